"""Strict checks for typed records built from JSON: one set, shared.

The trajectory schema (``provenance.trajectory``), the engine identity and
the binding (``core.versions``) all parse JSON objects the same strict way:
an unknown key is an error (a silently dropped field would change a record's
digest on rewrite), JSON-like values are deep-frozen so a record cannot be
changed after it was validated. Errors name the field path (``where``).

Standard library only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from rolloutcore.errors import BadInput

__all__ = ["HEX64", "check_int", "check_obj", "check_str", "check_timeout", "exact_keys", "fail",
           "freeze_json", "thaw_json"]


#: A sha256 digest as hex: every content digest, checksum and identity digest.
HEX64 = re.compile(r"^[0-9a-f]{64}$")


def fail(where: str, msg: str) -> BadInput:
    return BadInput(f"{where}: {msg}")


def check_str(where: str, x: object) -> str:
    if not isinstance(x, str) or not x:
        raise fail(where, f"must be a non-empty string, got {x!r}")
    return x


def check_int(name: str, v: object, lo: int = 0, hi: int | None = None) -> int:
    """``v`` if it is an int (a bool is not) in ``lo..hi``; else ``BadInput`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        raise BadInput(f"{name} must be an int " + (f">= {lo}" if hi is None else f"in {lo}..{hi}")
                       + f", got {v!r}")
    return v


def check_timeout(v: object, name: str = "timeout_s") -> float:
    """A positive, finite number of seconds, else ``BadInput`` naming ``name``."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise BadInput(f"{name} must be a positive number of seconds, got {v!r}")
    return float(v)


def check_obj(where: str, d: object) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise fail(where, f"must be a JSON object, got {type(d).__name__}")
    return d


def exact_keys(where: str, d: Mapping[str, Any], required: Iterable[str],
               optional: Iterable[str] = (), note: str = "") -> None:
    req, opt = set(required), set(optional)
    missing = sorted(req - d.keys())
    unknown = sorted(d.keys() - req - opt)
    if missing:
        raise fail(where, f"missing keys {missing}")
    if unknown:
        raise fail(where, f"unknown keys {unknown}" + (f" ({note})" if note else ""))


def freeze_json(where: str, x: object) -> Any:
    """A deep read-only copy of a JSON value; rejects what JSON cannot hold exactly."""
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return x
    if isinstance(x, float):
        if not math.isfinite(x):
            raise fail(where, f"non-finite number {x!r} is not JSON")
        return x
    if isinstance(x, Mapping):
        out: dict[str, Any] = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise fail(where, f"object keys must be strings, got {k!r}")
            out[k] = freeze_json(f"{where}.{k}", v)
        return MappingProxyType(out)
    if isinstance(x, (list, tuple)):
        return tuple(freeze_json(f"{where}[{i}]", v) for i, v in enumerate(x))
    raise fail(where, f"{type(x).__name__} is not a JSON value")


def thaw_json(x: object) -> Any:
    if isinstance(x, Mapping):
        return {k: thaw_json(v) for k, v in x.items()}
    if isinstance(x, tuple):
        return [thaw_json(v) for v in x]
    return x
