"""The fast lane's schedule (``tests/conftest.py``): Hugging Face's stack is imported by
one worker only.

Checked from the source text: no test module imports PEFT, transformers or TRL when it
is collected (``pytest.importorskip`` or a top-level import: every worker collects every
module), and every module that uses them is in the one unit one worker runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers.needs import installed
from helpers.schedule import HF_UNIT, hf_unit

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("peft", "transformers", "trl")


def _collection_imports(tree: ast.Module) -> list[str]:
    """What a module imports at its top level (collection), of ``HEAVY``."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # runs when a test runs, not at collection
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] in HEAVY]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in HEAVY:
            out.append(str(node.module))
        for call in ast.walk(node):
            if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "importorskip" \
                    and call.args and isinstance(call.args[0], ast.Constant) \
                    and str(call.args[0].value).split(".")[0] in HEAVY:
                out.append(f"importorskip({call.args[0].value!r})")
    return out


def test_no_module_imports_the_hf_stack_at_collection() -> None:
    found = {p.name: hits for p in sorted((ROOT / "tests").glob("test_*.py"))
             if (hits := _collection_imports(ast.parse(p.read_text())))}
    assert found == {}, f"imported at collection (use helpers.needs.installed): {found}"


def test_every_module_that_uses_the_hf_stack_is_in_the_one_unit() -> None:
    unit = hf_unit(ROOT)
    assert HF_UNIT in unit and "tests/test_trl_lora_unit.py" in unit
    users = {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
             if any(f'installed("{m}")' in p.read_text() for m in HEAVY)}
    assert users and users <= unit, sorted(users - unit)
    assert "tests/test_lifecycle.py" not in unit   # nothing of the stack there


def test_the_detector_of_collection_imports_sees_each_form() -> None:
    for text in ("import peft\n", "from transformers import AutoModel\n",
                 "trl = pytest.importorskip('trl')\n", "pytest.importorskip('peft')\n"):
        assert _collection_imports(ast.parse(text)), text
    assert not _collection_imports(ast.parse("def f():\n    import peft\n"))
    assert not _collection_imports(ast.parse("def f():\n    pytest.importorskip('peft')\n"))


def test_installed_skips_without_importing(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.delitem(sys.modules, "json.tool", raising=False)
    installed("json.tool")          # found: no skip, and not imported
    assert "json.tool" not in sys.modules
    with pytest.raises(pytest.skip.Exception, match="no_such_package_x"):
        installed("no_such_package_x")
    with pytest.raises(ValueError):
        installed()
