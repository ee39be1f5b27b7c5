"""Colocated training: the engine sleeps beside its trainer on one GPU, then wakes.

``sleep`` closes admission, lets bound rollouts finish and puts the engine to
sleep; ``wake`` wakes it on its own weights (a restore, verified against the
checksums taken before the sleep); ``wake_update`` wakes the weights, writes
the new policy, wakes the KV cache, then validates like any update. Every
step goes through the runner's effects (deadlines, cancel) and the
controller's table (``WAKE_TARGETS``); the runner delegates here so that each
file holds one concern, and this module does not import the runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol, TypeVar

from rolloutcore.control.outcomes import EffectHost, SleepOutcome, StepAborted, UpdateOutcome
from rolloutcore.control.port import Sleeper
from rolloutcore.core.evidence import SLEEP_LEVELS, WakeTags
from rolloutcore.core.lifecycle import FailureKind, State, Step, Verdict
from rolloutcore.core.lifecycle_state import SleepTicket, UpdateTicket
from rolloutcore.core.versions import VerificationLevel, WeightIdentity
from rolloutcore.errors import BadInput, EffectError, UpdateFailed, UpdateRefused

__all__ = ["ColocatedHost", "sleep", "wake", "wake_update"]

T = TypeVar("T")


class ColocatedHost(EffectHost, Protocol):
    """What the colocated paths drive: the runner's controller, adapter, deadlines,
    effects and update phases (the runner is one)."""

    def _run_step(self, ticket: UpdateTicket, step: Step, fn: Callable[[], T],
                  feed: Callable[[T], Verdict], deadline_s: float, out: UpdateOutcome,
                  phase: str | None = None) -> Verdict: ...
    def _phase(self, out: UpdateOutcome) -> AbstractContextManager[None]: ...
    def close_update(self, out: UpdateOutcome) -> UpdateOutcome: ...


def _sleeper(runner: ColocatedHost) -> Sleeper:
    a = runner.adapter
    if not isinstance(a, Sleeper):
        raise UpdateRefused(f"{type(a).__name__} cannot put its engine to sleep "
                            f"(no Sleeper capability); nothing was changed")
    return a

def sleep(runner: ColocatedHost, level: int = 2, *, owner: str = "trainer",
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
    sleeper = _sleeper(runner)
    c, d = runner.controller, runner.deadlines
    t0 = time.monotonic()
    ticket = c.request_sleep(owner, level)
    out = SleepOutcome(ticket, State.DOZING, None, 0.0)

    def failed(v: Verdict, reason: str) -> UpdateFailed:
        out.verdicts.append(v)
        if c.state is State.TAINTED:
            try:
                runner._effect("fence", runner.adapter.fence, d.fence_s, None)
            except EffectError as exc:
                runner._note("fence_failed", error=str(exc))
        out.state, out.total_s = c.state, time.monotonic() - t0
        cls = v.classification.value if v.classification else "ambiguous"
        return UpdateFailed("sleep", cls, c.state.value, reason)

    if not c.wait_idle(d.drain_s):
        why = f"{len(c.active)} rollouts still bound after {d.drain_s:g}s: not slept"
        raise failed(c.fail(ticket, Step.SLEEP, FailureKind.REFUSED, why), why)
    try:
        ev = runner._effect(Step.SLEEP.value, lambda: sleeper.sleep(level, reference=ref),
                          d.sleep_s, None)
    except EffectError as exc:
        v = c.fail(ticket, Step.SLEEP, FailureKind.of(exc), str(exc))
        raise failed(v, str(exc)) from exc
    v = c.slept(ticket, ev)
    if not v.accepted:
        raise failed(v, "; ".join(v.problems))
    out.verdicts.append(v)
    out.evidence, out.state, out.total_s = ev, c.state, time.monotonic() - t0
    return out

def _asleep(runner: ColocatedHost) -> SleepTicket:
    sl = runner.controller.current_sleep
    if sl is None or runner.controller.state is not State.SLEEPING:
        raise UpdateRefused(f"nothing to wake: the engine is {runner.controller.state.value}")
    return sl

def _wake_step(runner: ColocatedHost, out: UpdateOutcome, sleeper: Sleeper, tags: WakeTags) -> None:
    c, ticket = runner.controller, out.ticket
    try:
        ev = runner._effect(Step.WAKE.value, lambda: sleeper.wake(tags), runner.deadlines.wake_s,
                          out.phases, f"wake_{tags.value}")
    except EffectError as exc:
        v = c.fail(ticket, Step.WAKE, FailureKind.of(exc), str(exc))
        out.verdicts.append(v)
        raise StepAborted(v) from exc
    v = c.woke(ticket, ev)
    out.verdicts.append(v)
    if not v.accepted:
        raise StepAborted(v)

def wake(runner: ColocatedHost, *, owner: str = "trainer") -> UpdateOutcome:
    """Wake the sleeping engine on its own weights (a restore), verified, or taint.

    Wakes everything, resets the caches, validates while paused (every
    parameter against its checksum from before the sleep), resumes: the
    committed version serves again, nothing new is published (the journal
    closes the wake with an ``abandon``). After a level-2 sleep (or one
    without ``reference``) the validation cannot hold: the engine is
    tainted, never served.
    """
    sleeper = _sleeper(runner)
    ticket = runner.controller.request_wake(_asleep(runner), owner)
    out = UpdateOutcome(ticket, None, State.SLEEPING, 0.0)
    out.started_at = time.monotonic()
    with runner._phase(out):
        _wake_step(runner, out, sleeper, WakeTags.ALL)
    return runner.close_update(out)

def wake_update(runner: ColocatedHost, identity: WeightIdentity, *, owner: str = "trainer",
                label: str | None = None,
                min_verification: VerificationLevel = VerificationLevel.ENGINE_CHECKSUM,
                ) -> UpdateOutcome:
    """The colocated update: preflight, wake the weights, transfer, wake the KV cache,
    reset caches, validate while paused (every parameter), resume, publish.

    A preflight that does not hold refuses the wake before any engine call
    (``UpdateRefused``; the engine still sleeps). Any failure after the
    first wake call taints: the old weights are gone or unverified.
    """
    sleeper = _sleeper(runner)
    c, a, d = runner.controller, runner.adapter, runner.deadlines
    sl = _asleep(runner)
    target = c.wake_target(owner, identity, label=label)
    try:
        pf = runner._effect(Step.PREFLIGHT.value, lambda: a.preflight(target), d.preflight_s,
                          None)
    except EffectError as exc:
        raise UpdateFailed("preflight", "no_mutation", c.state.value,
                           f"{exc} (the engine still sleeps)") from exc
    ticket = c.request_wake(sl, owner, identity, label=label,
                            min_verification=min_verification, preflight=pf)
    out = UpdateOutcome(ticket, None, State.SLEEPING, 0.0)
    out.started_at = time.monotonic()
    with runner._phase(out):
        _wake_step(runner, out, sleeper, WakeTags.WEIGHTS)
        runner._run_step(ticket, Step.TRANSFER, lambda: a.transfer(ticket.target),
                       lambda ev: c.transferred(ticket, ev), d.transfer_s, out)
        _wake_step(runner, out, sleeper, WakeTags.KV_CACHE)
    return runner.close_update(out)
