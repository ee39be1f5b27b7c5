"""The vLLM adapter's sleep mode: colocated training on one GPU (``control.port.Sleeper``).

``VllmAdapter`` takes these methods from ``SleepMode``. The rules they keep:

* **Only an engine with sleep mode sleeps.** ``enable_sleep_mode`` is read
  from ``/server_info``; vLLM's CPU build has none (``--enable-sleep-mode``
  stops it at start; without the flag its worker ignores ``/sleep`` and keeps
  every byte while the engine reports asleep), so the sleep is refused before
  any call, with ``mutation_started=False``. A ``/sleep`` the engine answers
  4xx also left it untouched; anything else leaves its memory unknown.
* **Nothing reaches a sleeping engine but the wake.** Until the weights are
  woken, a transfer, a drain or a cache reset (until the KV cache is woken)
  is refused here, before any call: vLLM writes weights sent to a sleeping
  engine into released memory and its core crashes (vLLM #57853).
* **A woken engine stays paused.** vLLM resumes its scheduler once fully
  awake (0.32) or on any wake (older releases, vLLM #44395); the wake pauses
  it again at once and says so.
* **After a wake, every parameter is checked.** With a transfer since the
  sleep, the transport's check restated over the engine's whole parameter
  list (``SleepAwareTransport.engine_parameter_check``); without one (a
  restore), every parameter's checksum against those taken before the
  sleep. The workers also drop what the sleep made stale
  (``after_wake``) and report the device memory (``engine_memory``): vLLM
  itself reports none over HTTP (0.26, 0.32), only in its worker's log.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from rolloutcore.core.evidence import (
    SLEEP_LEVELS,
    Check,
    PauseMode,
    SleepEvidence,
    ValidationEvidence,
    WakeEvidence,
    WakeTags,
)
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.errors import BadInput, EffectError, EngineRefused, RolloutCoreError
from rolloutcore.transports.base import WeightTransport
from rolloutcore.verification.checksums import compare

__all__ = ["SleepAwareTransport", "SleepMode"]


@runtime_checkable
class SleepAwareTransport(Protocol):
    """A transport with engine-side state a sleep can leave stale, and a view of the workers.

    rc_cuda_ipc's worker half keeps mapped buffers, copy plans and a checksum
    prefetched at the last update: ``after_wake`` has the workers drop what a
    wake may have made stale; ``param_checksums`` hashes every engine
    parameter now (never a prefetched value); ``engine_memory`` is the
    device memory as the workers see it; ``engine_parameter_check`` is the
    last validation's checksum check restated over the engine's whole
    parameter list (``None`` before one ran).
    """

    def after_wake(self, base_url: str) -> Mapping[str, Any]:
        ...

    def param_checksums(self, base_url: str) -> Mapping[str, int]:
        ...

    def engine_memory(self, base_url: str) -> Mapping[str, Any]:
        ...

    def engine_parameter_check(self) -> Check | None:
        ...


class SleepMode:
    """The sleep-mode half of ``VllmAdapter`` (see the module docstring).

    It keeps the sleep this adapter put the engine in, until the engine
    serves again (``forget_sleep``, called by the resume): the level, the
    pools woken since, whether a transfer wrote the weights since, and the
    per-parameter checksums taken before it (for a wake on the same weights).
    """

    http: VllmHTTP
    transport: WeightTransport | None
    _sleep_mode: bool | None
    _drain_timeout_s: float
    _connected: bool
    #: read the workers' memory around sleep and wake (one RPC each, when the
    #: transport can); off: the evidence carries no memory
    report_memory: bool

    def _init_sleep_mode(self) -> None:
        self._slept: int | None = None
        self._woken: set[str] = set()
        self._wrote = False
        self._reference: Mapping[str, Any] | None = None
        self.report_memory = True

    def forget_sleep(self) -> None:
        """The engine serves again (resumed or replaced): no sleep of ours is in progress."""
        self._slept, self._woken, self._wrote, self._reference = None, set(), False, None

    @property
    def asleep(self) -> int | None:
        """The level of the sleep this adapter put the engine in (None: not asleep)."""
        return self._slept

    def _refuse_asleep(self, step: str, what: str, pool: str = "weights") -> None:
        if self._slept is not None and pool not in self._woken:
            raise EngineRefused(step, f"the engine is asleep ({pool} released): {what} was "
                                f"refused before reaching it", status=409,
                                mutation_started=False)

    def _memory(self) -> dict[str, Any]:
        tr = self.transport
        if not self.report_memory or not isinstance(tr, SleepAwareTransport):
            return {}
        try:
            return {**tr.engine_memory(self.http.base_url)}
        except RolloutCoreError:
            return {}  # a report, not a step: its absence is in the evidence

    def _param_checksums(self) -> tuple[Mapping[str, Any], str] | None:
        """Every engine parameter hashed now: (name -> value, how), or None if it cannot be."""
        tr, h = self.transport, self.http
        if isinstance(tr, SleepAwareTransport):
            return dict(tr.param_checksums(h.base_url)), "workers' block checksum"
        if Routes.WEIGHT_CHECKER in h.capabilities():
            return dict(h.weight_checksums().digests), "/weight_checker sha256"
        return None

    def sleep(self, level: int, *, reference: bool) -> SleepEvidence:
        """``/sleep?level=N&mode=wait`` (after the checksums of ``reference``), then read
        ``/is_sleeping`` and ``/is_paused``. Refused before any call on an engine
        without sleep mode."""
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise BadInput(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if not isinstance(reference, bool):
            raise BadInput("reference must be a bool")
        t0 = time.monotonic()
        h = self.http
        caps = h.capabilities()
        if self._sleep_mode is None and Routes.SERVER_INFO in caps:
            mc = (h.server_info().get("vllm_config") or {}).get("model_config")
            sm = mc.get("enable_sleep_mode") if isinstance(mc, dict) else None
            self._sleep_mode = sm if isinstance(sm, bool) else None
        if self._sleep_mode is False:
            raise EngineRefused(
                "sleep", "the engine was started without --enable-sleep-mode (and vLLM's CPU "
                "build has no sleep mode: its worker ignores /sleep, keeps every byte, and "
                "the engine reports asleep): nothing was sent", status=409,
                mutation_started=False)
        if Routes.SLEEP not in caps or Routes.WAKE_UP not in caps:
            raise EngineRefused("sleep", "the engine offers no /sleep and /wake_up (start it "
                                "with VLLM_SERVER_DEV_MODE=1): nothing was sent", status=404,
                                mutation_started=False)
        if self._slept is not None:
            raise EngineRefused("sleep", f"the engine is already asleep (level {self._slept})",
                                status=409, mutation_started=False)
        unverified: list[str] = []
        if self._sleep_mode is None:
            unverified.append("sleep mode not confirmed by /server_info")
        before = self._memory()
        ref: Mapping[str, Any] | None = None
        if reference:
            try:
                got = self._param_checksums()
            except RolloutCoreError as exc:
                raise EffectError("sleep", f"checksums before the sleep failed: {exc}",
                                  mutation_started=False) from exc
            if got is None:
                unverified.append("no way to hash the engine's parameters: a wake on the "
                                  "same weights cannot be verified")
            else:
                ref = got[0]
        try:
            h.sleep(level, mode=PauseMode.WAIT, timeout_s=self._drain_timeout_s)
        except EngineRefused as exc:
            exc.mutation_started = False  # a 4xx: the engine refused before acting
            raise
        self._slept, self._woken, self._wrote, self._reference = level, set(), False, ref
        sleeping = h.is_sleeping() if Routes.IS_SLEEPING in caps else None
        paused = h.is_paused() if Routes.IS_PAUSED in caps else None
        after = self._memory()
        if not before:
            unverified.append("the engine reports no memory (no rc_cuda_ipc workers)")
        return SleepEvidence(level=level, is_sleeping_after=sleeping, paused_after=paused,
                             memory_before=before, memory_after=after,
                             reference_params=0 if ref is None else len(ref),
                             elapsed_s=time.monotonic() - t0, unverified=tuple(unverified))

    def wake(self, tags: WakeTags) -> WakeEvidence:
        """``/wake_up`` for ``tags``; re-pause a scheduler the engine resumed on its own.

        vLLM resumes its scheduler once everything is awake (0.32) or on any
        wake (older releases): either way the adapter pauses it again at once,
        so that nothing runs on weights not yet verified.
        """
        if not isinstance(tags, WakeTags):
            raise BadInput(f"tags must be WakeTags, got {tags!r}")
        t0 = time.monotonic()
        h = self.http
        caps = h.capabilities()
        unverified: list[str] = []
        if self._slept is None:
            unverified.append("this adapter did not put the engine to sleep")
        said = h.wake_up(None if tags is WakeTags.ALL else [tags.value])
        self._woken |= ({"weights", "kv_cache"} if tags is WakeTags.ALL else {tags.value})
        fully = said
        if fully is None and Routes.IS_SLEEPING in caps:
            fully = not h.is_sleeping()  # before any re-pause: is_sleeping counts pauses
        paused = h.is_paused() if Routes.IS_PAUSED in caps else None
        repaused = False
        if paused is False:
            said_paused = h.pause(PauseMode.WAIT, clear_cache=False,
                                  timeout_s=self._drain_timeout_s)
            paused, repaused = said_paused or h.is_paused(), True
            unverified.append("the engine resumed its scheduler on waking and was paused "
                              "again: a request sent to the engine directly, past "
                              "RolloutCore, could have started in between")
        detail = ""
        tr = self.transport
        if tags is not WakeTags.KV_CACHE and isinstance(tr, SleepAwareTransport) \
                and self._connected:
            try:
                tr.after_wake(h.base_url)
            except RolloutCoreError as exc:
                detail = f"the workers could not drop state the sleep made stale: {exc}"
        return WakeEvidence(tags=tags, fully_awake=fully, paused_after=paused,
                            repaused=repaused, memory_after=self._memory(), detail=detail,
                            elapsed_s=time.monotonic() - t0, unverified=tuple(unverified))

    def _validate_restore(self, t0: float) -> ValidationEvidence:
        """A wake with no transfer since the sleep: every parameter against its checksum
        from before the sleep (the engine's whole parameter list is the denominator)."""
        h = self.http
        wi = h.weight_info()
        unverified: list[str] = []
        ref = self._reference
        if ref is None:
            chk = Check("engine-parameters", False, "no checksums were taken before the "
                        "sleep (a level-2 sleep discards the weights): a wake on the same "
                        "weights cannot be verified", coverage=0.0,
                        level=VerificationLevel.ENGINE_CHECKSUM)
        else:
            got = self._param_checksums()
            assert got is not None  # the same way the reference was taken
            report = compare(dict(sorted(got[0].items())), dict(sorted(ref.items())),
                             keyed_by="name")
            chk = dataclasses.replace(
                report.to_check("engine-parameters"),
                detail=f"{got[1]} after the wake vs before the sleep: {report.detail()}")
        paused = h.is_paused() if Routes.IS_PAUSED in h.capabilities() else None
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        return ValidationEvidence(wi.label, wi.label_supported, paused=paused, checks=(chk,),
                                  elapsed_s=time.monotonic() - t0,
                                  unverified=tuple(unverified))
