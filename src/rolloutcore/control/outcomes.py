"""What the runner takes and hands back: its deadlines, phase timings and the outcome
of an update or a sleep.

Apart from the runner so that the paths it delegates to (the takeover, the
colocated sleep and wake) use the same types without importing the runner.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.port import LifecycleAdapter
from rolloutcore.core.evidence import SleepEvidence
from rolloutcore.core.lifecycle import State, Verdict
from rolloutcore.core.lifecycle_state import SleepTicket, UpdateTicket
from rolloutcore.core.versions import WeightVersion
from rolloutcore.errors import BadInput

__all__ = ["Deadlines", "EffectHost", "PhaseTiming", "SleepOutcome", "StepAborted", "UpdateOutcome"]

T = TypeVar("T")


@dataclass(frozen=True)
class Deadlines:
    """Seconds each effect may take before it is classified as a timeout."""

    drain_s: float = 120.0        # local rollouts finishing (admission closed)
    abort_s: float = 10.0         # stragglers cut and aborted in the engine (drain policy)
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
    # A read with its own timeout (health between updates, the lease's write count) is
    # cancelled by the watchdog at twice that timeout plus this.
    read_slack_s: float = 1.0

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
    deadlines: Deadlines

    def _effect(self, step: str, fn: Callable[[], T], deadline_s: float,
                phases: list[PhaseTiming] | None, phase: str | None = None,
                cancel: Callable[[], None] | None = None) -> T: ...
    def _note(self, what: str, **data: object) -> None: ...
