"""Test parts that ship with the package (layer 3), for fast tests and the demo.

``FakeVllm`` (``fake_vllm``: the one fake of vLLM, the in-process ``FakeEngine``
behind an httpx mock transport, handed to a client as ``transport=``) and
``conformance`` (the checks the fake and a real vLLM both pass); ``fake``
(the simulated engine and its lifecycle adapter), ``faultproxy`` (fault
injection between a client and a real engine), ``models`` (tiny offline
checkpoints vLLM loads). The exports load on first use: the demo imports
this package with nothing installed (no httpx).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["FakeVllm", "conformance"]


def __getattr__(name: str) -> Any:
    if name == "FakeVllm":
        return importlib.import_module(f"{__name__}.fake_vllm").FakeVllm
    if name == "conformance":
        return importlib.import_module(f"{__name__}.conformance")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
