"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` (tests only).

Put ``tests/data/fakevllm`` first on a launched engine's ``PYTHONPATH``: the
``ManagedEngine`` then starts this instead of vLLM, in its own session as it
would vLLM. It sleeps ``FAKEVLLM_IMPORT_S`` (vLLM's seconds of imports, when a
squatter can take the port), binds ``--host:--port`` (dying with "Address
already in use" as vLLM does when it cannot) and answers ``/health``,
``/version`` and ``/openapi.json`` as vLLM 0.32 would for a launch's checks.
"""

import argparse
import http.server
import json
import os
import sys
import time

ROUTES = ["/health", "/version", "/pause", "/resume", "/start_weight_update",
          "/update_weights", "/finish_weight_update", "/reset_prefix_cache"]


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = {"/health": {}, "/version": {"version": "0.32.0"},
                "/openapi.json": {"paths": {r: {} for r in ROUTES}}}.get(self.path)
        data = json.dumps(body if body is not None else {"error": "no"}).encode()
        self.send_response(200 if body is not None else 404)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    args, _ = ap.parse_known_args()
    time.sleep(float(os.environ.get("FAKEVLLM_IMPORT_S", "0")))
    try:
        srv = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as exc:
        print(f"ERROR: [Errno 98] error while attempting to bind: {exc}", flush=True)
        sys.exit(1)
    print(f"fake vLLM listening on {args.host}:{args.port} pid {os.getpid()}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
