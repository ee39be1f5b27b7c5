"""A LoRA adapter as the trainer hands it over: checked, content-addressed, and its reference.

``AdapterSource.of(peft_model or adapter_dir)`` reads the adapter once, checks
it before anything reaches an engine (``BadInput`` naming what is wrong: no
``adapter_config.json``, not a LoRA, a rank above the engine's
``--max-lora-rank``, no ``lora_A``/``lora_B`` tensors, an A without its B,
non-finite values) and computes its content digest: sha256 over the config
(without the fields that name where it came from) and every tensor's name,
dtype, shape and bytes. The digest names the version (``core.adapters
.adapter_name``); ``write`` puts exactly the digested bytes where the engine
reads them, so what is verified is what was digested.

The reference the engine must reproduce through the adapter is base +
adapter computed on the trainer's side in float32 (PEFT on the base model,
``adapter_probe``), teacher-forced as ``verification.probe.PolicyProbe``
does, but scored through the sampling path (``measure_generated``): the
probes run beside live traffic, where ``prompt_logprobs`` would kill a LoRA
engine on vLLM 0.32's CPU build.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutcore.core.strict import check_int
from rolloutcore.errors import BadInput, EffectError
from rolloutcore.verification.probe import (
    DEFAULT_TOLERANCE,
    ModelOrDir,
    PolicyProbe,
    ProbeCase,
    ProbeResult,
)

if TYPE_CHECKING:
    import torch

__all__ = ["TOP_K", "AdapterSource", "GreedyScorer", "adapter_probe", "is_peft_model",
           "measure_generated"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
#: Config fields that say where an adapter came from or how it was trained, not what it
#: computes (PEFT writes ``inference_mode`` true in a saved directory, false in a model).
_WHERE_FROM = frozenset({"base_model_name_or_path", "revision", "auto_mapping",
                         "inference_mode"})
#: Config fields that are sets (PEFT keeps them as Python sets: any order).
_SETS = frozenset({"target_modules", "modules_to_save", "exclude_modules"})


def is_peft_model(obj: object) -> bool:
    return hasattr(obj, "peft_config") and hasattr(obj, "base_model")


@dataclass(frozen=True)
class AdapterSource:
    """A checked LoRA adapter: its config, its tensors (CPU), its digest and size."""

    config: Mapping[str, Any]
    tensors: Mapping[str, Any]
    content_digest: str
    size_bytes: int
    rank: int

    @classmethod
    def of(cls, adapter: ModelOrDir, *, max_rank: int | None = None) -> AdapterSource:
        """From a PEFT model (its active adapter) or an adapter directory."""
        if isinstance(adapter, (str, Path)):
            config, tensors = _read_dir(Path(adapter))
        elif is_peft_model(adapter):
            config, tensors = _from_peft(adapter)
        else:
            raise BadInput(f"an adapter is a PEFT model or an adapter directory, got "
                           f"{type(adapter).__name__}")
        return cls._checked(config, tensors, max_rank)

    @classmethod
    def _checked(cls, config: dict[str, Any], tensors: dict[str, Any],
                 max_rank: int | None) -> AdapterSource:
        import torch

        if str(config.get("peft_type", "")).upper() != "LORA":
            raise BadInput(f"{CONFIG}: peft_type must be LORA, got {config.get('peft_type')!r}")
        r = check_int(f"{CONFIG}: r", config.get("r"), 1)
        if max_rank is not None and r > max_rank:
            raise BadInput(f"adapter rank {r} exceeds the engine's --max-lora-rank {max_rank}")
        lora = [n for n in tensors if ".lora_A." in n or ".lora_B." in n]
        if not lora:
            raise BadInput(f"0 of {len(tensors)} tensors are lora_A/lora_B: nothing an engine "
                           f"would load as this adapter")
        a = {n.replace(".lora_A.", ".") for n in lora if ".lora_A." in n}
        b = {n.replace(".lora_B.", ".") for n in lora if ".lora_B." in n}
        if a != b:
            odd = sorted(a ^ b)[:3]
            raise BadInput(f"every lora_A needs its lora_B and back: unpaired {odd}")
        digest = hashlib.sha256()
        cfg = {k: sorted(map(str, v)) if k in _SETS and isinstance(v, list) else v
               for k, v in config.items() if k not in _WHERE_FROM}
        digest.update(json.dumps(cfg, sort_keys=True, separators=(",", ":"),
                                 default=str).encode())
        size = 0
        out: dict[str, Any] = {}
        for name in sorted(tensors):
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise BadInput(f"{name}: not a tensor")
            t = t.detach().to("cpu").contiguous()
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                raise BadInput(f"{name}: non-finite values")
            if ".lora_A." in name and t.dim() == 2 and t.shape[0] != r:
                raise BadInput(f"{name}: shape {tuple(t.shape)} does not have rank {r}")
            raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
            digest.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
            digest.update(raw)
            size += len(raw)
            out[name] = t
        return cls(config, out, digest.hexdigest(), size, r)

    def write(self, out_dir: Path) -> Path:
        """Write the config and the tensors (exactly the digested bytes) into ``out_dir``."""
        from safetensors.torch import save_file

        if out_dir.exists():
            raise BadInput(f"{out_dir} exists: an adapter version's directory is never reused")
        out_dir.mkdir(parents=True)
        (out_dir / CONFIG).write_text(json.dumps(dict(self.config), indent=1, default=str))
        save_file(dict(self.tensors), str(out_dir / WEIGHTS))
        return out_dir


def _read_dir(d: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    if not d.is_dir():
        raise BadInput(f"adapter directory {d} does not exist")
    cfg_path = d / CONFIG
    if not cfg_path.is_file():
        raise BadInput(f"{d} has no {CONFIG}: not a PEFT adapter directory")
    try:
        config = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadInput(f"{cfg_path} is not JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise BadInput(f"{cfg_path}: expected an object")
    w = d / WEIGHTS
    if not w.is_file():
        raise BadInput(f"{d} has no {WEIGHTS}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(w))
    except (SafetensorError, OSError, ValueError) as exc:
        raise BadInput(f"{w} is not a readable safetensors file: {exc}") from exc
    return config, dict(tensors)


def _from_peft(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    from peft import get_peft_model_state_dict

    name = getattr(model, "active_adapter", "default")
    if not isinstance(name, str):
        raise BadInput("a PEFT model with several active adapters: pass one adapter")
    cfg = model.peft_config[name].to_dict()
    state = get_peft_model_state_dict(model, adapter_name=name)
    return (json.loads(json.dumps(cfg, default=_jsonable)),
            {k: v.detach().to("cpu").clone() for k, v in state.items()})


def _jsonable(v: object) -> object:
    if isinstance(v, (set, frozenset)):
        return sorted(v)
    return str(v)


#: Alternatives the engine reports per generated position (vLLM's default ``max_logprobs``).
TOP_K = 20


class GreedyScorer(Protocol):
    """What ``measure_generated`` needs from an engine client (``VllmHTTP`` provides it)."""

    def top_logprobs(self, token_ids: Sequence[int], *, max_tokens: int, top: int,
                     model: str | None = None, timeout_s: float | None = None
                     ) -> list[tuple[int, dict[int, float]]]: ...


def measure_generated(probe: PolicyProbe, http: GreedyScorer, model: str | None, *,
                      timeout_s: float | None = None) -> ProbeResult:
    """``probe`` measured through the sampling path: teacher-forced by generation.

    Each case's prompt is continued greedily with the top ``TOP_K``
    log-probabilities at every position; the engine's log-probability of the
    reference token is read there. Where the engine's token differs from the
    reference's (a near-tie, or a wrong policy), the next request continues
    from the reference's token, so every position is scored on the reference's
    context, as ``PolicyProbe.measure`` scores it with ``prompt_logprobs``
    (which cannot run beside other requests on vLLM 0.32's CPU build with LoRA
    enabled: ``VllmHTTP.top_logprobs``). A reference token the engine does not
    rank among its top ``TOP_K`` counts as an infinite deviation: it is the
    reference's own argmax. The cases run at once (each on its own thread, the
    engine batches them); the first case's failure in case order is raised once
    all have answered or timed out.
    """
    def one(ci: int, case: ProbeCase) -> list[tuple[float, int, int]]:
        out: list[tuple[float, int, int]] = []
        j = 0
        n = len(case.continuation)
        while j < n:
            ctx = [*case.prompt, *case.continuation[:j]]
            got = http.top_logprobs(ctx, max_tokens=n - j, top=TOP_K, model=model,
                                    timeout_s=timeout_s)
            if not got:
                raise EffectError("validate_live", "the engine generated no token")
            for tok, tops in got:
                want = case.continuation[j]
                have = tops.get(want)
                out.append((math.inf if have is None else abs(have - case.logprobs[j]),
                            ci, j))
                j += 1
                if tok != want or j >= n:
                    break
        return out

    # The cases are independent requests of one model: sent together, the engine
    # decodes them in one batch (one decode's latency instead of one per case).
    cases = list(enumerate(probe.cases))
    if len(cases) == 1:
        per_case = [one(*cases[0])]
    else:
        with ThreadPoolExecutor(len(cases), thread_name_prefix="rc-probe") as pool:
            futures = [pool.submit(one, ci, case) for ci, case in cases]
            per_case = [f.result() for f in futures]
    probe.last = ProbeResult.of([d for case_diffs in per_case for d in case_diffs])
    return probe.last


def adapter_probe(base: ModelOrDir, adapter_dir: Path, *,
                  reference: torch.nn.Module | None = None,
                  prompts: Sequence[Sequence[int]] | None = None,
                  new_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE) -> PolicyProbe:
    """The trainer-side reference of base + adapter (float32, PEFT), as a policy probe.

    ``base``: the base model's checkpoint directory or a HF causal LM (not
    changed: a float32 copy is taken). ``reference``: the trainer's own model of
    base + adapter (a PEFT model), used instead of loading the two.
    """
    if reference is not None:
        probe = PolicyProbe.from_model(reference, prompts, new_tokens=new_tokens,
                                       tolerance=tolerance)
        probe.name = "adapter-probe"
        return probe
    import copy

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rolloutcore.verification.hf_load import HF_LOCK

    with HF_LOCK:
        model = (AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
                 if isinstance(base, (str, Path)) else copy.deepcopy(base).float())
        peft = PeftModel.from_pretrained(model, str(adapter_dir))
    # PEFT forwards ``config`` to the base: the prompts are the base vocabulary's.
    probe = PolicyProbe.from_model(peft, prompts, new_tokens=new_tokens, tolerance=tolerance)
    probe.name = "adapter-probe"
    return probe

