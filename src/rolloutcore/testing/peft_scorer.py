"""The tiny model's own answers for the one fake: ``FakeVllm(engine, scorer=PeftScorer(base))``.

``PeftScorer(checkpoint)(path, token_ids, max_tokens=, top=)`` decodes greedily with the
real model, the base in float32 (``path`` None) or a LoRA adapter through PEFT from the
directory it was loaded from (merged into a copy of the base's weights), and answers each
token with its ``top`` logprobs. Nothing is scripted: an adapter probe passes because the
computation matches the reference, and fails when it does not.

A model's answers are a function of the files it was made from: the process keeps one base
model per checkpoint content, one merged model per (base, adapter files) content and each
answer per (model content, request) it computed, so the replicas of a fleet, the engines
of one test and the tests of one worker share the computation (the fleet-adapter tests
asked the same three base probes 171 times). What a request is answered with is still the
model's own computation: only a request already computed from the same bytes is answered
again.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights
from rolloutcore.testing.fake_vllm import FakeVllm

__all__ = ["PeftScorer", "peft_vllm"]

_SHARED_LOCK = threading.Lock()
_MODELS: dict[str, Any] = {}                       # content digest -> model computing it
_ANSWERS: dict[tuple[Any, ...], list[tuple[int, dict[int, float]]]] = {}
_UNSHARED = itertools.count()                      # keys of models made from no files


def files_digest(directory: str | Path, *within: str) -> str | None:
    """The digest of a directory's files (names and bytes; ``within``: what they are
    combined with), or None when it holds none (the load then fails as it would)."""
    root = Path(directory)
    files = sorted(f for f in root.rglob("*") if f.is_file()) if root.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256("\0".join(within).encode())
    for f in files:
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
    return h.hexdigest()


def _shared(digest: str | None, kind: str, make: Callable[[], Any]) -> tuple[str, Any]:
    """(its content key, the model): one per content, a fresh one made from no files."""
    if digest is None:
        return f"unshared:{next(_UNSHARED)}", make()
    key = f"{kind}:{digest}"
    with _SHARED_LOCK:
        model = _MODELS.get(key)
    if model is None:
        model = make()
        with _SHARED_LOCK:
            model = _MODELS.setdefault(key, model)
    return key, model


class PeftScorer:
    """The tiny model at ``checkpoint`` and the adapters it is asked about, computing."""

    def __init__(self, checkpoint: str | Path) -> None:
        if not isinstance(checkpoint, (str, Path)):
            raise BadInput(f"checkpoint must be a path, got {checkpoint!r}")
        import torch
        from transformers import AutoModelForCausalLM

        from rolloutcore.verification.hf_load import HF_LOCK

        def load() -> Any:
            with HF_LOCK:  # beside the managers' own loads, in their threads
                m = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
            return m.eval()  # type: ignore[no-untyped-call]

        self._torch = torch
        self._base_key, self._base = _shared(files_digest(checkpoint), "base", load)
        #: the ids the model reads
        self.vocab_size = int(self._base.config.vocab_size)

    def _model(self, path: str | None) -> tuple[str, Any]:
        if path is None:
            return self._base_key, self._base

        def merged() -> Any:
            from peft import PeftModel

            from rolloutcore.verification.hf_load import HF_LOCK

            with HF_LOCK:
                # PEFT reads the directory and adds each layer's B @ A x scale to a copy
                # of the base's weights: the same function as the unmerged model (float32
                # rounding apart), at the base's cost per token (the probes decode token
                # by token, on every replica).
                m = PeftModel.from_pretrained(copy.deepcopy(self._base), path)
                return m.merge_and_unload().eval()
        return _shared(files_digest(path, self._base_key), "adapter", merged)

    def __call__(self, path: str | None, token_ids: list[int], *, max_tokens: int, top: int
                 ) -> list[tuple[int, dict[int, float]]]:
        """Each greedy token after ``token_ids`` and the ``top`` logprobs at its place."""
        key, m = self._model(path)
        request = (key, tuple(token_ids), max_tokens, top)
        with _SHARED_LOCK:
            known = _ANSWERS.get(request)
        if known is None:
            known = self._decode(m, token_ids, max_tokens, top)
            with _SHARED_LOCK:
                _ANSWERS[request] = known
        return [(tok, dict(tops)) for tok, tops in known]

    def prompt_logprobs(self, path: str | None, token_ids: list[int]) -> list[float | None]:
        """The teacher-forced logprob of every token of ``token_ids`` (the first: None),
        through the base or the adapter at ``path``: vLLM's ``prompt_logprobs``."""
        from rolloutcore.verification.probe import ModelScorer

        return ModelScorer(self._model(path)[1]).score(list(token_ids))

    def _decode(self, m: Any, token_ids: list[int], max_tokens: int, top: int
                ) -> list[tuple[int, dict[int, float]]]:
        torch = self._torch
        out: list[tuple[int, dict[int, float]]] = []
        with torch.inference_mode():
            # Decoding with the model's KV cache, as an engine does: the prompt once, then
            # one token per step (a full forward per token made this fake O(n^2)).
            step, past = torch.tensor([list(token_ids)]), None
            for _ in range(max_tokens):
                res = m(step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                vals, idx = torch.log_softmax(res.logits[0, -1].float(), -1).topk(top)
                tok = int(idx[0])
                out.append((tok, dict(zip(idx.tolist(), vals.tolist(), strict=True))))
                step = torch.tensor([[tok]])
        return out


def peft_vllm(checkpoint: str | Path, *, scorer: PeftScorer | None = None,
              device: str = "cpu") -> tuple[FakeVllm, VllmHTTP]:
    """The one fake answering logprobs with the tiny model at ``checkpoint`` (and its
    adapters), and a client of it: what ``AdapterManager`` drives in the fast lane.
    ``scorer``: one of this checkpoint's (a test's subclass); ``device``: what
    ``/server_info`` says the engine runs on."""
    scorer = PeftScorer(checkpoint) if scorer is None else scorer
    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0)), vocab_size=scorer.vocab_size,
                    scorer=scorer, device=device)
    return fake, VllmHTTP("http://fake-vllm", transport=fake.transport())
