"""What the controller and the runner output: typed records, and the journal's schema.

Every output of the controller (``core.lifecycle``) and of the runner
(``control.runner``) is one of the frozen record classes below; listeners
receive the objects themselves and match on their types. The journal
(``control.journal``) writes each as one JSON line through ``to_data`` and
reads it back through ``decode``; the invariant checker (``core.invariants``),
the crash restore, the metrics and the audit read the typed records.
``docs/journal-schema.md`` documents every field.

The vocabulary that appears in records lives here too (``State``, ``Event``,
``Step``, ``FailureKind``, ``Classification``), so the schema is one module;
``core.lifecycle`` re-exports it and holds the tables that use it.

Why typed records rather than (kind, dict) pairs: a consumer that matches on
a class cannot misspell a kind or a key, and mypy sees every field. The JSON
form is built only when something is written (the journal's writer thread),
never on the controller's path.

``SCHEMA_VERSION`` is written in every journal line (``"v"``). It changes
whenever a record gains, loses or changes the meaning of a field. A reader
decodes the versions in ``READABLE_VERSIONS`` (version 1 lines, written
before the number existed, carry no ``"v"``) and refuses any other, naming
it, rather than guess.

Standard library only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol, TypeVar

from rolloutcore.core.adapters import ADAPTER_RECORDS
from rolloutcore.core.evidence import Evidence, evidence_from_dict, evidence_to_dict, jsonable
from rolloutcore.core.lease import LEASE_RECORDS
from rolloutcore.core.pool import POOL_RECORDS
from rolloutcore.core.strict import check_obj, exact_keys
from rolloutcore.core.versions import VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.core.vocab import (  # re-exported: the one schema module
    Classification,
    Event,
    FailureKind,
    Record,
    State,
    Step,
    TypedRecord,
    UpdateMode,
    strs,
)
from rolloutcore.errors import JournalError

__all__ = [
    "KINDS",
    "READABLE_VERSIONS",
    "RECORD_TYPES",
    "SCHEMA_VERSION",
    "Abandon",
    "Admit",
    "BeginRecovery",
    "BeginUpdate",
    "Carry",
    "Classification",
    "Commit",
    "Compacted",
    "Complete",
    "Effect",
    "Event",
    "EvidenceSeen",
    "Failure",
    "FailureKind",
    "Interrupted",
    "JournalRecord",
    "Note",
    "Record",
    "Refuse",
    "RequestSleep",
    "RequestUpdate",
    "RequestWake",
    "Restore",
    "State",
    "Step",
    "Taint",
    "Transition",
    "UpdateMode",
    "Verdict",
    "decode",
    "fields_dict",
    "fields_from_dict",
]

class _Dataclass(Protocol):
    """Any dataclass instance (what ``dataclasses.fields`` takes)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


_D = TypeVar("_D", bound=_Dataclass)

#: The journal schema's version; see docs/journal-schema.md for what changed.
#: 3 added the ``carry`` record (asynchronous updates, issue 20) and the
#: ``request_sleep``/``request_wake`` records (colocated sleep and wake, issue 21).
#: 4 added the fleet's records (``core.pool``: ``fleet_*``, ``replica_*``, ``wave*``),
#: which a fleet gateway writes to the same journal format as one engine's, and the
#: trainer protocol's ``lease`` record (``core.lease``).
#: 5 added the ``interrupted`` record (the engine's owner interrupted: what it was
#: doing, and how the update it had open was ended).
#: 6 added the ``adapter`` record (``core.adapters``: a LoRA-adapter version's states).
SCHEMA_VERSION = 6
#: Versions this reader decodes (1: lines without ``"v"``).
READABLE_VERSIONS = frozenset({1, 2, 3, 4, 5, 6})


# ``Admit``, ``Complete`` and ``Refuse`` are written once per request: their codecs are
# written out (about 7x faster than ``TypedRecord``'s, which reads the fields' types).
# The records of updates, sleeps and recoveries are ``TypedRecord``s.


@dataclass(frozen=True)
class Admit(Record):
    """A rollout was admitted (bound to the committed version)."""

    KIND: ClassVar[str] = "admit"
    rollout_id: str
    version: WeightVersion
    identity_digest: str

    def to_data(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "version": self.version.to_dict(),
                "identity_digest": self.identity_digest}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Admit:
        return cls(str(d["rollout_id"]), WeightVersion.from_dict(d["version"]),
                   str(d["identity_digest"]))


@dataclass(frozen=True)
class Complete(Record):
    """A rollout's binding was released."""

    KIND: ClassVar[str] = "complete"
    rollout_id: str
    version: WeightVersion
    state: State
    attributable: bool

    def to_data(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "version": self.version.to_dict(),
                "state": self.state.value, "attributable": self.attributable}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Complete:
        return cls(str(d["rollout_id"]), WeightVersion.from_dict(d["version"]), State(d["state"]),
                   bool(d["attributable"]))


@dataclass(frozen=True)
class Compacted(TypedRecord):
    """What a journal's snapshot left out (``control.journal``): never a line of the file.

    A restart replays the snapshot (every record a restore needs, and the admissions
    still open) and the file's tail after it, not every request ever served. The
    finished requests' ``admit``/``complete`` pairs and the refusals are left out;
    only their count survives, and how many completions were attributable (the
    admission capacity counts those). ``through_seq``: the snapshot's last ``seq``.
    """

    KIND: ClassVar[str] = "compacted"
    through_seq: int
    requests: int
    accepted: int


@dataclass(frozen=True)
class Refuse(Record):
    """An admission was refused."""

    KIND: ClassVar[str] = "refuse"
    rollout_id: str
    state: State
    reason: str

    def to_data(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "state": self.state.value, "reason": self.reason}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Refuse:
        return cls(str(d["rollout_id"]), State(d["state"]), str(d["reason"]))


@dataclass(frozen=True)
class RequestUpdate(Record):
    """An update was opened (admission closes)."""

    KIND: ClassVar[str] = "request_update"
    update_id: int
    owner: str
    target: WeightVersion
    identity: WeightIdentity
    active_rollouts: int
    min_verification: VerificationLevel = VerificationLevel.DECLARED  # since version 2

    def to_data(self) -> dict[str, Any]:
        return {"update_id": self.update_id, "owner": self.owner,
                "target": self.target.to_dict(), "identity": self.identity.to_dict(),
                "active_rollouts": self.active_rollouts,
                "min_verification": self.min_verification.wire}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> RequestUpdate:
        return cls(int(d["update_id"]), str(d["owner"]), WeightVersion.from_dict(d["target"]),
                   WeightIdentity.from_dict(d["identity"]), int(d["active_rollouts"]),
                   VerificationLevel.parse(str(d.get("min_verification", "declared"))))


@dataclass(frozen=True)
class RequestSleep(TypedRecord):
    """A sleep was opened (admission closes; since version 3).

    ``level`` is vLLM's: 1 offloads the weights to host memory, 2 discards
    them (a wake then needs an update that writes every parameter).
    """

    KIND: ClassVar[str] = "request_sleep"
    sleep_id: int
    owner: str
    level: int
    active_rollouts: int


@dataclass(frozen=True)
class RequestWake(RequestUpdate):
    """The owner of a sleeping engine wakes it: an update opened while asleep (version 3).

    ``restore`` is a wake on the engine's own weights: ``target`` is then the
    committed version itself, verified against the checksums taken before
    the sleep; it ends with an ``abandon`` (the committed version serves
    again, nothing is published). Otherwise ``target`` is a fresh version,
    as in ``request_update``. It is a ``request_update``
    (every consumer that follows updates follows this one) with the sleep's
    level and which kind of wake it is.
    """

    KIND: ClassVar[str] = "request_wake"
    level: int = 2
    restore: bool = False

    def to_data(self) -> dict[str, Any]:
        return {**super().to_data(), "level": self.level, "restore": self.restore}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> RequestWake:
        base = RequestUpdate.from_data(d)
        return cls(base.update_id, base.owner, base.target, base.identity,
                   base.active_rollouts, base.min_verification, int(d["level"]),
                   bool(d["restore"]))


@dataclass(frozen=True)
class Transition(Record):
    """The controller's state changed; ``duration_s`` is the time spent in ``before``."""

    KIND: ClassVar[str] = "transition"
    before: State
    after: State
    event: Event
    duration_s: float

    def to_data(self) -> dict[str, Any]:
        return {"from": self.before.value, "to": self.after.value, "event": self.event.value,
                "duration_s": self.duration_s}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Transition:
        return cls(State(d["from"]), State(d["to"]), Event(d["event"]),
                   float(d["duration_s"]))


@dataclass(frozen=True)
class EvidenceSeen(Record):
    """Evidence an effect returned, and what the controller found wrong with it."""

    KIND: ClassVar[str] = "evidence"
    event: Event
    evidence: Evidence
    problems: tuple[str, ...]

    def to_data(self) -> dict[str, Any]:
        return {"event": self.event.value, "evidence": evidence_to_dict(self.evidence),
                "problems": list(self.problems)}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> EvidenceSeen:
        return cls(Event(d["event"]), evidence_from_dict(d["evidence"]), strs(d["problems"]))


@dataclass(frozen=True)
class Verdict(TypedRecord):
    """What the controller made of one event: returned to the caller, and recorded."""

    KIND: ClassVar[str] = "verdict"
    event: Event
    accepted: bool
    before: State
    after: State
    classification: Classification | None = None
    problems: tuple[str, ...] = ()
    published: WeightVersion | None = None

    @property
    def tainted(self) -> bool:
        return self.after is State.TAINTED


@dataclass(frozen=True)
class BeginUpdate(TypedRecord):
    """The mutation may start: from here the target's label is never reused."""

    KIND: ClassVar[str] = "begin_update"
    update_id: int
    target: WeightVersion


@dataclass(frozen=True)
class Carry(TypedRecord):
    """An asynchronous update paused the engine with rollouts bound (since version 3).

    ``carried`` continue across the update (kept, or resubmitted by their
    owner) and, once the target is published, under it; ``over_bound``
    would have had tokens more than ``max_staleness`` published versions
    old, so their bindings are released here, unattributable (each gets its
    ``complete`` record right after this one): reported, never dropped
    silently.
    """

    KIND: ClassVar[str] = "carry"
    update_id: int
    mode: UpdateMode
    carried: tuple[str, ...]
    over_bound: tuple[str, ...] = ()
    max_staleness: int | None = None


@dataclass(frozen=True)
class Commit(TypedRecord):
    """A version was published (bootstrap, update or recovery)."""

    KIND: ClassVar[str] = "commit"
    version: WeightVersion
    identity: WeightIdentity


@dataclass(frozen=True)
class Abandon(TypedRecord):
    """An update that mutated nothing ended, or a restore (a wake on the engine's own
    weights) was verified: the old version serves again."""

    KIND: ClassVar[str] = "abandon"
    update_id: int
    target: WeightVersion


@dataclass(frozen=True)
class Failure(TypedRecord):
    """An effect failed (as reported through ``fail``)."""

    KIND: ClassVar[str] = "failure"
    step: Step
    kind: FailureKind
    reason: str


@dataclass(frozen=True)
class Taint(TypedRecord):
    """The engine may serve anything: nothing is admitted or published until recovery."""

    KIND: ClassVar[str] = "taint"
    problems: tuple[str, ...]
    target: WeightVersion | None


@dataclass(frozen=True)
class BeginRecovery(TypedRecord):
    KIND: ClassVar[str] = "begin_recovery"
    owner: str


@dataclass(frozen=True)
class Restore(Record):
    """A controller was rebuilt from its journal (written before any taint it implies)."""

    KIND: ClassVar[str] = "restore"
    state: State
    active_rollouts: int
    in_flight_update: RequestUpdate | None

    def to_data(self) -> dict[str, Any]:
        u = self.in_flight_update
        return {"state": self.state.value, "active_rollouts": self.active_rollouts,
                "in_flight_update": None if u is None else u.to_data()}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Restore:
        u = d.get("in_flight_update")
        return cls(State(d["state"]), int(d["active_rollouts"]),
                   None if u is None else RequestUpdate.from_data(u))


@dataclass(frozen=True)
class Effect(Record):
    """The runner ran one effect (its duration, whether it returned)."""

    KIND: ClassVar[str] = "effect"
    step: str
    seconds: float
    ok: bool
    error: str | None = None

    def to_data(self) -> dict[str, Any]:
        return {"what": "effect", "step": self.step, "seconds": self.seconds, "ok": self.ok,
                "error": self.error}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Effect:
        e = d.get("error")
        return cls(str(d["step"]), float(d["seconds"]), bool(d["ok"]),
                   None if e is None else str(e))


@dataclass(frozen=True)
class Note(Record):
    """Something the runner saw that is not an effect (a failed cancel, a health miss)."""

    KIND: ClassVar[str] = "note"
    what: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def to_data(self) -> dict[str, Any]:
        return {"what": self.what, **self.fields}

    @classmethod
    def from_data(cls, d: Mapping[str, Any]) -> Note:
        rest = dict(d)
        return cls(str(rest.pop("what")), rest)


@dataclass(frozen=True)
class Interrupted(TypedRecord):
    """The engine's owner was interrupted (Ctrl-C, ``SystemExit``): its last record before
    the journal closes (since version 5).

    ``cause`` is the exception's name, ``phase`` what was interrupted (the TRL
    integration writes ``bootstrap``, ``trainer_setup``, ``generation``, ``update``,
    ``reward``, ``training``, ``finishing``), ``step`` the trainer's step. ``update_id``
    is the update that was open (its ``request_update``) and ``update_state`` the state
    it was in; ``outcome`` is how it was ended before this record (``no_mutation``: the
    old version serves again, with its ``abandon``; ``ambiguous``: TAINTED and fenced,
    with its ``taint``); all three are null when no update was open. ``state`` and
    ``committed`` are what the controller holds as the journal closes, ``rollouts`` the
    rollouts still bound then (a restore releases them unattributable).
    """

    KIND: ClassVar[str] = "interrupted"
    cause: str
    phase: str
    step: int | None
    state: State
    committed: WeightVersion | None
    update_id: int | None = None
    update_state: State | None = None
    outcome: Classification | None = None
    rollouts: int = 0
    detail: str = ""


#: Kind -> record class: the whole schema (the engine's, the fleet pool's, the leases').
_ENGINE_RECORDS: tuple[type[Record], ...] = (
    Admit, Complete, Refuse, RequestUpdate, Transition, EvidenceSeen, Verdict, BeginUpdate,
    Commit, Abandon, Failure, Taint, BeginRecovery, Restore, Effect, Note, Carry,
    RequestSleep, RequestWake, Interrupted)
RECORD_TYPES: Mapping[str, type[Record]] = {
    t.KIND: t for t in (*_ENGINE_RECORDS, *POOL_RECORDS, *LEASE_RECORDS, *ADAPTER_RECORDS)}

KINDS = frozenset(RECORD_TYPES)


def decode(kind: str, data: Mapping[str, Any]) -> Record:
    """The typed record of one (kind, data) pair; ``JournalError`` if it is not one."""
    t = RECORD_TYPES.get(kind)
    if t is None:
        raise JournalError(f"unknown record kind {kind!r}")
    try:
        return t.from_data(data)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:  # BadInput is a ValueError
        raise JournalError(f"bad {kind} record: {exc!r}") from exc


def fields_dict(obj: _Dataclass, **extra: object) -> dict[str, Any]:
    """A dataclass's JSON form: its fields in order, each as ``jsonable`` writes it (an enum
    as its value, a nested object as its ``to_dict``, a tuple as a list, a mapping as a
    dict), then ``extra`` (what is derived, not stored). The one ``to_dict`` of the plain
    report and record classes (a ``TypedRecord``'s ``to_data`` is the same, without extras).
    """
    names = _FIELD_NAMES.get(type(obj))
    if names is None:
        names = _FIELD_NAMES[type(obj)] = tuple(f.name for f in fields(obj))
    out: dict[str, Any] = {}
    for name in names:
        v = getattr(obj, name)
        out[name] = v if type(v) in _PLAIN else jsonable(v)  # per sample: skip the plain
    out.update(extra)
    return out


def fields_from_dict(cls: type[_D], where: str, d: object, note: str = "") -> _D:
    """``fields_dict``'s inverse for a class whose fields are all JSON values its own
    ``__post_init__`` checks: ``d`` must be an object with exactly the field names
    (``BadInput`` naming ``where``; ``note`` says what an unknown key may be)."""
    m = check_obj(where, d)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    exact_keys(where, m, names, note=note)
    return cls(**{k: m[k] for k in names})


#: ``fields_dict``'s per-class field names, and the values it writes as they are.
_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_PLAIN = frozenset({str, int, float, bool, type(None)})


# --------------------------------------------------------------------------- the journal line

@dataclass(frozen=True)
class JournalRecord:
    """One journal line: the journal's sequence number and clocks around a record.

    ``kind`` and ``data`` are the record's JSON form, for people and tools
    that read lines; code matches on ``record``.
    """

    seq: int
    t_mono: float
    t_wall: float
    record: Record

    @property
    def kind(self) -> str:
        return self.record.KIND

    @property
    def data(self) -> dict[str, Any]:
        return self.record.to_data()

    def to_json(self) -> str:
        return json.dumps({"v": SCHEMA_VERSION, "seq": self.seq, "t_mono": self.t_mono,
                           "t_wall": self.t_wall, "kind": self.kind, "data": self.data},
                          sort_keys=True)

    @classmethod
    def from_obj(cls, obj: object, where: str) -> JournalRecord:
        if not isinstance(obj, Mapping):
            raise JournalError(f"{where}: not a journal record")
        v = obj.get("v", 1)
        if v not in READABLE_VERSIONS:
            raise JournalError(
                f"{where}: journal schema version {v!r} is not readable here (this reader "
                f"knows {sorted(READABLE_VERSIONS)}); use a newer RolloutCore")
        try:
            seq, t_mono, t_wall = int(obj["seq"]), float(obj["t_mono"]), float(obj["t_wall"])
            kind, data = str(obj["kind"]), obj["data"]
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalError(f"{where}: not a journal record") from exc
        if not isinstance(data, Mapping):
            raise JournalError(f"{where}: not a journal record")
        try:
            rec = decode(kind, data)
        except JournalError as exc:
            raise JournalError(f"{where}: {exc}") from exc
        return cls(seq, t_mono, t_wall, rec)
