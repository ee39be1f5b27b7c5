"""One fake of vLLM (issue 45), checked from the source text alone.

Every module under ``src/`` and ``tests/`` is read for what stands in for vLLM: a class
or function that serves vLLM's routes (a Starlette ``Route``, ``add_route``, a route
decorator, a raw ASGI app, a handler table keyed by ``Routes.X``), a handler of requests
(an httpx ``MockTransport``'s) that answers by the request's path, or a stand-in for its
client (three of ``CLIENT_ROUTE_METHODS``). The one found must be ``ONE_FAKE``; the
gateway's own route lists (``GATEWAY_ROUTES``) serve vLLM-shaped routes and are no fake.
Its own file beside ``test_layering.py``, whose parse of each file it shares.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterator

from test_layering import SRC, _nodes, _vllm_paths

TESTS = SRC.parent / "tests"
#: The one fake of vLLM (#45): ``FakeEngine``'s state behind an httpx mock transport, and
#: over a real socket as an ASGI app. Every test that needs vLLM's routes without a real
#: engine uses it; a second fake is a failure, not an entry in a list.
ONE_FAKE = ("src/rolloutcore/testing/fake_vllm.py", "FakeVllm")
#: The methods of ``VllmHTTP`` that each name a vLLM route: a class defining three of
#: them outside the client stands in for it.
CLIENT_ROUTE_METHODS = frozenset({
    "generate", "models", "model", "version", "server_info", "weight_info",
    "weight_checksums", "load_lora_adapter", "unload_lora_adapter", "top_logprobs",
    "is_paused", "is_sleeping", "wake_up", "set_weight_version"})
#: Servers of vLLM-shaped routes that are not fakes: the gateway's own route lists, and
#: its relay of vLLM's own RL routes under ``/rc/<token>`` (an ASGI app naming them).
GATEWAY_ROUTES = frozenset({"src/rolloutcore/service/app.py",
                            "src/rolloutcore/fleet/gateway.py",
                            "src/rolloutcore/service/native.py"})


#: Paths only the gateway answers (its control routes, its relay of vLLM's RL routes): a
#: handler answering them stands in for the gateway, not for vLLM.
GATEWAY_PATHS = ("/control/", "/rc/")
#: Calls that declare a route of an app: Starlette's ``Route``/``app.add_route``.
_ROUTE_CALLS = frozenset({"Route", "WebSocketRoute", "add_route", "add_api_route"})
#: Decorators that declare one: ``@app.route``, FastAPI's ``@app.post`` and the rest.
_ROUTE_DECORATORS = frozenset({"route", "api_route", "get", "post", "put", "delete",
                               "patch", "websocket"})


def _is_vllm_path(node: ast.AST, paths: frozenset[str]) -> bool:
    """``"/pause"`` or ``Routes.PAUSE``: a path of vLLM's route table."""
    if isinstance(node, ast.Constant):
        return node.value in paths
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
            and node.value.id == "Routes":
        from rolloutcore.engine.routes import Routes

        return getattr(Routes, node.attr, None) in paths
    return False


def _is_asgi_app(fn: ast.AST) -> bool:
    """``async def app(scope, receive, send)`` (or a method of that shape): a raw ASGI app."""
    if not isinstance(fn, ast.AsyncFunctionDef):
        return False
    names = [a.arg for a in fn.args.args]
    return names[-3:] == ["scope", "receive", "send"] and len(names) <= 4


def _walk_outside_classes(node: ast.AST) -> Iterator[ast.AST]:
    """``ast.walk`` that does not enter a class (a class is judged as one)."""
    todo = [node]
    while todo:
        n = todo.pop()
        yield n
        todo.extend(c for c in ast.iter_child_nodes(n) if not isinstance(c, ast.ClassDef))


def _holds_vllm_path(node: ast.AST | None, paths: frozenset[str]) -> bool:
    """A vLLM path, or a literal tuple/list/set/dict (its keys) holding one."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_holds_vllm_path(e, paths) for e in node.elts)
    if isinstance(node, ast.Dict):
        return any(_holds_vllm_path(k, paths) for k in node.keys)
    return node is not None and _is_vllm_path(node, paths)


def _name_of(node: ast.AST) -> str | None:
    """``x`` for a name, ``self.x`` for an attribute of one: what an assignment binds."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def _path_tables(tree: ast.AST, paths: frozenset[str]) -> frozenset[str]:
    """Names (``ROUTES``, ``self.table``) bound anywhere in ``tree`` to a literal holding a
    vLLM path: a handler looking its request's path up in one answers by vLLM's routes."""
    out: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.Assign, ast.AnnAssign)) and _holds_vllm_path(n.value, paths):
            for t in n.targets if isinstance(n, ast.Assign) else [n.target]:
                if (name := _name_of(t)) is not None:
                    out.add(name)
    return frozenset(out)


def _answers_by_request_path(fn: ast.AST, paths: frozenset[str],
                             tables: frozenset[str]) -> bool:
    """A function or lambda handed a request (an httpx ``MockTransport`` handler, a
    ``__call__``) that answers it (returns a value) by its path: ``request.url.path`` (or
    a name bound to it) compared with a vLLM path (``==``, ``in (...)``,
    ``match``/``case``) or looked up in a table of them (``table[path]``,
    ``table.get(path)``, ``path in table``). One that also answers the gateway's own
    paths (``GATEWAY_PATHS``) stands in for the gateway, which relays vLLM's generation
    routes under their paths; one that returns nothing (a hook watching requests)
    answers none."""
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        return False
    params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args]} - {"self", "cls"}
    answers = [fn.body] if isinstance(fn, ast.Lambda) else [
        n.value for n in ast.walk(fn) if isinstance(n, ast.Return)]
    if not params or not any(v is not None and not (
            isinstance(v, ast.Constant) and v.value is None) for v in answers):
        return False

    def is_path(e: ast.AST) -> bool:  # request.url.path, or a name bound to it
        return (isinstance(e, ast.Attribute) and e.attr == "path"
                and isinstance(e.value, ast.Attribute) and e.value.attr == "url"
                and isinstance(e.value.value, ast.Name) and e.value.value.id in params) \
            or (isinstance(e, ast.Name) and e.id in bound)

    def is_table(e: ast.AST) -> bool:
        return _holds_vllm_path(e, paths) or _name_of(e) in tables

    def is_gateway(e: ast.AST) -> bool:
        return isinstance(e, ast.Constant) and isinstance(e.value, str) \
            and e.value.startswith(GATEWAY_PATHS)

    bound: set[str] = set()
    for n in ast.walk(fn):  # path = request.url.path; path, x = request.url.path, ...
        if isinstance(n, ast.Assign):
            for t in n.targets:
                pairs = zip(t.elts, n.value.elts, strict=False) if isinstance(
                    t, ast.Tuple) and isinstance(n.value, ast.Tuple) else [(t, n.value)]
                bound.update(x.id for x, v in pairs if isinstance(x, ast.Name) and is_path(v))
    vllm = gateway = False
    for n in ast.walk(fn):
        if isinstance(n, ast.Compare) and any(is_path(x) for x in [n.left, *n.comparators]):
            vllm |= any(is_table(x) for x in [n.left, *n.comparators])
            gateway |= any(is_gateway(x) for x in [n.left, *n.comparators])
        elif isinstance(n, ast.Match) and is_path(n.subject):
            values = [p.value for c in n.cases for p in ast.walk(c.pattern)
                      if isinstance(p, ast.MatchValue)]
            vllm |= any(_is_vllm_path(v, paths) for v in values)
            gateway |= any(is_gateway(v) for v in values)
        elif isinstance(n, ast.Subscript) and is_path(n.slice):
            vllm |= is_table(n.value)
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
                and n.func.attr == "get" and n.args and is_path(n.args[0]):
            vllm |= is_table(n.func.value)
    return vllm and not gateway


def _serves_vllm_route(node: ast.AST, paths: frozenset[str], *,
                       walk: Callable[[ast.AST], Iterator[ast.AST]] = ast.walk,
                       tables: frozenset[str] | None = None) -> bool:
    """Whether ``node`` builds an app answering a vLLM route: ``Route("/pause", ...)``
    (Starlette, or ``app.add_route``), a ``@app.post("/pause")`` handler, a handler table
    keyed by ``Routes.X``, a raw ASGI app (``async def app(scope, receive, send)``)
    that names a vLLM path, or a handler of requests (an httpx ``MockTransport``'s)
    answering by their path (``_answers_by_request_path``; ``tables``: the module's
    names bound to literals of vLLM paths, ``_path_tables``)."""
    tables = _path_tables(node, paths) if tables is None else tables
    for n in walk(node):
        if _answers_by_request_path(n, paths, tables):
            return True
        if isinstance(n, ast.Call) and n.args and getattr(
                n.func, "id", getattr(n.func, "attr", None)) in _ROUTE_CALLS \
                and _is_vllm_path(n.args[0], paths):
            return True
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                and d.func.attr in _ROUTE_DECORATORS and d.args
                and _is_vllm_path(d.args[0], paths) for d in n.decorator_list):
            return True
        if _is_asgi_app(n) and any(_is_vllm_path(x, paths) for x in ast.walk(n)):
            return True
        if isinstance(n, ast.Dict) and any(
                isinstance(k, ast.Tuple) and any(isinstance(e, ast.Attribute) and isinstance(
                    e.value, ast.Name) and e.value.id == "Routes" for e in k.elts)
                for k in n.keys):
            return True
    return False


_ASGI_DEF = re.compile(r"def\s+\w+\s*\(\s*(self\s*,\s*)?scope\b")


def _may_hold_a_fake(text: str) -> bool:
    """False only for a file in which nothing can pass the checks of ``fakes_of_vllm``:
    every route declaration names ``Route``, ``Routes`` or ``add_route`` or is a decorator
    (``@app.post(``), a raw
    ASGI app defines ``(scope, receive, send)``, a handler of requests reads their
    ``.url.path``, and a client's stand-in defines three of ``CLIENT_ROUTE_METHODS``."""
    return "Route" in text or "add_route" in text or "add_api_route" in text \
        or ".url.path" in text \
        or _ASGI_DEF.search(text) is not None or re.search(
        r"@\w[\w.]*\.(" + "|".join(_ROUTE_DECORATORS) + r")\(", text) is not None or len(
        {m for m in CLIENT_ROUTE_METHODS if re.search(rf"def\s+{m}\s*\(", text)}) >= 3


def _fakes_in(tree: ast.AST, paths: frozenset[str]) -> Iterator[str]:
    """The names of what in a module stands in for vLLM: a class (at any depth) that
    serves its routes or defines three of its client's methods; a function (outside a
    class) that builds an app serving its routes; ``<module>`` for module-level code
    that does."""
    tables = _path_tables(tree, paths)
    for c in ast.walk(tree):
        if not isinstance(c, ast.ClassDef) or any(
                ast.unparse(b).endswith("Protocol") for b in c.bases):
            continue  # a Protocol states the client's shape; it serves nothing
        methods = {m.name for m in c.body
                   if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if _serves_vllm_route(c, paths, tables=tables) \
                or len(methods & CLIENT_ROUTE_METHODS) >= 3:
            yield c.name
    for stmt in getattr(tree, "body", ()):
        if isinstance(stmt, ast.ClassDef):
            continue
        if _serves_vllm_route(stmt, paths, walk=_walk_outside_classes, tables=tables):
            yield stmt.name if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                else "<module>"


def fakes_of_vllm() -> set[tuple[str, str]]:
    """Everything in src/ and tests/ that serves vLLM's routes or stands in for its
    client (``_fakes_in``)."""
    paths = _vllm_paths()
    out: set[tuple[str, str]] = set()
    for f in sorted([*SRC.rglob("*.py"), *TESTS.rglob("*.py")]):
        rel = str(f.relative_to(SRC.parent))
        if rel in GATEWAY_ROUTES or rel == "src/rolloutcore/engine/http.py":
            continue
        if not _may_hold_a_fake(f.read_text()):
            continue  # nothing in it can match below: not parsed
        out.update((rel, name) for name in _fakes_in(_nodes(f)[0], paths))
    return out


def test_one_fake_of_vllm() -> None:
    found = fakes_of_vllm()
    assert ONE_FAKE in found, f"the one fake is not found: {sorted(found)}"
    others = sorted(found - {ONE_FAKE})
    assert not others, f"a second fake of vLLM (use rolloutcore.testing.fake_vllm): {others}"
    assert len(found) == 1


def test_the_fake_detector_sees_both_seams() -> None:
    paths = _vllm_paths()
    server = ast.parse("class S:\n    def __init__(self):\n"
                       "        self.app = Starlette(routes=[Route('/pause', self.p)])\n")
    table = ast.parse("class T:\n    def __init__(self):\n"
                      "        self.r = {('POST', Routes.PAUSE): self.p}\n")
    plain = ast.parse("class P:\n    def __init__(self):\n"
                      "        self.app = Starlette(routes=[Route('/mine', self.p)])\n")
    assert _serves_vllm_route(server, paths) and _serves_vllm_route(table, paths)
    assert not _serves_vllm_route(plain, paths)


def test_the_text_filter_keeps_every_file_the_detector_could_match() -> None:
    """``_may_hold_a_fake`` skips a file unparsed: it never skips one that holds a fake."""
    client = ("class C:\n    def generate(self): ...\n    async def models(self): ...\n"
              "    def version (self): ...\n")
    assert _may_hold_a_fake(client) and _may_hold_a_fake("x = Routes.PAUSE\n")
    assert _may_hold_a_fake("app = Starlette(routes=[Route('/pause', p)])\n")
    assert not _may_hold_a_fake("class C:\n    def generate(self): ...\n"
                                "    def models(self): ...\n")


def test_the_fake_detector_sees_function_built_apps() -> None:
    """An app built by a function (or at module level) that answers a vLLM route is a
    fake as much as a class is: Starlette's ``Route``, ``add_route``, a decorator, a raw
    ASGI app; inside a test function too. One answering only its own paths is not."""
    paths = _vllm_paths()
    built = {
        "starlette": "def _sse_app(served):\n    async def generate(request): ...\n"
                     "    return Starlette(routes=[Route('/inference/v1/generate', generate,"
                     " methods=['POST'])])\n",
        "inline": "def test_x():\n    async def world_size(request): ...\n"
                  "    app = Starlette(routes=[Route('/get_world_size', world_size)])\n",
        "table name": "def make():\n    return Starlette(routes=[Route(Routes.VERSION, f)])\n",
        "add_route": "def make(app):\n    app.add_route('/pause', f, methods=['POST'])\n",
        "decorator": "def make(app):\n    @app.post('/resume')\n    async def r(): ...\n",
        "asgi": "def make():\n    async def app(scope, receive, send):\n"
                "        if scope['path'] == '/is_paused': ...\n    return app\n",
        "module": "app = Starlette(routes=[Route('/v1/models', models)])\n",
    }
    for kind, text in built.items():
        assert _may_hold_a_fake(text), kind
        name = "<module>" if kind == "module" else text.split("(")[0][4:]
        assert list(_fakes_in(ast.parse(text), paths)) == [name], kind
    # Not a fake: an app of its own paths, a client calling vLLM's, a class judged once.
    for text in ("def make():\n    return Starlette(routes=[Route('/mine', f)])\n",
                 "def test_y(client):\n    client.post('/pause')\n"
                 "    assert seen == ['/get_world_size']\n",
                 "async def app(scope, receive, send):\n    await send(scope['path'])\n"):
        assert list(_fakes_in(ast.parse(text), paths)) == [], text
    nested = "def test_z():\n    class S:\n        app = Starlette(routes=[Route('/pause', p)])\n"
    assert list(_fakes_in(ast.parse(nested), paths)) == ["S"]


def test_the_fake_detector_sees_handlers_answering_by_the_requests_path() -> None:
    """A handler of requests (an httpx ``MockTransport``'s, a ``__call__``, a lambda) that
    answers by the request's path is a fake of vLLM: ``if``/``match`` on
    ``request.url.path`` (or a name bound to it) against a vLLM path, or a lookup of it in
    a table of vLLM paths (a literal, or a name bound to one anywhere in the module).
    Not a fake: a client
    calling vLLM's routes, a hook that only watches requests, a handler of the gateway's
    own paths (it relays vLLM's generation routes), a table of vLLM's paths that no
    handler reads by a request's path (the gateway's route lists)."""
    paths = _vllm_paths()
    fakes = {
        "if": ("class E:\n    def __call__(self, req):\n        path = req.url.path\n"
               "        if path == Routes.PAUSE:\n            return httpx.Response(200)\n"
               "        return httpx.Response(404)\n", ["E"]),
        "literal": ("def make():\n    def handler(request):\n"
                    "        if request.url.path == '/is_paused':\n"
                    "            return ok\n    return httpx.MockTransport(handler)\n",
                    ["make"]),
        "in": ("def h(r):\n    return ok if r.url.path in ('/pause', '/resume') else no\n",
               ["h"]),
        "tuple bound": ("def h(r):\n    p, new = r.url.path, 1\n"
                        "    assert p != '/v1/models'\n    return ok\n", ["h"]),
        "match": ("def h(r):\n    match r.url.path:\n        case Routes.HEALTH:\n"
                  "            return ok\n    return no\n", ["h"]),
        "table": ("ANSWERS = {'/version': v, Routes.MODELS: m}\n"
                  "def h(r):\n    return ANSWERS[r.url.path](r)\n", ["h"]),
        "self table": ("class T:\n    def __init__(self):\n"
                       "        self.ok = {Routes.RESET_MM: True}\n"
                       "    def __call__(self, r):\n"
                       "        return self.ok.get(r.url.path)\n", ["T"]),
        "lambda": ("def test_l():\n    t = httpx.MockTransport(lambda r: no\n"
                   "        if r.url.path == Routes.SLEEP else ok)\n", ["test_l"]),
        "in a test": ("def test_x():\n    def handler(req):\n"
                      "        assert req.url.path == '/collective_rpc'\n"
                      "        return ok\n    run(handler)\n", ["test_x"]),
    }
    for kind, (text, names) in fakes.items():
        assert _may_hold_a_fake(text), kind
        assert list(_fakes_in(ast.parse(text), paths)) == names, kind
    not_fakes = (
        # a client calling vLLM's routes, and reading its answer's request
        "def pause(c):\n    r = c.post(Routes.PAUSE)\n"
        "    return r.request.url.path == Routes.PAUSE\n",
        # a hook watching requests (FakeVllm.before): it answers none
        "def before(req):\n    if req.url.path != Routes.GENERATE:\n        return\n"
        "    seen.append(req)\n",
        # a fake of the gateway: its control routes, its relay of vLLM's generate
        "def handler(req):\n    path = req.url.path\n"
        "    if path == '/control/status':\n        return st\n"
        "    if path == '/inference/v1/generate':\n        return gen\n    return no\n",
        # the gateway's route table, read by no handler of a request's path
        "NATIVE = {Routes.HEALTH: 'GET', Routes.PAUSE: 'POST'}\n"
        "def methods(path):\n    return NATIVE[path]\n",
        # a handler answering paths of its own
        "def h(r):\n    return ok if r.url.path == '/ok' else no\n",
        # a handler answering every path alike, and one handed no request
        "def h(r):\n    return httpx.Response(200, json={'ok': True})\n",
        "def h():\n    p = x.url.path\n    return p == '/pause'\n",
    )
    for text in not_fakes:
        assert list(_fakes_in(ast.parse(text), paths)) == [], text
