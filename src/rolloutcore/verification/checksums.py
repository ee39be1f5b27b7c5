"""Engine-checksum verification: the ``engine-checksum`` verification level.

vLLM's ``/weight_checker {"action": "checksum"}`` hashes every parameter *as
the engine holds it*: after fusing (``qkv_proj``, ``gate_up_proj``), sharding
(one entry per rank, keyed ``dp0:pp0:pcp0:tp0:<name>``), casting to the
serving dtype and, on some backends, repacking. None of that can be
reproduced from the checkpoint's tensors on the trainer side, so a reference
is only meaningful when it was taken **the same way**: from an engine
cold-loaded on the same checkpoint by vLLM's own loader, under the same
*layout* (vLLM version, dtype, quantization, device, parallel sizes, load
format). This module

* takes such references (``reference_checksums``: start a cold engine on the
  checkpoint, read its checksums, stop it) and keeps them in a
  ``ChecksumCache`` on disk, keyed by the checkpoint's content digest
  (``WeightSource.content_digest()``) and the layout, so that a reference
  costs one cold start per checkpoint and layout, ever; a reference can also
  be recorded from an engine whose load was verified otherwise
  (``ReferenceChecksums.take(..., origin="verified-load")``);
* compares an engine's checksums with a reference key by key (``verify``),
  and turns the result into a ``Check`` at ``VerificationLevel.ENGINE_CHECKSUM``.

Rules the comparison keeps:

* **Only keys present on both sides are compared**, and the keys present on
  one side only are counted and listed (``missing_in_engine``,
  ``missing_in_reference``); any of them fails the check, because a
  parameter nobody compared is not verified.
* **A zero-byte hash verifies nothing.** The CPU backend hashes its repacked
  linear layers to ``sha256(b"")``; such parameters are *unverifiable*
  (on either side) and never count as matches. ``coverage`` is the fraction
  of the engine's parameters whose content was actually compared, and it is
  stated in every check, so "engine-checksum" never claims more than it saw.
* **Keys are compared raw** (rank prefix included) when both sides have rank
  prefixes: with tensor parallelism each rank holds, and hashes, its own
  shard of a parameter. A reference keyed by bare names is accepted only
  when the engine's names are unique (one rank).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

from rolloutcore.adapters.vllm import EMPTY_SHA256, VllmHTTP, WeightChecksums
from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EffectError, JournalError

__all__ = [
    "LAYOUT_FIELDS",
    "REFERENCE_FORMAT",
    "ChecksumCache",
    "ChecksumReport",
    "ReferenceChecksums",
    "engine_layout",
    "layout_digest",
    "reference_checksums",
    "verify",
    "verify_engine",
]

REFERENCE_FORMAT = "rolloutcore-checksum-reference"
_FORMAT_VERSION = 1
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RANK_PREFIX = re.compile(r"^((?:[a-z]+\d+:)+)(.+)$")
_ORIGINS = frozenset({"cold-load", "verified-load"})

#: The engine facts that decide which bytes ``/weight_checker`` hashes, and
#: where ``engine_layout`` reads them in ``/server_info``'s ``vllm_config``.
LAYOUT_FIELDS: Mapping[str, tuple[str, str]] = MappingProxyType({
    "dtype": ("model_config", "dtype"),
    "quantization": ("model_config", "quantization"),
    "model_impl": ("model_config", "model_impl"),
    "device": ("device_config", "device"),
    "load_format": ("load_config", "load_format"),
    "tensor_parallel_size": ("parallel_config", "tensor_parallel_size"),
    "pipeline_parallel_size": ("parallel_config", "pipeline_parallel_size"),
    "prefill_context_parallel_size": ("parallel_config", "prefill_context_parallel_size"),
    "data_parallel_size": ("parallel_config", "data_parallel_size"),
    "enable_expert_parallel": ("parallel_config", "enable_expert_parallel"),
})


# --------------------------------------------------------------------------- layout


def engine_layout(http: VllmHTTP, *, timeout_s: float | None = None) -> dict[str, Any]:
    """The layout of the engine behind ``http``: ``LAYOUT_FIELDS`` + ``vllm_version``.

    A field the engine does not report is recorded as ``None``: two engines
    that both lack it still compare equal on it, which is the best that can
    be said.
    """
    if not isinstance(http, VllmHTTP):
        raise BadInput("http must be a VllmHTTP")
    info = http.server_info(timeout_s=timeout_s)
    cfg = info.get("vllm_config")
    if not isinstance(cfg, Mapping):
        raise EffectError("server_info", "no vllm_config in /server_info: engine layout "
                          "unknown", mutation_started=False)
    out: dict[str, Any] = {"vllm_version": http.version(timeout_s=timeout_s)}
    for key, (section, name) in LAYOUT_FIELDS.items():
        sec = cfg.get(section)
        v = sec.get(name) if isinstance(sec, Mapping) else None
        out[key] = v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
    return out


def _check_layout(layout: object) -> dict[str, Any]:
    if not isinstance(layout, Mapping) or not all(isinstance(k, str) for k in layout):
        raise BadInput("layout must be a mapping with string keys")
    for k, v in layout.items():
        if v is not None and not isinstance(v, (str, int, float, bool)):
            raise BadInput(f"layout[{k!r}] must be a JSON scalar, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise BadInput(f"layout[{k!r}] must be finite")
    return dict(layout)


def layout_digest(layout: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of a layout: part of a reference's cache key."""
    blob = json.dumps(_check_layout(layout), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _layout_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


# --------------------------------------------------------------------------- references


def _check_digests(where: str, m: object) -> dict[str, str]:
    if not isinstance(m, Mapping) or not m:
        raise BadInput(f"{where} must be a non-empty mapping of parameter key to sha256")
    out: dict[str, str] = {}
    for k, v in m.items():
        if not isinstance(k, str) or not k:
            raise BadInput(f"{where}: keys must be non-empty strings, got {k!r}")
        if not isinstance(v, str) or not _HEX64.match(v.lower()):
            raise BadInput(f"{where}[{k!r}] is not a sha256 hex digest: {v!r}")
        out[k] = v.lower()
    return out


def _raw_map(cs: WeightChecksums) -> dict[str, str]:
    return {cs.raw_keys.get(n, n): d for n, d in cs.digests.items()}


@dataclass(frozen=True)
class ReferenceChecksums:
    """``/weight_checker`` checksums of one checkpoint, taken from an engine that loaded it.

    ``checksums`` are keyed by the engine's raw keys (``dp0:pp0:pcp0:tp0:<name>``).
    ``origin`` says how the engine got the weights: ``cold-load`` (vLLM's
    loader read the checkpoint at start) or ``verified-load`` (an update
    whose result was verified otherwise, e.g. by the policy probe).
    """

    content_digest: str
    layout: Mapping[str, Any]
    checksums: Mapping[str, str]
    origin: str = "cold-load"
    source: str = ""
    taken_wall: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        if not isinstance(self.content_digest, str) or not _HEX64.match(self.content_digest):
            raise BadInput("content_digest must be a sha256 hex digest")
        object.__setattr__(self, "layout", MappingProxyType(_check_layout(self.layout)))
        object.__setattr__(self, "checksums",
                           MappingProxyType(_check_digests("checksums", self.checksums)))
        if self.origin not in _ORIGINS:
            raise BadInput(f"origin must be one of {sorted(_ORIGINS)}, got {self.origin!r}")
        if not isinstance(self.source, str):
            raise BadInput("source must be a string")
        if isinstance(self.taken_wall, bool) or not isinstance(self.taken_wall, (int, float)) \
                or not math.isfinite(self.taken_wall):
            raise BadInput("taken_wall must be a finite number")

    @classmethod
    def take(cls, http: VllmHTTP, content_digest: str, *, origin: str = "cold-load",
             source: str = "", timeout_s: float | None = None) -> ReferenceChecksums:
        """Read the checksums and layout of the engine behind ``http`` now.

        The caller vouches that the engine holds the checkpoint whose content
        digest is ``content_digest`` (``origin`` says why).
        """
        cs = http.weight_checksums(timeout_s=timeout_s)
        return cls(content_digest, engine_layout(http, timeout_s=timeout_s), _raw_map(cs),
                   origin, source or http.base_url)

    @property
    def layout_digest(self) -> str:
        return layout_digest(self.layout)

    @property
    def unverifiable(self) -> frozenset[str]:
        """Keys the reference engine hashed as zero bytes."""
        return frozenset(k for k, d in self.checksums.items() if d == EMPTY_SHA256)

    @property
    def coverage(self) -> float:
        return 1.0 - len(self.unverifiable) / len(self.checksums)

    def by_name(self) -> dict[str, str]:
        """Checksums keyed by bare parameter name (one rank only), as the adapter compares."""
        out: dict[str, str] = {}
        for k, d in self.checksums.items():
            name = _split(k)[1]
            if name in out:
                raise BadInput(f"parameter {name!r} appears on several ranks: compare raw keys")
            out[name] = d
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"format": REFERENCE_FORMAT, "format_version": _FORMAT_VERSION,
                "content_digest": self.content_digest, "layout": dict(self.layout),
                "layout_digest": self.layout_digest, "origin": self.origin,
                "source": self.source, "taken_wall": self.taken_wall,
                "checksums": dict(sorted(self.checksums.items()))}

    @classmethod
    def from_dict(cls, d: object) -> ReferenceChecksums:
        if not isinstance(d, Mapping) or d.get("format") != REFERENCE_FORMAT:
            raise BadInput(f"not a {REFERENCE_FORMAT} document")
        if d.get("format_version") != _FORMAT_VERSION:
            raise BadInput(f"{REFERENCE_FORMAT} format_version {d.get('format_version')!r} "
                           f"is not supported (this reader knows {_FORMAT_VERSION})")
        try:
            ref = cls(d["content_digest"], d["layout"], d["checksums"], d["origin"],
                      d["source"], d["taken_wall"])
        except KeyError as exc:
            raise BadInput(f"{REFERENCE_FORMAT} document lacks {exc}") from exc
        if d.get("layout_digest") != ref.layout_digest:
            raise BadInput("reference layout_digest does not match its layout")
        return ref


class ChecksumCache:
    """References on disk: ``<root>/<content digest>/<layout digest>.json``.

    Files are written atomically (temp file, fsync, rename); a file that
    does not parse, or whose content does not match its name, raises
    ``JournalError`` instead of being treated as a miss, because a silently
    replaced reference would make any engine "verified".
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise BadInput(f"cache root must be a path, got {root!r}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise BadInput(f"checksum cache {str(self.root)!r} is not a directory")

    def path_for(self, content_digest: str, layout: Mapping[str, Any]) -> Path:
        if not isinstance(content_digest, str) or not _HEX64.match(content_digest):
            raise BadInput("content_digest must be a sha256 hex digest")
        return self.root / content_digest / f"{layout_digest(layout)}.json"

    def get(self, content_digest: str, layout: Mapping[str, Any]) -> ReferenceChecksums | None:
        p = self.path_for(content_digest, layout)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise JournalError(f"cannot read checksum reference {str(p)!r}: {exc}") from exc
        try:
            ref = ReferenceChecksums.from_dict(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:  # BadInput is a ValueError
            raise JournalError(f"checksum reference {str(p)!r} is unreadable: {exc}") from exc
        if ref.content_digest != content_digest or ref.layout_digest != layout_digest(layout):
            raise JournalError(f"checksum reference {str(p)!r} does not hold the reference "
                               "its name says (content or layout digest differs)")
        return ref

    def put(self, ref: ReferenceChecksums) -> Path:
        if not isinstance(ref, ReferenceChecksums):
            raise BadInput("put takes a ReferenceChecksums")
        p = self.path_for(ref.content_digest, ref.layout)
        data = json.dumps(ref.to_dict(), sort_keys=True, indent=1).encode() + b"\n"
        tmp: str | None = None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
            tmp = None
        except OSError as exc:
            raise JournalError(f"cannot write checksum reference {str(p)!r}: {exc}") from exc
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        return p

    def references(self, content_digest: str) -> list[ReferenceChecksums]:
        """Every cached reference of one checkpoint, whatever its layout."""
        d = self.path_for(content_digest, {}).parent
        if not d.is_dir():
            return []
        out = []
        for p in sorted(d.glob("*.json")):
            try:
                layout = json.loads(p.read_bytes())["layout"]
                ref = self.get(content_digest, layout)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise JournalError(f"checksum reference {str(p)!r} is unreadable: "
                                   f"{exc!r}") from exc
            if ref is None:
                raise JournalError(f"checksum reference {str(p)!r} is not stored under its "
                                   "own layout digest")
            out.append(ref)
        return out


class _Engine(Protocol):
    """What ``reference_checksums`` needs of a started engine (``ManagedEngine`` has it)."""

    @property
    def base_url(self) -> str: ...

    def stop(self) -> None: ...


def _default_launch(model_dir: Path, layout: Mapping[str, Any] | None) -> _Engine:
    from rolloutcore.adapters.vllm.process import ManagedEngine

    kw: dict[str, Any] = {"backend": None}
    dtype = None if layout is None else layout.get("dtype")
    if isinstance(dtype, str):
        kw["dtype"] = dtype.removeprefix("torch.")
    return ManagedEngine(model_dir, **kw).start()


def reference_checksums(model_dir: str | os.PathLike[str], *,
                        cache: ChecksumCache | str | os.PathLike[str] | None = None,
                        layout: Mapping[str, Any] | None = None,
                        launch: Callable[[Path], _Engine] | None = None,
                        timeout_s: float = 60.0) -> ReferenceChecksums:
    """The reference checksums of the checkpoint in ``model_dir``, cold-loaded by vLLM.

    ``layout`` is the layout of the engine the reference is for (normally
    ``engine_layout(http)`` of the engine to verify). With a ``cache`` and a
    ``layout``, a cached reference for (content digest, layout) is returned
    without starting anything. Otherwise ``launch(model_dir)`` (default: a
    ``ManagedEngine`` with no transfer backend, in the layout's dtype) starts
    a cold engine, its checksums are read, it is stopped, and the reference
    is cached. ``BadInput`` when the cold engine's layout is not ``layout``
    (the reference is cached under its own layout all the same), or when the
    checkpoint changed while the engine loaded it (nothing cached).
    """
    from rolloutcore.transports.source import WeightSource

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise BadInput(f"{d} is not a model directory (no config.json)")
    if layout is not None:
        layout = _check_layout(layout)
    store = cache if isinstance(cache, ChecksumCache) or cache is None else ChecksumCache(cache)
    digest = WeightSource.from_checkpoint(d).content_digest()
    if store is not None and layout is not None:
        hit = store.get(digest, layout)
        if hit is not None:
            return hit
    eng = launch(d) if launch is not None else _default_launch(d, layout)
    try:
        with VllmHTTP(eng.base_url, timeout_s=timeout_s) as http:
            ref = ReferenceChecksums.take(http, digest, origin="cold-load", source=str(d))
    finally:
        eng.stop()
    if WeightSource.from_checkpoint(d).content_digest() != digest:
        raise BadInput(f"checkpoint {d} changed while the reference engine loaded it; "
                       "nothing cached")
    if store is not None:
        store.put(ref)
    if layout is not None and ref.layout_digest != layout_digest(layout):
        raise BadInput("the cold-loaded engine's layout differs from the requested one ("
                       + "; ".join(_layout_diff(ref.layout, layout))
                       + "): start it like the engine to verify (pass launch=...)")
    return ref


# --------------------------------------------------------------------------- comparison


def _split(key: str) -> tuple[str, str]:
    """``"dp0:pp0:pcp0:tp0:model.x"`` -> ``("dp0:pp0:pcp0:tp0:", "model.x")``."""
    m = _RANK_PREFIX.match(key)
    return ("", key) if m is None else (m.group(1), m.group(2))


def _by_name(where: str, m: Mapping[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in m.items():
        name = _split(k)[1]
        if name in out:
            raise BadInput(f"{where}: parameter {name!r} appears on several ranks; a "
                           "reference keyed by bare names cannot be compared with it")
        out[name] = v
    return out


def _show(keys: tuple[str, ...], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" ... (+{len(keys) - n})" if len(keys) > n else "")


@dataclass(frozen=True)
class ChecksumReport:
    """An engine's checksums against a reference, key by key.

    ``coverage`` = compared / engine parameters: the fraction whose content
    was actually compared. ``hashable`` counts the engine parameters with a
    non-empty hash. Keys are raw (``dp0:...:<name>``) when ``keyed_by`` is
    ``raw``, bare parameter names when it is ``name``.
    """

    keyed_by: str
    engine_params: int
    reference_params: int
    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unverifiable: tuple[str, ...]              # engine hashed zero bytes
    unverifiable_reference: tuple[str, ...]    # only the reference hashed zero bytes
    missing_in_engine: tuple[str, ...]         # reference keys the engine lacks
    missing_in_reference: tuple[str, ...]      # engine keys the reference lacks
    layout_mismatch: tuple[str, ...] = ()

    @property
    def compared(self) -> int:
        return len(self.matched) + len(self.mismatched)

    @property
    def hashable(self) -> int:
        return self.engine_params - len(self.unverifiable)

    @property
    def coverage(self) -> float:
        return 0.0 if self.engine_params == 0 else self.compared / self.engine_params

    @property
    def passed(self) -> bool:
        return (self.compared > 0 and not self.mismatched and not self.missing_in_engine
                and not self.missing_in_reference and not self.layout_mismatch)

    def detail(self) -> str:
        parts = [f"{len(self.matched)}/{self.engine_params} engine parameters matched "
                 f"(coverage {self.coverage:.3f}); {len(self.unverifiable)} unverifiable "
                 "(zero-byte hash)"]
        if self.unverifiable_reference:
            parts.append(f"{len(self.unverifiable_reference)} unverifiable in the reference")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} MISMATCHED: {_show(self.mismatched)}")
        if self.missing_in_engine:
            parts.append(f"{len(self.missing_in_engine)} missing in engine: "
                         f"{_show(self.missing_in_engine)}")
        if self.missing_in_reference:
            parts.append(f"{len(self.missing_in_reference)} without reference: "
                         f"{_show(self.missing_in_reference)}")
        if self.layout_mismatch:
            parts.append("reference taken under another layout: "
                         + "; ".join(self.layout_mismatch))
        if self.compared == 0:
            parts.append("nothing compared")
        return "; ".join(parts)

    def to_check(self, name: str = "engine_checksum") -> Check:
        """The check at ``ENGINE_CHECKSUM`` level, with its coverage."""
        return Check(name=name, passed=self.passed, detail=self.detail(),
                     coverage=self.coverage, level=VerificationLevel.ENGINE_CHECKSUM)

    def to_dict(self) -> dict[str, Any]:
        return {"keyed_by": self.keyed_by, "passed": self.passed,
                "engine_params": self.engine_params,
                "reference_params": self.reference_params, "hashable": self.hashable,
                "compared": self.compared, "coverage": self.coverage,
                "matched": list(self.matched), "mismatched": list(self.mismatched),
                "unverifiable": list(self.unverifiable),
                "unverifiable_reference": list(self.unverifiable_reference),
                "missing_in_engine": list(self.missing_in_engine),
                "missing_in_reference": list(self.missing_in_reference),
                "layout_mismatch": list(self.layout_mismatch)}


def verify(engine: WeightChecksums | Mapping[str, str],
           reference: ReferenceChecksums | Mapping[str, str]) -> ChecksumReport:
    """Compare engine checksums with a reference, key by key.

    ``engine`` is what ``VllmHTTP.weight_checksums()`` returns (or a raw
    ``/weight_checker`` mapping); ``reference`` a ``ReferenceChecksums`` or a
    mapping keyed by raw keys or bare names. Raw keys are compared when both
    sides carry rank prefixes, bare names otherwise.
    """
    eng = _raw_map(engine) if isinstance(engine, WeightChecksums) else \
        _check_digests("engine checksums", engine)
    ref = dict(reference.checksums) if isinstance(reference, ReferenceChecksums) else \
        _check_digests("reference checksums", reference)
    if not eng:
        raise BadInput("engine checksums are empty")
    raw = all(_split(k)[0] for k in eng) and all(_split(k)[0] for k in ref)
    if not raw:
        eng, ref = _by_name("engine checksums", eng), _by_name("reference checksums", ref)
    matched, mismatched, unv, unv_ref = [], [], [], []
    for k in sorted(eng.keys() & ref.keys()):
        e, r = eng[k], ref[k]
        if e == EMPTY_SHA256:
            unv.append(k)
        elif r == EMPTY_SHA256:
            unv_ref.append(k)
        elif e == r:
            matched.append(k)
        else:
            mismatched.append(k)
    # An engine key without a reference that hashes to zero bytes is still unverifiable.
    only_engine = sorted(eng.keys() - ref.keys())
    unv += [k for k in only_engine if eng[k] == EMPTY_SHA256]
    return ChecksumReport("raw" if raw else "name", len(eng), len(ref), tuple(matched),
                          tuple(mismatched), tuple(sorted(unv)), tuple(unv_ref),
                          tuple(sorted(ref.keys() - eng.keys())),
                          tuple(k for k in only_engine if eng[k] != EMPTY_SHA256))


def verify_engine(http: VllmHTTP, reference: ReferenceChecksums, *,
                  timeout_s: float | None = None) -> ChecksumReport:
    """``verify`` of the engine behind ``http`` now, with the layouts compared as well."""
    if not isinstance(reference, ReferenceChecksums):
        raise BadInput("reference must be a ReferenceChecksums")
    report = verify(http.weight_checksums(timeout_s=timeout_s), reference)
    diff = _layout_diff(reference.layout, engine_layout(http, timeout_s=timeout_s))
    return dataclasses.replace(report, layout_mismatch=tuple(diff)) if diff else report
