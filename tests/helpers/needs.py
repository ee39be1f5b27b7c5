"""``installed("peft")``: skip the calling test module unless a package is installed,
without importing it.

``pytest.importorskip`` imports the package at collection, in every xdist worker, whether
or not that worker runs one of the module's tests: ``import peft`` takes transformers
and accelerate with it (~4 s of CPU on this 2-core host), paid at collection by both
workers of the fast lane while only one runs the PEFT files (``tests/conftest.py``'s
schedule keeps them on one). The tests import the package where they use it.
"""

from __future__ import annotations

import importlib.util

import pytest

__all__ = ["installed"]


def installed(*names: str) -> None:
    """Skip the module being collected unless every one of ``names`` can be imported
    (its top-level package is found); nothing is imported."""
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError("installed() takes one or more package names")
    missing = [n for n in names if importlib.util.find_spec(n.partition(".")[0]) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (not installed)", allow_module_level=True)
