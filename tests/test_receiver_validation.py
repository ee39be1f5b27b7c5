"""Engine-side weight receivers trust nothing in a request, and tied weights stay exact.

Forged payloads for every field a receiver acts on, each refused with a
clear error before anything is connected to, allocated, mapped or written:

* gloo ``init_info`` (``check_init_info``): the rendezvous address, the
  timeout, the world size, against the engine's own ``ReceiverPolicy``;
* gloo ``update_info`` (``check_against_model``): names, shapes, dtypes
  against the engine's own parameters (vLLM-shaped stand-ins: fused
  ``qkv_proj`` with ``output_sizes``, a vocab-padded embedding, a tied head,
  a packed layer whose live weight is empty);
* CUDA IPC handles, without a GPU: the wire checks of ``BufferHandle``, the
  reference-counter file (``check_ref_counter_file``), the declared storage
  against the opened allocation (``check_mapped_range``), and ``map_buffer``'s
  order (counter checked before the open, range after it, refusal releases).

And the tied-embedding fix (``transports.derived``), by simulation of the
CPU backend's packed GEMM: a head whose ``cpu_linear`` closes over a copy of
the shared weight, which vLLM's layerwise reload never rebuilds. The real
vLLM path is exercised by ``tests/engine/test_tied_models.py``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from rolloutcore.errors import BadInput
from rolloutcore.transports import derived
from rolloutcore.transports.cuda_ipc import wire
from rolloutcore.transports.cuda_ipc.loader import (
    SliceLoader,
    check_mapped_range,
    check_ref_counter_file,
    map_buffer,
)
from rolloutcore.transports.cuda_ipc.wire import (
    REF_COUNTER_FILE_BYTES,
    REF_COUNTER_SLOTS,
    BufferHandle,
    EntrySpec,
    ResultSlot,
    UpdateMessage,
    decode_update,
    encode_update,
)
from rolloutcore.transports.gloo import (
    MAX_WORLD_SIZE,
    GlooInitInfo,
    GlooUpdateInfo,
    ModelIndex,
    ReceiverPolicy,
    check_against_model,
    check_init_info,
)

# ------------------------------------------------------------------ vLLM-shaped model


class UnquantizedEmbeddingMethod:
    """Stands in for vLLM's: on a packing host its processing makes ``cpu_linear`` a
    closure over a *copy* of the weight (as the sgl / oneDNN paths do), and leaves the
    weight itself intact. Counts its runs."""

    runs = 0

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        type(self).runs += 1
        packed = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, w, b: torch.nn.functional.linear(x, packed, b)


class UnquantizedLinearMethod:
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        raise AssertionError("a linear layer's processing must not be re-run")


class Fp8LinearMethod(UnquantizedLinearMethod):
    pass


def _param(*shape: int, output_dim: int | None = 0, dtype: torch.dtype = torch.float32,
           seed: int = 0) -> torch.nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    p = torch.nn.Parameter(torch.randn(*shape, generator=g).to(dtype), requires_grad=False)
    if output_dim is not None:
        p.output_dim = output_dim  # type: ignore[attr-defined]
        p.input_dim = 1 - output_dim if len(shape) == 2 else None  # type: ignore[attr-defined]
    return p


class Layer(torch.nn.Module):
    def __init__(self, *shape: int, method: Any = None, seed: int = 0, **attrs: Any) -> None:
        super().__init__()
        self.weight = _param(*shape, seed=seed)
        if method is not None:
            self.quant_method = method
        for k, v in attrs.items():
            setattr(self, k, v)


class Head(Layer):
    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.cpu_linear(h, self.weight, None)  # type: ignore[no-any-return,operator]


class Model(torch.nn.Module):
    """Llama-shaped, as vLLM builds it: padded vocab 32 (of 30), hidden 8, fused qkv
    (q 8, k 4, v 4) and gate_up (2 x 16), tied head unless ``tied=False``."""

    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, tied: bool = True, seed: int = 0, tp: int = 1,
                 head_method: Any = None) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = Layer(32, 8, method=UnquantizedEmbeddingMethod(), seed=seed)
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = Layer(16 // tp, 8, method=UnquantizedLinearMethod(),
                                         output_sizes=[8, 4, 4], tp_size=tp, seed=seed + 1)
        layer.mlp = torch.nn.Module()
        layer.mlp.gate_up_proj = Layer(32, 8, method=UnquantizedLinearMethod(),
                                       output_sizes=[16, 16], seed=seed + 2)
        layer.mlp.down_proj = Layer(8, 16, method=UnquantizedLinearMethod(), seed=seed + 3)
        layer.norm = torch.nn.Module()
        layer.norm.weight = _param(8, output_dim=None, seed=seed + 4)
        self.model.layers = torch.nn.ModuleList([layer])
        self.lm_head = Head(32, 8, method=head_method or UnquantizedEmbeddingMethod(),
                            seed=seed + 5)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        for mod in (self.model.embed_tokens, self.lm_head):
            mod.quant_method.process_weights_after_loading(mod)


def _round(**over: Any) -> GlooUpdateInfo:
    items = {
        "model.embed_tokens.weight": ("float32", [30, 8]),  # vocab 30, padded to 32
        "model.layers.0.self_attn.q_proj.weight": ("bfloat16", [8, 8]),
        "model.layers.0.self_attn.k_proj.weight": ("bfloat16", [4, 8]),
        "model.layers.0.self_attn.v_proj.weight": ("bfloat16", [4, 8]),
        "model.layers.0.mlp.gate_proj.weight": ("float32", [16, 8]),
        "model.layers.0.mlp.up_proj.weight": ("float32", [16, 8]),
        "model.layers.0.mlp.down_proj.weight": ("float32", [8, 16]),
        "model.layers.0.norm.weight": ("float32", [8]),
    }
    for k, v in over.items():
        name = k.replace("__", ".")
        if v is None:
            items.pop(name)
        else:
            items[name] = v
    return GlooUpdateInfo(list(items), [d for d, _ in items.values()],
                          [s for _, s in items.values()])


# ------------------------------------------------------------------ gloo init_info


def _init(addr: str = "127.0.0.1", **kw: Any) -> GlooInitInfo:
    return GlooInitInfo(**{"master_address": addr, "master_port": 29500, "rank_offset": 1,
                           "world_size": 2, "timeout_s": 60.0, **kw})


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.3.2.1", "::1", "localhost"])
def test_loopback_rendezvous_is_accepted_by_default(addr: str) -> None:
    check_init_info(_init(addr), ReceiverPolicy())


@pytest.mark.parametrize("addr", ["10.1.2.3", "192.168.0.7", "0.0.0.0", "8.8.8.8",
                                  "fe80::1", "evil.example.com", "127.0.0.1.nip.io",
                                  "127.0.0.1 ", "LOCALHOST"])
def test_any_other_rendezvous_address_is_refused_by_default(addr: str) -> None:
    with pytest.raises(ValueError, match=r"master_address .* refused"):
        check_init_info(_init(addr), ReceiverPolicy())


def test_the_allow_list_comes_from_the_engine_environment() -> None:
    pol = ReceiverPolicy.from_env({"ROLLOUTCORE_GLOO_PEERS": " 10.0.0.0/24, 192.168.1.5 ,"})
    check_init_info(_init("10.0.0.77"), pol)
    check_init_info(_init("192.168.1.5"), pol)
    check_init_info(_init("127.0.0.1"), pol)  # loopback stays allowed
    for bad in ("10.0.1.1", "192.168.1.6", "host.in.10.0.0.0.example"):
        with pytest.raises(ValueError, match="ROLLOUTCORE_GLOO_PEERS"):
            check_init_info(_init(bad), pol)
    with pytest.raises(ValueError, match="not an IP address"):
        ReceiverPolicy.from_env({"ROLLOUTCORE_GLOO_PEERS": "trainer.local"})


def test_timeouts_are_capped_by_the_engine() -> None:
    check_init_info(_init(timeout_s=300), ReceiverPolicy())
    with pytest.raises(ValueError, match="exceeds this engine's cap of 300"):
        check_init_info(_init(timeout_s=86400), ReceiverPolicy())  # a day: the old bound
    pol = ReceiverPolicy.from_env({"ROLLOUTCORE_GLOO_MAX_TIMEOUT_S": "30"})
    assert pol.max_timeout_s == 30
    with pytest.raises(ValueError, match="cap of 30"):
        check_init_info(_init(timeout_s=31), pol)
    for raw in ("soon", "0", "-5", "1e9", "inf", "nan"):
        with pytest.raises(ValueError):
            ReceiverPolicy.from_env({"ROLLOUTCORE_GLOO_MAX_TIMEOUT_S": raw})


def test_worlds_and_structure_are_bounded() -> None:
    with pytest.raises(ValueError, match="world_size"):
        check_init_info(_init(world_size=MAX_WORLD_SIZE + 1), ReceiverPolicy())
    for kw in ({"master_port": 0}, {"master_port": 70000}, {"rank_offset": 0},
               {"rank_offset": 2}, {"world_size": True}, {"timeout_s": 0},
               {"timeout_s": float("nan")}, {"master_address": ""}):
        with pytest.raises(ValueError):
            _init(**kw)


# ------------------------------------------------------------------ gloo update_info


def test_a_checkpoint_round_places_on_the_model() -> None:
    m = Model()
    written = check_against_model(_round(), m)
    assert written == {"model.embed_tokens.weight",
                       "model.layers.0.self_attn.qkv_proj.weight",
                       "model.layers.0.mlp.gate_up_proj.weight",
                       "model.layers.0.mlp.down_proj.weight", "model.layers.0.norm.weight"}
    check_against_model(_round(model__embed_tokens__weight=("bfloat16", [32, 8])), m)


@pytest.mark.parametrize(("over", "match"), [
    ({"model__layers__0__self_attn__o_proj__weight": ("float32", [8, 8])},
     "not a parameter of this model"),
    ({"lm_head__weight": ("float32", [30, 8])}, "tied to model.embed_tokens.weight"),
    ({"model__embed_tokens__weight": ("float32", [33, 8])}, r"does not fit .*\[32, 8\]"),
    ({"model__embed_tokens__weight": ("float32", [1 << 40, 8])}, "does not fit"),
    ({"model__embed_tokens__weight": ("float32", [30, 8, 1])}, "does not fit"),
    ({"model__layers__0__self_attn__k_proj__weight": ("bfloat16", [8, 8])},
     r"does not fit .*qkv_proj.weight \(at most \[4, 8\]"),
    ({"model__layers__0__norm__weight": ("int64", [8])}, "does not convert exactly"),
    ({"model__layers__0__norm__weight": ("bool", [8])}, "does not convert exactly"),
    ({"model__layers__0__norm__weight": ("float8_e4m3fn", [8])}, "does not convert"),
    ({"model__layers__0__self_attn__qkv_proj__weight": ("float32", [16, 8])},
     "both land on model.layers.0.self_attn.qkv_proj.weight"),
])
def test_a_forged_round_is_refused_naming_the_tensor(over: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_against_model(_round(**over), Model())


def test_an_untied_head_is_its_own_parameter() -> None:
    m = Model(tied=False)
    assert "lm_head.weight" in check_against_model(
        _round(lm_head__weight=("float32", [30, 8])), m)


def test_the_whole_fused_parameter_and_a_shard_of_it_clash_in_either_order() -> None:
    whole = ("model.layers.0.self_attn.qkv_proj.weight", "float32", [16, 8])
    shard = ("model.layers.0.self_attn.q_proj.weight", "float32", [8, 8])
    for a, b in ((whole, shard), (shard, whole)):
        info = GlooUpdateInfo([a[0], b[0]], [a[1], b[1]], [a[2], b[2]])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="both land on"):
            check_against_model(info, Model())


def test_tensor_parallel_shards_fit_the_whole_checkpoint_tensor() -> None:
    m = Model(tp=2)  # qkv_proj holds [8, 8] per worker; output_sizes stay whole
    check_against_model(_round(), m)
    with pytest.raises(ValueError, match="does not fit"):
        check_against_model(
            _round(model__layers__0__self_attn__q_proj__weight=("bfloat16", [9, 8])), m)


def test_a_packed_layer_is_checked_against_its_load_format_not_its_empty_weight() -> None:
    """On a packing CPU host a linear layer's live weight is empty (its GEMM holds the
    packed copy); vLLM's reload metadata keeps the format a load writes."""
    m = Model()
    down = m.model.layers[0].mlp.down_proj
    fmt = {"weight": down.weight.detach().to("meta")}
    down.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    with pytest.raises(ValueError, match=r"down_proj.weight \(at most \[0\]"):
        check_against_model(_round(), m)
    index = ModelIndex(m, lambda mod: fmt if mod is down else None)
    assert "model.layers.0.mlp.down_proj.weight" in check_against_model(_round(), index)


def test_a_name_mapper_is_applied_and_a_dropped_name_refused() -> None:
    m = Model()

    class Mapper:
        def _map_name(self, name: str) -> str | None:
            return None if name.startswith("vision.") else name.replace("lm.", "model.")

    m.hf_to_vllm_mapper = Mapper()  # type: ignore[assignment]
    info = _round()
    info = GlooUpdateInfo([n.replace("model.", "lm.", 1) for n in info.names],
                          info.dtype_names, info.shapes)
    assert len(check_against_model(info, m)) == 5
    with pytest.raises(ValueError, match="drops that name"):
        check_against_model(GlooUpdateInfo(["vision.w"], ["float32"], [[2]]), m)


class StackedMapper:
    """vLLM's ``WeightsMapper`` as Llama has it (``orig_to_new_stacked``): a checkpoint
    shard name maps to the fused parameter plus a shard id."""

    stacked: ClassVar[dict[str, tuple[str, Any]]] = {
        ".q_proj": (".qkv_proj", "q"), ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"), ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1)}

    def _map_name_with_shard(self, key: str) -> tuple[str, Any] | None:
        if key.startswith("drop."):
            return None
        for sub, (new, shard) in self.stacked.items():
            if sub in key:
                return key.replace(sub, new, 1), shard
        return key, None


def test_the_models_stacked_mapper_places_shards_by_their_id() -> None:
    m = Model()
    m.hf_to_vllm_mapper = StackedMapper()  # type: ignore[assignment]
    assert len(check_against_model(_round(), m)) == 5
    with pytest.raises(ValueError, match=r"qkv_proj.weight \(at most \[4, 8\]"):
        check_against_model(
            _round(model__layers__0__self_attn__v_proj__weight=("bfloat16", [8, 8])), m)
    with pytest.raises(ValueError, match="drops that name"):
        check_against_model(GlooUpdateInfo(["drop.w"], ["float32"], [[2]]), m)
    index = ModelIndex(m)
    with pytest.raises(ValueError, match="not one of its 3 shards"):
        index._shards("x", "model.layers.0.self_attn.qkv_proj.weight", "z")
    with pytest.raises(ValueError, match="not a fused parameter"):
        index._shards("x", "model.layers.0.mlp.down_proj.weight", 0)
    span = index._shards("x", "model.layers.0.self_attn.qkv_proj.weight", [("k", "v"), 0])
    assert [(s.parts, s.bound) for s in span] == [((1, 2), (8, 8)), ((0,), (8, 8))]


class EagleLlamaForCausalLM(Model):
    """vLLM's EAGLE-1 head as the engine holds it: ``model.fc`` and a decoder layer of
    its own, the target's embedding and output projection borrowed (the same modules),
    the Llama stacked mapper inherited; its ``load_weights`` moves every checkpoint
    name but ``lm_head``'s under ``model.``."""

    def __init__(self, target: Model) -> None:
        super().__init__(tied=False, seed=7)
        self.model.fc = Layer(8, 16, method=UnquantizedLinearMethod(), seed=9)
        self.model.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
        self.hf_to_vllm_mapper = StackedMapper()


def _head_round(*extra: str) -> GlooUpdateInfo:
    info = _round(model__embed_tokens__weight=None)
    names = ["fc.weight", *(n.removeprefix("model.") for n in info.names)]
    shapes = [[8, 16], *info.shapes]
    dtypes = ["bfloat16", *info.dtype_names]
    for n in extra:  # the target's tensors, as a checkpoint that carries them names them
        names.append(n)
        shapes.append([30, 8])
        dtypes.append("float32")
    return GlooUpdateInfo(names, dtypes, shapes)


def test_an_eagle_heads_checkpoint_names_place_as_its_loader_renames_them() -> None:
    target = Model(tied=False)
    head = EagleLlamaForCausalLM(target)
    index = ModelIndex(head, shared_with=target)
    written = check_against_model(_head_round(), index)
    assert written == {"model.fc.weight", "model.layers.0.self_attn.qkv_proj.weight",
                       "model.layers.0.mlp.gate_up_proj.weight",
                       "model.layers.0.mlp.down_proj.weight", "model.layers.0.norm.weight"}
    # vLLM's own parameter names would be prefixed again by the head's loader, which
    # then fails with the reload open (seen: the engine core died). Refused up front.
    with pytest.raises(ValueError, match=r"model\.fc\.weight: not a parameter"):
        check_against_model(GlooUpdateInfo(["model.fc.weight"], ["bfloat16"], [[8, 16]]),
                            index)
    # What the head borrows from the target is the target round's to write.
    for borrowed in ("embed_tokens.weight", "lm_head.weight"):
        with pytest.raises(ValueError, match="shares with the engine's target model"):
            check_against_model(_head_round(borrowed), index)
    # The same modules seen as the target's own (its round) are writable.
    assert "model.embed_tokens.weight" in check_against_model(_round(), ModelIndex(target))


def test_a_draft_head_whose_loader_is_not_known_takes_no_name() -> None:
    target = Model(tied=False)
    head = type("Eagle3LlamaForCausalLM", (EagleLlamaForCausalLM,), {})(target)
    with pytest.raises(ValueError, match="Eagle3LlamaForCausalLM, whose load_weights"):
        check_against_model(_head_round(), ModelIndex(head, shared_with=target))
    mtp = type("DeepSeekMTP", (EagleLlamaForCausalLM,), {})(target)
    with pytest.raises(ValueError, match="DeepSeekMTP, whose load_weights"):
        check_against_model(_head_round(), ModelIndex(mtp, shared_with=target))


def test_a_target_is_never_refused_for_its_class_name() -> None:
    """Eagle2_5_VL is a vision-language target, not a head: its own round is checked as
    any model's (no renaming, nothing borrowed)."""
    vl = type("Eagle2_5_VLForConditionalGeneration", (Model,), {})()
    assert len(check_against_model(_round(), ModelIndex(vl))) == 5


def test_structural_metadata_is_refused_before_the_model_is_consulted() -> None:
    for kw in ({"names": ["a"], "dtype_names": ["complex128"], "shapes": [[1]]},
               {"names": ["a"], "dtype_names": ["float32"], "shapes": [[-1]]},
               {"names": ["a", "a"], "dtype_names": ["float32"] * 2, "shapes": [[1]] * 2},
               {"names": ["a"], "dtype_names": ["float32"], "shapes": [[1] * 9]},
               {"names": [], "dtype_names": [], "shapes": []}):
        with pytest.raises(ValueError):
            GlooUpdateInfo(**kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------ tied weights


def _write_like_the_reload(m: Model, new: torch.Tensor) -> None:
    """What vLLM's layerwise reload does to a tied model: the checkpoint names only the
    embedding; its layer is loaded and processed; the tied head is put back as it was."""
    emb = m.model.embed_tokens
    emb.weight.data.copy_(new)
    emb.quant_method.process_weights_after_loading(emb)


def test_a_tied_head_keeps_a_stale_copy_unless_rederived() -> None:
    a, b = Model(seed=1), Model(seed=2)
    h = torch.randn(3, 8, generator=torch.Generator().manual_seed(9))
    cold_b = b.lm_head.logits(h)
    plan = derived.plan_rederive(a)
    assert plan.describe() == ["model.embed_tokens.weight = lm_head.weight"]
    assert [s.module for s in plan.rederived] == ["model.embed_tokens", "lm_head"]

    _write_like_the_reload(a, b.model.embed_tokens.weight)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)  # the parameter is new ...
    assert not torch.equal(a.lm_head.logits(h), cold_b)     # ... its GEMM's copy is not

    done = derived.rederive(a, plan, {"model.embed_tokens.weight"})
    assert done == ["model.embed_tokens", "lm_head"]
    assert torch.equal(a.lm_head.logits(h), cold_b)  # bit for bit a cold load of B
    derived.rederive(a, plan, {"model.embed_tokens.weight"})  # idempotent
    assert torch.equal(a.lm_head.logits(h), cold_b)


def test_rederive_touches_only_groups_the_update_wrote() -> None:
    m = Model()
    plan = derived.plan_rederive(m)
    before = UnquantizedEmbeddingMethod.runs
    assert derived.rederive(m, plan, {"model.layers.0.mlp.down_proj.weight"}) == []
    assert UnquantizedEmbeddingMethod.runs == before
    assert derived.rederive(m, plan, {"lm_head.weight"}) != []  # any alias counts
    assert derived.rederive(m, plan, None) != []  # unknown: every group


def test_an_untied_model_has_nothing_to_rederive() -> None:
    m = Model(tied=False)
    plan = derived.plan_rederive(m)
    assert plan.groups == () and derived.rederive(m, plan, None) == []


@pytest.mark.parametrize("method", [UnquantizedLinearMethod(), Fp8LinearMethod()])
def test_a_tied_member_that_cannot_be_rebuilt_is_refused_up_front(method: Any) -> None:
    m = Model(head_method=UnquantizedEmbeddingMethod())
    m.lm_head.quant_method = method
    with pytest.raises(derived.NotRederivable,
                       match=f"lm_head shares the weight .* {type(method).__name__}"):
        derived.plan_rederive(m)
    assert isinstance(derived.NotRederivable("x"), BadInput)


def test_a_tie_the_update_broke_is_not_exact() -> None:
    m = Model()
    plan = derived.plan_rederive(m)
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone(),
                                          requires_grad=False)
    with pytest.raises(derived.NotExact, match="no longer share one storage"):
        derived.rederive(m, plan, None)


def test_views_share_storage_and_one_module_under_two_names_is_one_holder() -> None:
    m = Model(tied=False)
    m.extra = Layer(4, 8)
    m.extra.weight = torch.nn.Parameter(m.lm_head.weight.data[:4], requires_grad=False)
    m.alias_of_head = m.lm_head  # the same module registered twice
    groups = derived.tied_groups(m)
    assert [g.names for g in groups] == [("lm_head.weight", "extra.weight")]
    empty = Model(tied=False)
    empty.a = Layer(2, 2)
    empty.b = Layer(2, 2)
    empty.a.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    empty.b.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert derived.tied_groups(empty) == []  # removed (packed) weights hold no bytes


# ------------------------------------------------------------------ CUDA IPC handles

UUID = "GPU-3b1f6a2c-0d4e-4f5a-9b8c-7d6e5f4a3b2c"
REF = "/torch_4242_17_3"


def _handle(nbytes: int = 4096, **kw: Any) -> BufferHandle:
    # torch's own layout (CUDACachingAllocator::shareIpcHandle): version 2, kind 'c',
    # then the 64-byte cudaIpcMemHandle_t.
    d: dict[str, Any] = dict(device_uuid=UUID, handle=b"\x02c" + bytes(range(64)),
                             storage_size_bytes=nbytes, storage_offset_bytes=0,
                             ref_counter_handle=REF.encode(), ref_counter_offset=3,
                             event_handle=bytes(64), event_sync_required=True,
                             tensor_offset_bytes=0, nbytes=nbytes)
    d.update(kw)
    return BufferHandle(**d)


@pytest.mark.parametrize(("kw", "match"), [
    ({"ref_counter_offset": REF_COUNTER_SLOTS}, "outside the 10000 slots"),
    ({"ref_counter_offset": 1 << 40}, "outside the 10000 slots"),
    ({"ref_counter_offset": -1}, r"\[0,"),
    ({"ref_counter_handle": b"/etc/passwd"}, "reference-counter file name"),
    ({"ref_counter_handle": b"/torch_1_2"}, "reference-counter file name"),
    ({"ref_counter_handle": b"/torch_1_2_3/../../x"}, "reference-counter file name"),
    ({"ref_counter_handle": b"../torch_1_2_3"}, "reference-counter file name"),
    ({"ref_counter_handle": b"/torch_1_2_3\n"}, "reference-counter file name"),
    ({"ref_counter_handle": b"/torch_1_2_3\x00"}, "reference-counter file name"),
    ({"handle": b"x" + bytes(64)}, "handle kind"),
    ({"handle": b"\x02x" + bytes(64)}, "handle kind"),
    ({"handle": b"\x09c" + bytes(64)}, "handle kind"),
    ({"handle": b"\x02c" + bytes(63)}, "66 bytes"),
    ({"handle": b"\x02c" + bytes(65)}, "66 bytes"),
    ({"handle": b"c" + bytes(63)}, "65 bytes"),
    ({"handle": b"c" + bytes(65)}, "65 bytes"),
    ({"storage_size_bytes": 0, "nbytes": 0}, "storage_size_bytes must be > 0"),
    ({"event_handle": bytes(8)}, "event_handle must be 64 bytes"),
    ({"event_handle": b""}, "event_handle must be 64 bytes"),
    ({"tensor_offset_bytes": 1}, "exceeds its storage"),
    ({"storage_offset_bytes": 1 << 63}, r"\[0,"),
])
def test_forged_handle_fields_are_refused_on_the_wire(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(BadInput, match=match):
        _handle(**kw)
    d = _handle().to_json()  # and through the JSON decoder too
    d.update({k: (wire._b64(v) if isinstance(v, bytes) else v) for k, v in kw.items()})
    with pytest.raises(BadInput):
        BufferHandle.from_json(d)


def test_both_torch_handle_layouts_are_accepted() -> None:
    """torch 2.x writes <version 2><kind><payload> (seen on the H200, torch 2.11: the first
    byte is 0x02); older releases wrote <kind><payload>. Both carry kind 'c' or 'e'."""
    from rolloutcore.transports.cuda_ipc.wire import handle_kind

    assert handle_kind(b"\x02c" + bytes(64)) == (ord("c"), 2)
    assert handle_kind(b"\x03c" + bytes(64)) == (ord("c"), 2)  # torch >= 2.13
    assert handle_kind(b"\x02e" + bytes(40)) == (ord("e"), 2)
    assert handle_kind(b"c" + bytes(64)) == (ord("c"), 1)
    assert _handle().handle[:2] == b"\x02c"
    assert _handle(handle=b"c" + bytes(64)).handle[:1] == b"c"
    assert _handle(handle=b"\x02e" + bytes(100)).handle[:2] == b"\x02e"


def test_one_update_has_one_producer() -> None:
    e = (EntrySpec("a.weight", "float32", (4,), 0, 0), EntrySpec("b.weight", "float32", (4,), 1, 0))
    with pytest.raises(BadInput, match="several processes"):
        UpdateMessage("fast", (_handle(), _handle(ref_counter_handle=b"/torch_99_1_1")), e)
    body = encode_update(UpdateMessage("fast", (_handle(), _handle()), e))
    slot = ResultSlot(_handle(8 * 1 * 6, ref_counter_handle=b"/torch_99_1_1"), 7, 1, 6)
    body["results"] = slot.to_json()
    with pytest.raises(BadInput, match="results comes from process 99"):
        decode_update(body)
    body["results"] = ResultSlot(_handle(8 * 6), 7, 1, 6).to_json()
    assert decode_update(body).buffers[0].producer_pid == 4242


def _counter_file(root: Path, name: str = REF, size: int = REF_COUNTER_FILE_BYTES) -> Path:
    p = root / name.lstrip("/")
    p.write_bytes(bytes(size))
    return p


def test_the_reference_counter_file_must_be_torchs(tmp_path: Path) -> None:
    b = _handle()
    with pytest.raises(BadInput, match="cannot open it as a reference-counter file"):
        check_ref_counter_file(b, str(tmp_path))
    p = _counter_file(tmp_path, size=8 * 10)  # in bounds of torch's map, out of this file
    with pytest.raises(BadInput, match="not a torch reference-counter file"):
        check_ref_counter_file(b, str(tmp_path))
    p.unlink()
    target = _counter_file(tmp_path, "/elsewhere")
    os.symlink(target, tmp_path / REF.lstrip("/"))
    with pytest.raises(BadInput, match="links are not followed"):
        check_ref_counter_file(b, str(tmp_path))
    (tmp_path / REF.lstrip("/")).unlink()
    (tmp_path / REF.lstrip("/")).mkdir()
    with pytest.raises(BadInput, match="not a torch reference-counter file"):
        check_ref_counter_file(b, str(tmp_path))
    (tmp_path / REF.lstrip("/")).rmdir()
    _counter_file(tmp_path)
    check_ref_counter_file(b, str(tmp_path))


def test_a_counter_file_torch_made_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file's name and size as torch's ``RefcountedMapAllocator`` really makes them
    (CPU shared memory uses the same allocator for the ``file_system`` strategy)."""
    import torch.multiprocessing as tmp

    old = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        st = torch.UntypedStorage(8 * REF_COUNTER_SLOTS)
        st.share_memory_()
        _, name, _ = st._share_filename_cpu_()  # type: ignore[attr-defined]
    finally:
        tmp.set_sharing_strategy(old)
    if not os.path.exists("/dev/shm" + name.decode()):
        pytest.skip("this platform's shared memory is not under /dev/shm")
    check_ref_counter_file(_handle(ref_counter_handle=name))
    assert os.path.getsize("/dev/shm" + name.decode()) == REF_COUNTER_FILE_BYTES
    del st


def test_the_declared_storage_must_fit_the_opened_allocation() -> None:
    b = _handle(4096, storage_offset_bytes=512)
    base = 0x7F0000000000
    ptr = base + 512
    check_mapped_range(b, ptr, 4096, base, 8192)
    check_mapped_range(b, ptr, 4096, base, 512 + 4096)  # exactly fits
    with pytest.raises(BadInput, match="exceeds the opened allocation of 4607"):
        check_mapped_range(b, ptr, 4096, base, 512 + 4095)
    with pytest.raises(BadInput, match="starts at"):
        check_mapped_range(b, ptr, 4096, base + 256, 1 << 20)  # offset outside it
    with pytest.raises(BadInput, match="holds 2048 bytes"):
        check_mapped_range(b, ptr, 2048, base, 8192)


class _FakeOpen:
    """``rebuild_cuda_tensor`` on the CPU: a storage of the declared size, and a record
    of every open and of whether the tensor handed out is still referenced."""

    def __init__(self) -> None:
        self.opened: list[tuple[int, int]] = []
        self.last: Any = None

    def __call__(self, tensor_cls: Any, size: Any, stride: Any, offset: int,
                 storage_cls: Any, dtype: Any, device: int, handle: bytes,
                 storage_size: int, storage_offset: int, *rest: Any) -> torch.Tensor:
        self.opened.append((storage_size, storage_offset))
        t = torch.zeros(storage_size, dtype=torch.uint8)[offset:offset + size[0]]
        self.last = weakref.ref(t)
        return t


@pytest.fixture()
def fake_open(monkeypatch: pytest.MonkeyPatch) -> _FakeOpen:
    import torch.multiprocessing.reductions as red

    f = _FakeOpen()
    monkeypatch.setattr(red, "rebuild_cuda_tensor", f)
    return f


def _range_of(real_size: int) -> Callable[[int], tuple[int, int]]:
    return lambda base: (base, real_size)


def test_map_buffer_checks_the_counter_before_opening(tmp_path: Path,
                                                      fake_open: _FakeOpen) -> None:
    with pytest.raises(BadInput, match="cannot open it as a reference-counter file"):
        map_buffer(_handle(), 0, shm_dir=str(tmp_path), address_range=_range_of(4096))
    assert fake_open.opened == []  # nothing was opened


def test_map_buffer_refuses_a_storage_larger_than_the_allocation_and_releases_it(
        tmp_path: Path, fake_open: _FakeOpen) -> None:
    _counter_file(tmp_path)
    t = map_buffer(_handle(4096), 0, shm_dir=str(tmp_path), address_range=_range_of(4096))
    assert t.numel() == 4096 and t.dtype == torch.uint8
    for b, real in ((_handle(8192), 4096), (_handle(4096, storage_offset_bytes=4096), 4096),
                    (_handle(1 << 24), 1 << 20)):
        with pytest.raises(BadInput, match="exceeds the opened allocation"):
            map_buffer(b, 0, shm_dir=str(tmp_path), address_range=_range_of(real))
        assert fake_open.opened[-1] == (b.storage_size_bytes, b.storage_offset_bytes)
        # Released at once: by reference counting, no collection (a collection would
        # also hide a cycle that kept it, and costs seconds with torch loaded).
        assert fake_open.last() is None

    def unknown(ptr: int) -> tuple[int, int]:
        raise BadInput("cuMemGetAddressRange failed: the size cannot be shown")

    with pytest.raises(BadInput, match="cannot be shown"):
        map_buffer(_handle(), 0, shm_dir=str(tmp_path), address_range=unknown)


def test_a_fast_update_refuses_layers_that_transform_their_weights() -> None:
    m = torch.nn.Module()
    m.a = torch.nn.Linear(8, 4, bias=False)
    m.b = torch.nn.Linear(8, 4, bias=False)
    m.a.quant_method = UnquantizedLinearMethod()
    m.b.quant_method = Fp8LinearMethod()
    entries = (EntrySpec("a.weight", "float32", (4, 8), 0, 0),
               EntrySpec("b.weight", "float32", (4, 8), 0, 256))
    buf = torch.randn(128).view(torch.uint8)
    msg = UpdateMessage("fast", (_handle(512),), entries)
    before = [m.a.weight.detach().clone(), m.b.weight.detach().clone()]
    with pytest.raises(BadInput, match=r"b.weight \(Fp8LinearMethod\)"):
        SliceLoader(m).load([buf], msg)
    assert torch.equal(m.a.weight, before[0]) and torch.equal(m.b.weight, before[1])
    loaded: list[str] = []
    m.load_weights = lambda ws: loaded.extend(n for n, _ in ws)  # type: ignore[assignment]
    SliceLoader(m).load([buf], UpdateMessage("reference", (_handle(512),), entries))
    assert loaded == ["a.weight", "b.weight"]  # vLLM's path processes them itself
    del m.b.quant_method
    SliceLoader(m).load([buf], msg)
    assert torch.equal(m.b.weight.view(torch.uint8).reshape(-1), buf[256:384])


def test_the_forged_handle_cases_of_the_gpu_diagnostic_are_all_refused_on_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``diagnostics/gpu/forged_handles.py --plan``: everything that runs without a GPU.
    Its ``main`` runs in this process (an interpreter of its own paid ~2 s of CPU to
    import torch again, for nothing the plan needs)."""
    import json
    import sys

    from helpers.scripts import load_script

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "out"
    script = load_script("forged_handles", root / "diagnostics/gpu/forged_handles.py")
    monkeypatch.setattr(sys, "argv", ["forged_handles.py", "--plan", "--out", str(out)])
    assert script.main() == 0
    rep = json.loads((out / "forged-handles.json").read_text())
    assert rep["mode"] == "plan" and rep["ok"] is True
    cpu = [c for c in rep["cases"] if c["ran"]]
    assert len(cpu) >= 10 and all(c["refused"] and c["stage"] for c in cpu
                                  if c["expect"] == "refused")
    assert any(not c["ran"] for c in rep["cases"])  # the GPU cases are listed, not run
