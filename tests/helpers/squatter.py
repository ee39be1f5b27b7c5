"""A squatter: a local process that binds a port a launched engine was meant to have and
answers every request 200, printing each path and the engine key it was sent (issue 47)."""

import textwrap

SQUATTER = textwrap.dedent("""
    import http.server, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            print(self.path, self.headers.get("x-rolloutcore-engine-key"), flush=True)
            self.send_response(200); self.send_header("content-length", "2"); self.end_headers()
            self.wfile.write(b"{}")
        do_POST = do_GET
        def log_message(self, *a): pass
    srv = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H)
    print("listening", flush=True)
    srv.serve_forever()
""")
