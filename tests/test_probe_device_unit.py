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


def test_the_kv_cached_reference_is_the_whole_sequence_reference(tmp_path: Any) -> None:
    """A HF causal LM's reference decodes with its KV cache (one forward of the prompt,
    then one per token); a module that is not one (no ``use_cache``) is run on the whole
    sequence at every step. Both give the same greedy tokens and log-probabilities to
    float32 rounding, through PEFT too."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.verification.probe import _takes_cache, default_prompts

    class Plain(torch.nn.Module):  # type: ignore[misc]
        """The same model behind a forward that takes only ``input_ids``."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner
            self.config = inner.config
            self.calls: list[int] = []

        def forward(self, input_ids: Any) -> Any:
            self.calls.append(int(input_ids.shape[1]))
            return self.inner(input_ids=input_ids, use_cache=False)

    base = AutoModelForCausalLM.from_pretrained(make_checkpoint(tmp_path / "b", 1),
                                                dtype=torch.float32)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    with torch.no_grad():
        for n, p in lora.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(0))
    prompts = default_prompts(int(base.config.vocab_size), n=2, length=20)
    for model in (base, lora):
        assert _takes_cache(model)
        plain = Plain(model)
        assert not _takes_cache(plain)
        cached = PolicyProbe.from_model(model, prompts, new_tokens=6)
        whole = PolicyProbe.from_model(plain, prompts, new_tokens=6)
        assert plain.calls == [20, 21, 22, 23, 24, 25] * 2   # the whole sequence each step
        for a, b in zip(cached.cases, whole.cases, strict=True):
            assert a.continuation == b.continuation
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
