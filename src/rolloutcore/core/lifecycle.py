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

The machine and its shell
-------------------------

This module is the machine only: ``Lifecycle`` holds no lock, reads no
clock and delivers nothing. Each call decides from the tables, applies the
records that change durable state, and appends every record it made to its
outbox, which whoever runs it empties with ``take``. The shell
(``rolloutcore.control.controller.LifecycleController``, on
``control.shell.Shell``) runs it under one lock, sets ``now`` from its
injected clock before each call, delivers the outbox to the listeners
after the lock is released (in the order of decisions), waits for the
journal to confirm durable records, wakes whoever waits for the drain, and
publishes a snapshot readers take without locking.

A controller whose records could not be delivered is failed closed
(``fail_closed``, decided here): from then on admissions, updates,
evidence and recovery are refused with a clear error, because it can no
longer record what it would decide. A failure (``fail``) is still applied
after that, and always as *ambiguous*: a controller that cannot record
cannot prove a return to the old version either, and an update left
half-way in memory would refuse every later begin as "in progress" for
ever. So a journal that fails mid-update ends the update TAINTED (in
memory; the journal may lack the taint), and the runner fences the engine.

Every evidence event goes through one skeleton (``_step``) and one table
(``STEPS``: the event's failure row, the evidence it takes, its checks, its
effect), as h2's stream machine maps (state, input) to (effect, target);
a transition the state itself triggers (a keep-mode transfer that leaves
no cache to reset) is a row of ``STATE_TRIGGERED``, as in h11.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

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
    Compacted,
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
    TRANSITIONS,
    UPDATE_MODES,
    UPDATE_STATES,
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
from rolloutcore.core.vocab import Machine
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    InvalidTransition,
    JournalError,
    UpdateRefused,
)

__all__ = [
    "STATE_TRIGGERED",
    "STEPS",
    "Binding",
    "Classification",
    "Completion",
    "ControllerConfig",
    "Event",
    "FailureKind",
    "Lifecycle",
    "SleepTicket",
    "State",
    "Step",
    "StepRule",
    "UpdateMode",
    "UpdateTicket",
    "Verdict",
    "verification_of",
]

S, E = State, Event
C = Classification
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
    wake: int | None = None         # the sleep level this update wakes from (colocated)
    restore: bool = False           # a wake on the engine's own weights, no transfer

    @property
    def rule(self) -> ModeRule:
        return UPDATE_MODES[self.mode]


def verification_of(vals: Iterable[ValidationEvidence]) -> tuple[VerificationLevel, list[str]]:
    """The level a set of validations reached (every check that passed), and its summary."""
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


# --------------------------------------------------------------------------- the step table
#: A step's checks: (machine, its update, the evidence, the extra argument) -> problems.
Checks = Callable[["Lifecycle", "_Update", Any, Any], list[str]]
#: A step's effect once its evidence holds: applies its records and returns the key
#: its event's outcome table needs (``None`` for an entry with one target).
Effect = Callable[["Lifecycle", "_Update", Any, Any], object]


@dataclass(frozen=True)
class StepRule:
    """One evidence event of an update: what it takes, how it is checked, what it does.

    ``step`` is the failure-policy row evidence that does not hold falls in.
    """

    step: Step
    evidence: type[Evidence]
    checks: Checks
    effect: Effect
    #: The extra argument is evidence too (the resume's live validation): recorded
    #: after the step's own, with the same problems.
    extra_is_evidence: bool = False


def _checks_drained(m: Lifecycle, upd: _Update, ev: DrainEvidence, _: Any) -> list[str]:
    rule = upd.rule
    problems = (ev.problems(upd.ticket.target) if rule.pause is None
                else ev.problems_for(rule.pause, rule.clear_cache))
    if m._active and rule.drains:
        problems.append(f"{len(m._active)} rollouts still bound")
    return problems


def _effect_drained(m: Lifecycle, upd: _Update, ev: DrainEvidence, _: Any) -> None:
    if not upd.rule.drains:
        m._carry(upd)


def _checks_preflighted(m: Lifecycle, upd: _Update, ev: PreflightEvidence,
                        _: Any) -> list[str]:
    problems = ev.problems(upd.ticket.target)
    if m._active and upd.rule.drains:  # unreachable: admission is closed
        problems.append(f"{len(m._active)} rollouts bound at begin_update")
    return problems


def _effect_preflighted(m: Lifecycle, upd: _Update, ev: PreflightEvidence, _: Any) -> None:
    # From here the target's label may reach the engine: never reuse it.
    m._record(BeginUpdate(upd.ticket.update_id, upd.ticket.target.version))


def _checks_target(m: Lifecycle, upd: _Update, ev: Any, _: Any) -> list[str]:
    problems: list[str] = ev.problems(upd.ticket.target)
    return problems


def _effect_transferred(m: Lifecycle, upd: _Update, ev: TransferEvidence, _: Any) -> None:
    # Evidence that came back but does not hold failed in the checks: the weights
    # may be anything then (ambiguous, even if the transport says it never
    # started; fail(REFUSED) is the way to report a provable no-op).
    upd.mutation_started = upd.mutation_started or ev.mutation_started


def _effect_invalidated(m: Lifecycle, upd: _Update, ev: CacheResetEvidence, _: Any) -> bool:
    upd.reset_ok.add(ev.cache)
    return not m._pending_resets()


def _checks_validated(m: Lifecycle, upd: _Update, ev: ValidationEvidence,
                      _: Any) -> list[str]:
    problems = ev.problems(upd.ticket.target)
    if ev.paused is False:
        problems.append("validation ran on a resumed engine; it must run while paused")
    if upd.wake is not None:
        problems += _wake_coverage_problems(ev, upd.wake)
    return problems


def _effect_validated(m: Lifecycle, upd: _Update, ev: ValidationEvidence, _: Any) -> None:
    upd.validations.append(ev)


def _checks_resumed(m: Lifecycle, upd: _Update, ev: ResumeEvidence,
                    live: ValidationEvidence | None) -> list[str]:
    target = upd.ticket.target
    problems = ev.problems(target)
    if live is not None:
        problems += [f"live validation: {p}" for p in live.problems(target)]
    if problems or upd.aborting:
        return problems
    level, _ = verification_of([*upd.validations, *([live] if live is not None else [])])
    if level < upd.ticket.min_verification:
        what = "the wake" if upd.restore else "update"
        problems.append(f"verification reached {level.wire}, "
                        f"{what} requires {upd.ticket.min_verification.wire}")
    return problems


def _effect_resumed(m: Lifecycle, upd: _Update, ev: ResumeEvidence,
                    live: ValidationEvidence | None) -> None:
    t = upd.ticket
    if upd.aborting or upd.restore:
        # Nothing was installed (an abandoned update), or a wake on the engine's own
        # weights was verified unchanged: the committed version serves again.
        m._record(Abandon(t.update_id, t.target.version))
        return
    if live is not None:
        upd.validations.append(live)
    level, summary = verification_of(upd.validations)
    m._record(Commit(t.target.version, t.target.identity.verified(level, summary)))


def _effect_woke(m: Lifecycle, upd: _Update, ev: WakeEvidence, key: object) -> object:
    return key


#: The evidence events of an update, one row each (h2's form: the effect is in the
#: table with the check; ``TRANSITIONS`` and its outcome tables give the target).
STEPS: Mapping[Event, StepRule] = {
    E.DRAINED: StepRule(Step.DRAIN, DrainEvidence, _checks_drained, _effect_drained),
    E.PREFLIGHTED: StepRule(Step.PREFLIGHT, PreflightEvidence, _checks_preflighted,
                            _effect_preflighted),
    E.TRANSFERRED: StepRule(Step.TRANSFER, TransferEvidence, _checks_target,
                            _effect_transferred),
    E.INVALIDATED: StepRule(Step.INVALIDATE, CacheResetEvidence, _checks_target,
                            _effect_invalidated),
    E.VALIDATED: StepRule(Step.VALIDATE, ValidationEvidence, _checks_validated,
                          _effect_validated),
    E.RESUMED: StepRule(Step.RESUME, ResumeEvidence, _checks_resumed, _effect_resumed,
                        extra_is_evidence=True),
    E.WOKE: StepRule(Step.WAKE, WakeEvidence, _checks_target, _effect_woke),
}

#: Transitions the state triggers by itself after an accepted step (h11's
#: state-triggered transitions): state -> (the event, the outcome key, when).
#: A keep-mode transfer leaves no cache to reset while paused (the prefix reset
#: is deferred): nothing to invalidate, so INVALIDATING passes on at once.
STATE_TRIGGERED: Mapping[State, tuple[Event, object, Callable[[Lifecycle], bool]]] = {
    S.INVALIDATING: (E.INVALIDATED, True, lambda m: not m._pending_resets()),
}


class Lifecycle(Machine):
    """The sans-I/O lifecycle of one engine; see the module docstring.

    Not thread-safe, by design: the shell (``control.controller``) runs it under
    its lock. ``now`` is the time of the call being decided (the shell sets it
    from its injected clock); ``take`` hands over the records the calls made,
    in order; ``recording`` off skips the records that change no state (the
    shell turns it on with its first listener).
    """

    def __init__(self, *, config: ControllerConfig | None = None,
                 required_caches: tuple[CacheKind, ...] = tuple(CacheKind),
                 now: float = 0.0) -> None:
        if not required_caches or CacheKind.PREFIX not in required_caches:
            raise BadInput("the prefix cache must be among the required cache resets")
        self._cfg = config or ControllerConfig()
        self._required_caches = frozenset(required_caches)
        super().__init__(now)
        # Durable state: changed only by the appliers (``_APPLIERS``).
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
        self._entered_at = now
        self._history: list[tuple[State, State, Event, float, float]] = []

    # ---------------------------------------------------------------- queries
    @property
    def state(self) -> State:
        return self._state

    @property
    def committed(self) -> WeightVersion | None:
        return self._committed

    @property
    def identity(self) -> WeightIdentity | None:
        return self._identity

    @property
    def published(self) -> tuple[WeightVersion, ...]:
        return tuple(self._published)

    @property
    def active(self) -> Mapping[str, Binding]:
        return dict(self._active)

    @property
    def active_count(self) -> int:
        return len(self._active)

    @property
    def current_ticket(self) -> UpdateTicket | None:
        return None if self._update is None else self._update.ticket

    @property
    def current_sleep(self) -> SleepTicket | None:
        """The sleep in progress (DOZING to the wake's publish or taint), or None."""
        return self._sleep

    @property
    def pending_resets(self) -> frozenset[CacheKind]:
        return self._pending_resets()

    def _pending_resets(self) -> frozenset[CacheKind]:
        upd = self._update
        if upd is None:
            return frozenset(self._required_caches)
        return frozenset(self._required_caches - upd.reset_ok - upd.rule.deferred_resets)

    @property
    def config(self) -> ControllerConfig:
        return self._cfg

    @property
    def required_caches(self) -> frozenset[CacheKind]:
        return self._required_caches

    def serving_version(self, rollout_id: str) -> WeightVersion | None:
        """The version a bound rollout's next tokens come from (None: not bound).

        Its admission version, or, once an asynchronous update carried it and
        published, the version it continues under.
        """
        b = self._active.get(rollout_id)
        if b is None:
            return None
        return self._continues.get(rollout_id, b.version)

    def over_bound(self, rollout_id: str) -> bool:
        """Whether an update ended this rollout for exceeding ``max_staleness`` (recently)."""
        return rollout_id in self._over_bound

    @property
    def stale_rollouts(self) -> int:
        """Bound rollouts admitted under a version older than the committed one."""
        return sum(b.version != self._committed for b in self._active.values())

    @property
    def sweep_due(self) -> bool:
        """A prefix reset deferred by a keep-mode update is still to be done.

        It is ready once nothing admitted under an older version runs
        (``stale_rollouts == 0``) and the controller is READY; until then
        the version salt keeps new requests off the old blocks.
        """
        return self._sweep_due

    @property
    def failed_closed(self) -> str | None:
        """Why the controller refuses every step (a record could not be delivered), or None."""
        return self._broken

    def history(self) -> list[dict[str, Any]]:
        """Transitions with the time spent in the state that was left."""
        return [{"from": a.value, "to": b.value, "event": e.value, "at": t,
                 "duration_s": d} for a, b, e, t, d in self._history]

    def snapshot(self) -> dict[str, Any]:
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

    # ---------------------------------------------------------------- appliers
    # The only code that changes durable state; used live and by replay().
    def _apply_transition(self, rec: Transition) -> None:
        self._state = rec.after
        if rec.after is S.READY or rec.after is S.TAINTED:
            self._sleep = None  # awake (or abandoned to recovery): no sleep in progress

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

    def _apply_admit(self, rec: Admit) -> Binding:
        assert self._identity is not None
        b = Binding(rec.version, self._identity, rec.rollout_id, self.now)
        self._active[rec.rollout_id] = b
        return b

    def _apply_complete(self, rec: Complete) -> None:
        self._active.pop(rec.rollout_id, None)
        self._continues.pop(rec.rollout_id, None)
        self._accepted += rec.attributable

    def _apply_compacted(self, rec: Compacted) -> None:
        self._accepted += rec.accepted

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

    def _record(self, rec: Record) -> None:
        """Apply a record that changes durable state, and queue it for the listeners."""
        _APPLIERS[type(rec)](self, rec)
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
        now = self.now
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
            raise UpdateRefused(f"{event.value}: ticket "
                                f"{getattr(ticket, 'update_id', ticket)} does not own the "
                                f"update in progress")
        return self._update

    def _evidence(self, event: Event, ev: Evidence, problems: list[str]) -> None:
        if self.recording:
            self._outbox.append(EvidenceSeen(event, ev, tuple(problems)))

    def _verdict(self, event: Event, before: State, *, accepted: bool,
                 cls: Classification | None = None, problems: list[str] | None = None,
                 published: WeightVersion | None = None, report: bool = True) -> Verdict:
        v = Verdict(event, accepted, before, self._state, cls, tuple(problems or ()), published)
        if report and self.recording:
            self._outbox.append(v)
        return v

    def _step(self, event: Event, ticket: UpdateTicket, ev: Evidence, extra: Any = None,
              *, key: object = None) -> Verdict:
        """Every evidence event of an update: one skeleton over its ``STEPS`` row.

        Owned by the ticket, checked (the evidence's own postcondition and the
        row's checks), recorded; evidence that does not hold is a failure of the
        row's step; evidence that holds runs the row's effect, whose key picks the
        target, then whatever the new state triggers by itself.
        """
        rule = STEPS[event]
        if not isinstance(ev, rule.evidence):
            raise BadInput(f"{event.value} needs {rule.evidence.__name__}, "
                           f"got {type(ev).__name__}")
        upd = self._own(event, ticket)
        before = self._state
        if key is not None:
            self._target(event, key)  # an outcome the table has no entry for: refused now
        problems = rule.checks(self, upd, ev, extra)
        self._evidence(event, ev, problems)
        if rule.extra_is_evidence and extra is not None:
            self._evidence(event, extra, problems)
        if problems:
            return self._failure(event, rule.step, FailureKind.BAD_EVIDENCE, problems)
        committed = self._committed
        got = rule.effect(self, upd, ev, extra)
        self._go(event, key if key is not None else got)
        trigger = STATE_TRIGGERED.get(self._state)
        if trigger is not None and trigger[2](self):
            self._go(trigger[0], trigger[1])
        return self._verdict(event, before, accepted=True,
                             published=None if self._committed is committed
                             else self._committed)

    def _failure(self, event: Event, step: Step, kind: FailureKind, problems: list[str],
                 taint_problems: list[str] | None = None, *, report: bool = True) -> Verdict:
        """Classify (FAILURE_POLICY), decide the target (FAILURE_TARGETS), then apply."""
        before = self._state
        upd = self._update
        cls = FAILURE_POLICY[(step, kind)]
        mutated = upd is not None and (
            upd.mutation_started or (step is Step.TRANSFER and kind is not FailureKind.REFUSED))
        count = 0
        if cls is C.INCOMPLETE:
            count = (upd.incomplete.get(step, 0) if upd is not None else 0) + 1
            if count > self._cfg.max_incomplete:
                cls = ESCALATION[step]
                problems = [*problems, f"{step.value}: gave up after {count - 1} retries"]
        if cls is C.NO_MUTATION and upd is not None and (mutated or upd.aborting):
            cls = C.AMBIGUOUS  # a no_mutation claim never overrides what the controller knows
        if self._broken is not None and cls is not C.AMBIGUOUS and (
                before, C.AMBIGUOUS) in FAILURE_TARGETS:
            # Failed closed: the return to the old version could not be recorded
            # (nor proved by evidence, which is refused now), so the outcome is unknown.
            cls = C.AMBIGUOUS
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
        level, summary = verification_of(vals)
        if not problems and level < min_verification:
            problems.append(f"takeover verification reached {level.wire}, "
                            f"{min_verification.wire} required")
        self._evidence(E.BOOTSTRAP, ev, problems)
        for val in vals:
            self._evidence(E.BOOTSTRAP, val, problems)
        if problems:
            return self._failure(E.BOOTSTRAP, Step.BOOTSTRAP, FailureKind.BAD_EVIDENCE,
                                 problems)
        return self._commit(E.BOOTSTRAP, before, version,
                            identity.verified(level, summary) if vals else identity)

    def _commit(self, event: Event, before: State, version: WeightVersion,
                identity: WeightIdentity) -> Verdict:
        self._record(Commit(version, identity))
        self._go(event)
        return self._verdict(event, before, accepted=True, published=version)

    # ---------------------------------------------------------------- rollouts
    def admit(self, rollout_id: str, expect: WeightVersion | None = None) -> Binding:
        """Bind a rollout to the committed version; raise AdmissionRefused outside READY.

        ``expect``: the version the caller routed the rollout for (a fleet's
        router). Another committed version refuses the admission, retryably,
        and binds nothing: a binding never names a version its caller did not
        choose.
        """
        if not isinstance(rollout_id, str) or not rollout_id or len(rollout_id) > 256:
            raise BadInput("rollout_id must be a non-empty string of at most 256 characters")
        st = self._state
        if self._broken is not None:
            raise AdmissionRefused(st.value, f"the controller failed closed ({self._broken})",
                                   None)
        if (st, E.ADMIT) not in TRANSITIONS:
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
            if self.recording:
                self._outbox.append(Refuse(rollout_id, st, reason))
            raise AdmissionRefused(st.value, reason, retry)
        if expect is not None and expect != self._committed:
            reason = (f"routed for {expect.label}, but the engine now serves "
                      f"{self._committed.label if self._committed else 'nothing'}")
            if self.recording:
                self._outbox.append(Refuse(rollout_id, st, reason))
            raise AdmissionRefused(st.value, reason, self._cfg.retry_after_s)
        cap = self._capacity()
        if cap is not None and cap <= 0:
            reason = (f"staleness capacity reached: {len(self._active)} running and "
                      f"{self._accepted} accepted for max_staleness "
                      f"{self._cfg.max_staleness} at version {len(self._published) - 1}")
            if self.recording:
                self._outbox.append(Refuse(rollout_id, st, reason))
            raise AdmissionRefused(st.value, reason, self._cfg.retry_after_s)
        if rollout_id in self._active:
            raise BadInput(f"rollout {rollout_id!r} is already active")
        assert self._committed is not None and self._identity is not None
        rec = Admit(rollout_id, self._committed, self._identity.digest)
        b = self._apply_admit(rec)
        self._outbox.append(rec)
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
        self._outbox.append(rec)
        return Completion(b, self.now, self._state, self._committed, attributable)

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
            self._outbox.append(rec)
            c = Completion(b, self.now, self._state, self._committed, False, aborted=reason)
            self._aborted[rid] = c
            while len(self._aborted) > _ABORTED_KEPT:
                self._aborted.popitem(last=False)
            out.append(c)
        return out

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
        return self._update.ticket

    def drained(self, ticket: UpdateTicket, ev: DrainEvidence) -> Verdict:
        """The engine paused as the update mode's row says (``rules.UPDATE_MODES``).

        Strict: nothing bound, nothing in flight. Asynchronous: paused in the
        row's mode; the bound rollouts are carried across the update (a
        ``carry`` record), less those that would exceed ``max_staleness``
        once the target is published, which end here, unattributable.
        """
        return self._step(E.DRAINED, ticket, ev)

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
            self._outbox.append(rec)

    def preflighted(self, ticket: UpdateTicket, ev: PreflightEvidence) -> Verdict:
        """begin_update: the preflight holds and no rollout is bound, so mutation may start.

        (Asynchronous modes: rollouts carried at the pause stay bound.)
        """
        return self._step(E.PREFLIGHTED, ticket, ev)

    def transferred(self, ticket: UpdateTicket, ev: TransferEvidence) -> Verdict:
        return self._step(E.TRANSFERRED, ticket, ev)

    def invalidated(self, ticket: UpdateTicket, ev: CacheResetEvidence) -> Verdict:
        """One cache reset; VALIDATING once every required cache has been reset."""
        return self._step(E.INVALIDATED, ticket, ev)

    def validated(self, ticket: UpdateTicket, ev: ValidationEvidence) -> Verdict:
        """The validation while paused. It must hold; a failed one taints."""
        return self._step(E.VALIDATED, ticket, ev)

    def resumed(self, ticket: UpdateTicket, ev: ResumeEvidence,
                live: ValidationEvidence | None = None) -> Verdict:
        """Resume confirmed (plus the live validation, if any): publish, or taint.

        On the abort path (nothing mutated) this returns to READY on the old
        version and publishes nothing.
        """
        if live is not None and not isinstance(live, ValidationEvidence):
            raise BadInput("the live validation must be ValidationEvidence")
        upd = self._own(E.RESUMED, ticket)
        if upd.aborting and live is not None:
            raise BadInput("no live validation on the abort path: nothing was installed")
        return self._step(E.RESUMED, ticket, ev, live)

    def fail(self, ticket: UpdateTicket | SleepTicket | None, step: Step, kind: FailureKind,
             reason: str) -> Verdict:
        """An effect failed (raised, timed out, died): ``FAIL_STEPS`` then ``FAILURE_POLICY``.

        In READY the failure is the engine's while serving (``Step.SERVE``,
        no ticket); during an update it needs the update's ticket.
        """
        if not isinstance(step, Step) or not isinstance(kind, FailureKind):
            raise BadInput("fail needs a Step and a FailureKind")
        return self._fail(ticket, step, kind, str(reason), report=True)

    def _fail(self, ticket: UpdateTicket | SleepTicket | None, step: Step, kind: FailureKind,
              reason: str, *, report: bool) -> Verdict:
        """``fail`` itself; ``report=False`` (restore) records only the transition and
        the taint, as a restore always has."""
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
        if self._state in UPDATE_STATES:
            if not isinstance(ticket, UpdateTicket):
                raise BadInput("fail during an update needs the ticket")
            self._own_any(E.FAIL, ticket)
        if self._state in _SLEEP_STATES:
            self._own_sleeping(E.FAIL, ticket)
        if report and self.recording:
            self._outbox.append(Failure(row, kind, reason))
        # Serving: the verdict names the observation, the taint record what it means.
        return self._failure(E.FAIL, row, kind, [reason],
                             [f"engine failed while serving: {reason}"]
                             if row is Step.SERVE else None, report=report)

    def swept(self, ev: CacheResetEvidence) -> bool:
        """The deferred prefix reset's evidence; True once it holds (nothing due after).

        Refused (``InvalidTransition``) outside READY: an update resets caches itself.
        """
        if not isinstance(ev, CacheResetEvidence) or ev.cache is not CacheKind.PREFIX:
            raise BadInput("swept needs the prefix cache's CacheResetEvidence")
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
        return not problems

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
        return self._sleep

    def slept(self, ticket: SleepTicket, ev: SleepEvidence) -> Verdict:
        """The engine is asleep at the level asked, nothing bound: SLEEPING, or a taint."""
        if not isinstance(ev, SleepEvidence):
            raise BadInput("slept needs SleepEvidence")
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
            return self._failure(E.SLEPT, Step.SLEEP, FailureKind.BAD_EVIDENCE, problems)
        self._go(E.SLEPT)
        return self._verdict(E.SLEPT, before, accepted=True)

    def wake_target(self, owner: str, identity: WeightIdentity | None = None, *,
                    label: str | None = None) -> UpdateTarget:
        """What ``request_wake`` would install (for the preflight that must come with it).

        No identity: the committed version itself (a restore). Changes nothing.
        """
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
        if self._broken is not None:
            raise UpdateRefused(f"the controller failed closed ({self._broken})")
        if self._sleep != sleep:
            raise UpdateRefused(f"sleep {sleep.sleep_id} is not the sleep in progress")
        if self._update is not None:
            raise UpdateRefused(f"a wake by {self._update.ticket.target.owner!r} is in "
                                f"progress (state {self._state.value}); one at a time")
        if (self._state, E.REQUEST_WAKE) not in TRANSITIONS:
            raise UpdateRefused(f"a wake starts only in SLEEPING, not {self._state.value}")
        target = self.wake_target(owner, identity, label=label)
        if preflight is not None:
            problems = preflight.problems(target)
            self._evidence(E.REQUEST_WAKE, preflight, problems)
            if problems:
                raise UpdateRefused(f"wake refused, the engine still sleeps: "
                                    f"{'; '.join(problems)}")
        rec = RequestWake(self._next_update_id, owner, target.version,
                          target.identity, 0, level, sleep.level, identity is None)
        self._record(rec)
        if identity is not None:
            # From here the target's label may reach the engine: never reuse it.
            self._record(BeginUpdate(rec.update_id, target.version))
        self._go(E.REQUEST_WAKE)
        assert self._update is not None
        return self._update.ticket

    def woke(self, ticket: UpdateTicket, ev: WakeEvidence) -> Verdict:
        """One wake call. ``WAKE_TARGETS`` decides where it leads; a wake it has no
        entry for is refused (``InvalidTransition``, nothing changes)."""
        if not isinstance(ev, WakeEvidence):
            raise BadInput("woke needs WakeEvidence")
        upd = self._own(E.WOKE, ticket)
        key = (self._state, "restore" if upd.restore else "update", ev.tags.value)
        return self._step(E.WOKE, ticket, ev, key=key)

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
        self._check(E.BEGIN_RECOVERY)
        if self.recording:
            self._outbox.append(BeginRecovery(owner))
        self._go(E.BEGIN_RECOVERY)

    def recovered(self, ev: RecoveryEvidence) -> Verdict:
        """A replacement engine (new epoch) verified on a known checkpoint: READY again.

        It is published as a *new* generation on the new epoch, so nothing
        admitted before the taint can be attributed to the recovered engine.
        """
        if not isinstance(ev, RecoveryEvidence):
            raise BadInput("recovered needs RecoveryEvidence")
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
            if self.recording:
                self._outbox.append(Failure(Step.RECOVER, FailureKind.BAD_EVIDENCE,
                                            "; ".join(problems)))
            return self._failure(E.RECOVERED, Step.RECOVER, FailureKind.BAD_EVIDENCE,
                                 problems)
        level, summary = verification_of([ev.validation])
        return self._commit(E.RECOVERED, before, version,
                            ev.identity.verified(level, summary))

    def recovery_target(self) -> WeightVersion:
        """The version a recovery would publish (its label must be set on the new engine)."""
        gen = self._fresh_generation()
        return WeightVersion(gen, label_for(gen), self._engine_epoch or "pending")

    # ---------------------------------------------------------------- crash restore
    def replay(self, records: Iterable[Record | JournalRecord]) -> None:
        """Apply a journal's records, each checked against the tables (see ``restored``).

        Each record that changed durable state is applied through the same
        applier that applied it live; a transition must leave the state the
        replay is in, for a target the table allows, and an admission must
        name the committed identity: a journal that breaks them raises
        ``JournalError``. Nothing is recorded (the records are the journal's).
        """
        for r in records:
            rec = r.record if isinstance(r, JournalRecord) else r
            t = type(rec)
            if isinstance(rec, Transition):
                if rec.before is not self._state or rec.after not in _replay_targets(
                        rec.before, rec.event):
                    raise JournalError(
                        f"journal replays {rec.before.value} -> {rec.after.value} on "
                        f"{rec.event.value} while the controller is {self._state.value}: "
                        f"not a transition of its tables")
            elif isinstance(rec, Admit) and (
                    (self._state, E.ADMIT) not in TRANSITIONS or self._identity is None
                    or rec.identity_digest != self._identity.digest):
                raise JournalError(f"journal admits {rec.rollout_id!r} in "
                                   f"{self._state.value} under an identity not committed")
            applier = _APPLIERS.get(t)
            if applier is not None:
                applier(self, rec)
            # Every other record describes a decision; it changes no durable state.

    def restored(self) -> None:
        """End a replay (``replay``): what a controller restored from its journal does first.

        An update (or recovery, or sleep) that was in flight when the process
        died is never resumed as if it had succeeded: whatever step it had
        reached, it is failed with ``Step.RESTART`` (ambiguous: TAINTED), and
        only recovery leads back to READY. Rollouts the journal shows still
        bound belonged to the dead process: each is released at once with a
        ``complete`` record that says it is not attributable.
        """
        self._entered_at = self.now
        upd = self._update
        if self._state in UPDATE_STATES and upd is None:
            raise JournalError(f"journal ends in {self._state.value} without the "
                               f"request_update that opened the update")
        if self._state in _SLEEP_STATES and self._sleep is None:
            raise JournalError(f"journal ends in {self._state.value} without the "
                               f"request_sleep that opened the sleep")
        if self.recording:
            self._outbox.append(Restore(self._state, len(self._active),
                                        None if upd is None else upd.request))
        # Rollouts bound by the process that wrote the journal died with it:
        # released here, unattributable (recorded as such), never kept active.
        for rid, b in list(self._active.items()):
            rec = Complete(rid, b.version, self._state, False)
            self._apply_complete(rec)
            self._outbox.append(rec)
        if (self._state, Step.RESTART) in FAIL_STEPS:
            what = ("a recovery" if self._state is S.RECOVERING else
                    "a sleep" if self._state in _SLEEP_STATES else "an update")
            self._fail(upd.ticket if upd is not None else self._sleep, Step.RESTART,
                       FailureKind.DIED, f"controller restarted during {what}", report=False)


#: Record type -> the applier that makes its change of durable state; used by live
#: decisions (``_record``) and by the restore (``replay``) alike.
_APPLIERS: Mapping[type[Record], Callable[[Lifecycle, Any], object]] = {
    Transition: Lifecycle._apply_transition,
    Commit: Lifecycle._apply_commit,
    Admit: Lifecycle._apply_admit,
    Complete: Lifecycle._apply_complete,
    Compacted: Lifecycle._apply_compacted,
    RequestUpdate: Lifecycle._apply_request_update,
    RequestWake: Lifecycle._apply_request_wake,
    BeginUpdate: Lifecycle._apply_begin_update,
    Abandon: Lifecycle._apply_end_update,
    Taint: Lifecycle._apply_end_update,
    Carry: Lifecycle._apply_carry,
    RequestSleep: Lifecycle._apply_request_sleep,
}


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
