"""LoRA-adapter updates of one engine: load, verify, publish, retire (``core.adapters``).

``AdapterManager`` runs the adapter machine (``core.adapters.AdapterTable``) in
the one shell (``control.shell``), its records going to the engine's journal,
and does the I/O the machine decides: vLLM's runtime LoRA routes
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, ``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``, ``/v1/models``) and the probes.

An update (``prepare`` then ``apply``, or ``update``):

1. ``prepare`` (no engine call): the adapter is checked and digested
   (``verification.adapters.AdapterSource``), named after its generation and
   digest (``core.adapters.adapter_name``) and written to its own directory
   under the store; the reference of base + adapter is computed (PEFT, float32)
   unless the trainer passes its own model as ``reference``.
2. ``apply``: superseded adapters that may go are unloaded first (``sweep``);
   the proposal is refused before anything changes when the base is not READY
   on the version the adapter was prepared for, another adapter update is in
   progress, the name was ever seen, or it would not fit the budget. Then the
   load; the listing (``/v1/models`` must name it, with the base as its parent);
   the probe *through the adapter* against the reference; the probe of the
   *base* against the base's own reference (an adapter must not change what
   base requests compute; ``BASE_PROBE_MODES`` for when it runs); publish.
   Any failure unloads it (REFUSED), or, when the unload fails, leaves it
   FENCED (never routed), and raises
   ``UpdateFailed``; the adapter published before keeps serving.

No drain and no pause: the requests running on the old adapter or on the base
read slots the load does not write. Requests are bound with ``admit`` to (base
version, adapter version): the lifecycle's binding for the base (so a full
update still drains them) and the table's for the adapter.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from rolloutcore.control.adapter_probes import (
    check_probe_tolerance,
    engine_device,
    run_probes,
)
from rolloutcore.control.adapter_results import (
    AdapterResult,
    PreparedAdapter,
    RolloutBinding,
    VerifiedAdapter,
)
from rolloutcore.control.port import LoraCapability
from rolloutcore.control.shell import Listener, Shell
from rolloutcore.core.adapters import (
    AdapterChange,
    AdapterConfig,
    AdapterEvent,
    AdapterState,
    AdapterTable,
    AdapterVersion,
    AdapterView,
    adapter_name,
)
from rolloutcore.core.evidence import Check
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import Binding, Provenance, WeightIdentity, WeightVersion
from rolloutcore.core.vocab import State
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    EffectError,
    RequestRejected,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.transports.adapter_store import delete_adapter, upload_adapter
from rolloutcore.verification.adapters import AdapterSource, adapter_probe
from rolloutcore.verification.probe import (
    DEFAULT_TOLERANCE,
    MAX_TOLERANCE,
    Calibration,
    ModelOrDir,
    ModelScorer,
    PolicyProbe,
)

if TYPE_CHECKING:
    import torch

    from rolloutcore.control.controller import LifecycleController

log = logging.getLogger("rolloutcore.adapters")

__all__ = ["ADAPTER_TOLERANCE", "BASE_PROBE_MODES", "DISCRIMINATION", "ENGINE_SCORINGS",
           "PROBE_SCORINGS", "TOGETHER_DEVICES", "AdapterManager", "engine_device",
           "AdapterResult", "PreparedAdapter", "RolloutBinding", "VerifiedAdapter",
           "check_probe_tolerance"]

#: When the base is probed beside a newly loaded adapter. ``required``: always, so a
#: base computed wrong beside adapter requests refuses the update (vLLM 0.32's CPU
#: LoRA kernels index the no-adapter slot -1 as the last slot: a base request batched
#: with adapter requests gets that slot's adapter). ``when_idle``: only while no
#: request bound to an adapter runs; otherwise skipped and said so in the evidence
#: (``AdapterResult.base_verified`` false), for engines that serve only adapter
#: requests once one is published (the gateway's ``AdapterEngine`` refuses base
#: requests then).
BASE_PROBE_MODES = frozenset({"required", "when_idle"})

#: How the probes score the engine. ``generation``: teacher-forced through the sampling
#: path (``measure_generated``: a decode per reference token where the engine's differs),
#: safe beside live requests everywhere. ``prompt_logprobs``: one prefill per case
#: (``PolicyProbe.measure``), 12x cheaper on an 8B engine, but vLLM 0.32's CPU build
#: kills its engine core when a ``prompt_logprobs`` request runs beside another request
#: on a LoRA engine (docs/lora.md): only for engines where that was shown safe
#: (``diagnostics/gpu/h200_lora.py``'s ``beside`` stage: vLLM 0.26 on CUDA).
#: ``AdapterManager(probe_scoring="auto")``, the default, takes ``prompt_logprobs`` on a
#: CUDA engine and ``generation`` on any other or one that does not say
#: (``ENGINE_SCORINGS``); what generation proves that prompt_logprobs does not:
#: docs/lora.md ("Which scoring").
PROBE_SCORINGS = frozenset({"generation", "prompt_logprobs"})

#: The scoring ``probe_scoring="auto"`` takes on an engine of each device type
#: (``/server_info``'s ``device_config``); any other device, or an engine without
#: ``/server_info``, is scored through generation.
ENGINE_SCORINGS: Mapping[str, str] = MappingProxyType({"cuda": "prompt_logprobs",
                                                        "cpu": "generation"})

#: The devices whose engines score ``prompt_logprobs`` requests batched with each other and
#: with LoRA requests correctly (measured: ``h200_lora.py``'s ``beside`` stage, vLLM 0.26 on
#: an H100, 2026-12-07: engine alive, deviations as when quiet). There the two probes and
#: all their cases go to the engine at once (``probes_together``); elsewhere one at a time.
TOGETHER_DEVICES = frozenset({"cuda"})

#: The probe through an adapter's own tolerance (nats) when the update declares none. A
#: LoRA engine computes the adapter's delta with two more bf16 matmuls than the base, so
#: correct adapters deviate more than the base does: on vLLM 0.32's CPU build (tiny
#: Qwen3, rank 8-16 test adapters; 17 adapters, 2026-12-05) their worst position was
#: 0.0034-0.0061 and their mean 0.0012-0.0026 (one CI run), against the base's
#: 0.0034 / 0.0012 on the same engine. With the base's 0.005 a correct adapter above it
#: was held to the base's calibrated mean rule (2x the base's mean) and refused once
#: in CI. 0.01 passes those with room and still refuses what the probe exists for: an
#: adapter the engine did not load or loaded as another (deviations of 0.1 to inf).
ADAPTER_TOLERANCE = 0.01

#: Above ``MAX_TOLERANCE`` (only where a manager's ``max_tolerance`` allows it: an
#: engine measured noisier than that, e.g. an 8B bf16 engine against a float32
#: reference deviates by tenths of a nat on the base itself), an update's probe
#: tolerance is taken only for an adapter the probe can still tell from the base: on
#: the probe's own tokens the adapter's reference must lie at least ``DISCRIMINATION``
#: times the tolerance away from the base's (``ModelScorer``), so that the base served
#: in its place (a load that did nothing) still fails the probe. A tolerance within
#: ``MAX_TOLERANCE`` is taken as it always was.
DISCRIMINATION = 2.0


@dataclass
class _Phases:
    t: dict[str, float] = field(default_factory=dict)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            self.t[name] = self.t.get(name, 0.0) + time.perf_counter() - t0


class AdapterManager:
    """The adapter versions of one engine (see the module docstring). Thread-safe."""

    def __init__(self, http: LoraCapability, controller: LifecycleController, *,
                 base_model: ModelOrDir,
                 store: str | Path | None = None, config: AdapterConfig | None = None,
                 listener: Listener | None = None, max_rank: int | None = None,
                 calibrations: Callable[[], Mapping[str, Calibration]] | None = None,
                 probe_tolerance: float = ADAPTER_TOLERANCE,
                 base_tolerance: float = DEFAULT_TOLERANCE,
                 timeout_s: float = 60.0, base_probe: str = "required",
                 max_tolerance: float = MAX_TOLERANCE, probe_scoring: str = "auto",
                 probes_together: bool | None = None, upload: bool = False) -> None:
        if not isinstance(probe_scoring, str) or \
                probe_scoring not in {*PROBE_SCORINGS, "auto"}:
            raise BadInput(f"probe_scoring must be one of {sorted({*PROBE_SCORINGS, 'auto'})}"
                           f", got {probe_scoring!r}")
        if probes_together is not None and not isinstance(probes_together, bool):
            raise BadInput(f"probes_together must be a bool or None, got {probes_together!r}")
        if base_probe not in BASE_PROBE_MODES:
            raise BadInput(f"base_probe must be one of {sorted(BASE_PROBE_MODES)}, got "
                           f"{base_probe!r}")
        if base_model is None:
            raise BadInput("an adapter manager needs the base model (a checkpoint directory or "
                           "a HF causal LM) for its references")
        if max_rank is not None:
            check_int("max_rank", max_rank, 1)
        if not isinstance(upload, bool):
            raise BadInput(f"upload must be a bool, got {upload!r}")
        #: Upload each version's files into the engine's own store
        #: (``transports.adapter_store``) and load them from there: for an engine that
        #: cannot read this process's files (another node).
        self.upload = upload
        self.http = http
        self.controller = controller
        self.base_model = base_model
        self.max_rank = max_rank
        if isinstance(max_tolerance, bool) or not isinstance(max_tolerance, (int, float)) \
                or not math.isfinite(max_tolerance) or max_tolerance <= 0:
            raise BadInput(f"max_tolerance must be a finite number > 0 (nats), got "
                           f"{max_tolerance!r}")
        #: The largest probe tolerance this manager takes (an operator's setting: above
        #: ``MAX_TOLERANCE`` only for adapters the probe can tell from the base).
        self.max_tolerance = float(max_tolerance)
        self.probe_tolerance = check_probe_tolerance(probe_tolerance, ADAPTER_TOLERANCE,
                                                     self.max_tolerance)
        self.base_tolerance = check_probe_tolerance(base_tolerance, DEFAULT_TOLERANCE,
                                                    self.max_tolerance)
        self.timeout_s = timeout_s
        self.base_probe = base_probe
        #: The engine's device type as ``/server_info`` gives it (None: it does not say).
        self.engine_device = (engine_device(http, timeout_s)
                              if probe_scoring == "auto" or probes_together is None else None)
        #: How the probes score (``PROBE_SCORINGS``; ``auto`` resolved here, once).
        self.probe_scoring = probe_scoring if probe_scoring != "auto" else \
            ENGINE_SCORINGS.get(self.engine_device or "", "generation")
        #: Both probes sent at once, the base probe's requests batched with the adapter
        #: probe's (with ``prompt_logprobs`` every case of both: one prefill for all; else
        #: one request at a time); else the base probe after the adapter probe. Default:
        #: on the devices of ``TOGETHER_DEVICES``.
        self.probes_together = (self.engine_device in TOGETHER_DEVICES
                                if probes_together is None else probes_together)
        self._calibrations = calibrations or dict
        self._own_store = store is None
        self.store = Path(store) if store is not None else Path(
            tempfile.mkdtemp(prefix="rolloutcore-adapters-"))
        self.store.mkdir(parents=True, exist_ok=True)
        self.table = AdapterTable(config)
        self.shell: Shell[AdapterTable, AdapterView] = Shell(self.table, AdapterTable.view,
                                                             listener=listener)
        self._io = threading.Lock()   # one load/unload sequence at a time
        self._sweeps = threading.Condition()  # guards the two below
        self._sweeper: threading.Thread | None = None
        self._sweep_again = False
        self._base_probes: dict[str, PolicyProbe] = {}
        # The base weights ``base_model`` is (the references' base): after a full update
        # of the base, ``set_base`` must name the new one before an adapter is prepared.
        self._base_identity = getattr(controller, "identity", None)
        # Whatever the engine already lists (an earlier controller's adapters) is never
        # reused as a name and never routed to.
        listed = http.models(timeout_s=timeout_s)
        self.shell.run(self.table.note_loaded, {n: p for n, p in listed.items() if p})

    # ------------------------------------------------------------------ reading
    @property
    def view(self) -> AdapterView:
        return self.shell.view

    @property
    def current(self) -> AdapterVersion | None:
        return self.shell.view.current

    # ------------------------------------------------------------------ update
    def update(self, adapter: ModelOrDir, provenance: Provenance, *,
               reference: torch.nn.Module | None = None,
               probe_tolerance: float | None = None) -> AdapterResult:
        """``prepare`` then ``apply``: the adapter published, verified, or ``UpdateFailed``.

        Refused before the table took the version (``UpdateRefused``: the budget full,
        another update verifying, the base changed), nothing changed: the files
        ``prepare`` wrote go too, so the same adapter can be sent again once it fits
        (its name, generation and digest, would be the same)."""
        prepared = self.prepare(adapter, provenance, reference=reference,
                                probe_tolerance=probe_tolerance)
        try:
            return self.apply(prepared)
        except UpdateRefused:
            if prepared.version.name not in self.shell.view.states:
                shutil.rmtree(prepared.version.path, ignore_errors=True)
            raise

    def prepare(self, adapter: ModelOrDir, provenance: Provenance, *,
                reference: torch.nn.Module | None = None,
                probe_tolerance: float | None = None) -> PreparedAdapter:
        """Check, digest, name and write the adapter, and compute its reference.

        ``reference``: the trainer's own model of base + adapter (a PEFT model);
        default: the base model with the adapter as written, through PEFT.
        ``probe_tolerance``: this update's probe through the adapter (nats, at most
        the manager's ``max_tolerance``; default the manager's): a trainer declares it
        as it declares a full update's (LoRA's bf16 arithmetic grows with the adapter).
        A tolerance above ``MAX_TOLERANCE`` needs an adapter the probe can tell from
        the base (``DISCRIMINATION``).
        Refused with ``BadInput`` (nothing written) when the adapter is bad.
        """
        t0 = time.perf_counter()
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        tol = check_probe_tolerance(probe_tolerance, self.probe_tolerance, self.max_tolerance)
        base = self._base_version()
        self.check_base()
        src = AdapterSource.of(adapter, max_rank=self.max_rank)
        gen = self.shell.read(lambda: self.table.next_generation)
        name = adapter_name(gen, src.content_digest)
        path = self.store / name
        src.write(path)
        try:
            version = AdapterVersion(gen, name, str(path.resolve()), src.content_digest,
                                     base.label, src.size_bytes)
            probe = adapter_probe(self.base_model, path, reference=reference, tolerance=tol)
            effect = None
            if tol > MAX_TOLERANCE:
                effect = probe.measure(ModelScorer(self._base_module()))
                if effect.max_abs_diff < DISCRIMINATION * tol:
                    raise BadInput(
                        f"probe_tolerance {tol:g} cannot tell adapter {name} from the base: "
                        f"its reference lies at most {effect.max_abs_diff:.4g} nats (mean "
                        f"{effect.mean_abs_diff:.3g}) from the base's on the probe's tokens, "
                        f"under {DISCRIMINATION:g}x the tolerance; a tolerance above "
                        f"{MAX_TOLERANCE:g} is taken only for an adapter the probe can tell "
                        f"from the base; nothing was loaded")
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return PreparedAdapter(version, src, provenance, probe, time.perf_counter() - t0,
                               effect)

    def apply(self, prepared: PreparedAdapter) -> AdapterResult:
        """Load, verify and publish a prepared adapter (see the module docstring)."""
        t0 = time.perf_counter()
        return self.publish(self.verify(prepared), started=t0)

    def verify(self, prepared: PreparedAdapter, *, deadline: float | None = None
               ) -> VerifiedAdapter:
        """The first phase of ``apply``: load and verify, and leave the version VERIFYING
        (listed, probed, never routed to) for ``publish`` or ``abandon``.

        A fleet verifies one adapter on every replica this way before it publishes
        it anywhere (``fleet.adapters``). ``deadline`` (``time.monotonic()``): a
        step that would start after it fails the version instead (unloaded), so
        the whole phase is bounded by it plus one engine call's ``timeout_s``.
        While a version is VERIFYING no other adapter update starts (the table
        refuses it), and requests keep getting the published one.
        """
        if not isinstance(prepared, PreparedAdapter):
            raise BadInput("verify needs a PreparedAdapter (from prepare)")
        if deadline is not None and (isinstance(deadline, bool)
                                     or not isinstance(deadline, (int, float))):
            raise BadInput(f"deadline must be a time.monotonic() value, got {deadline!r}")
        v = prepared.version
        ph = _Phases()
        t0 = time.perf_counter()

        def in_time(step: str, checks: Iterable[Check] = ()) -> None:
            if deadline is not None and time.monotonic() > deadline:
                self._refuse(v, step, f"the deadline passed before {step}", checks)

        with self._io:
            retired = list(self._sweep_locked())
            base = self._base_version()
            if base.label != v.base:
                raise UpdateRefused(f"adapter {v.name} was prepared on base {v.base}; the "
                                    f"engine now serves {base.label}: prepare it again")
            base_probe = self._base_probe(base.label)
            # A name the engine holds that this table did not load (another controller's)
            # is never reused: vLLM would refuse it, or with load_inplace serve its KV.
            held = ph.run("list", lambda: self.http.models(timeout_s=self.timeout_s))
            self.shell.run(self.table.note_loaded, {n: p for n, p in held.items() if p})
            if deadline is not None and time.monotonic() > deadline:
                raise UpdateRefused(f"adapter {v.name}: the deadline passed before the load; "
                                    f"nothing was loaded")
            self.shell.run(self.table.propose, v)   # refusals change nothing
            # -- load (from the engine's own store, where the files were uploaded)
            try:
                where = v.path if not self.upload else ph.run("upload", lambda: upload_adapter(
                    self.http.base_url, v.name, v.path, v.content_digest,
                    timeout_s=self.timeout_s))
                ph.run("load", lambda: self.http.load_lora_adapter(
                    v.name, where, timeout_s=self.timeout_s))
            except RequestRejected as exc:   # a 4xx: the engine loaded nothing
                self._move(v.name, AdapterEvent.REJECTED, f"the engine refused the load: {exc}")
                raise UpdateFailed("load_adapter", "no_mutation", "READY",
                                   f"the engine refused adapter {v.name}: {exc}") from exc
            except EffectError as exc:       # maybe loaded: unload it
                self._refuse(v, "load_adapter", f"load failed: {exc}", (), exc)
            in_time("list")
            # -- the engine lists it, on this base
            listed: dict[str, str | None] = ph.run("list", lambda: self.http.models(
                timeout_s=self.timeout_s))
            if v.name not in listed:
                self._refuse(v, "list", f"the load answered 200 but the engine does not list "
                             f"{v.name} (it lists {sorted(listed)})", ())
            self._move(v.name, AdapterEvent.LOADED, "listed by the engine")
            # -- probes: through the adapter, then the base beside it
            notes: list[str] = []
            checks = [Check("listed", True, f"/v1/models lists {v.name} (parent "
                            f"{listed[v.name]})"),
                      Check("content", True, f"sha256 {v.content_digest} of {v.size_bytes} "
                            f"tensor bytes and the config, rank {prepared.source.rank}")]
            if prepared.effect is not None:
                e = prepared.effect
                checks.append(Check(
                    "adapter-effect", True,
                    f"the adapter's reference lies {e.max_abs_diff:.4g} nats at most (mean "
                    f"{e.mean_abs_diff:.3g}) from the base's on the probe's tokens: at least "
                    f"{DISCRIMINATION:g}x the probe's tolerance "
                    f"{prepared.probe.tolerance:g}, so the base served in its place fails it",
                    max_abs_diff=e.max_abs_diff, tolerance=prepared.probe.tolerance))
            in_time("probe_adapter", checks)
            try:
                through = (prepared.probe, v.name, "probe through the adapter")
                busy = self._adapter_requests()
                if self.probes_together and not (busy and self.base_probe == "when_idle"):
                    # Both at once: the base probe's requests are batched with the
                    # adapter's (as serving batches them; stricter than one after the other).
                    checks.extend(ph.run("probes", lambda: self._probes([
                        through, (base_probe, None, self._beside(busy)
                                  + " (sent with the adapter probe)")])))
                else:
                    checks.append(ph.run("probe_adapter", lambda: self._probe(*through)))
                    in_time("probe_base", checks)
                    busy = self._adapter_requests()
                    if busy and self.base_probe == "when_idle":
                        notes.append(f"base-probe not run: {busy} adapter requests in flight "
                                     f"(when_idle; vLLM 0.32's CPU LoRA kernels apply the last "
                                     f"slot's adapter to base requests batched with them)")
                    else:
                        checks.append(ph.run("probe_base", lambda: self._probe(
                            base_probe, None, self._beside(busy))))
            except EffectError as exc:
                self._refuse(v, "validate", f"a probe failed to run: {exc}", checks, exc)
            failed = [c for c in checks if not c.passed]
            if failed:
                self._refuse(v, "validate", "; ".join(f"{c.name}: {c.detail}" for c in failed),
                             checks)
        return VerifiedAdapter(prepared, tuple(checks), tuple(notes), dict(ph.t),
                               tuple(retired), time.perf_counter() - t0)

    def publish(self, verified: VerifiedAdapter, *, started: float | None = None
                ) -> AdapterResult:
        """The second phase: publish a version ``verify`` left VERIFYING (it supersedes the
        current one in the same decision), then retire what may go. If the base moved
        since, the version is failed (unloaded) and ``UpdateFailed`` raised."""
        if not isinstance(verified, VerifiedAdapter):
            raise BadInput("publish needs a VerifiedAdapter (from verify)")
        prepared, checks = verified.prepared, verified.checks
        v = prepared.version
        if self.shell.read(self.table.state, v.name) is not AdapterState.VERIFYING:
            raise UpdateRefused(f"adapter {v.name} is "
                                f"{self.shell.read(self.table.state, v.name)}, not verifying: "
                                f"nothing to publish")
        ph = _Phases(dict(verified.phases))
        t0 = time.perf_counter() - verified.verify_s if started is None else started
        with self._io:
            now = self._base_version_or_none()
            if now is None or now.label != v.base:
                self._refuse(v, "validate", f"the base moved to "
                             f"{None if now is None else now.label} during the verification "
                             f"of {v.name} (verified on {v.base})", checks)
            ev = (*(f"{c.name}: {c.detail}" for c in checks), *verified.notes,
                  f"provenance: {prepared.provenance.to_dict()}")
            ph.run("publish", lambda: self._move(v.name, AdapterEvent.VERIFIED,
                                                 "every check passed", ev))
            retired = [*verified.retired, *ph.run("retire",
                                                  lambda: list(self._sweep_locked()))]
        phases = {"prepare": prepared.prepare_s, **ph.t, "apply": time.perf_counter() - t0}
        return AdapterResult(v, tuple(checks), phases, tuple(retired), verified.notes)

    def abandon(self, verified: VerifiedAdapter, reason: str) -> str:
        """Fail a version ``verify`` left VERIFYING: unload it (REFUSED) or, if the unload
        fails, fence it (FENCED: never routed). Returns the state it ended in."""
        if not isinstance(verified, VerifiedAdapter):
            raise BadInput("abandon needs a VerifiedAdapter (from verify)")
        if not isinstance(reason, str) or not reason:
            raise BadInput("abandon needs a reason")
        v = verified.prepared.version
        if self.shell.read(self.table.state, v.name) is not AdapterState.VERIFYING:
            raise UpdateRefused(f"adapter {v.name} is not verifying: nothing to abandon")
        with self._io, contextlib.suppress(UpdateFailed):
            self._refuse(v, "publish", reason, verified.checks)
        st = self.shell.read(self.table.state, v.name)
        return str(st.value) if st is not None else "unknown"

    # ------------------------------------------------------------------ requests
    def admit(self, rollout_id: str) -> RolloutBinding:
        """Bind a request to the committed base version and the current adapter."""
        base = self.controller.admit(rollout_id)
        try:
            return self.bind(rollout_id, base)
        except BaseException:
            self.controller.complete(rollout_id)
            raise

    def bind(self, rollout_id: str, base: Binding, *, expect: str | None = None
             ) -> RolloutBinding:
        """The adapter half of ``admit``, for a request already bound to ``base`` (the
        caller's binding, released by the caller on a refusal). ``expect``: the
        adapter name the caller routed for (a fleet's current); another current one
        is refused (``AdmissionRefused``), nothing bound."""
        ab = self.shell.run(self.table.admit, rollout_id, wait=False)
        why = None
        if ab.adapter.base != base.version.label:
            why = (f"adapter {ab.adapter.name} was verified on base {ab.adapter.base}, "
                   f"the engine serves {base.version.label}: update the adapter")
        elif expect is not None and ab.adapter.name != expect:
            why = f"the engine's current adapter is {ab.adapter.name}, not {expect}"
        if why is not None:
            self.shell.run(self.table.complete, rollout_id, wait=False)
            raise AdmissionRefused("adapters", why, None)
        return RolloutBinding(base, ab)

    def complete(self, rollout_id: str) -> AdapterVersion:
        """The request ended: release both bindings, and retire what may go now."""
        v = self.release(rollout_id)
        self.controller.complete(rollout_id)
        return v

    def release(self, rollout_id: str) -> AdapterVersion:
        """Release the adapter binding only (the data plane releases the base's itself)."""
        v: AdapterVersion = self.shell.run(self.table.complete, rollout_id, wait=False)
        if self.shell.read(self.table.evictable) and self._io.acquire(blocking=False):
            try:
                list(self._sweep_locked())
            finally:
                self._io.release()
        return v

    def release_soon(self, rollout_id: str) -> AdapterVersion:
        """``release``, for the gateway's event loop: the binding is released now (memory
        and a queued record), the unloads it may allow run on a sweeper thread. An unload
        waits on the engine (up to two calls of ``timeout_s``) and on the journal's sync,
        and a client chooses when its request ends: none of that may stall the loop."""
        v: AdapterVersion = self.shell.run(self.table.complete, rollout_id, wait=False)
        if self.shell.read(self.table.evictable):
            with self._sweeps:
                self._sweep_again = True
                if self._sweeper is None:
                    self._sweeper = threading.Thread(target=self._sweep_loop, daemon=True,
                                                     name="rolloutcore-adapter-sweep")
                    self._sweeper.start()
        return v

    def _sweep_loop(self) -> None:
        while True:
            with self._sweeps:
                if not self._sweep_again:
                    self._sweeper = None
                    self._sweeps.notify_all()
                    return
                self._sweep_again = False
            try:
                self.sweep()
            except Exception as exc:  # noted; the next release or publish sweeps again
                log.warning("adapter sweep failed: %r", exc)

    def wait_swept(self, timeout_s: float = 30.0) -> bool:
        """Wait until no sweep started by ``release_soon`` runs; False at the timeout."""
        with self._sweeps:
            return self._sweeps.wait_for(lambda: self._sweeper is None, timeout_s)

    def withdraw(self, name: str, reason: str) -> list[str]:
        """The client unloaded adapter version ``name`` (published or superseded): it is
        no longer current (new requests get no adapter), and it is retired as soon as
        no request bound to it runs, ``max_staleness`` aside. Returns the versions
        unloaded now (the others go when their last bound request ends, ``release``);
        ``UpdateRefused`` (nothing changed) when it is in no state to withdraw."""
        if not isinstance(reason, str) or not reason:
            raise BadInput("withdraw needs a reason")
        with self._io:
            st = self.shell.read(self.table.state, name)
            if st not in (AdapterState.PUBLISHED, AdapterState.STANDBY):
                raise UpdateRefused(f"adapter {name} is {getattr(st, 'value', 'unknown')}: "
                                    f"only a published or superseded version is withdrawn")
            self._move(name, AdapterEvent.WITHDRAWN, reason)
            return list(self._sweep_locked())

    def is_adapter(self, name: str) -> bool:
        """Whether ``name`` is (or was) an adapter version on this engine."""
        seen: bool = self.shell.read(self.table.seen, name)
        return seen

    def sweep(self) -> list[str]:
        """Unload every superseded adapter that may go (``AdapterTable.evictable``)."""
        with self._io:
            return list(self._sweep_locked())

    def restore(self, changes: Iterable[AdapterChange]) -> AdapterVersion | None:
        """A previous controller's adapter records (``AdapterChange``, from its journal):
        their names are never reused and generations continue above them; the version
        it had published last is returned, not routed to (``republish`` loads and
        verifies it again, under a new name)."""
        was: AdapterVersion | None = self.shell.run(self.table.restore, list(changes))
        return was

    def republish(self, was: AdapterVersion, provenance: Provenance, *,
                  verified_on: WeightIdentity | None = None) -> AdapterResult:
        """The files of an earlier version (``restore``) published again, verified on the
        base served now, as a new version. Refused (``UpdateRefused``, nothing changed)
        when they are gone or no longer hold what the version's digest says, or when the
        base served now is not the one it was verified on: ``verified_on``, the identity
        the journal committed under ``was.base`` (content digests compared); without it,
        only the same committed label of this controller counts. An adapter is trained
        for its base: on another one it answers for a pair nobody published."""
        if not isinstance(was, AdapterVersion):
            raise BadInput("republish needs an AdapterVersion")
        self._check_same_base(was, verified_on)
        p = Path(was.path)
        if not (p / "adapter_config.json").is_file():
            raise UpdateRefused(f"the files of {was.name} are gone ({p}): publish it again")
        src = AdapterSource.of(p, max_rank=self.max_rank)
        if src.content_digest != was.content_digest:
            raise UpdateRefused(f"{p} no longer holds {was.name} (digest "
                                f"{src.content_digest[:16]}, not {was.content_digest[:16]})")
        return self.update(p, provenance)

    def _check_same_base(self, was: AdapterVersion,
                         verified_on: WeightIdentity | None) -> None:
        c = self.controller
        now, committed = getattr(c, "identity", None), getattr(c, "committed", None)
        if verified_on is None:
            if committed is not None and committed.label == was.base:
                return
            why = (f"the base it was verified on ({was.base}) is not in the journal and the "
                   f"engine serves {getattr(committed, 'label', None)}")
        else:
            had = getattr(verified_on, "content_digest", None)
            cur = getattr(now, "content_digest", None)
            if had is not None and had == cur:
                return
            why = (f"it was verified on base {was.base} (content "
                   f"{(had or 'unknown')[:16]}), the engine serves content "
                   f"{(cur or 'unknown')[:16]}")
        raise UpdateRefused(f"{was.name} is not published again: {why}; publish an adapter "
                            "trained for this base")

    def close(self) -> None:
        self.wait_swept()
        if self._own_store:
            shutil.rmtree(self.store, ignore_errors=True)

    # ------------------------------------------------------------------ internals
    def _adapter_requests(self) -> int:
        return sum(self.shell.view.bound.values())

    def _base_version_or_none(self) -> WeightVersion | None:
        c = self.controller
        return c.committed if c.state is State.READY else None

    def _base_version(self) -> WeightVersion:
        c = self.controller
        if c.state is not State.READY or c.committed is None:
            raise UpdateRefused(f"the base is {c.state.value}, not READY on a committed "
                                f"version: no adapter update now; nothing was changed")
        return c.committed

    def _base_module(self) -> torch.nn.Module:
        """The base as a module (a checkpoint directory is loaded, float32)."""
        if not isinstance(self.base_model, (str, Path)):
            return self.base_model
        from transformers import AutoModelForCausalLM

        from rolloutcore.verification.hf_load import HF_LOCK

        with HF_LOCK:
            return AutoModelForCausalLM.from_pretrained(str(self.base_model))

    def _base_probe(self, label: str) -> PolicyProbe:
        p = self._base_probes.get(label)
        if p is None:
            p = PolicyProbe.of(self.base_model, tolerance=self.base_tolerance)
            p.name = "base-probe"
            self._base_probes = {label: p}
        return p

    def check_base(self) -> None:
        """``UpdateRefused`` when the engine serves other base weights than the ones this
        manager's references are of (a full update of the base since: ``set_base``)."""
        ident = getattr(self.controller, "identity", None)
        if self._base_identity is not None and ident is not None and \
                not ident.same_weights(self._base_identity):
            raise UpdateRefused(f"the engine serves base {ident.provenance.checkpoint}, but "
                                f"the adapter references are of "
                                f"{self._base_identity.provenance.checkpoint}: give the new "
                                f"base (set_base, or base_dir with POST /control/adapters) "
                                f"first; nothing was changed")

    def set_base(self, base_model: ModelOrDir) -> None:
        """The base model after a full update (its references; the old ones are dropped)."""
        if base_model is None:
            raise BadInput("base_model must be a checkpoint directory or a HF causal LM")
        with self._io:
            self.base_model = base_model
            self._base_probes = {}
            self._base_identity = getattr(self.controller, "identity", None)

    @staticmethod
    def _beside(busy: int) -> str:
        return "probe of the base beside it" + (f" ({busy} adapter requests in flight)"
                                                if busy else "")

    def _probe(self, probe: PolicyProbe, model: str | None, what: str) -> Check:
        """One probe, judged (``_probes`` with one)."""
        (check,) = self._probes([(probe, model, what)])
        return check

    def _probes(self, probes: Sequence[tuple[PolicyProbe, str | None, str]]) -> list[Check]:
        """Each (probe, model, what) measured through ``model`` and judged, in order.

        These probes run beside live requests: through the sampling path unless the
        deployment's engine scores ``prompt_logprobs`` (``PROBE_SCORINGS``). With
        ``probes_together`` every probe is sent at once, and with ``prompt_logprobs``
        every case of every probe too (one batch on the engine); each probe still reads
        every position of every case of its own and is judged on its own. The first
        failure to run, in probe order, is raised once all have answered."""
        return run_probes(self.http, probes, scoring=self.probe_scoring,
                          together=self.probes_together, timeout_s=self.timeout_s,
                          calibrations=dict(self._calibrations()))

    def _move(self, name: str, event: AdapterEvent, reason: str = "",
              evidence: tuple[str, ...] = ()) -> AdapterState:
        st: AdapterState = self.shell.run(self.table.move, name, event, reason=reason,
                                          evidence=evidence)
        return st

    def _refuse(self, v: AdapterVersion, phase: str, reason: str, checks: Iterable[Check],
                cause: BaseException | None = None) -> None:
        """Fail the version: unload it (REFUSED) or fence it (FENCED); raise UpdateFailed."""
        ev = tuple(f"{c.name}: {'pass' if c.passed else 'FAIL'}: {c.detail}" for c in checks)
        self._move(v.name, AdapterEvent.FAILED, reason, ev)
        gone, why = self._unload(v.name)
        self._move(v.name, AdapterEvent.UNLOADED if gone else AdapterEvent.FAILED, why)
        if gone:
            self._forget_files(v)
        cls = "no_mutation" if gone else "ambiguous"
        err = UpdateFailed(phase, cls, "READY",
                           f"adapter {v.name} not published: {reason}"
                           + ("" if gone else f"; and it could not be unloaded ({why}): "
                              f"fenced, never routed to"))
        if cause is not None:
            raise err from cause
        raise err

    def _forget_files(self, v: AdapterVersion) -> None:
        """An unloaded version's files: here, and in the engine's store if uploaded there
        (best effort: a file left in the store is never loaded again, its name is never
        reused)."""
        shutil.rmtree(v.path, ignore_errors=True)
        if self.upload:
            with contextlib.suppress(EffectError):
                delete_adapter(self.http.base_url, v.name, timeout_s=self.timeout_s)

    def _unload(self, name: str) -> tuple[bool, str]:
        """Unload ``name``; gone when the engine no longer lists it."""
        try:
            self.http.unload_lora_adapter(name, timeout_s=self.timeout_s)
            how = "unloaded"
        except RequestRejected as exc:   # a 404: it was not loaded
            how = f"the engine did not hold it: {exc}"
        except EffectError as exc:
            return False, f"unload failed: {exc}"
        try:
            listed = self.http.models(timeout_s=self.timeout_s)
        except EffectError as exc:
            return False, f"the listing after the unload failed: {exc}"
        if name in listed:
            return False, "the engine still lists it after the unload"
        return True, how

    def _sweep_locked(self) -> Any:
        for v in self.shell.read(self.table.evictable):
            try:
                self._move(v.name, AdapterEvent.UNLOAD, "superseded, nothing bound, outside "
                           "max_staleness")
            except UpdateRefused:
                continue   # a request was bound to it meanwhile
            gone, why = self._unload(v.name)
            self._move(v.name, AdapterEvent.UNLOADED if gone else AdapterEvent.FAILED, why)
            if gone:
                self._forget_files(v)
                yield v.name
