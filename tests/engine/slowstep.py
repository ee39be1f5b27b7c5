"""A vLLM logits processor that makes every sampling step take longer (tests only).

The tiny test model decodes a token in about a millisecond on the CPU
backend, faster than vLLM's API server turns each step's output around on
a loaded 2-core machine. The API server then falls behind, and its answers
to control calls (``/pause``, ``/resume``, ``/is_paused``) come seconds late,
as late as the whole generation. A test that must land a pause while a
request runs cannot do so against such an engine. Sleeping in the worker
at each step paces the engine below what the API server handles, so the
control path stays prompt; the engine is otherwise the real one.

Loaded by vLLM through ``--logits-processors slowstep:SlowStep`` (this
directory on ``PYTHONPATH``); the sleep is ``ROLLOUTCORE_TEST_STEP_SLEEP_S``.
It leaves the logits unchanged.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

ENV = "ROLLOUTCORE_TEST_STEP_SLEEP_S"


class SlowStep(LogitsProcessor):
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self.sleep_s = float(os.environ.get(ENV, "0"))

    def is_argmax_invariant(self) -> bool:
        return False  # so that greedy steps are slowed too (vLLM skips invariant ones)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.sleep_s > 0:
            time.sleep(self.sleep_s)
        return logits
