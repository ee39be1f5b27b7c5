"""Typed, immutable observations returned by adapters for each effect.

An adapter never advances the controller by saying "ok". It returns one of
the evidence objects below, describing what it *saw*; the controller
(``lifecycle``) decides whether that establishes the step's postcondition.
Each class validates its fields in its constructor, so malformed evidence
cannot be built, and each has a ``problems(target)`` method that lists, in
words, why it does not establish the postcondition (empty means it does).

The rule that runs through all of them: a transport-level success is not an
engine-level success. A cache reset that answered HTTP 200 with
``{"success": false}`` has ``engine_success=False`` and is a failure.

Standard library only.
"""

from __future__ import annotations

import enum
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.errors import BadInput

__all__ = [
    "field_types",
    "jsonable",
    "BootstrapEvidence",
    "CacheKind",
    "CacheResetEvidence",
    "Check",
    "DrainEvidence",
    "Evidence",
    "HealthEvidence",
    "PauseMode",
    "PreflightEvidence",
    "RecoveryEvidence",
    "ResumeEvidence",
    "SLEEP_LEVELS",
    "SleepEvidence",
    "TransferEvidence",
    "UpdateTarget",
    "ValidationEvidence",
    "WakeEvidence",
    "WakeTags",
    "evidence_from_dict",
    "evidence_to_dict",
]


class PauseMode(enum.StrEnum):
    """vLLM's pause modes. RolloutCore's strict mode drains with WAIT."""

    ABORT = "abort"  # in-flight requests are aborted (client must resend)
    WAIT = "wait"    # in-flight requests run to completion, new ones are held
    KEEP = "keep"    # in-flight requests are frozen and continue after resume


class CacheKind(enum.StrEnum):
    PREFIX = "prefix"
    ENCODER = "encoder"
    MULTIMODAL = "multimodal"


def _nonneg(name: str, x: float) -> None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
        raise BadInput(f"{name} must be a finite number >= 0, got {x!r}")


@dataclass(frozen=True)
class UpdateTarget:
    """What an update is meant to install: the next version and its identity."""

    version: WeightVersion
    identity: WeightIdentity
    owner: str

    def __post_init__(self) -> None:
        if not isinstance(self.version, WeightVersion):
            raise BadInput("target.version must be a WeightVersion")
        if not isinstance(self.identity, WeightIdentity):
            raise BadInput("target.identity must be a WeightIdentity")
        if not isinstance(self.owner, str) or not self.owner:
            raise BadInput("target.owner must be a non-empty string")


@dataclass(frozen=True)
class Evidence:
    """Common part: how long the effect took and what it could not verify."""

    elapsed_s: float = field(default=0.0, kw_only=True)
    unverified: tuple[str, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        _nonneg("elapsed_s", self.elapsed_s)
        if not all(isinstance(u, str) for u in self.unverified):
            raise BadInput("unverified must be a tuple of strings")

    def problems(self, target: UpdateTarget | None) -> list[str]:
        return []


@dataclass(frozen=True)
class BootstrapEvidence(Evidence):
    """The engine was reached and described itself."""

    engine_epoch: str
    healthy: bool
    observed_label: str | None = None
    label_supported: bool = False
    capabilities: frozenset[str] = frozenset()
    engine_info: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.engine_epoch:
            raise BadInput("engine_epoch must be non-empty")

    def problems(self, target: UpdateTarget | None) -> list[str]:
        return [] if self.healthy else ["engine is not healthy"]


@dataclass(frozen=True)
class HealthEvidence(Evidence):
    """The engine observed between updates: answering, healthy, the same incarnation.

    ``restarted`` is set when the engine answers as a different process than
    the one bootstrapped (vLLM's ``instance_id`` changed): it then serves
    whatever its start checkpoint holds, not the committed version.
    """

    answering: bool
    healthy: bool
    restarted: bool = False
    reason: str = ""
    #: The engine's weight version label now (``None``: not read or not offered).
    observed_label: str | None = None
    #: Weight writes the engine counted since the adapter last verified it (its
    #: own weight-update operations: start, update, finish), or a label it was
    #: given, that no update of this controller made; empty when none.
    writes: tuple[str, ...] = ()

    def problems(self, target: UpdateTarget | None = None) -> list[str]:
        why = f": {self.reason}" if self.reason else ""
        if not self.answering:
            return [f"engine not answering{why}"]
        out = [] if self.healthy else [f"engine reports unhealthy{why}"]
        if self.restarted:
            out.append(f"engine restarted{why}")
        out += [f"weights written outside any update: {w}" for w in self.writes]
        return out

    @property
    def written(self) -> bool:
        """Evidence that the served weights are no longer what was verified."""
        return bool(self.writes)


@dataclass(frozen=True)
class DrainEvidence(Evidence):
    """The engine was paused; ``engine_in_flight`` is what it still runs, if known."""

    paused: bool
    mode: PauseMode
    engine_in_flight: int | None = None
    #: The engine was asked to clear its caches at the pause (and said it paused).
    cleared: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.mode, PauseMode):
            raise BadInput("mode must be a PauseMode")
        if self.engine_in_flight is not None and self.engine_in_flight < 0:
            raise BadInput("engine_in_flight must be >= 0")

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = []
        if not self.paused:
            out.append("engine does not report paused")
        if self.mode is PauseMode.KEEP:
            out.append("strict mode cannot drain with pause mode 'keep'")
        if self.engine_in_flight:
            out.append(f"engine still has {self.engine_in_flight} requests in flight")
        return out

    def problems_for(self, expected: PauseMode, clear_cache: bool = False) -> list[str]:
        """The postcondition of an asynchronous update's pause (issue 20).

        The engine must be paused in the mode the update's row names
        (``keep`` or ``abort``); requests it still holds are the point of
        ``keep``, not a problem.
        """
        out = [] if self.paused else ["engine does not report paused"]
        if self.mode is not expected:
            out.append(f"the update mode pauses with {expected.value!r}, the engine was "
                       f"paused with {self.mode.value!r}")
        if clear_cache and not self.cleared:
            out.append("the update mode pauses with clear_cache (the engine recomputes the "
                       "frozen requests), the engine's caches were not cleared")
        return out


@dataclass(frozen=True)
class PreflightEvidence(Evidence):
    """What the trainer's source and the engine declare, before any mutation."""

    source_manifest_digest: str
    source_provenance: Provenance | None = None
    engine_manifest_digest: str | None = None
    detail: str = ""

    def problems(self, target: UpdateTarget | None) -> list[str]:
        if target is None:
            return ["no update target"]
        want = target.identity
        out = []
        if self.source_manifest_digest != want.manifest_digest:
            out.append("trainer source manifest differs from the target identity's manifest")
        if self.engine_manifest_digest is not None and (
                self.engine_manifest_digest != want.manifest_digest):
            out.append("engine's parameter manifest differs from the target's")
        if self.source_provenance is not None and self.source_provenance != want.provenance:
            out.append("trainer source provenance differs from the target's")
        if self.detail:
            out.append(self.detail)
        return out


@dataclass(frozen=True)
class TransferEvidence(Evidence):
    """The outcome of moving the tensors, as the transport saw it.

    ``finish_label`` is the label the transport passed through vLLM's
    ``finish_weight_update`` (the target-aware finish), never written after.
    """

    completed: bool
    mutation_started: bool
    backend: str
    tensors: int = 0
    bytes: int = 0
    finish_label: str | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensors < 0 or self.bytes < 0:
            raise BadInput("tensors and bytes must be >= 0")
        if self.completed and not self.mutation_started:
            raise BadInput("a completed transfer has started mutating")

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = []
        if not self.completed:
            out.append(f"transfer did not complete: {self.error or 'no reason given'}")
        elif self.tensors == 0:
            out.append("transfer completed with zero tensors")
        if self.completed and target is not None and self.finish_label not in (
                None, target.version.label):
            out.append(f"transfer finished with label {self.finish_label!r}, "
                       f"target is {target.version.label!r}")
        return out


@dataclass(frozen=True)
class CacheResetEvidence(Evidence):
    """One cache reset. ``engine_success`` is the engine's own flag, if it gave one.

    ``absent``: the engine has no such cache, and why, read from the engine itself
    (an encoder or multimodal cache of a model that takes no multimodal input:
    vLLM sizes both at nothing). Nothing was sent (``http_status`` is None), and
    nothing computed under the old weights can be in a cache that does not exist.
    The prefix cache is never absent: every engine keeps one.
    """

    cache: CacheKind
    http_status: int | None
    engine_success: bool | None
    detail: str = ""
    absent: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.cache, CacheKind):
            raise BadInput("cache must be a CacheKind")
        if not isinstance(self.absent, str):
            raise BadInput("absent must be a string")

    def problems(self, target: UpdateTarget | None) -> list[str]:
        if self.absent:
            if self.cache is CacheKind.PREFIX:
                return ["the prefix cache cannot be absent: every engine keeps one"]
            if self.http_status is not None or self.engine_success is not None:
                return [f"{self.cache.value} cache said absent, yet a reset was answered"]
            return []
        out = []
        if self.http_status is None or not 200 <= self.http_status < 300:
            out.append(f"{self.cache.value} cache reset answered HTTP {self.http_status}")
        if self.engine_success is False:
            out.append(f"{self.cache.value} cache reset: engine reported success=false"
                       + (f" ({self.detail})" if self.detail else ""))
        return out


@dataclass(frozen=True)
class Check:
    """One validation check: a label, a checksum comparison, a policy probe..."""

    name: str
    passed: bool
    detail: str = ""
    coverage: float | None = None        # fraction of parameters actually checked
    max_abs_diff: float | None = None    # observed, for numeric checks
    tolerance: float | None = None
    level: VerificationLevel | None = None  # what a pass of this check establishes

    def __post_init__(self) -> None:
        if not self.name:
            raise BadInput("check name must be non-empty")
        if self.coverage is not None and not 0.0 <= self.coverage <= 1.0:
            raise BadInput("coverage must be in [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "detail": self.detail,
                "coverage": self.coverage, "max_abs_diff": self.max_abs_diff,
                "tolerance": self.tolerance,
                "level": None if self.level is None else self.level.wire}


@dataclass(frozen=True)
class ValidationEvidence(Evidence):
    """What the engine was observed to serve after the mutation.

    ``paused`` is whether the engine was still paused when observed; the
    runner states whether a given validation must be a paused one.
    """

    observed_label: str | None
    label_supported: bool
    paused: bool | None = None
    checks: tuple[Check, ...] = ()

    def problems(self, target: UpdateTarget | None) -> list[str]:
        if target is None:
            return ["no update target"]
        out = []
        if self.label_supported and self.observed_label != target.version.label:
            out.append(f"engine reports label {self.observed_label!r}, "
                       f"expected {target.version.label!r}")
        for c in self.checks:
            if not c.passed:
                out.append(f"check {c.name} failed: {c.detail}")
        if not self.label_supported and not self.checks:
            out.append("no evidence at all: the engine has no version label and no check ran")
        return out

    @property
    def summary(self) -> tuple[str, ...]:
        parts = []
        if self.label_supported:
            parts.append(f"label={self.observed_label}")
        for c in self.checks:
            s = f"{c.name}={'pass' if c.passed else 'FAIL'}"
            if c.coverage is not None:
                s += f" coverage={c.coverage:.3f}"
            if c.max_abs_diff is not None:
                s += f" max_abs_diff={c.max_abs_diff:.3g}"
            if c.tolerance is not None:
                s += f" tol={c.tolerance:.3g}"
            parts.append(s)
        return tuple(parts)


@dataclass(frozen=True)
class ResumeEvidence(Evidence):
    resumed: bool
    is_paused_after: bool | None = None

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = []
        if not self.resumed:
            out.append("resume was not acknowledged")
        if self.is_paused_after:
            out.append("engine still reports paused after resume")
        return out


@dataclass(frozen=True)
class RecoveryEvidence(Evidence):
    """A replacement engine (new epoch) loaded a checkpoint of known identity."""

    engine_epoch: str
    identity: WeightIdentity
    validation: ValidationEvidence
    healthy: bool

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = [] if self.healthy else ["recovered engine is not healthy"]
        out += self.validation.problems(target)
        return out


#: vLLM's sleep levels RolloutCore drives: 1 offloads the weights to host memory
#: and discards the KV cache; 2 discards both (the colocated-update level).
#: Level 0 (pause scheduling only) is not a sleep: ``drain`` does that.
SLEEP_LEVELS = (1, 2)


class WakeTags(enum.StrEnum):
    """What one ``/wake_up`` brings back (vLLM's tags; ``ALL`` sends none)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    ALL = "all"


def _memory(name: str, m: Mapping[str, Any]) -> None:
    if not isinstance(m, Mapping) or any(
            not isinstance(k, str) or (k != "source" and (
                isinstance(v, bool) or not isinstance(v, int) or v < 0))
            for k, v in m.items()):
        raise BadInput(f"{name} must map names to byte counts >= 0 (and 'source' to a string)")


@dataclass(frozen=True)
class SleepEvidence(Evidence):
    """The engine was put to sleep, as it then described itself.

    ``memory_before`` / ``memory_after`` are what the engine reports (its
    worker's view of the device: ``used_bytes``, ``free_bytes``,
    ``total_bytes``, and vLLM's own pool accounting where it has one;
    ``source`` names where the numbers come from); empty where the engine
    reports none. ``reference_params`` is how many of the engine's
    parameters were hashed before the sleep (what a wake on the same weights
    is verified against; 0: none taken).
    """

    level: int
    is_sleeping_after: bool | None
    paused_after: bool | None = None
    memory_before: Mapping[str, Any] = field(default_factory=dict)
    memory_after: Mapping[str, Any] = field(default_factory=dict)
    reference_params: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.level not in SLEEP_LEVELS:
            raise BadInput(f"sleep level must be one of {SLEEP_LEVELS}, got {self.level!r}")
        _memory("memory_before", self.memory_before)
        _memory("memory_after", self.memory_after)
        if self.reference_params < 0:
            raise BadInput("reference_params must be >= 0")

    @property
    def freed_bytes(self) -> int | None:
        """Device memory the sleep gave back, as the engine reports it (None: not reported)."""
        a, b = self.memory_before.get("used_bytes"), self.memory_after.get("used_bytes")
        if isinstance(a, int) and isinstance(b, int):
            return a - b
        return None

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = []
        if self.is_sleeping_after is not True:
            out.append("engine does not report sleeping after /sleep"
                       if self.is_sleeping_after is False else
                       "engine sleep state not observed after /sleep")
        if self.paused_after is False:
            out.append("engine reports its scheduler running while asleep")
        return out


@dataclass(frozen=True)
class WakeEvidence(Evidence):
    """One wake call: which tags came back, and what the engine says after it.

    ``fully_awake`` is whether nothing is asleep any more (vLLM 0.32 says so
    in its answer; otherwise read from ``/is_sleeping``). ``paused_after`` is
    the scheduler after the call, once the adapter re-paused it where the
    engine resumed it on its own (``repaused``): a woken engine must not
    serve until its weights are verified.
    """

    tags: WakeTags
    fully_awake: bool | None
    paused_after: bool | None
    repaused: bool = False
    memory_after: Mapping[str, Any] = field(default_factory=dict)
    detail: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.tags, WakeTags):
            raise BadInput("tags must be WakeTags")
        _memory("memory_after", self.memory_after)

    def problems(self, target: UpdateTarget | None) -> list[str]:
        out = []
        whole = self.tags is not WakeTags.WEIGHTS
        if self.fully_awake is False and whole:
            out.append(f"engine still reports sleeping after waking {self.tags.value}")
        if self.fully_awake is True and not whole:
            out.append("engine reports fully awake after waking only its weights "
                       "(the KV cache was not asleep)")
        if self.paused_after is False:
            out.append("engine scheduler runs after the wake: it would serve unverified "
                       "weights")
        if self.detail:
            out.append(self.detail)
        return out


def jsonable(v: Any) -> Any:
    """``v`` as JSON: an enum as its value, a version, identity or check as its ``to_dict``,
    sets sorted, tuples as lists, evidence as ``evidence_to_dict`` (records and evidence)."""
    if isinstance(v, enum.Enum):
        return v.value
    if hasattr(v, "to_dict"):
        return v.to_dict()
    if isinstance(v, (frozenset, set)):
        return sorted(jsonable(x) for x in v)
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, Evidence):
        return evidence_to_dict(v)
    return v


def evidence_to_dict(ev: Evidence) -> dict[str, Any]:
    """A JSON-safe dict of any evidence object, tagged with its type."""
    out: dict[str, Any] = {"type": type(ev).__name__}
    for f in fields(ev):
        out[f.name] = jsonable(getattr(ev, f.name))
    return out


_EVIDENCE_TYPES: Mapping[str, type[Evidence]] = {t.__name__: t for t in (
    Evidence, BootstrapEvidence, HealthEvidence, DrainEvidence, PreflightEvidence,
    TransferEvidence, CacheResetEvidence, ValidationEvidence, ResumeEvidence,
    RecoveryEvidence, SleepEvidence, WakeEvidence)}


_HINTS: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Field types, resolved once per class (the annotations are strings)."""
    h = _HINTS.get(cls)
    if h is None:
        h = _HINTS[cls] = typing.get_type_hints(cls)
    return h


def _from_json(tp: Any, v: Any) -> Any:
    """Undo ``jsonable`` for a value of declared type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _from_json(inner, v)
    if origin is tuple:
        return tuple(_from_json(args[0], x) for x in v)
    if origin is frozenset:
        return frozenset(_from_json(args[0], x) for x in v)
    if origin is not None and issubclass(origin, Mapping):
        return dict(v)
    if tp is VerificationLevel:
        return VerificationLevel(v) if isinstance(v, int) else VerificationLevel.parse(str(v))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(v)
    if tp is WeightIdentity:
        return WeightIdentity.from_dict(v)
    if tp is WeightVersion:
        return WeightVersion.from_dict(v)
    if isinstance(tp, type) and issubclass(tp, Evidence):
        return evidence_from_dict(v)
    if tp in (Provenance, Check):
        hints = field_types(tp)
        return tp(**{k: _from_json(hints[k], x) for k, x in v.items()})
    if tp is float:
        return float(v)
    return v


def evidence_from_dict(d: Mapping[str, Any]) -> Evidence:
    """The evidence object ``evidence_to_dict`` made ``d`` of (its constructor validates)."""
    if not isinstance(d, Mapping):
        raise BadInput(f"not an evidence object: {d!r}")
    cls = _EVIDENCE_TYPES.get(str(d.get("type")))
    if cls is None:
        raise BadInput(f"unknown evidence type {d.get('type')!r}")
    hints = field_types(cls)
    try:
        kw = {f.name: _from_json(hints[f.name], d[f.name]) for f in fields(cls) if f.name in d}
        return cls(**kw)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BadInput(f"not a {cls.__name__}: {exc}") from exc
