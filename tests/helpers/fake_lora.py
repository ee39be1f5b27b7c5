"""An in-process LoRA engine for the fast lane: the routes ``AdapterManager`` drives.

``LoraEngine(checkpoint)`` answers ``models``, ``load_lora_adapter``,
``unload_lora_adapter`` and ``top_logprobs`` as ``VllmHTTP`` does, computing
with the real tiny model: the base in float32, and each loaded adapter
through PEFT from the directory it was loaded from (merged into a copy of the base's
weights). Nothing is scripted: a
probe passes because the computation matches the reference, and fails when
it does not.

Faults, each one a failure a real engine has shown: ``swallow_loads`` (the
route answers and loads nothing), ``base_under_name`` (the name is listed but
the base computes: an adapter load that silently does nothing), ``refuse_loads``
(a 4xx), ``fail_unloads`` (the unload times out), ``down`` (every call fails).

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
from pathlib import Path
from typing import Any

from rolloutcore.errors import EffectError, EffectTimeout, RequestRejected

BASE_NAME = "policy"

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


def _shared_model(key: str, make: Any) -> Any:
    with _SHARED_LOCK:
        model = _MODELS.get(key)
    if model is None:
        model = make()
        with _SHARED_LOCK:
            model = _MODELS.setdefault(key, model)
    return model


class LoraEngine:
    def __init__(self, checkpoint: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        from rolloutcore.verification.hf_load import HF_LOCK

        def load() -> Any:
            with HF_LOCK:  # beside the managers' own loads, in their threads
                m = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
            return m.eval()

        digest = files_digest(checkpoint)
        self.base_key = f"base:{digest}" if digest else f"unshared:{next(_UNSHARED)}"
        self.base = _shared_model(self.base_key, load) if digest else load()
        self.adapters: dict[str, Any] = {}     # name -> model computing it
        self.keys: dict[str, str] = {}         # name -> the content key of that model
        self.paths: dict[str, str] = {}
        self.swallow_loads = 0
        self.base_under_name = 0
        self.refuse_loads = 0
        self.fail_unloads = 0
        self.down = False
        self.calls: list[tuple[str, str | None]] = []
        self._lock = threading.Lock()

    def _up(self, step: str) -> None:
        if self.down:
            raise EffectError(step, "the engine does not answer (fault)")

    # -- the routes ----------------------------------------------------------
    def models(self, *, timeout_s: float | None = None) -> dict[str, str | None]:
        self._up("models")
        with self._lock:
            return {BASE_NAME: None, **{n: BASE_NAME for n in self.adapters}}

    def load_lora_adapter(self, name: str, path: str, *, timeout_s: float | None = None
                          ) -> None:
        self._up("load_adapter")
        self.calls.append(("load", name))
        with self._lock:
            if self.refuse_loads:
                self.refuse_loads -= 1
                raise RequestRejected("load_adapter", f"refused {name} (fault)", status=400)
            if name in self.adapters:
                raise RequestRejected("load_adapter", f"{name} is already loaded", status=400)
            if self.swallow_loads:
                self.swallow_loads -= 1
                return
            if self.base_under_name:
                self.base_under_name -= 1
                self.adapters[name] = self.base
                self.keys[name] = self.base_key
            else:
                digest = files_digest(path, self.base_key)
                if digest:
                    key = f"adapter:{digest}"
                    self.adapters[name] = _shared_model(key, lambda: self._merged(path))
                else:
                    key = f"unshared:{next(_UNSHARED)}"
                    self.adapters[name] = self._merged(path)
                self.keys[name] = key
            self.paths[name] = path

    def _merged(self, path: str) -> Any:
        from peft import PeftModel

        from rolloutcore.verification.hf_load import HF_LOCK

        with HF_LOCK:
            # PEFT reads the directory and adds each layer's B @ A x scale to a copy of
            # the base's weights: the same function as the unmerged model (float32
            # rounding apart), at the base's cost per token (the probes decode token by
            # token, on every replica).
            m = PeftModel.from_pretrained(copy.deepcopy(self.base), path).merge_and_unload()
        return m.eval()

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None:
        self._up("unload_adapter")
        self.calls.append(("unload", name))
        with self._lock:
            if self.fail_unloads:
                self.fail_unloads -= 1
                raise EffectTimeout("unload_adapter", timeout_s or 1.0)
            if name not in self.adapters:
                raise RequestRejected("unload_adapter", f"{name} is not loaded", status=404)
            del self.adapters[name]
            self.keys.pop(name, None)
            self.paths.pop(name, None)

    def top_logprobs(self, token_ids: list[int], *, max_tokens: int, top: int,
                     model: str | None = None, timeout_s: float | None = None
                     ) -> list[tuple[int, dict[int, float]]]:
        self._up("generate")
        with self._lock:
            if model is None or model == BASE_NAME:
                m, key = self.base, self.base_key
            elif model in self.adapters:
                m, key = self.adapters[model], self.keys[model]
            else:
                raise RequestRejected("generate", f"model {model} does not exist", status=404)
        request = (key, tuple(token_ids), max_tokens, top)
        with _SHARED_LOCK:
            known = _ANSWERS.get(request)
        if known is None:
            known = self._decode(m, token_ids, max_tokens, top)
            with _SHARED_LOCK:
                _ANSWERS[request] = known
        return [(tok, dict(tops)) for tok, tops in known]

    def _decode(self, m: Any, token_ids: list[int], max_tokens: int, top: int
                ) -> list[tuple[int, dict[int, float]]]:
        torch = self.torch
        ids = list(token_ids)
        out: list[tuple[int, dict[int, float]]] = []
        with torch.inference_mode():
            # Decoding with the model's KV cache, as an engine does: the prompt once, then
            # one token per step (a full forward per token made this fake O(n^2)).
            step = torch.tensor([ids])
            past = None
            for _ in range(max_tokens):
                res = m(step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                lp = torch.log_softmax(res.logits[0, -1].float(), -1)
                vals, idx = lp.topk(top)
                tok = int(idx[0])
                out.append((tok, dict(zip(idx.tolist(), vals.tolist(), strict=True))))
                step = torch.tensor([[tok]])
        return out
