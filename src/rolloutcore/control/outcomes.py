"""What the runner hands back: phase timings and the outcome of an update or a sleep.

Apart from the runner so that the paths it delegates to (the takeover, the
colocated sleep and wake) use the same types without importing the runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.port import LifecycleAdapter
from rolloutcore.core.evidence import SleepEvidence
from rolloutcore.core.lifecycle import State, Verdict
from rolloutcore.core.lifecycle_state import SleepTicket, UpdateTicket
from rolloutcore.core.versions import WeightVersion

__all__ = ["EffectHost", "PhaseTiming", "SleepOutcome", "StepAborted", "UpdateOutcome"]

T = TypeVar("T")


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


class StepAborted(Exception):
    """A verdict stopped the update (inside the runner's phases: the failure is decided)."""

    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict


class EffectHost(Protocol):
    """The runner as the paths it delegates to drive it (the takeover, the colocated
    sleep and wake): its controller, its adapter, its effects under deadlines."""

    controller: LifecycleController
    adapter: LifecycleAdapter

    def _effect(self, step: str, fn: Callable[[], T], deadline_s: float,
                phases: Any, phase: str | None = None,
                cancel: Callable[[], None] | None = None) -> T: ...
    def _note(self, what: str, **data: Any) -> None: ...
