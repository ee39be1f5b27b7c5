"""The vocabulary every record speaks: the record base class and the lifecycle's enums.

Apart from ``core.records`` (the engine's records and the one schema's
registry) so that the other machines' records (``core.pool``: the fleet's
replica table; ``core.lease``: the trainer protocol's leases) are records
of the same kind, typed with the same enums, and join the one registry
without an import cycle. Standard library only.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from rolloutcore.core.evidence import field_types, jsonable
from rolloutcore.errors import BadInput, EffectError, EffectTimeout

__all__ = ["Classification", "Event", "FailureKind", "Machine", "Record", "State", "Step",
           "TypedRecord", "UpdateMode", "strs"]


# --------------------------------------------------------------------------- vocabulary

class State(enum.StrEnum):
    UNINITIALIZED = "UNINITIALIZED"
    READY = "READY"
    DRAINING = "DRAINING"
    QUIESCED = "QUIESCED"
    UPDATING = "UPDATING"
    INVALIDATING = "INVALIDATING"
    VALIDATING = "VALIDATING"
    RESUMING = "RESUMING"
    TAINTED = "TAINTED"
    RECOVERING = "RECOVERING"
    # Colocated training (issue 21): the engine gives its GPU memory to the trainer.
    DOZING = "DOZING"        # admission closed for a sleep: rollouts finish, the engine sleeps
    SLEEPING = "SLEEPING"    # asleep: weights offloaded (level 1) or discarded (level 2)
    WAKING = "WAKING"        # weights resident again, KV cache asleep, weights unverified
    WARMING = "WARMING"      # the update wrote the woken weights; KV cache still asleep


class Event(enum.StrEnum):
    BOOTSTRAP = "bootstrap"
    ADMIT = "admit"
    COMPLETE = "complete"
    REQUEST_UPDATE = "request_update"
    DRAINED = "drained"
    PREFLIGHTED = "preflighted"      # begin_update: the mutation may start
    TRANSFERRED = "transferred"
    INVALIDATED = "invalidated"
    VALIDATED = "validated"
    RESUMED = "resumed"
    FAIL = "fail"
    BEGIN_RECOVERY = "begin_recovery"
    RECOVERED = "recovered"
    REQUEST_SLEEP = "request_sleep"  # admission closes; the engine is to sleep
    SLEPT = "slept"
    REQUEST_WAKE = "request_wake"    # the owner wakes it: with an update, or on its own weights
    WOKE = "woke"                    # one wake call (weights, KV cache, or both)


class Step(enum.StrEnum):
    """The effect a failure happened in."""

    BOOTSTRAP = "bootstrap"
    DRAIN = "drain"
    PREFLIGHT = "preflight"
    TRANSFER = "transfer"
    INVALIDATE = "invalidate"
    VALIDATE = "validate"
    RESUME = "resume"
    RECOVER = "recover"
    SERVE = "serve"        # no effect: the engine observed failing while READY
    RESTART = "restart"    # no effect: the controller itself restarted mid-way (crash restore)
    SLEEP = "sleep"        # put the engine to sleep (after the local rollouts finished)
    WAKE = "wake"          # wake the weights or the KV cache


class FailureKind(enum.StrEnum):
    REFUSED = "refused"            # the effect proves it did nothing (e.g. rejected up front)
    ERROR = "error"                # raised / server error / connection cut
    TIMEOUT = "timeout"            # overran its deadline
    BAD_EVIDENCE = "bad_evidence"  # returned, but the postcondition does not hold
    DIED = "died"                  # the engine or trainer process is gone

    @classmethod
    def of(cls, exc: BaseException) -> FailureKind:
        """The kind an effect's exception is: a timeout, a refusal that proves
        nothing was mutated, or an error (anything else, mutation unknown)."""
        if isinstance(exc, EffectTimeout):
            return cls.TIMEOUT
        if isinstance(exc, EffectError) and not exc.mutation_started:
            return cls.REFUSED
        return cls.ERROR


class Classification(enum.StrEnum):
    NO_MUTATION = "no_mutation"
    INCOMPLETE = "incomplete"
    AMBIGUOUS = "ambiguous"


class UpdateMode(enum.StrEnum):
    """What an update does with the rollouts in flight; each is a row of ``rules.UPDATE_MODES``.

    ``strict`` drains them first (every rollout completes under the version
    it was admitted with); ``keep`` freezes them in the engine
    (``pause(mode=keep)``) and lets them continue under the new version;
    ``recompute`` aborts them at the pause and has their owner resubmit
    prompt + partial output under the new version (the KV is recomputed);
    ``engine_recompute`` freezes them like ``keep`` but has the engine clear
    its caches at the pause (``pause(mode=keep, clear_cache=true)``: vLLM
    preempts the frozen requests), so on resume each is recomputed by the
    new weights inside the engine and continues in the same request.
    """

    STRICT = "strict"
    KEEP = "keep"
    RECOMPUTE = "recompute"
    ENGINE_RECOMPUTE = "engine_recompute"


# --------------------------------------------------------------------------- records

R = TypeVar("R", bound="Record")


@dataclass(frozen=True)
class Record:
    """One output. ``KIND`` is its name in the journal; ``to_data`` its JSON ``data``."""

    KIND: ClassVar[str] = ""

    def to_data(self) -> dict[str, Any]:
        raise NotImplementedError

    @classmethod
    def from_data(cls: type[R], d: Mapping[str, Any]) -> R:
        raise NotImplementedError


def strs(xs: Iterable[object]) -> tuple[str, ...]:
    if isinstance(xs, (str, bytes)):
        raise BadInput("expected a list of strings")
    return tuple(str(x) for x in xs)


class Machine:
    """What every machine is to its shell (``control.shell``): the time of the call it
    decides (``now``, set by the shell), its outbox (``take``), whether anyone listens
    (``recording``: records that change no state are skipped otherwise), and the
    fail-closed switch (``fail_closed``: sticky, the first reason kept; what it
    refuses then is each machine's own decision), which of its records are commits
    (``commits``) and the mark of one not yet on record (``unrecorded``: set and
    cleared by the shell only, never by a replay; each machine refuses admissions,
    retryably, while it is set)."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.recording = False
        #: A commit of this machine is on its way to the journal (or never got there):
        #: nothing may be admitted under it yet (``control.shell``).
        self.unrecorded = False
        self._outbox: list[Record] = []
        self._broken: str | None = None

    def commits(self, record: Record) -> bool:
        """Whether ``record`` publishes something (a version) that nothing may be served
        under before it is on record. None of a machine's records, unless it says so."""
        return False

    def take(self) -> list[Record]:
        """The records made since the last ``take``, in the order they were decided."""
        out, self._outbox = self._outbox, []
        return out

    def fail_closed(self, reason: str) -> None:
        """Refuse what can no longer be recorded (each machine says what that is)."""
        if self._broken is None:
            self._broken = str(reason) or "a record sink failed"


class TypedRecord(Record):
    """A record whose JSON form follows its fields' types (no hand-written codec).

    Field types it knows: ``str``, ``int``, ``float``, ``bool``, a ``StrEnum``,
    ``WeightVersion``, ``WeightIdentity``, ``tuple[str, ...]``, and any of them
    ``| None``. ``to_data`` writes enums as their values and versions and
    identities as their dicts; ``from_data`` reads exactly the fields (an
    unknown key, a missing one without a default, or a value of another type
    raises ``BadInput``), so a record reads back equal to what was written.
    """

    def to_data(self) -> dict[str, Any]:
        return {f.name: jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)}

    @classmethod
    def from_data(cls: type[R], d: Mapping[str, Any]) -> R:
        hints = field_types(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - fields.keys())
        if unknown:
            raise BadInput(f"{cls.KIND}: unknown keys {unknown}")
        kw: dict[str, Any] = {}
        for name, f in fields.items():
            if name not in d:
                if f.default is dataclasses.MISSING and \
                        f.default_factory is dataclasses.MISSING:
                    raise BadInput(f"{cls.KIND}: missing key {name!r}")
                continue
            kw[name] = _decode(f"{cls.KIND}.{name}", hints[name], d[name])
        return cls(**kw)


def _decode(where: str, tp: Any, v: object) -> Any:
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(where, inner, v)
    if origin is tuple:
        if not isinstance(v, list):
            raise BadInput(f"{where}: expected a list, got {type(v).__name__}")
        return tuple(_decode(f"{where}[]", args[0], x) for x in v)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(v)
        except ValueError:
            raise BadInput(f"{where}: {v!r} is not a {tp.__name__}") from None
    if hasattr(tp, "from_dict"):
        if not isinstance(v, Mapping):
            raise BadInput(f"{where}: expected an object")
        return tp.from_dict(v)
    if tp is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if tp in (str, int, float, bool) and (type(v) is not tp):
        raise BadInput(f"{where}: expected {tp.__name__}, got {type(v).__name__}")
    return v
