"""The port: the one interface between the lifecycle runner and an engine.

An adapter performs effects on one inference engine and returns typed
evidence (``rolloutcore.core.evidence``). It never decides whether an effect
*worked*: the controller does, from the evidence. Adapters translate their
low-level failures into ``rolloutcore.errors.EffectError`` subclasses, with
``mutation_started=False`` only when they can prove the weights are
untouched.

Every method may be called from a worker thread supervised by a deadline;
``cancel`` is called from *another* thread when that deadline expires and
must make the stuck call return (tear down a transfer group, close a
connection). The fake engine (``adapters.fake``) and the vLLM HTTP adapter
(``adapters.vllm``) are adapters like any other.

One method is optional: ``observe_health(*, timeout_s) -> HealthEvidence``,
the engine seen between updates (answering, healthy, the same process as
at bootstrap). ``LifecycleRunner.check_serving`` uses it where it exists;
an adapter without it is simply not watched.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    DrainEvidence,
    PauseMode,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.versions import WeightVersion

__all__ = ["LifecycleAdapter", "Recoverer"]


@runtime_checkable
class LifecycleAdapter(Protocol):
    """Effects on one engine. See the module docstring for the contract."""

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        """Caches this adapter can reset; the runner resets all of them."""
        ...

    def bootstrap(self) -> BootstrapEvidence:
        """Reach the engine and describe it (epoch, label, capabilities)."""
        ...

    def drain(self, mode: PauseMode) -> DrainEvidence:
        """Pause the engine; with WAIT, return once its in-flight work is done."""
        ...

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        """Describe the trainer's source (and the engine's manifest) before mutating."""
        ...

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        """Move the weights, finishing the engine's update with ``target``'s label."""
        ...

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        """Reset one cache and report the engine's own success flag."""
        ...

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        """Observe what the engine serves. ``live=False``: still paused.

        ``live=True`` is called after resume with admission still closed; it
        returns ``None`` when the adapter has nothing that needs a running
        engine (then the paused validation alone decides).
        """
        ...

    def resume(self) -> ResumeEvidence:
        """Resume the engine and confirm it is no longer paused."""
        ...

    def fence(self) -> None:
        """Best effort, after a taint: stop the engine from serving anyone."""
        ...

    def cancel(self, step: str) -> None:
        """Called from another thread when ``step`` overran: unblock it."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class Recoverer(Protocol):
    """Brings a tainted engine back: a *replacement* process on a checkpoint of known identity.

    ``replace_engine`` must stop the old engine (or be told by an operator
    that it is gone), start a new one (new epoch) on the known checkpoint,
    give it ``target``'s label, and validate it like an update (label,
    checksums, probe), returning the evidence. ``cancel`` is the watchdog.
    """

    def replace_engine(self, target: WeightVersion) -> RecoveryEvidence:
        ...

    def cancel(self) -> None:
        ...
