"""The versioned trajectory schema: what one sampled completion was, exactly.

A trajectory record must answer, long after the run, four questions without
consulting anything else: *what was asked* (prompt token ids and their
digest), *how it was sampled* (sampling parameters and the seed, with the rule
that derived it), *what came back* (tokens, sampled-token logprobs, finish
reason, and vLLM's own per-token ``weight_versions`` spans), and *under which
policy* (the controller's binding: ``WeightVersion`` + ``WeightIdentity``,
and the engine's identity and configuration). The audit (version purity,
group diversity) and the replay validator read nothing but these records.

House rules of this module:

* every type is a frozen dataclass that validates itself in its constructor,
  so a malformed record cannot exist in memory; JSON-like sub-objects are
  deep-frozen (mappings become read-only, lists become tuples);
* ``to_dict``/``from_dict`` are exact inverses and JSON-safe (no NaN or
  infinity, string keys only); ``from_dict`` rejects unknown keys, because a
  silently dropped field would change a record's content digest on rewrite;
* ``SCHEMA_VERSION`` changes whenever a field is added, removed or changes
  meaning. A reader refuses any record whose ``schema_version`` it does not
  know, naming the version, instead of guessing (newer writers may have
  changed a meaning, not only added a field). Version 2 added
  ``prompt.media`` (digests of the images sent with the prompt), version 3
  ``attribution`` (whether the controller credits the sample to its
  binding's version) and ``completion.versions`` (per-token versions, the
  update mode, the engine requests and their cache salts:
  ``provenance.token_versions``). A record is written with the lowest
  version that can hold it: a text prompt attributable as before is version
  1, byte for byte as before (so version-1 readers keep reading such files
  and content digests do not change); with images version 2; a sample that
  is unattributable or carries per-token versions version 3. A record
  without ``attribution`` reads as attributable, which is what its writer
  claimed by writing it.

The on-disk transaction format (groups + commit markers) belongs to
``recorder``; this module only knows records. ``docs/trajectory-schema.md``
documents every field.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from rolloutcore.core.media import ImageRef
from rolloutcore.core.records import fields_dict, fields_from_dict
from rolloutcore.core.strict import HEX64, check_str, exact_keys
from rolloutcore.core.strict import check_obj as _obj
from rolloutcore.core.strict import fail as _fail
from rolloutcore.core.strict import freeze_json as _freeze_json
from rolloutcore.core.strict import thaw_json as _thaw_json
from rolloutcore.core.versions import Binding, EngineIdentity
from rolloutcore.engine.wire import VersionSpan  # re-exported: the schema's spans
from rolloutcore.errors import BadInput
from rolloutcore.provenance.adapter_use import AdapterUse
from rolloutcore.provenance.seeds import SEED_DERIVATION
from rolloutcore.provenance.token_versions import TokenVersions, check_cover

__all__ = [
    "KNOWN_SCHEMA_VERSIONS",
    "AdapterUse",
    "MAX_EXTRA_DEPTH",
    "SAMPLING_EPS",
    "SCHEMA_VERSION",
    "Attribution",
    "SEED_EXTERNAL",
    "SEED_NONE",
    "Binding",
    "EngineIdentity",
    "FleetPlacement",
    "SampledCompletion",
    "Prompt",
    "SamplingSpec",
    "Timestamps",
    "TokenVersions",
    "TrajectoryGroup",
    "TrajectorySample",
    "VersionSpan",
    "check_schema_version",
    "encode_line",
    "group_id_for",
    "prompt_digest",
    "validate_spans",
]

#: The newest version written and read. 1: text prompts; 2: + ``prompt.media``;
#: 3: + ``attribution`` (written only for a sample credited to no version) and
#: ``completion.versions`` (asynchronous updates), each only where it applies;
#: 4: + ``fleet`` (the replica and the fleet version that answered, written only
#: for a sample a fleet gateway recorded); 5: + ``adapter`` (the LoRA-adapter
#: version the sample was generated through, written only for such a sample).
SCHEMA_VERSION = 5
#: What an unknown key is told (it may be a newer schema's).
_NOTE = f"schema version {SCHEMA_VERSION}"
KNOWN_SCHEMA_VERSIONS = frozenset({1, 2, 3, 4, 5})
#: Deepest nesting of ``sampling.extra`` (whatever else was sent to vLLM) kept in
#: a record: the record's own encoders and readers recurse over it.
MAX_EXTRA_DEPTH = 32

#: ``seed_derivation`` values besides ``seeds.SEED_DERIVATION``: a seed chosen
#: by the caller some other way (for instance vLLM's ``seed + i`` for ``n > 1``),
#: or no seed at all (the engine's global stream: the seed-collision hazard).
SEED_EXTERNAL = "external"
SEED_NONE = "none"
_SEED_SCHEMES = frozenset({SEED_DERIVATION, SEED_EXTERNAL, SEED_NONE})

#: vLLM treats temperatures below this as greedy (``vllm.sampling_params``).
SAMPLING_EPS = 1e-5

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$")
_FINISH_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_TYPED_SAMPLING_KEYS = frozenset({"temperature", "top_p", "top_k", "max_tokens", "seed"})


# --------------------------------------------------------------------------- helpers

def _int(where: str, x: object, *, lo: int | None = 0, hi: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise _fail(where, f"must be an int, got {x!r}")
    if lo is not None and x < lo:
        raise _fail(where, f"must be >= {lo}, got {x}")
    if hi is not None and x > hi:
        raise _fail(where, f"must be <= {hi}, got {x}")
    return x


def _float(where: str, x: object) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _fail(where, f"must be a number, got {x!r}")
    f = float(x)
    if not math.isfinite(f):
        raise _fail(where, f"must be finite, got {x!r}")
    return f


def _str(where: str, x: object, pattern: re.Pattern[str] | None = None) -> str:
    check_str(where, x)
    assert isinstance(x, str)
    if pattern is not None and not pattern.fullmatch(x):
        raise _fail(where, f"must match {pattern.pattern}, got {x!r}")
    return x


def _tokens(where: str, xs: object) -> tuple[int, ...]:
    if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
        raise _fail(where, f"must be a sequence of token ids, got {type(xs).__name__}")
    out = tuple(xs)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise _fail(f"{where}[{i}]", f"token ids are ints >= 0, got {t!r}")
    return out


def _exact_keys(where: str, d: Mapping[str, Any], required: Iterable[str],
                optional: Iterable[str] = ()) -> None:
    exact_keys(where, d, required, optional, _NOTE)


def encode_line(d: Mapping[str, Any]) -> bytes:
    """One canonical JSON line: sorted keys, compact, ASCII, no NaN, newline-terminated.

    Canonical so that the same record always has the same bytes, which is what
    content digests (and idempotent re-appends) are computed over.
    """
    try:
        text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                          allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise BadInput(f"record is not JSON-safe: {exc}") from exc
    return text.encode("ascii") + b"\n"


def check_schema_version(d: Mapping[str, Any], what: str = "record") -> None:
    """Refuse a record whose schema version this reader does not know."""
    if "schema_version" not in d:
        raise BadInput(f"{what} has no schema_version; not a RolloutCore trajectory record")
    v = d["schema_version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(f"{what} has an unreadable schema_version {v!r}")
    if v > SCHEMA_VERSION:
        raise BadInput(f"{what} has schema_version {v}, newer than this reader supports "
                       f"({SCHEMA_VERSION}); upgrade rolloutcore to read it")
    if v not in KNOWN_SCHEMA_VERSIONS:
        raise BadInput(f"{what} has unknown schema_version {v} "
                       f"(this reader knows {sorted(KNOWN_SCHEMA_VERSIONS)})")


def _depth(x: object) -> int:
    """Nesting depth of a JSON-like value, without recursion."""
    deepest, stack = 0, [(x, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, Mapping):
            items: Iterable[object] = o.values()
        elif isinstance(o, (list, tuple)):
            items = o
        else:
            continue
        deepest = max(deepest, d)
        if deepest > MAX_EXTRA_DEPTH:
            break
        stack.extend((v, d + 1) for v in items)
    return deepest


def prompt_digest(token_ids: Sequence[int]) -> str:
    """sha256 hex of the compact JSON array of the token ids, e.g. ``[1,2,3]``."""
    ids = _tokens("prompt.token_ids", token_ids)
    return hashlib.sha256(json.dumps(list(ids), separators=(",", ":")).encode("ascii")).hexdigest()


def group_id_for(run: str, step: int, prompt_index: int) -> str:
    """The stable group id of prompt ``prompt_index`` at ``step`` of ``run``.

    A pure function of the prompt's position, so a generator that resumes
    after a crash names a regenerated group exactly as before.
    """
    _str("run", run, _ID_RE)
    return f"{run}:s{_int('step', step)}:p{_int('prompt_index', prompt_index)}"


# --------------------------------------------------------------------------- records

def validate_spans(spans: Sequence[VersionSpan], n_tokens: int) -> None:
    """Contiguous spans covering exactly ``[0, n_tokens)``, as vLLM builds them.

    vLLM starts a span whenever the label changes, so an empty span can occur
    (two label changes between tokens) and a zero-token completion may carry
    either no span or one empty span; both are accepted.
    """
    check_cover("weight_versions", spans, n_tokens)


@dataclass(frozen=True)
class Prompt:
    """The prompt as token ids; ``digest`` is computed when empty and checked otherwise.

    ``media`` describes the images sent with it, in request order (digest,
    format, size; never the bytes). ``digest`` covers the token ids only.
    """

    token_ids: tuple[int, ...]
    digest: str = ""
    media: tuple[ImageRef, ...] = ()

    def __post_init__(self) -> None:
        ids = _tokens("prompt.token_ids", self.token_ids)
        if not ids:
            raise BadInput("prompt.token_ids must not be empty")
        object.__setattr__(self, "token_ids", ids)
        if isinstance(self.media, (str, bytes)) or not isinstance(self.media, Iterable):
            raise BadInput("prompt.media must be a sequence of ImageRef")
        media = tuple(self.media)
        if not all(isinstance(m, ImageRef) for m in media):
            raise BadInput("prompt.media must contain ImageRef only")
        object.__setattr__(self, "media", media)
        actual = prompt_digest(ids)
        if self.digest and self.digest != actual:
            raise BadInput(f"prompt.digest {self.digest!r} does not match its token ids "
                           f"({actual})")
        object.__setattr__(self, "digest", actual)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"digest": self.digest, "token_ids": list(self.token_ids)}
        if self.media:  # absent, not empty, when there are none (schema version 1)
            d["media"] = [x.to_dict() for x in self.media]
        return d

    @classmethod
    def from_dict(cls, d: object) -> Prompt:
        m = _obj("prompt", d)
        _exact_keys("prompt", m, ("digest", "token_ids"), ("media",))
        media: tuple[ImageRef, ...] = ()
        if "media" in m:
            raw = m["media"]
            if not isinstance(raw, (list, tuple)) or not raw:
                raise BadInput("prompt.media must be a non-empty list when present")
            media = tuple(ImageRef.from_dict(dict(x) if isinstance(x, Mapping) else x)
                          for x in raw)
        return cls(_tokens("prompt.token_ids", m["token_ids"]),
                   _str("prompt.digest", m["digest"], HEX64), media)


@dataclass(frozen=True)
class SamplingSpec:
    """The sampling parameters sent to the engine, and where the seed came from.

    The typed fields are those the audit and replay read; anything else sent
    to vLLM goes, unchanged, in ``extra`` (e.g. ``{"logprobs": 0}``).
    """

    temperature: float
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = None
    seed: int | None = None
    seed_derivation: str = SEED_NONE
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        t = _float("sampling.temperature", self.temperature)
        if t < 0:
            raise BadInput(f"sampling.temperature must be >= 0, got {t}")
        object.__setattr__(self, "temperature", t)
        p = _float("sampling.top_p", self.top_p)
        if not 0 < p <= 1:
            raise BadInput(f"sampling.top_p must be in (0, 1], got {p}")
        object.__setattr__(self, "top_p", p)
        _int("sampling.top_k", self.top_k, lo=-1)
        if self.max_tokens is not None:
            _int("sampling.max_tokens", self.max_tokens, lo=1)
        if self.seed is not None:
            _int("sampling.seed", self.seed, lo=_INT64_MIN, hi=_UINT64_MAX)
        if self.seed_derivation not in _SEED_SCHEMES:
            raise BadInput(f"sampling.seed_derivation must be one of {sorted(_SEED_SCHEMES)}, "
                           f"got {self.seed_derivation!r}")
        if (self.seed is None) != (self.seed_derivation == SEED_NONE):
            raise BadInput("sampling.seed and seed_derivation disagree: a seed needs a "
                           f"derivation other than {SEED_NONE!r}, and {SEED_NONE!r} needs "
                           f"seed=None (got seed={self.seed!r}, "
                           f"derivation={self.seed_derivation!r})")
        if _depth(self.extra) > MAX_EXTRA_DEPTH:
            raise BadInput(f"sampling.extra nests deeper than {MAX_EXTRA_DEPTH}")
        extra = _freeze_json("sampling.extra", _obj("sampling.extra", self.extra))
        clash = sorted(_TYPED_SAMPLING_KEYS & extra.keys())
        if clash:
            raise BadInput(f"sampling.extra must not repeat the typed fields {clash}")
        object.__setattr__(self, "extra", extra)

    @property
    def greedy(self) -> bool:
        """Greedy decoding ignores the seed: identical siblings are then expected."""
        return self.temperature < SAMPLING_EPS

    def to_vllm(self) -> dict[str, Any]:
        """The ``sampling_params`` object for vLLM's ``/inference/v1/generate``."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                               "top_k": self.top_k}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.seed is not None:
            out["seed"] = self.seed
        out.update(_thaw_json(self.extra))
        return out

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> SamplingSpec:
        return fields_from_dict(cls, "sampling", d, _NOTE)


@dataclass(frozen=True)
class SampledCompletion:
    """What the engine returned for one sample.

    ``logprobs`` are the sampled-token logprobs, one per output token, as
    vLLM reports them (their meaning depends on the engine's
    ``logprobs_mode``, recorded in ``EngineIdentity.config``); ``None`` when
    not requested. ``weight_versions`` are the engine's own spans, ``None``
    when the engine does not report them (vLLM < 0.32, or no label known).
    ``versions`` (schema version 3) are the per-token versions of a rollout
    an asynchronous update may have carried (``provenance.token_versions``).
    """

    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[float, ...] | None = None
    stop_reason: int | str | None = None
    weight_versions: tuple[VersionSpan, ...] | None = None
    versions: TokenVersions | None = None

    def __post_init__(self) -> None:
        ids = _tokens("completion.token_ids", self.token_ids)
        object.__setattr__(self, "token_ids", ids)
        _str("completion.finish_reason", self.finish_reason, _FINISH_RE)
        if self.logprobs is not None:
            if isinstance(self.logprobs, (str, bytes)) or not isinstance(self.logprobs, Iterable):
                raise BadInput("completion.logprobs must be a sequence of numbers or None")
            lps = tuple(_float(f"completion.logprobs[{i}]", x)
                        for i, x in enumerate(self.logprobs))
            if len(lps) != len(ids):
                raise BadInput(f"completion.logprobs has {len(lps)} entries for "
                               f"{len(ids)} output tokens")
            object.__setattr__(self, "logprobs", lps)
        sr = self.stop_reason
        if sr is not None and (isinstance(sr, bool) or not isinstance(sr, (int, str))):
            raise BadInput(f"completion.stop_reason must be an int, a string or None, got {sr!r}")
        if self.weight_versions is not None:
            if not isinstance(self.weight_versions, Iterable):
                raise BadInput("completion.weight_versions must be a sequence of spans or None")
            spans = tuple(self.weight_versions)
            for s in spans:
                if not isinstance(s, VersionSpan):
                    raise BadInput(f"completion.weight_versions holds a {type(s).__name__}, "
                                   "not a VersionSpan")
            validate_spans(spans, len(ids))
            object.__setattr__(self, "weight_versions", spans)
        if self.versions is not None:
            if not isinstance(self.versions, TokenVersions):
                raise BadInput("completion.versions must be a TokenVersions or None")
            self.versions.check_length(len(ids))

    @property
    def span_versions(self) -> tuple[str, ...] | None:
        """Distinct version labels that sampled at least one token, in order."""
        if self.weight_versions is None:
            return None
        seen: list[str] = []
        for s in self.weight_versions:
            if len(s) and s.version not in seen:
                seen.append(s.version)
        return tuple(seen)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"token_ids": list(self.token_ids),
                             "finish_reason": self.finish_reason,
             "logprobs": None if self.logprobs is None else list(self.logprobs),
             "stop_reason": self.stop_reason,
             "weight_versions": (None if self.weight_versions is None
                                 else [s.to_dict() for s in self.weight_versions])}
        if self.versions is not None:  # absent, not null, before schema version 3
            d["versions"] = self.versions.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: object) -> SampledCompletion:
        m = _obj("completion", d)
        _exact_keys("completion", m, ("token_ids", "finish_reason", "logprobs",
                                      "stop_reason", "weight_versions"), ("versions",))
        wv = m["weight_versions"]
        if wv is not None and not isinstance(wv, list):
            raise BadInput("completion.weight_versions must be a list or null")
        return cls(_tokens("completion.token_ids", m["token_ids"]), m["finish_reason"],
                   m["logprobs"], m["stop_reason"],
                   None if wv is None else tuple(VersionSpan.from_dict(s, _NOTE) for s in wv),
                   TokenVersions.from_dict(m["versions"]) if "versions" in m else None)


@dataclass(frozen=True)
class Timestamps:
    """Admission and completion, as wall time (``time.time``) and ``time.monotonic``.

    Monotonic times are comparable with the lifecycle journal's ``t_mono``
    only for processes on the same host and boot.
    """

    admitted_wall: float
    admitted_mono: float
    completed_wall: float
    completed_mono: float

    def __post_init__(self) -> None:
        for name in ("admitted_wall", "admitted_mono", "completed_wall", "completed_mono"):
            v = _float(f"timestamps.{name}", getattr(self, name))
            if v < 0:
                raise BadInput(f"timestamps.{name} must be >= 0, got {v}")
            object.__setattr__(self, name, v)
        if self.completed_mono < self.admitted_mono:
            raise BadInput(f"timestamps: completed_mono {self.completed_mono} is before "
                           f"admitted_mono {self.admitted_mono}")

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> Timestamps:
        return fields_from_dict(cls, "timestamps", d, _NOTE)


_SAMPLE_KEYS = ("schema_version", "record", "run", "step", "group_id", "prompt_index",
                "group_size", "sample_index", "prompt", "sampling", "completion",
                "binding", "engine", "timestamps")


@dataclass(frozen=True)
class Attribution:
    """Whether the controller credits the sample to its binding's version (schema 3).

    ``attributable`` is the controller's own word at the rollout's release
    (``Completion.attributable``). It is false when the answer was cut by a
    policy abort (the drain deadline of an update expired), or when the
    engine was tainted or the committed version changed before the release:
    the tokens are what the engine returned, but no version may be named as
    their policy. ``reason`` says why (``None`` exactly when attributable).
    """

    attributable: bool = True
    reason: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.attributable, bool):
            raise BadInput("attribution.attributable must be a boolean")
        if self.attributable:
            if self.reason is not None:
                raise BadInput("attribution.reason is null for an attributable sample")
        else:
            if not isinstance(self.reason, str) or not self.reason or len(self.reason) > 512:
                raise BadInput("attribution.reason must say, in 1..512 characters, why the "
                               "sample is not attributable")
            check_str("attribution.reason", self.reason)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> Attribution:
        return fields_from_dict(cls, "attribution", d, _NOTE)


@dataclass(frozen=True)
class FleetPlacement:
    """Which replica of a fleet answered, serving which fleet version (schema 4).

    The binding says which *engine* version generated the tokens; this says
    under which published *fleet* version that engine version served, and
    which replica it was (``rolloutcore audit`` checks the three agree with the
    fleet's journal).
    """

    replica: str
    fleet_version: int
    fleet_label: str

    def __post_init__(self) -> None:
        _str("fleet.replica", self.replica, _ID_RE)
        _int("fleet.fleet_version", self.fleet_version)
        _str("fleet.fleet_label", self.fleet_label, _ID_RE)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> FleetPlacement:
        return fields_from_dict(cls, "fleet", d, _NOTE)


@dataclass(frozen=True)
class TrajectorySample:
    """One sampled completion: sample ``sample_index`` of ``group_size`` in ``group_id``."""

    run: str
    step: int
    group_id: str
    prompt_index: int
    group_size: int
    sample_index: int
    prompt: Prompt
    sampling: SamplingSpec
    completion: SampledCompletion
    binding: Binding
    engine: EngineIdentity
    timestamps: Timestamps
    attribution: Attribution = field(default_factory=Attribution)
    #: The replica and fleet version that answered (a fleet gateway's record).
    fleet: FleetPlacement | None = None
    #: The LoRA-adapter version it was generated through (on the bound base).
    adapter: AdapterUse | None = None

    def __post_init__(self) -> None:
        _str("run", self.run, _ID_RE)
        _int("step", self.step)
        _str("group_id", self.group_id, _ID_RE)
        _int("prompt_index", self.prompt_index)
        _int("group_size", self.group_size, lo=1)
        _int("sample_index", self.sample_index)
        if self.sample_index >= self.group_size:
            raise BadInput(f"sample_index {self.sample_index} is out of range for "
                           f"group_size {self.group_size}")
        for name, typ in (("prompt", Prompt), ("sampling", SamplingSpec),
                          ("completion", SampledCompletion), ("binding", Binding),
                          ("engine", EngineIdentity), ("timestamps", Timestamps),
                          ("attribution", Attribution)):
            if not isinstance(getattr(self, name), typ):
                raise BadInput(f"{name} must be a {typ.__name__}, "
                               f"got {type(getattr(self, name)).__name__}")
        if self.fleet is not None and not isinstance(self.fleet, FleetPlacement):
            raise BadInput(f"fleet must be a FleetPlacement or None, "
                           f"got {type(self.fleet).__name__}")
        if self.adapter is not None:
            if not isinstance(self.adapter, AdapterUse):
                raise BadInput(f"adapter must be an AdapterUse or None, "
                               f"got {type(self.adapter).__name__}")
            if self.adapter.base != self.binding.version.label:
                raise BadInput(f"adapter {self.adapter.name} was verified on base "
                               f"{self.adapter.base}, the sample is bound to "
                               f"{self.binding.version.label}")

    @property
    def schema_version(self) -> int:
        """The lowest version that holds this record: 1 for a text prompt (written
        exactly as before version 2), 2 with images, 3 when not attributable or
        with per-token versions (``completion.versions``), 4 with a fleet placement,
        5 with a LoRA adapter."""
        if self.adapter is not None:
            return 5
        if self.fleet is not None:
            return 4
        if not self.attribution.attributable or self.completion.versions is not None:
            return 3
        return 2 if self.prompt.media else 1

    def to_dict(self) -> dict[str, Any]:
        out = {"schema_version": self.schema_version, "record": "sample", "run": self.run,
               "step": self.step, "group_id": self.group_id,
               "prompt_index": self.prompt_index, "group_size": self.group_size,
               "sample_index": self.sample_index, "prompt": self.prompt.to_dict(),
               "sampling": self.sampling.to_dict(), "completion": self.completion.to_dict(),
               "binding": self.binding.to_dict(), "engine": self.engine.to_dict(),
               "timestamps": self.timestamps.to_dict()}
        if not self.attribution.attributable:
            out["attribution"] = self.attribution.to_dict()
        if self.fleet is not None:
            out["fleet"] = self.fleet.to_dict()
        if self.adapter is not None:
            out["adapter"] = self.adapter.to_dict()
        return out

    @classmethod
    def from_dict(cls, d: object) -> TrajectorySample:
        m = _obj("sample", d)
        check_schema_version(m, "trajectory sample")
        if m.get("record") != "sample":
            raise BadInput(f"not a sample record (record={m.get('record')!r})")
        v = m["schema_version"]
        _exact_keys("sample", m, _SAMPLE_KEYS, ("attribution",) if v == 3 else
                    ("attribution", "fleet") if v == 4 else
                    ("attribution", "fleet", "adapter") if v == 5 else ())
        has_media = isinstance(m["prompt"], Mapping) and "media" in m["prompt"]
        has_versions = isinstance(m["completion"], Mapping) and "versions" in m["completion"]
        has_attribution = "attribution" in m
        attribution = (Attribution.from_dict(m["attribution"]) if has_attribution
                       else Attribution())
        fleet = FleetPlacement.from_dict(m["fleet"]) if "fleet" in m else None
        adapter = AdapterUse.from_dict(m["adapter"]) if "adapter" in m else None
        want = (5 if adapter is not None else 4 if fleet is not None
                else 3 if (has_versions or has_attribution) else 2 if has_media else 1)
        if v != want:
            raise BadInput("trajectory sample: prompt.media is written with schema_version 2, "
                           "attribution and completion.versions with 3 (with or without "
                           f"media), each only then (got schema_version {v}, "
                           f"{'with' if has_media else 'without'} media, "
                           f"{'with' if has_attribution else 'without'} attribution, "
                           f"{'with' if has_versions else 'without'} versions; a fleet "
                           "placement with 4, an adapter with 5)")
        if has_attribution and attribution.attributable:
            raise BadInput("trajectory sample: attribution is written only for a sample "
                           "that is not attributable")
        return cls(m["run"], m["step"], m["group_id"], m["prompt_index"], m["group_size"],
                   m["sample_index"], Prompt.from_dict(m["prompt"]),
                   SamplingSpec.from_dict(m["sampling"]),
                   SampledCompletion.from_dict(m["completion"]),
                   Binding.from_dict(m["binding"]),
                   EngineIdentity.from_dict(m["engine"]),
                   Timestamps.from_dict(m["timestamps"]), attribution, fleet, adapter)

    def encode(self) -> bytes:
        """The canonical JSON line of this record."""
        return encode_line(self.to_dict())


@dataclass(frozen=True)
class TrajectoryGroup:
    """The n siblings of one prompt, the unit the recorder commits atomically.

    Samples are kept sorted by ``sample_index`` and must be exactly
    ``0..group_size-1``, all naming the same run, step, group, prompt index,
    group size and prompt.
    """

    samples: tuple[TrajectorySample, ...]

    def __post_init__(self) -> None:
        if isinstance(self.samples, (str, bytes)) or not isinstance(self.samples, Iterable):
            raise BadInput("a group is a sequence of TrajectorySample")
        samples = tuple(self.samples)
        if not samples:
            raise BadInput("a group needs at least one sample")
        for s in samples:
            if not isinstance(s, TrajectorySample):
                raise BadInput(f"a group holds TrajectorySample, not {type(s).__name__}")
        samples = tuple(sorted(samples, key=lambda s: s.sample_index))
        first = samples[0]
        for s in samples[1:]:
            for attr in ("run", "step", "group_id", "prompt_index", "group_size"):
                if getattr(s, attr) != getattr(first, attr):
                    raise BadInput(f"group {first.group_id!r}: sample {s.sample_index} has "
                                   f"{attr}={getattr(s, attr)!r}, sample "
                                   f"{first.sample_index} has {getattr(first, attr)!r}")
            if s.prompt.digest != first.prompt.digest:
                raise BadInput(f"group {first.group_id!r}: siblings have different prompts")
        indices = [s.sample_index for s in samples]
        if indices != list(range(first.group_size)):
            raise BadInput(f"group {first.group_id!r}: sample indices {indices} are not "
                           f"exactly 0..{first.group_size - 1}")
        object.__setattr__(self, "samples", samples)

    @property
    def group_id(self) -> str:
        return self.samples[0].group_id

    @property
    def run(self) -> str:
        return self.samples[0].run

    @property
    def step(self) -> int:
        return self.samples[0].step

    @property
    def prompt_index(self) -> int:
        return self.samples[0].prompt_index

    def __len__(self) -> int:
        return len(self.samples)

    @cached_property
    def lines(self) -> bytes:
        """The canonical JSON lines of the samples, in sample order."""
        return b"".join(s.encode() for s in self.samples)

    @cached_property
    def content_digest(self) -> str:
        """sha256 of ``lines``: equal digests mean byte-identical groups."""
        return hashlib.sha256(self.lines).hexdigest()
