"""The step table of an update: each evidence event's row (h2's form).

One row per evidence event (``STEPS``): the failure-policy row its evidence
falls in when it does not hold, the evidence type it takes, its checks and
its effect once the evidence holds; the effect returns the key the event's
outcome table (``rules.TRANSITIONS``) needs. ``Lifecycle._step``
(``core.lifecycle``) is the one skeleton that runs a row. ``STATE_TRIGGERED``
holds the transitions the state triggers by itself after an accepted step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutcore.core.evidence import (
    CacheResetEvidence,
    DrainEvidence,
    Evidence,
    PreflightEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
    WakeEvidence,
)
from rolloutcore.core.lifecycle_state import LifecycleState, UpdateInFlight, verification_of
from rolloutcore.core.records import (
    Abandon,
    BeginUpdate,
    Commit,
    Event,
    State,
    Step,
)
from rolloutcore.core.versions import (
    VerificationLevel,
)

__all__ = ["STATE_TRIGGERED", "STEPS", "StepRule"]

S, E = State, Event


# --------------------------------------------------------------------------- the step table
#: A step's checks: (machine, its update, the evidence, the extra argument) -> problems.
Checks = Callable[[LifecycleState, UpdateInFlight, Any, Any], list[str]]
#: A step's effect once its evidence holds: applies its records and returns the key
#: its event's outcome table needs (``None`` for an entry with one target).
Effect = Callable[[LifecycleState, UpdateInFlight, Any, Any], object]


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


def _checks_drained(m: LifecycleState, upd: UpdateInFlight, ev: DrainEvidence,
                    _: object) -> list[str]:
    rule = upd.rule
    problems = (ev.problems(upd.ticket.target) if rule.pause is None
                else ev.problems_for(rule.pause, rule.clear_cache))
    if m._active and rule.drains:
        problems.append(f"{len(m._active)} rollouts still bound")
    return problems


def _effect_drained(m: LifecycleState, upd: UpdateInFlight, ev: DrainEvidence, _: object) -> None:
    if not upd.rule.drains:
        m._carry(upd)


def _checks_preflighted(m: LifecycleState, upd: UpdateInFlight, ev: PreflightEvidence,
                        _: object) -> list[str]:
    problems = ev.problems(upd.ticket.target)
    if m._active and upd.rule.drains:  # unreachable: admission is closed
        problems.append(f"{len(m._active)} rollouts bound at begin_update")
    return problems


def _effect_preflighted(m: LifecycleState, upd: UpdateInFlight,
                        ev: PreflightEvidence, _: object) -> None:
    # From here the target's label may reach the engine: never reuse it.
    m._record(BeginUpdate(upd.ticket.update_id, upd.ticket.target.version))


class _Targeted(Protocol):
    """Evidence checked against the update's target alone."""

    def problems(self, target: UpdateTarget) -> list[str]: ...


def _checks_target(m: LifecycleState, upd: UpdateInFlight, ev: _Targeted, _: object) -> list[str]:
    return ev.problems(upd.ticket.target)


def _effect_transferred(m: LifecycleState, upd: UpdateInFlight,
                        ev: TransferEvidence, _: object) -> None:
    # Evidence that came back but does not hold failed in the checks: the weights
    # may be anything then (ambiguous, even if the transport says it never
    # started; fail(REFUSED) is the way to report a provable no-op).
    upd.mutation_started = upd.mutation_started or ev.mutation_started


def _effect_invalidated(m: LifecycleState, upd: UpdateInFlight,
                        ev: CacheResetEvidence, _: object) -> bool:
    upd.reset_ok.add(ev.cache)
    return not m._pending_resets()


def _checks_validated(m: LifecycleState, upd: UpdateInFlight, ev: ValidationEvidence,
                      _: object) -> list[str]:
    problems = ev.problems(upd.ticket.target)
    if ev.paused is False:
        problems.append("validation ran on a resumed engine; it must run while paused")
    if upd.wake is not None:
        problems += _wake_coverage_problems(ev, upd.wake)
    return problems


def _effect_validated(m: LifecycleState, upd: UpdateInFlight,
                      ev: ValidationEvidence, _: object) -> None:
    upd.validations.append(ev)


def _checks_resumed(m: LifecycleState, upd: UpdateInFlight, ev: ResumeEvidence,
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


def _effect_resumed(m: LifecycleState, upd: UpdateInFlight, ev: ResumeEvidence,
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


def _effect_woke(m: LifecycleState, upd: UpdateInFlight, ev: WakeEvidence, key: object) -> object:
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
STATE_TRIGGERED: Mapping[State, tuple[Event, object, Callable[[LifecycleState], bool]]] = {
    S.INVALIDATING: (E.INVALIDATED, True, lambda m: not m._pending_resets()),
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
