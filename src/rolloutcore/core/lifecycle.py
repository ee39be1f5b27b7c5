"""The lifecycle controller of one inference engine: states, transitions, invariants.

House rules (after h11's ``_state.py``):

* Everything that decides *whether* the engine may serve, mutate or publish
  lives in this file, and it decides through tables: ``TRANSITIONS`` names
  the one target of each legal (state, event), or the one named outcome
  table (``Lookup``) that picks it; ``FAIL_STEPS`` says which failure-policy
  row a reported failure falls in; ``FAILURE_POLICY`` classifies it and
  ``FAILURE_TARGETS`` says where the class leads. A (state, event) with no
  entry is one ``InvalidTransition`` naming both, and changes nothing.
* It performs no I/O: it never talks to an engine, a trainer, a socket or a
  file. Adapters perform effects and hand back typed evidence
  (``rolloutcore.core.evidence``); the controller checks the evidence's
  postcondition and advances, waits, refuses or taints.
* Its outputs are typed records (``rolloutcore.core.records``, the journal
  schema). Every change of durable state (the state, the committed version,
  the bindings, the update in flight, the burnt labels) is made by applying
  such a record, through the ``_apply_*`` methods, and by nothing else; a
  crash restore replays the journal's records through the same methods
  (``restore``), so the restored controller is what the journal says.
* It knows nothing of vLLM, HTTP or tensors. Standard library only.

Theory of operation
-------------------

Rollouts are admitted only in READY. Admission binds the rollout to the
committed ``WeightVersion`` and ``WeightIdentity``; completion releases the
binding. An update has exactly one owner (single writer): ``request_update``
in READY returns an ``UpdateTicket`` and closes admission (DRAINING). The
owner then feeds the controller evidence, step by step::

    READY --request_update--> DRAINING --drained--> QUIESCED --preflighted-->
    UPDATING --transferred--> INVALIDATING --invalidated--> VALIDATING
    --validated--> RESUMING --resumed--> READY (target published)

Evidence that does not establish its step's postcondition is a failure of
that step (``FailureKind.BAD_EVIDENCE``) and takes the failure path below.
``drained`` is accepted only when the engine reports paused with nothing in
flight *and* no rollout is bound locally; otherwise the drain is incomplete
and the controller stays in DRAINING (retried within the drain deadline).
So no mutation can begin while a rollout admitted under the old version is
active, and a rollout always completes under the version it was admitted
with. The target is published only on ``resumed``, after transfer, cache
invalidation, a validation while paused, and the resume (plus a live
validation with admission still closed, when the engine can only run its
probes while resumed) all produced evidence that holds.

Failures go through one table, ``FAILURE_POLICY``, keyed by (step, kind):

* ``no_mutation``: the failure proves the weights did not change. The update
  is abandoned; the engine is resumed on the old version (RESUMING with no
  target), and READY admits again under the old version.
* ``incomplete``: the observation was incomplete (a reset said
  ``success: false``, a label could not be read). The state does not change;
  the owner may retry, at most ``max_incomplete`` times, after which the
  failure escalates to the class in ``ESCALATION``.
* ``ambiguous``: a mutation may have started and its outcome is unknown.
  TAINTED: nothing is published, nothing is admitted, and only the recovery
  path (a replacement engine loading a checkpoint of known identity, verified
  like an update) leads back to READY, under a new engine epoch.

Outside any update, the engine can still fail: it dies, restarts on its own
(a new epoch, loading whatever its start checkpoint holds, not the committed
version) or stops answering. Whoever watches its health reports that as a
``fail`` in READY with ``Step.SERVE`` and no ticket; it is always
ambiguous, so the engine is TAINTED and leaves service until a recovery.
Rollouts still bound then complete unattributable. A controller restored
from a journal that ends mid-update (or mid-recovery) fails the same way,
with ``Step.RESTART``: whatever step was reached, its outcome is unknown.

Stragglers: the drain deadline
------------------------------

A rollout that never ends (a client that stopped reading its stream, a
generation that outlives the drain deadline) would hold every update
hostage. When the drain deadline expires the update's owner may abort the
stragglers (``abort_rollouts``, DRAINING only, with the ticket): each
binding is released *unattributable* (a ``complete`` record with
``attributable: false`` in DRAINING, which nothing else produces), so
nothing it received is ever credited to a version, and the update goes on.
Aborting a binding decides nothing about the engine: the drain step that
follows still needs the engine paused with nothing in flight before any
mutation may start. The rollout's own ``complete`` then answers with the
same unattributable completion instead of an error, so its caller learns
what happened to it.
Colocated training (a trainer and the engine on one GPU)
--------------------------------------------------------

``request_sleep`` in READY closes admission for a sleep (DOZING); once the
bound rollouts finished and the engine reports asleep, ``slept`` leads to
SLEEPING, where nothing is admitted, transferred or reset. The sleep's
owner wakes it with ``request_wake``: a colocated update (a fresh target,
its preflight checked up front: a refusal leaves the engine asleep) or a
restore (the committed version, on the engine's own weights). Each wake
call's evidence (``woke``) goes through ``WAKE_TARGETS``: an update wakes the
weights (WAKING), writes them (WARMING), wakes the KV cache; a restore wakes
everything at once; both then reset the caches and validate while paused,
where only a passing check of every engine parameter (coverage 1.0) lets a
woken engine serve. Failures after the first wake call taint (there is no
old version to resume); a sleep refused before it reached the engine
serves on.

Records leave the lock before anyone reads them
-----------------------------------------------

One lock guards the state (no reliance on the GIL); one condition variable
wakes whoever waits for the active rollouts to drain. Nothing runs under
that lock but the decision itself: a decision appends its records to an
outbox (a deque: its order is the order of decisions, so the order of
records is the order of events), and the thread that made it, once it has
left the lock, delivers the outbox to the listeners, in order, under a
second lock that only serialises delivery. A listener (the journal, the
metrics, the gateway's wake-up) therefore never runs under the state lock,
and a slow or failing one cannot leave a decision half made.

Calls on the data plane (``admit``, ``complete``) do not wait for delivery:
if another thread is delivering, it delivers their records too. Every other
call returns only after its records were delivered, and after every
``Sink`` (a listener that writes asynchronously: the journal's writer
thread) confirmed them durable, so a published version is in the journal
before anyone is told. A listener or sink that fails puts the controller
in a fail-closed condition (``fail_closed``): from then on admissions,
updates, evidence and recovery are refused with a clear error, because the
controller can no longer record what it would decide. The in-memory state
is consistent (each decision is applied whole, under the lock), but the
journal may lack the last records; a restart restores from the journal.

A failure (``fail``) is still applied after the controller failed closed,
and always as *ambiguous*: a controller that cannot record cannot prove a
return to the old version either, and an update left half-way in memory
would refuse every later begin as "in progress" forever. So a journal that
fails mid-update ends the update TAINTED (in memory; the journal may lack
the taint), and the runner fences the engine.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    DrainEvidence,
    Evidence,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    SleepEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
    WakeEvidence,
)
from rolloutcore.core.records import (
    Abandon,
    Admit,
    BeginRecovery,
    BeginUpdate,
    Carry,
    Classification,
    Commit,
    Complete,
    Event,
    EvidenceSeen,
    Failure,
    FailureKind,
    JournalRecord,
    Record,
    Refuse,
    RequestSleep,
    RequestUpdate,
    RequestWake,
    Restore,
    State,
    Step,
    Taint,
    Transition,
    UpdateMode,
    Verdict,
)
from rolloutcore.core.rules import (
    ABORT_STEPS,
    ESCALATION,
    FAIL_STEPS,
    FAILURE_POLICY,
    FAILURE_TARGETS,
    OUTCOMES,
    RESETS_DONE,
    STEP_STATE,
    TRANSITIONS,
    UPDATE_MODES,
    WAKE_TARGETS,
    Lookup,
    ModeRule,
    targets,
)
from rolloutcore.core.versions import (
    Binding,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
    generation_of,
    label_for,
)
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    InvalidTransition,
    JournalError,
    UpdateRefused,
)

__all__ = [
    "ABORT_STEPS",
    "ESCALATION",
    "FAILURE_POLICY",
    "FAILURE_TARGETS",
    "FAIL_STEPS",
    "OUTCOMES",
    "RESETS_DONE",
    "STEP_STATE",
    "TRANSITIONS",
    "WAKE_TARGETS",
    "Binding",
    "Classification",
    "Completion",
    "ControllerConfig",
    "Event",
    "FailureKind",
    "LifecycleController",
    "Listener",
    "Lookup",
    "Sink",
    "SleepTicket",
    "State",
    "Step",
    "UpdateMode",
    "UpdateTicket",
    "Verdict",
    "targets",
]

S, E = State, Event
_NM, _INC, _AMB = Classification.NO_MUTATION, Classification.INCOMPLETE, Classification.AMBIGUOUS
_ALL_BUT_UNINIT = tuple(s for s in State if s is not S.UNINITIALIZED)
_IDLE_POLL_S = 0.1
_UPDATE_STATES = (S.DRAINING, S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING,
                  S.RESUMING)
#: Rollouts released by ``abort_rollouts`` whose own ``complete`` has not come yet.
_ABORTED_KEPT = 4096
_OVER_BOUND_KEPT = 4096  # rollout ids ended over the staleness bound, remembered for owners
#: Colocated training: the states a sleep owns (DOZING, SLEEPING) or its wake (all four).
_SLEEP_STATES = (S.DOZING, S.SLEEPING, S.WAKING, S.WARMING)


@dataclass(frozen=True)
class ControllerConfig:
    max_incomplete: int = 3
    retry_after_s: float = 1.0     # admission hint while an update runs
    recovering_retry_after_s: float = 5.0
    #: What updates do with rollouts in flight (a row of ``rules.UPDATE_MODES``).
    update_mode: UpdateMode = UpdateMode.STRICT
    #: Asynchronous modes: no rollout may hold a token more than this many
    #: published versions old; one that would is ended (unattributable,
    #: reported in the ``carry`` record). ``None``: unbounded.
    max_staleness: int | None = None
    #: With ``max_staleness``: admit at most ``(k + v + 1) * admission_batch
    #: - (accepted + running)`` rollouts (AReaL's capacity; ``v`` updates
    #: published, ``accepted`` attributable completions). ``None``: no cap.
    admission_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_incomplete < 0 or self.retry_after_s <= 0 or self.recovering_retry_after_s <= 0:
            raise BadInput("ControllerConfig values must be positive")
        if not isinstance(self.update_mode, UpdateMode):
            raise BadInput(f"update_mode must be an UpdateMode "
                           f"({', '.join(m.value for m in UpdateMode)}), got "
                           f"{self.update_mode!r}")
        for name in ("max_staleness", "admission_batch"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0
                                  or (name == "admission_batch" and v == 0)):
                raise BadInput(f"{name} must be None or an int >= "
                               f"{1 if name == 'admission_batch' else 0}, got {v!r}")
        if self.admission_batch is not None and self.max_staleness is None:
            raise BadInput("admission_batch needs max_staleness (the capacity is "
                           "(max_staleness + version + 1) * admission_batch)")


@dataclass(frozen=True)
class Completion:
    binding: Binding
    completed_at: float
    state: State
    committed: WeightVersion | None
    #: True when the version the rollout was bound to is still what the engine
    #: is known to serve (False e.g. if the engine was tainted meanwhile).
    attributable: bool
    #: Why a policy abort released it (``abort_rollouts``), else None.
    aborted: str | None = None


@dataclass(frozen=True)
class UpdateTicket:
    """Proof of update ownership; every step of the update must present it."""

    update_id: int
    target: UpdateTarget
    min_verification: VerificationLevel


#: A listener receives every record, in order, outside the controller's lock.
Listener = Callable[[Record], None]


@runtime_checkable
class Sink(Protocol):
    """A listener that writes asynchronously (the journal's writer thread).

    ``sync`` blocks until every record it accepted is durable (or raises);
    ``on_failure`` registers whom to tell when a write fails later.
    """

    def __call__(self, record: Record) -> None: ...

    def sync(self) -> None: ...

    def on_failure(self, callback: Callable[[str], None]) -> None: ...


@dataclass(frozen=True)
class SleepTicket:
    """Proof of owning a sleep: the sleep's steps and the wake's request present it."""

    sleep_id: int
    owner: str
    level: int


@dataclass
class _Update:
    """The update in flight: the ticket (durable, from its record) and working memory."""

    ticket: UpdateTicket
    request: RequestUpdate
    aborting: bool = False          # RESUMING to return to the *old* version
    mutation_started: bool = False
    incomplete: dict[Step, int] = field(default_factory=dict)
    reset_ok: set[CacheKind] = field(default_factory=set)
    validations: list[ValidationEvidence] = field(default_factory=list)
    mode: UpdateMode = UpdateMode.STRICT
    carry: Carry | None = None      # asynchronous modes: who was bound at the pause

    @property
    def rule(self) -> ModeRule:
        return UPDATE_MODES[self.mode]
    wake: int | None = None         # the sleep level this update wakes from (colocated)
    restore: bool = False           # a wake on the engine's own weights, no transfer


class LifecycleController:
    """The sans-I/O lifecycle of one engine. Thread-safe. See the module docstring.

    ``clock`` is the only time source (``wait_idle``, transition durations,
    binding times): inject a fake one to test timing without sleeping.
    """

    def __init__(self, *, config: ControllerConfig | None = None,
                 required_caches: tuple[CacheKind, ...] = tuple(CacheKind),
                 clock: Callable[[], float] = time.monotonic,
                 listener: Listener | None = None) -> None:
        if not required_caches or CacheKind.PREFIX not in required_caches:
            raise BadInput("the prefix cache must be among the required cache resets")
        self._cfg = config or ControllerConfig()
        self._required_caches = frozenset(required_caches)
        self._clock = clock
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        # Delivery (outside the state lock): copy-on-write lists, so a delivery
        # iterates a list no one appends to.
        self._listeners: list[Listener] = []
        self._sinks: list[Sink] = []
        self._outbox: collections.deque[Record] = collections.deque()
        self._deliver_lock = threading.Lock()
        self._delivering: int | None = None  # the delivering thread, against re-entry
        self._broken: str | None = None
        # Durable state: changed only by the _apply_* methods.
        self._state = S.UNINITIALIZED
        self._committed: WeightVersion | None = None
        self._identity: WeightIdentity | None = None
        self._published: list[WeightVersion] = []
        self._active: dict[str, Binding] = {}
        # Working memory, not durable: bindings a policy abort released, kept so
        # that the rollout's own ``complete`` can say so (bounded, oldest dropped).
        self._aborted: collections.OrderedDict[str, Completion] = collections.OrderedDict()
        self._update: _Update | None = None
        self._next_update_id = 1
        self._sleep: SleepTicket | None = None  # the sleep in progress (colocated training)
        self._next_sleep_id = 1
        self._max_generation = -1
        self._used_labels: set[str] = set()   # published, or burnt at begin_update
        self._engine_epoch: str | None = None
        # Asynchronous modes (issue 20): the version each carried rollout continues
        # under, rollouts ended over the staleness bound (recent ones), whether a
        # deferred prefix reset is still to be done, attributable completions.
        self._continues: dict[str, WeightVersion] = {}
        self._over_bound: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._sweep_due = False
        self._accepted = 0
        # Timing, for history() and the transition records.
        self._entered_at = clock()
        self._history: list[tuple[State, State, Event, float, float]] = []
        if listener is not None:
            self.add_listener(listener)

    # ---------------------------------------------------------------- queries
    @property
    def state(self) -> State:
        with self._lock:
            return self._state

    @property
    def committed(self) -> WeightVersion | None:
        with self._lock:
            return self._committed

    @property
    def identity(self) -> WeightIdentity | None:
        with self._lock:
            return self._identity

    @property
    def published(self) -> tuple[WeightVersion, ...]:
        with self._lock:
            return tuple(self._published)

    @property
    def active(self) -> Mapping[str, Binding]:
        with self._lock:
            return dict(self._active)

    @property
    def current_ticket(self) -> UpdateTicket | None:
        with self._lock:
            return None if self._update is None else self._update.ticket

    @property
    def current_sleep(self) -> SleepTicket | None:
        """The sleep in progress (DOZING to the wake's publish or taint), or None."""
        with self._lock:
            return self._sleep

    @property
    def pending_resets(self) -> frozenset[CacheKind]:
        with self._lock:
            return self._pending_resets()

    def _pending_resets(self) -> frozenset[CacheKind]:
        upd = self._update
        if upd is None:
            return frozenset(self._required_caches)
        return frozenset(self._required_caches - upd.reset_ok - upd.rule.deferred_resets)

    # ------------------------------------------------------- asynchronous modes
    @property
    def update_mode(self) -> UpdateMode:
        return self._cfg.update_mode

    @property
    def max_staleness(self) -> int | None:
        return self._cfg.max_staleness

    def serving_version(self, rollout_id: str) -> WeightVersion | None:
        """The version a bound rollout's next tokens come from (None: not bound).

        Its admission version, or, once an asynchronous update carried it and
        published, the version it continues under.
        """
        with self._lock:
            b = self._active.get(rollout_id)
            if b is None:
                return None
            return self._continues.get(rollout_id, b.version)

    def over_bound(self, rollout_id: str) -> bool:
        """Whether an update ended this rollout for exceeding ``max_staleness`` (recently)."""
        with self._lock:
            return rollout_id in self._over_bound

    @property
    def stale_rollouts(self) -> int:
        """Bound rollouts admitted under a version older than the committed one."""
        with self._lock:
            return sum(b.version != self._committed for b in self._active.values())

    @property
    def sweep_due(self) -> bool:
        """A prefix reset deferred by a keep-mode update is still to be done.

        It is ready once nothing admitted under an older version runs
        (``stale_rollouts == 0``) and the controller is READY; until then
        the version salt keeps new requests off the old blocks.
        """
        with self._lock:
            return self._sweep_due

    def swept(self, ev: CacheResetEvidence) -> bool:
        """The deferred prefix reset's evidence; True once it holds (nothing due after).

        Refused (``InvalidTransition``) outside READY: an update resets caches itself.
        """
        if not isinstance(ev, CacheResetEvidence) or ev.cache is not CacheKind.PREFIX:
            raise BadInput("swept needs the prefix cache's CacheResetEvidence")
        with self._lock:
            if self._broken is not None:
                raise JournalError(f"swept refused: the controller failed closed "
                                   f"({self._broken})")
            if self._state is not S.READY:
                raise InvalidTransition("swept", self._state.value,
                                        "a deferred reset runs only between updates")
            problems = ev.problems(None)
            self._evidence(E.INVALIDATED, ev, problems)
            if not problems:
                self._sweep_due = False
            ok = not problems
        self._deliver(True)
        return ok

    @property
    def failed_closed(self) -> str | None:
        """Why the controller refuses every step (a record could not be delivered), or None."""
        with self._lock:
            return self._broken

    def history(self) -> list[dict[str, Any]]:
        """Transitions with the time spent in the state that was left."""
        with self._lock:
            return [{"from": a.value, "to": b.value, "event": e.value, "at": t,
                     "duration_s": d} for a, b, e, t, d in self._history]

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            upd = self._update
            return {
                "state": self._state.value,
                "committed": None if self._committed is None else self._committed.to_dict(),
                "identity": None if self._identity is None else self._identity.to_dict(),
                "active_rollouts": len(self._active),
                "update": None if upd is None else {
                    "update_id": upd.ticket.update_id,
                    "target": upd.ticket.target.version.to_dict(),
                    "owner": upd.ticket.target.owner,
                    "aborting": upd.aborting,
                    "mutation_started": upd.mutation_started,
                },
                "published": [v.to_dict() for v in self._published],
                "failed_closed": self._broken,
                "update_mode": self._cfg.update_mode.value,
                "sleep": None if self._sleep is None else {
                    "sleep_id": self._sleep.sleep_id, "owner": self._sleep.owner,
                    "level": self._sleep.level},
            }

    # ---------------------------------------------------------------- listeners
    def add_listener(self, listener: Listener) -> None:
        """Listeners see every record, in order, outside the state lock (keep them quick).

        A ``Sink`` is also waited on after each decision (``sync``) and tells the
        controller when it fails (``on_failure``): the controller then fails closed.
        """
        if not callable(listener):
            raise BadInput("a listener must be callable")
        with self._lock:
            self._listeners = [*self._listeners, listener]
            if isinstance(listener, Sink):
                self._sinks = [*self._sinks, listener]
        if isinstance(listener, Sink):
            listener.on_failure(self.fail_closed)

    def fail_closed(self, reason: str) -> None:
        """Refuse every further step: something the records go to failed (the journal).

        Sticky: the first reason is kept. Queries and ``complete`` still work
        (a release decides nothing); admissions, updates, evidence and recovery
        are refused, naming the reason. A restart restores from the journal.
        """
        with self._lock:
            if self._broken is None:
                self._broken = str(reason) or "a record sink failed"

    def _deliver(self, wait: bool) -> None:
        """Hand the outbox to the listeners, in order, outside the state lock.

        One thread delivers at a time (``_deliver_lock``); it delivers every
        record appended before it finds the outbox empty, and re-checks after
        releasing the lock, so a record whose own thread did not wait
        (``wait=False``: the data plane) is delivered by whoever holds the
        lock. With ``wait`` the caller delivers (or waits for the delivery of)
        its records, then waits for every sink to confirm them durable; a
        failure then raises ``JournalError`` to that caller.
        """
        if not self._outbox and not (wait and self._sinks):
            return  # nothing to hand over (no listener, or someone delivered it)
        if self._delivering == threading.get_ident():
            return  # a listener called back into the controller: the outer loop delivers
        err: BaseException | None = None
        while True:
            if not self._deliver_lock.acquire(blocking=wait):
                return  # the holder delivers ours: it re-checks after releasing
            self._delivering = threading.get_ident()
            try:
                out = self._outbox
                listeners = self._listeners
                while out:
                    rec = out.popleft()  # only the lock holder pops
                    for listener in listeners:
                        try:
                            listener(rec)
                        except Exception as exc:
                            err = err or exc
                            self.fail_closed(f"a listener failed on a {rec.KIND} record: "
                                             f"{exc}")
            finally:
                self._delivering = None
                self._deliver_lock.release()
            if not self._outbox:
                break
        if wait:
            for sink in self._sinks:
                try:
                    sink.sync()
                except Exception as exc:
                    err = err or exc
                    self.fail_closed(f"the journal failed: {exc}")
            if err is not None:
                raise JournalError(f"records could not be delivered; the controller now "
                                   f"refuses every step: {err}") from err

    # ---------------------------------------------------------------- appliers
    # The only code that changes durable state; used live and by restore().
    def _apply_transition(self, rec: Transition) -> None:
        self._state = rec.after
        if rec.after is S.READY or rec.after is S.TAINTED:
            self._sleep = None  # awake (or abandoned to recovery): no sleep in progress
        if rec.after is S.READY:
            self._idle.notify_all()

    def _apply_commit(self, rec: Commit) -> None:
        v = rec.version
        upd = self._update
        if upd is not None and upd.carry is not None:
            # The carried rollouts continue under the version just published.
            for rid in upd.carry.carried:
                if rid in self._active:
                    self._continues[rid] = v
            self._sweep_due = self._sweep_due or CacheKind.PREFIX in upd.rule.deferred_resets
        self._committed, self._identity = v, rec.identity
        self._published.append(v)
        self._max_generation = max(self._max_generation, v.generation)
        self._used_labels.add(v.label)
        self._engine_epoch = v.engine_epoch
        self._update = None

    def _apply_admit(self, rec: Admit, at: float) -> Binding:
        assert self._identity is not None
        b = Binding(rec.version, self._identity, rec.rollout_id, at)
        self._active[rec.rollout_id] = b
        return b

    def _apply_complete(self, rec: Complete) -> None:
        self._active.pop(rec.rollout_id, None)
        self._continues.pop(rec.rollout_id, None)
        self._accepted += rec.attributable
        if not self._active:
            self._idle.notify_all()

    def _apply_request_update(self, rec: RequestUpdate) -> None:
        ticket = UpdateTicket(rec.update_id, UpdateTarget(rec.target, rec.identity, rec.owner),
                              rec.min_verification)
        self._update = _Update(ticket, rec, mode=self._cfg.update_mode)
        self._next_update_id = max(self._next_update_id, rec.update_id + 1)

    def _apply_begin_update(self, rec: BeginUpdate) -> None:
        self._max_generation = max(self._max_generation, rec.target.generation)
        self._used_labels.add(rec.target.label)

    def _apply_end_update(self, rec: Abandon | Taint) -> None:
        self._update = None
        if isinstance(rec, Taint):
            self._sleep = None

    def _apply_request_sleep(self, rec: RequestSleep) -> None:
        self._sleep = SleepTicket(rec.sleep_id, rec.owner, rec.level)
        self._next_sleep_id = max(self._next_sleep_id, rec.sleep_id + 1)

    def _apply_request_wake(self, rec: RequestWake) -> None:
        self._apply_request_update(rec)
        assert self._update is not None
        self._update.wake, self._update.restore = rec.level, rec.restore

    def _apply_carry(self, rec: Carry) -> None:
        upd = self._update
        if upd is not None:
            upd.mode = rec.mode
            upd.carry = rec
        for rid in rec.over_bound:  # their complete records follow and release them
            self._over_bound[rid] = rec.update_id
            self._over_bound.move_to_end(rid)
        while len(self._over_bound) > _OVER_BOUND_KEPT:
            self._over_bound.popitem(last=False)

    def _record(self, rec: Transition | Commit | RequestUpdate | BeginUpdate | Abandon | Taint
                | Carry | RequestSleep) -> None:
        """Apply a record that changes durable state, and queue it for the listeners."""
        t = type(rec)
        if t is Carry:
            self._apply_carry(rec)  # type: ignore[arg-type]
        elif t is Transition:
            self._apply_transition(rec)  # type: ignore[arg-type]
        elif t is Commit:
            self._apply_commit(rec)  # type: ignore[arg-type]
        elif t is RequestUpdate:
            self._apply_request_update(rec)  # type: ignore[arg-type]
        elif t is RequestSleep:
            self._apply_request_sleep(rec)  # type: ignore[arg-type]
        elif t is RequestWake:
            self._apply_request_wake(rec)  # type: ignore[arg-type]
        elif t is BeginUpdate:
            self._apply_begin_update(rec)  # type: ignore[arg-type]
        else:
            self._apply_end_update(rec)  # type: ignore[arg-type]
        if self._listeners:
            self._outbox.append(rec)

    # ---------------------------------------------------------------- internals
    def _check(self, event: Event) -> None:
        if self._broken is not None:
            raise JournalError(f"{event.value} refused: the controller failed closed "
                               f"({self._broken})")
        if (self._state, event) not in TRANSITIONS:
            raise InvalidTransition(event.value, self._state.value)

    def _target(self, event: Event, key: object = None) -> State:
        """The one lookup: the table entry's target, or its outcome table's."""
        rule = TRANSITIONS.get((self._state, event))
        if rule is None:
            raise InvalidTransition(event.value, self._state.value)
        if isinstance(rule, State):
            return rule
        to = OUTCOMES[rule].get(key)
        if to is None:
            raise InvalidTransition(event.value, self._state.value,
                                    f"{rule.value} has no outcome for {key!r}")
        return to

    def _go(self, event: Event, key: object = None) -> None:
        self._move(event, self._target(event, key))

    def _move(self, event: Event, to: State) -> None:
        frm = self._state
        if to is frm:
            return
        now = self._clock()
        self._history.append((frm, to, event, now, now - self._entered_at))
        self._record(Transition(frm, to, event, now - self._entered_at))
        self._entered_at = now

    def _own(self, event: Event, ticket: UpdateTicket) -> _Update:
        self._check(event)
        return self._own_any(event, ticket)

    def _own_any(self, event: Event, ticket: UpdateTicket) -> _Update:
        """The ticket owns the update in progress (no fail-closed check: releases and
        failures are still applied after the controller failed closed)."""
        if (self._state, event) not in TRANSITIONS:
            raise InvalidTransition(event.value, self._state.value)
        if self._update is None or self._update.ticket != ticket:
            raise UpdateRefused(f"{event.value}: ticket {ticket.update_id} does not own the "
                                f"update in progress")
        return self._update

    def _evidence(self, event: Event, ev: Evidence, problems: list[str]) -> None:
        if self._listeners:  # serialised only by whoever writes it, off this path
            self._outbox.append(EvidenceSeen(event, ev, tuple(problems)))

    def _verdict(self, event: Event, before: State, *, accepted: bool,
                 cls: Classification | None = None, problems: list[str] | None = None,
                 published: WeightVersion | None = None, report: bool = True) -> Verdict:
        v = Verdict(event, accepted, before, self._state, cls, tuple(problems or ()), published)
        if report and self._listeners:
            self._outbox.append(v)
        return v

    def _failure(self, event: Event, step: Step, kind: FailureKind, problems: list[str],
                 taint_problems: list[str] | None = None, *, report: bool = True) -> Verdict:
        """Classify (FAILURE_POLICY), decide the target (FAILURE_TARGETS), then apply."""
        before = self._state
        upd = self._update
        cls = FAILURE_POLICY[(step, kind)]
        mutated = upd is not None and (
            upd.mutation_started or (step is Step.TRANSFER and kind is not FailureKind.REFUSED))
        count = 0
        if cls is _INC:
            count = (upd.incomplete.get(step, 0) if upd is not None else 0) + 1
            if count > self._cfg.max_incomplete:
                cls = ESCALATION[step]
                problems = [*problems, f"{step.value}: gave up after {count - 1} retries"]
        if cls is _NM and upd is not None and (mutated or upd.aborting):
            cls = _AMB  # a no_mutation claim never overrides what the controller knows
        if self._broken is not None and cls is not _AMB and (before, _AMB) in FAILURE_TARGETS:
            # Failed closed: the return to the old version could not be recorded
            # (nor proved by evidence, which is refused now), so the outcome is unknown.
            cls = _AMB
            problems = [*problems, f"the controller failed closed ({self._broken}); a "
                        "failure it cannot record is ambiguous"]
        to = self._target(E.FAIL, (before, cls))
        # Decided; apply.
        if upd is not None:
            upd.mutation_started = mutated
            if count:
                upd.incomplete[step] = count
            if to is S.RESUMING:
                upd.aborting = True
        if to is S.TAINTED:
            self._taint(taint_problems or problems)
        else:
            self._move(E.FAIL, to)
        return self._verdict(event, before, accepted=False, cls=cls, problems=problems,
                             report=report)

    def _taint(self, problems: list[str]) -> None:
        upd = self._update
        self._move(E.FAIL, S.TAINTED)
        self._record(Taint(tuple(problems),
                           None if upd is None else upd.ticket.target.version))

    def _fresh_generation(self) -> int:
        """The next generation whose default label was never used (published or burnt)."""
        gen = self._max_generation + 1
        while label_for(gen) in self._used_labels:
            gen += 1
        return gen

    # ---------------------------------------------------------------- bootstrap
    def bootstrap(self, ev: BootstrapEvidence, identity: WeightIdentity,
                  label: str | None = None, *,
                  validations: Iterable[ValidationEvidence] = (),
                  min_verification: VerificationLevel = VerificationLevel.DECLARED,
                  ) -> Verdict:
        """Take over an engine: its current weights become generation 0 (or the label given).

        A takeover declares what the engine holds; ``validations`` are what
        was observed of it (its label, checksums, the policy probe of the
        declared checkpoint), judged like an update's: each must hold, and
        together they must reach ``min_verification``, or nothing is
        published (UNINITIALIZED stays, ``no_mutation``: a takeover changes
        no weights). The committed identity carries the level reached.
        """
        if not isinstance(ev, BootstrapEvidence) or not isinstance(identity, WeightIdentity):
            raise BadInput("bootstrap needs BootstrapEvidence and a WeightIdentity")
        vals = list(validations)
        if not all(isinstance(x, ValidationEvidence) for x in vals):
            raise BadInput("validations must be ValidationEvidence")
        if not isinstance(min_verification, VerificationLevel):
            raise BadInput("min_verification must be a VerificationLevel")
        with self._lock:
            self._check(E.BOOTSTRAP)
            before = self._state
            problems = ev.problems(None)
            # An engine already labelled rc-N by an earlier controller continues
            # at generation N, so labels and generations keep agreeing.
            version = WeightVersion(generation_of(label) or 0, label or label_for(0),
                                    ev.engine_epoch)
            target = UpdateTarget(version, identity, "bootstrap")
            for val in vals:
                problems += val.problems(target)
            level, summary = self._verification(vals)
            if not problems and level < min_verification:
                problems.append(f"takeover verification reached {level.wire}, "
                                f"{min_verification.wire} required")
            self._evidence(E.BOOTSTRAP, ev, problems)
            for val in vals:
                self._evidence(E.BOOTSTRAP, val, problems)
            if problems:
                v = self._failure(E.BOOTSTRAP, Step.BOOTSTRAP, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                v = self._commit(E.BOOTSTRAP, before, version,
                                 identity.verified(level, summary) if vals else identity)
        self._deliver(True)
        return v

    def _commit(self, event: Event, before: State, version: WeightVersion,
                identity: WeightIdentity) -> Verdict:
        self._record(Commit(version, identity))
        self._go(event)
        return self._verdict(event, before, accepted=True, published=version)

    # ---------------------------------------------------------------- rollouts
    def admit(self, rollout_id: str) -> Binding:
        """Bind a rollout to the committed version; raise AdmissionRefused outside READY."""
        if not isinstance(rollout_id, str) or not rollout_id or len(rollout_id) > 256:
            raise BadInput("rollout_id must be a non-empty string of at most 256 characters")
        refused: AdmissionRefused | None = None
        b: Binding | None = None
        with self._lock:
            st = self._state
            if self._broken is not None:
                refused = AdmissionRefused(st.value, f"the controller failed closed "
                                                     f"({self._broken})", None)
            elif (st, E.ADMIT) not in TRANSITIONS:
                retry: float | None
                if st is S.TAINTED:
                    retry, reason = None, "engine is tainted; it serves nothing until recovered"
                elif st in (S.RECOVERING, S.UNINITIALIZED):
                    retry, reason = self._cfg.recovering_retry_after_s, "engine not ready"
                elif st in _SLEEP_STATES:
                    retry, reason = (self._cfg.recovering_retry_after_s,
                                     "engine is asleep (colocated training); it serves "
                                     "again once woken and verified")
                else:
                    retry, reason = self._cfg.retry_after_s, "a policy update is in progress"
                if self._listeners:
                    self._outbox.append(Refuse(rollout_id, st, reason))
                refused = AdmissionRefused(st.value, reason, retry)
            elif (cap := self._capacity()) is not None and cap <= 0:
                reason = (f"staleness capacity reached: {len(self._active)} running and "
                          f"{self._accepted} accepted for max_staleness "
                          f"{self._cfg.max_staleness} at version {len(self._published) - 1}")
                if self._listeners:
                    self._outbox.append(Refuse(rollout_id, st, reason))
                refused = AdmissionRefused(st.value, reason, self._cfg.retry_after_s)
            else:
                if rollout_id in self._active:
                    raise BadInput(f"rollout {rollout_id!r} is already active")
                assert self._committed is not None and self._identity is not None
                rec = Admit(rollout_id, self._committed, self._identity.digest)
                b = self._apply_admit(rec, self._clock())
                if self._listeners:
                    self._outbox.append(rec)
        if self._outbox:
            self._deliver(False)
        if refused is not None:
            raise refused
        assert b is not None
        return b

    def _capacity(self) -> int | None:
        """AReaL's admission capacity: ``(k + v + 1) * batch - (accepted + running)``."""
        k, batch = self._cfg.max_staleness, self._cfg.admission_batch
        if k is None or batch is None:
            return None
        return (k + max(0, len(self._published) - 1) + 1) * batch - (
            self._accepted + len(self._active))

    def complete(self, rollout_id: str) -> Completion:
        """Release a rollout's binding. Unknown ids are an error and change nothing.

        A rollout that ``abort_rollouts`` released already gets that
        (unattributable) completion back once, and nothing is recorded again.
        Otherwise it is attributable when the version it was bound to (or, carried by an
        asynchronous update, continues under) is still what the engine is
        known to serve. A carried rollout that ends while the update's target
        serves unpublished (RESUMING, after the resume) is not: the target
        may still fail its live validation.
        """
        with self._lock:
            if (self._state, E.COMPLETE) not in TRANSITIONS:
                raise InvalidTransition(E.COMPLETE.value, self._state.value)
            b = self._active.get(rollout_id) if isinstance(rollout_id, str) else None
            if b is None:
                done = self._aborted.pop(rollout_id, None) if isinstance(rollout_id, str) \
                    else None
                if done is not None:
                    return done
                raise BadInput(f"rollout {rollout_id!r} is not active")
            upd = self._update
            carried_now = (upd is not None and upd.carry is not None and not upd.aborting
                           and self._state is S.RESUMING and rollout_id in upd.carry.carried)
            attributable = (self._state not in (S.TAINTED, S.RECOVERING) and not carried_now
                            and self._committed == self._continues.get(rollout_id, b.version))
            rec = Complete(rollout_id, b.version, self._state, attributable)
            self._apply_complete(rec)
            if self._listeners:
                self._outbox.append(rec)
            c = Completion(b, self._clock(), self._state, self._committed, attributable)
        if self._outbox:
            self._deliver(False)
        return c

    def abort_rollouts(self, ticket: UpdateTicket, rollout_ids: Iterable[str],
                       reason: str) -> list[Completion]:
        """The drain deadline expired: release these stragglers, unattributable.

        Only the update's owner, and only in DRAINING: admission is closed and
        nothing has touched the engine's weights, so each binding was to the
        committed version and ends there, credited to no version at all (the
        answer was cut; its tokens are not training data of any policy). Ids
        no longer bound (they completed meanwhile) are skipped. The engine
        side is not decided here: the drain step that follows must still show
        the engine paused with nothing in flight.
        """
        if not isinstance(reason, str) or not reason:
            raise BadInput("abort_rollouts needs a reason")
        if isinstance(rollout_ids, str):
            raise BadInput("rollout_ids must be a collection of ids, not one string")
        ids = list(rollout_ids)
        out: list[Completion] = []
        with self._lock:
            self._own_any(E.COMPLETE, ticket)
            if self._state is not S.DRAINING:
                raise InvalidTransition("abort_rollouts", self._state.value,
                                        "stragglers are aborted only while DRAINING")
            for rid in ids:
                b = self._active.get(rid) if isinstance(rid, str) else None
                if b is None:
                    continue
                rec = Complete(rid, b.version, self._state, False)
                self._apply_complete(rec)
                if self._listeners:
                    self._outbox.append(rec)
                c = Completion(b, self._clock(), self._state, self._committed, False,
                               aborted=reason)
                self._aborted[rid] = c
                while len(self._aborted) > _ABORTED_KEPT:
                    self._aborted.popitem(last=False)
                out.append(c)
        self._deliver(True)
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no rollout is bound (or the timeout, on the injected clock).

        The last completion wakes the waiter at once; the deadline is re-read
        from the injected clock at least every ``_IDLE_POLL_S``, so a fake
        clock moved forward by a test is seen without real waiting.
        """
        deadline = self._clock() + max(0.0, timeout_s)
        with self._idle:
            while self._active:
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._idle.wait(min(left, _IDLE_POLL_S))
            return True

    # ---------------------------------------------------------------- update
    def request_update(self, target_identity: WeightIdentity, owner: str, *,
                       label: str | None = None,
                       min_verification: VerificationLevel = VerificationLevel.DECLARED,
                       ) -> UpdateTicket:
        """Open an update (single writer). Refused unless READY; nothing changes then."""
        if not isinstance(target_identity, WeightIdentity):
            raise BadInput("target_identity must be a WeightIdentity")
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        if not isinstance(min_verification, VerificationLevel):
            raise BadInput("min_verification must be a VerificationLevel")
        with self._lock:
            if self._broken is not None:
                raise UpdateRefused(f"the controller failed closed ({self._broken})")
            if self._update is not None:
                raise UpdateRefused(
                    f"an update by {self._update.ticket.target.owner!r} is in progress "
                    f"(state {self._state.value}); one writer at a time")
            if self._state in _SLEEP_STATES:
                raise UpdateRefused(
                    f"the engine is asleep ({self._state.value}): an update is its wake "
                    f"(request_wake); nothing was sent (weights sent to a sleeping engine "
                    f"land in released memory, vLLM #57853)")
            if (self._state, E.REQUEST_UPDATE) not in TRANSITIONS:
                raise UpdateRefused(f"updates start only in READY, not {self._state.value}")
            assert self._committed is not None
            gen = self._fresh_generation()
            nxt = WeightVersion(gen, label or label_for(gen), self._committed.engine_epoch)
            if nxt.label in self._used_labels:
                raise BadInput(f"label {nxt.label!r} was already used; labels name one "
                               f"weight set each")
            self._record(RequestUpdate(self._next_update_id, owner, nxt, target_identity,
                                       len(self._active), min_verification))
            self._go(E.REQUEST_UPDATE)
            assert self._update is not None
            ticket = self._update.ticket
        self._deliver(True)
        return ticket

    def drained(self, ticket: UpdateTicket, ev: DrainEvidence) -> Verdict:
        """The engine paused as the update mode's row says (``rules.UPDATE_MODES``).

        Strict: nothing bound, nothing in flight. Asynchronous: paused in the
        row's mode; the bound rollouts are carried across the update (a
        ``carry`` record), less those that would exceed ``max_staleness``
        once the target is published, which end here, unattributable.
        """
        with self._lock:
            upd = self._own(E.DRAINED, ticket)
            before = self._state
            rule = upd.rule
            problems = (ev.problems(ticket.target) if rule.pause is None
                        else ev.problems_for(rule.pause))
            if self._active and rule.drains:
                problems.append(f"{len(self._active)} rollouts still bound")
            self._evidence(E.DRAINED, ev, problems)
            if problems:
                v = self._failure(E.DRAINED, Step.DRAIN, FailureKind.BAD_EVIDENCE, problems)
            else:
                if not rule.drains:
                    self._carry(upd)
                self._go(E.DRAINED)
                v = self._verdict(E.DRAINED, before, accepted=True)
        self._deliver(True)
        return v

    def _carry(self, upd: _Update) -> None:
        """Record who the asynchronous update carries, and end those over the bound."""
        k = self._cfg.max_staleness
        carried: list[str] = []
        over: list[str] = []
        for rid, b in sorted(self._active.items()):
            # Its oldest tokens are its admission version's: once the target is
            # published they are this many published versions old.
            age = 1 + sum(v.generation > b.version.generation for v in self._published)
            (over if k is not None and age > k else carried).append(rid)
        self._record(Carry(upd.ticket.update_id, upd.mode, tuple(carried), tuple(over), k))
        for rid in over:
            rec = Complete(rid, self._active[rid].version, self._state, False)
            self._apply_complete(rec)
            if self._listeners:
                self._outbox.append(rec)

    def preflighted(self, ticket: UpdateTicket, ev: PreflightEvidence) -> Verdict:
        """begin_update: the preflight holds and no rollout is bound, so mutation may start.

        (Asynchronous modes: rollouts carried at the pause stay bound.)
        """
        with self._lock:
            upd = self._own(E.PREFLIGHTED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            if self._active and upd.rule.drains:  # unreachable: admission is closed
                problems.append(f"{len(self._active)} rollouts bound at begin_update")
            self._evidence(E.PREFLIGHTED, ev, problems)
            if problems:
                v = self._failure(E.PREFLIGHTED, Step.PREFLIGHT, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                # From here the target's label may reach the engine: never reuse it.
                self._record(BeginUpdate(ticket.update_id, ticket.target.version))
                self._go(E.PREFLIGHTED)
                v = self._verdict(E.PREFLIGHTED, before, accepted=True)
        self._deliver(True)
        return v

    def transferred(self, ticket: UpdateTicket, ev: TransferEvidence) -> Verdict:
        with self._lock:
            upd = self._own(E.TRANSFERRED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            self._evidence(E.TRANSFERRED, ev, problems)
            if problems:
                # Evidence came back but does not hold: the weights may be
                # anything now. Ambiguous, even if the transport says it never
                # started (use fail(REFUSED) for a provable no-op).
                v = self._failure(E.TRANSFERRED, Step.TRANSFER, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                upd.mutation_started = upd.mutation_started or ev.mutation_started
                self._go(E.TRANSFERRED)
                if not self._pending_resets():
                    # Every required reset is deferred by the mode (keep, prefix only):
                    # nothing to invalidate while paused.
                    self._go(E.INVALIDATED, True)
                v = self._verdict(E.TRANSFERRED, before, accepted=True)
        self._deliver(True)
        return v

    def invalidated(self, ticket: UpdateTicket, ev: CacheResetEvidence) -> Verdict:
        """One cache reset; VALIDATING once every required cache has been reset."""
        with self._lock:
            upd = self._own(E.INVALIDATED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            self._evidence(E.INVALIDATED, ev, problems)
            if problems:
                v = self._failure(E.INVALIDATED, Step.INVALIDATE, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                upd.reset_ok.add(ev.cache)
                self._go(E.INVALIDATED, not self._pending_resets())
                v = self._verdict(E.INVALIDATED, before, accepted=True)
        self._deliver(True)
        return v

    def validated(self, ticket: UpdateTicket, ev: ValidationEvidence) -> Verdict:
        """The validation while paused. It must hold; a failed one taints."""
        with self._lock:
            upd = self._own(E.VALIDATED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            if ev.paused is False:
                problems.append("validation ran on a resumed engine; it must run while paused")
            if upd.wake is not None:
                problems += _wake_coverage_problems(ev, upd.wake)
            self._evidence(E.VALIDATED, ev, problems)
            if problems:
                v = self._failure(E.VALIDATED, Step.VALIDATE, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                upd.validations.append(ev)
                self._go(E.VALIDATED)
                v = self._verdict(E.VALIDATED, before, accepted=True)
        self._deliver(True)
        return v

    def resumed(self, ticket: UpdateTicket, ev: ResumeEvidence,
                live: ValidationEvidence | None = None) -> Verdict:
        """Resume confirmed (plus the live validation, if any): publish, or taint.

        On the abort path (nothing mutated) this returns to READY on the old
        version and publishes nothing.
        """
        with self._lock:
            v = self._resumed(ticket, ev, live)
        self._deliver(True)
        return v

    def _resumed(self, ticket: UpdateTicket, ev: ResumeEvidence,
                 live: ValidationEvidence | None) -> Verdict:
        upd = self._own(E.RESUMED, ticket)
        before = self._state
        if upd.aborting and live is not None:
            raise BadInput("no live validation on the abort path: nothing was installed")
        problems = ev.problems(ticket.target)
        if live is not None:
            problems += [f"live validation: {p}" for p in live.problems(ticket.target)]
        self._evidence(E.RESUMED, ev, problems)
        if live is not None:
            self._evidence(E.RESUMED, live, problems)
        if problems:
            return self._failure(E.RESUMED, Step.RESUME, FailureKind.BAD_EVIDENCE, problems)
        if upd.aborting:
            self._record(Abandon(ticket.update_id, ticket.target.version))
            self._go(E.RESUMED)
            return self._verdict(E.RESUMED, before, accepted=True)
        if live is not None:
            upd.validations.append(live)
        level, summary = self._verification(upd.validations)
        if upd.restore:
            # A wake on the engine's own weights, verified unchanged: the committed
            # version serves again; nothing new is published.
            if level < ticket.min_verification:
                return self._failure(
                    E.RESUMED, Step.RESUME, FailureKind.BAD_EVIDENCE,
                    [f"verification reached {level.wire}, "
                     f"the wake requires {ticket.min_verification.wire}"])
            self._record(Abandon(ticket.update_id, ticket.target.version))
            self._go(E.RESUMED)
            return self._verdict(E.RESUMED, before, accepted=True)
        if level < ticket.min_verification:
            return self._failure(
                E.RESUMED, Step.RESUME, FailureKind.BAD_EVIDENCE,
                [f"verification reached {level.wire}, "
                 f"update requires {ticket.min_verification.wire}"])
        identity = ticket.target.identity.verified(level, summary)
        return self._commit(E.RESUMED, before, ticket.target.version, identity)

    @staticmethod
    def _verification(vals: list[ValidationEvidence]) -> tuple[VerificationLevel, list[str]]:
        level = VerificationLevel.DECLARED
        summary: list[str] = []
        for v in vals:
            if v.label_supported and v.observed_label is not None:
                level = max(level, VerificationLevel.MANIFEST)
            for c in v.checks:
                if c.passed and c.level is not None:
                    level = max(level, c.level)
            summary += v.summary
        return level, summary

    def fail(self, ticket: UpdateTicket | SleepTicket | None, step: Step, kind: FailureKind,
             reason: str) -> Verdict:
        """An effect failed (raised, timed out, died): ``FAIL_STEPS`` then ``FAILURE_POLICY``.

        In READY the failure is the engine's while serving (``Step.SERVE``,
        no ticket); during an update it needs the update's ticket.
        """
        if not isinstance(step, Step) or not isinstance(kind, FailureKind):
            raise BadInput("fail needs a Step and a FailureKind")
        with self._lock:
            v = self._fail(ticket, step, kind, str(reason), report=True)
        self._deliver(True)
        return v

    def _fail(self, ticket: UpdateTicket | SleepTicket | None, step: Step, kind: FailureKind,
              reason: str, *, report: bool) -> Verdict:
        """``fail`` under the lock; ``report=False`` (restore) records only the transition
        and the taint, as a restore always has."""
        # No fail-closed refusal: a failure is applied whatever the journal did
        # (as ambiguous when it failed, see ``_failure``).
        if (self._state, E.FAIL) not in TRANSITIONS:
            raise InvalidTransition(E.FAIL.value, self._state.value)
        upd = self._update
        aborting = upd is not None and upd.aborting
        row = (ABORT_STEPS if aborting else FAIL_STEPS).get((self._state, step))
        if row is None:
            raise InvalidTransition(E.FAIL.value, self._state.value,
                                    f"update is aborting; step {step.value} is over" if aborting
                                    else f"step {step.value} does not run in this state")
        if self._state is S.READY and ticket is not None:
            raise BadInput("a serving failure has no update ticket")
        if self._state in _UPDATE_STATES:
            if not isinstance(ticket, UpdateTicket):
                raise BadInput("fail during an update needs the ticket")
            self._own_any(E.FAIL, ticket)
        if self._state in _SLEEP_STATES:
            self._own_sleeping(E.FAIL, ticket)
        if report and self._listeners:
            self._outbox.append(Failure(row, kind, reason))
        # Serving: the verdict names the observation, the taint record what it means.
        return self._failure(E.FAIL, row, kind, [reason],
                             [f"engine failed while serving: {reason}"]
                             if row is Step.SERVE else None, report=report)

    # ---------------------------------------------------------------- colocated training
    # The trainer and the engine share a GPU (issue 21): the engine sleeps while
    # the trainer trains in the memory it gave back, then its owner wakes it, with
    # an update (level 2 discarded the weights: the update writes every parameter)
    # or on its own weights (a restore, verified against the checksums taken
    # before the sleep). Either way the wake ends like an update: caches reset,
    # a paused validation that covers every parameter, the resume; an update
    # publishes its target, a restore serves the committed version again.

    def request_sleep(self, owner: str, level: int = 2) -> SleepTicket:
        """Close admission for a sleep (READY -> DOZING). Refused, changing nothing, elsewhere."""
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        if isinstance(level, bool) or level not in (1, 2):
            raise BadInput(f"sleep level must be 1 or 2, got {level!r}")
        with self._lock:
            if self._broken is not None:
                raise UpdateRefused(f"the controller failed closed ({self._broken})")
            if self._update is not None or self._sleep is not None:
                raise UpdateRefused(f"the engine is not idle (state {self._state.value}): "
                                    f"one update or sleep at a time")
            if (self._state, E.REQUEST_SLEEP) not in TRANSITIONS:
                raise UpdateRefused(f"a sleep starts only in READY, not {self._state.value}")
            self._record(RequestSleep(self._next_sleep_id, owner, level, len(self._active)))
            self._go(E.REQUEST_SLEEP)
            assert self._sleep is not None
            ticket = self._sleep
        self._deliver(True)
        return ticket

    def slept(self, ticket: SleepTicket, ev: SleepEvidence) -> Verdict:
        """The engine is asleep at the level asked, nothing bound: SLEEPING, or a taint."""
        if not isinstance(ev, SleepEvidence):
            raise BadInput("slept needs SleepEvidence")
        with self._lock:
            self._own_sleeping(E.SLEPT, ticket)
            before = self._state
            problems = ev.problems(None)
            if ev.level != ticket.level:
                problems.append(f"engine slept at level {ev.level}, the sleep asked for "
                                f"{ticket.level}")
            if self._active:  # unreachable by construction: admission is closed
                problems.append(f"{len(self._active)} rollouts bound while asleep")
            self._evidence(E.SLEPT, ev, problems)
            if problems:
                v = self._failure(E.SLEPT, Step.SLEEP, FailureKind.BAD_EVIDENCE, problems)
            else:
                self._go(E.SLEPT)
                v = self._verdict(E.SLEPT, before, accepted=True)
        self._deliver(True)
        return v

    def wake_target(self, owner: str, identity: WeightIdentity | None = None, *,
                    label: str | None = None) -> UpdateTarget:
        """What ``request_wake`` would install (for the preflight that must come with it).

        No identity: the committed version itself (a restore). Changes nothing.
        """
        with self._lock:
            return self._wake_target(owner, identity, label)

    def _wake_target(self, owner: str, identity: WeightIdentity | None,
                     label: str | None) -> UpdateTarget:
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        if identity is not None and not isinstance(identity, WeightIdentity):
            raise BadInput("identity must be a WeightIdentity or None (a restore)")
        if self._committed is None or self._identity is None:
            raise UpdateRefused("nothing was ever committed: there is nothing to wake")
        if identity is None:
            if label is not None:
                raise BadInput("a restore keeps the committed label; pass no label")
            return UpdateTarget(self._committed, self._identity, owner)
        gen = self._fresh_generation()
        nxt = WeightVersion(gen, label or label_for(gen), self._committed.engine_epoch)
        if nxt.label in self._used_labels:
            raise BadInput(f"label {nxt.label!r} was already used; labels name one "
                           f"weight set each")
        return UpdateTarget(nxt, identity, owner)

    def request_wake(self, sleep: SleepTicket, owner: str,
                     identity: WeightIdentity | None = None, *, label: str | None = None,
                     min_verification: VerificationLevel = VerificationLevel.ENGINE_CHECKSUM,
                     preflight: PreflightEvidence | None = None) -> UpdateTicket:
        """The sleep's owner wakes the engine: with an update (``identity``), or a restore.

        Returns the wake's update ticket; the state stays SLEEPING until the
        first wake call's evidence. An update needs its ``preflight`` (the
        trainer's source against the target of ``wake_target``): evidence
        that does not hold refuses the wake, and nothing changes. The
        verification asked is at least ``ENGINE_CHECKSUM``: a woken engine
        serves only weights checked parameter by parameter.
        """
        if not isinstance(sleep, SleepTicket):
            raise BadInput("request_wake needs the SleepTicket of the sleep")
        if not isinstance(min_verification, VerificationLevel):
            raise BadInput("min_verification must be a VerificationLevel")
        if identity is not None and not isinstance(preflight, PreflightEvidence):
            raise BadInput("a wake with an update needs its PreflightEvidence")
        if identity is None and preflight is not None:
            raise BadInput("a restore has no source to preflight")
        level = max(min_verification, VerificationLevel.ENGINE_CHECKSUM)
        refused: str | None = None
        with self._lock:
            if self._broken is not None:
                raise UpdateRefused(f"the controller failed closed ({self._broken})")
            if self._sleep != sleep:
                raise UpdateRefused(f"sleep {sleep.sleep_id} is not the sleep in progress")
            if self._update is not None:
                raise UpdateRefused(f"a wake by {self._update.ticket.target.owner!r} is in "
                                    f"progress (state {self._state.value}); one at a time")
            if (self._state, E.REQUEST_WAKE) not in TRANSITIONS:
                raise UpdateRefused(f"a wake starts only in SLEEPING, not {self._state.value}")
            target = self._wake_target(owner, identity, label)
            if preflight is not None:
                problems = preflight.problems(target)
                self._evidence(E.REQUEST_WAKE, preflight, problems)
                if problems:
                    refused = "; ".join(problems)
            if refused is None:
                rec = RequestWake(self._next_update_id, owner, target.version,
                                  target.identity, 0, level, sleep.level, identity is None)
                self._record(rec)
                if identity is not None:
                    # From here the target's label may reach the engine: never reuse it.
                    self._record(BeginUpdate(rec.update_id, target.version))
                self._go(E.REQUEST_WAKE)
                assert self._update is not None
                ticket = self._update.ticket
        self._deliver(True)
        if refused is not None:
            raise UpdateRefused(f"wake refused, the engine still sleeps: {refused}")
        return ticket

    def woke(self, ticket: UpdateTicket, ev: WakeEvidence) -> Verdict:
        """One wake call. ``WAKE_TARGETS`` decides where it leads; a wake it has no
        entry for is refused (``InvalidTransition``, nothing changes)."""
        if not isinstance(ev, WakeEvidence):
            raise BadInput("woke needs WakeEvidence")
        with self._lock:
            upd = self._own(E.WOKE, ticket)
            before = self._state
            key = (before, "restore" if upd.restore else "update", ev.tags.value)
            self._target(E.WOKE, key)  # refused here, before anything is recorded
            problems = ev.problems(ticket.target)
            self._evidence(E.WOKE, ev, problems)
            if problems:
                v = self._failure(E.WOKE, Step.WAKE, FailureKind.BAD_EVIDENCE, problems)
            else:
                self._go(E.WOKE, key)
                v = self._verdict(E.WOKE, before, accepted=True)
        self._deliver(True)
        return v

    def _own_sleeping(self, event: Event, ticket: object) -> None:
        """The caller owns the sleep (or, once a wake was requested, the wake)."""
        self._check(event)
        upd = self._update
        if upd is not None:
            if ticket != upd.ticket:
                raise UpdateRefused(f"{event.value}: only the wake's ticket acts on the "
                                    f"waking engine")
        elif self._sleep is None or ticket != self._sleep:
            raise UpdateRefused(f"{event.value}: not the ticket of the sleep in progress")

    # ---------------------------------------------------------------- recovery
    def begin_recovery(self, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        with self._lock:
            self._check(E.BEGIN_RECOVERY)
            if self._listeners:
                self._outbox.append(BeginRecovery(owner))
            self._go(E.BEGIN_RECOVERY)
        self._deliver(True)

    def recovered(self, ev: RecoveryEvidence) -> Verdict:
        """A replacement engine (new epoch) verified on a known checkpoint: READY again.

        It is published as a *new* generation on the new epoch, so nothing
        admitted before the taint can be attributed to the recovered engine.
        """
        if not isinstance(ev, RecoveryEvidence):
            raise BadInput("recovered needs RecoveryEvidence")
        with self._lock:
            self._check(E.RECOVERED)
            before = self._state
            gen = self._fresh_generation()
            version = WeightVersion(gen, label_for(gen), ev.engine_epoch)
            target = UpdateTarget(version, ev.identity, "recovery")
            problems = ev.problems(target)
            if ev.engine_epoch == self._engine_epoch:
                problems.append("recovery must replace the engine (same epoch observed)")
            self._evidence(E.RECOVERED, ev, problems)
            if problems:
                if self._listeners:
                    self._outbox.append(Failure(Step.RECOVER, FailureKind.BAD_EVIDENCE,
                                                "; ".join(problems)))
                v = self._failure(E.RECOVERED, Step.RECOVER, FailureKind.BAD_EVIDENCE,
                                  problems)
            else:
                level, summary = self._verification([ev.validation])
                v = self._commit(E.RECOVERED, before, version,
                                 ev.identity.verified(level, summary))
        self._deliver(True)
        return v

    def recovery_target(self) -> WeightVersion:
        """The version a recovery would publish (its label must be set on the new engine)."""
        with self._lock:
            gen = self._fresh_generation()
            return WeightVersion(gen, label_for(gen), self._engine_epoch or "pending")

    # ---------------------------------------------------------------- crash restore
    @classmethod
    def restore(cls, records: Iterable[Record | JournalRecord], *,
                config: ControllerConfig | None = None,
                required_caches: tuple[CacheKind, ...] = tuple(CacheKind),
                clock: Callable[[], float] = time.monotonic,
                listener: Listener | None = None) -> LifecycleController:
        """Rebuild a controller by replaying the records of its journal.

        Each record that changed durable state is applied through the same
        method that applied it live, after checking it against the tables
        (a transition must leave the state the replay is in, for a target
        the table allows); a journal that breaks them raises
        ``JournalError``. An update (or recovery) that was in flight when the
        process died is never resumed as if it had succeeded: whatever step
        it had reached, the restored controller fails it with
        ``Step.RESTART`` (ambiguous: TAINTED), and only recovery leads back
        to READY. Rollouts the journal shows still bound belonged to the dead
        process: each is released at once with a ``complete`` record that
        says it is not attributable (their requests ended with the process).
        """
        c = cls(config=config, required_caches=required_caches, clock=clock)
        with c._lock:
            for r in records:
                c._replay(r.record if isinstance(r, JournalRecord) else r)
            c._entered_at = clock()
        if listener is not None:
            c.add_listener(listener)
        with c._lock:
            upd = c._update
            if c._state in _UPDATE_STATES and upd is None:
                raise JournalError(f"journal ends in {c._state.value} without the "
                                   f"request_update that opened the update")
            if c._state in _SLEEP_STATES and c._sleep is None:
                raise JournalError(f"journal ends in {c._state.value} without the "
                                   f"request_sleep that opened the sleep")
            if c._listeners:
                c._outbox.append(Restore(c._state, len(c._active),
                                         None if upd is None else upd.request))
            # Rollouts bound by the process that wrote the journal died with it:
            # released here, unattributable (recorded as such), never kept active.
            for rid, b in list(c._active.items()):
                rec = Complete(rid, b.version, c._state, False)
                c._apply_complete(rec)
                if c._listeners:
                    c._outbox.append(rec)
            if (c._state, Step.RESTART) in FAIL_STEPS:
                what = ("a recovery" if c._state is S.RECOVERING else
                        "a sleep" if c._state in _SLEEP_STATES else "an update")
                c._fail(upd.ticket if upd is not None else c._sleep, Step.RESTART,
                        FailureKind.DIED, f"controller restarted during {what}", report=False)
        c._deliver(True)
        return c

    def _replay(self, rec: Record) -> None:
        t = type(rec)
        if t is Transition:
            assert isinstance(rec, Transition)
            if rec.before is not self._state or rec.after not in _replay_targets(
                    rec.before, rec.event):
                raise JournalError(
                    f"journal replays {rec.before.value} -> {rec.after.value} on "
                    f"{rec.event.value} while the controller is {self._state.value}: "
                    f"not a transition of its tables")
            self._apply_transition(rec)
        elif t is Admit:
            assert isinstance(rec, Admit)
            if (self._state, E.ADMIT) not in TRANSITIONS or self._identity is None or \
                    rec.identity_digest != self._identity.digest:
                raise JournalError(f"journal admits {rec.rollout_id!r} in "
                                   f"{self._state.value} under an identity not committed")
            self._apply_admit(rec, self._clock())
        elif t is Complete:
            self._apply_complete(rec)  # type: ignore[arg-type]
        elif t is Commit:
            self._apply_commit(rec)  # type: ignore[arg-type]
        elif t is RequestUpdate:
            self._apply_request_update(rec)  # type: ignore[arg-type]
        elif t is BeginUpdate:
            self._apply_begin_update(rec)  # type: ignore[arg-type]
        elif t is Abandon or t is Taint:
            self._apply_end_update(rec)  # type: ignore[arg-type]
        elif t is Carry:
            self._apply_carry(rec)  # type: ignore[arg-type]
        elif t is RequestSleep:
            self._apply_request_sleep(rec)  # type: ignore[arg-type]
        elif t is RequestWake:
            self._apply_request_wake(rec)  # type: ignore[arg-type]
        # Every other record describes a decision; it changes no durable state.


def _wake_coverage_problems(ev: ValidationEvidence, level: int) -> list[str]:
    """After a wake, only a check of every engine parameter verifies the weights.

    The sleep gave the weights' memory away (level 2 discarded its contents), so
    a label, or a checksum of part of the parameters, says nothing about the rest.
    """
    full = [c for c in ev.checks if c.passed and c.coverage == 1.0 and c.level is not None
            and c.level >= VerificationLevel.ENGINE_CHECKSUM]
    if full:
        return []
    seen = ", ".join(f"{c.name}={'pass' if c.passed else 'FAIL'}/"
                     f"{'n.a.' if c.coverage is None else format(c.coverage, '.4f')}"
                     for c in ev.checks) or "none"
    return [f"after a level-{level} sleep the paused validation must verify every engine "
            f"parameter (a passing engine-checksum check of coverage 1.0); checks: {seen}"]


def _replay_targets(state: State, event: Event) -> frozenset[State]:
    """Targets a journal may show for (state, event).

    Schema 1 labelled a transition caused by failing evidence with the
    evidence's event rather than ``fail``; such a journal still restores.
    """
    out = targets(state, event) if (state, event) in TRANSITIONS else frozenset()
    if event is not E.FAIL and (state, E.FAIL) in TRANSITIONS:
        out |= targets(state, E.FAIL)
    return out
