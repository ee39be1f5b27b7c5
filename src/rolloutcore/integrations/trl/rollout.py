"""``RolloutCoreRollout``: GRPOTrainer's ``rollout_func`` through RolloutCore."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.core.adapters import AdapterConfig, AdapterVersion
from rolloutcore.core.records import State
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import (
    EngineIdentity,
    Provenance,
    WeightVersion,
)
from rolloutcore.errors import (
    BadInput,
    EffectError,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.integrations.trl.common import (
    DEFAULT_PROBE_TOLERANCE,
    GenerationReport,
    Interruption,
    StepReport,
    TrainingStopped,
    UpdateReport,
)
from rolloutcore.integrations.trl.engines import (
    EngineSample,
    PublishedUpdate,
    RolloutEngine,
    _GatewayEngine,
    _SessionEngine,
    interrupted_record,
)
from rolloutcore.integrations.trl.weights import (
    engine_state_dict,
    probe_for,
)
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
from rolloutcore.provenance.trajectory import (
    AdapterUse,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    TrajectoryGroup,
    TrajectorySample,
    group_id_for,
)
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    from rolloutcore.integrations.trl.engines import Probe
    from rolloutcore.transports.base import WeightTransport

__all__ = ["LORA_RANKS", "RolloutCoreRollout", "lora_engine_args"]

#: The ``--max-lora-rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: What a LoRA run needs of vLLM besides its flags: adapters loaded at runtime.
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
#: How often the wait for a step's samples wakes to run a pending Ctrl-C's handler.
_INTERRUPT_POLL_S = 0.1


def lora_engine_args(rank: int, max_loras: int = 2) -> list[str]:
    """vLLM's flags for adapters up to ``rank``: ``--max-lora-rank`` is the smallest
    value vLLM accepts that holds it; ``max_loras`` adapters in one batch (a
    synchronous run has one in use, and the next one beside it while it is probed)."""
    check_int("LoRA rank", rank, 1, LORA_RANKS[-1])
    check_int("max_loras", max_loras, 1)
    vllm_rank = next(r for r in LORA_RANKS if r >= rank)
    return ["--enable-lora", "--max-loras", str(max_loras), "--max-lora-rank", str(vllm_rank)]

# --------------------------------------------------------------------------- rollout


class _WeightSync:
    """Stands in for TRL's ``vllm_generation``: TRL calls ``sync_weights`` when its step moved."""

    def __init__(self, rollout: RolloutCoreRollout, trainer: Any) -> None:
        self._rollout = rollout
        self._trainer = trainer

    def sync_weights(self) -> None:
        self._rollout.sync(self._trainer)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"RolloutCore generates for this trainer; TRL's vLLM backend "
                             f"attribute {name!r} does not exist here")


@dataclass
class _Pending:
    prompt_index: int
    group_id: str
    prompt: tuple[int, ...]
    futures: list[Future[EngineSample]] = field(default_factory=list)
    specs: list[SamplingSpec] = field(default_factory=list)


class RolloutCoreRollout:
    """TRL's ``rollout_func``: verified updates, bound and recorded samples.

    ``RolloutCoreRollout(session, checkpoint=..., run=...)`` over an
    ``EngineSession`` (bootstrapped on ``checkpoint``) or any
    ``RolloutEngine``, or the constructors ``launch`` and ``through_gateway``.
    ``trajectories`` is the trajectory file (opened now: one writer).
    ``max_concurrency`` bounds the requests in flight (vLLM batches them).

    **LoRA** (``adapters=True``; ``launch(..., lora_rank=R)`` starts the engine
    for it, ``through_gateway(..., adapters=True)`` uses a ``serve --lora``
    gateway, publishing through ``RolloutCoreClient.update_adapter``): the
    trainer's model is a PEFT model (TRL's ``peft_config``) and the
    base never changes. Before the first generation and after every optimizer
    step the trainer's adapter (not merged) is published as the next adapter
    version (``EngineSession.update_adapter``: loaded under a new name, listed,
    probed through it against the trainer's own PEFT model and the base probed
    beside it, then published; no drain). Every request is bound to (base
    version, adapter version) and sent as that adapter; every sample records
    both (trajectory schema 5, ``adapter``) and is refused unless its adapter
    is the one published for its step.

    **Interrupted** (Ctrl-C: ``KeyboardInterrupt``, or ``SystemExit``): the
    interrupt propagates, never as a sample failure or a ``TrainingStopped``.
    During generation the step's requests not yet started are cancelled and
    the running ones awaited for at most ``interrupt_wait_s`` (nothing of the
    step is recorded or returned); during an update, the update left open is
    ended decided at once (``engines.end_open_update``: resumed on the old
    version when nothing was mutated, else TAINTED and fenced). What was
    stopped is ``interrupted`` (an ``Interruption``), and ``close`` writes it to
    the journal as the ``interrupted`` record (in process).
    """

    def __init__(self, engine: Any, *, checkpoint: str | Path, run: str,
                 trajectories: str | Path | None = None, origin: str | None = None,
                 probe: bool = True, probe_tolerance: float = DEFAULT_PROBE_TOLERANCE,
                 importance_sampling: bool = True,
                 max_concurrency: int = 32, owner: str = "trl",
                 interrupt_wait_s: float = 10.0, adapters: bool = False) -> None:
        from rolloutcore.session import EngineSession

        if isinstance(engine, EngineSession):
            engine = _SessionEngine(engine, owns=False, adapters=bool(adapters))
        elif not all(callable(getattr(engine, m, None)) for m in (
                "committed", "update", "generate", "engine_identity", "close")):
            raise BadInput("engine must be an EngineSession or a RolloutEngine (or use "
                           "RolloutCoreRollout.launch / through_gateway)")
        if adapters and not (callable(getattr(engine, "update_adapter", None))
                             and getattr(engine, "adapters", False)):
            raise BadInput("adapters=True needs an engine that publishes LoRA adapters (an "
                           "EngineSession with adapters enabled, launch(lora_rank=...), or "
                           "through_gateway(adapters=True) to a serve --lora gateway)")
        ckpt = Path(checkpoint)
        if not (ckpt / "config.json").is_file():
            raise BadInput(f"{ckpt} is not a checkpoint directory (no config.json)")
        if not isinstance(run, str) or not run:
            raise BadInput("run must be a non-empty string")
        # The run name is part of every group id and seed: check it once, here.
        group_id_for(run, 0, 0)
        check_int("max_concurrency", max_concurrency, 1)
        self.engine: RolloutEngine = engine
        self.run = run
        self.checkpoint = ckpt
        self.origin = origin or str(ckpt.resolve())
        self.probe = bool(probe)
        if isinstance(probe_tolerance, bool) or not isinstance(probe_tolerance, (int, float)) \
                or not 0 < probe_tolerance < math.inf:
            raise BadInput(f"probe_tolerance must be a positive number, got {probe_tolerance!r}")
        self.probe_tolerance = float(probe_tolerance)
        self.importance_sampling = bool(importance_sampling)
        if isinstance(interrupt_wait_s, bool) or not isinstance(interrupt_wait_s, (int, float)) \
                or not 0 <= interrupt_wait_s < math.inf:
            raise BadInput(f"interrupt_wait_s must be a number >= 0, got {interrupt_wait_s!r}")
        self.interrupt_wait_s = float(interrupt_wait_s)
        self.owner = owner
        #: A LoRA run: adapters published, the base never updated.
        self.adapters = bool(adapters)
        #: The adapter version published for the current step (a LoRA run).
        self.adapter: AdapterVersion | None = None
        #: The same, as each engine that acknowledged it holds it (by replica; ``""``:
        #: one engine): a sample is credited only through its own engine's copy.
        self.adapter_on: Mapping[str, AdapterVersion] = {}
        self.manifest = WeightSource.from_checkpoint(ckpt).manifest()
        version, identity = engine.committed()
        self.version = version
        self.identity = identity
        self.synced_step: int = identity.provenance.step
        self.steps: list[StepReport] = []
        self.updates: list[UpdateReport] = []
        self.samples_generated = 0
        self.samples_recorded = 0
        self.stopped: TrainingStopped | None = None
        #: What the last interrupt stopped (reset by every call), written to the
        #: journal by ``close``.
        self.interrupted: Interruption | None = None
        self._pending_update: UpdateReport | None = None
        self._next_index: dict[int, int] = {}
        self._engine_identity: EngineIdentity | None = None
        self._pool: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=max_concurrency,
                                        thread_name_prefix="rolloutcore-gen")
        self._adopted: Any = None
        self.recorder = TrajectoryRecorder(trajectories) if trajectories is not None else None
        self.trajectories = None if trajectories is None else Path(trajectories)

    # ------------------------------------------------------------------ constructors
    @classmethod
    def launch(cls, checkpoint: str | Path, *, run: str, trajectories: str | Path | None = None,
               journal: str | Path | None = None, transport: WeightTransport | None = None,
               engine_kwargs: Mapping[str, Any] | None = None, progress: bool = False,
               start_timeout_s: float = 600.0, lora_rank: int | None = None,
               adapter_config: AdapterConfig | None = None,
               adapter_store: str | Path | None = None,
               **kw: Any) -> RolloutCoreRollout:
        """Start vLLM on ``checkpoint`` under RolloutCore and bootstrap it (step 0).

        ``lora_rank``: a LoRA run (``adapters=True``): vLLM is started with
        ``lora_engine_args(lora_rank)`` and runtime adapter loading, and the
        session's adapters enabled (``adapter_config``: default 4 loaded, one
        superseded version kept), with the rollout's probe tolerance;
        ``adapter_store``: where each adapter version's directory is written
        (default a temporary one, removed at close; a given one is kept, holding
        the versions not retired, for replay).
        """
        from rolloutcore.session import EngineSession

        ekw = dict(engine_kwargs or {})
        if lora_rank is not None:
            ekw["extra_args"] = [*ekw.get("extra_args", ()), *lora_engine_args(lora_rank)]
            ekw["env"] = {**dict(ekw.get("env") or {}), **LORA_ENV}
        if adapter_config is not None and not isinstance(adapter_config, AdapterConfig):
            raise BadInput("adapter_config must be an AdapterConfig")
        if (adapter_config is not None or adapter_store is not None
                or kw.pop("adapters", None)) and lora_rank is None:
            raise BadInput("a LoRA run needs lora_rank (the engine's --max-lora-rank)")
        session = EngineSession.launch(checkpoint, transport=transport, journal_path=journal,
                                       engine_kwargs=ekw, progress=progress,
                                       start_timeout_s=start_timeout_s)
        try:
            origin = kw.get("origin") or str(Path(checkpoint).resolve())
            session.bootstrap(checkpoint, Provenance(origin, run, 0))
            if lora_rank is not None:
                session.enable_adapters(
                    config=adapter_config or AdapterConfig(max_loaded=4, max_staleness=1),
                    store=adapter_store,
                    probe_tolerance=float(kw.get("probe_tolerance", DEFAULT_PROBE_TOLERANCE)))
            return cls(_SessionEngine(session, owns=True, adapters=lora_rank is not None),
                       checkpoint=checkpoint, run=run, trajectories=trajectories,
                       adapters=lora_rank is not None, **kw)
        except BaseException as exc:
            try:
                if not isinstance(exc, Exception):  # the journal says what stopped it
                    session.runner.emit(interrupted_record(
                        session.controller, Interruption("bootstrap", 0, type(exc).__name__)))
            finally:
                session.close()
            raise

    @classmethod
    def through_gateway(cls, url: str, token: str, *, checkpoint: str | Path, run: str,
                        trajectories: str | Path | None = None,
                        transport: WeightTransport | None = None, data_token: str | None = None,
                        timeout_s: float = 300.0, min_verification: str | None = None,
                        adapter_dir: str | Path | None = None, **kw: Any) -> RolloutCoreRollout:
        """Generate and update through a ``rolloutcore serve`` gateway at ``url``.

        ``token`` is the gateway's control token; ``transport`` moves the
        weights into the engine the gateway names (default: gloo, the CPU
        backend ``rolloutcore serve`` starts vLLM with). ``min_verification``
        ``None`` asks for the gateway's floor (``probe`` by default): the
        policy probe's expectations are computed here, from the trained model,
        and the gateway compares the engine with them.

        ``adapters=True``: a LoRA run through a gateway started with ``serve
        --lora`` on ``checkpoint``. The trainer's adapter is saved to a fresh
        directory under ``adapter_dir`` (default the system's temporary directory;
        the gateway must be able to read it: the same machine) and published
        through ``RolloutCoreClient.update_adapter``; requests ask for the model
        ``policy`` and every sample takes the adapter version its answer names
        (refused unless it is the one published for its step). No weights move:
        ``transport`` is not used.
        """
        adapters = bool(kw.get("adapters"))
        if adapter_dir is not None and not adapters:
            raise BadInput("adapter_dir is for adapters=True (a LoRA run)")
        if transport is None and not adapters:
            from rolloutcore.transports.gloo import GlooTransport

            transport = GlooTransport()
        kw.setdefault("probe", True)  # expectations from the model; the gateway compares
        eng = _GatewayEngine(url, token, transport=transport, data_token=data_token,
                             timeout_s=timeout_s, min_verification=min_verification,
                             adapters=adapters, adapter_dir=adapter_dir,
                             probe_tolerance=float(kw.get("probe_tolerance",
                                                          DEFAULT_PROBE_TOLERANCE)))
        try:
            return cls(eng, checkpoint=checkpoint, run=run, trajectories=trajectories, **kw)
        except BaseException:
            eng.close()
            raise

    @property
    def session(self) -> Any:
        """The in-process ``EngineSession`` (controller, journal, HTTP client); else None."""
        return self.engine.session if isinstance(self.engine, _SessionEngine) else None

    # ------------------------------------------------------------------ TRL's hooks
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """TRL's ``rollout_func(prompts, trainer)``."""
        self._check_usable()
        self.interrupted = None
        t0 = time.monotonic()
        self._adopt(trainer)
        step = int(trainer.state.global_step)
        hooked = self._pending_update
        upd = self.sync(trainer)
        self._pending_update = None
        # An update TRL's own sync hook made just before this call is part of it.
        before = upd.total_s if upd is not None and upd is hooked else 0.0
        training = bool(getattr(trainer.model, "training", True))
        n = int(trainer.num_generations if training else
                getattr(trainer, "num_generations_eval", None) or trainer.num_generations)
        unique = _groups(prompts, n)
        ids = self._tokenize(trainer, unique)
        spec = self._sampling(trainer)
        try:
            out, gen = self._generate(step, ids, n, spec)
        except TrainingStopped as exc:
            self._stop(exc)
            raise
        self.steps.append(StepReport(step, upd, gen, before + time.monotonic() - t0))
        self._metrics(trainer, training, upd, gen)
        return out

    def sync(self, trainer: Any) -> UpdateReport | None:
        """Push the trainer's weights (verified) if its step moved since the last push.

        Idempotent per step: TRL's sync hook and the rollout call may both
        ask. Returns the update made by this call or the one made earlier
        for the same step by TRL's hook (once), else ``None``.
        """
        self._check_usable()
        self.interrupted = None
        step = int(trainer.state.global_step)
        # A LoRA run publishes the trainer's adapter before its first generation too.
        if step == self.synced_step and not (self.adapters and self.adapter is None):
            upd, self._pending_update = self._pending_update, None
            return upd
        try:
            return self._push(trainer, step)
        except BaseException as exc:
            if not isinstance(exc, Exception):
                self._update_interrupted(step, exc)
            raise

    def _push(self, trainer: Any, step: int) -> UpdateReport:
        if getattr(getattr(trainer, "accelerator", None), "num_processes", 1) != 1:
            raise BadInput("RolloutCoreRollout runs in one training process")
        model = trainer.model
        acc = getattr(trainer, "accelerator", None)
        if acc is not None and hasattr(acc, "unwrap_model"):
            model = acc.unwrap_model(model)
        t0 = time.monotonic()
        if self.adapters:
            return self._push_adapter(model, step, t0)
        state = engine_state_dict(model, self.manifest)
        probe: Probe = False
        if self.probe:
            probe = probe_for(model, state, tolerance=self.probe_tolerance)
        prov = Provenance(self.origin, self.run, step)
        prepare_s = time.monotonic() - t0
        try:
            pub = self.engine.update(state, prov, probe, self.owner)
        except (UpdateFailed, UpdateRefused, EffectError) as exc:
            raise self._update_failed(step, exc) from exc
        last = getattr(probe, "last", None)
        return self._published(pub, step, UpdateReport(
            step, pub.version, pub.identity, prepare_s, dict(pub.phases_s),
            time.monotonic() - t0, None if last is None else float(last.max_abs_diff)))

    def _published(self, pub: PublishedUpdate, step: int, rep: UpdateReport) -> UpdateReport:
        """``pub`` is the version held from ``step`` on; ``rep`` its report."""
        self.version, self.identity, self.synced_step = pub.version, pub.identity, step
        self.updates.append(rep)
        self._pending_update = rep
        return rep

    def _push_adapter(self, model: Any, step: int, t0: float) -> UpdateReport:
        """A LoRA run: the trainer's adapter published as the next adapter version."""
        from rolloutcore.verification.adapters import is_peft_model

        if not is_peft_model(model):
            raise BadInput("a LoRA run (adapters=True) trains a PEFT model: give the "
                           "GRPOTrainer a peft_config (or a PeftModel)")
        prov = Provenance(self.origin, self.run, step)
        try:
            pub = self.engine.update_adapter(  # type: ignore[attr-defined]
                model, prov, self.manifest.params[0].dtype)
        except (UpdateFailed, UpdateRefused, EffectError) as exc:
            raise self._update_failed(step, exc, "adapter: ") from exc
        assert pub.adapter is not None
        self.adapter = pub.adapter
        self.adapter_on = dict(pub.adapters) or {"": pub.adapter}
        phases = dict(pub.phases_s)
        return self._published(pub, step, UpdateReport(
            step, pub.version, pub.identity, float(phases.get("prepare", 0.0)), phases,
            time.monotonic() - t0, pub.probe_max_abs_diff, pub.adapter))

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if self.stopped is not None:
            raise self.stopped
        if self._pool is None:
            raise BadInput("this rollout function is closed")

    def _stop(self, err: TrainingStopped) -> None:
        if self.stopped is None:
            self.stopped = err

    def _update_failed(self, step: int, exc: RolloutCoreError, what: str = ""
                       ) -> TrainingStopped:
        """The update for ``step`` failed (its phase, classification and engine state):
        training stops, with this error."""
        err = TrainingStopped(step, "update_failed", f"{what}{type(exc).__name__}: {exc}",
                              phase=getattr(exc, "phase", None),
                              classification=getattr(exc, "classification", None),
                              state=getattr(exc, "state", None), published=self.version)
        self._stop(err)
        return err

    def _update_interrupted(self, step: int, exc: BaseException) -> None:
        """The update for ``step`` was interrupted: end what it left open, say so."""
        cause = type(exc).__name__
        end = getattr(self.engine, "end_update", None)
        ended, detail = None, ""
        try:
            if callable(end):
                ended = end(f"interrupted ({cause}) during the update to step {step}")
        except Exception as e2:  # the interrupt propagates whatever happens here
            detail = f"ending the update failed: {type(e2).__name__}: {e2}"
        self.interrupted = Interruption("update", step, cause, ended, detail=detail)
        if ended is not None and ended.state_after is State.TAINTED:
            # The engine serves nothing now: a later call says why instead of failing
            # on a refused admission.
            self._stop(TrainingStopped(
                step, "update_failed", f"interrupted ({cause}) during the update",
                phase=ended.step,
                classification=None if ended.classification is None
                else ended.classification.value, state=ended.state_after.value,
                published=self.version))

    def note_interruption(self, phase: str, exc: BaseException | str,
                          step: int | None = None, detail: str = "") -> Interruption:
        """Record an interrupt the caller caught outside the rollout function's own calls
        (TRL's loss, the reward, a setup step); one the rollout function saw itself
        (``interrupted``) is kept. ``close`` writes it to the journal."""
        if self.interrupted is None:
            cause = exc if isinstance(exc, str) else type(exc).__name__
            self.interrupted = Interruption(phase, step, cause, detail=detail)
        return self.interrupted

    def _adopt(self, trainer: Any) -> None:
        """Once per trainer: checks, and TRL's importance-sampling correction switched on."""
        if self._adopted is trainer:
            return
        for attr in ("state", "model", "num_generations", "processing_class"):
            if not hasattr(trainer, attr):
                raise BadInput(f"not a TRL GRPOTrainer: it has no {attr!r}")
        if getattr(getattr(trainer, "accelerator", None), "num_processes", 1) != 1:
            raise BadInput("RolloutCoreRollout runs in one training process")
        if self.importance_sampling and not getattr(trainer, "tools", None) and getattr(
                trainer, "vllm_importance_sampling_correction", False):
            if getattr(trainer, "use_vllm", False) and not isinstance(
                    getattr(trainer, "vllm_generation", None), _WeightSync):
                raise BadInput("the trainer runs its own vLLM (use_vllm=True); RolloutCore "
                               "generates instead: leave use_vllm off")
            if getattr(trainer, "loss_type", None) == "vespo" and getattr(
                    trainer, "vllm_importance_sampling_mode", None) not in (
                    "token_truncate", "token_mask"):
                # TRL checks this at init, only for its own vLLM backend.
                raise BadInput("loss_type 'vespo' with the importance-sampling correction "
                               "needs vllm_importance_sampling_mode 'token_truncate' or "
                               "'token_mask'")
            trainer.use_vllm = True
            trainer.vllm_generation = _WeightSync(self, trainer)
            trainer._last_loaded_step = self.synced_step
        self._adopted = trainer

    def _tokenize(self, trainer: Any, prompts: list[Any]) -> list[tuple[int, ...]]:
        tok = trainer.processing_class
        if _conversational(prompts[0]):
            enc = tok.apply_chat_template(
                conversation=prompts, chat_template=getattr(trainer, "chat_template", None),
                add_generation_prompt=True, tokenize=True, return_dict=True,
                **(getattr(trainer, "chat_template_kwargs", None) or {}))
            raw = enc["input_ids"]
        else:
            raw = tok(text=prompts)["input_ids"]
        out = []
        for p, ids in zip(prompts, raw, strict=True):
            t = tuple(int(x) for x in ids)
            if not t:
                raise BadInput(f"prompt {p!r} tokenizes to nothing")
            out.append(t)
        return out

    @staticmethod
    def _sampling(trainer: Any) -> SamplingSpec:
        max_tokens = int(trainer.max_completion_length)
        top_k = int(getattr(trainer, "top_k", 0) or 0)
        extra: dict[str, Any] = {"logprobs": 0, "ignore_eos": False}
        min_p = getattr(trainer, "min_p", None)
        if min_p:
            extra["min_p"] = float(min_p)
        rep = getattr(trainer, "repetition_penalty", 1.0)
        if rep is not None and rep != 1.0:
            extra["repetition_penalty"] = float(rep)
        gk = getattr(getattr(trainer, "args", None), "generation_kwargs", None) or {}
        extra.update({k: v for k, v in dict(gk).items()
                      if k not in ("temperature", "top_p", "top_k", "max_tokens", "seed", "n")})
        return SamplingSpec(float(trainer.temperature), float(trainer.top_p or 1.0),
                            top_k if top_k > 0 else -1, max_tokens, 0, SEED_DERIVATION, extra)

    def _generate(self, step: int, prompts: list[tuple[int, ...]], n: int,
                  base: SamplingSpec) -> tuple[dict[str, Any], GenerationReport]:
        pending: list[_Pending] = []
        try:
            return self._generate_all(step, prompts, n, base, pending)
        except BaseException as exc:
            if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit
                self._generation_interrupted(step, pending, exc)
            raise

    def _generation_interrupted(self, step: int, pending: list[_Pending],
                                exc: BaseException) -> None:
        """Cancel what has not started, await the rest for at most ``interrupt_wait_s``.

        Nothing of the step is recorded or returned; the samples that completed
        released their bindings (their ``complete`` records), as did the cancelled
        ones, which were never admitted.
        """
        futures = [f for p in pending for f in p.futures]
        for f in futures:
            f.cancel()
        running = [f for f in futures if not f.cancelled()]
        cause = type(exc).__name__
        self.interrupted = Interruption("generation", step, cause, samples=len(futures),
                                        unfinished=len(running))
        done, not_done = wait(running, timeout=self.interrupt_wait_s)
        completed = sum(1 for f in done if not f.cancelled() and f.exception() is None)
        self.interrupted = Interruption("generation", step, cause, samples=len(futures),
                                        completed=completed, unfinished=len(not_done))

    def _generate_all(self, step: int, prompts: list[tuple[int, ...]], n: int,
                      base: SamplingSpec, pending: list[_Pending],
                      ) -> tuple[dict[str, Any], GenerationReport]:
        pool = self._pool
        assert pool is not None
        first = self._next_index.get(step, 0)
        version, adapter, adapter_on = self.version, self.adapter, self.adapter_on
        t0 = time.monotonic()
        for k, p in enumerate(prompts):
            idx = first + k
            gid = group_id_for(self.run, step, idx)
            pend = _Pending(idx, gid, p)
            for i in range(n):
                spec = SamplingSpec(base.temperature, base.top_p, base.top_k, base.max_tokens,
                                    derive_seed(self.run, step, gid, i), SEED_DERIVATION,
                                    base.extra)
                pend.specs.append(spec)
                pend.futures.append(pool.submit(self.engine.generate, f"{gid}/{i}", p, spec))
            pending.append(pend)
        self._next_index[step] = first + len(prompts)
        # Every future is awaited before anything is raised. An interrupt while
        # waiting is not a sample's failure: it propagates (``_generate``). The wait
        # wakes every ``_INTERRUPT_POLL_S``: CPython runs a signal's Python handler only
        # between bytecodes, so a Ctrl-C that lands just before the wait blocks would
        # otherwise be raised only once the last sample ended (seen under load).
        not_done = {f for pend in pending for f in pend.futures}
        while not_done:
            not_done = wait(not_done, timeout=_INTERRUPT_POLL_S).not_done
        results: list[list[EngineSample]] = []
        errors: list[BaseException] = []
        for pend in pending:
            row = []
            for f in pend.futures:
                failed = (EffectError("generate", "cancelled: the rollout function was "
                                      "closed meanwhile", mutation_started=False)
                          if f.cancelled() else f.exception())
                if failed is None:
                    row.append(f.result())
                else:
                    errors.append(failed)
            results.append(row)
        generate_s = time.monotonic() - t0
        self.samples_generated += sum(len(r) for r in results)
        if errors:
            e = errors[0]
            st = getattr(e, "state", None)
            raise TrainingStopped(step, "generation", f"{len(errors)} of {len(prompts) * n} "
                                  f"samples failed; first: {type(e).__name__}: {e}",
                                  state=st, published=self.version) from e
        for pend, row in zip(pending, results, strict=True):
            for i, s in enumerate(row):
                problem = _attribution_problem(s, version) or (
                    _adapter_problem(s, adapter_on) if self.adapters else None)
                if problem:
                    raise TrainingStopped(step, "attribution",
                                          f"sample {pend.group_id}/{i}: {problem}",
                                          published=self.version)
        t1 = time.monotonic()
        engine = self._engine_id()
        groups = []
        for pend, row in zip(pending, results, strict=True):
            groups.append(TrajectoryGroup(tuple(
                TrajectorySample(self.run, step, pend.group_id, pend.prompt_index, n, i,
                                 Prompt(pend.prompt), pend.specs[i],
                                 SampledCompletion(s.token_ids, s.finish_reason, s.logprobs,
                                                   None, s.spans),
                                 s.binding, engine, s.stamps, fleet=s.fleet,
                                 adapter=None if s.adapter is None else AdapterUse(
                                     s.adapter.name, s.adapter.generation,
                                     s.adapter.content_digest, s.adapter.base))
                for i, s in enumerate(row))))
        if self.recorder is not None:
            for g in groups:
                self.recorder.append_group(g)
                self.samples_recorded += len(g)
        record_s = time.monotonic() - t1
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                               "rc_version": [], "rc_generation": [], "rc_rollout_id": []}
        if self.adapters:
            out["rc_adapter"] = []
        tokens = 0
        for pend, row in zip(pending, results, strict=True):
            for s in row:
                out["prompt_ids"].append(list(pend.prompt))
                out["completion_ids"].append(list(s.token_ids))
                out["logprobs"].append(list(s.logprobs))
                out["rc_version"].append(s.binding.version.label)
                out["rc_generation"].append(s.binding.version.generation)
                out["rc_rollout_id"].append(s.binding.rollout_id)
                if self.adapters:
                    out["rc_adapter"].append(None if s.adapter is None else s.adapter.name)
                tokens += len(s.token_ids)
        return out, GenerationReport(step, version, len(prompts), len(prompts) * n, tokens,
                                     generate_s, record_s, first, adapter)

    def _engine_id(self) -> EngineIdentity:
        if self._engine_identity is None:
            self._engine_identity = self.engine.engine_identity()
        return self._engine_identity

    @staticmethod
    def _metrics(trainer: Any, training: bool, upd: UpdateReport | None,
                 gen: GenerationReport) -> None:
        """RolloutCore's numbers in TRL's own logs (averaged and printed with its metrics)."""
        m = getattr(trainer, "_metrics", None)
        if not isinstance(m, Mapping):
            return
        mode = m.get("train" if training else "eval")
        if mode is None:
            return
        with contextlib.suppress(Exception):
            mode["rolloutcore/generation"].append(float(gen.version.generation))
            mode["rolloutcore/generate_s"].append(gen.generate_s)
            if upd is not None:
                mode["rolloutcore/update_s"].append(upd.total_s)
                mode["rolloutcore/drain_s"].append(upd.drain_s)

    def close(self) -> None:
        """Stop the generation threads, close the trajectory file (and an owned engine).

        After an interrupt (``interrupted``) the journal gets its ``interrupted``
        record first, any update still open ended before it (in process; a
        gateway's journal is the gateway's own).
        """
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        try:
            record = getattr(self.engine, "record_interruption", None)
            if self.interrupted is not None and callable(record):
                self.interrupted = record(self.interrupted)
        finally:
            try:
                if self.recorder is not None:
                    self.recorder.close()
            finally:
                try:
                    self.engine.close()
                finally:
                    if pool is not None:
                        pool.shutdown(wait=True)

    def __enter__(self) -> RolloutCoreRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _conversational(prompt: object) -> bool:
    """TRL's test: a prompt is a list of messages (dicts with a role)."""
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], Mapping) \
        and "role" in prompt[0]


def _groups(prompts: Sequence[Any], n: int) -> list[Any]:
    """The distinct prompts of TRL's batch, which repeats each one ``n`` times in a row."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise BadInput("prompts must be a non-empty list")
    if n < 1 or len(prompts) % n:
        raise BadInput(f"{len(prompts)} prompts are not groups of num_generations={n}")
    out = []
    for k in range(0, len(prompts), n):
        block = prompts[k:k + n]
        if any(p != block[0] for p in block[1:]):
            raise BadInput(f"prompts {k}..{k + n - 1} are not one prompt repeated "
                           f"{n} times (TRL's RepeatSampler order)")
        out.append(block[0])
    return out


def _adapter_problem(s: EngineSample, expected: Mapping[str, AdapterVersion]) -> str | None:
    """Why ``s`` cannot be credited to the adapter version published for its step
    (``expected``: as each engine holds it, by replica; ``""``: one engine)."""
    if s.adapter is None:
        return "generated without an adapter in a LoRA run"
    where = "" if s.fleet is None else s.fleet.replica
    want = expected.get(where)
    if s.adapter != want:
        on = f" on {where}" if where else ""
        return (f"generated through adapter {s.adapter.name}{on} but this step's adapter"
                f"{' there' if on else ''} is {None if want is None else want.name}")
    if s.adapter.base != s.binding.version.label:
        return (f"adapter {s.adapter.name} was verified on {s.adapter.base}, the sample is "
                f"bound to {s.binding.version.label}")
    return None


def _attribution_problem(s: EngineSample, expected: WeightVersion) -> str | None:
    """Why ``s`` cannot be credited to ``expected``; ``None`` when it can."""
    bound = s.binding.version
    if not s.attributable:
        return (f"its binding to {bound.label} did not survive (the engine left service "
                "while it ran)")
    if s.fleet is not None:
        # Through a fleet: ``expected`` is the fleet's version; the binding is the
        # engine version its replica serves it as (checked by the engine, against the
        # fleet's status, and by the audit, against its journals).
        fl = s.fleet
        if (fl.fleet_version, fl.fleet_label) != (expected.generation, expected.label):
            return (f"answered by {fl.replica} under fleet version {fl.fleet_version} "
                    f"({fl.fleet_label}) but this step's version is {expected}")
    elif bound != expected:
        return f"bound to {bound} but this step's version is {expected}"
    if s.spans is not None:
        named = {sp.version for sp in s.spans if sp.end > sp.start}
        if named - {bound.label}:
            return (f"vLLM labels its tokens {sorted(named)} but it is bound to "
                    f"{bound.label}")
    if not all(math.isfinite(x) for x in s.logprobs) or len(s.logprobs) != len(s.token_ids):
        return "the engine's logprobs do not cover its tokens"
    return None

