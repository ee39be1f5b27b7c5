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
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rolloutcore.control.port import HealthObserver, LifecycleAdapter, Recoverer, Sleeper
from rolloutcore.core.evidence import (
    SLEEP_LEVELS,
    CacheKind,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    SleepEvidence,
    TransferEvidence,
    ValidationEvidence,
    WakeTags,
)
from rolloutcore.core.lifecycle import (
    Classification,
    FailureKind,
    LifecycleController,
    SleepTicket,
    State,
    Step,
    UpdateTicket,
    Verdict,
)
from rolloutcore.core.records import Effect, Note, Record
from rolloutcore.core.versions import VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    InvalidTransition,
    JournalError,
    UpdateFailed,
    UpdateRefused,
)

__all__ = ["Deadlines", "LifecycleRunner", "PhaseTiming", "SleepOutcome", "UpdateOutcome"]

T = TypeVar("T")


@dataclass(frozen=True)
class Deadlines:
    """Seconds each effect may take before it is classified as a timeout."""

    drain_s: float = 120.0        # local rollouts finishing (admission closed)
    pause_s: float = 60.0         # engine pause(mode=wait): engine's own in-flight work
    preflight_s: float = 30.0
    transfer_s: float = 300.0
    reset_s: float = 15.0
    validate_s: float = 60.0
    resume_s: float = 15.0
    live_validate_s: float = 60.0
    bootstrap_s: float = 30.0
    recover_s: float = 600.0      # replace the engine process and verify it
    fence_s: float = 10.0
    cancel_grace_s: float = 5.0   # how long a cancelled effect gets to unwind
    retry_backoff_s: float = 0.2
    sleep_s: float = 120.0        # /sleep (level 1 copies the weights to host: 14 s for 8B)
    wake_s: float = 60.0          # one /wake_up

    def __post_init__(self) -> None:
        for name, v in self.__dict__.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise BadInput(f"deadline {name} must be a positive number, got {v!r}")

    def scaled(self, factor: float) -> Deadlines:
        if not factor > 0:
            raise BadInput("factor must be positive")
        return Deadlines(**{k: v * factor for k, v in self.__dict__.items()})


@dataclass(frozen=True)
class PhaseTiming:
    phase: str
    seconds: float
    in_effect: bool  # True: time spent inside an engine/transport call


@dataclass
class UpdateOutcome:
    ticket: UpdateTicket
    published: WeightVersion | None
    state: State
    total_s: float
    phases: list[PhaseTiming] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)

    @property
    def effect_s(self) -> float:
        return sum(p.seconds for p in self.phases if p.in_effect)

    @property
    def controller_overhead_s(self) -> float:
        """Time outside engine and transport calls (decisions, bookkeeping, journal)."""
        return max(0.0, self.total_s - self.effect_s - self.phase_s("drain"))


    def phase_s(self, name: str) -> float:
        return sum(p.seconds for p in self.phases if p.phase == name)

    def breakdown(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.phases:
            out[p.phase] = out.get(p.phase, 0.0) + p.seconds
        out["controller_overhead"] = self.controller_overhead_s
        out["total"] = self.total_s
        return out


#: The lifecycle step of each effect the runner names otherwise, for the port's
#: ``cancel``: the live validation is part of VALIDATE; the health observation
#: and the fence act on the serving engine.
_CANCEL_STEP: dict[str, Step] = {"validate_live": Step.VALIDATE, "health": Step.SERVE,
                                 "fence": Step.SERVE}


@dataclass
class SleepOutcome:
    """A sleep, as the trainer sees it: where the engine is, and the memory it gave back."""

    ticket: SleepTicket
    state: State
    evidence: SleepEvidence | None
    total_s: float
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int | None:
        """Device memory the engine reports it gave back (None: it reports none)."""
        return None if self.evidence is None else self.evidence.freed_bytes


class _Abort(Exception):
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict


def _kind(exc: BaseException) -> FailureKind:
    if isinstance(exc, EffectTimeout):
        return FailureKind.TIMEOUT
    if isinstance(exc, EffectError) and not exc.mutation_started:
        return FailureKind.REFUSED
    return FailureKind.ERROR


class LifecycleRunner:
    """Runs bootstrap and updates for one engine; one update at a time (the controller
    enforces it)."""

    def __init__(self, controller: LifecycleController, adapter: LifecycleAdapter,
                 deadlines: Deadlines | None = None, *,
                 record: Callable[[Record], object] | None = None,
                 drain_mode: PauseMode = PauseMode.WAIT) -> None:
        if drain_mode is PauseMode.KEEP:
            raise BadInput("strict mode drains with WAIT (or ABORT); KEEP lets rollouts span "
                           "versions")
        self.controller = controller
        self.adapter = adapter
        self.deadlines = deadlines or Deadlines()
        self._record = record
        self._health_failures = 0  # consecutive failed check_serving observations
        self._drain_mode = drain_mode

    # ------------------------------------------------------------ effects
    def _effect(self, step: str, fn: Callable[[], T], deadline_s: float,
                phases: list[PhaseTiming] | None, phase: str | None = None,
                cancel: Callable[[], None] | None = None) -> T:
        """Run ``fn`` in a worker thread; on deadline, cancel it and raise EffectTimeout."""
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the supervising thread
                box["error"] = exc

        t0 = time.monotonic()
        th = threading.Thread(target=work, name=f"rolloutcore-{step}", daemon=True)
        th.start()
        th.join(deadline_s)
        timed_out = th.is_alive()
        if timed_out:
            try:
                if cancel is not None:
                    cancel()
                else:
                    self.adapter.cancel(_CANCEL_STEP.get(step) or Step(step))
            except Exception as exc:
                self._note("cancel_failed", step=step, error=repr(exc))
            th.join(self.deadlines.cancel_grace_s)
        dt = time.monotonic() - t0
        if phases is not None:
            phases.append(PhaseTiming(phase or step, dt, True))
        ok = not timed_out and "error" not in box
        self._emit(Effect(step, dt, ok, None if ok else repr(box.get("error", "deadline expired"))))
        if timed_out:
            raise EffectTimeout(step, deadline_s, mutation_started=step != Step.PREFLIGHT)
        if "error" in box:
            err = box["error"]
            if isinstance(err, EffectError):
                raise err
            if isinstance(err, Exception):
                raise EffectError(step, f"{type(err).__name__}: {err}") from err
            raise err
        return box["value"]  # type: ignore[no-any-return]

    def _note(self, what: str, **data: Any) -> None:
        self._emit(Note(what, data))

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
                verdict = self.controller.fail(ticket, step, _kind(exc), str(exc))
            else:
                verdict = feed(ev)
            out.verdicts.append(verdict)
            if verdict.classification is Classification.INCOMPLETE:
                time.sleep(self.deadlines.retry_backoff_s)
                continue
            if not verdict.accepted:
                raise _Abort(verdict)
            return verdict

    # ------------------------------------------------------------ bootstrap
    def bootstrap(self, identity: WeightIdentity) -> Verdict:
        """Take over the engine; its current weights become the first committed version."""
        try:
            ev = self._effect(Step.BOOTSTRAP.value, self.adapter.bootstrap,
                              self.deadlines.bootstrap_s, None)
        except EffectError as exc:
            v = self.controller.fail(None, Step.BOOTSTRAP, _kind(exc), str(exc))
            raise UpdateFailed("bootstrap", v.classification.value if v.classification
                               else "no_mutation", v.after.value, str(exc)) from exc
        label = ev.observed_label if ev.label_supported else None
        v = self.controller.bootstrap(ev, identity, label=label)
        if not v.accepted:
            raise UpdateFailed("bootstrap", "no_mutation", v.after.value, "; ".join(v.problems))
        return v

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
                v = c.fail(None, Step.RECOVER, _kind(exc), str(exc))
            raise UpdateFailed("recover", "ambiguous", v.after.value, str(exc)) from exc
        v = c.recovered(ev)
        if not v.accepted:
            raise UpdateFailed("recover", "ambiguous", v.after.value, "; ".join(v.problems))
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
        if isinstance(failures_to_taint, bool) or not isinstance(failures_to_taint, int) \
                or failures_to_taint < 1:
            raise BadInput("failures_to_taint must be an int >= 1")
        if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool)
                and timeout_s > 0):
            raise BadInput("timeout_s must be a positive number")
        adapter = self.adapter
        if not isinstance(adapter, HealthObserver) or self.controller.state is not State.READY:
            return None
        # An observation belongs to the version served when it began: one that an
        # update overtook (the update verified the engine itself) is dropped.
        serving = self.controller.committed
        restarted = False
        try:
            ev = self._effect("health", lambda: adapter.observe_health(timeout_s=timeout_s),
                              timeout_s * 2 + 1.0, None)
        except EffectError as exc:
            problems, kind = [str(exc)], _kind(exc)
            if kind is FailureKind.REFUSED:
                kind = FailureKind.ERROR
        else:
            if not isinstance(ev, HealthEvidence):
                raise EffectError("health", f"observe_health returned {type(ev).__name__}")
            problems = ev.problems(None)
            restarted = ev.restarted
            kind = FailureKind.DIED if (restarted or not ev.answering) else FailureKind.ERROR
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
        try:
            self._effect("fence", self.adapter.fence, self.deadlines.fence_s, None)
        except EffectError as exc:
            self._note("fence_failed", error=str(exc))
        return v

    # ------------------------------------------------------------ colocated training
    def _sleeper(self) -> Sleeper:
        a = self.adapter
        if not isinstance(a, Sleeper):
            raise UpdateRefused(f"{type(a).__name__} cannot put its engine to sleep "
                                f"(no Sleeper capability); nothing was changed")
        return a

    def sleep(self, level: int = 2, *, owner: str = "trainer",
              reference: bool | None = None) -> SleepOutcome:
        """Close admission, let bound rollouts finish, put the engine to sleep.

        ``reference`` (default: level 1 only) hashes every engine parameter
        before the sleep, so that a wake on the same weights can be verified
        (a level-2 sleep discards them: only an update wakes it well). On
        return the state is SLEEPING; otherwise ``UpdateFailed``: READY again
        when the engine was not touched, TAINTED when its memory is unknown.
        """
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise BadInput(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        ref = level == 1 if reference is None else reference
        if not isinstance(ref, bool):
            raise BadInput("reference must be a bool or None")
        sleeper = self._sleeper()
        c, d = self.controller, self.deadlines
        t0 = time.monotonic()
        ticket = c.request_sleep(owner, level)
        out = SleepOutcome(ticket, State.DOZING, None, 0.0)

        def failed(v: Verdict, reason: str) -> UpdateFailed:
            out.verdicts.append(v)
            if c.state is State.TAINTED:
                try:
                    self._effect("fence", self.adapter.fence, d.fence_s, None)
                except EffectError as exc:
                    self._note("fence_failed", error=str(exc))
            out.state, out.total_s = c.state, time.monotonic() - t0
            cls = v.classification.value if v.classification else "ambiguous"
            return UpdateFailed("sleep", cls, c.state.value, reason)

        if not c.wait_idle(d.drain_s):
            why = f"{len(c.active)} rollouts still bound after {d.drain_s:g}s: not slept"
            raise failed(c.fail(ticket, Step.SLEEP, FailureKind.REFUSED, why), why)
        try:
            ev = self._effect(Step.SLEEP.value, lambda: sleeper.sleep(level, reference=ref),
                              d.sleep_s, None)
        except EffectError as exc:
            raise failed(c.fail(ticket, Step.SLEEP, _kind(exc), str(exc)), str(exc)) from exc
        v = c.slept(ticket, ev)
        if not v.accepted:
            raise failed(v, "; ".join(v.problems))
        out.verdicts.append(v)
        out.evidence, out.state, out.total_s = ev, c.state, time.monotonic() - t0
        return out

    def _asleep(self) -> SleepTicket:
        sl = self.controller.current_sleep
        if sl is None or self.controller.state is not State.SLEEPING:
            raise UpdateRefused(f"nothing to wake: the engine is {self.controller.state.value}")
        return sl

    def _wake_step(self, out: UpdateOutcome, sleeper: Sleeper, tags: WakeTags) -> None:
        c, ticket = self.controller, out.ticket
        try:
            ev = self._effect(Step.WAKE.value, lambda: sleeper.wake(tags), self.deadlines.wake_s,
                              out.phases, f"wake_{tags.value}")
        except EffectError as exc:
            v = c.fail(ticket, Step.WAKE, _kind(exc), str(exc))
            out.verdicts.append(v)
            raise _Abort(v) from exc
        v = c.woke(ticket, ev)
        out.verdicts.append(v)
        if not v.accepted:
            raise _Abort(v)

    def wake(self, *, owner: str = "trainer") -> UpdateOutcome:
        """Wake the sleeping engine on its own weights (a restore), verified, or taint.

        Wakes everything, resets the caches, validates while paused (every
        parameter against its checksum from before the sleep), resumes: the
        committed version serves again, nothing new is published (the journal
        closes the wake with an ``abandon``). After a level-2 sleep (or one
        without ``reference``) the validation cannot hold: the engine is
        tainted, never served.
        """
        sleeper = self._sleeper()
        ticket = self.controller.request_wake(self._asleep(), owner)
        out = UpdateOutcome(ticket, None, State.SLEEPING, 0.0)
        out.started_at = time.monotonic()
        with self._phase(out):
            self._wake_step(out, sleeper, WakeTags.ALL)
        return self.close_update(out)

    def wake_update(self, identity: WeightIdentity, *, owner: str = "trainer",
                    label: str | None = None,
                    min_verification: VerificationLevel = VerificationLevel.ENGINE_CHECKSUM,
                    ) -> UpdateOutcome:
        """The colocated update: preflight, wake the weights, transfer, wake the KV cache,
        reset caches, validate while paused (every parameter), resume, publish.

        A preflight that does not hold refuses the wake before any engine call
        (``UpdateRefused``; the engine still sleeps). Any failure after the
        first wake call taints: the old weights are gone or unverified.
        """
        sleeper = self._sleeper()
        c, a, d = self.controller, self.adapter, self.deadlines
        sl = self._asleep()
        target = c.wake_target(owner, identity, label=label)
        try:
            pf = self._effect(Step.PREFLIGHT.value, lambda: a.preflight(target), d.preflight_s,
                              None)
        except EffectError as exc:
            raise UpdateFailed("preflight", "no_mutation", c.state.value,
                               f"{exc} (the engine still sleeps)") from exc
        ticket = c.request_wake(sl, owner, identity, label=label,
                                min_verification=min_verification, preflight=pf)
        out = UpdateOutcome(ticket, None, State.SLEEPING, 0.0)
        out.started_at = time.monotonic()
        with self._phase(out):
            self._wake_step(out, sleeper, WakeTags.WEIGHTS)
            self._run_step(ticket, Step.TRANSFER, lambda: a.transfer(ticket.target),
                           lambda ev: c.transferred(ticket, ev), d.transfer_s, out)
            self._wake_step(out, sleeper, WakeTags.KV_CACHE)
        return self.close_update(out)

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
        ticket = self.controller.request_update(identity, owner, label=label,
                                                min_verification=min_verification)
        out = UpdateOutcome(ticket, None, State.DRAINING, 0.0)
        out.started_at = time.monotonic()
        c, a, d = self.controller, self.adapter, self.deadlines
        with self._phase(out):
            # DRAINING: admission is closed; wait for bound rollouts, then pause
            # the engine so that anything it runs beyond our view finishes too.
            tw = time.monotonic()
            idle = c.wait_idle(d.drain_s)
            out.phases.append(PhaseTiming("drain", time.monotonic() - tw, False))
            if not idle:
                v = c.fail(ticket, Step.DRAIN, FailureKind.TIMEOUT,
                           f"{len(c.active)} rollouts still active after {d.drain_s:g}s")
                out.verdicts.append(v)
                raise _Abort(v)
            self._run_step(ticket, Step.DRAIN, lambda: a.drain(self._drain_mode),
                           lambda ev: c.drained(ticket, ev), d.pause_s, out, "pause")
            if preflight is not None:
                v = c.preflighted(ticket, preflight)
                out.verdicts.append(v)
                if not v.accepted:
                    raise _Abort(v)
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
                raise _Abort(v)

    def report_transfer_failure(self, out: UpdateOutcome, kind: FailureKind, reason: str) -> None:
        """The transfer failed or its lease expired; classified by the failure policy."""
        with self._phase(out):
            v = self.controller.fail(out.ticket, Step.TRANSFER, kind, reason)
            out.verdicts.append(v)
            raise _Abort(v)

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
                raise _Abort(v)

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
                v = c.fail(ticket, Step.RESUME, _kind(exc), str(exc))
                out.verdicts.append(v)
                raise _Abort(v) from exc
            try:
                live = self._effect("validate_live", lambda: a.validate(ticket.target, live=True),
                                    d.live_validate_s, out.phases)
            except EffectError as exc:
                v = c.fail(ticket, Step.VALIDATE, _kind(exc), str(exc))
                out.verdicts.append(v)
                raise _Abort(v) from exc
            v = c.resumed(ticket, rev, live)
            out.verdicts.append(v)
            if not v.accepted:
                raise _Abort(v)
            out.published = v.published
        return out

    @contextlib.contextmanager
    def _phase(self, out: UpdateOutcome) -> Iterator[None]:
        """Route a failure verdict to the failure path; keep the outcome's clock."""
        try:
            yield
        except _Abort as ab:
            try:
                self._after_failure(out.ticket, ab.verdict, out)
            except UpdateFailed as uf:
                uf.outcome = out
                raise
        finally:
            out.total_s = time.monotonic() - out.started_at
            out.state = self.controller.state

    def _caches_in_order(self) -> list[CacheKind]:
        order = [CacheKind.PREFIX, CacheKind.ENCODER, CacheKind.MULTIMODAL]
        have = set(self.adapter.caches)
        return [k for k in order if k in have]

    def _after_failure(self, ticket: UpdateTicket, verdict: Verdict, out: UpdateOutcome) -> None:
        c, d = self.controller, self.deadlines
        if verdict.after is State.RESUMING:
            # Nothing mutated: return the engine to service on the old version.
            try:
                rev = self._effect(Step.RESUME.value, self.adapter.resume, d.resume_s,
                                   out.phases)
            except EffectError as exc:
                v2 = c.fail(ticket, Step.RESUME, _kind(exc), str(exc))
            else:
                v2 = c.resumed(ticket, rev)
            out.verdicts.append(v2)
        if c.state is State.TAINTED:
            try:
                self._effect("fence", self.adapter.fence, d.fence_s, out.phases)
            except EffectError as exc:
                self._note("fence_failed", error=str(exc))
        cls = verdict.classification.value if verdict.classification else "ambiguous"
        phase = _PHASE_OF_STATE.get(verdict.before, verdict.before.value)
        raise UpdateFailed(phase, cls, c.state.value, "; ".join(verdict.problems))


_PHASE_OF_STATE = {State.DRAINING: "drain", State.QUIESCED: "preflight",
                   State.UPDATING: "transfer", State.INVALIDATING: "invalidate",
                   State.VALIDATING: "validate", State.RESUMING: "resume",
                   State.SLEEPING: "wake", State.WAKING: "transfer", State.WARMING: "wake"}

