"""The runner: drives one update through an adapter, every effect under a deadline.

The controller (``lifecycle``) decides; the adapter (``port``) acts; the
runner connects them. For each step it runs the adapter's effect in a worker
thread supervised by the step's deadline, translates what came back into an
event for the controller (evidence, or ``fail`` with a ``FailureKind``), and
does what the controller's verdict says: go on, retry an incomplete
observation, resume on the old version (nothing mutated), or fence a tainted
engine and stop.

A stuck effect is never waited on forever. When its deadline expires the
runner calls ``adapter.cancel(step)`` from *this* thread (the watchdog): the
adapter must make the stuck call return (tear down the transfer group, close
connections). The step is classified as a TIMEOUT at once; the worker thread
is a daemon and is left to unwind.

Nobody holds an update hostage. The drain waits at most ``drain_s`` for the
bound rollouts; then the ``DrainPolicy`` decides: ``ABORT`` (the default)
aborts the stragglers (the gateway's data plane cuts their streams and
aborts them in vLLM, through ``stragglers``; the controller releases their
bindings unattributable) and drains the engine with ``PauseMode.ABORT``, so
the engine is paused with nothing in flight before anything mutates;
``REFUSE`` fails the drain (no mutation: the update is refused and the
stragglers keep running).

Nothing that goes wrong inside an update leaves it half-way. An exception
the runner did not expect (a journal that failed, an invalid transition, a
bug in an adapter's evidence) is reported to the controller as a failure of
the step the update was in, with kind TIMEOUT (the step's outcome is
unknown, exactly as when its deadline expires) and classified by the
failure policy; the engine is resumed or fenced accordingly and the caller
gets ``UpdateFailed``, never the raw exception.
"""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn, TypeVar, cast

from rolloutcore.control import colocated
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.effects import WORKERS
from rolloutcore.control.outcomes import (
    Deadlines,
    PhaseTiming,
    SleepOutcome,
    StepAborted,
    UpdateOutcome,
)
from rolloutcore.control.port import (
    HealthObserver,
    LifecycleAdapter,
    Recoverer,
    WriteObserver,
)
from rolloutcore.control.takeover import TakeoverRefused, take_over
from rolloutcore.core.evidence import (
    CacheKind,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    TransferEvidence,
    ValidationEvidence,
)
from rolloutcore.core.lifecycle import Classification, FailureKind, State, Step, Verdict
from rolloutcore.core.lifecycle_state import UpdateTicket
from rolloutcore.core.records import Effect, Event, Note, Record
from rolloutcore.core.rules import UPDATE_MODES
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import (
    Binding,
    VerificationLevel,
    WeightIdentity,
)
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    InvalidTransition,
    JournalError,
    UpdateFailed,
)

__all__ = ["Deadlines", "DrainPolicy", "LifecycleRunner", "PhaseTiming", "SleepOutcome",
           "StragglerAborter", "TakeoverRefused", "UpdateOutcome"]

T = TypeVar("T")


class DrainPolicy(enum.StrEnum):
    """What the drain deadline does to rollouts still bound when it expires."""

    #: Abort them (unattributable) and go on with the update: the fleet keeps moving.
    ABORT = "abort"
    #: Refuse the update (no mutation); they keep running on the old version.
    REFUSE = "refuse"


#: Cuts the stragglers' requests and aborts them in the engine (the gateway's data
#: plane): gets the bindings and the reason, returns what it did (for the journal).
StragglerAborter = Callable[[tuple[Binding, ...], str], Any]


#: The lifecycle step of each effect the runner names otherwise, for the port's
#: ``cancel``: the live validation is part of VALIDATE; the health observation
#: and the fence act on the serving engine.
_CANCEL_STEP: dict[str, Step] = {"validate_live": Step.VALIDATE, "health": Step.SERVE,
                                 "fence": Step.SERVE, "lease": Step.SERVE}


class LifecycleRunner:
    """Runs bootstrap and updates for one engine; one update at a time (the controller
    enforces it)."""

    def __init__(self, controller: LifecycleController, adapter: LifecycleAdapter,
                 deadlines: Deadlines | None = None, *,
                 record: Callable[[Record], object] | None = None,
                 drain_policy: DrainPolicy = DrainPolicy.ABORT,
                 stragglers: StragglerAborter | None = None) -> None:
        if not isinstance(drain_policy, DrainPolicy):
            raise BadInput(f"drain_policy must be a DrainPolicy, got {drain_policy!r}")
        if stragglers is not None and not callable(stragglers):
            raise BadInput("stragglers must be callable")
        self.controller = controller
        self.adapter = adapter
        self.deadlines = deadlines or Deadlines()
        self._record = record
        self._health_failures = 0  # consecutive failed check_serving observations
        self._engine_gone: str | None = None  # why the launched engine's process ended
        #: What the drain deadline does (public: a gateway's configuration sets it).
        self.drain_policy = drain_policy
        #: Who cuts the stragglers' requests (the gateway's data plane sets it).
        self.stragglers = stragglers

    # ------------------------------------------------------------ effects
    def _effect(self, step: str, fn: Callable[[], T], deadline_s: float,
                phases: list[PhaseTiming] | None, phase: str | None = None,
                cancel: Callable[[], None] | None = None) -> T:
        """Run ``fn`` in a worker thread; on deadline, cancel it and raise EffectTimeout.

        The worker is one of the process's effect workers (``effects.WORKERS``):
        reused, not started per effect; the deadline is the supervisor's, as before.
        """
        t0 = time.monotonic()
        job = WORKERS.submit(step, fn)
        timed_out = not job.wait(deadline_s)
        if timed_out:
            try:
                if cancel is not None:
                    cancel()
                else:
                    self.adapter.cancel(_CANCEL_STEP.get(step) or Step(step))
            except Exception as exc:
                self._note("cancel_failed", step=step, error=repr(exc))
            job.wait(self.deadlines.cancel_grace_s)
        dt = time.monotonic() - t0
        if phases is not None:
            phases.append(PhaseTiming(phase or step, dt, True))
        err = job.error
        ok = not timed_out and err is None
        self._emit(Effect(step, dt, ok, None if ok else repr(
            "deadline expired" if err is None else err)))
        if timed_out:
            raise EffectTimeout(step, deadline_s, mutation_started=step != Step.PREFLIGHT)
        if err is not None:
            job.error = None
            if isinstance(err, EffectError):
                raise err
            if isinstance(err, Exception):
                raise EffectError(step, f"{type(err).__name__}: {err}") from err
            raise err
        return cast(T, job.value)

    def _note(self, what: str, **data: object) -> None:
        self._emit(Note(what, data))

    def emit(self, rec: Record) -> None:
        """Hand a record to the runner's journal (``record=``): a listener for the machines
        that run beside this engine's (the trainer protocol's leases)."""
        self._emit(rec)

    def _emit(self, rec: Record) -> None:
        """Hand the runner's own record (``record=``, normally the journal's ``write``).

        A journal that failed refuses it; the controller was told of the same
        failure and refuses the next step with a clear error, so the effect's
        outcome still reaches it rather than this error.
        """
        if self._record is not None:
            with contextlib.suppress(JournalError):
                self._record(rec)

    def _run_step(self, ticket: UpdateTicket, step: Step, fn: Callable[[], T],
                  feed: Callable[[T], Verdict], deadline_s: float, out: UpdateOutcome,
                  phase: str | None = None) -> Verdict:
        """One step with bounded retries of incomplete observations."""
        while True:
            try:
                ev = self._effect(step.value, fn, deadline_s, out.phases, phase)
            except EffectError as exc:
                verdict = self.controller.fail(ticket, step, FailureKind.of(exc), str(exc))
            else:
                verdict = feed(ev)
            out.verdicts.append(verdict)
            if verdict.classification is Classification.INCOMPLETE:
                time.sleep(self.deadlines.retry_backoff_s)
                continue
            if not verdict.accepted:
                raise StepAborted(verdict)
            return verdict

    # ------------------------------------------------------------ bootstrap
    def bootstrap(self, identity: WeightIdentity) -> Verdict:
        """Take over the engine; its current weights become the first committed version."""
        try:
            ev = self._effect(Step.BOOTSTRAP.value, self.adapter.bootstrap,
                              self.deadlines.bootstrap_s, None)
        except EffectError as exc:
            v = self.controller.fail(None, Step.BOOTSTRAP, FailureKind.of(exc), str(exc))
            raise UpdateFailed("bootstrap", v.classification.value if v.classification
                               else "no_mutation", v.after.value, str(exc)) from exc
        label = ev.observed_label if ev.label_supported else None
        v = self.controller.bootstrap(ev, identity, label=label)
        if not v.accepted:
            raise UpdateFailed("bootstrap", "no_mutation", v.after.value, "; ".join(v.problems))
        return v

    # ------------------------------------------------------------ takeover
    def take_over(self, identity: WeightIdentity, *, probes: object = None,
                  reference_checksums: Mapping[str, str] | None = None,
                  min_verification: VerificationLevel = VerificationLevel.DECLARED,
                  recoverer: Callable[[str], Recoverer] | None = None) -> Verdict | None:
        """Take over a running engine declared to hold ``identity``, verified
        (``rolloutcore.control.takeover.take_over`` says how)."""
        return take_over(self, identity, probes=probes, reference_checksums=reference_checksums,
                         min_verification=min_verification, recoverer=recoverer)

    def _fence_quietly(self) -> None:
        try:
            self._effect("fence", self.adapter.fence, self.deadlines.fence_s, None)
        except EffectError as exc:
            self._note("fence_failed", error=str(exc))

    # ------------------------------------------------------------ recovery
    def recover(self, recoverer: Recoverer, *, owner: str = "operator") -> Verdict:
        """TAINTED -> RECOVERING -> READY on a replacement engine, or back to TAINTED.

        The replacement is verified like an update; it is published as a new
        generation on a new engine epoch, so nothing admitted before the taint
        can be attributed to it.
        """
        c = self.controller
        if c.state is State.TAINTED:
            c.begin_recovery(owner)
        target = c.recovery_target()

        def work() -> Any:
            return recoverer.replace_engine(target)

        try:
            # On expiry the watchdog cancels the recoverer itself (not the adapter).
            ev = self._effect(Step.RECOVER.value, work, self.deadlines.recover_s, None,
                              cancel=recoverer.cancel)
        except EffectError as exc:
            try:
                if not isinstance(exc, EffectTimeout):
                    recoverer.cancel()  # clean up a half-started replacement
            finally:
                v = c.fail(None, Step.RECOVER, FailureKind.of(exc), str(exc))
            raise UpdateFailed("recover", "ambiguous", v.after.value, str(exc)) from exc
        v = c.recovered(ev)
        if not v.accepted:
            raise UpdateFailed("recover", "ambiguous", v.after.value, "; ".join(v.problems))
        self._engine_gone = None  # a replacement engine serves now
        return v

    # ------------------------------------------------------------ serving
    def check_serving(self, *, timeout_s: float = 5.0,
                      failures_to_taint: int = 2) -> Verdict | None:
        """Between updates: taint the engine if it died, restarted or stopped answering.

        Asks the adapter's ``observe_health`` (a port ``HealthObserver``) under
        a deadline. A restart (another process answering) taints at once: it
        serves its start checkpoint, not the committed version. Not answering
        or unhealthy taints after ``failures_to_taint`` checks in a row (one
        slow ``/health`` under load is not a death). The tainted engine is
        then fenced (paused with abort), so a restarted one serves nobody
        either. Returns the verdict when it tainted, else ``None``; does
        nothing outside READY (an update's own effects classify failures
        then) and drops a check that raced an update's start.
        """
        check_int("failures_to_taint", failures_to_taint, 1)
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and timeout_s > 0):
            raise BadInput("timeout_s must be a positive number")
        if self._engine_gone is not None and self.controller.state is State.READY:
            return self.engine_exited(self._engine_gone)
        adapter = self.adapter
        if not isinstance(adapter, HealthObserver) or self.controller.state is not State.READY:
            return None
        # An observation belongs to the version served when it began: one that an
        # update overtook (the update verified the engine itself) is dropped.
        serving = self.controller.committed
        restarted = False
        try:
            ev = self._effect("health", lambda: adapter.observe_health(timeout_s=timeout_s),
                              timeout_s * 2 + self.deadlines.read_slack_s, None)
        except EffectError as exc:
            problems, kind = [str(exc)], FailureKind.of(exc)
            if kind is FailureKind.REFUSED:
                kind = FailureKind.ERROR
        else:
            if not isinstance(ev, HealthEvidence):
                raise EffectError("health", f"observe_health returned {type(ev).__name__}")
            problems = ev.problems(None)
            if serving is not None and ev.observed_label is not None and \
                    ev.observed_label != serving.label:
                problems.append(f"engine's weight version is {ev.observed_label!r}, the "
                                f"committed version is {serving.label!r}: weights written "
                                "outside any update")
            # A restart or a write nobody published is proof at once, not a slow answer.
            restarted = ev.restarted or ev.written or bool(problems and ev.answering
                                                           and ev.healthy)
            kind = (FailureKind.DIED if (ev.restarted or not ev.answering)
                    else FailureKind.BAD_EVIDENCE if restarted else FailureKind.ERROR)
        if not problems or self.controller.committed != serving:
            self._health_failures = 0
            return None
        self._health_failures += 1
        self._note("health", problems=problems, consecutive=self._health_failures)
        if not restarted and self._health_failures < failures_to_taint:
            return None
        try:
            v = self.controller.fail(None, Step.SERVE, kind, "; ".join(problems))
        except InvalidTransition:
            return None  # an update began meanwhile: its effects meet the engine
        self._health_failures = 0
        self._fence_quietly()
        return v

    def engine_exited(self, reason: str) -> Verdict | None:
        """The launched engine's process ended without being stopped (``ManagedEngine.on_exit``,
        from its watcher thread): taint now, not at a health check that whoever holds the
        port by then may answer. Outside READY the update's own effects meet the dead
        engine; the exit is noted, and a later READY is tainted by ``check_serving``."""
        self._engine_gone = reason
        self._note("engine_exited", reason=reason)
        if self.controller.state is not State.READY:
            return None
        try:
            return self.controller.fail(None, Step.SERVE, FailureKind.DIED, reason)
        except InvalidTransition:
            return None  # an update began meanwhile; check_serving taints after it

    # ------------------------------------------------------------ colocated training
    def sleep(self, level: int = 2, *, owner: str = "trainer",
              reference: bool | None = None) -> SleepOutcome:
        """Close admission, let bound rollouts finish, put the engine to sleep
        (``rolloutcore.control.colocated.sleep``)."""
        return colocated.sleep(self, level, owner=owner, reference=reference)

    def wake(self, *, owner: str = "trainer") -> UpdateOutcome:
        """Wake the sleeping engine on its own weights, verified, or taint
        (``rolloutcore.control.colocated.wake``)."""
        return colocated.wake(self, owner=owner)

    def wake_update(self, identity: WeightIdentity, *, owner: str = "trainer",
                    label: str | None = None,
                    min_verification: VerificationLevel = VerificationLevel.ENGINE_CHECKSUM,
                    ) -> UpdateOutcome:
        """The colocated update (``rolloutcore.control.colocated.wake_update``)."""
        return colocated.wake_update(self, identity, owner=owner, label=label,
                                     min_verification=min_verification)

    # ------------------------------------------------------------ update
    def run_update(self, identity: WeightIdentity, *, owner: str = "trainer",
                   label: str | None = None,
                   min_verification: VerificationLevel = VerificationLevel.DECLARED,
                   ) -> UpdateOutcome:
        """Drain, quiesce, preflight, transfer, invalidate, validate (paused), resume, commit.

        Returns the outcome with the published version, or raises UpdateFailed
        (state READY when nothing mutated, TAINTED otherwise; ``.outcome`` has
        the phases).
        """
        out = self.open_update(identity, owner=owner, label=label,
                               min_verification=min_verification)
        ticket = out.ticket
        with self._phase(out):
            self._run_step(ticket, Step.TRANSFER, lambda: self.adapter.transfer(ticket.target),
                           lambda ev: self.controller.transferred(ticket, ev),
                           self.deadlines.transfer_s, out)
        return self.close_update(out)

    def sweep(self) -> bool | None:
        """The prefix reset a keep-mode update deferred, once nothing old runs.

        ``None`` when nothing is due or it is not yet possible (rollouts
        admitted under an older version still run, or an update is under
        way); otherwise whether the reset held (vLLM refuses it while any
        request holds blocks: it stays due and is tried again). Until it
        holds, every request's version salt keeps new requests off the old
        blocks, so a failed sweep costs cache memory, never correctness.
        """
        c = self.controller
        if not c.sweep_due or c.stale_rollouts or c.state is not State.READY:
            return None
        if CacheKind.PREFIX not in set(self.adapter.caches):
            return None
        try:
            ev = self._effect("sweep", lambda: self.adapter.reset_cache(CacheKind.PREFIX),
                              self.deadlines.reset_s, None, cancel=lambda: self.adapter.cancel(
                                  Step.INVALIDATE))
        except EffectError as exc:
            self._note("sweep_failed", error=str(exc))
            return False
        try:
            return c.swept(ev)
        except InvalidTransition:
            return None  # an update began meanwhile: it resets the caches itself

    # The two-phase form, for a trainer in another process: open_update ->
    # (the trainer transfers, through vLLM's weight-transfer path) ->
    # report_transfer / report_transfer_failure -> close_update.

    def open_update(self, identity: WeightIdentity, *, owner: str = "trainer",
                    label: str | None = None,
                    min_verification: VerificationLevel = VerificationLevel.DECLARED,
                    preflight: PreflightEvidence | None = None) -> UpdateOutcome:
        """Close admission, drain, pause, preflight; on return the state is UPDATING.

        ``preflight`` is the trainer's own description of its source when the
        trainer is remote; otherwise the adapter is asked.
        """
        try:
            ticket = self.controller.request_update(identity, owner, label=label,
                                                    min_verification=min_verification)
        except JournalError as exc:
            # The update was opened in memory and its record could not be
            # delivered: this call owns it, so it fails it (ambiguous: the
            # controller failed closed) rather than leave it open for ever.
            mine = self._opened_by_us(owner, identity)
            if mine is None:
                raise
            failed = UpdateOutcome(mine, None, State.DRAINING, 0.0)
            try:
                self._after_failure(mine, self._unexpected(failed, exc), failed)
            except UpdateFailed as uf:
                failed.state = self.controller.state
                uf.outcome = failed
                raise uf from exc
        out = UpdateOutcome(ticket, None, State.DRAINING, 0.0)
        out.started_at = time.monotonic()
        c, a, d = self.controller, self.adapter, self.deadlines
        rule = UPDATE_MODES[c.update_mode]
        pause = rule.pause or PauseMode.WAIT
        with self._phase(out):
            # DRAINING: admission is closed. Strict: wait for bound rollouts, then
            # pause the engine so that anything it runs beyond our view finishes
            # too; at the drain deadline the drain policy aborts the stragglers
            # or refuses the update. Asynchronous (the mode's row): pause at
            # once, keeping or aborting what runs; the controller carries the
            # bound rollouts.
            if rule.drains:
                tw = time.monotonic()
                idle = c.wait_idle(d.drain_s)
                out.phases.append(PhaseTiming("drain", time.monotonic() - tw, False))
                if not idle:
                    if self.drain_policy is DrainPolicy.REFUSE:
                        v = c.fail(ticket, Step.DRAIN, FailureKind.TIMEOUT,
                                   f"{len(c.active)} rollouts still active after "
                                   f"{d.drain_s:g}s (drain policy: refuse)")
                        out.verdicts.append(v)
                        raise StepAborted(v)
                    self._abort_stragglers(ticket, out)
                    # Whatever the engine still runs is a straggler whose abort
                    # has not landed yet (admission is closed): the pause aborts
                    # it too, and returns once nothing is in flight.
                    pause = PauseMode.ABORT
            self._run_step(ticket, Step.DRAIN,
                           (lambda: a.drain(pause, clear_cache=True)) if rule.clear_cache
                           else (lambda: a.drain(pause)),
                           lambda ev: c.drained(ticket, ev), d.pause_s, out, "pause")
            if preflight is not None:
                v = c.preflighted(ticket, preflight)
                out.verdicts.append(v)
                if not v.accepted:
                    raise StepAborted(v)
            else:
                self._run_step(ticket, Step.PREFLIGHT, lambda: a.preflight(ticket.target),
                               lambda ev: c.preflighted(ticket, ev), d.preflight_s, out)
        return out

    def report_transfer(self, out: UpdateOutcome, ev: TransferEvidence) -> None:
        """The remote trainer's transfer evidence (state UPDATING -> INVALIDATING)."""
        with self._phase(out):
            v = self.controller.transferred(out.ticket, ev)
            out.phases.append(PhaseTiming("transfer", ev.elapsed_s, True))
            out.verdicts.append(v)
            if not v.accepted:
                raise StepAborted(v)

    def report_transfer_failure(self, out: UpdateOutcome, kind: FailureKind, reason: str) -> None:
        """The transfer failed or its lease expired; classified by the failure policy."""
        with self._phase(out):
            v = self.controller.fail(out.ticket, Step.TRANSFER, kind, reason)
            out.verdicts.append(v)
            raise StepAborted(v)

    def expire_lease(self, out: UpdateOutcome, reason: str, *, timeout_s: float = 5.0) -> None:
        """A remote trainer's lease ran out without a report: classified from the engine.

        The trainer may have died before sending anything (or never got the
        begin's answer), or in the middle of the transfer: only the engine
        can tell. An adapter that is a ``WriteObserver`` reads the engine's
        own count of weight-update operations; when it proves none ran since
        the drain, nothing was sent and the update ends as REFUSED
        (no_mutation: back to service on the old version). Otherwise it is a
        TIMEOUT of the transfer: ambiguous, TAINTED.
        """
        a = self.adapter
        writes: tuple[str, ...] | None = None
        if isinstance(a, WriteObserver):
            try:
                writes = self._effect("lease", lambda: a.writes_since_drain(timeout_s=timeout_s),
                                      timeout_s * 2 + self.deadlines.read_slack_s,
                                      out.phases, "lease_check")
            except EffectError as exc:
                self._note("lease_check_failed", error=str(exc))
        if writes == ():
            self.report_transfer_failure(
                out, FailureKind.REFUSED,
                f"{reason}; the engine counted no weight update since the drain: nothing "
                "was sent")
        detail = ("the engine cannot tell whether anything was sent" if writes is None
                  else "the engine counted " + ", ".join(writes))
        self.report_transfer_failure(out, FailureKind.TIMEOUT, f"{reason}; {detail}")

    def close_update(self, out: UpdateOutcome) -> UpdateOutcome:
        """Invalidate caches, validate while paused, resume, live-validate, publish."""
        ticket = out.ticket
        c, a, d = self.controller, self.adapter, self.deadlines
        with self._phase(out):
            for cache in self._caches_in_order():
                if cache not in c.pending_resets:
                    continue
                self._run_step(ticket, Step.INVALIDATE,
                               lambda cache=cache: a.reset_cache(cache),  # type: ignore[misc]
                               lambda ev: c.invalidated(ticket, ev), d.reset_s, out,
                               "invalidate")
            if c.state is not State.VALIDATING:
                missing = ", ".join(k.value for k in c.pending_resets)
                v = c.fail(ticket, Step.INVALIDATE, FailureKind.BAD_EVIDENCE,
                           f"adapter cannot reset required caches: {missing}")
                out.verdicts.append(v)
                raise StepAborted(v)

            def validate_paused() -> ValidationEvidence:
                ev = a.validate(ticket.target, live=False)
                if ev is None:
                    raise EffectError(Step.VALIDATE.value, "adapter returned no paused validation")
                return ev

            self._run_step(ticket, Step.VALIDATE, validate_paused,
                           lambda ev: c.validated(ticket, ev), d.validate_s, out)
            # RESUMING: admission stays closed until resumed() publishes.
            try:
                rev = self._effect(Step.RESUME.value, a.resume, d.resume_s, out.phases)
            except EffectError as exc:
                v = c.fail(ticket, Step.RESUME, FailureKind.of(exc), str(exc))
                out.verdicts.append(v)
                raise StepAborted(v) from exc
            try:
                live = self._effect("validate_live", lambda: a.validate(ticket.target, live=True),
                                    d.live_validate_s, out.phases)
            except EffectError as exc:
                v = c.fail(ticket, Step.VALIDATE, FailureKind.of(exc), str(exc))
                out.verdicts.append(v)
                raise StepAborted(v) from exc
            v = c.resumed(ticket, rev, live)
            out.verdicts.append(v)
            if not v.accepted:
                raise StepAborted(v)
            out.published = v.published
        return out

    @contextlib.contextmanager
    def _phase(self, out: UpdateOutcome) -> Iterator[None]:
        """Route a failure verdict to the failure path; keep the outcome's clock.

        Anything else that escapes (a journal error, an invalid transition, a
        bug) is classified too (``_unexpected``): the caller always gets
        ``UpdateFailed`` with the update ended, never a half-done update.
        """
        try:
            try:
                yield
            except StepAborted as ab:
                verdict = ab.verdict
            except UpdateFailed:
                raise
            except Exception as exc:
                verdict = self._unexpected(out, exc)
            else:
                return
            try:
                self._after_failure(out.ticket, verdict, out)
            except UpdateFailed as uf:
                uf.outcome = out
                raise
            except Exception as exc:  # the failure path itself broke: end it anyway
                last = self._last_resort(out, exc)
                last.outcome = out
                raise last from exc
        finally:
            out.total_s = time.monotonic() - out.started_at
            out.state = self.controller.state

    def _opened_by_us(self, owner: str, identity: WeightIdentity) -> UpdateTicket | None:
        t = self.controller.current_ticket
        if t is not None and t.target.owner == owner and t.target.identity == identity:
            return t
        return None

    def _unexpected(self, out: UpdateOutcome, exc: Exception) -> Verdict:
        """Report an exception nobody classified as a failure of the current step.

        Kind TIMEOUT: the step's outcome is unknown, as when its deadline
        expires, so the policy's TIMEOUT column decides (a drain or a
        preflight mutated nothing; from the transfer on it is ambiguous). A
        controller that failed closed applies it as ambiguous and then cannot
        deliver its records: the verdict is rebuilt from its state.
        """
        c = self.controller
        before = c.state
        reason = f"unexpected {type(exc).__name__} in {before.value}: {exc}"
        self._note("unexpected_error", state=before.value, error=reason)
        step = _STEP_OF_STATE.get(before)
        ticket: UpdateTicket | None = out.ticket
        if before is State.READY and c.current_ticket is None:
            # The update got as far as the publish, whose records did not reach
            # the journal: what the engine serves is not on record.
            step, ticket = Step.SERVE, None
        if step is not None and (ticket is None or c.current_ticket == ticket):
            try:
                return c.fail(ticket, step, FailureKind.TIMEOUT, reason)
            except JournalError:
                pass  # applied (as ambiguous), but not delivered
            except (InvalidTransition, BadInput) as e2:
                self._note("unexpected_error_unclassified", error=repr(e2))
        after = c.state
        return Verdict(Event.FAIL, False, before, after,
                       Classification.AMBIGUOUS if after is State.TAINTED
                       else Classification.NO_MUTATION, (reason,))

    def _last_resort(self, out: UpdateOutcome, exc: Exception) -> UpdateFailed:
        """The failure path raised: taint if anything is still open, fence, report."""
        c = self.controller
        reason = f"failure path broke: {type(exc).__name__}: {exc}"
        self._note("unexpected_error", state=c.state.value, error=reason)
        step = _STEP_OF_STATE.get(c.state)
        if step is not None and c.current_ticket == out.ticket:
            with contextlib.suppress(Exception):
                c.fail(out.ticket, step, FailureKind.TIMEOUT, reason)
        if c.state is State.TAINTED:
            try:
                self._effect("fence", self.adapter.fence, self.deadlines.fence_s, out.phases)
            except Exception as e2:
                self._note("fence_failed", error=str(e2))
        cls = "ambiguous" if c.state is State.TAINTED else "no_mutation"
        return UpdateFailed(_phase_of(c.state), cls,
                            c.state.value, reason)

    def _abort_stragglers(self, ticket: UpdateTicket, out: UpdateOutcome) -> None:
        """The drain deadline expired under ``DrainPolicy.ABORT``: cut, abort, release.

        The controller releases the bindings first (unattributable), so no
        straggler can still complete as attributable; then whoever serves
        them (``stragglers``) cuts their requests and aborts them in the
        engine, under ``abort_s``. A failure there is noted, not fatal: the
        drain that follows pauses with ``PauseMode.ABORT`` and must see
        nothing in flight.
        """
        c, d = self.controller, self.deadlines
        bound = tuple(c.active.values())
        reason = (f"aborted by the drain policy: the drain deadline of {d.drain_s:g}s "
                  "expired before it finished")
        t0 = time.monotonic()
        released = c.abort_rollouts(ticket, [b.rollout_id for b in bound if b.rollout_id],
                                    reason)
        done: object = None
        handler = self.stragglers
        if handler is not None and released:
            try:
                done = self._effect("abort", lambda: handler(tuple(r.binding for r in released),
                                                             reason),
                                    d.abort_s, out.phases, "abort", cancel=lambda: None)
            except EffectError as exc:
                self._note("abort_failed", error=str(exc))
        elif released:
            out.phases.append(PhaseTiming("abort", time.monotonic() - t0, False))
        self._note("stragglers_aborted", rollouts=[r.binding.rollout_id for r in released],
                   reason=reason, result=done)

    def _caches_in_order(self) -> list[CacheKind]:
        order = [CacheKind.PREFIX, CacheKind.ENCODER, CacheKind.MULTIMODAL]
        have = set(self.adapter.caches)
        return [k for k in order if k in have]

    def _after_failure(self, ticket: UpdateTicket, verdict: Verdict,
                       out: UpdateOutcome) -> NoReturn:
        c, d = self.controller, self.deadlines
        if verdict.after is State.RESUMING:
            # Nothing mutated: return the engine to service on the old version.
            try:
                rev = self._effect(Step.RESUME.value, self.adapter.resume, d.resume_s,
                                   out.phases)
            except EffectError as exc:
                v2 = c.fail(ticket, Step.RESUME, FailureKind.of(exc), str(exc))
            else:
                v2 = c.resumed(ticket, rev)
            out.verdicts.append(v2)
        if c.state is State.TAINTED:
            try:
                self._effect("fence", self.adapter.fence, d.fence_s, out.phases)
            except EffectError as exc:
                self._note("fence_failed", error=str(exc))
        cls = verdict.classification.value if verdict.classification else "ambiguous"
        phase = _phase_of(verdict.before)
        raise UpdateFailed(phase, cls, c.state.value, "; ".join(verdict.problems))


#: The step an update is in, by state (what an unexpected failure is reported as).
_STEP_OF_STATE = {State.DRAINING: Step.DRAIN, State.QUIESCED: Step.PREFLIGHT,
                  State.UPDATING: Step.TRANSFER, State.INVALIDATING: Step.INVALIDATE,
                  State.VALIDATING: Step.VALIDATE, State.RESUMING: Step.RESUME}
#: The phase an ``UpdateFailed`` names for a failure in a state no update step owns.
_PHASE_OF_STATE = {State.SLEEPING: "wake", State.WAKING: "transfer", State.WARMING: "wake"}


def _phase_of(state: State) -> str:
    """The phase an ``UpdateFailed`` names for a failure in ``state``."""
    step = _STEP_OF_STATE.get(state)
    return step.value if step is not None else _PHASE_OF_STATE.get(state, state.value.lower())
