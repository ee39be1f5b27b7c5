"""The lifecycle's state: its value types, its durable state and the records that change it.

``core.lifecycle`` (the module docstring there is the theory of operation)
decides; this module holds what it decides over, split off along the
machine's own seam (h11's ``_state.py`` keeps the same line between the
state and the events): ``ControllerConfig``, the tickets, the update in
flight (``UpdateInFlight``), ``verification_of``, and ``LifecycleState``: the
durable state, its read-only queries, the appliers (``_APPLIERS``: the only
code that changes durable state, used live and by the journal's replay) and
the internals every decision goes through (the table lookup, the move, the
failure path). Standard library only, no I/O, like the rest of the core.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.core.evidence import (
    CacheKind,
    Evidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.records import (
    Abandon,
    Admit,
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
    RequestSleep,
    RequestUpdate,
    RequestWake,
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
    SLEEP_STATES,
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
    label_for,
)
from rolloutcore.core.vocab import Machine
from rolloutcore.errors import (
    BadInput,
    InvalidTransition,
    JournalError,
    UpdateRefused,
)

__all__ = ["Completion", "ControllerConfig", "LifecycleState", "SleepTicket",
           "UpdateInFlight", "UpdateTicket", "judge_takeover", "verification_of"]

S, E = State, Event
C = Classification
_OVER_BOUND_KEPT = 4096  # rollout ids ended over the staleness bound, remembered for owners


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
class UpdateInFlight:
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


def judge_takeover(problems: Iterable[str], vals: Iterable[ValidationEvidence],
                   target: UpdateTarget, min_verification: VerificationLevel
                   ) -> tuple[list[str], VerificationLevel, list[str]]:
    """A takeover's validations of ``target`` judged as an update's: ``problems`` (those
    found before) plus each one's, and one more where they are none yet the level
    reached is under ``min_verification``; the level and the checks' summary."""
    vals = list(vals)
    found = [*problems, *(p for v in vals for p in v.problems(target))]
    level, summary = verification_of(vals)
    if not found and level < min_verification:
        found.append(f"takeover verification reached {level.wire}, "
                     f"{min_verification.wire} required")
    return found, level, summary


class LifecycleState(Machine):
    """The sans-I/O lifecycle's state; ``core.lifecycle.Lifecycle`` adds the decisions.

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
        # What was committed before the last commit (shown while that one is unrecorded).
        self._prior: tuple[WeightVersion | None, WeightIdentity | None] = (None, None)
        self._published: list[WeightVersion] = []
        self._active: dict[str, Binding] = {}
        # Working memory, not durable: bindings a policy abort released, kept so
        # that the rollout's own ``complete`` can say so (bounded, oldest dropped).
        self._aborted: collections.OrderedDict[str, Completion] = collections.OrderedDict()
        self._update: UpdateInFlight | None = None
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

    def commits(self, record: Record) -> bool:
        """A ``commit`` record (bootstrap, publish, recovery): nothing is admitted under
        its version before it is on record (``control.shell``)."""
        return type(record) is Commit

    @property
    def on_record(self) -> tuple[WeightVersion | None, WeightIdentity | None]:
        """The committed version and identity as the journal has them: the ones before a
        commit that is not on record (``unrecorded``), else the committed ones."""
        return self._prior if self.unrecorded else (self._committed, self._identity)

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
        self._prior = (self._committed, self._identity)
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
        self._update = UpdateInFlight(ticket, rec, mode=self._cfg.update_mode)
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

    def _note(self, rec: Record) -> None:
        """Queue a record that changes no durable state (only while anyone listens)."""
        if self.recording:
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

    def _own(self, event: Event, ticket: UpdateTicket) -> UpdateInFlight:
        self._check(event)
        return self._own_any(event, ticket)

    def _own_any(self, event: Event, ticket: UpdateTicket) -> UpdateInFlight:
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
        self._note(EvidenceSeen(event, ev, tuple(problems)))

    def _verdict(self, event: Event, before: State, *, accepted: bool,
                 cls: Classification | None = None, problems: list[str] | None = None,
                 published: WeightVersion | None = None, report: bool = True) -> Verdict:
        v = Verdict(event, accepted, before, self._state, cls, tuple(problems or ()), published)
        if report and self.recording:
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

    def _carry(self, upd: UpdateInFlight) -> None:
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
            self._record(Complete(rid, self._active[rid].version, self._state, False))

    def _capacity(self) -> int | None:
        """AReaL's admission capacity: ``(k + v + 1) * batch - (accepted + running)``."""
        k, batch = self._cfg.max_staleness, self._cfg.admission_batch
        if k is None or batch is None:
            return None
        return (k + max(0, len(self._published) - 1) + 1) * batch - (
            self._accepted + len(self._active))

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
        if self._state in SLEEP_STATES:
            self._own_sleeping(E.FAIL, ticket)
        if report and self.recording:
            self._outbox.append(Failure(row, kind, reason))
        # Serving: the verdict names the observation, the taint record what it means.
        return self._failure(E.FAIL, row, kind, [reason],
                             [f"engine failed while serving: {reason}"]
                             if row is Step.SERVE else None, report=report)

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


#: Record type -> the applier that makes its change of durable state; used by live
#: decisions (``_record``) and by the restore (``replay``) alike.
_APPLIERS: Mapping[type[Record], Callable[[LifecycleState, Any], object]] = {
    Transition: LifecycleState._apply_transition,
    Commit: LifecycleState._apply_commit,
    Admit: LifecycleState._apply_admit,
    Complete: LifecycleState._apply_complete,
    Compacted: LifecycleState._apply_compacted,
    RequestUpdate: LifecycleState._apply_request_update,
    RequestWake: LifecycleState._apply_request_wake,
    BeginUpdate: LifecycleState._apply_begin_update,
    Abandon: LifecycleState._apply_end_update,
    Taint: LifecycleState._apply_end_update,
    Carry: LifecycleState._apply_carry,
    RequestSleep: LifecycleState._apply_request_sleep,
}


def _replay_targets(state: State, event: Event) -> frozenset[State]:
    """Targets a journal may show for (state, event).

    Schema 1 labelled a transition caused by failing evidence with the
    evidence's event rather than ``fail``; such a journal still restores.
    """
    out = targets(state, event) if (state, event) in TRANSITIONS else frozenset()
    if event is not E.FAIL and (state, E.FAIL) in TRANSITIONS:
        out |= targets(state, E.FAIL)
    return out
