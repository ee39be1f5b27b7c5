"""Qwen3 models' shapes from their public config values: no weights, no download.

``QWEN3`` holds the sizes of the scaling curve (issue 49), 0.6B to 32B; the
architecture values are the public ``config.json`` ones, shared by the family
except where a size sets its own.
"""

from __future__ import annotations

from typing import Any

__all__ = ["QWEN3", "QWEN3_8B", "qwen3_specs"]

# Qwen3-8B's public config.json values (architecture only; no weights needed).
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645,
    "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 12288,
    "max_position_embeddings": 40960, "max_window_layers": 36,
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}




def _size(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    return {**QWEN3_8B, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "max_window_layers": layers,
            "num_attention_heads": heads, "tie_word_embeddings": tied}


#: name -> config, by the public config values of each size (head_dim 128 and 8 KV
#: heads throughout; the three smallest tie the output projection to the embedding).
QWEN3: dict[str, dict[str, Any]] = {
    "0.6b": _size(1024, 3072, 28, 16, True),
    "1.7b": _size(2048, 6144, 28, 16, True),
    "4b": _size(2560, 9728, 36, 32, True),
    "8b": QWEN3_8B,
    "14b": _size(5120, 17408, 40, 40, False),
    "32b": _size(5120, 25600, 64, 64, False),
}


def qwen3_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attn.q_proj.weight", (nq * d, h)),
                (p + "self_attn.k_proj.weight", (nkv * d, h)),
                (p + "self_attn.v_proj.weight", (nkv * d, h)),
                (p + "self_attn.o_proj.weight", (h, nq * d)),
                (p + "self_attn.q_norm.weight", (d,)),
                (p + "self_attn.k_norm.weight", (d,)),
                (p + "post_attention_layernorm.weight", (h,)),
                (p + "mlp.gate_proj.weight", (i, h)),
                (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i))]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings"):  # a tied head is the embedding: not sent
        out.append(("lm_head.weight", (v, h)))
    return out
