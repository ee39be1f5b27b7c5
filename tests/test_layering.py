"""The package's layering, checked from the source text alone.

Every module under ``src/`` is parsed with ``ast``; every import counts,
including those inside functions, under ``TYPE_CHECKING`` and through
``importlib.import_module("literal")``, because a lazy import is still a
dependency: it only fails later. Checked:

(a) no import cycle among modules;
(b) no import from a lower layer to a higher one (``RANKS``);
(c) the core (``rolloutcore.core`` and ``rolloutcore.errors``) imports the
    standard library only;
(d) no file over ``MAX_LINES`` lines unless ``ALLOWED_LARGE`` says why;
(e) no module but the route table (``engine.routes``) spells a vLLM route:
    a string or bytes literal equal to a path of the table (or that path
    with a query) is a violation anywhere else, except as the path of the
    gateway's own route list (a ``Route("/health", ...)`` declaration);
(f) no module outside the engine package (``rolloutcore.engine``) catches an
    httpx exception for itself (``except httpx.X`` or
    ``contextlib.suppress(httpx.X)``): it wraps its call in
    ``engine.errors.map_errors`` (or holds an ``engine.client`` client) and
    catches the tree's errors;
(g) the weight transports (``rolloutcore.transports``) import no HTTP client
    (``NO_HTTP_CLIENT``): they take a weight-sync client
    (``engine.weight_sync``) or call ``engine.errors.request``;
(i) ``control`` imports nothing from the engine package (vLLM code) but the
    modules ``CONTROL_ENGINE_LEFT`` names, each with its reason;
(j) one composition: only ``control.stack`` constructs a ``LifecycleRunner``;
(h) HTTP clients (``httpx.Client(`` / ``httpx.AsyncClient(``) are constructed
    only in ``engine.client`` (the sync and async twins), at most
    ``MAX_CLIENT_SITES`` times in ``src/``; everything else holds one of them.

The implicit import of a parent package (``import a.b`` runs ``a/__init__``)
is not an edge: otherwise every package that re-exports its modules would be
a cycle. ``rolloutcore/__init__`` (the public facade, which loads from every
layer) and ``rolloutcore/__main__`` are exempt.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from helpers.srcast import parsed

SRC = Path(__file__).resolve().parent.parent / "src"
ROOT = "rolloutcore"

#: An import may go to the same rank or a lower one, never higher.
RANKS: dict[str, int] = {
    "errors": 0,
    "core": 1,
    "transports": 2, "verification": 2, "engine": 2,
    "testing": 3,
    "control": 4, "provenance": 4,
    "session": 5, "service": 5, "fleet": 5,
    "cli": 6, "integrations": 6,
}
EXEMPT = frozenset({ROOT, f"{ROOT}.__main__"})
PURE = ("core", "errors")
#: What the pure layers never import: they decide, and never lock, wait, sleep or
#: do I/O (the shell in ``control.shell`` does all of that).
NOT_IN_PURE = frozenset({"threading", "asyncio", "socket", "subprocess", "time",
                         "concurrent", "multiprocessing", "selectors"})
MAX_LINES = 800

#: Files allowed over MAX_LINES, each with the reason it cannot be split.
ALLOWED_LARGE: dict[str, str] = {}

#: Today's violations, written down so that this test passes now and fails on
#: any new one. Other work of issue #15 removes them; an entry that no longer
#: occurs fails too ("fixed: remove it"), so the list stays exact. The lead
#: empties it at merge.
KNOWN_VIOLATIONS: frozenset[tuple[str, ...]] = frozenset()

#: The one module that spells vLLM's routes (issue 45).
ROUTE_TABLE = f"{ROOT}.engine.routes"
#: The package that maps httpx's exceptions into the tree (issue 45).
ENGINE = f"{ROOT}.engine"
#: What the weight transports never import (they talk to engines through the engine package).
NO_HTTP_CLIENT = frozenset({"httpx", "requests", "aiohttp", "urllib3"})
#: The one module that constructs HTTP clients (``httpx.Client`` / ``httpx.AsyncClient``).
CLIENTS = f"{ROOT}.engine.client"
#: How many HTTP client constructions ``src/`` may hold, all in ``CLIENTS`` (issue 45: <= 3).
MAX_CLIENT_SITES = 3
#: The one composition of the engine stack: the only module that constructs a runner.
WIRING = f"{ROOT}.control.stack"
#: ``control`` modules that still import the engine package (vLLM code), each with the
#: reason; issue 45 emptied it: the session that launches and drives vLLM is
#: ``rolloutcore.session`` (above control), the recoverers that restart and read it are
#: ``engine.recovery``. Any control module importing ``engine`` fails, and an entry that
#: no longer imports it fails too ("fixed: remove it").
CONTROL_ENGINE_LEFT: dict[str, str] = {}


# --------------------------------------------------------------------------- the graph

def _files() -> dict[str, Path]:
    """Module name -> file, for every module under src/."""
    out: dict[str, Path] = {}
    for path in sorted((SRC / ROOT).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


FILES = _files()


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    """Every node of the file's tree (``ast.walk`` order), parsed once per file and run:
    each check reads them all, and parsing and walking ~170 modules once per check
    was most of this file's time."""
    return parsed(path)[1]


def _package_of(module: str) -> str:
    """The package a module's relative imports are resolved against."""
    return module if FILES[module].name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the module, wherever it is."""
    for node in _nodes(FILES[module]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module).split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                yield (sub if sub in FILES else target), node.lineno
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
            if (name == "import_module" and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)):
                yield node.args[0].value, node.lineno


def _internal(target: str) -> str | None:
    """The known module an import of ``target`` lands on (longest known prefix)."""
    parts = target.split(".")
    while parts:
        name = ".".join(parts)
        if name in FILES:
            return name
        parts.pop()
    return None


def _layer(module: str) -> str:
    return module.split(".")[1]


def _graph(imports: dict[str, list[tuple[str, int]]]) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in FILES if m not in EXEMPT}
    for m in g:
        for target, _ in imports[m]:
            if target == ROOT or not target.startswith(ROOT + "."):
                continue
            t = _internal(target)
            if t is not None and t != m and t not in EXEMPT:
                g[m].add(t)
    return g


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(max(10_000, sys.getrecursionlimit()))

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def violations() -> dict[tuple[str, ...], str]:
    """Every violation of (a)-(d), each with a message saying where."""
    out: dict[tuple[str, ...], str] = {}
    imports = {m: list(_imports(m)) for m in FILES if m not in EXEMPT}  # one parse each
    g = _graph(imports)
    for comp in _cycles(g):
        edges = [f"{a} -> {b}" for a in comp for b in sorted(g[a]) if b in comp]
        out[("cycle", *comp)] = "import cycle: " + "; ".join(edges)
    for m in g:
        if _layer(m) not in RANKS:
            out[("unranked", m)] = f"{m}: layer {_layer(m)!r} has no rank in RANKS"
            continue
        for target, line in imports[m]:
            t = _internal(target) if target.startswith(ROOT + ".") else None
            if t is not None and t not in EXEMPT and t != m and _layer(t) in RANKS and (
                    RANKS[_layer(t)] > RANKS[_layer(m)]):
                out[("layer", m, t)] = (
                    f"{m} (line {line}, {_layer(m)}={RANKS[_layer(m)]}) imports {t} "
                    f"({_layer(t)}={RANKS[_layer(t)]}): a lower layer may not import a "
                    "higher one")
            top = target.split(".")[0]
            if _layer(m) == "transports" and top in NO_HTTP_CLIENT:
                out[("http-client", m, top)] = (
                    f"{m} (line {line}) imports {top}: a transport takes a weight-sync client "
                    "(engine.weight_sync) or calls engine.errors.request")
            if _layer(m) in PURE and top not in (ROOT, "__future__") and (
                    top not in sys.stdlib_module_names):
                out[("third-party", m, top)] = (
                    f"{m} (line {line}) imports {target}: the core is stdlib only")
            if _layer(m) in PURE and top in NOT_IN_PURE:
                out[("impure", m, top)] = (
                    f"{m} (line {line}) imports {target}: the core decides only (no "
                    "threads, clocks, sleeps or I/O; the shell in control.shell has them)")
    for m, line, path in _route_literals():
        out[("route", m, path)] = (
            f"{m} (line {line}) spells the vLLM route {path!r}: name it from "
            f"{ROUTE_TABLE} (Routes.*)")
    for m, line in _httpx_catches():
        out[("httpx-catch", m, str(line))] = (
            f"{m} (line {line}) catches an httpx exception for itself: wrap the call in "
            "engine.errors.map_errors and catch the tree's errors")
    for m, line, target in _control_engine_imports():
        if m not in CONTROL_ENGINE_LEFT:
            out[("control-engine", m, target)] = (
                f"{m} (line {line}) imports {target}: control knows no vLLM code (take a "
                "port or a capability from control.port instead)")
    for m, line in _calls_of("LifecycleRunner"):
        if m != WIRING:
            out[("wiring", m, str(line))] = (
                f"{m} (line {line}) builds a LifecycleRunner: call {WIRING}.wire, the one "
                "composition of the engine stack")
    for m, line in _client_constructions():
        if m != CLIENTS:
            out[("client-site", m, str(line))] = (
                f"{m} (line {line}) builds an HTTP client: hold an engine.client "
                "EngineClient / AsyncEngineClient instead")
    for path in FILES.values():
        n = len(path.read_text().splitlines())
        rel = path.relative_to(SRC).as_posix()
        if n > MAX_LINES and rel not in ALLOWED_LARGE:
            out[("size", rel)] = f"{rel}: {n} lines > {MAX_LINES} (split it or allow it)"
    return out


def _vllm_paths() -> frozenset[str]:
    from rolloutcore.engine.routes import TABLE

    return frozenset(TABLE)


def _route_literals() -> Iterator[tuple[str, int, str]]:
    """(module, line, path) for every vLLM route spelled outside the route table."""
    paths = _vllm_paths()
    for m, file in FILES.items():
        if m == ROUTE_TABLE:
            continue
        declared: set[int] = set()  # the gateway's own routes: Route("/path", ...)
        for node in _nodes(file):
            if isinstance(node, ast.Call) and node.args and getattr(
                    node.func, "id", getattr(node.func, "attr", None)) == "Route":
                declared.add(id(node.args[0]))
        for node in _nodes(file):
            if not isinstance(node, ast.Constant) or id(node) in declared:
                continue
            v = node.value
            text = v.decode("latin-1") if isinstance(v, bytes) else v
            if isinstance(text, str) and text.partition("?")[0] in paths:
                yield m, node.lineno, text


def _names_httpx(node: ast.expr | None) -> bool:
    return node is not None and any(
        isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "httpx"
        for n in ast.walk(node))


def _httpx_catches() -> Iterator[tuple[str, int]]:
    """(module, line) for every httpx exception caught outside the engine package."""
    for m, file in FILES.items():
        if m == ENGINE or m.startswith(ENGINE + "."):
            continue
        for node in _nodes(file):
            caught = (node.type if isinstance(node, ast.ExceptHandler) else ast.Tuple(
                node.args) if isinstance(node, ast.Call) and getattr(
                    node.func, "attr", getattr(node.func, "id", None)) == "suppress" else None)
            if _names_httpx(caught):
                yield m, node.lineno


# --------------------------------------------------------------------------- the tests

@pytest.fixture(scope="module")
def found() -> dict[tuple[str, ...], str]:
    """The package's violations, found once for the tests that read them."""
    return violations()


def test_no_new_violation(found: dict[tuple[str, ...], str]) -> None:
    new = [msg for key, msg in sorted(found.items()) if key not in KNOWN_VIOLATIONS]
    assert not new, "layering violations:\n  " + "\n  ".join(new)


def test_known_violations_still_occur(found: dict[tuple[str, ...], str]) -> None:
    """A fixed violation leaves the list, so the list never hides a new one."""
    stale = sorted(KNOWN_VIOLATIONS - found.keys())
    assert not stale, f"fixed (remove from KNOWN_VIOLATIONS): {stale}"


def _client_constructions() -> Iterator[tuple[str, int]]:
    """(module, line) for every ``httpx.Client(...)`` / ``httpx.AsyncClient(...)`` in src/."""
    for m, file in FILES.items():
        for node in _nodes(file):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("Client", "AsyncClient") and isinstance(
                        node.func.value, ast.Name) and node.func.value.id == "httpx":
                yield m, node.lineno


def _control_engine_imports() -> Iterator[tuple[str, int, str]]:
    """(control module, line, engine module) for every import of the engine package."""
    for m in FILES:
        if m not in EXEMPT and _layer(m) == "control":
            for target, line in _imports(m):
                if target == ENGINE or target.startswith(ENGINE + "."):
                    yield m, line, target


def _calls_of(name: str) -> Iterator[tuple[str, int]]:
    """(module, line) for every call ``name(...)`` or ``x.name(...)`` in src/."""
    for m, file in FILES.items():
        for node in _nodes(file):
            if isinstance(node, ast.Call) and getattr(
                    node.func, "id", getattr(node.func, "attr", None)) == name:
                yield m, node.lineno


def test_control_engine_imports_left_still_occur() -> None:
    """The list of control modules that still import vLLM code only shrinks."""
    still = {m for m, _, _ in _control_engine_imports()}
    stale = sorted(set(CONTROL_ENGINE_LEFT) - still)
    assert not stale, f"fixed (remove from CONTROL_ENGINE_LEFT): {stale}"


def test_one_wiring_function() -> None:
    sites = {m for m, _ in _calls_of("LifecycleRunner")}
    assert sites == {WIRING}, sites


def test_http_clients_are_built_in_the_engine_client_only() -> None:
    sites = list(_client_constructions())
    outside = [f"{m} (line {line})" for m, line in sites if m != CLIENTS]
    assert not outside, (f"HTTP clients built outside {CLIENTS}: hold an EngineClient / "
                         f"AsyncEngineClient instead: {outside}")
    assert 1 <= len(sites) <= MAX_CLIENT_SITES, sites


def test_allowed_large_files_exist_and_give_a_reason() -> None:
    for rel, reason in ALLOWED_LARGE.items():
        assert (SRC / rel).is_file(), rel
        assert len((SRC / rel).read_text().splitlines()) > MAX_LINES, (
            f"{rel} is no longer large: remove it from ALLOWED_LARGE")
        assert reason.strip(), rel


def test_every_layer_is_ranked() -> None:
    layers = {_layer(m) for m in FILES if m not in EXEMPT}
    assert layers <= RANKS.keys(), layers - RANKS.keys()


# --------------------------------------------------------------------------- the checker itself

def _with_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "FILES", _files())


def test_checker_sees_every_kind_of_import(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    """The checker catches what it claims to: lazy, TYPE_CHECKING and relative imports."""
    _with_files(monkeypatch, tmp_path, {
        "rolloutcore/__init__.py": "from rolloutcore.cli import main\n",
        "rolloutcore/errors.py": "",
        "rolloutcore/core/__init__.py": "",
        "rolloutcore/core/a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from rolloutcore.service import app\n"
            "def f():\n    import numpy\n    from . import b\n    import threading\n"),
        "rolloutcore/core/b.py": "from rolloutcore.core.a import f\n",
        "rolloutcore/service/__init__.py": "",
        "rolloutcore/service/app.py": (
            "import importlib\nm = importlib.import_module('rolloutcore.cli.x')\n"),
        "rolloutcore/cli/__init__.py": "",
        "rolloutcore/cli/x.py": "\n" * (MAX_LINES + 1),
        "rolloutcore/widgets/__init__.py": "",
        "rolloutcore/transports/__init__.py": "",
        "rolloutcore/transports/t.py": "def f():\n    import httpx\n",
        "rolloutcore/service/routes.py": (
            "PAUSE = '/pause?mode=wait'\nA = b'/abort_requests'\nMSG = '/pause failed'\n"
            "r = Route('/health', None)\n"
            "try:\n    pass\nexcept (httpx.HTTPError, OSError):\n    pass\n"
            "with contextlib.suppress(httpx.ConnectError):\n    pass\n"
            "c = httpx.AsyncClient(timeout=1)\n"
            "r = LifecycleRunner(c, None)\n"),
        "rolloutcore/control/__init__.py": "",
        "rolloutcore/control/x.py": "from rolloutcore.engine.http import VllmHTTP\n",
        "rolloutcore/engine/__init__.py": "",
        "rolloutcore/engine/http.py": "",
    })
    assert set(violations()) == {
        ("cycle", "rolloutcore.core.a", "rolloutcore.core.b"),
        ("layer", "rolloutcore.core.a", "rolloutcore.service.app"),
        ("third-party", "rolloutcore.core.a", "numpy"),
        ("impure", "rolloutcore.core.a", "threading"),
        ("layer", "rolloutcore.service.app", "rolloutcore.cli.x"),
        ("size", "rolloutcore/cli/x.py"),
        ("unranked", "rolloutcore.widgets"),
        ("route", "rolloutcore.service.routes", "/pause?mode=wait"),
        ("route", "rolloutcore.service.routes", "/abort_requests"),
        ("httpx-catch", "rolloutcore.service.routes", "7"),
        ("httpx-catch", "rolloutcore.service.routes", "9"),
        ("client-site", "rolloutcore.service.routes", "11"),
        ("wiring", "rolloutcore.service.routes", "12"),
        ("control-engine", "rolloutcore.control.x", "rolloutcore.engine.http"),
        ("http-client", "rolloutcore.transports.t", "httpx"),
    }


# --------------------------------------------------------------------------- fakes of vLLM

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


def _serves_vllm_route(node: ast.AST, paths: frozenset[str], *,
                       walk: Callable[[ast.AST], Iterator[ast.AST]] = ast.walk) -> bool:
    """Whether ``node`` builds an app answering a vLLM route: ``Route("/pause", ...)``
    (Starlette, or ``app.add_route``), a ``@app.post("/pause")`` handler, a handler table
    keyed by ``Routes.X``, or a raw ASGI app (``async def app(scope, receive, send)``)
    that names a vLLM path."""
    for n in walk(node):
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
    ASGI app defines ``(scope, receive, send)``, and a client's stand-in defines three of
    ``CLIENT_ROUTE_METHODS``."""
    return "Route" in text or "add_route" in text or "add_api_route" in text \
        or _ASGI_DEF.search(text) is not None or re.search(
        r"@\w[\w.]*\.(" + "|".join(_ROUTE_DECORATORS) + r")\(", text) is not None or len(
        {m for m in CLIENT_ROUTE_METHODS if re.search(rf"def\s+{m}\s*\(", text)}) >= 3


def _fakes_in(tree: ast.AST, paths: frozenset[str]) -> Iterator[str]:
    """The names of what in a module stands in for vLLM: a class (at any depth) that
    serves its routes or defines three of its client's methods; a function (outside a
    class) that builds an app serving its routes; ``<module>`` for module-level code
    that does."""
    for c in ast.walk(tree):
        if not isinstance(c, ast.ClassDef) or any(
                ast.unparse(b).endswith("Protocol") for b in c.bases):
            continue  # a Protocol states the client's shape; it serves nothing
        methods = {m.name for m in c.body
                   if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if _serves_vllm_route(c, paths) or len(methods & CLIENT_ROUTE_METHODS) >= 3:
            yield c.name
    for stmt in getattr(tree, "body", ()):
        if isinstance(stmt, ast.ClassDef):
            continue
        if _serves_vllm_route(stmt, paths, walk=_walk_outside_classes):
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
