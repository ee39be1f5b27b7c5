"""vLLM's own engine options on a launched engine: which pass through, which RolloutCore owns.

What this module owns: the vocabulary of ``serve --vllm-arg`` (and of
everything after ``--`` on ``serve``'s command line) and the defaults of the
tiny checkpoints. It starts nothing and knows nothing of the gateway.

* **Passed through**: every vLLM engine option (context length, memory share,
  dtype, quantization, ``--enforce-eager``, ...) reaches the launched vLLM's
  command line as given, after RolloutCore's own arguments.
* **Owned**: the options RolloutCore sets itself and depends on (``OWNED``),
  each refused with the reason and the option to use instead, before
  anything starts (``check_vllm_args``).
* **Tiny defaults**: ``--dtype bfloat16 --max-model-len 512`` suit the tiny
  offline checkpoints (``rolloutcore.testing.models``, which mark their
  directory with ``rolloutcore.json``). They apply to such a checkpoint only,
  and only where neither the caller nor the passed-through options chose
  (``engine_defaults``); a real model gets vLLM's own defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from rolloutcore.errors import BadInput

__all__ = ["OWNED", "TINY_DEFAULTS", "TINY_MARKER", "check_vllm_args", "engine_defaults",
           "flag_value", "has_flag", "is_tiny_checkpoint"]

#: The file ``rolloutcore.testing.models`` writes into every tiny checkpoint.
TINY_MARKER = "rolloutcore.json"

#: The tiny checkpoints' engine settings (their context is 1024 positions; 512 keeps
#: the CPU engine's KV cache small).
TINY_DEFAULTS: dict[str, object] = {"dtype": "bfloat16", "max_model_len": 512}

_LAUNCHED = "RolloutCore launches and reaches the engine itself"
#: vLLM options that RolloutCore sets on a launched engine, with why and what to use.
OWNED: dict[str, str] = {
    "--host": f"{_LAUNCHED} on loopback (the gateway's bind address is serve --host)",
    "--port": f"{_LAUNCHED} on a free port (the gateway's port is serve --port)",
    "--model": "the checkpoint is serve --model DIR (its identity is the first version)",
    "--served-model-name": "the gateway serves the model as 'policy'",
    "--weight-transfer-config": "the weight-transfer backend is serve --transport-backend",
    "--worker-extension-cls": "use serve --worker-extension-cls (checked against the "
                              "transport)",
    "--middleware": "RolloutCore adds its route guard (only the gateway may pause or "
                    "write weights); another middleware would see every request first",
    "--enable-scale-out": "always on: the token-in/token-out route the gateway generates "
                          "through",
    "--enable-prefix-caching": "always on: every update resets it (the cache boundary)",
    "--no-enable-prefix-caching": "prefix caching stays on: every update resets it",
    "--tensor-parallel-size": "use serve --tensor-parallel-size (each rank is checked)",
    "-tp": "use serve --tensor-parallel-size (each rank is checked)",
    "--pipeline-parallel-size": "use serve --pipeline-parallel-size (each stage is checked)",
    "-pp": "use serve --pipeline-parallel-size (each stage is checked)",
    "--data-parallel-size": "one engine per gateway version: several engines are serve "
                            "--engines N (each verified)",
    "-dp": "one engine per gateway version: several engines are serve --engines N",
    "--enable-lora": "use serve --lora (adapter versions are verified and journaled)",
    "--max-loras": "use serve --lora --max-loras N",
    "--max-lora-rank": "use serve --lora --max-lora-rank R",
    "--max-cpu-loras": "serve --lora sizes it from the adapter budget",
    "--api-key": "the gateway is the only client of a launched engine: its data token is "
                 "serve --data-token",
    "--uds": f"{_LAUNCHED} over TCP on loopback",
    "--root-path": f"{_LAUNCHED} at its root URL",
    "--headless": "the gateway needs the engine's HTTP server",
}


def _name(arg: str) -> str:
    return arg.split("=", 1)[0]


def has_flag(args: Sequence[str], flag: str) -> bool:
    """``flag`` given in ``args``, as ``--flag VALUE`` or ``--flag=VALUE``."""
    return any(_name(a) == flag for a in args)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value the last ``flag`` in ``args`` gives (``--flag V`` or ``--flag=V``)."""
    value: str | None = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def check_vllm_args(args: Sequence[str], *, launched: bool = True) -> tuple[str, ...]:
    """The passed-through vLLM options, or ``BadInput`` naming the first refused one.

    ``launched`` is false for a running engine (``serve --upstream``): it keeps
    the options it was started with, so none can be passed.
    """
    out = tuple(args)
    if not all(isinstance(a, str) and a for a in out):
        raise BadInput(f"vLLM options must be non-empty strings, got {list(out)!r}")
    if out and not launched:
        raise BadInput(f"vLLM option {out[0]}: a running engine (--upstream) keeps the "
                       "options it was started with; pass them where you start it "
                       "(docs/own-vllm.md)")
    if out and not out[0].startswith("-"):
        raise BadInput(f"vLLM option {out[0]!r} is not an option (--name or --name=value): "
                       "the model is serve --model DIR")
    for a in out:
        if a.startswith("-") and _name(a) in OWNED:
            raise BadInput(f"vLLM option {_name(a)} is RolloutCore's on a launched engine: "
                           f"{OWNED[_name(a)]}")
    return out


def is_tiny_checkpoint(model_dir: str | Path) -> bool:
    """Is ``model_dir`` one of RolloutCore's tiny offline checkpoints?"""
    return (Path(model_dir) / TINY_MARKER).is_file()


def engine_defaults(model_dir: str | Path, dtype: str | None, max_model_len: int | None,
                    extra_args: Sequence[str]) -> tuple[str | None, int | None]:
    """The engine's effective ``(dtype, max_model_len)``; ``None``: vLLM's own default.

    The passed-through options win, then the caller's values, then the tiny
    defaults (a tiny checkpoint only).
    """
    tiny = is_tiny_checkpoint(model_dir)
    given_dtype = flag_value(extra_args, "--dtype")
    given_len = flag_value(extra_args, "--max-model-len")
    if given_dtype is not None:
        dtype = given_dtype
    elif dtype is None and tiny:
        dtype = str(TINY_DEFAULTS["dtype"])
    if given_len is not None:
        max_model_len = int(given_len) if given_len.isdigit() else None
    elif max_model_len is None and tiny:
        max_model_len = int(str(TINY_DEFAULTS["max_model_len"]))
    return dtype, max_model_len
