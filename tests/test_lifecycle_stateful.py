"""Stateful property test: random interleavings from several threads, invariants after each step."""

from __future__ import annotations

import threading
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from coretools import (
    boot_ev,
    drain_ev,
    ident,
    preflight_ev,
    recovery_ev,
    request_wake_update,
    reset_ev,
    resume_ev,
    sleep_ev,
    transfer_ev,
    validation_ev,
    wake_ev,
    wake_validation_ev,
)
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.core.evidence import (
    CacheKind,
    DrainEvidence,
    PauseMode,
    TransferEvidence,
    WakeTags,
)
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.lifecycle_state import UpdateTicket
from rolloutcore.core.rules import FAIL_STEPS, STEP_STATE
from rolloutcore.core.versions import WeightVersion
from rolloutcore.errors import AdmissionRefused, BadInput, InvalidTransition, UpdateRefused

_STEP_OF = {v: k for k, v in STEP_STATE.items()}
_MUTATING = {State.QUIESCED, State.UPDATING, State.INVALIDATING, State.VALIDATING}


class LifecycleMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.journal = Journal()
        self.c = LifecycleController(listener=self.journal.listener)
        self.c.bootstrap(boot_ev(), ident(0))
        self.ticket: UpdateTicket | None = None
        self.n = 0
        self.bound: dict[str, WeightVersion] = {}
        self.epochs = 0
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- rollouts
    def _admit(self) -> None:
        with self.lock:
            self.n += 1
            rid = f"r{self.n}"
        state = self.c.state
        try:
            b = self.c.admit(rid)
        except AdmissionRefused as e:
            assert e.state != State.READY.value or self.c.state is not State.READY or \
                state is not State.READY
            return
        with self.lock:
            self.bound[rid] = b.version

    def _complete_one(self) -> None:
        with self.lock:
            if not self.bound:
                return
            rid = next(iter(self.bound))
            version = self.bound.pop(rid)
        done = self.c.complete(rid)
        assert done.binding.version == version
        if done.attributable:
            assert done.committed == version, "completed under another version"

    @rule()
    def admit(self) -> None:
        self._admit()

    @rule()
    def complete(self) -> None:
        self._complete_one()

    # ---------------------------------------------------------------- update
    @rule(owner=st.sampled_from(["t1", "t2"]))
    def request_update(self, owner: str) -> None:
        try:
            self.ticket = self.c.request_update(ident(self.n + 1, owner), owner)
        except UpdateRefused:
            assert self.c.state is not State.READY or self.c.current_ticket is not None

    def _good(self) -> Any:
        c, t, s = self.c, self.ticket, self.c.state
        if t is None or c.current_ticket != t:
            return None
        if s is State.DRAINING:
            return c.drained(t, drain_ev())
        if s is State.QUIESCED:
            return c.preflighted(t, preflight_ev(t))
        if s is State.UPDATING:
            return c.transferred(t, transfer_ev(t))
        if s is State.INVALIDATING:
            return c.invalidated(t, reset_ev(next(iter(c.pending_resets))))
        if s is State.VALIDATING:  # a woken engine needs every parameter checked
            return c.validated(t, wake_validation_ev(t))
        if s is State.RESUMING:
            return c.resumed(t, resume_ev())
        return None

    @rule()
    def good_evidence(self) -> None:
        self._good()

    @rule(which=st.integers(0, 4))
    def bad_evidence(self, which: int) -> None:
        c, t, s = self.c, self.ticket, self.c.state
        if t is None or c.current_ticket != t:
            return
        if s is State.DRAINING:
            c.drained(t, DrainEvidence(paused=which % 2 == 0, mode=PauseMode.WAIT,
                                       engine_in_flight=which))
        elif s is State.QUIESCED:
            from rolloutcore.core.evidence import PreflightEvidence
            c.preflighted(t, PreflightEvidence(source_manifest_digest="f" * 64))
        elif s is State.UPDATING:
            c.transferred(t, TransferEvidence(completed=False, mutation_started=True,
                                              backend="x", error="cut"))
        elif s is State.INVALIDATING:
            c.invalidated(t, reset_ev(CacheKind.PREFIX, ok=False))
        elif s is State.VALIDATING:
            c.validated(t, validation_ev(t, label="rc-999"))
        elif s is State.RESUMING:
            from rolloutcore.core.evidence import ResumeEvidence
            c.resumed(t, ResumeEvidence(resumed=False))

    @rule(kind=st.sampled_from(list(FailureKind)))
    def effect_fails(self, kind: FailureKind) -> None:
        """An effect raised, died, or overran its deadline."""
        c, t, s = self.c, self.ticket, self.c.state
        if t is None or c.current_ticket != t or s not in _STEP_OF:
            return
        step = _STEP_OF[s]
        try:
            c.fail(t, step, kind, f"{kind.value} in {step.value}")
        except InvalidTransition:
            # aborting: only the resume step runs in RESUMING
            assert s is State.RESUMING
            c.fail(t, Step.RESUME, kind, "resume failed")

    # ---------------------------------------------------------------- colocated
    @rule(level=st.sampled_from([1, 2]))
    def sleep(self, level: int) -> None:
        """Put the engine to sleep (the runner waits for bound rollouts first)."""
        c = self.c
        try:
            sl = c.request_sleep("t1", level)
        except UpdateRefused:
            assert c.state is not State.READY or c.current_ticket is not None or \
                c.current_sleep is not None
            return
        if c.active:  # the runner's wait for them ran out: the sleep is refused
            c.fail(sl, Step.SLEEP, FailureKind.REFUSED, "rollouts still bound")
            assert c.state is State.READY
        else:
            assert c.slept(sl, sleep_ev(level)).accepted

    @rule(restore=st.booleans())
    def wake(self, restore: bool) -> None:
        """Wake it: a colocated update (to INVALIDATING), or a restore."""
        c = self.c
        sl = c.current_sleep
        if sl is None or c.state is not State.SLEEPING or c.current_ticket is not None:
            return
        if restore:
            t = c.request_wake(sl, "t1")
            assert c.woke(t, wake_ev(WakeTags.ALL)).accepted
        else:
            self.n += 1
            t = request_wake_update(c, f"w{self.n}", self.n)
            c.woke(t, wake_ev(WakeTags.WEIGHTS))
            c.transferred(t, transfer_ev(t))
            c.woke(t, wake_ev(WakeTags.KV_CACHE))
        self.ticket = t
        assert c.state is State.INVALIDATING

    @rule(kind=st.sampled_from(list(FailureKind)))
    def engine_lost_while_serving(self, kind: FailureKind) -> None:
        """The health watcher saw the engine die or restart while READY."""
        if self.c.state is State.READY:
            v = self.c.fail(None, Step.SERVE, kind, f"engine lost ({kind.value})")
            assert v.tainted and self.c.state is State.TAINTED

    @rule(good=st.booleans())
    def recover(self, good: bool) -> None:
        c = self.c
        if c.state is State.TAINTED:
            c.begin_recovery("operator")
        elif c.state is State.RECOVERING:
            self.epochs += 1
            ev = recovery_ev(c, f"e{self.epochs}") if good else recovery_ev(c, "e0-same")
            if not good:
                # same epoch as the tainted engine: must be refused
                object.__setattr__(ev, "engine_epoch", c.committed.engine_epoch
                                   if c.committed else "e0")
            c.recovered(ev)

    @rule(threads=st.integers(2, 5), ops=st.integers(1, 20))
    def concurrent_burst(self, threads: int, ops: int) -> None:
        """Admissions and completions from several threads while the update advances."""
        errors: list[BaseException] = []

        def work() -> None:
            try:
                for i in range(ops):
                    (self._admit if i % 2 == 0 else self._complete_one)()
            except (BadInput, AssertionError) as e:  # pragma: no cover
                errors.append(e)

        ths = [threading.Thread(target=work) for _ in range(threads)]
        for th in ths:
            th.start()
        for _ in range(3):
            self._good()
        for th in ths:
            th.join()
        assert not errors, errors

    @rule()
    def restore_from_journal(self) -> None:
        """A controller replayed from the journal so far agrees with the live one."""
        with self.lock:  # no burst runs now; the journal is whole
            recs = self.journal.records
        c = self.c
        r = LifecycleController.restore(recs)
        assert r.committed == c.committed and r.identity == c.identity
        assert r.published == c.published
        # The live controller's bindings belonged to the process that wrote the journal:
        # a restore releases each, unattributable, and keeps none.
        assert r.active == {}
        assert r.recovery_target().label == c.recovery_target().label
        mid = (c.state, Step.RESTART) in FAIL_STEPS
        assert r.state is (State.TAINTED if mid else c.state)
        if not mid:
            assert r.current_ticket == c.current_ticket

    # ---------------------------------------------------------------- invariants
    @invariant()
    def journal_invariants_hold(self) -> None:
        assert check_journal(self.journal.records) == []

    @invariant()
    def no_binding_during_mutation(self) -> None:
        if self.c.state in _MUTATING:
            assert not self.c.active

    @invariant()
    def tainted_admits_nothing(self) -> None:
        if self.c.state in (State.TAINTED, State.RECOVERING):
            try:
                self.c.admit("probe-while-tainted")
            except AdmissionRefused:
                return
            raise AssertionError("admitted while tainted")

    @invariant()
    def published_generations_increase(self) -> None:
        gens = [v.generation for v in self.c.published]
        assert gens == sorted(set(gens))


LifecycleMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestLifecycleMachine = LifecycleMachine.TestCase
