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
import sys
from collections.abc import Iterator
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
