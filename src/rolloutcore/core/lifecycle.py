"""The lifecycle controller of one inference engine: states, transitions, invariants.

House rules (after h11's ``_state.py``):

* Everything that decides *whether* the engine may serve, mutate or publish
  lives in this file and the two it stands on: ``core.lifecycle_state`` (the
  state the decisions read, the appliers that alone change it, the failure
  path) and ``core.steps`` (the update's step table). It decides through
  tables: ``TRANSITIONS`` names
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
  such a record, through the ``_apply_*`` methods (``core.lifecycle_state``),
  and by nothing else; a crash restore replays the journal's records through
  the same methods (``replay``, then ``restored`` here), so the restored
  controller is what the journal says.
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
(``core.steps.STEPS``: the event's failure row, the evidence it takes, its checks, its
effect), as h2's stream machine maps (state, input) to (effect, target);
a transition the state itself triggers (a keep-mode transfer that leaves
no cache to reset) is a row of ``STATE_TRIGGERED``, as in h11.
"""

from __future__ import annotations

from collections.abc import Iterable

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
from rolloutcore.core.lifecycle_state import (
    Completion,
    LifecycleState,
    SleepTicket,
    UpdateTicket,
    judge_takeover,
    verification_of,
)
from rolloutcore.core.records import (
    Admit,
    BeginRecovery,
    BeginUpdate,
    Classification,
    Commit,
    Complete,
    Event,
    Failure,
    FailureKind,
    Refuse,
    RequestSleep,
    RequestUpdate,
    RequestWake,
    Restore,
    State,
    Step,
    UpdateMode,
    Verdict,
)
from rolloutcore.core.rules import (
    FAIL_STEPS,
    SLEEP_STATES,
    TRANSITIONS,
    UPDATE_STATES,
)
from rolloutcore.core.steps import STATE_TRIGGERED, STEPS
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
    "Binding",
    "Classification",
    "Event",
    "FailureKind",
    "Lifecycle",
    "State",
    "Step",
    "UpdateMode",
    "Verdict",
]

S, E = State, Event
#: Rollouts released by ``abort_rollouts`` whose own ``complete`` has not come yet.
_ABORTED_KEPT = 4096


class Lifecycle(LifecycleState):
    """The sans-I/O lifecycle of one engine; see the module docstring.

    Not thread-safe, by design: the shell (``control.controller``) runs it under
    its lock. Its state, queries and appliers are ``LifecycleState``'s
    (``core.lifecycle_state``); here are the decisions.
    """

    def _step(self, event: Event, ticket: UpdateTicket, ev: Evidence,
              extra: ValidationEvidence | None = None, *, key: object = None) -> Verdict:
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
        # An engine already labelled rc-N by an earlier controller continues
        # at generation N, so labels and generations keep agreeing.
        version = WeightVersion(generation_of(label) or 0, label or label_for(0),
                                ev.engine_epoch)
        problems, level, summary = judge_takeover(
            ev.problems(None), vals, UpdateTarget(version, identity, "bootstrap"),
            min_verification)
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
            elif st in SLEEP_STATES:
                retry, reason = (self._cfg.recovering_retry_after_s,
                                 "engine is asleep (colocated training); it serves "
                                 "again once woken and verified")
            else:
                retry, reason = self._cfg.retry_after_s, "a policy update is in progress"
            raise self._refuse(rollout_id, reason, retry)
        if self.unrecorded:
            # Published, but its commit record is not on disk yet: a crash now would
            # restore the version before it, so nothing may be served under it.
            label = self._committed.label if self._committed else "the version"
            raise self._refuse(rollout_id, f"the publish of {label} is being recorded",
                               self._cfg.retry_after_s)
        if expect is not None and expect != self._committed:
            raise self._refuse(rollout_id, f"routed for {expect.label}, but the engine now "
                               f"serves {self._committed.label if self._committed else 'nothing'}",
                               self._cfg.retry_after_s)
        cap = self._capacity()
        if cap is not None and cap <= 0:
            raise self._refuse(rollout_id, f"staleness capacity reached: {len(self._active)} "
                               f"running and {self._accepted} accepted for max_staleness "
                               f"{self._cfg.max_staleness} at version {len(self._published) - 1}",
                               self._cfg.retry_after_s)
        if rollout_id in self._active:
            raise BadInput(f"rollout {rollout_id!r} is already active")
        assert self._committed is not None and self._identity is not None
        rec = Admit(rollout_id, self._committed, self._identity.digest)
        b = self._apply_admit(rec)
        self._outbox.append(rec)
        return b

    def _refuse(self, rollout_id: str, reason: str, retry: float | None) -> AdmissionRefused:
        """A refused admission, recorded: for its caller to raise."""
        self._note(Refuse(rollout_id, self._state, reason))
        return AdmissionRefused(self._state.value, reason, retry)

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
        self._record(Complete(rollout_id, b.version, self._state, attributable))
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
            self._record(Complete(rid, b.version, self._state, False))
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
        if self._state in SLEEP_STATES:
            raise UpdateRefused(
                f"the engine is asleep ({self._state.value}): an update is its wake "
                f"(request_wake); nothing was sent (weights sent to a sleeping engine "
                f"land in released memory, vLLM #57853)")
        if (self._state, E.REQUEST_UPDATE) not in TRANSITIONS:
            raise UpdateRefused(f"updates start only in READY, not {self._state.value}")
        nxt = self._next_version(label)
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
        return UpdateTarget(self._next_version(label), identity, owner)

    def _next_version(self, label: str | None) -> WeightVersion:
        """The next generation on the committed epoch, labelled ``label`` (or rc-N)."""
        assert self._committed is not None
        gen = self._fresh_generation()
        nxt = WeightVersion(gen, label or label_for(gen), self._committed.engine_epoch)
        if nxt.label in self._used_labels:
            raise BadInput(f"label {nxt.label!r} was already used; labels name one "
                           f"weight set each")
        return nxt

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

    # ---------------------------------------------------------------- recovery
    def begin_recovery(self, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        self._check(E.BEGIN_RECOVERY)
        self._note(BeginRecovery(owner))
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
            self._note(Failure(Step.RECOVER, FailureKind.BAD_EVIDENCE, "; ".join(problems)))
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
        if self._state in SLEEP_STATES and self._sleep is None:
            raise JournalError(f"journal ends in {self._state.value} without the "
                               f"request_sleep that opened the sleep")
        self._note(Restore(self._state, len(self._active),
                           None if upd is None else upd.request))
        # Rollouts bound by the process that wrote the journal died with it:
        # released here, unattributable (recorded as such), never kept active.
        for rid, b in list(self._active.items()):
            self._record(Complete(rid, b.version, self._state, False))
        if (self._state, Step.RESTART) in FAIL_STEPS:
            what = ("a recovery" if self._state is S.RECOVERING else
                    "a sleep" if self._state in SLEEP_STATES else "an update")
            self._fail(upd.ticket if upd is not None else self._sleep, Step.RESTART,
                       FailureKind.DIED, f"controller restarted during {what}", report=False)
