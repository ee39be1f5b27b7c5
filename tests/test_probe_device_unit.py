"""The trainer's reference on the trainer's device: ``PolicyProbe.from_model`` with a model
that is not on the CPU (a CUDA model on the H200, ``diagnostics/gpu/h200_lora.py``).

The inputs must go where the model's parameters are: here the parameters are on
``meta`` (any non-CPU device shows it without a GPU) and the forward refuses
inputs from anywhere else, as a CUDA module does ("Expected all tensors to be on
the same device"). Before the fix the probe built its inputs on the CPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from rolloutcore.verification.probe import PolicyProbe  # noqa: E402

VOCAB = 11


class _ElsewhereLM(torch.nn.Module):  # type: ignore[misc]
    """A causal LM whose parameters live on ``meta``; its logits are computed on the CPU
    from the token ids (meta tensors hold no values), so the reference is checkable."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2, 2, device="meta"))
        self.config = SimpleNamespace(vocab_size=VOCAB)
        self.seen: list[str] = []
        self.known: list[int] = []

    def forward(self, input_ids: Any) -> Any:
        if input_ids.device != self.w.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, got "
                               f"{input_ids.device} and {self.w.device}")
        self.seen.append(str(input_ids.device))
        # meta tensors hold no values: the ids are known from the prompt and each argmax
        last = self.known[-1]
        logits = torch.full((1, input_ids.shape[1], VOCAB), -1.0)
        logits[0, -1, (3 * last + 1) % VOCAB] = 2.0
        return SimpleNamespace(logits=logits)


def test_reference_inputs_go_to_the_models_device() -> None:
    m = _ElsewhereLM()
    m.known = [5]
    probe = PolicyProbe.from_model(m, [[5, 6, 5]], new_tokens=1)
    assert m.seen == ["meta"]
    (case,) = probe.cases
    assert case.prompt == (5, 6, 5) and case.continuation == ((3 * 5 + 1) % VOCAB,)
    want = float(torch.log_softmax(torch.tensor([-1.0] * (VOCAB - 1) + [2.0]), -1)[-1])
    assert case.logprobs[0] == pytest.approx(want)


def test_a_cpu_model_still_gets_cpu_inputs() -> None:
    class Cpu(_ElsewhereLM):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(2, 2))

    m = Cpu()
    m.known = [2]
    probe = PolicyProbe.from_model(m, [[2, 2]], new_tokens=3)
    assert m.seen == ["cpu"] * 3 and len(probe.cases[0].continuation) == 3
