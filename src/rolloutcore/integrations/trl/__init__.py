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

**Interrupted** (Ctrl-C): the interrupt propagates out of ``trainer.train()``
as itself, never as a sample failure; an update it caught half-way is ended
decided first (resumed on the old version when nothing was mutated, else
tainted and fenced), and ``rollout.interrupted`` says what was stopped
(``close`` writes it to the journal as its ``interrupted`` record).

One training process only: the seeds, group ids and the trajectory file are
per run, and a second process would need its own (refused, not guessed).
"""

from rolloutcore.integrations.trl.common import (
    DEFAULT_PROBE_TOLERANCE,
    TESTED_VERSIONS,
    EndedUpdate,
    GenerationReport,
    Interruption,
    StepReport,
    TrainingStopped,
    UpdateReport,
    import_trl,
)
from rolloutcore.integrations.trl.engines import EngineSample, PublishedUpdate, RolloutEngine
from rolloutcore.integrations.trl.rollout import RolloutCoreRollout
from rolloutcore.integrations.trl.weights import engine_state_dict, probe_for

__all__ = [
    "DEFAULT_PROBE_TOLERANCE",
    "TESTED_VERSIONS",
    "EndedUpdate",
    "EngineSample",
    "GenerationReport",
    "Interruption",
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
