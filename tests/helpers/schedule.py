"""The fast lane's schedule (``tests/conftest.py``'s loadfile scheduler): the files that
compute through Hugging Face's stack, run as one unit, and the heaviest files first.

Its own module, not ``conftest``: a test that imports ``conftest`` gets whichever
``conftest.py`` was imported last (``tests/engine/`` has one too).
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["HEAVIEST_FIRST", "HF_UNIT", "HF_USE", "hf_unit"]

HF_USE = re.compile(r"\b[Pp]eft|make_adapter|make_checkpoint|installed\(\"(transformers|trl)\"\)"
                     r"|^\s*(from|import) (transformers|trl)\b", re.M)
HF_UNIT = "tests/test_fleet_adapters.py"
HEAVIEST_FIRST = (
    HF_UNIT, "tests/test_layering.py", "tests/test_layering_fakes.py",
    "tests/test_errors_tree.py",
    "tests/test_service_schemathesis.py", "tests/test_lifecycle_stateful.py",
    "tests/test_service_control.py", "tests/test_trainer_protocol_fuzz.py",
    "tests/test_cli_demo.py",
)


def hf_unit(root: Path) -> frozenset[str]:
    """The test files (relative to ``root``, as xdist names them) run as the one unit."""
    return frozenset({f"tests/{p.name}" for p in (root / "tests").glob("test_*.py")
                      if HF_USE.search(p.read_text())})
