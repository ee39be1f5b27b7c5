"""``VllmAdapter``: the lifecycle port over one vLLM server (``VllmHTTP``) and a transport.

It performs each step's effects and returns evidence; whether an effect
*worked* is the controller's call, from that evidence. What the engine does
not offer (vLLM 0.26: no ``/weight_info``, no ``/weight_checker``, no
per-token ``weight_versions``) is stated in ``Evidence.unverified``, never
assumed.

The failure policy's one input from an adapter is whether a failed step may
have changed the engine's weights (``EffectError.mutation_started``). The
HTTP client cannot know; each step does, and says it once, in
``STEP_MAY_MUTATE``: a step declared ``False`` can prove the weights are
untouched, so whatever it raises says so. A transfer may mutate once it has
sent anything; what it refuses before sending says ``False`` where it is
raised.

Sleep mode (colocated training, ``control.port.Sleeper``): the adapter puts
the engine to sleep only where it was started with ``--enable-sleep-mode``
(read from ``/server_info`` at bootstrap; vLLM's CPU build has no sleep
mode: its worker ignores ``/sleep`` and keeps every byte while the engine
reports asleep), and until the weights are woken it refuses a transfer, a
drain or a cache reset itself, before any call. After a wake the paused
validation covers every engine parameter, against what the update sent or,
when nothing was sent since the sleep, against the checksums taken before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from types import MappingProxyType
from typing import Any

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    Check,
    DrainEvidence,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.lifecycle import Step
from rolloutcore.core.versions import Provenance
from rolloutcore.engine import state as engine_state
from rolloutcore.engine.expected import CheckingTransport, ProbeSet, Staged, expectations
from rolloutcore.engine.http import CACHE_ROUTES, Routes, VllmHTTP, check_timeout
from rolloutcore.engine.sent import check_sent_scheme, compare_sent
from rolloutcore.engine.sleep import SleepAwareTransport, SleepMode
from rolloutcore.engine.state import (
    COUNTS_WEIGHT_OPS_FROM,
    checkpoint_check,
    incomplete_update_check,
    version_tuple,
)
from rolloutcore.engine.write_counts import WriteCounts
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EngineUnavailable,
    RolloutCoreError,
    TransferError,
)
from rolloutcore.transports import drafted
from rolloutcore.transports.base import WeightTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import compare_checksums
from rolloutcore.verification.probe import Calibration, takes_calibration

__all__ = [
    "STEP_MAY_MUTATE",
    "CheckingTransport",
    "ProbeSet",
    "VllmAdapter",
]

#: Whether a failure inside each of the adapter's steps may have changed the
#: engine's weights. ``False`` is a proof, so only steps that move no weights
#: and run before this update's transfer say it.
STEP_MAY_MUTATE: Mapping[Step, bool] = MappingProxyType({
    Step.BOOTSTRAP: False,   # reads, and the transport's handshake: no weights move
    Step.DRAIN: False,       # /pause and reads, before this update's transfer
    Step.PREFLIGHT: False,   # compares the staged source; no engine call
    Step.TRANSFER: True,     # once sent (refusals before the send say False themselves)
    Step.INVALIDATE: True,   # after the transfer: the weights there may be new
    Step.VALIDATE: True,
    Step.RESUME: True,
    Step.SERVE: False,       # observe_health, between updates: reads only
    Step.SLEEP: True,        # once /sleep is sent (refusals before it say False themselves)
    Step.WAKE: True,
})


#: The caches that hold only what multimodal inputs put there.
_MM_CACHES = frozenset((CacheKind.ENCODER, CacheKind.MULTIMODAL))


def _no_mm_caches(vllm_config: Mapping[str, Any]) -> str:
    """Why an engine has neither an encoder nor a multimodal cache, from its
    ``/server_info`` ``vllm_config``; "" unless that config says so itself.

    vLLM builds a multimodal config exactly for the models that take multimodal
    input (text-only encoder-decoder models included: vLLM implements them as
    multimodal), and sizes the encoder cache and the multimodal caches from it: a
    ``multimodal_config`` of null means both hold nothing, ever, on this process.
    An engine that does not say (the key missing, an older vLLM), or one with an
    encoder-cache connector (``ec_transfer_config``), keeps both resets.
    """
    mc = vllm_config.get("model_config")
    if not isinstance(mc, dict) or "multimodal_config" not in mc or \
            mc["multimodal_config"] is not None or vllm_config.get("ec_transfer_config"):
        return ""
    return ("the model takes no multimodal input (/server_info: model_config."
            "multimodal_config is null, no ec_transfer_config): vLLM keeps no encoder "
            "or multimodal cache for it")


@contextlib.contextmanager
def _step(step: Step) -> Iterator[None]:
    """Apply ``STEP_MAY_MUTATE[step]`` to what the step raises (also a decorator)."""
    try:
        yield
    except EffectError as exc:
        if not STEP_MAY_MUTATE[step]:
            exc.mutation_started = False
        raise


class VllmAdapter(SleepMode, WriteCounts):
    """``LifecycleAdapter`` for one vLLM server: ``VllmHTTP`` + a weight transport.

    The trainer side calls ``stage(source, ...)`` before each update; the
    runner then drives ``drain -> preflight -> transfer -> reset_cache ->
    validate -> resume -> validate(live=True)``. ``engine_epoch`` should come
    from the launcher (``ManagedEngine.epoch``); without it the adapter derives
    one from the engine's ``instance_id`` (new on every process start).
    """

    def __init__(self, http: VllmHTTP, transport: WeightTransport | None = None, *,
                 engine_epoch: str | None = None, probes: ProbeSet | None = None,
                 drain_timeout_s: float = 120.0, transfer_timeout_s: float = 300.0,
                 connect_timeout_s: float = 120.0, early_transport_check: bool = True) -> None:
        if not isinstance(http, VllmHTTP):
            raise BadInput("http must be a VllmHTTP")
        if engine_epoch is not None and (not isinstance(engine_epoch, str) or not engine_epoch):
            raise BadInput("engine_epoch must be a non-empty string or None")
        self.http = http
        self.transport = transport
        self.probes = expectations(probes, None)[1]
        self._epoch = engine_epoch
        self._drain_timeout_s = check_timeout(drain_timeout_s, "drain_timeout_s")
        self._transfer_timeout_s = check_timeout(transfer_timeout_s, "transfer_timeout_s")
        self._connect_timeout_s = check_timeout(connect_timeout_s, "connect_timeout_s")
        self._staged: Staged | None = None
        self._connected = False
        self._caches: tuple[CacheKind, ...] = tuple(CacheKind)
        self._sleeping_at_drain: bool | None = None
        # The engine's enable_sleep_mode, read at bootstrap (None: not known).
        self._sleep_mode: bool | None = None
        #: The engine's speculative draft with weights (``drafted.engine_draft``), read at
        #: bootstrap: updates that do not carry the draft are refused at preflight.
        self.draft_method: str | None = None
        self._side_pool: ThreadPoolExecutor | None = None
        if not isinstance(early_transport_check, bool):
            raise BadInput("early_transport_check must be a boolean")
        # The transport's own check of what it installed, started as soon as the
        # transfer returns (see ``transfer``) and collected by the paused validation.
        self.early_transport_check = early_transport_check
        self._early: tuple[UpdateTarget, Future[Check], Future[bool] | None] | None = None
        # The same for a remote trainer's sent checksum (``expect_sent``).
        #: What the last ``check_sent`` passed (``expect_sent`` does not check it again).
        self._sent_checked: Mapping[str, Any] | None = None
        self._early_sent: tuple[Mapping[str, Any], Future[Check], Future[bool] | None] | None \
            = None
        #: The per-rank comparison of the last report's rank declaration
        #: (``rolloutcore_gloo/rank``, ``sent.compare_rank_reports``), for the status.
        self.last_rank_result: dict[str, Any] | None = None
        #: Checks the caller made of this round's writes (``add_round_check``).
        self._round_checks: tuple[Check, ...] = ()
        # vLLM's instance_id at bootstrap (None: the engine does not say); a
        # different one later means the engine process was replaced behind us.
        self._instance_id: str | None = None
        # The engine's weight-operation counters (``engine.write_counts``).
        self._init_write_counts()
        # Why the engine has no encoder and no multimodal cache, read at bootstrap from
        # its own config ("": it may have them, so they are reset).
        self._mm_absent = ""
        # The update's cache resets sent beside its first one (``reset_cache``).
        self._resets_ahead: dict[CacheKind, Future[CacheResetEvidence]] | None = None
        self._version: tuple[int, ...] = ()  # the engine's vLLM (major, minor, patch)
        #: The probe tolerance calibrated on this engine (``verification.probe.Calibration``,
        #: by probe kind): set by a passing takeover probe (``expect(calibrating=True)``),
        #: used by every later update's probe. The model and the engine's kernels set the
        #: noise, not the process: a recovered engine keeps it (``calibrations`` copied).
        self.calibrations: dict[str, Calibration] = {}
        self._init_sleep_mode()

    @classmethod
    def for_engine(cls, engine: Any, transport: WeightTransport | None = None, *,
                   timeout_s: float = 30.0, **kw: Any) -> VllmAdapter:
        """An adapter for a launcher's engine (anything with ``base_url`` and ``epoch``)."""
        return cls(VllmHTTP(engine.base_url, timeout_s=timeout_s), transport,
                   engine_epoch=str(engine.epoch), **kw)

    # -- trainer side -------------------------------------------------------

    def stage(self, source: WeightSource, *, provenance: Provenance | None = None,
              reference_checksums: Mapping[str, str] | None = None,
              probes: ProbeSet | None = None) -> None:
        """Set what the next transfer sends, and what the next validation compares with.

        ``source`` is a ``rolloutcore.transports.source.WeightSource``; ``reference_checksums``
        are ``/weight_checker``-style sha256 digests of the target's engine
        parameters; ``probes`` override the adapter's default probe set.
        """
        if not isinstance(source, WeightSource):
            raise BadInput(f"source must be a WeightSource, got {type(source).__name__} "
                           "(WeightSource.of() takes a module, a state dict or a checkpoint)")
        if provenance is not None and not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance or None")
        self._staged = Staged(source, provenance, *expectations(probes, reference_checksums),
                               source.manifest().digest)

    @property
    def staged(self) -> WeightSource | None:
        return None if self._staged is None else self._staged.source

    def expect(self, *, probes: ProbeSet | None,
               reference_checksums: Mapping[str, str] | None,
               calibrating: bool = False) -> None:
        """A remote trainer's expectations for the next validation (``ExpectationTaker``).

        The trainer sends the weights itself, so nothing is staged to send;
        what it computed from the very tensors it sends (the probe, reference
        checksums) is compared here, by this adapter, while paused and then
        with admission still closed, as for a staged source. ``calibrating``:
        the probe is of the checkpoint the engine was started on (a takeover);
        its deviation, if the probe passes, calibrates later updates' probes.
        """
        if not isinstance(calibrating, bool):
            raise BadInput("calibrating must be a bool")
        self._staged = Staged(None, None, *expectations(probes, reference_checksums), "",
                               calibrating=calibrating)
        self._round_checks = ()

    def add_round_check(self, check: Check) -> None:
        """A check the caller made of this round's writes, reported with the next paused
        validation (cleared by ``expect``). The native routes' check that every
        parameter was written exactly once: on a vLLM with no label (0.26) and no
        reference it is the only check a round has, and a validation with none is
        refused ("no evidence at all")."""
        if not isinstance(check, Check):
            raise BadInput(f"check must be a Check, got {type(check).__name__}")
        self._round_checks += (check,)

    def _record_ranks(self, result: dict[str, Any]) -> None:
        self.last_rank_result = result

    def check_sent(self, sent: Mapping[str, Any]) -> None:
        """``BadInput`` unless ``sent`` is a scheme this adapter compares, well formed."""
        check_sent_scheme(sent)
        self._sent_checked = sent

    def expect_sent(self, sent: Mapping[str, Any] | None) -> None:
        """The remote transport's checksum of what it sent (compared in ``validate``); the
        object the last ``check_sent`` passed (the gateway's report) is not checked twice."""
        checked, self._sent_checked = self._sent_checked, None
        if sent is not None and sent is not checked:
            check_sent_scheme(sent)
        if self._staged is None:
            self._staged = Staged(None, None, None, None, "")
        self._staged.sent = None if sent is None else dict(sent)
        self._early_sent = None
        self.last_rank_result = None
        if self._staged.sent is not None and self.early_transport_check:
            # Reported once the remote transfer finished; the engine stays paused until
            # the runner resumes it after the validation. The workers' hash of what
            # the update wrote is read now, overlapping the cache reset (which does
            # not touch weights), as the in-process path's early check is; the
            # validation collects it, for this report only.
            st_sent = self._staged.sent
            check = self._side().submit(compare_sent, self.http, st_sent,
                                        record=self._record_ranks)
            self._early_sent = (st_sent, check, self._paused_ahead())

    def _paused_ahead(self) -> Future[bool] | None:
        """The paused state, read now beside an early check (None while the KV cache
        still sleeps: vLLM resumes its scheduler when it wakes, and the wake pauses it
        again, so the validation reads the state after that)."""
        kv_asleep = self._slept is not None and "kv_cache" not in self._woken
        if Routes.IS_PAUSED not in self.http.capabilities() or kv_asleep or self._state_route:
            return None
        return self._side().submit(self.http.is_paused)

    # -- port ---------------------------------------------------------------

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        """Caches with a reset route (all three until ``bootstrap`` has read the routes)."""
        return self._caches

    @_step(Step.BOOTSTRAP)
    def bootstrap(self) -> BootstrapEvidence:
        t0 = time.monotonic()
        h = self.http
        unverified: list[str] = []
        healthy = h.health()
        if not healthy:
            # The API server answers but its engine is dead: describe nothing more.
            return BootstrapEvidence(self._epoch or f"vllm-dead-{uuid.uuid4().hex[:12]}",
                                     False, elapsed_s=time.monotonic() - t0,
                                     unverified=("engine unhealthy: not described",))
        caps = h.capabilities(refresh=True)
        self._caches = tuple(k for k in CacheKind if CACHE_ROUTES[k] in caps)
        info: dict[str, Any] = {"base_url": h.base_url, "model": h.model()}
        info["vllm_version"] = h.version() if Routes.VERSION in caps else None
        instance_id = None
        self._mm_absent = ""
        if Routes.SERVER_INFO in caps:
            si = h.server_info()
            cfg = si.get("vllm_config")
            if isinstance(cfg, dict):
                instance_id = cfg.get("instance_id")
                wt = cfg.get("weight_transfer_config")
                info["weight_transfer_config"] = wt
                mc = cfg.get("model_config")
                sleep = mc.get("enable_sleep_mode") if isinstance(mc, dict) else None
                self._mm_absent = info["mm_caches_absent"] = _no_mm_caches(cfg)
                self._sleep_mode = sleep if isinstance(sleep, bool) else None
                info["enable_sleep_mode"] = self._sleep_mode
                self.draft_method = info["speculative_method"] = drafted.engine_draft(cfg)
        info["instance_id"] = instance_id
        self._instance_id = instance_id if isinstance(instance_id, str) and instance_id else None
        epoch = self._epoch
        if epoch is None:
            if instance_id:
                epoch = f"vllm-{instance_id}"
            else:
                epoch = f"vllm-unidentified-{uuid.uuid4().hex[:12]}"
                unverified.append("engine incarnation not identifiable (no instance_id): "
                                  "epoch is local to this adapter")
            self._epoch = epoch
        wi = h.weight_info()
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        if Routes.WEIGHT_CHECKER not in caps:
            unverified.append("no /weight_checker: engine checksums not available")
        if Routes.GENERATE not in caps:
            unverified.append("no /inference/v1/generate: per-token weight versions not seen")
        missing = [k.value for k in CacheKind if k not in self._caches]
        if missing:
            unverified.append(f"cache reset routes absent: {', '.join(missing)}")
        if Routes.IS_PAUSED in caps:
            info["paused"] = h.is_paused()
        self._version = version_tuple(info.get("vllm_version"))
        self._counts_ops = Routes.METRICS in caps and self._version >= COUNTS_WEIGHT_OPS_FROM
        ops = self._weight_ops()
        if ops is not None:
            info["awake"] = ops.awake
            info["weight_ops"] = dict(ops.done)
        self._ops_verified = ops
        self._probe_state_route(caps)
        if self.transport is not None:
            wt = info.get("weight_transfer_config")
            engine_backend = wt.get("backend") if isinstance(wt, dict) else None
            if Routes.SERVER_INFO in caps and engine_backend != self.transport.backend:
                # Connecting would block on a handshake the engine never joins.
                raise EngineUnavailable(
                    "bootstrap", f"engine weight-transfer backend is {engine_backend!r}, "
                    f"the transport is {self.transport.backend!r} (start the engine with "
                    f"--weight-transfer-config {json.dumps(self.transport.engine_config())})")
            self._ensure_connected(self.transport, EngineUnavailable, "bootstrap")
            info["transport"] = self.transport.backend
        return BootstrapEvidence(epoch, healthy, wi.label, wi.label_supported, caps, info,
                                 elapsed_s=time.monotonic() - t0, unverified=tuple(unverified))

    def _ensure_connected(self, transport: WeightTransport,
                          error: type[EngineUnavailable | TransferError], step: str) -> None:
        """The transport's init handshake (no weights change), once per engine."""
        if self._connected:
            return
        try:
            transport.connect(self.http.base_url, timeout_s=self._connect_timeout_s)
        except RolloutCoreError:
            raise
        except Exception as exc:
            raise error(step, f"transport connect failed: {exc!r}",
                        mutation_started=False) from exc
        self._connected = True

    @_step(Step.DRAIN)
    def drain(self, mode: PauseMode, *, clear_cache: bool = False) -> DrainEvidence:
        """``/pause?mode=...&clear_cache=false`` then ``/is_paused``.

        The cache is not cleared here: invalidation is its own step, after the
        transfer, with its own evidence. Only the ``engine_recompute`` mode asks
        for ``clear_cache=true`` with ``keep``: vLLM then preempts the frozen
        requests (their KV freed), which is what makes it recompute them under
        the new weights on resume; the reset step after the transfer still runs.
        """
        if not isinstance(mode, PauseMode):
            raise BadInput(f"mode must be a PauseMode, got {mode!r}")
        if clear_cache is True and mode is PauseMode.KEEP and \
                Routes.WEIGHT_INFO not in self.http.capabilities():
            # vLLM 0.26's keep ignores clear_cache: the frozen requests would resume over
            # KV of the old weights. Refused before the pause (fail closed).
            raise EffectError("drain", "this engine (no /weight_info: older than vLLM 0.32) "
                              "ignores clear_cache with pause mode keep; engine_recompute "
                              "needs vLLM 0.32's keep-with-recompute", mutation_started=False)
        self._refuse_asleep("drain", "a drain for an update")
        t0 = time.monotonic()
        self._drained, self._ops_closing, self._resets_ahead = True, None, None
        self._sleeping_at_drain = self._sleep_state()
        self._ops_at_drain = None
        # The engine's weight-operation counters at the drain: a later read that differs
        # means somebody wrote (``writes_since_drain``). Those it had counted when its
        # weights were last verified (``_ops_verified``: the bootstrap's, the last
        # validation's) where there are some, else read beside the pause (no grant
        # exists yet, so nothing writes in between). No more writes can be missed from
        # the verified baseline than from a read now: whatever wrote since (out of band,
        # a restart) differs from it too, and a round that sent nothing is clean only
        # when nothing changed the weights since they were verified (``write_counts``).
        base = self._ops_verified if self._counts_ops else None
        ops = self._side().submit(self._weight_ops) if self._counts_ops and base is None \
            else None
        said = engine_state.pause(self.http, mode, clear_cache=clear_cache is True,
                                  timeout_s=self._drain_timeout_s)
        # The answer is sent once the engine core has paused; only an answer
        # that does not say so costs a second round trip to ask.
        paused = said or self.http.is_paused()
        if base is not None:
            self._ops_at_drain = base
        elif ops is not None:
            try:
                self._ops_at_drain = ops.result()
            except RolloutCoreError:
                self._ops_at_drain = None  # then writes_since_drain cannot tell
        return DrainEvidence(paused, mode, cleared=bool(said) and clear_cache is True,
                             elapsed_s=time.monotonic() - t0,
                             unverified=("engine in-flight count not observed "
                                         "(the pause call's return is the drain signal)",))

    def _sleep_state(self) -> bool | None:
        """Whether the engine's weights are asleep; ``None`` when it cannot be told.

        vLLM's ``/is_sleeping`` is true when the engine sleeps *or* is paused,
        so it is read before the drain's pause, and a paused engine is unknown.
        (An update into sleeping weights writes to freed memory: vLLM #57853.)
        """
        h = self.http
        if self._sleep_mode is False:
            return False  # started without sleep mode: its weights cannot be put to sleep
        if Routes.IS_SLEEPING not in h.capabilities():
            return None
        if not h.is_sleeping():
            return False
        if Routes.IS_PAUSED in h.capabilities() and \
                not h.is_paused():
            return True
        return None

    @_step(Step.PREFLIGHT)
    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        """Compare the staged source with the target's identity. Mutates nothing."""
        t0 = time.monotonic()
        if not isinstance(target, UpdateTarget):
            raise BadInput("target must be an UpdateTarget")
        unverified = ["engine parameter manifest not compared "
                      "(vLLM fuses and renames parameters)"]
        st = self._staged
        if st is None:
            return PreflightEvidence("", None, detail="no weight source staged for this update",
                                     elapsed_s=time.monotonic() - t0,
                                     unverified=tuple(unverified))
        if st.source is None:
            return PreflightEvidence("", None, detail="a remote trainer sends this update: "
                                     "its preflight comes with its begin",
                                     elapsed_s=time.monotonic() - t0,
                                     unverified=tuple(unverified))
        details = []
        if self.draft_method is not None and not isinstance(st.source, drafted.DraftedSource):
            details.append(drafted.engine_draft_refusal(self.draft_method))
        want_content = target.identity.content_digest
        if want_content is not None:
            got = st.source.content_digest()
            if got != want_content:
                details.append(f"source content digest {got[:12]} differs from the "
                               f"target's {want_content[:12]}")
        else:
            unverified.append("target declares no content digest: source content not checked")
        if st.provenance is None:
            unverified.append("no provenance staged with the source: provenance not compared")
        if self._sleeping_at_drain is True:
            details.append("engine was asleep when drained: weights cannot be updated")
        elif self._sleeping_at_drain is None:
            unverified.append("engine sleep state unknown (vLLM's is_sleeping also reports "
                              "a pause): not checked")
        return PreflightEvidence(st.manifest_digest, st.provenance, None,
                                 detail="; ".join(details), elapsed_s=time.monotonic() - t0,
                                 unverified=tuple(unverified))

    @_step(Step.TRANSFER)
    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        st = self._staged
        if st is None or st.source is None or self.transport is None:
            raise TransferError("transfer", "no weight source staged" if self.transport
                                else "no weight transport", mutation_started=False)
        if self._slept is not None and "weights" not in self._woken:
            raise TransferError("transfer", "the engine is asleep (its weights are released): "
                                "nothing was sent (vLLM #57853)", mutation_started=False)
        self._ensure_connected(self.transport, TransferError, "transfer")
        self._wrote = self._wrote or self._slept is not None
        self._early = None
        try:
            ev = self.transport.send(self.http.base_url, target.version.label,
                                     st.source, timeout_s=self._transfer_timeout_s)
        except RolloutCoreError:
            raise
        except Exception as exc:
            raise TransferError("transfer", f"{type(exc).__name__}: {exc}",
                                mutation_started=True) from exc
        # The update session is over and the engine stays paused until the runner
        # resumes it, after the validation: the transport's check of what it
        # installed (a read of the parameters on the workers) can start now and
        # overlap the cache reset, which does not touch weights. The validation
        # collects it, for this target only.
        # The paused state is read then too (``_paused_ahead``: the engine stays paused
        # until the runner resumes it after the validation, so a read from here on is
        # inside the same paused window as one taken during the validation).
        tr = self.transport
        if self.early_transport_check and isinstance(tr, CheckingTransport):
            check = self._side().submit(tr.validation_check, self.http.base_url)
            self._early = (target, check, self._paused_ahead())
        return ev

    def _absent(self, cache: CacheKind) -> str:
        """Why the engine has no ``cache`` (read at bootstrap), or "" when it may."""
        return self._mm_absent if cache in _MM_CACHES else ""

    @_step(Step.INVALIDATE)
    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        self._refuse_asleep("invalidate", "a cache reset", "kv_cache")
        absent = self._absent(cache)
        if absent:
            # Nothing to reset and nothing sent: the evidence says why, from the
            # engine's own config, and the controller accepts only that for a cache
            # that may not hold anything (never the prefix cache).
            self._read_counts_at_reset(sends=False)
            return CacheResetEvidence(cache, None, None, absent=absent,
                                      detail="not reset: the engine has no such cache")
        ahead = self._resets_ahead
        if ahead is not None and cache in ahead:
            return ahead.pop(cache).result()
        if self._drained and ahead is None:
            # The update's first reset: the caches after it in the runner's order go
            # beside it. They are independent stores, the engine is paused and the
            # update's writes are over, so their order proves nothing; each answers the
            # runner's own call for it, checked by its body as before. The prefix
            # cache comes first and is never reset ahead (keep mode defers it).
            later = tuple(k for k in self._caches[self._caches.index(cache) + 1:]
                          if not self._absent(k)) if cache in self._caches else ()
            self._resets_ahead = {k: self._side().submit(self.http.reset_cache, k)
                                  for k in later}
        # The validation's counters, beside the resets (sent after them: vLLM renders
        # /metrics on its API server's loop while the resets wait on the engine core).
        return self.http.reset_cache(cache, mark=self._read_counts_at_reset())

    @_step(Step.VALIDATE)
    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        """``live=False``: label, paused state, engine checksums; ``live=True``: probes."""
        t0 = time.monotonic()
        h = self.http
        st = self._staged
        if not live and self._slept is not None and not self._wrote:
            return self._validate_restore(t0)
        if live:
            probes = (st.probes if st is not None and st.probes is not None else self.probes)
            if probes is None:
                return None
            wi = h.weight_info()
            calibrating = st is not None and st.calibrating
            deviations: dict[str, tuple[float, float]] = {}
            if takes_calibration(probes):
                calibrated: Any = probes  # run(http, target, *, calibrations, ...)
                check = calibrated.run(h, target, calibrations=dict(self.calibrations),
                                   calibrating=calibrating, deviations=deviations)
            else:
                check = probes.run(h, target)
            if not isinstance(check, Check):
                raise EffectError("validate_live", f"probe set returned {type(check).__name__}, "
                                  "not a Check")
            if calibrating and check.passed:
                self.calibrations.update({k: Calibration(mx, mean)
                                          for k, (mx, mean) in deviations.items()})
            live_paused = h.is_paused() if h.has(Routes.IS_PAUSED) else None
            # What the engine has counted by the end of its last validation is what
            # the published version was verified as (the health watch's baseline).
            self._ops_verified = self._weight_ops_or_none()
            return ValidationEvidence(wi.label, wi.label_supported, paused=live_paused,
                                      checks=(check,), elapsed_s=time.monotonic() - t0)
        unverified: list[str] = []
        # On a guarded engine, the label, paused state and counters in one read, after the
        # resets (the counters at the first: ``engine.close_state``), else as below.
        state, ops_read = self._close_reads()
        caps = h.capabilities()
        # A transport that can check what it installed (e.g. rc_cuda_ipc's block
        # checksum of the updated slices, computed on the workers) adds its own
        # evidence: on vLLM 0.26 it is the only evidence there is. The paused
        # state is read alongside the label and the checks: all are taken inside the
        # paused window (only the runner resumes, after this returns), so their order
        # proves nothing more than their overlap does.
        checker = self.transport if isinstance(self.transport, CheckingTransport) else None
        early, self._early = self._early, None
        if early is not None and early[0] != target:
            early = None
        sent = None if st is None else st.sent
        early_sent, self._early_sent = self._early_sent, None
        if early_sent is not None and early_sent[0] is not sent:
            early_sent = None
        paused_read: Future[bool] | None = None
        if early is not None and early[2] is not None:
            paused_read = early[2]
        elif early_sent is not None and early_sent[2] is not None:
            paused_read = early_sent[2]
        elif Routes.IS_PAUSED in caps and state is None:
            paused_read = self._side().submit(h.is_paused)
        # The label is read here, in the validation's own step: an engine lost since the
        # resets fails this observation (incomplete, retried), not a later step.
        wi = h.weight_info() if state is None else state.info
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        checks: list[Check] = []
        ref = None if st is None else st.reference_checksums
        if Routes.WEIGHT_CHECKER not in caps:
            unverified.append("no /weight_checker: engine checksums not verified")
        elif ref is None:
            unverified.append("no reference checksums for the target: "
                              "engine checksums not compared")
        else:
            cmp = compare_checksums(h.weight_checksums(), ref)
            checks.append(cmp.to_check())
            if cmp.unverifiable:
                unverified.append(f"{len(cmp.unverifiable)} of {cmp.total} engine parameters "
                                  "hash as zero bytes (repacked): content not verifiable")
        if sent is not None:
            if early_sent is not None:
                checks.append(early_sent[1].result())
            else:
                checks.append(compare_sent(h, sent, record=self._record_ranks))
        if checker is not None:
            if early is not None:
                chk = early[1].result()
                if isinstance(chk, Check):
                    chk = dataclasses.replace(chk, detail=(
                        f"{chk.detail}; read after the transfer, alongside the cache reset"
                    ).lstrip("; "))
            else:
                chk = checker.validation_check(h.base_url)
            if not isinstance(chk, Check):
                raise EffectError("validate", f"transport check returned {type(chk).__name__}")
            checks.append(chk)
            tr = self.transport
            if self._slept is not None and isinstance(tr, SleepAwareTransport):
                # After a wake the weights' memory was given away: the check must speak
                # for every engine parameter, not only for what was sent.
                whole = tr.engine_parameter_check()
                if whole is not None:
                    checks.append(whole)
        elif self._slept is not None:
            unverified.append("after a wake: the transport cannot check what it wrote, so "
                              "no check covers every engine parameter")
        # vLLM 0.34's own word on its weights (none from older releases).
        checks.extend(c for c in (incomplete_update_check(h, self._version),
                                  checkpoint_check(h, caps)) if c is not None)
        checks.extend(self._round_checks)
        self._round_checks = ()
        paused = state.paused if state is not None else None if paused_read is None \
            else paused_read.result()
        self._ops_verified = ops_read.result() if ops_read is not None else None \
            if state is None else state.ops
        return ValidationEvidence(wi.label, wi.label_supported, paused=paused,
                                  checks=tuple(checks), elapsed_s=time.monotonic() - t0,
                                  unverified=tuple(unverified))

    @_step(Step.SERVE)
    def observe_health(self, *, timeout_s: float = 5.0) -> HealthEvidence:
        """Between updates: does the engine answer, is it healthy, is it the same process?

        ``/health``, then (when bootstrap saw an ``instance_id``)
        ``/server_info``'s ``instance_id``: a restarted engine answers healthy
        but serves its start checkpoint, which only the incarnation reveals.
        """
        t0 = time.monotonic()
        h = self.http
        label: str | None = None
        writes: tuple[str, ...] = ()
        try:
            healthy = h.health(timeout_s=timeout_s)
            now: object = None
            if healthy and self._instance_id is not None:
                cfg = h.server_info(timeout_s=timeout_s).get(
                    "vllm_config")
                now = cfg.get("instance_id") if isinstance(cfg, dict) else None
            restarted = healthy and self._instance_id is not None and now != self._instance_id
            if healthy and not restarted:
                # Out-of-band writes: any local process can call the engine's weight
                # routes. The label is compared by the runner (with the committed
                # one); the engine's own operation counters catch a write that
                # kept the label.
                wi = h.weight_info(timeout_s=timeout_s)
                label = wi.label if wi.label_supported else None
                base = self._ops_verified
                if base is not None and self._counts_ops:
                    writes = h.weight_ops(timeout_s=timeout_s).writes_since(base)
        except RolloutCoreError as exc:
            return HealthEvidence(False, False, reason=str(exc),
                                  elapsed_s=time.monotonic() - t0)
        reason = (f"instance_id {self._instance_id} is now {now}" if restarted
                  else "" if healthy else "/health answered non-200")
        return HealthEvidence(True, healthy, restarted, reason, observed_label=label,
                              writes=writes, elapsed_s=time.monotonic() - t0)

    def _side(self) -> ThreadPoolExecutor:
        """Worker threads for engine reads that overlap another call (five: beside an
        update's first cache reset, the two resets after it and the operation counters;
        the early transport check and the paused-state read beside them)."""
        if self._side_pool is None:
            self._side_pool = ThreadPoolExecutor(5, thread_name_prefix="rc-vllm-side")
        return self._side_pool

    @_step(Step.RESUME)
    def resume(self) -> ResumeEvidence:
        t0 = time.monotonic()
        self.forget_sleep()
        self._drained, self._ops_closing, self._resets_ahead = False, None, None
        said = self.http.resume()
        unverified: tuple[str, ...] = ()
        after: bool | None
        if said:  # sent once the engine core has resumed its scheduler
            after = False
        elif Routes.IS_PAUSED in self.http.capabilities():
            after = self.http.is_paused()
        else:
            after, unverified = None, ("no /is_paused: resume not confirmed",)
        return ResumeEvidence(True, after, elapsed_s=time.monotonic() - t0,
                              unverified=unverified)

    def fence(self) -> None:
        """Abort and hold everything: a tainted engine must serve no one.

        A fence that fails raises, so that its caller (the runner's
        ``fence_failed`` note, the gateway's status) says the engine may
        still be serving rather than believing it fenced.
        """
        self.http.pause(PauseMode.ABORT, clear_cache=False,
                        timeout_s=min(10.0, self.http.timeout_s))

    def cancel(self, step: Step) -> None:
        """Unblock ``step``, called from the runner's watchdog thread."""
        if step is Step.TRANSFER and self.transport is not None:
            # The transfer group is torn down: the next transfer reconnects.
            self._connected = False
            self.transport.abort()
        else:
            self.http.cancel_inflight()

    def close(self) -> None:
        try:
            if self.transport is not None:
                self.transport.close()
        finally:
            self._connected = False
            if self._side_pool is not None:
                self._side_pool.shutdown(wait=False)
                self._side_pool = None
            self.http.close()

    def __enter__(self) -> VllmAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
