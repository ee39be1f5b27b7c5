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

__all__ = [
    "int_in",
    "nonneg_float",
    "nonneg_int",
    "port",
    "positive_finite",
    "positive_float",
    "positive_int",
    "positive_seconds",
    "tolerance",
]


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {v}")
    return v


def nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def positive_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {s}")
    return v


def port(s: str) -> int:
    v = nonneg_int(s)
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535: {s}")
    return v


def tolerance(s: str) -> float:
    """Nats: a finite number >= 0."""
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"not a finite number >= 0: {s!r}")
    return v


def positive_seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        v = math.nan
    if not math.isfinite(v) or v <= 0:
        raise argparse.ArgumentTypeError(f"not a positive number of seconds: {s!r}")
    return v


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"must be in {lo}..{hi}")
        return v
    return parse


def positive_finite(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError("must be a positive number")
    return v
