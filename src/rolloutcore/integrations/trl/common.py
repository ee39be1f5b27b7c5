"""What the TRL integration's modules share: the tested versions, the stop error, the reports."""

from __future__ import annotations

import contextlib
import importlib
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rolloutcore.core.adapters import AdapterVersion
from rolloutcore.core.records import Classification, State, fields_dict
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
    "EndedUpdate",
    "GenerationReport",
    "Interruption",
    "StepReport",
    "TrainingStopped",
    "UpdateReport",
    "deferred_interrupts",
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
    #: A LoRA run: the adapter version this update published (``version`` is the
    #: base, unchanged).
    adapter: AdapterVersion | None = None

    @property
    def drain_s(self) -> float:
        """Admission closed until the engine is paused with nothing in flight."""
        return float(self.phases_s.get("drain", 0.0)) + float(self.phases_s.get("pause", 0.0))

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version.to_dict(),
                "verification": self.identity.verification.wire,
                "prepare_s": self.prepare_s, "phases_s": dict(self.phases_s),
                "drain_s": self.drain_s, "total_s": self.total_s,
                "probe_max_abs_diff": self.probe_max_abs_diff,
                "adapter": None if self.adapter is None else self.adapter.to_dict()}


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
    adapter: AdapterVersion | None = None     # a LoRA run: the adapter it generated through

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


@dataclass(frozen=True)
class StepReport:
    """Everything one rollout call did (``rollout.steps``, in call order)."""

    step: int
    update: UpdateReport | None
    generation: GenerationReport
    call_s: float      # in the rollout function, the update included (wherever TRL ran it)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)




# --------------------------------------------------------------------------- interruptions


@dataclass(frozen=True)
class EndedUpdate:
    """The update that was open when its owner was interrupted, and how it was ended.

    ``state`` is where it was and ``step`` the step failed there; ``classification``
    how the failure policy ended it (a TIMEOUT of that step: ``no_mutation``, the
    old version serves again, or ``ambiguous``, TAINTED and fenced);
    ``state_after`` the controller's state then.
    """

    update_id: int
    target: WeightVersion
    state: State
    step: str
    classification: Classification | None
    state_after: State

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


_ENDED = {"no_mutation": "ended with nothing mutated (the old version serves)",
          "ambiguous": "ended ambiguous (the engine TAINTED and fenced)"}


@dataclass(frozen=True)
class Interruption:
    """What a ``KeyboardInterrupt`` (Ctrl-C) or ``SystemExit`` stopped (``rollout.interrupted``).

    ``phase`` is ``generation`` (the step's ``samples``: ``completed`` before it
    stopped, ``unfinished`` still running after the bounded wait, the rest
    cancelled; none of them recorded or returned to TRL), ``update`` (``update``:
    the update that was open and how it was ended; ``None`` when the engine had not
    been asked yet), or what the caller named (``note_interruption``: ``training``,
    ``reward``...). ``step`` is the trainer's global step.
    """

    phase: str
    step: int | None
    cause: str
    update: EndedUpdate | None = None
    samples: int = 0
    completed: int = 0
    unfinished: int = 0
    detail: str = ""

    @property
    def samples_text(self) -> str:
        """The generation's samples, in words (empty outside generation)."""
        if self.phase != "generation":
            return ""
        return (f"{self.completed} of {self.samples} samples had completed, "
                f"{self.unfinished} were still running; none was recorded or given to TRL")

    def describe(self) -> str:
        at = "" if self.step is None else f" at global_step {self.step}"
        out = f"{self.cause} during {self.phase}{at}"
        if self.samples_text:
            out += f": {self.samples_text}"
        u = self.update
        if u is not None:
            how = _ENDED.get(u.classification.value if u.classification else "",
                             "left undecided")
            out += f"; update {u.update_id} to {u.target.label} (in {u.state.value}) {how}"
        elif self.phase == "update":
            out += "; the engine had not been asked yet, nothing was open"
        return out + (f"; {self.detail}" if self.detail else "")

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self, description=self.describe())


@contextlib.contextmanager
def deferred_interrupts(message: str | None = None, *,
                        force_after: int = 3) -> Iterator[list[int]]:
    """Ctrl-C noted, not raised, inside: for bounded work that must not stop half-way.

    Only in the main thread and over Python's own SIGINT handler (elsewhere it
    changes nothing). Yields the list of presses seen. ``message`` is printed
    (stderr) at the first press; the ``force_after``-th press raises
    ``KeyboardInterrupt`` after all, for a user who will not wait.
    """
    presses: list[int] = []
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield presses
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        presses.append(signum)
        if len(presses) >= force_after:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.default_int_handler(signum, frame)   # KeyboardInterrupt after all
        if message and len(presses) == 1:
            print(f"[rolloutcore] {message} (Ctrl-C {force_after - 1} more times to quit "
                  "at once)", file=sys.stderr, flush=True)

    previous: Callable[..., Any] | int | None = signal.signal(signal.SIGINT, handler)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None
                      else signal.default_int_handler)
