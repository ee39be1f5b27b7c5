"""Tiny Idefics3-architecture vision-language checkpoints, made offline.

The encoder and multimodal caches of vLLM can only be shown stale (and their
reset shown to work) with a model that has an image encoder, and nothing may
come from a model hub. This module writes one from a seed: a transformers
``Idefics3Config`` (a SigLIP-style vision transformer, a pixel-shuffle
connector with one linear projection, and the same tiny Llama text model as
:mod:`rolloutcore.testing.models`), random weights saved as safetensors, the
byte-level tokenizer plus Idefics3's image tokens and a chat template, and
the PIL-backed ``Idefics3ImageProcessorPil``.

Why Idefics3: of the vision-language architectures vLLM 0.32 has, LLaVA,
PaliGemma, Qwen2-VL/2.5-VL, Gemma3 and LLaVA-NeXT all reach
``transformers.models.pixtral.image_processing_pixtral`` (vLLM's
``get_vision_encoder_info`` or a module-level import), which imports
torchvision; the torchvision wheel from PyPI breaks ``import transformers``
on these machines, so it is not installed. vLLM's Idefics3 path imports no
torchvision and handles the PIL image processor explicitly. Image splitting
is off: every image is resized to one 112x112 square, 8x8 patches of 14,
pixel-shuffled by 2 into 16 image tokens.

The "next policy" (:func:`make_vlm_checkpoint` with ``like=`` and
``new_vision_seed=``) keeps every text weight of ``like`` byte-identical and
draws the vision tower and the connector afresh: the only way its output
can differ from ``like``'s on the same prompt is through the image
embedding. So an engine that serves a stale cached embedding after the
update answers exactly as the old policy would, which is what the negative
control detects.

Text shapes: head_dim 32, because the CPU attention backend rejects 16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rolloutcore.errors import BadInput
from rolloutcore.testing.models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    _check_out,
    _check_seed,
    model_config,
)

__all__ = [
    "ARCHITECTURE",
    "IMAGE_SIZE",
    "IMAGE_TOKEN",
    "IMAGE_TOKEN_ID",
    "IMAGE_TOKENS_PER_IMAGE",
    "VLM_VOCAB_SIZE",
    "is_vision_param",
    "make_vlm_checkpoint",
    "make_vlm_pair",
    "vlm_config",
]

ARCHITECTURE = "Idefics3ForConditionalGeneration"
IMAGE_TOKEN = "<image>"

IMAGE_SIZE = 112
_PATCH = 14
_SCALE = 2
IMAGE_TOKENS_PER_IMAGE = (IMAGE_SIZE // _PATCH) ** 2 // _SCALE ** 2

_V_HIDDEN = 64
_V_LAYERS = 2
_V_HEADS = 2
_V_INTERMEDIATE = 128

# Idefics3's processor looks these up by name; the row/column tags are what
# it would write for split images (off here, but their ids must exist).
_EXTRA_TOKENS = ["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>",
                 "<global-img>",
                 *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
IMAGE_TOKEN_ID = VOCAB_SIZE + 1
# Room above the tokenizer's 299 tokens; a multiple of 64 like real vocabularies.
VLM_VOCAB_SIZE = 320

_META_FILE = "rolloutcore.json"
# Plain role-prefixed turns; vLLM puts "<image>" into the string content.
_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
_VISION_PREFIXES = ("model.vision_model.", "model.connector.")


def is_vision_param(name: str) -> bool:
    """True for the vision tower's and the connector's parameter names (HF and vLLM)."""
    return name.startswith(_VISION_PREFIXES)


def vlm_config() -> dict[str, Any]:
    """The Idefics3Config keyword arguments every tiny VLM shares (nested as dicts)."""
    text = dict(model_config())
    text.pop("torch_dtype", None)
    text.update(model_type="llama", vocab_size=VLM_VOCAB_SIZE)
    vision = {
        "model_type": "idefics3_vision",
        "hidden_size": _V_HIDDEN,
        "intermediate_size": _V_INTERMEDIATE,
        "num_hidden_layers": _V_LAYERS,
        "num_attention_heads": _V_HEADS,
        "num_channels": 3,
        "image_size": IMAGE_SIZE,
        "patch_size": _PATCH,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
    }
    return {
        "text_config": text,
        "vision_config": vision,
        "image_token_id": IMAGE_TOKEN_ID,
        "scale_factor": _SCALE,
        "tie_word_embeddings": False,
        "pad_token_id": PAD_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def _write_processor(out: Path) -> None:
    import transformers
    from tokenizers import AddedToken

    from rolloutcore.testing.models import _write_tokenizer

    tf: Any = transformers
    _write_tokenizer(out)
    tok = tf.PreTrainedTokenizerFast.from_pretrained(str(out))
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken(t, special=True, normalized=False) for t in _EXTRA_TOKENS]})
    ids = tok.convert_tokens_to_ids(_EXTRA_TOKENS)
    if ids != list(range(VOCAB_SIZE, VOCAB_SIZE + len(_EXTRA_TOKENS))):
        raise RuntimeError(f"image tokens came out as ids {ids}")
    if len(tok) > VLM_VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {len(tok)} tokens, model {VLM_VOCAB_SIZE}")
    tok.chat_template = _CHAT_TEMPLATE
    image_processor = tf.Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": IMAGE_SIZE},
        max_image_size={"longest_edge": IMAGE_SIZE},
    )
    proc = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tok,
                                image_seq_len=IMAGE_TOKENS_PER_IMAGE,
                                chat_template=_CHAT_TEMPLATE)
    if proc.image_token_id != IMAGE_TOKEN_ID:
        raise RuntimeError(f"<image> came out as id {proc.image_token_id}")
    proc.save_pretrained(str(out))


def _check_like(like: str | Path) -> Path:
    if not isinstance(like, (str, Path)) or not str(like):
        raise BadInput(f"like must be a path, got {like!r}")
    src = Path(like)
    cfg = src / "config.json"
    if not cfg.is_file() or not (src / "model.safetensors").is_file():
        raise BadInput(f"{src} is not a checkpoint made by make_vlm_checkpoint")
    try:
        arch = json.loads(cfg.read_text()).get("architectures")
    except (OSError, ValueError, AttributeError) as exc:
        raise BadInput(f"{cfg} is not readable JSON: {exc}") from exc
    if arch != [ARCHITECTURE]:
        raise BadInput(f"{src} is not an {ARCHITECTURE} checkpoint (architectures {arch!r})")
    return src


def make_vlm_checkpoint(out_dir: str | Path, seed: int, *, like: str | Path | None = None,
                        new_vision_seed: int | None = None) -> Path:
    """Write a tiny Idefics3 checkpoint to ``out_dir`` (new or empty) and return it.

    Without ``like`` every weight is random from ``seed``. With ``like`` and
    ``new_vision_seed`` the text model's weights are copied from ``like``
    byte for byte and the vision tower and connector are drawn from
    ``new_vision_seed`` (``seed`` is then only recorded), so the result is
    hot-swappable with ``like`` and differs from it only in the image path.
    """
    _check_seed("seed", seed)
    if (like is None) != (new_vision_seed is None):
        raise BadInput("like and new_vision_seed go together")
    src: Path | None = None
    if like is not None:
        _check_seed("new_vision_seed", new_vision_seed)
        src = _check_like(like)
    out = _check_out(out_dir)

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    tf: Any = transformers

    config = tf.Idefics3Config(**vlm_config())
    config.architectures = [ARCHITECTURE]
    # fork_rng: the seed must not leak into (or depend on) the caller's RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed if new_vision_seed is None else new_vision_seed)
        model = tf.Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        # Zero-initialised biases and unit norms would be equal in every
        # seed: jitter them so that every vision parameter differs between
        # policies and a checksum of any one of them tells them apart.
        for k, v in state.items():
            if is_vision_param(k) and (v.ndim == 1 or k.endswith(".bias")):
                state[k] = (v.float() + 0.02 * torch.randn_like(v.float())).to(v.dtype)
    meta: dict[str, Any] = {"seed": seed, "architecture": ARCHITECTURE}
    if src is not None:
        old = load_file(str(src / "model.safetensors"))
        if set(old) != set(state) or any(old[k].shape != state[k].shape for k in old):
            raise BadInput(f"{src} does not have this module's parameter manifest")
        state = {k: (v if is_vision_param(k) else old[k]) for k, v in state.items()}
        meta.update(like=str(src.resolve()), new_vision_seed=new_vision_seed)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    _write_processor(out)
    (out / _META_FILE).write_text(json.dumps(meta, sort_keys=True) + "\n")
    return out


def make_vlm_pair(root: str | Path) -> tuple[Path, Path]:
    """``root/A`` (seed 1) and ``root/B``: A's text weights, a new vision tower and connector."""
    base = Path(root)
    a = make_vlm_checkpoint(base / "A", 1)
    return a, make_vlm_checkpoint(base / "B", 1, like=a, new_vision_seed=2)
