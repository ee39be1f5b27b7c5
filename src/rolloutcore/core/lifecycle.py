"""The lifecycle controller of one inference engine: states, transitions, invariants.

House rules (after h11's ``_state.py``):

* Everything that decides *whether* the engine may serve, mutate or publish
  lives in this file. It performs no I/O: it never talks to an engine, a
  trainer, a socket or a file. Adapters perform effects and hand back typed
  evidence (``rolloutcore.core.evidence``); the controller checks the evidence's
  postcondition and advances, waits, refuses or taints.
* It knows nothing of vLLM, HTTP or tensors. Standard library only.
* It is safe to call from many threads: one lock guards all of its state
  (no reliance on the GIL); one condition variable wakes whoever waits for
  the active rollouts to drain.

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

``drained`` is accepted only when the engine reports paused with nothing in
flight *and* no rollout is bound locally; otherwise the controller stays in
DRAINING (an incomplete observation, retried within the drain deadline). So
no mutation can begin while a rollout admitted under the old version is
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
Rollouts still bound then complete unattributable.

``TRANSITIONS`` is the one table of legal (state, event) pairs and the states
each may lead to; an event with no entry raises ``InvalidTransition`` and
changes nothing.
"""

from __future__ import annotations

import enum
import itertools
import re
import threading
import time
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
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
    evidence_to_dict,
)
from rolloutcore.core.versions import VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.errors import AdmissionRefused, BadInput, InvalidTransition, UpdateRefused

__all__ = [
    "ESCALATION",
    "FAILURE_POLICY",
    "TRANSITIONS",
    "Binding",
    "Classification",
    "Completion",
    "ControllerConfig",
    "Event",
    "FailureKind",
    "LifecycleController",
    "State",
    "Step",
    "UpdateTicket",
    "Verdict",
]


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


S, E = State, Event
_ALL_BUT_UNINIT = tuple(s for s in State if s is not S.UNINITIALIZED)

#: The one table of legal (state, event) pairs -> the states they may lead to.
#: Where several, the evidence decides (e.g. DRAINED stays in DRAINING while a
#: rollout is still bound; a bad transfer taints or, if it provably mutated
#: nothing, goes to RESUMING to return to service on the old version).
TRANSITIONS: Mapping[tuple[State, Event], frozenset[State]] = {
    (S.UNINITIALIZED, E.BOOTSTRAP): frozenset({S.READY, S.UNINITIALIZED}),
    (S.UNINITIALIZED, E.FAIL): frozenset({S.UNINITIALIZED}),
    (S.READY, E.ADMIT): frozenset({S.READY}),
    **{(s, E.COMPLETE): frozenset({s}) for s in _ALL_BUT_UNINIT},
    (S.READY, E.REQUEST_UPDATE): frozenset({S.DRAINING}),
    # The engine failed while serving (died, restarted, stopped answering): what it
    # serves next is unknown, so it leaves service until a recovery replaces it.
    (S.READY, E.FAIL): frozenset({S.TAINTED}),
    (S.DRAINING, E.DRAINED): frozenset({S.QUIESCED, S.DRAINING, S.RESUMING}),
    (S.DRAINING, E.FAIL): frozenset({S.DRAINING, S.RESUMING}),
    (S.QUIESCED, E.PREFLIGHTED): frozenset({S.UPDATING, S.RESUMING}),
    (S.QUIESCED, E.FAIL): frozenset({S.RESUMING}),
    (S.UPDATING, E.TRANSFERRED): frozenset({S.INVALIDATING, S.TAINTED}),
    (S.UPDATING, E.FAIL): frozenset({S.RESUMING, S.TAINTED}),
    (S.INVALIDATING, E.INVALIDATED): frozenset({S.VALIDATING, S.INVALIDATING, S.TAINTED}),
    (S.INVALIDATING, E.FAIL): frozenset({S.INVALIDATING, S.TAINTED}),
    (S.VALIDATING, E.VALIDATED): frozenset({S.RESUMING, S.TAINTED}),
    (S.VALIDATING, E.FAIL): frozenset({S.VALIDATING, S.TAINTED}),
    (S.RESUMING, E.RESUMED): frozenset({S.READY, S.TAINTED}),
    (S.RESUMING, E.FAIL): frozenset({S.TAINTED}),
    (S.TAINTED, E.BEGIN_RECOVERY): frozenset({S.RECOVERING}),
    (S.RECOVERING, E.RECOVERED): frozenset({S.READY, S.TAINTED}),
    (S.RECOVERING, E.FAIL): frozenset({S.TAINTED}),
}


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


#: Which state each step's effect runs in.
STEP_STATE: Mapping[Step, State] = {
    Step.BOOTSTRAP: S.UNINITIALIZED,
    Step.DRAIN: S.DRAINING,
    Step.PREFLIGHT: S.QUIESCED,
    Step.TRANSFER: S.UPDATING,
    Step.INVALIDATE: S.INVALIDATING,
    Step.VALIDATE: S.VALIDATING,
    Step.RESUME: S.RESUMING,
    Step.RECOVER: S.RECOVERING,
    Step.SERVE: S.READY,
}


class FailureKind(enum.StrEnum):
    REFUSED = "refused"            # the effect proves it did nothing (e.g. rejected up front)
    ERROR = "error"                # raised / server error / connection cut
    TIMEOUT = "timeout"            # overran its deadline
    BAD_EVIDENCE = "bad_evidence"  # returned, but the postcondition does not hold
    DIED = "died"                  # the engine or trainer process is gone


class Classification(enum.StrEnum):
    NO_MUTATION = "no_mutation"
    INCOMPLETE = "incomplete"
    AMBIGUOUS = "ambiguous"


_RC_LABEL = re.compile(r"^rc-(\d+)$")
_NM, _INC, _AMB = Classification.NO_MUTATION, Classification.INCOMPLETE, Classification.AMBIGUOUS
_K = FailureKind

#: The failure policy: (step, kind) -> class. Enforced by ``LifecycleController.fail``.
#: Read by row: a drain that fails in any way mutated nothing; a transfer that
#: fails mutated nothing only when it was refused up front; a cache reset or a
#: label read that comes back incomplete may be retried; once a mutation may
#: have started, anything else is ambiguous.
FAILURE_POLICY: Mapping[tuple[Step, FailureKind], Classification] = {
    # step              REFUSED       ERROR          TIMEOUT        BAD_EVIDENCE   DIED
    **dict(zip([(Step.BOOTSTRAP, k) for k in _K], [_NM, _NM, _NM, _NM, _NM], strict=True)),
    **dict(zip([(Step.DRAIN, k) for k in _K], [_NM, _NM, _NM, _INC, _NM], strict=True)),
    **dict(zip([(Step.PREFLIGHT, k) for k in _K], [_NM, _NM, _NM, _NM, _NM], strict=True)),
    **dict(zip([(Step.TRANSFER, k) for k in _K], [_NM, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.INVALIDATE, k) for k in _K], [_INC, _INC, _AMB, _INC, _AMB], strict=True)),
    **dict(zip([(Step.VALIDATE, k) for k in _K], [_INC, _INC, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.RESUME, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.RECOVER, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.SERVE, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
}

#: Where an incomplete observation ends up once its retries are used up.
ESCALATION: Mapping[Step, Classification] = {
    Step.DRAIN: _NM,
    Step.INVALIDATE: _AMB,
    Step.VALIDATE: _AMB,
}


@dataclass(frozen=True)
class ControllerConfig:
    max_incomplete: int = 3
    retry_after_s: float = 1.0     # admission hint while an update runs
    recovering_retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_incomplete < 0 or self.retry_after_s <= 0 or self.recovering_retry_after_s <= 0:
            raise BadInput("ControllerConfig values must be positive")


@dataclass(frozen=True)
class Binding:
    """A rollout admitted under one committed version."""

    rollout_id: str
    version: WeightVersion
    identity: WeightIdentity
    admitted_at: float


@dataclass(frozen=True)
class Completion:
    binding: Binding
    completed_at: float
    state: State
    committed: WeightVersion | None
    #: True when the version the rollout was bound to is still what the engine
    #: is known to serve (False e.g. if the engine was tainted meanwhile).
    attributable: bool


@dataclass(frozen=True)
class UpdateTicket:
    """Proof of update ownership; every step of the update must present it."""

    update_id: int
    target: UpdateTarget
    min_verification: VerificationLevel


@dataclass(frozen=True)
class Verdict:
    """What the controller made of one event."""

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


Listener = Callable[[str, dict[str, Any]], None]


@dataclass
class _Update:
    ticket: UpdateTicket
    aborting: bool = False          # RESUMING to return to the *old* version
    mutation_started: bool = False
    incomplete: dict[Step, int] = field(default_factory=dict)
    reset_ok: set[CacheKind] = field(default_factory=set)
    validations: list[ValidationEvidence] = field(default_factory=list)


class LifecycleController:
    """The sans-I/O lifecycle of one engine. Thread-safe. See the module docstring."""

    def __init__(self, *, config: ControllerConfig | None = None,
                 required_caches: tuple[CacheKind, ...] = tuple(CacheKind),
                 clock: Callable[[], float] = time.monotonic,
                 listener: Listener | None = None) -> None:
        if not required_caches or CacheKind.PREFIX not in required_caches:
            raise BadInput("the prefix cache must be among the required cache resets")
        self._cfg = config or ControllerConfig()
        self._required_caches = frozenset(required_caches)
        self._clock = clock
        self._listeners: list[Listener] = [listener] if listener else []
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._state = S.UNINITIALIZED
        self._entered_at = clock()
        self._committed: WeightVersion | None = None
        self._identity: WeightIdentity | None = None
        self._published: list[WeightVersion] = []
        self._active: dict[str, Binding] = {}
        self._update: _Update | None = None
        self._update_ids = itertools.count(1)
        self._history: list[tuple[State, State, Event, float, float]] = []
        self._max_generation = -1
        self._used_labels: set[str] = set()   # published, or burnt at begin_update
        self._engine_epoch: str | None = None

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
    def pending_resets(self) -> frozenset[CacheKind]:
        with self._lock:
            done = self._update.reset_ok if self._update else set()
            return frozenset(self._required_caches - done)

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
            }

    def add_listener(self, listener: Listener) -> None:
        """Listeners see every record, in order, under the lock (keep them quick)."""
        with self._lock:
            self._listeners.append(listener)

    # ---------------------------------------------------------------- internals
    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        for listener in self._listeners:
            listener(kind, data)

    def _check(self, event: Event) -> None:
        if (self._state, event) not in TRANSITIONS:
            raise InvalidTransition(event.value, self._state.value)

    def _move(self, event: Event, to: State) -> None:
        allowed = TRANSITIONS[(self._state, event)]
        assert to in allowed, f"table violation: {self._state}->{to} on {event}"
        now = self._clock()
        frm = self._state
        if to is not frm:
            self._history.append((frm, to, event, now, now - self._entered_at))
            if self._listeners:  # records are built only for someone to read them
                self._emit("transition", {"from": frm.value, "to": to.value,
                                          "event": event.value,
                                          "duration_s": now - self._entered_at})
            self._state = to
            self._entered_at = now
            if to is S.READY:
                self._idle.notify_all()

    def _own(self, event: Event, ticket: UpdateTicket) -> _Update:
        self._check(event)
        if self._update is None or self._update.ticket != ticket:
            raise UpdateRefused(f"{event.value}: ticket {ticket.update_id} does not own the "
                                f"update in progress")
        return self._update

    def _evidence(self, event: Event, ev: Evidence, problems: list[str]) -> None:
        if not self._listeners:  # serializing evidence is the costliest bookkeeping here
            return
        self._emit("evidence", {"event": event.value, "evidence": evidence_to_dict(ev),
                                "problems": problems})

    def _verdict(self, event: Event, before: State, *, accepted: bool,
                 cls: Classification | None = None, problems: list[str] | None = None,
                 published: WeightVersion | None = None) -> Verdict:
        v = Verdict(event, accepted, before, self._state, cls, tuple(problems or ()), published)
        if not self._listeners:
            return v
        self._emit("verdict", {"event": event.value, "accepted": accepted,
                               "before": before.value, "after": self._state.value,
                               "classification": None if cls is None else cls.value,
                               "problems": list(v.problems),
                               "published": None if published is None else published.to_dict()})
        return v

    def _apply_failure(self, event: Event, step: Step, kind: FailureKind,
                       problems: list[str]) -> Verdict:
        before = self._state
        cls = FAILURE_POLICY[(step, kind)]
        upd = self._update
        if step is Step.TRANSFER and upd is not None and kind is not FailureKind.REFUSED:
            upd.mutation_started = True
        if cls is _INC:
            count = 0
            if upd is not None:
                count = upd.incomplete.get(step, 0) + 1
                upd.incomplete[step] = count
            if count > self._cfg.max_incomplete:
                cls = ESCALATION[step]
                problems = [*problems, f"{step.value}: gave up after {count - 1} retries"]
            else:
                return self._verdict(event, before, accepted=False, cls=_INC, problems=problems)
        if before is S.UNINITIALIZED:
            return self._verdict(event, before, accepted=False, cls=cls, problems=problems)
        if cls is _NM and upd is not None and not upd.mutation_started and not upd.aborting:
            upd.aborting = True
            self._move(event, S.RESUMING)
            return self._verdict(event, before, accepted=False, cls=cls, problems=problems)
        self._taint(event, problems)
        return self._verdict(event, before, accepted=False, cls=_AMB, problems=problems)

    def _taint(self, event: Event, problems: list[str]) -> None:
        self._move(event, S.TAINTED)
        self._emit("taint", {"problems": problems,
                             "target": None if self._update is None
                             else self._update.ticket.target.version.to_dict()})
        self._update = None

    # ---------------------------------------------------------------- bootstrap
    def bootstrap(self, ev: BootstrapEvidence, identity: WeightIdentity,
                  label: str | None = None) -> Verdict:
        """Take over an engine: its current weights become generation 0 (or the label given)."""
        if not isinstance(ev, BootstrapEvidence) or not isinstance(identity, WeightIdentity):
            raise BadInput("bootstrap needs BootstrapEvidence and a WeightIdentity")
        with self._lock:
            self._check(E.BOOTSTRAP)
            before = self._state
            problems = ev.problems(None)
            self._evidence(E.BOOTSTRAP, ev, problems)
            if problems:
                return self._apply_failure(E.BOOTSTRAP, Step.BOOTSTRAP,
                                           FailureKind.BAD_EVIDENCE, problems)
            # An engine already labelled rc-N by an earlier controller continues
            # at generation N, so labels and generations keep agreeing.
            m = _RC_LABEL.match(label or "")
            version = WeightVersion(int(m.group(1)) if m else 0, label or "rc-0",
                                    ev.engine_epoch)
            self._engine_epoch = ev.engine_epoch
            return self._commit(E.BOOTSTRAP, before, version, identity)

    def _commit(self, event: Event, before: State, version: WeightVersion,
                identity: WeightIdentity) -> Verdict:
        self._committed = version
        self._identity = identity
        self._published.append(version)
        self._max_generation = max(self._max_generation, version.generation)
        self._used_labels.add(version.label)
        self._update = None
        if self._listeners:
            self._emit("commit", {"version": version.to_dict(), "identity": identity.to_dict()})
        self._move(event, S.READY)
        return self._verdict(event, before, accepted=True, published=version)

    # ---------------------------------------------------------------- rollouts
    def admit(self, rollout_id: str) -> Binding:
        """Bind a rollout to the committed version; raise AdmissionRefused outside READY."""
        if not isinstance(rollout_id, str) or not rollout_id or len(rollout_id) > 256:
            raise BadInput("rollout_id must be a non-empty string of at most 256 characters")
        with self._lock:
            st = self._state
            if st is not S.READY:
                retry: float | None
                if st is S.TAINTED:
                    retry, reason = None, "engine is tainted; it serves nothing until recovered"
                elif st in (S.RECOVERING, S.UNINITIALIZED):
                    retry, reason = self._cfg.recovering_retry_after_s, "engine not ready"
                else:
                    retry, reason = self._cfg.retry_after_s, "a policy update is in progress"
                self._emit("refuse", {"rollout_id": rollout_id, "state": st.value,
                                      "reason": reason})
                raise AdmissionRefused(st.value, reason, retry)
            if rollout_id in self._active:
                raise BadInput(f"rollout {rollout_id!r} is already active")
            assert self._committed is not None and self._identity is not None
            b = Binding(rollout_id, self._committed, self._identity, self._clock())
            self._active[rollout_id] = b
            self._emit("admit", {"rollout_id": rollout_id, "version": b.version.to_dict(),
                                 "identity_digest": b.identity.digest})
            return b

    def complete(self, rollout_id: str) -> Completion:
        """Release a rollout's binding. Unknown ids are an error and change nothing."""
        with self._lock:
            if self._state is S.UNINITIALIZED:
                raise InvalidTransition(E.COMPLETE.value, self._state.value)
            b = self._active.get(rollout_id) if isinstance(rollout_id, str) else None
            if b is None:
                raise BadInput(f"rollout {rollout_id!r} is not active")
            del self._active[rollout_id]
            attributable = (self._state not in (S.TAINTED, S.RECOVERING)
                            and self._committed == b.version)
            c = Completion(b, self._clock(), self._state, self._committed, attributable)
            self._emit("complete", {"rollout_id": rollout_id, "version": b.version.to_dict(),
                                    "state": self._state.value, "attributable": attributable})
            if not self._active:
                self._idle.notify_all()
            return c

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no rollout is bound (or the timeout); True when idle."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._idle:
            while self._active:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
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
            if self._update is not None:
                raise UpdateRefused(
                    f"an update by {self._update.ticket.target.owner!r} is in progress "
                    f"(state {self._state.value}); one writer at a time")
            if self._state is not S.READY:
                raise UpdateRefused(f"updates start only in READY, not {self._state.value}")
            assert self._committed is not None
            gen = self._fresh_generation()
            nxt = WeightVersion(gen, label or f"rc-{gen}", self._committed.engine_epoch)
            if nxt.label in self._used_labels:
                raise BadInput(f"label {nxt.label!r} was already used; labels name one "
                               f"weight set each")
            target = UpdateTarget(nxt, target_identity, owner)
            ticket = UpdateTicket(next(self._update_ids), target, min_verification)
            self._update = _Update(ticket)
            if self._listeners:
                self._emit("request_update", {"update_id": ticket.update_id, "owner": owner,
                                              "target": nxt.to_dict(),
                                              "identity": target_identity.to_dict(),
                                              "active_rollouts": len(self._active)})
            self._move(E.REQUEST_UPDATE, S.DRAINING)
            return ticket

    def drained(self, ticket: UpdateTicket, ev: DrainEvidence) -> Verdict:
        with self._lock:
            upd = self._own(E.DRAINED, ticket)
            before = self._state
            if upd.aborting:
                raise InvalidTransition(E.DRAINED.value, before.value, "update is aborting")
            problems = ev.problems(ticket.target)
            if self._active:
                problems.append(f"{len(self._active)} rollouts still bound")
            self._evidence(E.DRAINED, ev, problems)
            if problems:
                return self._apply_failure(E.DRAINED, Step.DRAIN, FailureKind.BAD_EVIDENCE,
                                           problems)
            self._move(E.DRAINED, S.QUIESCED)
            return self._verdict(E.DRAINED, before, accepted=True)

    def preflighted(self, ticket: UpdateTicket, ev: PreflightEvidence) -> Verdict:
        """begin_update: the preflight holds and no rollout is bound, so mutation may start."""
        with self._lock:
            upd = self._own(E.PREFLIGHTED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            if self._active:  # unreachable by construction: admission is closed
                problems.append(f"{len(self._active)} rollouts bound at begin_update")
            self._evidence(E.PREFLIGHTED, ev, problems)
            if problems:
                return self._apply_failure(E.PREFLIGHTED, Step.PREFLIGHT,
                                           FailureKind.BAD_EVIDENCE, problems)
            # From here the target's label may reach the engine: never reuse it.
            self._max_generation = max(self._max_generation, ticket.target.version.generation)
            self._used_labels.add(ticket.target.version.label)
            if self._listeners:
                self._emit("begin_update", {"update_id": ticket.update_id,
                                            "target": ticket.target.version.to_dict()})
            self._move(E.PREFLIGHTED, S.UPDATING)
            upd.mutation_started = False
            return self._verdict(E.PREFLIGHTED, before, accepted=True)

    def transferred(self, ticket: UpdateTicket, ev: TransferEvidence) -> Verdict:
        with self._lock:
            upd = self._own(E.TRANSFERRED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            self._evidence(E.TRANSFERRED, ev, problems)
            upd.mutation_started = upd.mutation_started or ev.mutation_started
            if problems:
                # Evidence came back but does not hold: the weights may be
                # anything now. Ambiguous, even if the transport says it never
                # started (use fail(REFUSED) for a provable no-op).
                upd.mutation_started = True
                return self._apply_failure(E.TRANSFERRED, Step.TRANSFER,
                                           FailureKind.BAD_EVIDENCE, problems)
            self._move(E.TRANSFERRED, S.INVALIDATING)
            return self._verdict(E.TRANSFERRED, before, accepted=True)

    def invalidated(self, ticket: UpdateTicket, ev: CacheResetEvidence) -> Verdict:
        """One cache reset; VALIDATING once every required cache has been reset."""
        with self._lock:
            upd = self._own(E.INVALIDATED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            self._evidence(E.INVALIDATED, ev, problems)
            if problems:
                return self._apply_failure(E.INVALIDATED, Step.INVALIDATE,
                                           FailureKind.BAD_EVIDENCE, problems)
            upd.reset_ok.add(ev.cache)
            if self._required_caches <= upd.reset_ok:
                self._move(E.INVALIDATED, S.VALIDATING)
            return self._verdict(E.INVALIDATED, before, accepted=True)

    def validated(self, ticket: UpdateTicket, ev: ValidationEvidence) -> Verdict:
        """The validation while paused. It must hold; a failed one taints."""
        with self._lock:
            upd = self._own(E.VALIDATED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            if ev.paused is False:
                problems.append("validation ran on a resumed engine; it must run while paused")
            self._evidence(E.VALIDATED, ev, problems)
            if problems:
                return self._apply_failure(E.VALIDATED, Step.VALIDATE,
                                           FailureKind.BAD_EVIDENCE, problems)
            upd.validations.append(ev)
            self._move(E.VALIDATED, S.RESUMING)
            return self._verdict(E.VALIDATED, before, accepted=True)

    def resumed(self, ticket: UpdateTicket, ev: ResumeEvidence,
                live: ValidationEvidence | None = None) -> Verdict:
        """Resume confirmed (plus the live validation, if any): publish, or taint.

        On the abort path (nothing mutated) this returns to READY on the old
        version and publishes nothing.
        """
        with self._lock:
            upd = self._own(E.RESUMED, ticket)
            before = self._state
            problems = ev.problems(ticket.target)
            if upd.aborting and live is not None:
                raise BadInput("no live validation on the abort path: nothing was installed")
            if live is not None:
                lp = live.problems(ticket.target)
                problems += [f"live validation: {p}" for p in lp]
                upd.validations.append(live)
            self._evidence(E.RESUMED, ev, problems)
            if live is not None:
                self._evidence(E.RESUMED, live, problems)
            if problems:
                return self._apply_failure(E.RESUMED, Step.RESUME, FailureKind.BAD_EVIDENCE,
                                           problems)
            if upd.aborting:
                self._update = None
                self._emit("abandon", {"update_id": ticket.update_id,
                                       "target": ticket.target.version.to_dict()})
                self._move(E.RESUMED, S.READY)
                return self._verdict(E.RESUMED, before, accepted=True)
            level, summary = self._verification(upd.validations)
            if level < ticket.min_verification:
                return self._apply_failure(
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

    def fail(self, ticket: UpdateTicket | None, step: Step, kind: FailureKind,
             reason: str) -> Verdict:
        """An effect failed (raised, timed out, died). Classified by FAILURE_POLICY."""
        if not isinstance(step, Step) or not isinstance(kind, FailureKind):
            raise BadInput("fail needs a Step and a FailureKind")
        with self._lock:
            self._check(E.FAIL)
            if self._state is S.RECOVERING:
                if step is not Step.RECOVER:
                    raise InvalidTransition(E.FAIL.value, self._state.value,
                                            f"step {step.value} does not run in this state")
                before = self._state
                self._emit("failure", {"step": step.value, "kind": kind.value, "reason": reason})
                self._move(E.FAIL, S.TAINTED)
                return self._verdict(E.FAIL, before, accepted=False, cls=_AMB, problems=[reason])
            if self._state is S.READY:
                # Outside any update: a health watcher saw the engine die, restart
                # (new epoch) or stop answering. Bound rollouts stay bound and will
                # complete unattributable; nothing is admitted until a recovery.
                if step is not Step.SERVE:
                    raise InvalidTransition(E.FAIL.value, self._state.value,
                                            f"step {step.value} does not run in this state")
                if ticket is not None:
                    raise BadInput("a serving failure has no update ticket")
                self._emit("failure", {"step": step.value, "kind": kind.value, "reason": reason})
                self._taint(E.FAIL, [f"engine failed while serving: {reason}"])
                return self._verdict(E.FAIL, S.READY, accepted=False, cls=_AMB,
                                     problems=[reason])
            if self._state is not S.UNINITIALIZED:
                if ticket is None:
                    raise BadInput("fail during an update needs the ticket")
                upd = self._own(E.FAIL, ticket)
                if upd.aborting and step is not Step.RESUME:
                    raise InvalidTransition(E.FAIL.value, self._state.value,
                                            f"update is aborting; step {step.value} is over")
                expected = S.RESUMING if upd.aborting else STEP_STATE[step]
                if step is Step.VALIDATE and self._state is S.RESUMING:
                    expected = S.RESUMING  # the live validation runs after resume
                if self._state is not expected:
                    raise InvalidTransition(E.FAIL.value, self._state.value,
                                            f"step {step.value} does not run in this state")
            elif step is not Step.BOOTSTRAP:
                raise InvalidTransition(E.FAIL.value, self._state.value,
                                        f"step {step.value} does not run in this state")
            if self._state is S.RESUMING and step is Step.VALIDATE:
                step = Step.RESUME  # a failed live validation cannot be retried into service
            self._emit("failure", {"step": step.value, "kind": kind.value, "reason": reason})
            return self._apply_failure(E.FAIL, step, kind, [reason])

    # ---------------------------------------------------------------- recovery
    def begin_recovery(self, owner: str) -> None:
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        with self._lock:
            self._check(E.BEGIN_RECOVERY)
            self._emit("begin_recovery", {"owner": owner})
            self._move(E.BEGIN_RECOVERY, S.RECOVERING)

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
            version = WeightVersion(gen, f"rc-{gen}", ev.engine_epoch)
            target = UpdateTarget(version, ev.identity, "recovery")
            problems = ev.problems(target)
            if ev.engine_epoch == self._engine_epoch:
                problems.append("recovery must replace the engine (same epoch observed)")
            self._evidence(E.RECOVERED, ev, problems)
            if problems:
                self._update = None
                self._emit("failure", {"step": Step.RECOVER.value, "kind": "bad_evidence",
                                       "reason": "; ".join(problems)})
                self._move(E.RECOVERED, S.TAINTED)
                return self._verdict(E.RECOVERED, before, accepted=False, cls=_AMB,
                                     problems=problems)
            self._engine_epoch = ev.engine_epoch
            level, summary = self._verification([ev.validation])
            return self._commit(E.RECOVERED, before, version, ev.identity.verified(level, summary))

    def recovery_target(self) -> WeightVersion:
        """The version a recovery would publish (its label must be set on the new engine)."""
        with self._lock:
            gen = self._fresh_generation()
            return WeightVersion(gen, f"rc-{gen}", self._engine_epoch or "pending")

    def _fresh_generation(self) -> int:
        """The next generation whose default label was never used (published or burnt)."""
        gen = self._max_generation + 1
        while f"rc-{gen}" in self._used_labels:
            gen += 1
        return gen

    # ---------------------------------------------------------------- crash restore
    @classmethod
    def restore(cls, records: Iterable[tuple[str, Mapping[str, Any]]], *,
                config: ControllerConfig | None = None,
                required_caches: tuple[CacheKind, ...] = tuple(CacheKind),
                clock: Callable[[], float] = time.monotonic,
                listener: Listener | None = None) -> LifecycleController:
        """Rebuild a controller from the (kind, data) records of its journal.

        Committed versions, the identity and active bindings are restored.
        An update that was in flight when the process died is never resumed
        as if it had succeeded: whatever step it had reached, the restored
        controller is TAINTED and only recovery leads back to READY.
        """
        c = cls(config=config, required_caches=required_caches, clock=clock)
        state = S.UNINITIALIZED
        in_flight: dict[str, Any] | None = None
        for kind, d in records:
            if kind == "transition":
                state = State(str(d["to"]))
            elif kind == "commit":
                v = WeightVersion.from_dict(d["version"])
                c._committed, c._identity = v, WeightIdentity.from_dict(d["identity"])
                c._published.append(v)
                c._max_generation = max(c._max_generation, v.generation)
                c._used_labels.add(v.label)
                c._engine_epoch = v.engine_epoch
                in_flight = None
            elif kind == "admit":
                v = WeightVersion.from_dict(d["version"])
                assert c._identity is not None
                c._active[str(d["rollout_id"])] = Binding(str(d["rollout_id"]), v, c._identity,
                                                          clock())
            elif kind == "complete":
                c._active.pop(str(d["rollout_id"]), None)
            elif kind == "request_update":
                in_flight = dict(d)
            elif kind == "begin_update":
                c._max_generation = max(c._max_generation,
                                        int(d["target"]["generation"]))
                c._used_labels.add(str(d["target"]["label"]))
            elif kind in ("taint", "abandon"):
                in_flight = None
        c._state = state
        if listener is not None:
            c._listeners.append(listener)
        with c._lock:
            c._emit("restore", {"state": state.value, "active_rollouts": len(c._active),
                                "in_flight_update": in_flight})
            if state not in (S.UNINITIALIZED, S.READY, S.TAINTED, S.RECOVERING):
                # The update's outcome is unknown: ambiguous, whatever step it reached.
                c._force_taint(state)
                c._emit("taint", {"problems": ["controller restarted during an update"],
                                  "target": None if in_flight is None
                                  else in_flight.get("target")})
            elif state is S.RECOVERING:
                c._force_taint(state)
        return c

    def _force_taint(self, frm: State) -> None:
        """Crash restore only: the journal says we were mid-way; go to TAINTED directly."""
        now = self._clock()
        self._history.append((frm, S.TAINTED, E.FAIL, now, 0.0))
        self._emit("transition", {"from": frm.value, "to": S.TAINTED.value,
                                  "event": E.FAIL.value, "duration_s": 0.0})
        self._state = S.TAINTED
        self._entered_at = now
