"""Engine checksums: the one comparison, and the reference document it compares with.

Every comparison of checksums in RolloutCore goes through ``compare``: vLLM's
``/weight_checker`` sha256 digests against a reference (``verify``, and the
adapter's ``compare_checksums`` view of it), and the block checksums of the
``rc_cuda_ipc`` and NCCL paths (integers, one per tensor). It keeps one set
of rules:

* **A value that verifies nothing never counts as a match**: ``None`` (the
  side could not hash that tensor) or the sha256 of zero bytes
  (``EMPTY_SHA256``: the CPU backend hashes its repacked linear layers so).
  Such keys are *unverifiable* (``unverifiable`` on the engine side,
  ``unverifiable_reference`` when only the reference has it).
* **Keys present on one side only are counted and listed**
  (``missing_in_engine``, ``missing_in_reference``), and fail ``passed``: a
  parameter nobody compared is not verified.
* **Coverage is stated**: the fraction of the engine's keys whose content was
  actually compared. ``passed`` accepts partial coverage (the CPU engine
  cannot hash its fused layers); ``complete`` is the stricter "every key
  compared and equal" the block checksums require.

The reference for vLLM's digests is only meaningful when it was taken **the
same way** as the engine holds its weights (fused, sharded, cast, repacked):
from an engine cold-loaded on the same checkpoint by vLLM's own loader,
under the same *layout* (vLLM version, dtype, quantization, device, parallel
sizes, load format). ``ReferenceChecksums`` is that document; taking one,
caching it and reading engines are effects and live in
``rolloutcore.engine.verify``. This module does no I/O.

Keys of vLLM's digests are compared raw (rank prefix included,
``dp0:pp0:pcp0:tp0:<name>``) when both sides have rank prefixes: with tensor
parallelism each rank holds, and hashes, its own shard of a parameter. A
reference keyed by bare names is accepted only when the engine's names are
unique (one rank).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeGuard

from rolloutcore.core.evidence import Check
from rolloutcore.core.strict import HEX64  # re-exported
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput

__all__ = [
    "EMPTY_SHA256",
    "HEX64",
    "LAYOUT_FIELDS",
    "REFERENCE_FORMAT",
    "ChecksumComparison",
    "ChecksumReport",
    "NamedChecksums",
    "ReferenceChecksums",
    "WeightChecksums",
    "check_layout",
    "compare",
    "compare_checksums",
    "compare_lists",
    "layout_diff",
    "layout_digest",
    "raw_checksums",
    "strip_rank",
    "unverifiable_value",
    "verify",
]

#: sha256 of zero bytes: what ``/weight_checker`` reports for a parameter it could
#: not read (the CPU backend's repacked linear layers). It verifies nothing.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
REFERENCE_FORMAT = "rolloutcore-checksum-reference"
_FORMAT_VERSION = 1
_RANK_PREFIX = re.compile(r"^(?:[a-z]+\d+:)+")
_ORIGINS = frozenset({"cold-load", "verified-load"})

#: The engine facts that decide which bytes ``/weight_checker`` hashes, and
#: where ``engine.verify.engine_layout`` reads them in ``/server_info``'s
#: ``vllm_config``.
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


# --------------------------------------------------------------------------- keys


def strip_rank(key: str) -> str:
    """``"dp0:pp0:pcp0:tp0:model.x.weight"`` -> ``"model.x.weight"``."""
    return _RANK_PREFIX.sub("", key, count=1)


def _split(key: str) -> tuple[str, str]:
    """``"dp0:pp0:pcp0:tp0:model.x"`` -> ``("dp0:pp0:pcp0:tp0:", "model.x")``."""
    m = _RANK_PREFIX.match(key)
    if m is None or m.end() == len(key):
        return "", key
    return key[:m.end()], key[m.end():]


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


# --------------------------------------------------------------------------- the comparison


def unverifiable_value(v: object) -> bool:
    """Whether a checksum value verifies nothing: absent (``None``) or the zero-byte hash."""
    return v is None or v == EMPTY_SHA256


@dataclass(frozen=True)
class ChecksumReport:
    """An engine's checksums against a reference, key by key (what ``compare`` returns).

    ``coverage`` = compared / engine parameters: the fraction whose content
    was actually compared. ``hashable`` counts the engine parameters whose
    value verifies something. ``keyed_by``: ``raw`` (``dp0:...:<name>``),
    ``name`` (bare parameter names) or ``position`` (``compare_lists``).
    """

    keyed_by: str
    engine_params: int
    reference_params: int
    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unverifiable: tuple[str, ...]              # the engine's value verifies nothing
    unverifiable_reference: tuple[str, ...]    # only the reference's value verifies nothing
    missing_in_engine: tuple[str, ...]         # reference keys the engine lacks
    missing_in_reference: tuple[str, ...]      # engine keys the reference lacks
    #: why the two sides are not comparable at all (reference under another
    #: engine layout, tensors in another order): fails ``passed``
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
    def complete(self) -> bool:
        """Every key on both sides compared, and equal: what a block checksum requires."""
        return (self.compared > 0 and self.compared == self.engine_params
                and self.reference_params == self.engine_params and not self.mismatched
                and not self.layout_mismatch)

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
            parts.append("not comparable, layout differs: " + "; ".join(self.layout_mismatch))
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


def compare(engine: Mapping[str, Hashable], reference: Mapping[str, Hashable], *,
            keyed_by: str = "raw",
            unverifiable: Callable[[object], bool] = unverifiable_value) -> ChecksumReport:
    """The one comparison of checksums, key by key (the module's rules).

    Keys must already be in one key space (callers align them: rank
    prefixes, bare names, layout positions). Values are compared with
    ``==`` (sha256 hex digests, block-checksum integers). The result lists
    keys in ``engine``'s order, then ``reference``'s for keys the engine
    lacks: pass sorted mappings for sorted results. Validating the values
    is the caller's: this function only classifies.
    """
    matched: list[str] = []
    mismatched: list[str] = []
    unv: list[str] = []
    unv_ref: list[str] = []
    only_engine: list[str] = []
    for k, e in engine.items():
        if k not in reference:
            # An engine key without a reference that verifies nothing is still
            # unverifiable, not missing.
            (unv if unverifiable(e) else only_engine).append(k)
            continue
        r = reference[k]
        if unverifiable(e):
            unv.append(k)
        elif unverifiable(r):
            unv_ref.append(k)
        elif e == r:
            matched.append(k)
        else:
            mismatched.append(k)
    only_ref = tuple(k for k in reference if k not in engine)
    return ChecksumReport(keyed_by, len(engine), len(reference), tuple(matched),
                          tuple(mismatched), tuple(unv), tuple(unv_ref), only_ref,
                          tuple(only_engine))


def compare_lists(engine_names: Sequence[str], engine: Sequence[Hashable],
                  reference_names: Sequence[str],
                  reference: Sequence[Hashable]) -> ChecksumReport:
    """``compare`` of two per-tensor lists (block checksums: ``None`` = not hashed).

    A block checksum depends on where each block sits, so the two lists are
    comparable only over the same names in the same order; otherwise the
    report has ``layout_mismatch`` set and nothing compared.
    """
    for what, names, vals in (("engine", engine_names, engine),
                              ("reference", reference_names, reference)):
        if len(names) != len(vals):
            raise BadInput(f"{what}: {len(names)} names but {len(vals)} values")
        if len(set(names)) != len(names):
            raise BadInput(f"{what}: duplicate tensor names")
    if list(engine_names) != list(reference_names):
        return ChecksumReport(
            "position", len(engine_names), len(reference_names), (), (), (), (), (), (),
            layout_mismatch=("tensor names or order differ from the reference's",))
    return compare(dict(zip(engine_names, engine, strict=True)),
                   dict(zip(reference_names, reference, strict=True)), keyed_by="position")


# --------------------------------------------------------------------------- vLLM's digests


class NamedChecksums(Protocol):
    """``/weight_checker`` digests as the vLLM client parses them (``WeightChecksums``)."""

    @property
    def digests(self) -> Mapping[str, str]: ...

    @property
    def raw_keys(self) -> Mapping[str, str]: ...


@dataclass(frozen=True)
class WeightChecksums:
    """``/weight_checker`` checksums keyed by parameter name, rank prefix stripped.

    ``raw_keys`` maps each name back to the engine's key
    (``dp0:pp0:pcp0:tp0:<name>``). With several ranks a name can repeat, so
    such names keep their full key.
    """

    digests: Mapping[str, str]
    raw_keys: Mapping[str, str]

    @property
    def total(self) -> int:
        return len(self.digests)

    @property
    def unverifiable(self) -> frozenset[str]:
        """Parameters the engine hashed as zero bytes: their content cannot be checked."""
        return frozenset(n for n, d in self.digests.items() if d == EMPTY_SHA256)

    @property
    def hashable(self) -> frozenset[str]:
        return frozenset(n for n, d in self.digests.items() if d != EMPTY_SHA256)

    @property
    def coverage(self) -> float:
        """Fraction of parameters whose content the engine could hash at all."""
        return 0.0 if not self.digests else len(self.hashable) / len(self.digests)


def raw_checksums(cs: NamedChecksums) -> dict[str, str]:
    """The engine's digests keyed by its raw keys again (``dp0:...:<name>``)."""
    return {cs.raw_keys.get(n, n): d for n, d in cs.digests.items()}


def checksum_map(where: str, m: object) -> dict[str, str]:
    """``m`` copied, or ``BadInput``: checksums must be a non-empty mapping of str to str."""
    if not isinstance(m, Mapping) or not m or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in m.items()):
        raise BadInput(f"{where} must be a non-empty mapping of str to str")
    return dict(m)


def _check_digests(where: str, m: object) -> dict[str, str]:
    if not isinstance(m, Mapping) or not m:
        raise BadInput(f"{where} must be a non-empty mapping of parameter key to sha256")
    out: dict[str, str] = {}
    for k, v in m.items():
        if not isinstance(k, str) or not k:
            raise BadInput(f"{where}: keys must be non-empty strings, got {k!r}")
        if not isinstance(v, str) or not HEX64.fullmatch(v.lower()):
            raise BadInput(f"{where}[{k!r}] is not a sha256 hex digest: {v!r}")
        out[k] = v.lower()
    return out


def _named(m: object) -> TypeGuard[NamedChecksums]:
    return not isinstance(m, Mapping) and isinstance(getattr(m, "digests", None), Mapping) \
        and isinstance(getattr(m, "raw_keys", None), Mapping)


def verify(engine: NamedChecksums | Mapping[str, str],
           reference: ReferenceChecksums | Mapping[str, str]) -> ChecksumReport:
    """Compare engine checksums with a reference, key by key.

    ``engine`` is what ``VllmHTTP.weight_checksums()`` returns (or a raw
    ``/weight_checker`` mapping); ``reference`` a ``ReferenceChecksums`` or a
    mapping keyed by raw keys or bare names. Raw keys are compared when both
    sides carry rank prefixes, bare names otherwise. Results are sorted.
    """
    eng = raw_checksums(engine) if _named(engine) else \
        _check_digests("engine checksums", engine)
    ref = dict(reference.checksums) if isinstance(reference, ReferenceChecksums) else \
        _check_digests("reference checksums", reference)
    if not eng:
        raise BadInput("engine checksums are empty")
    raw = all(_split(k)[0] for k in eng) and all(_split(k)[0] for k in ref)
    if not raw:
        eng, ref = _by_name("engine checksums", eng), _by_name("reference checksums", ref)
    return compare(dict(sorted(eng.items())), dict(sorted(ref.items())),
                   keyed_by="raw" if raw else "name")


@dataclass(frozen=True)
class ChecksumComparison:
    """The adapter's view of ``compare``: engine names against a reference map.

    Unverifiable never counts as matched. A reference that hashed zero bytes
    where the engine hashed content counts as a mismatch here (the reference
    was not taken the way the engine holds the weights); engine parameters
    without a reference are listed but do not fail.
    """

    total: int
    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unverifiable: tuple[str, ...]
    no_reference: tuple[str, ...]
    missing_in_engine: tuple[str, ...]

    @property
    def compared(self) -> int:
        return len(self.matched) + len(self.mismatched)

    @property
    def coverage(self) -> float:
        """Fraction of the engine's parameters whose content was actually compared."""
        return 0.0 if self.total == 0 else self.compared / self.total

    @property
    def passed(self) -> bool:
        return not self.mismatched and not self.missing_in_engine and self.compared > 0

    def detail(self) -> str:
        parts = [f"{len(self.matched)}/{self.total} matched",
                 f"{len(self.unverifiable)} unverifiable (zero-byte hash)"]
        if self.no_reference:
            parts.append(f"{len(self.no_reference)} without reference")
        if self.mismatched:
            parts.append("MISMATCH: " + ", ".join(self.mismatched[:8])
                         + (" ..." if len(self.mismatched) > 8 else ""))
        if self.missing_in_engine:
            parts.append("missing in engine: " + ", ".join(self.missing_in_engine[:8]))
        if self.compared == 0:
            parts.append("nothing compared")
        return "; ".join(parts)

    def to_check(self, name: str = "engine_checksum") -> Check:
        return Check(name=name, passed=self.passed, detail=self.detail(),
                     coverage=self.coverage, level=VerificationLevel.ENGINE_CHECKSUM)


def compare_checksums(engine: NamedChecksums, reference: Mapping[str, str]
                      ) -> ChecksumComparison:
    """Compare engine checksums with a reference keyed by parameter name (or raw key).

    A parameter the engine hashed as zero bytes is unverifiable whatever the
    reference says; a reference entry the engine does not have is a failure.
    """
    if not isinstance(reference, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reference.items()):
        raise BadInput("reference checksums must be a mapping of str to str")
    by_raw = {raw: name for name, raw in engine.raw_keys.items()}
    ref: dict[str, str] = {}
    missing: list[str] = []
    for k, v in reference.items():
        name = k if k in engine.digests else by_raw.get(k)
        if name is None:
            missing.append(k)
        else:
            ref[name] = v.lower()
    r = compare(dict(sorted(engine.digests.items())), ref, keyed_by="name")
    return ChecksumComparison(len(engine.digests), r.matched,
                              tuple(sorted(r.mismatched + r.unverifiable_reference)),
                              r.unverifiable, r.missing_in_reference, tuple(sorted(missing)))


# --------------------------------------------------------------------------- references


def check_layout(layout: object) -> dict[str, Any]:
    """A layout as a plain dict of JSON scalars, else ``BadInput``."""
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
    blob = json.dumps(check_layout(layout), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def layout_diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """``key: a != b`` for every layout field the two disagree on."""
    return [f"{k}: {a.get(k)!r} != {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k)]


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
        if not isinstance(self.content_digest, str) or not HEX64.fullmatch(self.content_digest):
            raise BadInput("content_digest must be a sha256 hex digest")
        object.__setattr__(self, "layout", MappingProxyType(check_layout(self.layout)))
        object.__setattr__(self, "checksums",
                           MappingProxyType(_check_digests("checksums", self.checksums)))
        if self.origin not in _ORIGINS:
            raise BadInput(f"origin must be one of {sorted(_ORIGINS)}, got {self.origin!r}")
        if not isinstance(self.source, str):
            raise BadInput("source must be a string")
        if isinstance(self.taken_wall, bool) or not isinstance(self.taken_wall, (int, float)) \
                or not math.isfinite(self.taken_wall):
            raise BadInput("taken_wall must be a finite number")

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

