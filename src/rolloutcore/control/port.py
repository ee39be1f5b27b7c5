"""The port: the one interface between the lifecycle runner and an engine.

An adapter performs effects on one inference engine and returns typed
evidence (``rolloutcore.core.evidence``). It never decides whether an effect
*worked*: the controller does, from the evidence. Adapters translate their
low-level failures into ``rolloutcore.errors.EffectError`` subclasses, with
``mutation_started=False`` only when they can prove the weights are
untouched.

``LifecycleAdapter`` holds only what the runner calls for an update: one
method per step, ``fence`` after a taint, and ``cancel``. Every method may
be called from a worker thread supervised by a deadline; ``cancel(step)`` is
called from *another* thread when that deadline expires and must make the
stuck call of ``step`` return (tear down a transfer group, close a
connection). The fake engine (``rolloutcore.testing.fake``) and the vLLM
vLLM port (``rolloutcore.engine.port``) are adapters like any other;
how an adapter is made and closed is its own business.

What an adapter *may* do beyond that is a capability of its own, a small
protocol the runner tests for with ``isinstance``:

* ``HealthObserver``: the engine seen between updates (answering, healthy,
  the same process as at bootstrap); ``LifecycleRunner.check_serving``
  watches an adapter that has it, and leaves one without it unwatched;
* ``Recoverer``: brings a tainted engine back on a replacement process;
  given to ``LifecycleRunner.recover`` beside the adapter;
* ``ExpectationTaker``: validates against expectations a trainer in another
  process computed (the policy probe from the tensors it sends, reference
  checksums, the transport's checksum of what it sent), the gateway's case;
* ``WriteObserver``: can tell from the engine's own counters whether any
  weight write happened since this update's drain, so that a lease that
  expires with nothing sent is not mistaken for a half-done transfer.
* ``Sleeper``: the engine can give its GPU memory back and take it again
  (colocated training on one GPU); ``LifecycleRunner.sleep``, ``wake`` and
  ``wake_update`` need it and refuse an adapter without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    DrainEvidence,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    SleepEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
    WakeEvidence,
    WakeTags,
)
from rolloutcore.core.lifecycle import Step
from rolloutcore.core.versions import WeightVersion

__all__ = ["ExpectationTaker", "HealthObserver", "LifecycleAdapter", "LoraCapability",
           "Recoverer", "Sleeper", "StreamChunk", "WriteObserver"]


class _Span(Protocol):
    @property
    def version(self) -> str: ...
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


class StreamChunk(Protocol):
    """One event of a streamed generation, as ``control.async_modes`` reads it
    (``engine.wire.GenerationChunk`` has this shape; control never imports it)."""

    @property
    def token_ids(self) -> tuple[int, ...]: ...
    @property
    def logprobs(self) -> tuple[float, ...] | None: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def weight_versions(self) -> Sequence[_Span] | None: ...
    @property
    def read_at(self) -> float: ...


@runtime_checkable
class LoraCapability(Protocol):
    """What the LoRA adapter manager (``control.adapters``) needs of an engine.

    List, load, unload, score (teacher-forced) and the sampling path's top
    logprobs; ``base_url`` names the engine for the adapter store. Structural:
    ``engine.http.VllmHTTP`` has it, and so do the tests' fakes; ``control``
    never imports the engine package for it.
    """

    base_url: str

    def models(self, *, timeout_s: float | None = None) -> dict[str, str | None]:
        """Every listed model name -> its parent (a LoRA adapter's base; None: a base)."""
        ...

    def load_lora_adapter(self, name: str, path: str, *,
                          timeout_s: float | None = None) -> None: ...

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None: ...

    def score(self, token_ids: Sequence[int], *, images: Sequence[str] = (),
              timeout_s: float | None = None, model: str | None = None
              ) -> list[float | None]: ...

    def top_logprobs(self, token_ids: Sequence[int], *, max_tokens: int, top: int,
                     model: str | None = None, timeout_s: float | None = None
                     ) -> list[tuple[int, dict[int, float]]]: ...


@runtime_checkable
class LifecycleAdapter(Protocol):
    """Effects on one engine, one per step. See the module docstring for the contract."""

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        """Caches this adapter can reset; the runner resets all of them."""
        ...

    def bootstrap(self) -> BootstrapEvidence:
        """``Step.BOOTSTRAP``: reach the engine and describe it (epoch, label, capabilities)."""
        ...

    def drain(self, mode: PauseMode, *, clear_cache: bool = False) -> DrainEvidence:
        """``Step.DRAIN``: pause the engine; with WAIT, return once its in-flight work is done."""
        ...

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        """``Step.PREFLIGHT``: describe the trainer's source before anything mutates."""
        ...

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        """``Step.TRANSFER``: move the weights, finishing with ``target``'s label."""
        ...

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        """``Step.INVALIDATE``: reset one cache and report the engine's own success flag."""
        ...

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        """``Step.VALIDATE``: observe what the engine serves. ``live=False``: still paused.

        ``live=True`` is called after resume with admission still closed; it
        returns ``None`` when the adapter has nothing that needs a running
        engine (then the paused validation alone decides).
        """
        ...

    def resume(self) -> ResumeEvidence:
        """``Step.RESUME``: resume the engine and confirm it is no longer paused."""
        ...

    def fence(self) -> None:
        """Best effort, after a taint: stop the engine from serving anyone."""
        ...

    def cancel(self, step: Step) -> None:
        """Called from another thread when ``step``'s effect overran: unblock it.

        The live validation is ``Step.VALIDATE``; the health observation and
        the fence, which act on the serving engine, are ``Step.SERVE``.
        """
        ...


@runtime_checkable
class HealthObserver(Protocol):
    """An adapter that can observe its engine between updates."""

    def observe_health(self, *, timeout_s: float) -> HealthEvidence:
        """Answering, healthy, and the process bootstrapped (``restarted`` when not).

        Never raises for an engine that is down: that is evidence
        (``answering=False``). Cancelled as ``Step.SERVE``.
        """
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


@runtime_checkable
class ExpectationTaker(Protocol):
    """An adapter that validates an update against what a remote trainer computed.

    ``expect`` is called once per update, after the begin was accepted and
    before the transfer (it replaces whatever the last update staged);
    ``expect_sent`` once the trainer reported its transport's checksum of
    what it sent. The adapter compares them in its own validation, while
    admission is still closed, exactly as with expectations staged in process.
    A takeover calls ``expect(..., calibrating=True)``: the probe is of the
    checkpoint the engine was started on, and the engine's own deviation from
    it may calibrate later updates' probe tolerance
    (``verification.probe.Calibration``).
    """

    def expect(self, *, probes: object,
               reference_checksums: Mapping[str, str] | None,
               calibrating: bool = False) -> None:
        ...

    def expect_sent(self, sent: Mapping[str, Any] | None) -> None:
        ...

    def check_sent(self, sent: Mapping[str, Any]) -> None:
        """``BadInput`` unless this adapter can compare ``sent`` (changes nothing): a
        report it cannot use is refused before the update leaves its lease."""
        ...


@runtime_checkable
class WriteObserver(Protocol):
    """An adapter that can prove the weights were not written since this update's drain."""

    def writes_since_drain(self, *, timeout_s: float) -> tuple[str, ...] | None:
        """What wrote weights since the drain, in words (``()``: nothing, proven by the
        engine's own counters); ``None`` when it cannot tell."""
        ...


@runtime_checkable
class Sleeper(Protocol):
    """An adapter whose engine sleeps while a trainer uses its GPU memory.

    While the engine sleeps (from ``sleep`` until a wake of the weights) the
    adapter refuses ``transfer``, ``drain`` and ``reset_cache`` itself, before
    any engine call, with an ``EffectError`` of ``mutation_started=False``:
    weights sent to a sleeping engine land in released memory. After a wake
    its paused ``validate`` covers every engine parameter: against what the
    transfer sent when one ran since the sleep, against the checksums taken
    before the sleep (``reference``) when none did (a restore).
    """

    def sleep(self, level: int, *, reference: bool) -> SleepEvidence:
        """``Step.SLEEP``: put the engine to sleep at ``level`` (1 or 2); ``reference``:
        hash every parameter first, for a later wake on the same weights.

        Raises with ``mutation_started=False`` when it can prove the engine was
        not touched (the engine has no sleep mode, say).
        """
        ...

    def wake(self, tags: WakeTags) -> WakeEvidence:
        """``Step.WAKE``: bring back ``tags``, and leave the engine's scheduler paused
        (re-pausing it where the engine resumed it on its own)."""
        ...
