"""rc_cuda_ipc without CUDA: the JSON handle codec, its validation, the block
checksum, and the slice plan / copy path of the engine side on CPU tensors.

The IPC mapping itself (``rebuild_cuda_tensor``) needs a GPU and is exercised
by ``diagnostics/gpu/h200_8b_ipc.py`` on the device.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
import time
from typing import Any, ClassVar

import pytest
import torch

from rolloutcore.errors import BadInput
from rolloutcore.transports.cuda_ipc import (
    PROTOCOL,
    RESULTS,
    ROW_COUNT,
    ROW_HEADER,
    ROW_NAMES,
    ROW_NONCE,
    ROW_UNCOVERED,
    BufferHandle,
    CudaIpcTransport,
    EntrySpec,
    PackedWeights,
    ResultSlot,
    SliceLoader,
    UpdateMessage,
    block_checksum,
    build_plan,
    decode_results,
    decode_update,
    encode_update,
    names_digest,
    names_digest60,
)

UUID = "GPU-3b1f6a2c-0d4e-4f5a-9b8c-7d6e5f4a3b2c"


def _handle(nbytes: int = 4096, **kw: Any) -> BufferHandle:
    d: dict[str, Any] = dict(device_uuid=UUID, handle=b"\x02c" + bytes(range(64)),
                             storage_size_bytes=nbytes, storage_offset_bytes=0,
                             ref_counter_handle=b"/torch_123_456_0", ref_counter_offset=3,
                             event_handle=bytes(64), event_sync_required=True,
                             tensor_offset_bytes=0, nbytes=nbytes)
    d.update(kw)
    return BufferHandle(**d)


def _message(mode: str = "fast") -> UpdateMessage:
    entries = (EntrySpec("a.weight", "bfloat16", (4, 8), 0, 0),
               EntrySpec("b.weight", "float32", (3,), 0, 256))
    return UpdateMessage(mode, (_handle(),), entries)


def _body() -> dict[str, Any]:
    return encode_update(_message())


def test_roundtrip_is_plain_json_and_lossless() -> None:
    msg = _message()
    body = encode_update(msg)
    wire = json.loads(json.dumps(body))  # nothing but JSON types on the wire
    back = decode_update(wire)
    assert back == msg
    assert back.layout_digest == msg.layout_digest
    assert back.buffers[0].handle == b"\x02c" + bytes(range(64))
    assert wire["protocol"] == PROTOCOL
    assert back.nbytes == 4 * 8 * 2 + 3 * 4


def _mutated(path: list[Any], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(_body())
    node: Any = body
    for k in path[:-1]:
        node = node[k]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return body


@pytest.mark.parametrize(("path", "value", "match"), [
    (["protocol"], "rc-cuda-ipc/0", "protocol"),
    (["mode"], "pickle", "mode"),
    (["extra"], 1, "unknown fields"),
    (["buffers"], [], "buffers"),
    (["entries"], "x", "must be a list"),
    (["layout"], "0" * 64, "exactly one of entries and layout"),
    (["hash_at_finish"], "yes", "boolean"),
    (["buffers", 0, "handle"], "not base64!!", "base64"),
    (["buffers", 0, "handle"], "", "1..1024 bytes"),
    (["buffers", 0, "handle"], base64.b64encode(bytes(2000)).decode(), "too long"),
    (["buffers", 0, "device_uuid"], "../../etc", "UUID"),
    (["buffers", 0, "nbytes"], -1, r"\[0,"),
    (["buffers", 0, "nbytes"], True, "integer"),
    (["buffers", 0, "nbytes"], 1 << 20, "exceeds its storage"),
    (["buffers", 0, "event_sync_required"], "yes", "boolean"),
    (["buffers", 0, "ref_counter_handle"], "", "ref_counter_handle"),
    (["buffers", 0, "tensor_cls"], "torch.nn.Parameter", "unknown fields"),
    (["buffers", 0, "storage_size_bytes"], KeyError, "missing"),
    (["entries", 0, "name"], "a weight", "bad tensor name"),
    (["entries", 0, "dtype"], "object", "dtype"),
    (["entries", 0, "shape"], [4, -8], "shape dim"),
    (["entries", 0, "shape"], [1] * 9, "at most"),
    (["entries", 0, "offset_bytes"], 1, "aligned"),
    (["entries", 1, "offset_bytes"], 32, "overlap"),
    (["entries", 1, "offset_bytes"], 4096, "exceed buffer"),
    (["entries", 1, "buffer"], 1, "does not exist"),
    (["entries", 1, "name"], "a.weight", "duplicate"),
])
def test_bad_update_info_is_refused(path: list[Any], value: Any, match: str) -> None:
    with pytest.raises(BadInput, match=match):
        decode_update(_mutated(path, value))


def test_non_object_bodies_are_refused() -> None:
    for bad in (None, [], "x", 3, {"protocol": PROTOCOL}):
        with pytest.raises(BadInput):
            decode_update(bad)
    assert issubclass(BadInput, ValueError)  # vLLM's parse path expects ValueError


def test_block_checksum_sees_content_position_and_staleness() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 512, generator=g).to(torch.bfloat16)  # two 512-byte blocks a row
    b = torch.randn(3, 128, generator=g).to(torch.bfloat16)
    base = block_checksum([a, b])
    assert base == block_checksum([a.clone(), b.clone()])  # same bytes, same values
    assert len(base) == 2
    shifted = torch.roll(a, 1, dims=0)
    assert block_checksum([shifted, b])[0] != base[0]          # rows moved
    swapped = a.clone()
    swapped[:, :256], swapped[:, 256:] = a[:, 256:], a[:, :256]
    assert block_checksum([swapped, b])[0] != base[0]          # blocks moved within rows
    inside = a.clone()
    inside[:, :2], inside[:, 2:4] = a[:, 2:4], a[:, :2]
    # Documented limit: a permutation inside one 512-byte block is not seen.
    assert block_checksum([inside, b])[0] == base[0]
    one_bit = a.clone()
    one_bit.view(torch.int16)[5, 7] ^= 1
    assert block_checksum([one_bit, b])[0] != base[0]          # a single flipped bit
    assert block_checksum([a, b.clone().zero_()])[1] != base[1]
    # A slice of a bigger tensor hashes like a standalone copy of it.
    big = torch.cat([a, a])
    assert block_checksum([big[64:]])[0] == base[0]


def test_block_checksum_refuses_odd_byte_counts() -> None:
    with pytest.raises(BadInput):
        block_checksum([torch.zeros(3, dtype=torch.bfloat16)])


class _Fused(torch.nn.Module):
    """Stands in for vLLM's QKVParallelLinear / MergedColumnParallelLinear (tp=1)."""

    def __init__(self, sizes: list[int], cols: int) -> None:
        super().__init__()
        self.output_sizes = sizes
        self.tp_size = 1
        self.weight = torch.nn.Parameter(torch.zeros(sum(sizes), cols, dtype=torch.bfloat16),
                                         requires_grad=False)
        self.weight.output_dim = 0  # type: ignore[attr-defined]


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = _Fused([8, 4, 4], 8)
        self.o_proj = torch.nn.Linear(8, 8, bias=False, dtype=torch.bfloat16)
        self.gate_up_proj = _Fused([16, 16], 8)


class _TinyModel(torch.nn.Module):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Layer(), _Layer()])
        self.norm = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16),
                                       requires_grad=False)
        self.loaded: list[str] = []

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
        """The reference path: the same placement, done name by name."""
        params = dict(self.named_parameters())
        for name, t in weights:
            self.loaded.append(name)
            for fused, parts in self.packed_modules_mapping.items():
                for i, part in enumerate(parts):
                    if f".{part}." in f".{name}":
                        fname = name.replace(part, fused)
                        layer = self.get_submodule(fname.rsplit(".", 1)[0])
                        off = sum(layer.output_sizes[:i])
                        params[fname].data[off:off + t.shape[0]].copy_(t)
                        break
                else:
                    continue
                break
            else:
                params[name].data.copy_(t)
        return {n for n, _ in weights}


def _checkpoint_specs() -> list[tuple[str, tuple[int, ...]]]:
    out: list[tuple[str, tuple[int, ...]]] = [("norm", (8,))]
    for i in range(2):
        p = f"layers.{i}."
        out += [(p + "q_proj.weight", (8, 8)), (p + "k_proj.weight", (4, 8)),
                (p + "v_proj.weight", (4, 8)), (p + "o_proj.weight", (8, 8)),
                (p + "gate_proj.weight", (16, 8)), (p + "up_proj.weight", (16, 8))]
    return out


def _packed(seed: int) -> PackedWeights:
    pk = PackedWeights([(n, s, torch.bfloat16) for n, s in _checkpoint_specs()], device="cpu")
    g = torch.Generator().manual_seed(seed)
    for _, t in pk.items():
        t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
    return pk


def _message_for(pk: PackedWeights, mode: str) -> UpdateMessage:
    return UpdateMessage(mode, (_handle(pk.buffer.numel()),), pk.entries)


def test_plan_maps_every_checkpoint_name_onto_fused_slices() -> None:
    model = _TinyModel()
    pk = _packed(1)
    plan = build_plan(model, pk.entries)
    assert plan.uncovered == []
    assert plan.fused == 10 and plan.direct == 3
    t = dict(zip(pk.names(), plan.targets, strict=True))
    assert t["layers.1.k_proj.weight"] == "layers.1.qkv_proj.weight"
    assert t["layers.0.up_proj.weight"] == "layers.0.gate_up_proj.weight"


class _WithLoRA(torch.nn.Module):
    """Stands in for vLLM's ``...WithLoRA`` wrappers (``--enable-lora``): the layer is its
    ``base_layer`` submodule; the LoRA slots are plain tensors, not parameters."""

    def __init__(self, base_layer: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.tp_size = 1
        self.lora_a_stacked = (torch.zeros(1, 1, 4, 8, dtype=torch.bfloat16),)


def _lora_wrapped() -> _TinyModel:
    model = _TinyModel()
    for layer in model.layers:
        for name in ("qkv_proj", "o_proj", "gate_up_proj"):
            setattr(layer, name, _WithLoRA(getattr(layer, name)))
    return model


def test_plan_maps_names_onto_a_lora_engines_base_layers() -> None:
    # Found preparing the H200 LoRA run (diagnostics/gpu/h200_lora.py): a full update
    # of the base of an engine started with --enable-lora over rc_cuda_ipc, where every
    # weight is a base_layer's ("x.weight" is "x.base_layer.weight").
    model = _lora_wrapped()
    assert "layers.0.qkv_proj.base_layer.weight" in dict(model.named_parameters())
    pk = _packed(1)
    plan = build_plan(model, pk.entries)
    assert plan.uncovered == []
    assert plan.fused == 10 and plan.direct == 3
    t = dict(zip(pk.names(), plan.targets, strict=True))
    assert t["layers.1.k_proj.weight"] == "layers.1.qkv_proj.base_layer.weight"
    assert t["layers.0.o_proj.weight"] == "layers.0.o_proj.base_layer.weight"
    assert t["norm"] == "norm"
    # The fast path writes the base layers' parameters, bit-exact with a plain model's.
    loader = SliceLoader(model)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    plain = _TinyModel()
    SliceLoader(plain).load([pk.buffer], _message_for(pk, "fast"))
    got = dict(model.named_parameters())
    for n, want in plain.named_parameters():
        real = n if n in got else n.replace(".weight", ".base_layer.weight")
        assert torch.equal(got[real].view(torch.int16), want.view(torch.int16)), n
    assert loader.checksum()["values"] == pk.checksum()
    with pytest.raises(BadInput, match="slice"):   # shapes are still checked under the alias
        build_plan(model, (EntrySpec("layers.0.k_proj.weight", "bfloat16", (8, 8), 0, 0),))


def test_plan_refuses_unknown_names_and_wrong_shapes() -> None:
    model = _TinyModel()
    with pytest.raises(BadInput, match="not parameters"):
        build_plan(model, (EntrySpec("layers.0.x_proj.weight", "bfloat16", (8, 8), 0, 0),))
    with pytest.raises(BadInput, match="slice"):
        build_plan(model, (EntrySpec("layers.0.k_proj.weight", "bfloat16", (8, 8), 0, 0),))
    with pytest.raises(BadInput, match="parameter is"):
        build_plan(model, (EntrySpec("norm", "float32", (8,), 0, 0),))
    partial = build_plan(model, _packed(1).entries[:3])
    assert "layers.0.qkv_proj.weight" in partial.uncovered


def test_fast_path_is_bit_exact_with_load_weights_and_checksums_agree() -> None:
    pk = _packed(7)
    ref_model, fast_model = _TinyModel(), _TinyModel()
    SliceLoader(ref_model).load([pk.buffer], _message_for(pk, "reference"))
    assert len(ref_model.loaded) == len(pk.entries)
    loader = SliceLoader(fast_model)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    assert fast_model.loaded == []  # no per-tensor load_weights on the fast path
    for (n, a), (_, b) in zip(ref_model.named_parameters(), fast_model.named_parameters(),
                              strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    got = loader.checksum()
    assert got["values"] == pk.checksum()
    assert got["n_uncovered"] == 0
    # The plan is cached across updates of the same layout.
    pk2 = _packed(8)
    loader.load([pk2.buffer], _message_for(pk2, "fast"))
    assert loader.stats["plan_cached"] is True
    assert loader.checksum()["values"] == pk2.checksum() != pk.checksum()


def test_packed_weights_layout_and_zero_copy_detection() -> None:
    pk = _packed(3)
    offs = [e.offset_bytes for e in pk.entries]
    assert all(o % 256 == 0 for o in offs) and offs == sorted(offs)
    assert pk.holds(list(pk.items()))
    assert not pk.holds([(n, t.clone()) for n, t in pk.items()])
    with pytest.raises(BadInput):
        pk.load_([("norm", torch.zeros(9, dtype=torch.bfloat16))])
    with pytest.raises(BadInput):
        PackedWeights([("a", (2,), torch.bfloat16), ("a", (2,), torch.bfloat16)], device="cpu")


def test_layout_by_reference_resolves_only_known_layouts() -> None:
    msg = _message()
    ref = encode_update(msg, by_reference=True)
    assert "entries" not in ref and ref["layout"] == msg.layout_digest
    assert len(json.dumps(ref)) < len(json.dumps(encode_update(msg)))
    with pytest.raises(BadInput, match="unknown layout"):
        decode_update(ref)
    known = {msg.layout_digest: msg}
    assert decode_update(ref, known) is msg  # same buffers: the validated message itself
    # New buffers: the known entries are re-checked against them.
    other = encode_update(UpdateMessage("fast", (_handle(8192),), msg.entries),
                          by_reference=True)
    back = decode_update(other, known)
    assert back.entries == msg.entries and back.buffers[0].nbytes == 8192
    small = encode_update(UpdateMessage("fast", (_handle(4096),), msg.entries),
                          by_reference=True)
    small["buffers"][0].update(nbytes=16, storage_size_bytes=16)
    with pytest.raises(BadInput, match="exceed buffer"):
        decode_update(small, known)
    for bad in ("abc", 7, "g" * 64):
        with pytest.raises(BadInput, match="sha256"):
            decode_update(dict(ref, layout=bad), known)


@pytest.fixture
def interpreted_kernels() -> None:
    """The Triton kernels on CPU tensors, under Triton's interpreter.

    Triton reads ``TRITON_INTERPRET`` when it is first imported, so these
    tests run in a child pytest started with it (``test_kernels_interpreted``).
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs in the TRITON_INTERPRET=1 child of test_kernels_interpreted")
    from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels
    assert cuda_kernels.available(torch.device("cpu"))


# Slow lane: a child pytest under Triton's interpreter (torch and Triton imported again):
# ~5.5 s of CPU and 7 s of wall alone, 25 s in the fast lane at load 8. It checks the
# kernels' results bit for bit, not that anything is fast.
@pytest.mark.slow
def test_kernels_interpreted() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        __file__, "-k", "kernel_checksum or every_copy_impl"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "4 passed" in r.stdout, r.stdout[-2000:]


def _mixed_tensors(seed: int) -> list[torch.Tensor]:
    """bf16/f32 tensors in one buffer: whole 512-byte blocks, smaller blocks, odd offsets."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros(1 << 18, dtype=torch.uint8)
    out, off = [], 0
    for shape, dt, align in [((64, 128), torch.bfloat16, 256), ((128,), torch.bfloat16, 256),
                             ((3, 256), torch.bfloat16, 256), ((33, 64), torch.float32, 256),
                             ((1000, 64), torch.bfloat16, 4), ((6,), torch.float32, 256),
                             ((256,), torch.bfloat16, 256)]:
        off = -(-off // align) * align
        n = torch.Size(shape).numel() * (2 if dt == torch.bfloat16 else 4)
        t = buf[off:off + n].view(dt).view(shape)
        t.copy_(torch.randn(shape, generator=g).to(dt))
        out.append(t)
        off += n + 4
    return out


def test_kernel_checksum_equals_torch_checksum(interpreted_kernels: None) -> None:
    from rolloutcore.transports.cuda_ipc import kernels as ck

    ts = _mixed_tensors(3)
    ref = block_checksum(ts, impl="torch")
    assert block_checksum(ts, impl="kernel") == ref
    # Every form of the kernel, with tiles smaller than a tensor; unaligned tensors
    # take the small kernel (4-byte words, a runtime block width).
    prog = ck.MultiChecksum(ts)
    assert {name for name, *_ in prog._launches} == {"main", "small"}
    saved = ck.CSUM_KERNEL, ck.CSUM_ROWS
    try:
        for form in ck.CSUM_KERNELS:
            ck.CSUM_KERNEL, ck.CSUM_ROWS = form, 16
            assert [int(x) for x in ck.MultiChecksum(ts).run().tolist()] == ref, form
    finally:
        ck.CSUM_KERNEL, ck.CSUM_ROWS = saved
    with pytest.raises(ValueError, match="4-byte"):
        ck.MultiChecksum([torch.zeros(3, dtype=torch.uint8)])
    assert block_checksum(ts[2:], impl="kernel") == block_checksum(ts[2:], impl="torch")
    # One flipped bit in one block changes that tensor's value and no other.
    ts[2].view(torch.int16)[1, 7] ^= 1
    got = block_checksum(ts, impl="kernel")
    assert [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b] == [2]
    assert got == block_checksum(ts, impl="torch")
    with pytest.raises(BadInput, match="impl"):
        block_checksum(ts, impl="fast")


@pytest.mark.parametrize("impl", ["memcpy", "foreach", "kernel"])
def test_every_copy_impl_is_bit_exact(impl: str, interpreted_kernels: None) -> None:
    pk = _packed(11)
    model = _TinyModel()
    loader = SliceLoader(model, copy_impl=impl)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    assert loader.stats["copy_impl"] == impl
    ref_model = _TinyModel()
    SliceLoader(ref_model).load([pk.buffer], _message_for(pk, "reference"))
    for (n, a), (_, b) in zip(ref_model.named_parameters(), model.named_parameters(),
                              strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), n
    ref_sum = pk.checksum("torch")
    assert loader.checksum("kernel")["values"] == loader.checksum("torch")["values"] \
        == pk.checksum("torch")
    # The next update of the same layout from the same buffer reuses the prepared
    # copies (no per-tensor work) and installs the buffer's new contents.
    prog = loader._prog
    fresh = _packed(12)
    pk.buffer.copy_(fresh.buffer)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    assert loader._prog is prog
    assert loader.checksum("torch")["values"] == fresh.checksum("torch") != ref_sum
    # The kernel's prepared checksum of the plan is reused, and reads the new bytes.
    kept = loader._csum_prog
    assert kept is not None and kept[1] is not None
    assert loader.checksum("kernel")["values"] == fresh.checksum("torch")
    assert loader._csum_prog is kept
    with pytest.raises(BadInput, match="copy_impl"):
        SliceLoader(model, copy_impl="dma")


def test_prefetched_checksum_is_the_same_read_and_never_outlives_its_update() -> None:
    pk = _packed(21)
    loader = SliceLoader(_TinyModel())
    assert loader.prefetch_checksum() is False  # nothing loaded yet
    loader.load([pk.buffer], _message_for(pk, "fast"))
    fresh = loader.checksum()
    assert fresh["prefetched"] is False and fresh["values"] == pk.checksum()
    assert loader.prefetch_checksum() is True
    got = loader.checksum()
    assert got["prefetched"] is True and got["values"] == fresh["values"]
    assert loader.checksum()["prefetched"] is False  # collected once
    # An update after the prefetch makes it stale: the next checksum reads anew.
    loader.prefetch_checksum()
    pk2 = _packed(22)
    loader.load([pk2.buffer], _message_for(pk2, "fast"))
    after = loader.checksum()
    assert after["prefetched"] is False and after["values"] == pk2.checksum()
    # The prefetch hashes as the trainer asked at init (auto, i.e. torch, here).
    loader.prefetch_checksum()
    assert loader.checksum("torch")["prefetched"] is True
    ref = SliceLoader(_TinyModel())
    ref.load([pk.buffer], _message_for(pk, "reference"))
    assert ref.prefetch_checksum() is False  # reference mode: parameters may move


# ----------------------------------------------------------- results in the trainer's memory


def _slot(nonce: int = 5, rows: int = 1, n: int = 2) -> ResultSlot:
    return ResultSlot(_handle(8 * rows * (ROW_HEADER + n)), nonce, rows, ROW_HEADER + n)


@pytest.mark.parametrize("field,value,match", [
    ("nonce", 0, "nonce"), ("nonce", True, "nonce"), ("nonce", 1 << 63, "nonce"),
    ("rows", 0, "rows"), ("rows", 65, "rows"), ("row_len", ROW_HEADER, "row_len"),
    ("row_len", ROW_HEADER + 3, "not 1 rows"), ("buffer", {"x": 1}, "buffer"),
])
def test_result_slot_is_checked_on_receipt(field: str, value: Any, match: str) -> None:
    body = _body()
    body[RESULTS] = _slot().to_json()
    assert decode_results(body) == _slot()
    decode_update(body)  # a good slot is part of a good update_info
    body[RESULTS][field] = value
    with pytest.raises(BadInput, match=match):
        decode_update(body)
    with pytest.raises(BadInput, match=match):
        decode_results(body)
    assert decode_results(_body()) is None


def test_published_row_is_the_workers_checksum_with_the_nonce_written_last() -> None:
    pk = _packed(31)
    loader = SliceLoader(_TinyModel())
    n = len(pk.entries)
    row = torch.zeros(ROW_HEADER + n, dtype=torch.int64)
    # Nothing loaded yet: the row says so (count -1) and still carries the nonce.
    assert loader.publish_checksum(torch.zeros(ROW_HEADER + 1, dtype=torch.int64), 9) is False
    loader.load([pk.buffer], _message_for(pk, "fast"))
    with pytest.raises(BadInput, match="result row"):
        loader.publish_checksum(torch.zeros(ROW_HEADER + n + 1, dtype=torch.int64), 9)
    with pytest.raises(BadInput, match="result row"):
        loader.publish_checksum(torch.zeros(ROW_HEADER + n, dtype=torch.int32), 9)
    assert loader.publish_checksum(row, 12345) is True
    got = row.tolist()
    assert got[ROW_NONCE] == 12345 and got[ROW_COUNT] == n and got[ROW_UNCOVERED] == 0
    assert got[ROW_NAMES] == names_digest60(names_digest(pk.names()))
    assert got[ROW_HEADER:] == pk.checksum()
    # The hash it published is the one an RPC then collects (same read, prefetched).
    assert loader.checksum()["prefetched"] is True
    # Reference mode: parameters may move, nothing is hashed, the row says so.
    ref = SliceLoader(_TinyModel())
    ref.load([pk.buffer], _message_for(pk, "reference"))
    row2 = torch.zeros(ROW_HEADER + n, dtype=torch.int64)
    assert ref.publish_checksum(row2, 7) is False
    assert row2[ROW_NONCE] == 7 and row2[ROW_COUNT] == -1


class _LocalEngine:
    """The worker side in this process: a SliceLoader and the row it publishes into."""

    def __init__(self, tr: CudaIpcTransport, pk: PackedWeights, slot: ResultSlot) -> None:
        self.loader = SliceLoader(_TinyModel())
        self.loader.load([pk.buffer], _message_for(pk, "fast"))
        assert tr._slot is not None
        self.row = tr._slot[0][0]
        self.slot = slot
        self.asked = 0

    def rpc(self, base_url: str, method: str, *args: str, timeout_s: float = 60.0
            ) -> list[Any]:
        assert method == "rc_cuda_ipc_checksum"
        self.asked += 1
        return [self.loader.checksum()]


def _trainer_with_slot(pk: PackedWeights, wait_s: float = 2.0
                       ) -> tuple[CudaIpcTransport, _LocalEngine]:
    tr = CudaIpcTransport(device="cpu", results_wait_s=wait_s)
    n = len(pk.entries)
    slot = _slot(nonce=4242, n=n)
    tr._slot = (torch.zeros(1, ROW_HEADER + n, dtype=torch.int64), slot.buffer)
    tr._expect = (slot, "http://engine")
    tr.last_sent_checksum, tr.last_sent_names = pk.checksum(), pk.names()
    eng = _LocalEngine(tr, pk, slot)
    tr.rpc = eng.rpc  # type: ignore[method-assign]
    return tr, eng


def test_trainer_reads_the_published_row_and_compares_without_asking() -> None:
    pk = _packed(41)
    tr, eng = _trainer_with_slot(pk)
    eng.loader.publish_checksum(eng.row, eng.slot.nonce)
    r = tr.engine_checksum("http://engine")
    assert r["passed"] and r["via"] == "ipc" and r["coverage"] == 1.0 and eng.asked == 0
    # One value off in the engine's row: the check fails, naming the tensor.
    tr, eng = _trainer_with_slot(pk)
    eng.loader.publish_checksum(eng.row, eng.slot.nonce)
    eng.row[ROW_HEADER + 1] += 1
    r = tr.engine_checksum("http://engine")
    assert not r["passed"] and r["mismatched"] == [pk.names()[1]] and eng.asked == 0
    # Another layout's row (names digest differs): not this update's evidence.
    tr, eng = _trainer_with_slot(pk)
    eng.loader.publish_checksum(eng.row, eng.slot.nonce)
    eng.row[ROW_NAMES] += 1
    r = tr.engine_checksum("http://engine")
    assert not r["passed"] and r["coverage"] == 0.0
    # The trainer sent other bytes than the engine holds: fails.
    tr, eng = _trainer_with_slot(pk)
    eng.loader.publish_checksum(eng.row, eng.slot.nonce)
    tr.last_sent_checksum = _packed(42).checksum()
    assert not tr.engine_checksum("http://engine")["passed"]


def test_a_row_without_this_updates_nonce_is_never_taken_the_trainer_asks() -> None:
    pk = _packed(43)
    # A row from an earlier update (other nonce) is ignored until the wait ends.
    tr, eng = _trainer_with_slot(pk, wait_s=0.05)
    eng.loader.publish_checksum(eng.row, eng.slot.nonce + 1)
    r = tr.engine_checksum("http://engine")
    assert r["via"] == "rpc" and eng.asked == 1 and r["passed"]
    assert "within" in r["ipc_note"]
    # The worker could not hash at finish (count -1): asked at once.
    tr, eng = _trainer_with_slot(pk, wait_s=30)
    eng.row[ROW_COUNT] = -1
    eng.row[ROW_NONCE] = eng.slot.nonce
    t = time.monotonic()
    r = tr.engine_checksum("http://engine")
    assert r["via"] == "rpc" and eng.asked == 1 and r["passed"]
    assert time.monotonic() - t < 10  # not the 30 s wait
    # The expectation is used once: the next check asks.
    assert tr.engine_checksum("http://engine")["via"] == "rpc" and eng.asked == 2


def test_result_route_options_are_checked() -> None:
    with pytest.raises(BadInput, match="checksum_results"):
        CudaIpcTransport(device="cpu", checksum_results="shm")
    for bad in (0, -1, True, "2", 601):
        with pytest.raises(BadInput, match="results_wait_s"):
            CudaIpcTransport(device="cpu", results_wait_s=bad)
    # Off CUDA (or with rpc chosen, or before connect) no slot is offered.
    tr = CudaIpcTransport(device="cpu")
    tr._ranks["http://engine"] = [0]
    assert tr._result_slot("http://engine", 3) is None


class _CountingParam(torch.nn.Parameter):
    """A parameter subclass with its own __torch_function__ (as vLLM's are)."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_plan_check_skips_parameter_subclass_dispatch_and_sees_moves() -> None:
    pk = _packed(51)
    model = _TinyModel()
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            setattr(mod, name, _CountingParam(p.data))
    loader = SliceLoader(model)
    loader.load([pk.buffer], _message_for(pk, "fast"))
    _CountingParam.calls = 0
    msg = _message_for(pk, "fast")
    assert loader.plan(msg) is loader._plan and loader.stats["plan_cached"] is True
    assert _CountingParam.calls == 0
    # A parameter that moved is seen: the plan is rebuilt.
    first = next(iter(model.parameters()))
    first.data = first.data.clone()
    old = loader._plan
    assert loader.plan(msg) is not old and loader.stats["plan_cached"] is False


def test_engine_checksum_compares_each_worker_and_reports_the_least_covered() -> None:
    pk = _packed(61)
    tr = CudaIpcTransport(device="cpu")
    tr.last_sent_checksum, tr.last_sent_names = pk.checksum(), pk.names()
    n = len(pk.names())
    digest = names_digest(list(pk.names()))
    full = {"values": list(tr.last_sent_checksum), "names_digest": digest}
    hole = {"values": [None, *tr.last_sent_checksum[1:]], "names_digest": digest}
    wrong = {"values": [*tr.last_sent_checksum[:-1], 0], "names_digest": digest}

    def check(*workers: dict[str, Any]) -> dict[str, Any]:
        tr.rpc = lambda *a, **k: list(workers)  # type: ignore[method-assign]
        return tr.engine_checksum("http://engine")

    r = check(full, full)
    assert r["passed"] and r["coverage"] == 1.0 and r["workers"] == 2 and r["via"] == "rpc"
    # A value the worker could not hash is never a match: not compared, coverage drops.
    r = check(full, hole)
    assert not r["passed"] and r["coverage"] == (n - 1) / n and r["n_mismatched"] == 0
    r = check(hole, hole)  # per worker, not summed over workers
    assert not r["passed"] and r["coverage"] == (n - 1) / n
    r = check(full, wrong)
    assert not r["passed"] and r["mismatched"] == [pk.names()[-1]] and r["coverage"] == 1.0
    r = check(full, {**full, "names_digest": "0" * 64})
    assert not r["passed"] and r["coverage"] == 0.0
    assert r["mismatched"] == ["<layout differs from the last update sent>"]


class _Worker:
    """A vLLM worker as ``--worker-extension-cls`` sees it: ``weight_transfer_engine``
    (any backend's) and ``get_model()``."""

    def __init__(self, model: torch.nn.Module, engine: Any) -> None:
        self.weight_transfer_engine, self._model = engine, model

    def get_model(self) -> torch.nn.Module:
        return self._model


def _extended(model: torch.nn.Module, engine: Any) -> Any:
    from rolloutcore.transports.cuda_ipc.engine import CudaIpcWorkerExtension

    cls = type("ExtendedWorker", (CudaIpcWorkerExtension, _Worker), {})
    return cls(model, engine)


@pytest.mark.slow  # imports vLLM (the worker extension's module): ~6.5 s of CPU here
@pytest.mark.parametrize("target", ["engine", "worker"])
def test_parameter_checks_run_under_another_backend(target: str) -> None:
    """Snapshot and parameter checksums read the model the updates write, whatever the
    backend (vLLM's own ``ipc``: a diagnostic's bit-exact check runs beside it): the
    transfer engine's target, else the worker's own model. rc_cuda_ipc's own routes
    still refuse another backend."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Linear(32, 8)).to(
        torch.bfloat16)
    other = type("IPCWeightTransferEngine", (), {"model": model if target == "engine"
                                                  else None})()
    w = _extended(torch.nn.Linear(2, 2) if target == "engine" else model, other)
    names = [n for n, _ in model.named_parameters()]
    assert w.rc_cuda_ipc_snapshot("take") == {
        "taken": 4, "bytes": sum(p.numel() * 2 for p in model.parameters())}
    a = w.rc_cuda_ipc_param_checksums()
    assert a["names"] == names and a["values"] == block_checksum(
        [p.data for p in model.parameters()])
    assert w.rc_cuda_ipc_snapshot("compare")["n_mismatched"] == 0
    with torch.no_grad():
        model[1].bias[3] += 1.0                 # one value of one parameter
    got = w.rc_cuda_ipc_snapshot("compare")
    assert got["n_mismatched"] == 1 and got["mismatched"] == ["1.bias"] and got["compared"] == 4
    assert w.rc_cuda_ipc_param_checksums()["values"] != a["values"]
    assert w.rc_cuda_ipc_snapshot("drop") == {"dropped": True}
    assert w.rc_cuda_ipc_snapshot("compare")["n_mismatched"] == 4   # nothing to compare with
    with pytest.raises(ValueError, match="unknown snapshot action"):
        w.rc_cuda_ipc_snapshot("keep")
    with pytest.raises(RuntimeError, match="backend is not rc_cuda_ipc"):
        w.rc_cuda_ipc_stats()
