"""Argument types of the subcommands: a bad value is a usage error (exit 2), never a traceback.

argparse turns an ``ArgumentTypeError`` into ``rolloutcore X: error: ...``
and status 2 before anything runs, which is the CLI's "bad input, nothing
changed" answer; the library functions behind it check again for callers
that do not come through here.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "int_in",
    "nonneg_float",
    "nonneg_int",
    "port",
    "positive_float",
    "positive_int",
    "positive_seconds",
    "tolerance",
]


N = TypeVar("N", int, float)


def _bounded(cast: Callable[[str], N], noun: str, ok: Callable[[N], bool],
             want: str) -> Callable[[str], N]:
    """A parser of ``cast``: a value ``cast`` refuses is "not {noun}", one
    outside ``ok`` (NaN included: every test on it is false) is ``want``."""
    def parse(s: str) -> N:
        try:
            v = cast(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {s!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"{want}: {s}")
        return v
    return parse


positive_int = _bounded(int, "an integer", lambda v: v > 0, "must be positive")
nonneg_int = _bounded(int, "an integer", lambda v: v >= 0, "must be >= 0")
port = _bounded(int, "an integer", lambda v: 0 < v < 65536, "port must be in 1..65535")
nonneg_float = _bounded(float, "a number", lambda v: v >= 0, "must be >= 0")
#: A positive finite number (``inf`` and ``nan`` refused).
positive_float = _bounded(float, "a number", lambda v: 0 < v < math.inf,
                          "must be a positive number")
#: Nats: a finite number >= 0.
tolerance = _bounded(float, "a number", lambda v: 0 <= v < math.inf,
                     "not a finite number >= 0")
positive_seconds = _bounded(float, "a number", lambda v: 0 < v < math.inf,
                            "not a positive number of seconds")


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    return _bounded(int, "an integer", lambda v: lo <= v <= hi, f"must be in {lo}..{hi}")
