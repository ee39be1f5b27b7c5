"""The trainer's module as the engine expects it, and the probe computed from it."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rolloutcore.core.versions import (
    ParameterManifest,
)
from rolloutcore.errors import (
    BadInput,
)

if TYPE_CHECKING:
    import torch

    from rolloutcore.verification.probe import PolicyProbe

__all__ = ["engine_state_dict", "probe_for"]

# --------------------------------------------------------------------------- weights


def engine_state_dict(model: object, manifest: ParameterManifest) -> dict[str, torch.Tensor]:
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
    out: dict[str, torch.Tensor] = {}
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


def _probe_reference(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> Any:
    """A float32 copy of ``model`` holding exactly the tensors sent (cast back up)."""
    import torch

    ref: Any = copy.deepcopy(model)   # a transformers model (its config, its checkpointing)
    if getattr(ref, "is_gradient_checkpointing", False):
        # TRL turns it on; transformers then drops the KV cache even in eval mode.
        ref.gradient_checkpointing_disable()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.grad = None
            p.requires_grad_(False)
            p.data = state[name].to(torch.float32)
    return ref.float().eval()


def probe_for(model: torch.nn.Module, state: Mapping[str, torch.Tensor], *, tolerance: float,
              new_tokens: int = 16) -> PolicyProbe:
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


