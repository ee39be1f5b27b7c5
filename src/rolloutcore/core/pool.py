"""The fleet's machine: which replica is in the pool, on which version, and its records.

House rules, as ``core.lifecycle``'s: everything that decides whether a
replica may be routed to lives here, and decides through one table;
nothing here locks, reads a clock or does I/O. The shell
(``control.shell``, driven by ``fleet.coordinator``) runs the machine,
delivers its records to the one journal after its lock is released, and
publishes its ``PoolView`` for the router, which takes it without locking.

The per-engine controller (``core.lifecycle``) decides whether *one* engine
may serve, mutate or publish; it is unchanged under a fleet. The pool adds
one question per replica, *is it in the pool?*, and answers it with
``REPLICA_TRANSITIONS``: the one target of each legal (state, event);
anything else is an ``InvalidTransition`` that changes nothing. Only
``SERVING`` is in the pool, and a replica serves a fleet version as one
engine version (``engine_version``, set when it enters the pool): the
router admits on the replica's controller only if the engine still serves
exactly that version, so an answer's fleet headers always name the version
that produced it.

The two decisions of an update are pure functions of per-replica outcomes:

* ``decide_synchronous``: publish when at least ``quorum`` replicas passed;
  then the failed ones are fenced (tainted: recovered; untouched: kept on
  the old version) and the passed ones serve the new one. Below the quorum
  nothing is published, and the passed replicas, which now hold weights the
  fleet never published, are *withheld* (fenced) until they are back on a
  published version.
* ``plan_waves``: the order and size of a rolling update's waves, refused
  when a wave would leave fewer than ``min_serving`` replicas serving.

Its records (``fleet_*``, ``replica_*``, ``wave*``) are records of the one
journal schema (``core.records.RECORD_TYPES``), typed with these enums.

Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import WeightIdentity, WeightVersion
from rolloutcore.core.vocab import Machine, Record, State, TypedRecord
from rolloutcore.errors import BadInput, InvalidTransition, JournalError, UpdateRefused

__all__ = [
    "IN_POOL",
    "POOL_RECORDS",
    "REPLICA_TRANSITIONS",
    "FleetAbandon",
    "FleetBootstrap",
    "FleetClosed",
    "FleetPublish",
    "FleetRestore",
    "FleetUpdateBegin",
    "FleetUpdateEnd",
    "FleetVersion",
    "Keep",
    "Outcome",
    "PoolView",
    "ReplicaEntry",
    "ReplicaEvent",
    "ReplicaOutcome",
    "ReplicaState",
    "ReplicaStateChange",
    "ReplicaTable",
    "Strategy",
    "SyncDecision",
    "WaveBegin",
    "WaveEnd",
    "decide_synchronous",
    "next_state",
    "plan_waves",
]


class ReplicaState(enum.StrEnum):
    JOINING = "JOINING"        # placed; not yet verified on a fleet version
    SERVING = "SERVING"        # in the pool, on a published fleet version
    UPDATING = "UPDATING"      # out of the pool for a fleet update (or its wave)
    FENCED = "FENCED"          # out of the pool: tainted, or holding unpublished weights
    RECOVERING = "RECOVERING"  # a replacement engine is being started and verified
    REJOINING = "REJOINING"    # being brought onto the fleet's current version
    REMOVED = "REMOVED"        # closed; never routed again


class ReplicaEvent(enum.StrEnum):
    BOOTSTRAPPED = "bootstrapped"  # its engine was taken over, verified, on a fleet version
    SELECTED = "selected"          # picked by a fleet update (or wave)
    PASSED = "passed"              # verified on the update's target, which is published
    KEPT = "kept"                  # the update did not touch it: back on its old version
    WITHHELD = "withheld"          # verified on a target the fleet did not publish
    TAINTED = "tainted"            # its engine taints (update, health watch, data plane)
    RECOVER = "recover"            # recovery starts
    RECOVERED = "recovered"        # replacement verified on a known checkpoint
    REJOIN = "rejoin"              # an update onto the fleet's current version starts
    REJOINED = "rejoined"          # verified on a published fleet version: back in the pool
    FAILED = "failed"              # bootstrap, recovery or rejoin did not succeed
    REMOVE = "remove"


class Strategy(enum.StrEnum):
    SYNCHRONOUS = "synchronous"   # on-policy: every replica moves at once
    ROLLING = "rolling"           # waves; min_serving replicas always serve


class Outcome(enum.StrEnum):
    """How one replica's part of an update ended (its controller's classification)."""

    PASSED = "passed"             # its controller published the target
    NO_MUTATION = "no_mutation"   # refused before anything changed: old version, serving
    AMBIGUOUS = "ambiguous"       # tainted: fenced, recovered on its own
    SKIPPED = "skipped"           # not part of this update (busy, out of the pool)


S, E = ReplicaState, ReplicaEvent

#: (state, event) -> the one state it leads to.
REPLICA_TRANSITIONS: Mapping[tuple[ReplicaState, ReplicaEvent], ReplicaState] = {
    (S.JOINING, E.BOOTSTRAPPED): S.SERVING,
    (S.JOINING, E.FAILED): S.FENCED,
    (S.SERVING, E.SELECTED): S.UPDATING,
    (S.SERVING, E.TAINTED): S.FENCED,
    (S.UPDATING, E.PASSED): S.SERVING,
    (S.UPDATING, E.KEPT): S.SERVING,
    (S.UPDATING, E.WITHHELD): S.FENCED,
    (S.UPDATING, E.TAINTED): S.FENCED,
    (S.FENCED, E.SELECTED): S.UPDATING,   # a ready fenced engine joins the next update
    (S.FENCED, E.RECOVER): S.RECOVERING,
    (S.FENCED, E.REJOIN): S.REJOINING,
    (S.FENCED, E.REJOINED): S.SERVING,    # already verified on the current version
    (S.RECOVERING, E.RECOVERED): S.FENCED,  # then rejoins (or is already on the version)
    (S.RECOVERING, E.FAILED): S.FENCED,
    (S.REJOINING, E.REJOINED): S.SERVING,
    (S.REJOINING, E.FAILED): S.FENCED,
    (S.REJOINING, E.TAINTED): S.FENCED,
    **{(s, E.REMOVE): S.REMOVED for s in S if s is not S.REMOVED},
}

#: The states whose replicas the router may send requests to.
IN_POOL = frozenset({S.SERVING})
#: Events that put a replica in the pool: they must say which engine version serves.
_ENTERS_POOL = frozenset({E.BOOTSTRAPPED, E.PASSED, E.KEPT, E.REJOINED})


def next_state(state: ReplicaState, event: ReplicaEvent) -> ReplicaState:
    """The table's answer, or ``InvalidTransition`` naming both (nothing changes)."""
    to = REPLICA_TRANSITIONS.get((state, event))
    if to is None:
        raise InvalidTransition(event.value, state.value, "not in REPLICA_TRANSITIONS")
    return to


@dataclass(frozen=True)
class SyncDecision:
    publish: bool
    serving: tuple[str, ...]      # on the new version (publish) ...
    kept: tuple[str, ...]         # back on their old version, serving
    withheld: tuple[str, ...]     # hold unpublished weights: fenced until back on a version
    tainted: tuple[str, ...]      # fenced, to be recovered
    reason: str


def decide_synchronous(outcomes: Mapping[str, Outcome], quorum: int) -> SyncDecision:
    """Publish iff at least ``quorum`` replicas passed; say what becomes of each."""
    check_int("quorum", quorum, 1)
    passed = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.PASSED))
    kept = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.NO_MUTATION))
    tainted = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.AMBIGUOUS))
    if len(passed) >= quorum:
        return SyncDecision(True, passed, kept, (), tainted,
                            f"{len(passed)} of {len(outcomes)} passed (quorum {quorum})")
    return SyncDecision(False, (), kept, passed, tainted,
                        f"only {len(passed)} of {len(outcomes)} passed (quorum {quorum}): "
                        "nothing published")


def plan_waves(order: Sequence[str], *, serving: int, min_serving: int,
               wave_size: int | None = None) -> list[tuple[str, ...]]:
    """Waves of a rolling update over ``order`` (the replicas to move, in order).

    ``serving`` is how many replicas serve now (those in ``order`` among
    them). Each wave takes ``wave_size`` of them out of the pool (default:
    as many as ``min_serving`` allows); refused, before anything moves, when
    no wave of at least one replica would keep ``min_serving`` serving.
    """
    names = list(order)
    if len(set(names)) != len(names):
        raise BadInput("a replica appears twice in the rolling order")
    for name, v in (("serving", serving), ("min_serving", min_serving)):
        check_int(name, v)
    room = serving - min_serving
    if wave_size is None:
        wave_size = max(1, room)
    check_int("wave_size", wave_size, 1)
    if not names:
        return []
    if room < wave_size:
        raise BadInput(f"a wave of {wave_size} would leave {serving - wave_size} of {serving} "
                       f"replicas serving, below min_serving={min_serving}")
    return [tuple(names[i:i + wave_size]) for i in range(0, len(names), wave_size)]


# --------------------------------------------------------------------------- versions

@dataclass(frozen=True)
class FleetVersion:
    """A version the fleet published: its generation, label and identity."""

    generation: int
    label: str
    identity: WeightIdentity
    update_id: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"generation": self.generation, "label": self.label,
                "identity_digest": self.identity.digest,
                "verification": self.identity.verification.wire, "update_id": self.update_id}


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class FleetBootstrap(TypedRecord):
    """The fleet's first version: what every replica was taken over on."""

    KIND: ClassVar[str] = "fleet_bootstrap"
    generation: int
    label: str
    identity: WeightIdentity
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class FleetUpdateBegin(TypedRecord):
    """An update starts: its strategy, target and the replicas it takes."""

    KIND: ClassVar[str] = "fleet_update"
    update_id: int
    strategy: Strategy
    generation: int
    label: str
    identity_digest: str
    replicas: tuple[str, ...]
    quorum: int | None
    min_serving: int | None
    transfer: str


@dataclass(frozen=True)
class FleetClosed(TypedRecord):
    """Synchronous: every participant's controller has left READY; nothing is admitted
    anywhere until ``fleet_publish`` or ``fleet_abandon``."""

    KIND: ClassVar[str] = "fleet_closed"
    update_id: int
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class WaveBegin(TypedRecord):
    KIND: ClassVar[str] = "wave"
    update_id: int
    wave: int
    replicas: tuple[str, ...]
    serving: int            # replicas still in the pool while this wave runs


@dataclass(frozen=True)
class WaveEnd(TypedRecord):
    KIND: ClassVar[str] = "wave_end"
    update_id: int
    wave: int
    passed: tuple[str, ...]
    failed: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class ReplicaOutcome(TypedRecord):
    """How one replica's part of an update ended, as its controller classified it."""

    KIND: ClassVar[str] = "replica_outcome"
    update_id: int
    wave: int
    replica: str
    outcome: Outcome
    engine_label: str | None       # the label its engine was given (its own target)
    engine_state: State
    transfer: str                  # fanout | per-engine | fanout+resend
    seconds: float
    reason: str = ""


@dataclass(frozen=True)
class FleetPublish(TypedRecord):
    KIND: ClassVar[str] = "fleet_publish"
    update_id: int
    generation: int
    label: str
    identity: WeightIdentity
    replicas: tuple[str, ...]      # serving it at publication


@dataclass(frozen=True)
class FleetAbandon(TypedRecord):
    KIND: ClassVar[str] = "fleet_abandon"
    update_id: int
    reason: str


@dataclass(frozen=True)
class FleetUpdateEnd(TypedRecord):
    """The update is over: every replica it took was decided, admission reopens.
    ``published``: the generation it published (None: nothing)."""

    KIND: ClassVar[str] = "fleet_update_end"
    update_id: int
    published: int | None


@dataclass(frozen=True)
class FleetRestore(TypedRecord):
    """A fleet gateway started again on this pool's journal (``ReplicaTable.replay``).

    ``records``/``newest``: what the journal held and the newest version it had
    published; ``interrupted``: the update it had in flight (it died with the
    process; each replica's own journal says what its engine was doing). The
    restarted replicas serve ``generation``: the newest version when they were
    verified to hold its weights, else a new version (``new``) for the weights
    they were verified to hold (the start checkpoint, usually): a label is
    never given twice, so nothing recorded before the restart is confused
    with what is served after it.
    """

    KIND: ClassVar[str] = "fleet_restore"
    records: int
    newest: int
    interrupted: int | None
    generation: int
    label: str
    identity: WeightIdentity
    new: bool
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class ReplicaStateChange(TypedRecord):
    """A replica's pool state changed (``REPLICA_TRANSITIONS``).

    ``engine_version`` is the engine version it serves ``generation`` as (set
    when it enters the pool; what the router admits against).
    """

    KIND: ClassVar[str] = "replica_state"
    replica: str
    before: ReplicaState
    after: ReplicaState
    event: ReplicaEvent
    generation: int | None         # the fleet version it serves afterwards, if any
    engine_version: WeightVersion | None
    reason: str = ""


#: The pool's records, for the one schema's registry (``core.records``).
POOL_RECORDS: tuple[type[Record], ...] = (
    FleetBootstrap, FleetUpdateBegin, FleetClosed, WaveBegin, WaveEnd, ReplicaOutcome,
    FleetPublish, FleetAbandon, FleetUpdateEnd, FleetRestore, ReplicaStateChange)


# --------------------------------------------------------------------------- the machine

@dataclass(frozen=True, slots=True)
class ReplicaEntry:
    """One replica as the pool holds it (and publishes it to the router)."""

    name: str
    state: ReplicaState
    generation: int | None               # the fleet version its engine holds, verified
    engine_version: WeightVersion | None  # the engine version it serves that as
    reason: str = ""

    @property
    def in_pool(self) -> bool:
        return self.state in IN_POOL and self.generation is not None


@dataclass(frozen=True)
class PoolView:
    """The pool after the last decision: what the router and the status read."""

    replicas: tuple[ReplicaEntry, ...]
    versions: tuple[FleetVersion, ...]
    closed: str | None          # why admission is closed fleet-wide, or None
    failed_closed: str | None   # the pool cannot record: no update may begin
    update: Mapping[str, Any] | None

    @property
    def newest(self) -> FleetVersion | None:
        return self.versions[-1] if self.versions else None

    def version(self, generation: int | None) -> FleetVersion | None:
        for v in self.versions:
            if v.generation == generation:
                return v
        return None

    def entry(self, name: str) -> ReplicaEntry:
        for r in self.replicas:
            if r.name == name:
                return r
        raise BadInput(f"no replica named {name!r} in this fleet")


class Keep(enum.Enum):
    """``ReplicaTable.move``'s default: the replica keeps what it holds."""

    KEEP = "keep"


class ReplicaTable(Machine):
    """The replica pool of one fleet, sans I/O (see the module docstring).

    Runs in a ``control.shell.Shell``: ``now`` and ``recording`` are set by
    it, ``take`` hands it the records, ``fail_closed`` stops new updates
    (moves are still applied: a replica must be able to leave an update
    whatever the journal did).
    """

    def __init__(self, names: Sequence[str], *, now: float = 0.0) -> None:
        names = list(names)
        if not names or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n for n in names):
            raise BadInput(f"replica names must be distinct non-empty strings: {names}")
        super().__init__(now)
        self._entries: dict[str, ReplicaEntry] = {n: ReplicaEntry(n, S.JOINING, None, None)
                                                  for n in names}
        self._order = names
        self._versions: list[FleetVersion] = []
        self._closed: str | None = None
        self._update: dict[str, Any] | None = None
        #: Set by ``replay``: how many records it read, the last update id, and the
        #: update the journal left open (None: none).
        self.replayed = 0
        self.last_update_id = 0
        self.interrupted: int | None = None

    @classmethod
    def replay(cls, records: Iterable[Any], names: Sequence[str], *,
               now: float = 0.0) -> ReplicaTable:
        """The pool as a previous process's journal left it: its published versions,
        its last update id, the update it had in flight.

        The replicas are not restored: a restart has new engine processes, and
        each rejoins through its own verified takeover (``restore`` then says
        which version they serve). A journal of other replicas is refused.
        """
        t = cls(names, now=now)
        journal_names: tuple[str, ...] | None = None
        for item in records:
            rec = getattr(item, "record", item)
            t.replayed += 1
            if isinstance(rec, FleetBootstrap):
                if t._versions:
                    raise BadInput("the fleet journal holds two bootstraps")
                t._versions = [FleetVersion(rec.generation, rec.label, rec.identity)]
                journal_names = rec.replicas
            elif isinstance(rec, FleetPublish):
                t._follow(FleetVersion(rec.generation, rec.label, rec.identity, rec.update_id))
            elif isinstance(rec, FleetRestore):
                if rec.new:
                    t._follow(FleetVersion(rec.generation, rec.label, rec.identity))
                journal_names, t.interrupted = rec.replicas, None
            elif isinstance(rec, FleetUpdateBegin):
                t.last_update_id = max(t.last_update_id, rec.update_id)
                t.interrupted = rec.update_id
            elif isinstance(rec, FleetUpdateEnd) and t.interrupted == rec.update_id:
                t.interrupted = None
        if t.replayed and not t._versions:
            raise BadInput("the fleet journal has no bootstrap: it is not a fleet's journal")
        if journal_names is not None and sorted(journal_names) != sorted(t._order):
            raise BadInput(f"the fleet journal is of replicas {sorted(journal_names)}; this "
                           f"fleet has {sorted(t._order)}: start it with as many engines, "
                           "or give a new journal directory")
        return t

    def _follow(self, version: FleetVersion) -> None:
        if not self._versions or version.generation != self._versions[-1].generation + 1:
            raise BadInput(f"the fleet journal publishes version {version.generation} out "
                           "of order")
        if any(v.label == version.label for v in self._versions):
            raise BadInput(f"the fleet journal publishes label {version.label!r} twice")
        self._versions.append(version)

    def view(self) -> PoolView:
        return PoolView(tuple(self._entries[n] for n in self._order), tuple(self._versions),
                        self._closed, self._broken,
                        None if self._update is None else dict(self._update))

    def commits(self, record: Record) -> bool:
        """The fleet's versions (bootstrap, publish, a restart's restore): none is shown
        to the router before it is on record."""
        return isinstance(record, (FleetBootstrap, FleetPublish, FleetRestore))

    def entry(self, name: str) -> ReplicaEntry:
        e = self._entries.get(name)
        if e is None:
            raise BadInput(f"no replica named {name!r} in this fleet")
        return e

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._order)

    # ---------------------------------------------------------------- decisions
    def move(self, name: str, event: ReplicaEvent, *,
             generation: int | Keep | None = Keep.KEEP,
             engine_version: WeightVersion | Keep | None = Keep.KEEP, reason: str = "",
             only_from: ReplicaState | None = None) -> ReplicaState:
        """One replica's event (``REPLICA_TRANSITIONS``); returns its new state.

        ``generation``/``engine_version``: what it holds afterwards (default:
        unchanged). An event that puts it in the pool needs both; one that
        takes it out clears them unless given. ``only_from``: apply it only if
        the replica is still in that state (a supervisor's finding about a
        replica an update took meanwhile is moot), else change nothing.
        """
        e = self.entry(name)
        if only_from is not None and e.state is not only_from:
            return e.state
        after = next_state(e.state, event)
        gen = e.generation if isinstance(generation, Keep) else generation
        ver = e.engine_version if isinstance(engine_version, Keep) else engine_version
        if gen is not None and (isinstance(gen, bool) or not isinstance(gen, int)):
            raise BadInput(f"generation must be an int or None, got {gen!r}")
        if ver is not None and not isinstance(ver, WeightVersion):
            raise BadInput(f"engine_version must be a WeightVersion or None, got {ver!r}")
        if event in _ENTERS_POOL and (gen is None or ver is None):
            raise BadInput(f"{event.value}: a replica enters the pool only on a fleet "
                           f"version and the engine version that serves it")
        if gen is not None and gen not in {v.generation for v in self._versions}:
            raise BadInput(f"{name}: fleet version {gen} was never published")
        rec = ReplicaStateChange(name, e.state, after, event, gen, ver, reason[:500])
        self._entries[name] = ReplicaEntry(name, after, gen, ver, reason[:500])
        self._outbox.append(rec)
        return after

    def bootstrap(self, version: FleetVersion) -> None:
        """The fleet's first version (generation 0); the replicas join it one by one."""
        if self._versions:
            raise BadInput("the fleet is already bootstrapped")
        if self._broken is not None:
            raise JournalError(f"the fleet failed closed ({self._broken})")
        self._versions.append(version)
        self._outbox.append(FleetBootstrap(version.generation, version.label,
                                           version.identity, tuple(self._order)))

    def restore(self, version: FleetVersion) -> None:
        """After ``replay``: the restarted replicas serve ``version``, the newest one
        (the same weights) or a new one that follows it (``FleetRestore``)."""
        if not self.replayed or not self._versions:
            raise BadInput("restore follows the replay of a fleet journal")
        if self._broken is not None:
            raise JournalError(f"the fleet failed closed ({self._broken})")
        if self._update is not None:
            raise UpdateRefused("an update is running")
        newest = self._versions[-1]
        new = version != newest
        if new:
            if version.generation != newest.generation + 1 or any(
                    v.label == version.label for v in self._versions):
                raise BadInput(f"a restart serves the newest version ({newest.label}) or "
                               f"a new one after it with a new label, not {version}")
            self._versions.append(version)
        self._outbox.append(FleetRestore(self.replayed, newest.generation, self.interrupted,
                                         version.generation, version.label, version.identity,
                                         new, tuple(self._order)))
        self.interrupted = None

    def begin_update(self, rec: FleetUpdateBegin) -> None:
        """An update starts (one at a time; refused, changing nothing, otherwise)."""
        if self._broken is not None:
            raise UpdateRefused(f"the fleet refuses updates: it failed closed "
                                f"({self._broken})")
        if not self._versions:
            raise UpdateRefused("bootstrap the fleet first")
        if self._update is not None:
            raise UpdateRefused(f"fleet update {self._update['update_id']} is running; one "
                                "at a time")
        if any(v.label == rec.label for v in self._versions):
            raise BadInput(f"fleet label {rec.label!r} was already published")
        if rec.generation != self._versions[-1].generation + 1:
            raise BadInput(f"the next fleet version is {self._versions[-1].generation + 1}, "
                           f"not {rec.generation}")
        self._update = {"update_id": rec.update_id, "strategy": rec.strategy.value,
                        "label": rec.label, "replicas": list(rec.replicas), "wave": 0,
                        "min_serving": rec.min_serving}
        self._outbox.append(rec)

    def _running(self, update_id: int) -> dict[str, Any]:
        if self._update is None or self._update["update_id"] != update_id:
            raise InvalidTransition("fleet update", "idle" if self._update is None else
                                    f"update {self._update['update_id']}",
                                    f"update {update_id} is not the one running")
        return self._update

    def close_admission(self, update_id: int, why: str) -> None:
        """Synchronous: admission closes fleet-wide (every policy answers 503)."""
        self._running(update_id)
        self._closed = why

    def closed(self, update_id: int, replicas: Sequence[str]) -> None:
        """Every participant's controller has left READY (the ``fleet_closed`` record)."""
        self._running(update_id)
        self._outbox.append(FleetClosed(update_id, tuple(replicas)))

    def wave(self, rec: WaveBegin) -> None:
        self._running(rec.update_id)["wave"] = rec.wave
        self._outbox.append(rec)

    def note(self, rec: WaveEnd | ReplicaOutcome | FleetAbandon) -> None:
        """A record of the running update that changes nothing in the pool."""
        self._running(rec.update_id)
        self._outbox.append(rec)

    def publish(self, version: FleetVersion, replicas: Sequence[str]) -> None:
        """The running update's target is published (its first passing replicas)."""
        self._running(version.update_id or 0)
        newest = self._versions[-1]
        if version.generation != newest.generation + 1:
            raise BadInput(f"fleet version {version.generation} does not follow "
                           f"{newest.generation}")
        self._versions.append(version)
        self._outbox.append(FleetPublish(version.update_id or 0, version.generation,
                                         version.label, version.identity, tuple(replicas)))

    def end_update(self, update_id: int) -> None:
        """The running update is over: admission reopens (after its outcome was recorded)."""
        self._running(update_id)
        self._update = None
        self._closed = None
        newest = self._versions[-1]
        self._outbox.append(FleetUpdateEnd(
            update_id, newest.generation if newest.update_id == update_id else None))
