"""TRL's ``GRPOTrainer`` training through RolloutCore: TRL trains, RolloutCore generates.

TRL 1.16's ``GRPOTrainer(rollout_func=...)`` hands generation to a function
``(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs", ...}``
and then needs no vLLM of its own. ``RolloutCoreRollout`` is that function,
so that a user keeps the trainer they already use and gets, for every
sample it trains on, a verified policy version and a durable record. On
each call it

1. **updates the engine when the trainer's step moved** since the last
   call: the trainer's module, cast to the names, shapes and dtypes of the
   checkpoint the engine was started from, goes through a verified
   RolloutCore transition (drain, pause, transfer, cache reset, validation,
   the policy probe computed from the very tensors sent, publish) with
   provenance (run name, global step, the checkpoint or commit the run
   started from);
2. **generates every group** of ``num_generations`` completions per prompt
   as one request per sample, each admitted under (bound to) the committed
   version, with the seed ``seeds.derive_seed(run, step, group, sample)``,
   so no two siblings or engines share a sampling stream;
3. **checks every sample** against its binding: vLLM's own per-token
   version spans must name the bound version, and the bound version must be
   the one this rollout function published for this step;
4. **records every sample** as a trajectory group (``TrajectoryRecorder``,
   fsynced) before TRL sees it, so ``rolloutcore audit`` and ``rolloutcore
   replay`` work on a training run;
5. returns vLLM's sampled-token (behaviour) logprobs and, as extra fields
   that TRL hands to the reward functions, each sample's version
   (``rc_version``, ``rc_generation``) and rollout id (``rc_rollout_id``).

**Fail closed.** A refused or tainted update, a sample whose spans name
another version, an engine that stops answering mid-generation: each raises
``TrainingStopped`` (a ``RolloutCoreError`` naming the step, the phase, the
classification and the engine's state), which propagates out of
``trainer.train()``. Nothing of that step is returned to TRL, so it never
computes a loss on samples from an unverified engine, and the error is
sticky: every later call raises it again.

**Importance sampling.** TRL applies its vLLM importance-sampling
correction (``vllm_importance_sampling_correction``) only when its own vLLM
backend is on (``trainer.use_vllm``). With ``importance_sampling=True`` (the
default) the rollout function takes that backend's place on its first call:
it sets ``use_vllm`` and puts a weight-sync object at
``trainer.vllm_generation`` whose ``sync_weights`` (the hook TRL calls when
its step moved, before generating) is RolloutCore's verified update. TRL
then corrects with the logprobs returned here. This leans on TRL 1.16's
attribute names, which is why the extra pins TRL.

Two engines:

* in process: an ``EngineSession`` (``RolloutCoreRollout.launch(ckpt)``
  starts vLLM on the checkpoint; ``RolloutCoreRollout(session, ...)`` takes
  one you made);
* a gateway (``rolloutcore serve``): ``RolloutCoreRollout.through_gateway(url,
  token, checkpoint=...)``; updates go through the gateway's two-phase
  protocol, generation through its data plane (admission and binding are
  the gateway's; the answer's ``rolloutcore`` field says the version).

One training process only: the seeds, group ids and the trajectory file are
per run, and a second process would need its own (refused, not guessed).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import math
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from rolloutcore.core.versions import ParameterManifest, Provenance, WeightIdentity, WeightVersion
from rolloutcore.errors import (
    BadInput,
    EffectError,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
from rolloutcore.provenance.trajectory import (
    EngineIdentity,
    PolicyBinding,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    group_id_for,
)
from rolloutcore.transports.source import WeightSource

__all__ = [
    "DEFAULT_PROBE_TOLERANCE",
    "TESTED_VERSIONS",
    "EngineSample",
    "GenerationReport",
    "PublishedUpdate",
    "RolloutCoreRollout",
    "RolloutEngine",
    "StepReport",
    "TrainingStopped",
    "UpdateReport",
    "engine_state_dict",
    "import_trl",
    "probe_for",
]

#: The versions the ``trl`` extra pins and the tests run (what ``rolloutcore[trl]`` installs).
TESTED_VERSIONS: Mapping[str, str] = {"trl": "1.16.0", "accelerate": "1.15.0",
                                      "datasets": "5.2.0", "matplotlib": "3.11.2"}

#: TRL warns at import that it supports vLLM only up to 0.31; RolloutCore, not TRL,
#: talks to vLLM here, so the warning does not apply.
_TRL_VLLM_WARNING = r"TRL currently supports vLLM versions"

_RETRY_503_S = 120.0

#: Nats. The probe's own default (0.005) is calibrated on random tiny checkpoints,
#: and a model in training moves away from them: on the main job's 20 steps the
#: engine's bf16 arithmetic differed from the float32 reference by 0.0028-0.0121
#: nats on correct updates (it failed the first update at 0.0071), while one
#: mis-sent tensor (a negated down_proj) gave 0.33 (tests/engine/test_trl_loop.py).
#: Same value as the replay's logprob tolerance. Calibrate for a real model.
DEFAULT_PROBE_TOLERANCE = 0.05


def import_trl() -> Any:
    """``import trl`` without its vLLM-version warning (TRL does not drive vLLM here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRL_VLLM_WARNING, category=UserWarning)
        try:
            import trl

            # trl is a lazy module: the warnings come when the trainer is first reached.
            importlib.import_module("trl.trainer.grpo_trainer")
        except ImportError as exc:
            raise BadInput("TRL is not installed: pip install 'rolloutcore[trl]'") from exc
    return trl


class TrainingStopped(RolloutCoreError):
    """RolloutCore refused to hand TRL samples it cannot vouch for; training must stop.

    ``reason`` is ``update_failed`` (the transition for ``step`` failed:
    ``phase``, ``classification``, the engine's ``state``), ``attribution``
    (a sample is not provably from the version it should be) or
    ``generation`` (the engine did not answer). ``published`` is the version
    still committed (the last good one), never the failed target.
    """

    def __init__(self, step: int, reason: str, detail: str, *, phase: str | None = None,
                 classification: str | None = None, state: str | None = None,
                 published: WeightVersion | None = None) -> None:
        self.step = step
        self.reason = reason
        self.phase = phase
        self.classification = classification
        self.state = state
        self.published = published
        where = {"update_failed": "the update to this step's weights failed",
                 "attribution": "a sample could not be attributed to the expected version",
                 "generation": "generation failed"}.get(reason, reason)
        bits = [f"RolloutCore stopped training at step {step}: {where}"]
        if phase or classification or state:
            bits.append(f"(phase {phase or '?'}, {classification or '?'}; engine "
                        f"{state or '?'})")
        msg = " ".join(bits) + f": {detail}. Nothing of step {step} was returned to TRL"
        if published is not None:
            msg += f"; the last published version is {published.label}"
        super().__init__(msg)


# --------------------------------------------------------------------------- reports


@dataclass(frozen=True)
class UpdateReport:
    """One verified transition: what was published and where the time went."""

    step: int
    version: WeightVersion
    identity: WeightIdentity
    prepare_s: float            # cast, identity (content digest), probe reference
    phases_s: Mapping[str, float]
    total_s: float              # prepare + the transition, as the trainer waited for it
    probe_max_abs_diff: float | None = None   # nats; None when no probe ran here

    @property
    def drain_s(self) -> float:
        """Admission closed until the engine is paused with nothing in flight."""
        return float(self.phases_s.get("drain", 0.0)) + float(self.phases_s.get("pause", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version.to_dict(),
                "verification": self.identity.verification.wire,
                "prepare_s": self.prepare_s, "phases_s": dict(self.phases_s),
                "drain_s": self.drain_s, "total_s": self.total_s,
                "probe_max_abs_diff": self.probe_max_abs_diff}


@dataclass(frozen=True)
class GenerationReport:
    """One call's generation: how many samples, under which version, how long."""

    step: int
    version: WeightVersion
    groups: int
    samples: int
    tokens: int
    generate_s: float
    record_s: float
    first_prompt_index: int

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version.to_dict(), "groups": self.groups,
                "samples": self.samples, "tokens": self.tokens, "generate_s": self.generate_s,
                "record_s": self.record_s, "first_prompt_index": self.first_prompt_index}


@dataclass(frozen=True)
class StepReport:
    """Everything one rollout call did (``rollout.steps``, in call order)."""

    step: int
    update: UpdateReport | None
    generation: GenerationReport
    call_s: float      # in the rollout function, the update included (wherever TRL ran it)

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "update": None if self.update is None
                else self.update.to_dict(), "generation": self.generation.to_dict(),
                "call_s": self.call_s}


# --------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class PublishedUpdate:
    """What an engine's update published (the transition's phase times included)."""

    version: WeightVersion
    identity: WeightIdentity
    phases_s: Mapping[str, float]


@dataclass(frozen=True)
class EngineSample:
    """One generated sample as the engine answered it, with its binding."""

    binding: PolicyBinding
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    spans: tuple[VersionSpan, ...] | None
    stamps: Timestamps
    attributable: bool = True


class RolloutEngine(Protocol):
    """What the rollout function needs from where the policy is served.

    Two are built in (an ``EngineSession``; a gateway); another serving stack
    under a ``LifecycleController`` can be plugged in by implementing this.
    """

    replica: str

    def committed(self) -> tuple[WeightVersion, WeightIdentity]: ...

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Any,
               owner: str) -> PublishedUpdate: ...

    def generate(self, rollout_id: str, prompt: Sequence[int],
                 spec: SamplingSpec) -> EngineSample: ...

    def engine_identity(self) -> EngineIdentity: ...

    def close(self) -> None: ...


def _spans(raw: Any) -> tuple[VersionSpan, ...] | None:
    if raw is None:
        return None
    return tuple(VersionSpan(str(s.version), int(s.start), int(s.end)) if not isinstance(
        s, Mapping) else VersionSpan(str(s["version"]), int(s["start"]), int(s["end"]))
        for s in raw)


def _vllm_extra(spec: SamplingSpec) -> dict[str, Any]:
    """``spec.to_vllm()`` less what ``VllmHTTP.generate`` takes as arguments."""
    out = spec.to_vllm()
    for k in ("max_tokens", "temperature", "seed", "logprobs", "ignore_eos"):
        out.pop(k, None)
    return out


class _SessionEngine:
    """An in-process ``EngineSession``: its controller admits, its runner updates."""

    def __init__(self, session: Any, *, owns: bool) -> None:
        self.session = session
        self.owns = owns
        self.replica = str(session.http.base_url)

    def committed(self) -> tuple[WeightVersion, WeightIdentity]:
        c = self.session.controller
        if c.committed is None or c.identity is None:
            raise BadInput("the session is not bootstrapped: call session.bootstrap(checkpoint) "
                           "first (or use RolloutCoreRollout.launch)")
        return c.committed, c.identity

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Any,
               owner: str) -> PublishedUpdate:
        res = self.session.update(state, provenance, probe=probe, owner=owner)
        return PublishedUpdate(res.version, res.identity, res.outcome.breakdown())

    def generate(self, rollout_id: str, prompt: Sequence[int], spec: SamplingSpec) -> EngineSample:
        c, http = self.session.controller, self.session.http
        binding = c.admit(rollout_id)
        aw, am = time.time(), time.monotonic()
        try:
            assert spec.max_tokens is not None
            g = http.generate(prompt, max_tokens=spec.max_tokens, temperature=spec.temperature,
                              seed=spec.seed, logprobs=True,
                              ignore_eos=bool(spec.extra.get("ignore_eos", False)),
                              request_id=rollout_id, sampling_extra=_vllm_extra(spec))
        finally:
            done = c.complete(rollout_id)
        cw, cm = time.time(), time.monotonic()
        return EngineSample(PolicyBinding.of(binding), tuple(g.token_ids), tuple(g.logprobs or ()),
                       g.finish_reason or "unknown", _spans(g.weight_versions),
                       Timestamps(aw, am, cw, max(cm, am)), done.attributable)

    def engine_identity(self) -> EngineIdentity:
        from rolloutcore.adapters.vllm import engine_identity

        return engine_identity(self.session.http)

    def close(self) -> None:
        if self.owns:
            self.session.close()


class _GatewayEngine:
    """A ``rolloutcore serve`` gateway: its data plane admits, its control API updates."""

    def __init__(self, url: str, token: str, *, transport: Any, data_token: str | None,
                 timeout_s: float, min_verification: str) -> None:
        import httpx

        from rolloutcore.service.client import RolloutCoreClient

        self.replica = url.rstrip("/")
        self.client = RolloutCoreClient(self.replica, token, transport=transport)
        headers = {"authorization": f"Bearer {data_token}"} if data_token else {}
        self.http = httpx.Client(base_url=self.replica, timeout=timeout_s, headers=headers)
        self.min_verification = min_verification
        self._lock = threading.Lock()
        self._version: WeightVersion | None = None
        self._identity: WeightIdentity | None = None
        self._model: str | None = None

    def committed(self) -> tuple[WeightVersion, WeightIdentity]:
        st = self.client.status()
        if not st.get("committed") or not st.get("identity"):
            raise BadInput(f"the gateway has no committed version (state {st.get('state')})")
        v, ident = WeightVersion.from_dict(st["committed"]), WeightIdentity.from_dict(
            st["identity"])
        with self._lock:
            self._version, self._identity = v, ident
        return v, ident

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Any,
               owner: str) -> PublishedUpdate:
        res = self.client.update(WeightSource.of(state), provenance, owner=owner,
                                 min_verification=self.min_verification)
        if res.published is None or res.identity is None:
            raise UpdateFailed(res.phase or "commit", res.classification or "ambiguous",
                               res.state, f"the gateway answered {res.status} without a "
                               "published version")
        ident = WeightIdentity.from_dict(res.identity)
        with self._lock:
            self._version, self._identity = res.published, ident
        return PublishedUpdate(res.published, ident, dict(res.phases))

    def _served_model(self) -> str:
        if self._model is None:
            r = self.http.get("/v1/models")
            r.raise_for_status()
            self._model = str(r.json()["data"][0]["id"])
        return self._model

    def generate(self, rollout_id: str, prompt: Sequence[int], spec: SamplingSpec) -> EngineSample:
        import httpx

        body = {"model": self._served_model(), "token_ids": list(prompt),
                "sampling_params": spec.to_vllm()}
        deadline = time.monotonic() + _RETRY_503_S
        while True:
            aw, am = time.time(), time.monotonic()
            try:
                r = self.http.post("/inference/v1/generate", json=body,
                                   headers={"x-rolloutcore-rollout-id": rollout_id})
            except httpx.HTTPError as exc:
                raise EffectError("generate", f"gateway unreachable: {exc!r}",
                                  mutation_started=False) from exc
            retry = r.headers.get("retry-after")
            if r.status_code == 503 and retry is not None and time.monotonic() < deadline:
                time.sleep(min(float(retry), max(0.0, deadline - time.monotonic())))
                continue
            break
        cw, cm = time.time(), time.monotonic()
        if r.status_code != 200:
            raise EffectError("generate", f"gateway answered {r.status_code}: {r.text[:300]}",
                              mutation_started=False)
        try:
            d = r.json()
            info = d["rolloutcore"]
            ch = d["choices"][0]
            toks = tuple(int(t) for t in ch.get("token_ids") or ())
            lps = tuple(float(c["logprob"]) for c in (ch.get("logprobs") or {}).get(
                "content") or ())
            version = WeightVersion(int(info["generation"]), str(info["version"]),
                                    str(info["engine_epoch"]))
            digest = str(info["identity_digest"])
            spans = _spans(ch.get("weight_versions"))
            finish = str(ch.get("finish_reason") or "unknown")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EffectError("generate", f"unexpected gateway answer: {exc!r}",
                              mutation_started=False) from exc
        with self._lock:
            ident = self._identity
        if ident is None or ident.digest != digest:
            self.committed()
            with self._lock:
                ident = self._identity
        assert ident is not None
        known = ident.digest == digest
        rid = str(info.get("rollout_id") or rollout_id)
        return EngineSample(PolicyBinding(version, ident, rid), toks, lps, finish, spans,
                            Timestamps(aw, am, cw, max(cm, am)), known)

    def engine_identity(self) -> EngineIdentity:
        r = self.http.get("/version")
        version = str(r.json().get("version", "unknown")) if r.status_code == 200 else "unknown"
        return EngineIdentity(version, self._served_model(), {}, self.replica)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.http.close()


# --------------------------------------------------------------------------- weights


def engine_state_dict(model: Any, manifest: ParameterManifest) -> dict[str, Any]:
    """The module's parameters as the engine holds them: the manifest's names and dtypes.

    A trainer usually trains in float32 while vLLM serves bfloat16: each
    tensor is cast (copied) to the dtype the engine was started with, so the
    transfer, the identity and the probe all see exactly what the engine
    gets. A name or shape that does not match is refused before anything
    touches the engine.
    """
    import torch

    if not isinstance(model, torch.nn.Module):
        raise BadInput(f"not a torch.nn.Module: {type(model).__name__}")
    if not isinstance(manifest, ParameterManifest):
        raise BadInput("manifest must be a ParameterManifest")
    params = dict(model.named_parameters())
    want = {p.name: p for p in manifest.params}
    missing, unexpected = sorted(want.keys() - params.keys()), sorted(params.keys() - want)
    if missing or unexpected:
        raise BadInput(f"the trainer's model does not match the engine's checkpoint: missing "
                       f"{missing[:4]}, unexpected {unexpected[:4]} (a PEFT or wrapped model "
                       "must be merged and unwrapped first)")
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, spec in want.items():
            t = params[name].detach()
            if tuple(t.shape) != spec.shape:
                raise BadInput(f"{name}: shape {tuple(t.shape)} != the engine's {spec.shape}")
            dt = getattr(torch, spec.dtype, None)
            if not isinstance(dt, torch.dtype):
                raise BadInput(f"{name}: the engine's dtype {spec.dtype!r} is not a torch dtype")
            out[name] = t.to(dtype=dt, copy=True).contiguous()
    return out


def _probe_reference(model: Any, state: Mapping[str, Any]) -> Any:
    """A float32 copy of ``model`` holding exactly the tensors sent (cast back up)."""
    import torch

    ref = copy.deepcopy(model)
    if getattr(ref, "is_gradient_checkpointing", False):
        # TRL turns it on; transformers then drops the KV cache even in eval mode.
        ref.gradient_checkpointing_disable()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.grad = None
            p.requires_grad_(False)
            p.data = state[name].to(torch.float32)
    return ref.float().eval()


def probe_for(model: Any, state: Mapping[str, Any], *, tolerance: float,
              new_tokens: int = 16) -> Any:
    """The policy probe of the tensors in ``state`` (as sent), computed with a KV cache.

    The same cases as ``PolicyProbe.from_model`` (greedy continuations of the
    default probe prompts and their float32 log-probabilities), but batched
    and incremental: one prefill and ``new_tokens`` single-token steps instead
    of ``new_tokens`` full forwards per prompt. It runs before every update,
    inside the training step, so its cost is the trainer's.
    """
    import torch

    from rolloutcore.verification.probe import PolicyProbe, ProbeCase, default_prompts

    ref = _probe_reference(model, state)
    prompts = default_prompts(int(ref.config.vocab_size))
    with torch.no_grad():
        seq = torch.tensor(prompts, dtype=torch.long)
        out = ref(input_ids=seq, use_cache=True)
        conts: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        for k in range(new_tokens):
            logp = torch.log_softmax(out.logits[:, -1].float(), dim=-1)
            tok = torch.argmax(logp, dim=-1)
            for i in range(len(prompts)):
                conts[i].append(int(tok[i]))
                lps[i].append(float(logp[i, tok[i]]))
            if k + 1 == new_tokens:
                break
            seq = torch.cat([seq, tok[:, None]], dim=1)
            if out.past_key_values is not None:
                out = ref(input_ids=tok[:, None], past_key_values=out.past_key_values,
                          use_cache=True)
            else:  # a model without a cache: the whole sequence again
                out = ref(input_ids=seq, use_cache=False)
    del ref
    return PolicyProbe([ProbeCase(tuple(p), tuple(c), tuple(lp))
                        for p, c, lp in zip(prompts, conts, lps, strict=True)],
                       tolerance=tolerance)


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


class RolloutCoreRollout:
    """TRL's ``rollout_func``: verified updates, bound and recorded samples.

    ``RolloutCoreRollout(session, checkpoint=..., run=...)`` over an
    ``EngineSession`` (bootstrapped on ``checkpoint``) or any
    ``RolloutEngine``, or the constructors ``launch`` and ``through_gateway``.
    ``trajectories`` is the trajectory file (opened now: one writer).
    ``max_concurrency`` bounds the requests in flight (vLLM batches them).
    """

    def __init__(self, engine: Any, *, checkpoint: str | Path, run: str,
                 trajectories: str | Path | None = None, origin: str | None = None,
                 probe: bool = True, probe_tolerance: float = DEFAULT_PROBE_TOLERANCE,
                 importance_sampling: bool = True,
                 max_concurrency: int = 32, owner: str = "trl") -> None:
        from rolloutcore.control.session import EngineSession

        if isinstance(engine, EngineSession):
            engine = _SessionEngine(engine, owns=False)
        elif not all(callable(getattr(engine, m, None)) for m in (
                "committed", "update", "generate", "engine_identity", "close")):
            raise BadInput("engine must be an EngineSession or a RolloutEngine (or use "
                           "RolloutCoreRollout.launch / through_gateway)")
        ckpt = Path(checkpoint)
        if not (ckpt / "config.json").is_file():
            raise BadInput(f"{ckpt} is not a checkpoint directory (no config.json)")
        if not isinstance(run, str) or not run:
            raise BadInput("run must be a non-empty string")
        # The run name is part of every group id and seed: check it once, here.
        group_id_for(run, 0, 0)
        if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) or \
                max_concurrency < 1:
            raise BadInput(f"max_concurrency must be an int >= 1, got {max_concurrency!r}")
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
        self.owner = owner
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
               journal: str | Path | None = None, transport: Any = None,
               engine_kwargs: Mapping[str, Any] | None = None, progress: bool = False,
               start_timeout_s: float = 600.0, **kw: Any) -> RolloutCoreRollout:
        """Start vLLM on ``checkpoint`` under RolloutCore and bootstrap it (step 0)."""
        from rolloutcore.control.session import EngineSession

        session = EngineSession.launch(checkpoint, transport=transport, journal_path=journal,
                                       engine_kwargs=engine_kwargs, progress=progress,
                                       start_timeout_s=start_timeout_s)
        try:
            origin = kw.get("origin") or str(Path(checkpoint).resolve())
            session.bootstrap(checkpoint, Provenance(origin, run, 0))
            return cls(_SessionEngine(session, owns=True), checkpoint=checkpoint, run=run,
                       trajectories=trajectories, **kw)
        except BaseException:
            session.close()
            raise

    @classmethod
    def through_gateway(cls, url: str, token: str, *, checkpoint: str | Path, run: str,
                        trajectories: str | Path | None = None, transport: Any = None,
                        data_token: str | None = None, timeout_s: float = 300.0,
                        min_verification: str = "declared", **kw: Any) -> RolloutCoreRollout:
        """Generate and update through a ``rolloutcore serve`` gateway at ``url``.

        ``token`` is the gateway's control token; ``transport`` moves the
        weights into the engine the gateway names (default: gloo, the CPU
        backend ``rolloutcore serve`` starts vLLM with).
        """
        if transport is None:
            from rolloutcore.transports.gloo import GlooTransport

            transport = GlooTransport()
        kw.setdefault("probe", False)  # the probe runs where the engine is: the gateway
        eng = _GatewayEngine(url, token, transport=transport, data_token=data_token,
                             timeout_s=timeout_s, min_verification=min_verification)
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
        step = int(trainer.state.global_step)
        if step == self.synced_step:
            upd, self._pending_update = self._pending_update, None
            return upd
        if getattr(getattr(trainer, "accelerator", None), "num_processes", 1) != 1:
            raise BadInput("RolloutCoreRollout runs in one training process")
        model = trainer.model
        acc = getattr(trainer, "accelerator", None)
        if acc is not None and hasattr(acc, "unwrap_model"):
            model = acc.unwrap_model(model)
        t0 = time.monotonic()
        state = engine_state_dict(model, self.manifest)
        probe: Any = False
        if self.probe:
            probe = probe_for(model, state, tolerance=self.probe_tolerance)
        prov = Provenance(self.origin, self.run, step)
        prepare_s = time.monotonic() - t0
        try:
            pub = self.engine.update(state, prov, probe, self.owner)
        except (UpdateFailed, UpdateRefused, EffectError) as exc:
            err = TrainingStopped(
                step, "update_failed", f"{type(exc).__name__}: {exc}",
                phase=getattr(exc, "phase", None),
                classification=getattr(exc, "classification", None),
                state=getattr(exc, "state", None), published=self.version)
            self._stop(err)
            raise err from exc
        self.version, self.identity, self.synced_step = pub.version, pub.identity, step
        last = getattr(probe, "last", None)
        rep = UpdateReport(step, pub.version, pub.identity, prepare_s, dict(pub.phases_s),
                           time.monotonic() - t0,
                           None if last is None else float(last.max_abs_diff))
        self.updates.append(rep)
        self._pending_update = rep
        return rep

    # ------------------------------------------------------------------ internals
    def _check_usable(self) -> None:
        if self.stopped is not None:
            raise self.stopped
        if self._pool is None:
            raise BadInput("this rollout function is closed")

    def _stop(self, err: TrainingStopped) -> None:
        if self.stopped is None:
            self.stopped = err

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
        pool = self._pool
        assert pool is not None
        first = self._next_index.get(step, 0)
        version = self.version
        t0 = time.monotonic()
        pending: list[_Pending] = []
        for k, p in enumerate(prompts):
            idx = first + k
            gid = group_id_for(self.run, step, idx)
            pend = _Pending(idx, gid, p)
            for i in range(n):
                spec = SamplingSpec(base.temperature, base.top_p, base.top_k, base.max_tokens,
                                    derive_seed(self.run, step, gid, i), SEED_DERIVATION,
                                    base.extra)
                pend.futures.append(pool.submit(self.engine.generate, f"{gid}/{i}", p, spec))
            pending.append(pend)
        self._next_index[step] = first + len(prompts)
        results: list[list[EngineSample]] = []
        errors: list[BaseException] = []
        for pend in pending:
            row = []
            for f in pend.futures:
                try:
                    row.append(f.result())
                except BaseException as exc:  # every future is awaited before raising
                    errors.append(exc)
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
                problem = _attribution_problem(s, version)
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
                                 Prompt(pend.prompt),
                                 SamplingSpec(base.temperature, base.top_p, base.top_k,
                                              base.max_tokens,
                                              derive_seed(self.run, step, pend.group_id, i),
                                              SEED_DERIVATION, base.extra),
                                 SampledCompletion(s.token_ids, s.finish_reason, s.logprobs,
                                                   None, s.spans),
                                 s.binding, engine, s.stamps)
                for i, s in enumerate(row))))
        if self.recorder is not None:
            for g in groups:
                self.recorder.append_group(g)
            self.samples_recorded += sum(len(g) for g in groups)
        record_s = time.monotonic() - t1
        out: dict[str, Any] = {"prompt_ids": [], "completion_ids": [], "logprobs": [],
                               "rc_version": [], "rc_generation": [], "rc_rollout_id": []}
        tokens = 0
        for pend, row in zip(pending, results, strict=True):
            for s in row:
                out["prompt_ids"].append(list(pend.prompt))
                out["completion_ids"].append(list(s.token_ids))
                out["logprobs"].append(list(s.logprobs))
                out["rc_version"].append(s.binding.version.label)
                out["rc_generation"].append(s.binding.version.generation)
                out["rc_rollout_id"].append(s.binding.rollout_id)
                tokens += len(s.token_ids)
        return out, GenerationReport(step, version, len(prompts), len(prompts) * n, tokens,
                                     generate_s, record_s, first)

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
        """Stop the generation threads, close the trajectory file (and an owned engine)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        try:
            if self.recorder is not None:
                self.recorder.close()
        finally:
            self.engine.close()

    def __enter__(self) -> RolloutCoreRollout:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _conversational(prompt: Any) -> bool:
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


def _attribution_problem(s: EngineSample, expected: WeightVersion) -> str | None:
    """Why ``s`` cannot be credited to ``expected``; ``None`` when it can."""
    bound = s.binding.version
    if not s.attributable:
        return (f"its binding to {bound.label} did not survive (the engine left service "
                "while it ran)")
    if bound != expected:
        return f"bound to {bound} but this step's version is {expected}"
    if s.spans is not None:
        named = {sp.version for sp in s.spans if sp.end > sp.start}
        if named - {bound.label}:
            return (f"vLLM labels its tokens {sorted(named)} but it is bound to "
                    f"{bound.label}")
    if not all(math.isfinite(x) for x in s.logprobs) or len(s.logprobs) != len(s.token_ids):
        return "the engine's logprobs do not cover its tokens"
    return None

