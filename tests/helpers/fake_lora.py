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
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

from rolloutcore.errors import EffectError, EffectTimeout, RequestRejected

BASE_NAME = "policy"


class LoraEngine:
    def __init__(self, checkpoint: str | Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        from rolloutcore.verification.hf_load import HF_LOCK

        with HF_LOCK:  # beside the managers' own loads, in their threads
            self.base = AutoModelForCausalLM.from_pretrained(str(checkpoint),
                                                             dtype=torch.float32)
        self.base.eval()
        self.adapters: dict[str, Any] = {}     # name -> model computing it
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
            else:
                from peft import PeftModel

                from rolloutcore.verification.hf_load import HF_LOCK

                with HF_LOCK:
                    # PEFT reads the directory and adds each layer's B @ A x scale to
                    # a copy of the base's weights: the same function as the unmerged
                    # model (float32 rounding apart), at the base's cost per token
                    # (the probes decode token by token, on every replica).
                    m = PeftModel.from_pretrained(copy.deepcopy(self.base), path
                                                  ).merge_and_unload()
                m.eval()
                self.adapters[name] = m
            self.paths[name] = path

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
            self.paths.pop(name, None)

    def top_logprobs(self, token_ids: list[int], *, max_tokens: int, top: int,
                     model: str | None = None, timeout_s: float | None = None
                     ) -> list[tuple[int, dict[int, float]]]:
        self._up("generate")
        with self._lock:
            if model is None or model == BASE_NAME:
                m = self.base
            elif model in self.adapters:
                m = self.adapters[model]
            else:
                raise RequestRejected("generate", f"model {model} does not exist", status=404)
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
