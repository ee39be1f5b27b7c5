"""What the TRL integration's modules share: the tested versions, the stop error, the reports."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.versions import (
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.errors import (
    BadInput,
    RolloutCoreError,
)

__all__ = [
    "DEFAULT_PROBE_TOLERANCE",
    "TESTED_VERSIONS",
    "GenerationReport",
    "StepReport",
    "TrainingStopped",
    "UpdateReport",
    "import_trl",
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


