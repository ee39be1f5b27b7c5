"""Every exception the package raises or defines is in the one tree (``rolloutcore.errors``).

A static walk of ``src/rolloutcore`` (``ast``): each exception made
(``X(...)``, raised here or handed to a future or a waiting reader) or
raised by class (``raise X``), and each exception class defined, must derive
from ``RolloutCoreError``. Builtins are allowed only where a protocol
outside the package demands them, and each such place is listed below with
its reason; an entry that no longer matches anything fails too, so the
list cannot go stale. Re-raising a caught exception (``raise exc``) is not a
new exception and is not checked.
"""

from __future__ import annotations

import ast
import builtins
import functools
import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import rolloutcore.errors as errors
from helpers.srcast import parsed

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "rolloutcore"

_ENGINE_HALF = ("runs inside vLLM's engine process and follows its weight-transfer backend "
                "convention (ValueError for a bad init/update payload, RuntimeError out of order)")

#: (file under src/rolloutcore, class raised or defined) -> why a class outside the tree.
ALLOWED: dict[tuple[str, str], str] = {
    ("cli/argtypes.py", "argparse.ArgumentTypeError"): "argparse type functions",
    ("integrations/trl/rollout.py", "AttributeError"): "__getattr__ protocol (the stand-in "
                                                      "for TRL's vllm_generation)",
    ("__init__.py", "AttributeError"): "module __getattr__ protocol (lazy public names)",
    ("testing/__init__.py", "AttributeError"): "module __getattr__ protocol (lazy exports)",
    ("testing/conformance.py", "AssertionError"): "a conformance check reports a difference "
                                                  "as a test assertion (trio's check_* form)",
    ("testing/fake_vllm.py", "httpx.ConnectError"): "the fake's down fault: what a transport "
                                                    "raises for a refused connection",
    ("service/serve.py", "SystemExit"): "the signal handler ends the interpreter",
    ("service/control.py", "ValueError"): "pydantic validators signal with ValueError",
    ("service/control_sent.py", "ValueError"): "pydantic validators signal with ValueError",
    ("transports/gloo.py", "AttributeError"): "module __getattr__ protocol",
    ("transports/base.py", "NotImplementedError"): "abstract hook",
    ("core/vocab.py", "NotImplementedError"): "abstract hook",
    ("verification/probe.py", "NotImplementedError"): "abstract hook",
    ("transports/driver.py", "NotImplementedError"): "abstract hook",
    ("transports/cuda_ipc/engine.py", "NotImplementedError"): "abstract hook",
    ("transports/gloo.py", "ValueError"): _ENGINE_HALF,
    ("transports/gloo_policy.py", "ValueError"): _ENGINE_HALF,
    ("transports/gloo.py", "RuntimeError"): _ENGINE_HALF,
    ("transports/model_index.py", "ValueError"): _ENGINE_HALF,
    ("transports/rank_checksums.py", "ValueError"):
        "a malformed rank report: GlooTransport wraps it in TransferError",
    ("transports/cuda_ipc/engine.py", "ValueError"): _ENGINE_HALF,
    ("transports/cuda_ipc/engine.py", "RuntimeError"): _ENGINE_HALF,
    ("transports/cuda_ipc/kernels.py", "ValueError"): _ENGINE_HALF + " (worker-side kernels)",
    ("testing/models.py", "RuntimeError"): "a check on the tokenizers library's own output "
                                          "(a bug there, not a caller's error)",
    ("testing/vlm.py", "RuntimeError"): "a check on the tokenizers/processor libraries' own "
                                       "output (a bug there, not a caller's error)",
    ("service/proxy.py", "RuntimeError"): "an ASGI call before the lifespan started: a "
                                         "server wiring bug, not a request error",
    ("service/passthrough.py", "RuntimeError"): "an ASGI call before the lifespan started: a "
                                               "server wiring bug, not a request error",
    # Control flow inside one module: raised and caught there, never seen outside.
    ("control/outcomes.py", "StepAborted"): "control flow of the runner's update phases: "
                                            "raised inside them, caught by the runner",
    ("control/colocated.py", "StepAborted"): "raised inside the runner's update phases",
    ("control/runner.py", "StepAborted"): "raised inside the runner's update phases",
}


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    #: every node of ``tree`` (``ast.walk`` order), walked once for every check
    nodes: tuple[ast.AST, ...] = ()
    classes: dict[str, ast.ClassDef] = field(default_factory=dict)
    functions: set[str] = field(default_factory=set)
    names: dict[str, tuple[str, str]] = field(default_factory=dict)  # alias -> (module, name)
    modules: dict[str, str] = field(default_factory=dict)  # alias -> module


@functools.cache
def _mods() -> dict[str, _Module]:
    """Every module of the package, parsed (once, when a test first asks)."""
    mods: dict[str, _Module] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        tree, nodes = parsed(path)
        m = _Module(".".join(parts), path, tree, nodes)
        for node in m.nodes:
            if isinstance(node, ast.ClassDef):
                m.classes.setdefault(node.name, node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                m.functions.add(node.name)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    m.names[a.asname or a.name] = (node.module, a.name)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    m.modules[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0])
        mods[m.name] = m
    return mods


Ref = tuple[str, str, str]  # (kind, module, name): kind "src", "ext" or "builtin"


def _resolve(mod: str, name: str, depth: int = 0) -> Ref | None:
    m = _mods().get(mod)
    if m is None:
        return ("ext", mod, name)
    if name in m.classes:
        return ("src", mod, name)
    if name in m.names and depth < 10:
        src_mod, src_name = m.names[name]
        if src_mod in _mods():
            return _resolve(src_mod, src_name, depth + 1)
        return ("ext", src_mod, src_name)
    if name in m.functions:
        return None
    if hasattr(builtins, name):
        return ("builtin", "builtins", name)
    return None  # a variable: a re-raise


def _ref_of(mod: str, node: ast.expr) -> Ref | None:
    if isinstance(node, ast.Name):
        return _resolve(mod, node.id)
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        target = _mods()[mod].modules.get(node.value.id)
        if target is not None:
            return _resolve(target, node.attr) if target in _mods() else ("ext", target, node.attr)
    return None  # self.x, a call's result: not a class named here


def _is_exception(ref: Ref, seen: frozenset[Ref] = frozenset()) -> bool:
    kind, mod, name = ref
    if kind == "builtin":
        obj = getattr(builtins, name)
        return isinstance(obj, type) and issubclass(obj, BaseException)
    if kind == "ext":
        # Imported only when light: a base class from vLLM or torch is not worth
        # importing them for (and is no exception unless its name says so).
        if mod.split(".")[0] in sys.stdlib_module_names | {"httpx", "httptools"}:
            obj = getattr(importlib.import_module(mod), name, None)
            return isinstance(obj, type) and issubclass(obj, BaseException)
        return name.endswith(("Error", "Exception", "Exit", "Interrupt"))
    if ref in seen:
        return False
    return any(b is not None and _is_exception(b, seen | {ref})
               for b in _bases(ref))


def _bases(ref: Ref) -> list[Ref | None]:
    _, mod, name = ref
    return [_ref_of(mod, b) for b in _mods()[mod].classes[name].bases]


def _in_tree(ref: Ref, seen: frozenset[Ref] = frozenset()) -> bool:
    if ref == ("src", "rolloutcore.errors", "RolloutCoreError"):
        return True
    if ref[0] != "src" or ref in seen:
        return False
    return any(b is not None and _in_tree(b, seen | {ref}) for b in _bases(ref))


def _label(ref: Ref, node: ast.expr) -> str:
    return ast.unparse(node) if ref[0] == "ext" else ref[2]


def _violations() -> tuple[list[str], set[tuple[str, str]]]:
    bad: list[str] = []
    used: set[tuple[str, str]] = set()

    def check(m: _Module, ref: Ref | None, node: ast.expr, line: int, what: str) -> None:
        if ref is None or not _is_exception(ref) or _in_tree(ref):
            return
        key = (str(m.path.relative_to(PKG)), _label(ref, node))
        if key in ALLOWED:
            used.add(key)
        else:
            bad.append(f"{key[0]}:{line}: {what} {key[1]} is not a RolloutCoreError")

    for m in _mods().values():
        for node in m.nodes:
            if isinstance(node, ast.Raise) and isinstance(node.exc, (ast.Name, ast.Attribute)):
                check(m, _ref_of(m.name, node.exc), node.exc, node.lineno, "raises")
            elif isinstance(node, ast.Call):  # raised, or made to be raised elsewhere
                check(m, _ref_of(m.name, node.func), node.func, node.lineno, "makes")
            elif isinstance(node, ast.ClassDef):
                check(m, ("src", m.name, node.name), ast.Name(node.name), node.lineno,
                      "defines")
    return bad, used


def test_every_raised_or_defined_exception_is_in_the_tree() -> None:
    bad, used = _violations()
    assert bad == [], "\n".join(bad)
    stale = sorted(set(ALLOWED) - used)
    assert stale == [], f"allow-list entries that match nothing any more: {stale}"


def test_private_control_flow_exceptions_never_leave_their_module() -> None:
    for (rel, name), why in ALLOWED.items():
        if not why.startswith("private control flow"):
            continue
        text = (PKG / rel).read_text()
        tree = ast.parse(text)
        caught = [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)
                  and h.type is not None and name in ast.unparse(h.type)]
        assert caught, f"{rel}: {name} is raised but never caught there"
        assert name.startswith("_") and name not in getattr(
            importlib.import_module("rolloutcore." + rel.removesuffix(".py")
                                    .removesuffix("/__init__").replace("/", ".")),
            "__all__", ())


def test_the_walk_sees_what_it_checks() -> None:
    """The walk finds the tree's classes and a known raise, so an empty result means something."""
    assert _in_tree(("src", "rolloutcore.errors", "RequestRejected"))
    assert _in_tree(_resolve("rolloutcore.service.wire", "RequestTooLarge") or ("", "", ""))
    assert not _in_tree(("builtin", "builtins", "ValueError"))
    assert _is_exception(("ext", "argparse", "ArgumentTypeError"))
    # Re-exports are followed: the name means the class in errors.py.
    assert _resolve("rolloutcore.provenance.replay", "ReplayRefused") == (
        "src", "rolloutcore.errors", "ReplayRefused")


def test_the_tree_drawn_in_the_docstring_is_the_tree() -> None:
    doc = errors.__doc__ or ""
    drawn = {line.split("── ")[1].split()[0] for line in doc.splitlines() if "── " in line}
    classes = {n for n in errors.__all__
               if isinstance(getattr(errors, n), type)} - {"RolloutCoreError"}
    assert drawn == classes
    for line in doc.splitlines():
        if "── " not in line:
            continue
        name = line.split("── ")[1].split()[0]
        depth = line.index("── ") // 4
        # The nearest line above with a smaller depth is the parent.
        idx = doc.splitlines().index(line)
        parent = "RolloutCoreError"
        for above in reversed(doc.splitlines()[:idx]):
            if "── " in above and above.index("── ") // 4 < depth:
                parent = above.split("── ")[1].split()[0]
                break
        assert issubclass(getattr(errors, name), getattr(errors, parent)), (name, parent)
