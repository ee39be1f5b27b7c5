"""A tiny trainer buffer and the model vLLM would hold after loading it (fused qkv and
gate_up, in module order), for the per-parameter checksum tests on the CPU."""

from __future__ import annotations

import torch

from rolloutcore.transports.cuda_ipc import PackedWeights

SHAPES = {"q": (16, 8), "k": (16, 8), "v": (16, 8), "o": (8, 16), "gate": (32, 8),
          "up": (32, 8), "norm": (128,)}
NAMES = {"q": "model.layers.0.self_attn.q_proj.weight",
         "k": "model.layers.0.self_attn.k_proj.weight",
         "v": "model.layers.0.self_attn.v_proj.weight",
         "o": "model.layers.0.self_attn.o_proj.weight",
         "gate": "model.layers.0.mlp.gate_proj.weight",
         "up": "model.layers.0.mlp.up_proj.weight", "norm": "model.norm.weight"}
ORDER = ["q", "k", "v", "o", "gate", "up", "norm"]


def tiny_packed(order: list[str]) -> PackedWeights:
    pk = PackedWeights([(NAMES[k], SHAPES[k], torch.bfloat16) for k in order], device="cpu")
    g = torch.Generator().manual_seed(7)
    for _, t in pk.items():
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    return pk


def engine_model(pk: PackedWeights) -> torch.nn.Module:
    """What vLLM holds after loading ``pk``: fused qkv and gate_up, in module order."""
    t = dict(pk.items())
    p = "model.layers.0."
    m = torch.nn.Module()
    m.model = torch.nn.Module()
    layer = torch.nn.Module()
    m.model.layers = torch.nn.ModuleList([layer])
    layer.self_attn = torch.nn.Module()
    layer.mlp = torch.nn.Module()
    for mod, attr, val in [
            (layer.self_attn, "qkv_proj", torch.cat([t[p + f"self_attn.{x}_proj.weight"]
                                                     for x in "qkv"])),
            (layer.self_attn, "o_proj", t[p + "self_attn.o_proj.weight"]),
            (layer.mlp, "gate_up_proj", torch.cat([t[p + "mlp.gate_proj.weight"],
                                                   t[p + "mlp.up_proj.weight"]]))]:
        sub = torch.nn.Module()
        sub.weight = torch.nn.Parameter(val.clone(), requires_grad=False)
        setattr(mod, attr, sub)
    m.model.norm = torch.nn.Module()
    m.model.norm.weight = torch.nn.Parameter(t["model.norm.weight"].clone(), requires_grad=False)
    return m
