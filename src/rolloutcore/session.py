"""The trainer-facing API: one call per training step performs a verified transition.

``EngineSession`` owns one vLLM engine under RolloutCore control: the
(optional) managed process, the HTTP adapter, the weight transport, the
controller, the runner and the journal. ``session.update(weights,
provenance)`` takes a ``torch.nn.Module``, a state dict or a safetensors
checkpoint directory, computes its identity and (by default) a policy probe
from the very tensors it sends, and runs the whole transition through the
runner. It returns the new committed ``WeightVersion`` or raises
``UpdateFailed`` with the classification; it never returns with the engine
serving unverified weights.

Colocated training (the trainer and the engine on one GPU): ``sleep(level)``
gives the engine's GPU memory to the trainer and says how much it freed;
``wake_and_update(weights, provenance)`` wakes the weights, writes the new
policy into them, wakes the KV cache and runs the same verified transition
(every parameter checked); ``wake()`` wakes on the weights it had (level 1
only: level 2 forgot them).

LoRA adapters (an engine started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``): ``update_adapter(peft_model or
adapter_dir, provenance)`` publishes the next adapter version, verified
(``control.adapters``), with no drain; ``admit_adapter`` binds a request to
(base version, adapter version).

Speculative drafts, updated as one verified transaction: ``DraftedSession``
wraps an ``EngineSession`` whose engine was started with a draft
(``DraftSpec.engine_args``: vLLM's ``--speculative-config``, method
``draft_model`` or ``eagle``) and whose transport is a ``DraftedGlooTransport``.
``update(weights, provenance, draft_weights=...)`` runs the one transition
the runner always runs (drain, preflight, transfer, cache reset, paused
validation, resume, live validation, publish), with:

* one transfer step that writes the draft, then the target, whose finish
  carries the label (``transports.drafted``);
* a paused validation that checks the workers' checksums of what both
  rounds wrote, the draft's against the trainer's draft read again;
* a live validation that runs the target's policy probe, as any update
  does, and ``AcceptanceProbe``: greedy generation with vLLM's acceptance
  counters read around it (``min_acceptance`` makes it a gate);
* one published version whose identity's content digest is
  ``policy_digest(target, draft, draft manifest)`` (``DraftedUpdateResult``
  carries both parts);
* or nothing published: a failure after the draft round started taints the
  engine, as any mutation does.

An update without draft weights is refused before anything changes
(``UpdateRefused``), here and in the wrapped ``EngineSession.update``.

This module sits above ``control`` (layer ``session``): it builds the vLLM
side (``engine``: the launched process, ``VllmHTTP``, ``VllmAdapter``) and hands
``control.stack.wire`` the port, so ``control`` itself imports no vLLM code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.control.adapters import ADAPTER_TOLERANCE, AdapterManager, AdapterResult
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, SleepOutcome, UpdateOutcome
from rolloutcore.control.stack import wire
from rolloutcore.core.adapters import AdapterConfig
from rolloutcore.core.evidence import Check
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.core.vocab import State
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.errors import BadInput, UpdateRefused
from rolloutcore.transports.base import WeightTransport
from rolloutcore.transports.drafted import (
    DRAFT_REFUSAL,
    DraftedGlooTransport,
    DraftedSource,
    engine_draft_of,
)
from rolloutcore.transports.drafted import refusal as transport_refusal
from rolloutcore.transports.source import Weights, WeightSource
from rolloutcore.verification.acceptance import (
    AcceptanceProbe,
    AcceptanceSample,
    default_acceptance_prompts,
)
from rolloutcore.verification.image_probe import ProbeSuite, is_vision_language, vlm_probe
from rolloutcore.verification.probe import DEFAULT_TOLERANCE, PolicyProbe, default_prompts

if TYPE_CHECKING:
    from rolloutcore.engine.process import ManagedEngine

__all__ = ["DraftSpec", "DraftedSession", "DraftedUpdateResult", "EngineSession",
           "PreparedUpdate", "SleepReport", "UpdateResult", "identity_of"]


def identity_of(source: WeightSource, provenance: Provenance, *,
                content: bool = True) -> WeightIdentity:
    """Manifest + declared provenance (+ content digest, which reads every byte once)."""
    return WeightIdentity.declare(source.manifest(), provenance,
                                  source.content_digest() if content else None)


@dataclass(frozen=True)
class PreparedUpdate:
    source: WeightSource
    provenance: Provenance
    identity: WeightIdentity
    probe: PolicyProbe | ProbeSuite | None
    reference_checksums: Mapping[str, str] | None


@dataclass
class UpdateResult:
    version: WeightVersion
    identity: WeightIdentity
    outcome: UpdateOutcome


@dataclass(frozen=True)
class SleepReport:
    """What a sleep gave the trainer: the level, and the memory, as the engine reports it.

    ``freed_bytes`` is the drop of device memory in use across the sleep, read
    by the engine's workers (``None`` where the engine reports no memory);
    ``free_bytes`` the device memory free right after it.
    """

    level: int
    freed_bytes: int | None
    free_bytes: int | None
    elapsed_s: float
    outcome: SleepOutcome


class EngineSession:
    """One engine under RolloutCore: vLLM driver + transport + controller + runner + journal.

    ``vllm`` is the engine's driver (``VllmAdapter``: the runner's port to vLLM);
    ``adapters`` are the LoRA adapters, as vLLM names them (issue 45: one name, one
    concept); ``engine`` is the launched process, when this session launched it.
    """

    def __init__(self, http: VllmHTTP, transport: WeightTransport, *,
                 engine: ManagedEngine | None = None,
                 engine_epoch: str | None = None, journal_path: str | os.PathLike[str] | None
                 = None, deadlines: Deadlines | None = None,
                 controller_config: ControllerConfig | None = None) -> None:
        self.engine = engine
        self.http = http
        self.transport = transport
        self.journal = Journal(journal_path)
        self.vllm = VllmAdapter(http, transport,
                                engine_epoch=engine_epoch or (engine.epoch if engine else None))
        stack = wire(self.vllm, journal=self.journal, controller_config=controller_config,
                     deadlines=deadlines, engine=engine)  # the one composition
        self.controller, self.runner = stack.controller, stack.runner
        #: The LoRA-adapter versions (``enable_adapters``), None until enabled.
        self.adapters: AdapterManager | None = None

    # ------------------------------------------------------------------ set-up
    @classmethod
    def launch(cls, model_dir: str | Path, *, transport: WeightTransport | None = None,
               journal_path: str | os.PathLike[str] | None = None,
               deadlines: Deadlines | None = None, start_timeout_s: float = 300.0,
               progress: bool = False, engine_kwargs: Mapping[str, Any] | None = None,
               tensor_parallel_size: int = 1,
               pipeline_parallel_size: int = 1) -> EngineSession:
        """Start a managed vLLM on ``model_dir`` with RolloutCore's CPU transfer backend.

        ``tensor_parallel_size``: ranks of the engine (one worker process each; on
        the CPU build each rank is bound to its own cores, ``tp_thread_binding``).
        Every update then checks what each rank wrote (``rank_checksums``).
        ``pipeline_parallel_size``: stages (bound the same way, one core group per
        rank of tensor x pipeline); each stage loads its own layers, and every tensor
        must be written by exactly one stage (``rank_checksums.stage_coverage``).
        """
        from rolloutcore.engine.process import ManagedEngine
        from rolloutcore.transports.gloo import GlooTransport

        tr = transport or GlooTransport()
        # Its dev and weight routes answer only this process (transports.engine_key).
        kw = {"guard_routes": True, "tensor_parallel_size": tensor_parallel_size,
              "pipeline_parallel_size": pipeline_parallel_size, **dict(engine_kwargs or {})}
        eng = ManagedEngine(model_dir, backend=tr.backend, progress=progress,
                            startup_timeout_s=start_timeout_s, **kw)
        eng.start()
        try:
            http = VllmHTTP(eng.base_url)
            return cls(http, tr, engine=eng, journal_path=journal_path, deadlines=deadlines)
        except BaseException:
            eng.stop()
            raise

    def bootstrap(self, model_dir: str | Path, provenance: Provenance | None = None, *,
                  probe: bool = True) -> WeightVersion:
        """Take over the engine; it must be serving ``model_dir`` (its identity is recorded).

        ``probe=True`` (the default) verifies it as ``rolloutcore serve`` does: the
        policy probe of ``model_dir`` on the engine (version 0 is published at
        probe level, or ``TakeoverRefused``), and the engine's deviation from it
        calibrates every later update's probe tolerance to this model
        (``verification.probe.Calibration``; the adapter's ``calibrations``).
        ``probe=False`` declares it (no probe is computed: a large model).
        """
        src = WeightSource.from_checkpoint(model_dir)
        prov = provenance or Provenance(str(Path(model_dir).resolve()), "", 0)
        identity = identity_of(src, prov)
        if probe:
            self.runner.take_over(identity, probes=self._probe_for(model_dir, DEFAULT_TOLERANCE),
                                  min_verification=VerificationLevel.PROBE)
        else:
            self.runner.bootstrap(identity)
        committed = self.controller.committed
        assert committed is not None
        return committed

    # ------------------------------------------------------------------ the call
    def update(self, weights: Weights, provenance: Provenance, *, label: str | None = None,
               probe: PolicyProbe | ProbeSuite | bool = True,
               probe_tolerance: float = DEFAULT_TOLERANCE,
               reference_checksums: Mapping[str, str] | None = None,
               owner: str = "trainer", content_digest: bool = True) -> UpdateResult:
        """Install ``weights`` as the next policy version, verified, or raise UpdateFailed.

        ``probe=True`` computes the policy probe from ``weights`` (a module is
        used directly; a checkpoint or state dict is loaded into a reference
        model); ``probe=False`` validates by label and checksums only.
        """
        prepared = self.prepare(weights, provenance, probe=probe,
                                probe_tolerance=probe_tolerance,
                                reference_checksums=reference_checksums,
                                content_digest=content_digest)
        return self.apply(prepared, label=label, owner=owner)

    def prepare(self, weights: Weights, provenance: Provenance, *,
                probe: PolicyProbe | ProbeSuite | bool = True,
                probe_tolerance: float = DEFAULT_TOLERANCE,
                reference_checksums: Mapping[str, str] | None = None,
                content_digest: bool = True) -> PreparedUpdate:
        """Everything that does not touch the engine's serving: identity and probe.

        Done before the update is requested, so admission is closed only for
        the transition itself.
        """
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        src = WeightSource.of(weights)
        identity = identity_of(src, provenance, content=content_digest)
        pset: PolicyProbe | ProbeSuite | None
        if isinstance(probe, (PolicyProbe, ProbeSuite)):
            pset = probe
        elif probe:
            pset = self._probe_for(weights, probe_tolerance)
        else:
            pset = None
        return PreparedUpdate(src, provenance, identity, pset, reference_checksums)

    def apply(self, prepared: PreparedUpdate, *, label: str | None = None,
              owner: str = "trainer") -> UpdateResult:
        """Run the verified transition for a prepared update."""
        level = self._stage(prepared, VerificationLevel.DECLARED)
        return self._result(self.runner.run_update(prepared.identity, owner=owner, label=label,
                                                   min_verification=level))

    # ------------------------------------------------------------------ LoRA adapters
    def enable_adapters(self, *, base_model: Any = None, store: str | Path | None = None,
                        config: AdapterConfig | None = None, max_rank: int | None = None,
                        probe_tolerance: float = ADAPTER_TOLERANCE,
                        base_probe: str = "required", upload: bool = False) -> AdapterManager:
        """Manage LoRA-adapter versions on this engine (after ``bootstrap``).

        ``base_model``: the base the adapters apply to, for the references (a
        checkpoint directory or a HF causal LM; default: the managed engine's
        model directory). ``max_rank``: default the engine's ``--max-lora-rank``.
        ``base_probe``: when the base is probed beside a new adapter
        (``control.adapters.BASE_PROBE_MODES``). ``upload``: each version's files go
        into the engine's own store and are loaded from there (an engine started with
        ``transports.adapter_store.AdapterStore``, on a host that cannot read ours).
        The adapters' records go to this session's journal.
        """
        if self.adapters is not None:
            raise UpdateRefused("adapters are already enabled on this session")
        if self.controller.committed is None:
            raise UpdateRefused("bootstrap the session before enabling adapters")
        if base_model is None:
            if self.engine is None:
                raise BadInput("base_model is needed when the session does not manage the "
                               "engine")
            base_model = Path(self.engine.model_dir)
        if max_rank is None and self.engine is not None:
            max_rank = _flag_int(self.engine.extra_args, "--max-lora-rank")
        self.adapters = AdapterManager(
            self.http, self.controller, base_model=base_model, store=store, config=config,
            listener=self.journal.listener, max_rank=max_rank,
            calibrations=lambda: dict(self.vllm.calibrations),
            probe_tolerance=probe_tolerance, base_probe=base_probe, upload=upload)
        return self.adapters

    def update_adapter(self, adapter: Any, provenance: Provenance, *,
                       reference: Any = None) -> AdapterResult:
        """Publish ``adapter`` (a PEFT model or an adapter directory) as the next adapter
        version, verified before publish, without a drain; or raise ``UpdateFailed``
        (the previous adapter keeps serving) or ``UpdateRefused``/``BadInput``
        (nothing changed). ``reference``: the trainer's own PEFT model of the
        adapter, when the reference should come from it rather than from the files.
        """
        if self.adapters is None:
            self.enable_adapters()
        assert self.adapters is not None
        return self.adapters.update(adapter, provenance, reference=reference)

    # ------------------------------------------------------------------ colocated
    @property
    def asleep(self) -> int | None:
        """The level the engine sleeps at, or None when it is awake."""
        s = self.controller.current_sleep
        return None if s is None else s.level

    def sleep(self, level: int = 2, *, reference: bool | None = None) -> SleepReport:
        """Give the engine's GPU memory to the trainer: drain, then vLLM's sleep at ``level``.

        Level 2 (the default) discards the weights: the next wake must be
        ``wake_and_update``, which writes every parameter. Level 1 copies them
        to host memory (slow for a large model) so that ``wake`` can bring
        them back, verified against checksums taken now (``reference``,
        default: level 1 only). Raises ``UpdateFailed`` (READY when the engine
        was not touched, e.g. it has no sleep mode; TAINTED otherwise).
        """
        out = self.runner.sleep(level, reference=reference)
        ev = out.evidence
        free = None if ev is None else ev.memory_after.get("free_bytes")
        return SleepReport(level, out.freed_bytes, free if isinstance(free, int) else None,
                           out.total_s, out)

    def wake(self) -> WeightVersion:
        """Wake on the weights the engine had, verified unchanged, and serve them again.

        Refused, changing nothing, after a level-2 sleep (those weights are
        gone: use ``wake_and_update``).
        """
        s = self.controller.current_sleep
        if s is None:
            raise UpdateRefused("the engine is not asleep")
        if s.level == 2:
            raise UpdateRefused("the engine slept at level 2, which discarded its weights: "
                                "wake it with wake_and_update(weights, provenance); "
                                "nothing was changed")
        self.runner.wake()
        committed = self.controller.committed
        assert committed is not None
        return committed

    def wake_and_update(self, weights: Weights, provenance: Provenance, *,
                        label: str | None = None,
                        probe: PolicyProbe | ProbeSuite | bool = True,
                        probe_tolerance: float = DEFAULT_TOLERANCE,
                        reference_checksums: Mapping[str, str] | None = None,
                        owner: str = "trainer", content_digest: bool = True) -> UpdateResult:
        """The colocated update: wake the weights, write ``weights`` into them, wake the KV
        cache, reset caches, validate while paused (every parameter), resume, publish.

        ``weights`` as for ``update``. Any failure after the first wake taints
        the engine (its old weights are gone or unverified).
        """
        if self.controller.current_sleep is None:
            raise UpdateRefused("the engine is not asleep: use update()")
        prepared = self.prepare(weights, provenance, probe=probe,
                                probe_tolerance=probe_tolerance,
                                reference_checksums=reference_checksums,
                                content_digest=content_digest)
        level = self._stage(prepared, VerificationLevel.ENGINE_CHECKSUM)
        return self._result(self.runner.wake_update(prepared.identity, owner=owner,
                                                    label=label, min_verification=level))

    def _stage(self, prepared: PreparedUpdate, floor: VerificationLevel) -> VerificationLevel:
        """Stage a prepared update on the driver; the level it must reach (PROBE with a
        probe, else ``floor``). Refused before anything is drained or sent when the
        transport cannot carry it: e.g. an engine with a draft model and an update
        without draft weights (transports.drafted)."""
        why = transport_refusal(self.transport, prepared.source, engine_draft_of(self.vllm))
        if why is not None:
            raise UpdateRefused(why)
        self.vllm.stage(prepared.source, provenance=prepared.provenance,
                        reference_checksums=prepared.reference_checksums,
                        probes=prepared.probe)
        return VerificationLevel.PROBE if prepared.probe is not None else floor

    def _result(self, out: UpdateOutcome) -> UpdateResult:
        assert out.published is not None and self.controller.identity is not None
        return UpdateResult(out.published, self.controller.identity, out)

    def _probe_for(self, weights: Weights, tolerance: float) -> PolicyProbe | ProbeSuite:
        # Beside a CPU engine this process launched, the reference forward pass keeps
        # off the cores its ranks are pinned to (same numbers; 3-4x faster on 2 cores).
        from rolloutcore.engine.process import torch_threads

        with torch_threads(None if self.engine is None else self.engine.threads_beside()):
            return self._reference_probe(weights, tolerance)

    def _reference_probe(self, weights: Weights, tolerance: float) -> PolicyProbe | ProbeSuite:
        if isinstance(weights, (str, Path)):
            if is_vision_language(weights):  # text and image probes (issue 22)
                return vlm_probe(weights, tolerance=tolerance)
            return PolicyProbe.from_checkpoint(str(weights), tolerance=tolerance)
        if isinstance(weights, Mapping):
            if self.engine is None:
                raise BadInput("a probe from a state dict needs the engine's model config: "
                               "pass probe=PolicyProbe(...) or probe=False")
            return _probe_from_state_dict(weights, Path(self.engine.model_dir), tolerance)
        config = getattr(weights, "config", None)
        if isinstance(weights, WeightSource) or config is None:
            raise BadInput(f"no probe from a {type(weights).__name__} (a HF causal LM, a state "
                           "dict or a checkpoint has one): pass probe=PolicyProbe(...) or "
                           "probe=False")
        return PolicyProbe.from_model(weights, default_prompts(int(config.vocab_size)),
                                      tolerance=tolerance)

    def close(self) -> None:
        try:
            if self.adapters is not None:
                self.adapters.close()
            self.transport.close()
        finally:
            self.http.close()
            self.journal.close()
            if self.engine is not None:
                self.engine.stop()

    def __enter__(self) -> EngineSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _flag_int(args: Iterable[object], flag: str) -> int | None:
    """The int value of ``flag`` in a command line (``--flag N`` or ``--flag=N``)."""
    items = [str(a) for a in args]
    for i, a in enumerate(items):
        if a == flag and i + 1 < len(items) and items[i + 1].isdigit():
            return int(items[i + 1])
        if a.startswith(flag + "=") and a[len(flag) + 1:].isdigit():
            return int(a[len(flag) + 1:])
    return None


def _probe_from_state_dict(state: Mapping[str, Any], config_dir: Path,
                           tolerance: float) -> PolicyProbe:
    from transformers import AutoConfig, AutoModelForCausalLM

    from rolloutcore.verification.hf_load import HF_LOCK

    cfg = AutoConfig.from_pretrained(config_dir)
    with HF_LOCK:
        model = AutoModelForCausalLM.from_config(cfg)  # type: ignore[no-untyped-call]
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise BadInput(f"state dict does not fit the engine's model: missing {missing[:3]}, "
                       f"unexpected {unexpected[:3]}")
    return PolicyProbe.from_model(model, default_prompts(int(cfg.vocab_size)),
                                  tolerance=tolerance)


# ------------------------------------------------------------------ drafts

_METHODS = frozenset({"draft_model", "eagle"})


@dataclass(frozen=True)
class DraftSpec:
    """The draft an engine decodes with: vLLM's ``--speculative-config``.

    ``draft_model``: a separate, smaller causal LM with the target's
    vocabulary. ``eagle``: an EAGLE-1 head (vLLM's ``EagleLlamaForCausalLM``:
    ``fc`` and one decoder layer, fed the target's hidden states, borrowing
    the target's embedding and output projection, which only the target's
    round writes). Other heads (EAGLE-3, MTP) are not covered: their loaders
    rename or drop names in ways the receiver does not know, and it refuses
    them before anything changes (docs/speculative-drafts.md).
    """

    model_dir: Path
    num_speculative_tokens: int = 3
    method: str = "draft_model"

    def __post_init__(self) -> None:
        d = Path(self.model_dir) if isinstance(self.model_dir, (str, os.PathLike)) else None
        if d is None or not (d / "config.json").is_file():
            raise BadInput(f"draft model_dir must be a checkpoint directory with a "
                           f"config.json, got {self.model_dir!r}")
        object.__setattr__(self, "model_dir", d.resolve())
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
            raise BadInput(f"num_speculative_tokens must be an int in 1..16, got {n!r}")
        if self.method not in _METHODS:
            raise BadInput(f"method must be one of {sorted(_METHODS)}, got {self.method!r}")

    def config(self) -> dict[str, Any]:
        return {"method": self.method, "model": str(self.model_dir),
                "num_speculative_tokens": self.num_speculative_tokens}

    def engine_args(self) -> list[str]:
        """The engine's extra command-line arguments."""
        return ["--speculative-config", json.dumps(self.config(), sort_keys=True)]


@dataclass
class DraftedUpdateResult:
    """One drafted update: the version, the identity of the pair, and the evidence."""

    version: WeightVersion
    identity: WeightIdentity
    #: ``DraftedSource.parts()``: both content digests, the draft's manifest, the pair's.
    digests: dict[str, str]
    acceptance_before: AcceptanceSample | None
    acceptance_after: AcceptanceSample | None
    outcome: UpdateOutcome
    #: The transition's phases (``UpdateOutcome.breakdown``) and the transfer's two rounds.
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version.to_dict(), "identity": self.identity.to_dict(),
                "digests": dict(self.digests),
                "acceptance_before": None if self.acceptance_before is None
                else self.acceptance_before.to_dict(),
                "acceptance_after": None if self.acceptance_after is None
                else self.acceptance_after.to_dict(),
                "phases": dict(self.phases)}


def _vocab_size(model_dir: Path | None) -> int:
    if model_dir is None:
        return 256
    try:
        v = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return 256
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 2 else 256


class DraftedSession:
    """An ``EngineSession`` whose engine decodes with a draft model (see the module doc).

    ``min_acceptance``: the acceptance rate the live validation requires
    (``None``: measured and recorded, not required). ``acceptance_prompts``
    and ``acceptance_tokens`` shape the measuring window.
    """

    def __init__(self, session: EngineSession, *, min_acceptance: float | None = None,
                 acceptance_prompts: Sequence[Sequence[int]] | None = None,
                 acceptance_tokens: int = 32) -> None:
        if not isinstance(session, EngineSession):
            raise BadInput("session must be an EngineSession")
        if not isinstance(session.transport, DraftedGlooTransport) or \
                not session.transport.require_draft:
            raise BadInput("a drafted session needs a DraftedGlooTransport with "
                           "require_draft=True (every update carries the draft)")
        model_dir = None if session.engine is None else Path(session.engine.model_dir)
        prompts = acceptance_prompts or default_acceptance_prompts(_vocab_size(model_dir))
        self.acceptance = AcceptanceProbe(prompts, max_tokens=acceptance_tokens,
                                          min_acceptance=min_acceptance)
        self.session = session
        self.transport: DraftedGlooTransport = session.transport

    @classmethod
    def launch(cls, model_dir: str | Path, draft: DraftSpec | str | Path, *,
               min_acceptance: float | None = None, op_timeout_s: float = 120.0,
               journal_path: str | os.PathLike[str] | None = None,
               deadlines: Deadlines | None = None, start_timeout_s: float = 300.0,
               engine_kwargs: Mapping[str, Any] | None = None,
               transport: DraftedGlooTransport | None = None) -> DraftedSession:
        """Start a managed vLLM on ``model_dir`` decoding with ``draft``."""
        spec = draft if isinstance(draft, DraftSpec) else DraftSpec(Path(draft))
        if transport is not None and not isinstance(transport, DraftedGlooTransport):
            raise BadInput("transport must be a DraftedGlooTransport")
        kw = dict(engine_kwargs or {})
        kw["extra_args"] = [*kw.get("extra_args", ()), *spec.engine_args()]
        tr = transport or DraftedGlooTransport(op_timeout_s=op_timeout_s)
        s = EngineSession.launch(model_dir, transport=tr, journal_path=journal_path,
                                 deadlines=deadlines, start_timeout_s=start_timeout_s,
                                 engine_kwargs=kw)
        try:
            return cls(s, min_acceptance=min_acceptance)
        except BaseException:
            s.close()
            raise

    # ------------------------------------------------------------------ take over
    def bootstrap(self, model_dir: str | Path, draft_dir: str | Path,
                  provenance: Provenance | None = None) -> WeightVersion:
        """Take over the engine serving ``model_dir`` with draft ``draft_dir``.

        Version 0's identity names both (``policy_digest``); it is published at
        probe level: the target's policy probe, and the acceptance window (a
        gate when ``min_acceptance`` is set).
        """
        src = DraftedSource(WeightSource.from_checkpoint(model_dir),
                            WeightSource.from_checkpoint(draft_dir))
        prov = provenance or Provenance(str(Path(model_dir).resolve()), "", 0)
        identity = identity_of(src, prov)
        probes = ProbeSuite([PolicyProbe.from_checkpoint(str(model_dir),
                                                         tolerance=DEFAULT_TOLERANCE),
                             self.acceptance])
        self.session.runner.take_over(identity, probes=probes,
                                      min_verification=VerificationLevel.PROBE)
        committed = self.session.controller.committed
        assert committed is not None
        return committed

    # ------------------------------------------------------------------ the call
    def update(self, weights: Weights, provenance: Provenance, *,
               draft_weights: Weights | None = None,
               label: str | None = None, probe: PolicyProbe | ProbeSuite | bool = True,
               probe_tolerance: float = DEFAULT_TOLERANCE, owner: str = "trainer",
               measure_before: bool = True) -> DraftedUpdateResult:
        """Install target ``weights`` and ``draft_weights`` as one version, or raise.

        ``UpdateRefused`` (nothing changed) without ``draft_weights``;
        ``UpdateFailed`` as ``EngineSession.update``. ``measure_before``: an
        acceptance window on the current policy first (read-only generation; only
        while the engine serves, READY).
        """
        prepared = self.prepare(weights, provenance, draft_weights=draft_weights,
                                probe=probe, probe_tolerance=probe_tolerance)
        return self.apply(prepared, label=label, owner=owner, measure_before=measure_before)

    def prepare(self, weights: Weights, provenance: Provenance, *,
                draft_weights: Weights | None = None,
                probe: PolicyProbe | ProbeSuite | bool = True,
                probe_tolerance: float = DEFAULT_TOLERANCE) -> PreparedUpdate:
        """Identity of the pair and the probes; touches no engine."""
        if draft_weights is None:
            raise UpdateRefused(DRAFT_REFUSAL)
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        if not isinstance(probe, (bool, PolicyProbe, ProbeSuite)):
            raise BadInput("probe must be a bool, a PolicyProbe or a ProbeSuite")
        src = DraftedSource(WeightSource.of(weights), WeightSource.of(draft_weights))
        # The target's probe exactly as a plain update computes it (no digest read here).
        target = self.session.prepare(weights, provenance, probe=probe,
                                      probe_tolerance=probe_tolerance, content_digest=False)
        probes = (None if target.probe is None
                  else ProbeSuite([target.probe, self.acceptance]))
        return PreparedUpdate(src, provenance, identity_of(src, provenance), probes, None)

    def apply(self, prepared: PreparedUpdate, *, label: str | None = None,
              owner: str = "trainer", measure_before: bool = True) -> DraftedUpdateResult:
        """Run the one transition for a prepared pair."""
        if not isinstance(prepared, PreparedUpdate) or \
                not isinstance(prepared.source, DraftedSource):
            raise UpdateRefused(DRAFT_REFUSAL)
        # A window on the serving policy (read-only); not on an engine that does not
        # serve (a tainted one stays paused: the requests would wait).
        serving = self.session.controller.state is State.READY
        before = (self.acceptance.measure(self.session.http) if measure_before and serving
                  else None)
        self.acceptance.last = None
        res = self.session.apply(prepared, label=label, owner=owner)
        after = self.acceptance.last
        phases = dict(res.outcome.breakdown())
        phases.update(self.transport.last_phases)
        return DraftedUpdateResult(res.version, res.identity, prepared.source.parts(),
                                   before, after, res.outcome, phases)

    # ------------------------------------------------------------------ watch
    def check_draft(self) -> Check:
        """An acceptance window now, judged (``min_acceptance``): a draft left on other
        weights than its target's shows here, while every output token looks right."""
        return self.acceptance.run(self.session.http)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> DraftedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
