"""Tiny Llama-architecture checkpoints, made offline.

Real-engine tests and benchmarks need checkpoints that vLLM loads like any
Hugging Face model, but nothing may come from a model hub. This module writes
one from a seed: a transformers ``LlamaConfig``, random weights saved as
safetensors, and a byte-level BPE tokenizer with no merges (every byte is a
token, so any text round-trips and token ids stay below the vocabulary size).

The tokenizer carries a chat template (``CHAT_TEMPLATE``: plain role
markers, nothing model-specific) so that chat clients work against an
engine serving it: vLLM refuses ``/v1/chat/completions`` with 400 for a
tokenizer without one.

A "next policy" must have the same parameter manifest as the current one, so
that it can be hot-swapped into a running engine. Two ways to get one:

* another seed (``make_checkpoint(out, seed=2)``): every weight differs;
* a perturbation of a given checkpoint (``like=A, negate_layer=K``): the
  weights of A with decoder layer K negated, everything else byte-identical.
  Negating a whole layer (its norms included) flips the sign of what that
  layer adds to the residual stream, so the output changes while the
  embeddings and the other layers stay the same, as in the seed's cache
  experiment.

The shapes are fixed by what the CPU attention backend accepts: head_dim 32
works, 16 kills the engine core on the first request.

``tie_word_embeddings=True`` makes the architecture of most small real models
(Qwen3 and Llama 3.2 small sizes, Gemma): the output projection is the input
embedding. The checkpoint then holds no ``lm_head.weight``, as Hugging Face
saves tied models, so a hot update writes the one shared matrix through
``model.embed_tokens.weight`` only: the case where an engine that keeps a
derived copy of the output projection goes stale.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from rolloutcore.errors import BadInput

__all__ = [
    "ARCHITECTURES",
    "EAGLE_KINDS",
    "BOS_ID",
    "CHAT_TEMPLATE",
    "EOS_ID",
    "PAD_ID",
    "VOCAB_SIZE",
    "LORA_TARGETS",
    "make_adapter",
    "make_eagle_head",
    "make_checkpoint",
    "make_pair",
    "model_config",
]

# 256 byte tokens, then three specials.
BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
VOCAB_SIZE = 259

_HIDDEN = 128
_LAYERS = 2
_HEADS = 4
_KV_HEADS = 2
_HEAD_DIM = 32
_INTERMEDIATE = 256
_MAX_POS = 1024

#: ``<s><|user|>\nHi\n<|assistant|>\n``: every message as a role marker line and its
#: content; with ``add_generation_prompt`` the assistant's marker ends the prompt.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_META_FILE = "rolloutcore.json"


def model_config(*, tie_word_embeddings: bool = False) -> dict[str, Any]:
    """The LlamaConfig keyword arguments every tiny checkpoint shares."""
    if not isinstance(tie_word_embeddings, bool):
        raise BadInput(f"tie_word_embeddings must be a boolean, got {tie_word_embeddings!r}")
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": _HIDDEN,
        "intermediate_size": _INTERMEDIATE,
        "num_hidden_layers": _LAYERS,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _KV_HEADS,
        "head_dim": _HEAD_DIM,
        "max_position_embeddings": _MAX_POS,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "tie_word_embeddings": tie_word_embeddings,
        "rms_norm_eps": 1e-5,
        "torch_dtype": "bfloat16",
    }


def _write_tokenizer(out: Path) -> None:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tf: Any = transformers  # its stubs are partial; use it untyped

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel.alphabet() is unordered; order it by the byte each char stands for
    # (GPT-2's bytes_to_unicode), so token id == byte value.
    vocab = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    if set(vocab) != set(byte_chars):
        raise RuntimeError("byte-level alphabet mismatch in tokenizers")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = tf.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=_MAX_POS,
    )
    fast.chat_template = CHAT_TEMPLATE
    added = fast.convert_tokens_to_ids(["<s>", "</s>", "<pad>"])
    if added != [BOS_ID, EOS_ID, PAD_ID]:
        raise RuntimeError(f"special token ids came out as {added}")
    fast.save_pretrained(str(out))


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable char table, as a list indexed by byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs, strict=True))
    return [chr(table[b]) for b in range(256)]


def _check_seed(what: str, seed: object) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise BadInput(f"{what} must be an int >= 0, got {seed!r}")
    return seed


def _check_out(out_dir: str | Path) -> Path:
    if not isinstance(out_dir, (str, Path)) or not str(out_dir):
        raise BadInput(f"out_dir must be a path, got {out_dir!r}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise BadInput(f"{out} exists and is not an empty directory")
    return out


#: The architectures ``make_checkpoint`` writes: transformers' config and model class.
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    # Qwen3: q/k RMS norms per head, no attention bias; its small sizes tie the
    # output projection to the input embedding (Qwen3-0.6B, 1.7B, 4B).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_checkpoint(out_dir: str | Path, seed: int, *, like: str | Path | None = None,
                    negate_layer: int | None = None,
                    tie_word_embeddings: bool | None = None,
                    architecture: str = "llama") -> Path:
    """Write a tiny Llama (or Qwen3) checkpoint to ``out_dir`` (new or empty) and return it.

    Without ``like`` the weights are random from ``seed``. With ``like`` and
    ``negate_layer`` the weights are those of ``like`` with one decoder layer
    negated (``seed`` is then only recorded). The config and tokenizer are the
    same in both cases, so the result is hot-swappable with ``like``.

    ``tie_word_embeddings`` (default False) ties the output projection to the
    input embedding; with ``like`` it is taken from ``like`` (passing a
    different value is refused: the result would not be hot-swappable).
    ``architecture`` (``ARCHITECTURES``) picks the model class for new weights;
    with ``like`` the architecture is ``like``'s.
    """
    if architecture not in ARCHITECTURES:
        raise BadInput(f"architecture must be one of {sorted(ARCHITECTURES)}, "
                       f"got {architecture!r}")
    _check_seed("seed", seed)
    if tie_word_embeddings is not None and not isinstance(tie_word_embeddings, bool):
        raise BadInput(f"tie_word_embeddings must be a boolean, got {tie_word_embeddings!r}")
    if (like is None) != (negate_layer is None):
        raise BadInput("like and negate_layer go together")
    if negate_layer is not None and (
            isinstance(negate_layer, bool) or not isinstance(negate_layer, int)
            or not 0 <= negate_layer < _LAYERS):
        raise BadInput(f"negate_layer must be an int in [0, {_LAYERS}), got {negate_layer!r}")
    src: Path | None = None
    if like is not None:
        src = Path(like)
        if not (src / "config.json").is_file() or not list(src.glob("*.safetensors")):
            raise BadInput(f"{src} is not a safetensors checkpoint directory")
        src_tied = json.loads((src / "config.json").read_text()).get("tie_word_embeddings")
        if tie_word_embeddings is not None and tie_word_embeddings != bool(src_tied):
            raise BadInput(f"tie_word_embeddings={tie_word_embeddings} differs from {src}'s "
                           f"config ({bool(src_tied)}): the result would not be hot-swappable")
    out = _check_out(out_dir)

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    tf: Any = transformers

    out.mkdir(parents=True, exist_ok=True)
    if src is None:
        tied = bool(tie_word_embeddings)
        config_cls, model_cls = ARCHITECTURES[architecture]
        config = getattr(tf, config_cls)(**model_config(tie_word_embeddings=tied))
        config.architectures = [model_cls]
        # fork_rng: the seed must not leak into (or depend on) the caller's RNG state.
        from rolloutcore.verification.hf_load import HF_LOCK

        with HF_LOCK, torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = getattr(tf, model_cls)(config).to(torch.bfloat16)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if tied:
            # One matrix, saved once under the embedding's name (as save_pretrained does).
            if state["lm_head.weight"].data_ptr() != \
                    model.model.embed_tokens.weight.data_ptr():
                raise RuntimeError("transformers did not tie lm_head to embed_tokens")
            del state["lm_head.weight"]
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out))
        meta: dict[str, Any] = {"seed": seed}
        if architecture != "llama":
            meta["architecture"] = architecture
        if tied:
            meta["tie_word_embeddings"] = True
    else:
        assert negate_layer is not None
        for name in ("config.json", "generation_config.json"):
            if (src / name).is_file():
                (out / name).write_bytes((src / name).read_bytes())
        for shard in sorted(src.glob("*.safetensors")):
            tensors = load_file(str(shard))
            hit = {k: -v if _layer_of(k) == negate_layer else v for k, v in tensors.items()}
            save_file(hit, str(out / shard.name), metadata={"format": "pt"})
        for idx in src.glob("*.safetensors.index.json"):
            (out / idx.name).write_bytes(idx.read_bytes())
        meta = {"seed": seed, "like": str(src.resolve()), "negate_layer": negate_layer}
    _write_tokenizer(out)
    (out / _META_FILE).write_text(json.dumps(meta, sort_keys=True) + "\n")
    return out


def _layer_of(name: str) -> int | None:
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def make_pair(root: str | Path, *, tie_word_embeddings: bool = False,
              architecture: str = "llama") -> tuple[Path, Path]:
    """Checkpoints ``root/A`` (seed 1) and ``root/B`` (seed 2): a policy and its next."""
    base = Path(root)
    return (make_checkpoint(base / "A", 1, tie_word_embeddings=tie_word_embeddings,
                            architecture=architecture),
            make_checkpoint(base / "B", 2, tie_word_embeddings=tie_word_embeddings,
                            architecture=architecture))


#: Every projection of the tiny Llama (what a LoRA on "all linear layers" adapts).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(base_dir: str | Path, seed: int, *, std: float = 0.05, rank: int = 8) -> Any:
    """A PEFT LoRA (``rank``, alpha 2x rank) on every projection of the checkpoint at
    ``base_dir``, its B matrices random with ``std`` (0: PEFT's own initialisation, B = 0,
    i.e. an adapter that changes nothing); A and B both drawn from ``seed``. Needs ``peft``
    and ``transformers``."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadInput(f"seed must be an int, got {seed!r}")
    if not std >= 0 or isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise BadInput(f"std must be >= 0 and rank an int >= 1, got {std!r}, {rank!r}")
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    from rolloutcore.verification.hf_load import HF_LOCK

    # PEFT draws lora_A from torch's global generator: drawn under ``seed``, and without
    # disturbing the caller's generator, so one seed is one adapter whatever ran before.
    with HF_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
        m = peft.get_peft_model(base, peft.LoraConfig(r=rank, lora_alpha=2 * rank,
                                                      target_modules=list(LORA_TARGETS)))
    if std:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * std)
    return m


#: The heads ``make_eagle_head`` writes: random weights, or a head that proposes the
#: token the target just produced (its hidden state passes through the layer untouched).
EAGLE_KINDS = ("random", "repeat")


def make_eagle_head(out_dir: str | Path, seed: int, *, target: str | Path,
                    kind: str = "random") -> Path:
    """Write an EAGLE-1 draft head for the Llama checkpoint ``target`` to ``out_dir``.

    The layout is the one vLLM's ``EagleLlamaForCausalLM`` loads
    (``--speculative-config '{"method": "eagle", ...}'``): ``fc.weight``
    (hidden x 2 hidden, applied to the concatenated token embedding and the
    target's hidden state) and one decoder layer ``layers.0.*`` without an
    input norm; no embedding and no output projection of its own (the engine
    shares the target's). The config is the target's with one layer.

    ``kind="random"``: every tensor random from ``seed`` (a head that drafts,
    and is accepted about never). ``kind="repeat"``: ``fc`` passes the target's
    hidden state through and the layer adds nothing (zero output projections),
    so the head proposes the target's own last prediction again: accepted
    wherever the target repeats a token. ``seed`` then only fills the
    attention and MLP inputs, which do not reach the output.
    """
    _check_seed("seed", seed)
    if kind not in EAGLE_KINDS:
        raise BadInput(f"kind must be one of {list(EAGLE_KINDS)}, got {kind!r}")
    src = Path(target) if isinstance(target, (str, Path)) else None
    if src is None or not (src / "config.json").is_file():
        raise BadInput(f"target must be a checkpoint directory, got {target!r}")
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("architectures") != ["LlamaForCausalLM"]:
        raise BadInput(f"{src} is not a Llama checkpoint (architectures "
                       f"{cfg.get('architectures')!r}): EagleLlamaForCausalLM heads only")
    out = _check_out(out_dir)

    import torch
    from safetensors.torch import save_file

    h, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    hd = int(cfg.get("head_dim") or h // int(cfg["num_attention_heads"]))
    q, kv = int(cfg["num_attention_heads"]) * hd, int(cfg["num_key_value_heads"]) * hd
    shapes = {"fc.weight": (h, 2 * h),
              "layers.0.self_attn.q_proj.weight": (q, h),
              "layers.0.self_attn.k_proj.weight": (kv, h),
              "layers.0.self_attn.v_proj.weight": (kv, h),
              "layers.0.self_attn.o_proj.weight": (h, q),
              "layers.0.mlp.gate_proj.weight": (inter, h),
              "layers.0.mlp.up_proj.weight": (inter, h),
              "layers.0.mlp.down_proj.weight": (h, inter)}
    g = torch.Generator().manual_seed(seed)
    state = {k: torch.randn(s, generator=g) * 0.02 for k, s in shapes.items()}
    state["layers.0.post_attention_layernorm.weight"] = torch.ones(h)
    if kind == "repeat":
        state["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
        state["layers.0.self_attn.o_proj.weight"] = torch.zeros(h, q)
        state["layers.0.mlp.down_proj.weight"] = torch.zeros(h, inter)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1},
                                                indent=2, sort_keys=True) + "\n")
    _write_tokenizer(out)
    (out / _META_FILE).write_text(json.dumps(
        {"seed": seed, "eagle_head": kind, "target": str(src.resolve())},
        sort_keys=True) + "\n")
    return out
