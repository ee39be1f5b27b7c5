"""CUDA IPC weight transfer with no pickle: the wire format and the trainer side.

vLLM 0.26's built-in ``ipc`` backend sends its CUDA IPC handles over HTTP as
a base64 pickle (and so needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; its
module also imports ray). Here the same handles travel as plain JSON:
base64 bytes, integers, strings from an allow-list. Nothing on the wire
names a Python class or a callable; the receiver builds the tensors itself
from validated numbers (``decode_update``).

The fast path. The trainer keeps its weights in ONE contiguous device
buffer (``PackedWeights``; a module can be re-based onto it, the way a flat
parameter is) and shares that buffer through a single IPC handle, created
once and reused for every update. The engine (``cuda_ipc_plugin``) maps the
buffer once, computes once a name -> parameter-slice plan (fused
``qkv_proj`` / ``gate_up_proj`` slices from the model's own
``packed_modules_mapping`` and the layers' ``output_sizes``), and then every
update is a run of large device-to-device copies with no per-tensor
``load_weights`` processing. A ``reference`` mode runs vLLM's normal path
(layerwise reload around ``model.load_weights``) for the bit-exactness check.

Version evidence without an engine label. vLLM 0.26 has no
``weight_version``. Both sides compute ``block_checksum`` over the same
tensors in the same order: the trainer over what it sent (at staging), the
engine's workers over the parameter slices the update wrote. The workers
hash inside ``/finish_weight_update`` and write the values, then this
update's nonce, into a small trainer-owned device buffer shared the same way
(``ResultSlot``), which the paused validation reads locally; ``/collective_rpc``
on the worker extension is the fallback. It is one pass over the bytes on the
GPU: int32 sums of 512-byte blocks of the raw bits, weighted by block
position and reduced per tensor (exact integer arithmetic, so both sides
agree bit for bit whatever the reduction order). It detects stale, missing,
shifted or swapped data at block granularity; it is not cryptographic.

Module layout: codec and validation (no CUDA needed), checksum (torch on any
device), ``PackedWeights`` and ``CudaIpcTransport`` (trainer side, CUDA).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import itertools
import json
import math
import re
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rolloutcore.core.evidence import Check, TransferEvidence
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EngineUnavailable, TransferError
from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels

__all__ = [
    "BACKEND",
    "HASH_AT_FINISH",
    "PROTOCOL",
    "WORKER_EXTENSION",
    "CHECKSUM_IMPLS",
    "resolve_impl",
    "COPY_IMPLS",
    "BufferHandle",
    "CudaIpcTransport",
    "EntrySpec",
    "PackedWeights",
    "RESULTS",
    "ResultSlot",
    "UpdateMessage",
    "block_checksum",
    "decode_update",
    "checksum_digest",
    "encode_update",
    "engine_flags",
    "map_buffer",
    "names_digest",
    "names_digest60",
    "share_buffer",
]

BACKEND = "rc_cuda_ipc"
PROTOCOL = "rc-cuda-ipc/1"
WORKER_EXTENSION = "rolloutcore.transports.cuda_ipc.engine.CudaIpcWorkerExtension"

#: dtypes a buffer entry may have (name on the wire -> element size in bytes).
DTYPES: dict[str, int] = {"bfloat16": 2, "float16": 2, "float32": 4}
MODES = ("fast", "reference")
#: how the workers' checksum reaches the trainer (``CudaIpcTransport.checksum_results``)
RESULT_ROUTES = ("ipc", "rpc")

_MAX_ENTRIES = 100_000
_MAX_BUFFERS = 64
_MAX_NAME = 512
_MAX_DIMS = 8
# torch's CUDA storage handle is opaque: a kind byte then cudaIpcMemHandle_t (64 bytes)
# for cudaMalloc'd blocks, longer for expandable segments. CUDA itself validates it
# when the receiver opens it; here only its size is bounded.
_MAX_HANDLE = 1024
_MAX_REF_COUNTER_HANDLE = 1024       # a shared-memory file name
_ALIGN = 256                          # entries start on 256-byte boundaries
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_UUID_RE = re.compile(r"^(GPU-)?[0-9a-fA-F-]{16,64}$")


# --------------------------------------------------------------------------- codec

def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: object, what: str, *, max_len: int, exact: int | None = None) -> bytes:
    if not isinstance(s, str):
        raise BadInput(f"{what} must be a base64 string, got {type(s).__name__}")
    if len(s) > 4 * (max_len // 3 + 2):
        raise BadInput(f"{what} is too long")
    try:
        b = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadInput(f"{what} is not valid base64: {exc}") from exc
    if exact is not None and len(b) != exact:
        raise BadInput(f"{what} must be {exact} bytes, got {len(b)}")
    if len(b) > max_len:
        raise BadInput(f"{what} must be at most {max_len} bytes, got {len(b)}")
    return b


def _int(v: object, what: str, *, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(f"{what} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise BadInput(f"{what} must be in [{lo}, {hi}], got {v}")
    return v


def _obj(v: object, what: str, keys: set[str],
         optional: frozenset[str] = frozenset()) -> Mapping[str, Any]:
    if not isinstance(v, Mapping):
        raise BadInput(f"{what} must be an object, got {type(v).__name__}")
    got = set(v.keys())
    missing = keys - got
    extra = got - keys - optional
    if missing:
        raise BadInput(f"{what} is missing {sorted(missing)}")
    if extra:
        raise BadInput(f"{what} has unknown fields {sorted(extra)}")
    return v


@dataclass(frozen=True)
class BufferHandle:
    """One shared device allocation, as torch's CUDA IPC describes it.

    The fields are those ``torch.multiprocessing.reductions.reduce_tensor``
    produces for a CUDA storage (``_share_cuda_``), minus the classes and the
    dtype, which the receiver fixes itself (a flat ``uint8`` view).
    """

    device_uuid: str
    handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    tensor_offset_bytes: int
    nbytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.device_uuid, str) or not _UUID_RE.match(self.device_uuid):
            raise BadInput(f"device_uuid is not a GPU UUID: {self.device_uuid!r}")
        if not isinstance(self.handle, bytes) or not 0 < len(self.handle) <= _MAX_HANDLE:
            raise BadInput(f"handle must be 1..{_MAX_HANDLE} bytes")
        if not isinstance(self.ref_counter_handle, bytes) or not (
                0 < len(self.ref_counter_handle) <= _MAX_REF_COUNTER_HANDLE):
            raise BadInput("ref_counter_handle must be 1..1024 bytes")
        if not isinstance(self.event_handle, bytes) or len(self.event_handle) > _MAX_HANDLE:
            raise BadInput(f"event_handle must be at most {_MAX_HANDLE} bytes")
        if not isinstance(self.event_sync_required, bool):
            raise BadInput("event_sync_required must be a boolean")
        for name in ("storage_size_bytes", "storage_offset_bytes", "ref_counter_offset",
                     "tensor_offset_bytes", "nbytes"):
            _int(getattr(self, name), name)
        if self.tensor_offset_bytes + self.nbytes > self.storage_size_bytes:
            raise BadInput(f"buffer [{self.tensor_offset_bytes}, +{self.nbytes}) exceeds its "
                           f"storage of {self.storage_size_bytes} bytes")

    @property
    def key(self) -> tuple[bytes, int]:
        """Identifies the allocation (what a receiver caches its mapping by)."""
        return (self.handle, self.storage_offset_bytes)

    def to_json(self) -> dict[str, Any]:
        return {"device_uuid": self.device_uuid, "handle": _b64(self.handle),
                "storage_size_bytes": self.storage_size_bytes,
                "storage_offset_bytes": self.storage_offset_bytes,
                "ref_counter_handle": _b64(self.ref_counter_handle),
                "ref_counter_offset": self.ref_counter_offset,
                "event_handle": _b64(self.event_handle),
                "event_sync_required": self.event_sync_required,
                "tensor_offset_bytes": self.tensor_offset_bytes, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, d: object, what: str = "buffer") -> BufferHandle:
        o = _obj(d, what, {"device_uuid", "handle", "storage_size_bytes",
                           "storage_offset_bytes", "ref_counter_handle", "ref_counter_offset",
                           "event_handle", "event_sync_required", "tensor_offset_bytes",
                           "nbytes"})
        if not isinstance(o["event_sync_required"], bool):
            raise BadInput(f"{what}.event_sync_required must be a boolean")
        uuid = o["device_uuid"]
        if not isinstance(uuid, str):
            raise BadInput(f"{what}.device_uuid must be a string")
        return cls(
            device_uuid=uuid,
            handle=_unb64(o["handle"], f"{what}.handle", max_len=_MAX_HANDLE),
            storage_size_bytes=_int(o["storage_size_bytes"], f"{what}.storage_size_bytes"),
            storage_offset_bytes=_int(o["storage_offset_bytes"], f"{what}.storage_offset_bytes"),
            ref_counter_handle=_unb64(o["ref_counter_handle"], f"{what}.ref_counter_handle",
                                      max_len=_MAX_REF_COUNTER_HANDLE),
            ref_counter_offset=_int(o["ref_counter_offset"], f"{what}.ref_counter_offset"),
            event_handle=_unb64(o["event_handle"], f"{what}.event_handle",
                                max_len=_MAX_HANDLE),
            event_sync_required=o["event_sync_required"],
            tensor_offset_bytes=_int(o["tensor_offset_bytes"], f"{what}.tensor_offset_bytes"),
            nbytes=_int(o["nbytes"], f"{what}.nbytes"),
        )


@dataclass(frozen=True)
class EntrySpec:
    """One tensor inside a shared buffer: name, dtype, shape, where it starts."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    buffer: int
    offset_bytes: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not 0 < len(self.name) <= _MAX_NAME or (
                not _NAME_RE.match(self.name)):
            raise BadInput(f"bad tensor name {self.name!r}")
        if self.dtype not in DTYPES:
            raise BadInput(f"{self.name}: dtype {self.dtype!r} not in {sorted(DTYPES)}")
        if not isinstance(self.shape, tuple) or len(self.shape) > _MAX_DIMS:
            raise BadInput(f"{self.name}: shape must be a tuple of at most {_MAX_DIMS} dims")
        for d in self.shape:
            _int(d, f"{self.name}: shape dim", hi=1 << 40)
        _int(self.buffer, f"{self.name}: buffer", hi=_MAX_BUFFERS - 1)
        _int(self.offset_bytes, f"{self.name}: offset_bytes")
        if self.offset_bytes % DTYPES[self.dtype]:
            raise BadInput(f"{self.name}: offset {self.offset_bytes} is not aligned to its "
                           f"element size")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape),
                "buffer": self.buffer, "offset_bytes": self.offset_bytes}

    @classmethod
    def from_json(cls, d: object, what: str = "entry") -> EntrySpec:
        o = _obj(d, what, {"name", "dtype", "shape", "buffer", "offset_bytes"})
        shape = o["shape"]
        if not isinstance(shape, list):
            raise BadInput(f"{what}.shape must be a list")
        name, dtype = o["name"], o["dtype"]
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise BadInput(f"{what}: name and dtype must be strings")
        return cls(name, dtype, tuple(shape), o["buffer"], o["offset_bytes"])


@dataclass(frozen=True)
class UpdateMessage:
    """A validated ``update_info`` of the ``rc_cuda_ipc`` backend.

    Construction checks everything that can be checked without the model:
    unique names, entries inside their buffer, no two entries overlapping.
    The receiver then checks names, shapes and dtypes against its parameters.
    """

    mode: str
    buffers: tuple[BufferHandle, ...]
    entries: tuple[EntrySpec, ...]
    layout_digest: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadInput(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0 < len(self.buffers) <= _MAX_BUFFERS:
            raise BadInput(f"1..{_MAX_BUFFERS} buffers expected, got {len(self.buffers)}")
        if not 0 < len(self.entries) <= _MAX_ENTRIES:
            raise BadInput(f"1..{_MAX_ENTRIES} entries expected, got {len(self.entries)}")
        names = [e.name for e in self.entries]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})[:5]
            raise BadInput(f"duplicate tensor names: {dup}")
        spans: list[list[tuple[int, int, str]]] = [[] for _ in self.buffers]
        for e in self.entries:
            if e.buffer >= len(self.buffers):
                raise BadInput(f"{e.name}: buffer {e.buffer} does not exist")
            end = e.offset_bytes + e.nbytes
            if end > self.buffers[e.buffer].nbytes:
                raise BadInput(f"{e.name}: bytes [{e.offset_bytes}, {end}) exceed buffer "
                               f"{e.buffer} of {self.buffers[e.buffer].nbytes} bytes")
            spans[e.buffer].append((e.offset_bytes, end, e.name))
        for sp in spans:
            sp.sort()
            for (_, a_end, a), (b_start, _, b) in itertools.pairwise(sp):
                if b_start < a_end:
                    raise BadInput(f"entries {a} and {b} overlap")
        if not self.layout_digest:
            object.__setattr__(self, "layout_digest", _layout_digest(self.entries))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def _layout_digest(entries: Sequence[EntrySpec]) -> str:
    blob = json.dumps([e.to_json() for e in entries], separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def encode_update(msg: UpdateMessage, *, by_reference: bool = False) -> dict[str, Any]:
    """The JSON-safe ``update_info`` body for vLLM's ``/update_weights``.

    ``by_reference``: name the layout by its digest instead of listing the
    entries, for an engine that has already accepted this layout (399
    entries are about 40 KB of JSON to parse and validate on the worker for
    every update; the reference is one string).
    """
    body: dict[str, Any] = {"protocol": PROTOCOL, "mode": msg.mode,
                            "buffers": [b.to_json() for b in msg.buffers]}
    if by_reference:
        body["layout"] = msg.layout_digest
    else:
        body["entries"] = [e.to_json() for e in msg.entries]
    return body


#: ``update_info`` flag: the sender will validate by the workers' block checksum,
#: so they start hashing when the session finishes (read by the engine side).
HASH_AT_FINISH = "hash_at_finish"

#: ``update_info`` field: where the workers publish this update's checksum, a
#: ``ResultSlot`` (implies hashing at finish). The paused validation then reads
#: it from the trainer's own device memory: no round trip through the engine.
RESULTS = "results"

#: A result row (int64): the nonce, the 60-bit names digest, the count of model
#: parameters the update did not cover, the count of values (-1: the worker
#: could not hash), then one value per entry (-1: entry not hashable here).
ROW_NONCE, ROW_NAMES, ROW_UNCOVERED, ROW_COUNT, ROW_HEADER = 0, 1, 2, 3, 4
_MAX_WORKERS = 64


def names_digest60(hexdigest: str) -> int:
    """The first 60 bits of a ``names_digest``: fits a non-negative int64 cell."""
    return int(hexdigest[:15], 16)


@dataclass(frozen=True)
class ResultSlot:
    """A trainer-owned int64 device buffer of ``rows`` x ``row_len``, shared by handle.

    Worker of rank r writes row r after hashing at finish: the values, then
    (stream-ordered, last) the ``nonce`` the trainer chose for this update. The
    trainer waits for its nonce in every row, then reads the rows. A nonce is
    fresh per update, so a row left from an earlier update is never taken.
    """

    buffer: BufferHandle
    nonce: int
    rows: int
    row_len: int

    def __post_init__(self) -> None:
        _int(self.nonce, "results.nonce", lo=1)
        _int(self.rows, "results.rows", lo=1, hi=_MAX_WORKERS)
        _int(self.row_len, "results.row_len", lo=ROW_HEADER + 1, hi=ROW_HEADER + _MAX_ENTRIES)
        if self.buffer.nbytes != 8 * self.rows * self.row_len:
            raise BadInput(f"results.buffer holds {self.buffer.nbytes} bytes, not "
                           f"{self.rows} rows of {self.row_len} int64")

    def to_json(self) -> dict[str, Any]:
        return {"buffer": self.buffer.to_json(), "nonce": self.nonce, "rows": self.rows,
                "row_len": self.row_len}

    @classmethod
    def from_json(cls, d: object) -> ResultSlot:
        o = _obj(d, f"update_info.{RESULTS}", {"buffer", "nonce", "rows", "row_len"})
        # The numbers are checked once, by __post_init__.
        return cls(BufferHandle.from_json(o["buffer"], f"{RESULTS}.buffer"),
                   o["nonce"], o["rows"], o["row_len"])


def decode_update(d: object, known: Mapping[str, UpdateMessage] | None = None
                  ) -> UpdateMessage:
    """Parse and validate an ``update_info``. Raises ``BadInput`` on anything off.

    A body naming its ``layout`` (instead of ``entries``) is resolved against
    ``known``, the messages this receiver has already validated, by digest; an
    unknown digest is refused (the sender must send the entries). The entries
    are re-checked against the body's buffers unless those are the same.
    """
    o = _obj(d, "update_info", {"protocol", "mode", "buffers"},
             optional=frozenset({"entries", "layout", HASH_AT_FINISH, RESULTS}))
    if not isinstance(o.get(HASH_AT_FINISH, False), bool):
        raise BadInput(f"update_info.{HASH_AT_FINISH} must be a boolean")
    if RESULTS in o:
        decode_results(o)  # checked here with the rest; the engine side reads it again
    if o["protocol"] != PROTOCOL:
        raise BadInput(f"update_info.protocol must be {PROTOCOL!r}, got {o['protocol']!r}")
    if ("entries" in o) == ("layout" in o):
        raise BadInput("update_info needs exactly one of entries and layout")
    bufs = o["buffers"]
    if not isinstance(bufs, list) or len(bufs) > _MAX_BUFFERS:
        raise BadInput(f"update_info.buffers must be a list of at most {_MAX_BUFFERS}")
    mode = o["mode"]
    if not isinstance(mode, str):
        raise BadInput("update_info.mode must be a string")
    buffers = tuple(BufferHandle.from_json(b, f"buffers[{i}]") for i, b in enumerate(bufs))
    if "layout" in o:
        digest = o["layout"]
        if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
            raise BadInput("update_info.layout must be a sha256 hex digest")
        prev = (known or {}).get(digest)
        if prev is None:
            raise BadInput(f"unknown layout {digest[:12]}: this engine has not received its "
                           "entries (send them in full)")
        if prev.mode == mode and prev.buffers == buffers:
            return prev
        return UpdateMessage(mode, buffers, prev.entries, layout_digest=digest)
    ents = o["entries"]
    if not isinstance(ents, list) or len(ents) > _MAX_ENTRIES:
        raise BadInput(f"update_info.entries must be a list of at most {_MAX_ENTRIES}")
    return UpdateMessage(
        mode, buffers,
        tuple(EntrySpec.from_json(e, f"entries[{i}]") for i, e in enumerate(ents)),
    )


def decode_results(d: Mapping[str, Any]) -> ResultSlot | None:
    """The ``results`` slot of an ``update_info`` (validated), or None when absent."""
    r = d.get(RESULTS)
    return None if r is None else ResultSlot.from_json(r)


def map_buffer(b: BufferHandle, device_index: int) -> torch.Tensor:
    """Open a peer's shared allocation as a flat ``uint8`` tensor on this device.

    The classes and dtype are ours, not the sender's; the numbers come from a
    validated ``BufferHandle``. CUDA itself checks the handle when it opens it.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(  # type: ignore[no-untyped-call,no-any-return]
        torch.Tensor, (b.nbytes,), (1,), b.tensor_offset_bytes,
        torch.storage.TypedStorage, torch.uint8, device_index, b.handle,
        b.storage_size_bytes, b.storage_offset_bytes, False, b.ref_counter_handle,
        b.ref_counter_offset, b.event_handle, b.event_sync_required)


# ------------------------------------------------------------------------ checksum

_BLOCK_INT32 = 128          # 512-byte blocks
_MASK32 = 0xFFFFFFFF
_weights_cache: dict[tuple[int, str], torch.Tensor] = {}
_weights_lock = threading.Lock()


_rows_cols = cuda_kernels.block_shape


def _as_int32(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` as a flat int32 view (no copy when aligned)."""
    if t.numel() * t.element_size() % 4:
        raise BadInput(f"tensor of {t.numel() * t.element_size()} bytes is not a whole number "
                       "of 4-byte words")
    flat = t.reshape(-1)
    try:
        return flat.view(torch.int32)
    except RuntimeError:  # misaligned storage offset: hash a copy (rare, same bits)
        return flat.clone().view(torch.int32)


def _weights_at(pos: torch.Tensor) -> torch.Tensor:
    """The odd weight of each block position (the kernel computes the same)."""
    return ((pos * cuda_kernels.W_MUL + cuda_kernels.W_ADD) & 0x7FFFFFFF) | 1


def _position_weights(n: int, device: torch.device) -> torch.Tensor:
    key = (n, str(device))
    with _weights_lock:
        w = _weights_cache.get(key)
        if w is None:
            w = _weights_at(torch.arange(n, dtype=torch.int64, device=device))
            _weights_cache.clear()  # one layout at a time; weights are big at 16 GB
            _weights_cache[key] = w
        return w


CHECKSUM_IMPLS = ("auto", "torch", "kernel")


def block_checksum(tensors: Sequence[torch.Tensor], *, impl: str = "auto") -> list[int]:
    """One integer per tensor over its raw bits (see the module docstring).

    All tensors must be on one device. Per tensor: sum (mod 2**32) of each
    512-byte block, times an odd weight of the block's position, summed
    (mod 2**32 per term, exact in int64). Same bytes in the same layout give
    the same list on any device and with either implementation: ``torch``
    (per-tensor reductions, several launches per tensor) or ``kernel``
    (``cuda_kernels.MultiChecksum``: two Triton launches for all tensors, the
    work tables prepared once per set of tensors). ``auto`` is the kernel where
    Triton runs on the tensors' device (4.2 vs 10-11 ms for 16.4 GB on the
    H200, results/gpu/csum-bench.json), else torch.
    """
    if impl not in CHECKSUM_IMPLS:
        raise BadInput(f"impl must be one of {CHECKSUM_IMPLS}, got {impl!r}")
    if not tensors:
        return []
    device = tensors[0].device
    for t in tensors:
        if t.device != device:
            raise BadInput("block_checksum: tensors are on different devices")
    return [int(x) for x in block_checksum_device(tensors, impl=impl).tolist()]


def block_checksum_device(tensors: Sequence[torch.Tensor], *, impl: str = "auto"
                          ) -> torch.Tensor:
    """``block_checksum``'s values as an int64 device tensor, queued without waiting."""
    if impl not in CHECKSUM_IMPLS:
        raise BadInput(f"impl must be one of {CHECKSUM_IMPLS}, got {impl!r}")
    device = tensors[0].device
    if resolve_impl(impl, device) == "kernel":
        if cuda_kernels.available(device) and all(_kernel_ok(t) for t in tensors):
            return cuda_kernels.block_checksum_device(tensors)
        if impl == "kernel":
            raise BadInput("the checksum kernel cannot run here: it needs Triton on the "
                           "tensors' device and contiguous, 4-byte aligned tensors")
    rows = [_rows_cols(t.numel() * t.element_size()) for t in tensors]
    return _block_checksum_device(tensors, rows)


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` is the kernel where it can run (CUDA with Triton), else torch."""
    if impl != "auto":
        return impl
    return "kernel" if cuda_kernels.available(device) else "torch"


def _kernel_ok(t: torch.Tensor) -> bool:
    nb = t.numel() * t.element_size()
    return t.is_contiguous() and nb % 4 == 0 and t.data_ptr() % 4 == 0


def _block_checksum_device(tensors: Sequence[torch.Tensor],
                           rows: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The per-tensor values as a device tensor, enqueued without waiting on the GPU.

    The one host-to-device copy (the tensor boundaries) is made before any
    reduction is queued, so on CUDA nothing here blocks on the hashing.
    """
    device = tensors[0].device
    total = sum(r for r, _ in rows)
    bounds: list[int] = []
    start = 0
    for r, _ in rows:
        start += r
        bounds.append(start)
    ends = torch.tensor(bounds, dtype=torch.int64, device=device)
    w = _position_weights(total, device)
    sums = torch.empty(total, dtype=torch.int32, device=device)
    start = 0
    for t, (r, c) in zip(tensors, rows, strict=True):
        if r:
            torch.sum(_as_int32(t).view(r, c), dim=1, dtype=torch.int32,
                      out=sums[start:start + r])
        start += r
    terms = ((sums.to(torch.int64) & _MASK32) * w) & _MASK32
    csum = torch.cumsum(terms, 0)
    at_end = torch.where(ends > 0, csum[(ends - 1).clamp(min=0)], torch.zeros_like(ends))
    before = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), at_end[:-1]])
    return at_end - before


def checksum_digest(names: Sequence[str], values: Sequence[int | None]) -> str:
    """sha256 over (name, value) pairs: one string to compare and to record."""
    blob = json.dumps([[n, v] for n, v in zip(names, values, strict=True)],
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


# ------------------------------------------------------------------ engine side

@dataclass
class SlicePlan:
    """Where each entry of one layout lands in the model, computed once per layout.

    ``dsts[i]`` is a view of the parameter memory that entry ``i`` fills
    (``None``: not mappable, loaded through ``load_weights`` when allowed).
    ``ptrs`` are the parameters' data pointers when the plan was made: a
    plan whose parameters moved is rebuilt.
    """

    layout_digest: str
    dsts: list[torch.Tensor | None]
    targets: list[str | None]
    ptrs: dict[str, int]
    uncovered: list[str]
    fused: int = 0
    direct: int = 0
    names: tuple[str, ...] = ()


def build_plan(model: torch.nn.Module, entries: Sequence[EntrySpec], *,
               allow_fallback: bool = False) -> SlicePlan:
    """Map checkpoint-named entries onto the model's (possibly fused) parameters.

    A name that is a parameter is copied whole. A name whose module part is
    one of the model's ``packed_modules_mapping`` shards (``q_proj`` of
    ``qkv_proj``, ``gate_proj`` of ``gate_up_proj``) lands in its slice of the
    fused parameter: offsets from the layer's ``output_sizes`` along the
    parameter's ``output_dim`` (only without tensor parallelism; with it, or
    for any other name, the entry is refused unless ``allow_fallback``).
    Shape and dtype must match exactly, else ``BadInput``.
    """
    params = dict(model.named_parameters())
    packed: Mapping[str, Sequence[str]] = getattr(model, "packed_modules_mapping", None) or {}
    dsts: list[torch.Tensor | None] = []
    targets: list[str | None] = []
    covered: dict[str, int] = {}
    unknown: list[str] = []
    fused_n = direct_n = 0
    for e in entries:
        want_dt = getattr(torch, e.dtype)
        dst: torch.Tensor | None = None
        target: str | None = None
        p = params.get(e.name)
        if p is not None:
            if tuple(p.shape) != e.shape or p.dtype != want_dt:
                raise BadInput(f"{e.name}: sent {list(e.shape)}/{e.dtype}, parameter is "
                               f"{list(p.shape)}/{_dtype_name(p.dtype)}")
            dst, target = p.data, e.name
            direct_n += 1
        else:
            dotted = "." + e.name
            for fused, parts in packed.items():
                for i, part in enumerate(parts):
                    tag = f".{part}."
                    if tag not in dotted:
                        continue
                    fname = dotted.replace(tag, f".{fused}.", 1)[1:]
                    fp = params.get(fname)
                    if fp is None:
                        continue
                    layer = model.get_submodule(fname.rsplit(".", 1)[0])
                    sizes = getattr(layer, "output_sizes", None)
                    if getattr(layer, "tp_size", 1) != 1 or not sizes or len(sizes) != len(parts):
                        continue
                    odim = int(getattr(fp, "output_dim", 0))
                    off = int(sum(sizes[:i]))
                    view = fp.data.narrow(odim, off, int(sizes[i]))
                    if tuple(view.shape) != e.shape or fp.dtype != want_dt:
                        raise BadInput(f"{e.name}: sent {list(e.shape)}/{e.dtype}, its slice of "
                                       f"{fname} is {list(view.shape)}/{_dtype_name(fp.dtype)}")
                    if not view.is_contiguous():
                        continue
                    dst, target = view, fname
                    fused_n += 1
                    break
                if dst is not None:
                    break
        if dst is None:
            unknown.append(e.name)
        else:
            assert target is not None
            covered[target] = covered.get(target, 0) + dst.numel()
        dsts.append(dst)
        targets.append(target)
    if unknown and not allow_fallback:
        raise BadInput(f"{len(unknown)} names are not parameters of this model (or slices of "
                       f"its fused ones): {unknown[:5]}")
    uncovered = [n for n, p in params.items() if covered.get(n, 0) != p.numel()]
    return SlicePlan(_layout_digest(entries), dsts, targets,
                     {n: p.data_ptr() for n, p in params.items()}, uncovered, fused_n, direct_n,
                     tuple(e.name for e in entries))


COPY_IMPLS = ("auto", "memcpy", "foreach", "kernel")


class _CopyProgram:
    """The fast path's copies for one plan and one set of source views.

    Checked once (which entries have a slice, whether the one-launch kernel
    can take them all); ``run`` then only launches.
    """

    def __init__(self, plan: SlicePlan, srcs: list[torch.Tensor], wanted: str) -> None:
        self.plan, self.srcs, self.wanted = plan, srcs, wanted
        self.dsts = [d for d in plan.dsts if d is not None]
        self.copy_srcs = [x for d, x in zip(plan.dsts, srcs, strict=True) if d is not None]
        self.rest = [(e, x) for e, d, x in zip(plan.names, plan.dsts, srcs, strict=True)
                     if d is None]
        impl = wanted
        if impl == "auto":
            ok = bool(self.dsts) and cuda_kernels.available(self.dsts[0].device) and all(
                _kernel_ok(d) and _kernel_ok(x)
                for d, x in zip(self.dsts, self.copy_srcs, strict=True))
            impl = "kernel" if ok else "memcpy"
        self.impl = impl
        self._kernel = (cuda_kernels.MultiCopy(self.dsts, self.copy_srcs)
                        if impl == "kernel" and self.dsts else None)

    def run(self) -> None:
        if self._kernel is not None:
            self._kernel.run()
        elif self.impl == "foreach":
            if self.dsts:
                torch._foreach_copy_(self.dsts, self.copy_srcs, non_blocking=True)
        else:
            for d, x in zip(self.dsts, self.copy_srcs, strict=True):
                d.copy_(x, non_blocking=True)


class SliceLoader:
    """The engine-side work of ``rc_cuda_ipc``, free of vLLM: plan, copy, checksum.

    ``load`` takes the mapped source buffers (flat ``uint8`` tensors) and the
    validated message. ``fast`` copies each entry into its planned slice;
    ``reference`` hands the entries to ``model.load_weights`` (vLLM's path).
    The plan is cached per layout and rebuilt only when the layout or a
    parameter's storage changes.

    How ``fast`` copies (``copy_impl``): ``memcpy``, one ``Tensor.copy_``
    per entry (a driver memcpy); ``foreach``, torch's multi-tensor
    ``_foreach_copy_``; ``kernel``, one Triton launch for all entries
    (``cuda_kernels.multi_copy``, SM loads and stores). ``auto`` takes the
    kernel where it can run and memcpy elsewhere. All are bit-exact copies.
    """

    def __init__(self, model: torch.nn.Module, *, allow_fallback: bool = False,
                 copy_impl: str = "auto") -> None:
        self.model = model
        self.allow_fallback = allow_fallback
        self.copy_impl = copy_impl
        self._plan: SlicePlan | None = None
        #: the message whose load last checked the plan against the parameters
        self._plan_checked: UpdateMessage | None = None
        self._src_cache: tuple[Any, list[torch.Tensor]] | None = None
        self._prog: _CopyProgram | None = None
        self._pending: tuple[UpdateMessage, SlicePlan, torch.Tensor, float, str] | None = None
        #: what ``prefetch_checksum`` hashes with (set from the trainer's init_info)
        self.checksum_impl = "auto"
        self._csum_prog: tuple[SlicePlan, cuda_kernels.MultiChecksum | None] | None = None
        self._names_digest: tuple[UpdateMessage, str] | None = None
        self._row_head: tuple[UpdateMessage, SlicePlan, torch.Tensor,
                              torch.Tensor | None] | None = None
        self.last: UpdateMessage | None = None
        self.stats: dict[str, Any] = {}

    @property
    def copy_impl(self) -> str:
        return self._copy_impl

    @copy_impl.setter
    def copy_impl(self, v: str) -> None:
        if v not in COPY_IMPLS:
            raise BadInput(f"copy_impl must be one of {COPY_IMPLS}, got {v!r}")
        self._copy_impl = v

    def _param_ptrs(self) -> dict[str, int]:
        # vLLM's parameters are tensor subclasses: without this, every data_ptr()
        # goes through their __torch_function__ (milliseconds for an 8B model).
        with torch._C.DisableTorchFunctionSubclass():
            return {n: q.data_ptr() for n, q in self.model.named_parameters()}

    def plan(self, msg: UpdateMessage) -> SlicePlan:
        p = self._plan
        if p is not None and p.layout_digest == msg.layout_digest \
                and self._param_ptrs() == p.ptrs:
            self.stats["plan_cached"] = True
            self._plan_checked = msg
            return p
        t = time.monotonic()
        p = self._plan = build_plan(self.model, msg.entries, allow_fallback=self.allow_fallback)
        self._plan_checked = msg
        self.stats["plan_cached"] = False
        self.stats["plan_s"] = time.monotonic() - t
        return p

    def _load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        fn = getattr(self.model, "load_weights", None)
        if not callable(fn):
            raise BadInput(f"{type(self.model).__name__} has no load_weights")
        fn(weights)

    @staticmethod
    def sources(bufs: Sequence[torch.Tensor], msg: UpdateMessage) -> list[torch.Tensor]:
        out = []
        for e in msg.entries:
            raw = bufs[e.buffer][e.offset_bytes:e.offset_bytes + e.nbytes]
            out.append(raw.view(getattr(torch, e.dtype)).view(e.shape))
        return out

    def _sources(self, bufs: Sequence[torch.Tensor], msg: UpdateMessage) -> list[torch.Tensor]:
        """``sources`` kept across updates of one layout from the same mapped buffers.

        Building 399 views costs about 2 ms of CPU while the GPU waits; the
        mapped buffers are cached by the engine, so their views can be too.
        """
        key = (msg.layout_digest, tuple(b.data_ptr() for b in bufs),
               tuple(b.numel() for b in bufs))
        c = self._src_cache
        if c is not None and c[0] == key:
            return c[1]
        srcs = self.sources(bufs, msg)
        self._src_cache = (key, srcs)
        return srcs

    def _session_plan(self, msg: UpdateMessage) -> SlicePlan:
        """The plan of the update being finished: checked by its load moments ago.

        Between ``load`` and the end of the same update session nothing moves a
        parameter in the fast mode, so the finish does not walk the model again.
        Anything later (an RPC after resume) uses ``plan``, which checks.
        """
        p = self._plan
        if p is not None and self._plan_checked is msg and self.last is msg:
            return p
        return self.plan(msg)

    def load(self, bufs: Sequence[torch.Tensor], msg: UpdateMessage) -> None:
        self._pending = None  # hashed before this update: stale
        self._plan_checked = None
        plan = self.plan(msg)  # validates names, shapes and dtypes in both modes
        srcs = self._sources(bufs, msg)
        t = time.monotonic()
        with torch.no_grad():
            if msg.mode == "reference":
                self._load_weights(list(zip((e.name for e in msg.entries), srcs,
                                            strict=True)))
                fallback = 0
            else:
                prog = self._program(plan, srcs)
                prog.run()
                rest = prog.rest
                if rest:
                    self._load_weights(rest)
                fallback = len(rest)
                self.stats["copy_impl"] = prog.impl
        self.last = msg
        self.stats.update(mode=msg.mode, entries=len(msg.entries), bytes=msg.nbytes,
                          fallback=fallback, fused=plan.fused, direct=plan.direct,
                          uncovered=plan.uncovered[:20], n_uncovered=len(plan.uncovered),
                          launch_s=time.monotonic() - t)

    def _program(self, plan: SlicePlan, srcs: list[torch.Tensor]) -> _CopyProgram:
        """The copies of one (plan, sources, impl), prepared once and reused."""
        p = self._prog
        if p is not None and p.plan is plan and p.srcs is srcs and p.wanted == self._copy_impl:
            return p
        p = self._prog = _CopyProgram(plan, srcs, self._copy_impl)
        return p

    def prefetch_checksum(self, impl: str | None = None) -> bool:
        """Start hashing the slices the last fast update wrote; do not wait for it.

        Called when the update session finishes (the engine still paused): the
        GPU hashes while the cache is reset and the validation's request is on
        its way, and ``checksum`` then only collects the values. Same
        definition, same parameter memory read after the copies (stream
        order); a later update or a moved parameter discards it.
        """
        msg = self.last
        self._pending = None
        if msg is None or msg.mode != "fast":
            return False
        plan = self._session_plan(msg)
        dsts = [d for d in plan.dsts if d is not None]
        if not dsts:
            return False
        t = time.monotonic()
        impl = resolve_impl(self.checksum_impl if impl is None else impl, dsts[0].device)
        self._pending = (msg, plan, self._hash(plan, impl), t, impl)
        return True

    def _hash(self, plan: SlicePlan, impl: str) -> torch.Tensor:
        """The block checksum of a plan's slices, queued (a device tensor, no wait).

        With the kernel, the prepared ``MultiChecksum`` of the plan is kept: a
        validation then costs the GPU pass and no per-tensor CPU work (the
        worker's RPC waits on that CPU work as much as on the GPU).
        """
        if impl not in CHECKSUM_IMPLS:
            raise BadInput(f"impl must be one of {CHECKSUM_IMPLS}, got {impl!r}")
        dsts = [d for d in plan.dsts if d is not None]
        if resolve_impl(impl, dsts[0].device) == "kernel":
            c = self._csum_prog
            if c is None or c[0] is not plan:
                ok = cuda_kernels.available(dsts[0].device) and all(_kernel_ok(d) for d in dsts)
                c = self._csum_prog = (plan, cuda_kernels.MultiChecksum(dsts) if ok else None)
            if c[1] is not None:
                return c[1].run()
        return block_checksum_device(dsts, impl=impl)

    def _names_digest_of(self, msg: UpdateMessage) -> str:
        if self._names_digest is None or self._names_digest[0] is not msg:
            self._names_digest = (msg, names_digest([e.name for e in msg.entries]))
        return self._names_digest[1]

    def publish_checksum(self, row: torch.Tensor, nonce: int) -> bool:
        """Write the last update's checksum into ``row``, the ``nonce`` last.

        ``row``: int64, ``ROW_HEADER`` + one cell per entry (a ``ResultSlot``
        row, mapped from the trainer). Everything is queued on the current
        stream behind the hash, which is behind the copies: nothing here waits
        on the GPU (the header of a layout is made once, before the hash is
        queued). Where no hash can be made (no fast update, nothing
        hashable) the row says so with a count of -1, so that the reader asks
        instead of waiting. Returns whether values were published.
        """
        msg = self.last
        n = len(msg.entries) if msg is not None else 0
        if row.dtype != torch.int64 or row.dim() != 1 or (
                msg is not None and row.numel() != ROW_HEADER + n):
            raise BadInput(f"result row must be int64 of {ROW_HEADER} + {n} cells, got "
                           f"{row.dtype} {tuple(row.shape)}")
        head = None
        if msg is not None and msg.mode == "fast":
            plan = self._session_plan(msg)
            h = self._row_head
            if h is None or h[0] is not msg or h[1] is not plan or h[2].device != row.device:
                idx = [i for i, d in enumerate(plan.dsts) if d is not None]
                h = self._row_head = (
                    msg, plan,
                    torch.tensor([names_digest60(self._names_digest_of(msg)),
                                  len(plan.uncovered), n], dtype=torch.int64,
                                 device=row.device),
                    None if len(idx) == n else torch.tensor(idx, dtype=torch.int64,
                                                            device=row.device))
            head = h
        pend = self._pending
        if head is not None and (pend is None or pend[0] is not msg or pend[1] is not head[1]):
            self.prefetch_checksum()
            pend = self._pending
        if head is None or pend is None:
            row[ROW_COUNT].fill_(-1)
            row[ROW_NONCE].fill_(nonce)
            return False
        vals, idx_t = pend[2], head[3]
        cells = row[ROW_HEADER:]
        if idx_t is None:
            cells.copy_(vals)
        else:
            cells.fill_(-1)
            cells.index_copy_(0, idx_t, vals)
        row[ROW_NAMES:ROW_HEADER].copy_(head[2])
        row[ROW_NONCE].fill_(nonce)
        return True

    def checksum(self, impl: str = "auto") -> dict[str, Any]:
        """Block checksum of the slices the last update wrote, read from parameter memory."""
        msg = self.last
        if msg is None:
            return {"values": [], "names_digest": names_digest([]), "error": "no update yet"}
        plan = self.plan(msg)
        idx = [i for i, d in enumerate(plan.dsts) if d is not None]
        pend, self._pending = self._pending, None
        t = time.monotonic()
        prefetched = (pend is not None and pend[0] is msg and pend[1] is plan
                      and pend[4] == resolve_impl(impl, pend[2].device))
        if prefetched:
            assert pend is not None
            vals = [int(x) for x in pend[2].tolist()]
            since = pend[3]
        else:
            vals = [int(x) for x in self._hash(plan, impl).tolist()] if idx else []
            since = t
        out: list[int | None] = [None] * len(plan.dsts)
        for i, v in zip(idx, vals, strict=True):
            out[i] = v
        now = time.monotonic()
        return {"values": out, "names_digest": self._names_digest_of(msg),
                "elapsed_s": now - since, "wait_s": now - t, "prefetched": prefetched,
                "uncovered": plan.uncovered[:20], "n_uncovered": len(plan.uncovered)}


# ----------------------------------------------------------------- trainer side

def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).rsplit(".", 1)[-1]


class PackedWeights:
    """Named tensors laid out in one contiguous device buffer.

    The trainer can re-base its module onto it (``bind_module``): each
    parameter's ``.data`` becomes a view into the buffer, so an optimizer
    step writes straight into what is shared and ``send`` copies nothing.
    Otherwise ``load_`` copies tensors in (one device copy each).
    """

    def __init__(self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]], *,
                 device: torch.device | str = "cuda") -> None:
        entries: list[EntrySpec] = []
        off = 0
        for name, shape, dt in specs:
            dn = _dtype_name(dt)
            e = EntrySpec(name, dn, tuple(int(s) for s in shape), 0, off)
            entries.append(e)
            off += -(-e.nbytes // _ALIGN) * _ALIGN
        if not entries:
            raise BadInput("PackedWeights needs at least one tensor")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise BadInput("PackedWeights: duplicate tensor names")
        self.entries: tuple[EntrySpec, ...] = tuple(entries)
        self.device = torch.device(device)
        self.buffer = torch.empty(max(off, _ALIGN), dtype=torch.uint8, device=self.device)
        self._views: dict[str, torch.Tensor] = {}
        for e in entries:
            raw = self.buffer[e.offset_bytes:e.offset_bytes + e.nbytes]
            self._views[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
        self._handle: BufferHandle | None = None

    @classmethod
    def like(cls, named: Iterable[tuple[str, torch.Tensor]], *,
             device: torch.device | str = "cuda") -> PackedWeights:
        return cls(((n, tuple(t.shape), t.dtype) for n, t in named), device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return sum(e.nbytes for e in self.entries)

    def names(self) -> tuple[str, ...]:
        return tuple(e.name for e in self.entries)

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._views[name]
        except KeyError:
            raise BadInput(f"no tensor {name!r} in this PackedWeights") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.entries:
            yield e.name, self._views[e.name]

    def holds(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """True when ``named`` are exactly this buffer's views (then sending copies nothing)."""
        if len(named) != len(self.entries):
            return False
        views = self._views
        for name, t in named:
            v = views.get(name)
            if t is v:  # the view itself (a module bound to the buffer, its items())
                continue
            if v is None or t.data_ptr() != v.data_ptr() or t.shape != v.shape or (
                    t.dtype != v.dtype):
                return False
        return True

    def load_(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in by name; every name must exist with the same shape and dtype."""
        with torch.no_grad():
            for name, t in named:
                dst = self.tensor(name)
                if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                    raise BadInput(f"{name}: {tuple(t.shape)}/{t.dtype} does not match "
                                   f"{tuple(dst.shape)}/{dst.dtype}")
                dst.copy_(t)

    def bind_module(self, module: torch.nn.Module) -> None:
        """Make every parameter of ``module`` named here a view into the buffer (values kept)."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name in self._views:
                    dst = self._views[name]
                    if tuple(p.shape) != tuple(dst.shape) or p.dtype != dst.dtype:
                        raise BadInput(f"{name}: module parameter differs from the layout")
                    dst.copy_(p.data)
                    p.data = dst

    def handle(self) -> BufferHandle:
        """The buffer's IPC handle, created once (re-sharing would add ref counters)."""
        if self._handle is None:
            self._handle = share_buffer(self.buffer)
        return self._handle

    def message(self, mode: str = "fast") -> UpdateMessage:
        return UpdateMessage(mode, (self.handle(),), self.entries)

    def checksum(self, impl: str = "auto") -> list[int]:
        return block_checksum([self._views[e.name] for e in self.entries], impl=impl)


def share_buffer(buf: torch.Tensor) -> BufferHandle:
    """The CUDA IPC handle of a flat ``uint8`` device tensor, as plain data."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.device.type != "cuda":
        raise BadInput("CUDA IPC needs the buffer on a CUDA device")
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise BadInput("share_buffer takes a flat uint8 tensor")
    _, a = reduce_tensor(buf)  # type: ignore[no-untyped-call]
    # a = (tensor_cls, size, stride, tensor_offset, storage_cls, dtype, device,
    #      handle, storage_size_bytes, storage_offset_bytes, requires_grad,
    #      ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
    uuid = str(torch.cuda.get_device_properties(buf.device).uuid)
    return BufferHandle(
        device_uuid=uuid, handle=bytes(a[7]), storage_size_bytes=int(a[8]),
        storage_offset_bytes=int(a[9]), ref_counter_handle=bytes(a[11]),
        ref_counter_offset=int(a[12]),
        event_handle=bytes(a[13]) if a[13] is not None else b"",
        event_sync_required=bool(a[14]), tensor_offset_bytes=int(a[3]),
        nbytes=buf.numel())


def engine_flags() -> list[str]:
    """``vllm serve`` flags that select this backend and its worker extension."""
    return ["--weight-transfer-config", json.dumps({"backend": BACKEND}),
            "--worker-extension-cls", WORKER_EXTENSION]


@dataclass
class SendTimings:
    start_s: float = 0.0
    update_s: float = 0.0
    finish_s: float = 0.0
    pack_s: float = 0.0
    trainer_checksum_s: float = 0.0


class CudaIpcTransport:
    """Trainer side of ``rc_cuda_ipc``: a RolloutCore weight transport.

    ``send`` runs vLLM's update session (``/start_weight_update``,
    ``/update_weights`` with the JSON handle body, ``/finish_weight_update``)
    and passes the target's label to the finish when the engine has weight
    versions (read from its ``/openapi.json``: vLLM 0.26 has none, and then
    the label is not sent and the evidence says so). It also computes the
    trainer's own checksum of what it sent (``last_sent_checksum``), which
    ``engine_checksum`` compares against the workers' one.
    """

    backend = BACKEND

    def __init__(self, *, mode: str = "fast", device: torch.device | str = "cuda",
                 compute_checksum: bool = True, copy_impl: str = "auto",
                 checksum_impl: str = "auto", hash_at_finish: bool = False,
                 checksum_results: str = "ipc", results_wait_s: float = 2.0) -> None:
        if checksum_results not in RESULT_ROUTES:
            raise BadInput(f"checksum_results must be one of {RESULT_ROUTES}")
        if isinstance(results_wait_s, bool) or not isinstance(results_wait_s, (int, float)) \
                or not 0 < results_wait_s <= 600:
            raise BadInput("results_wait_s must be a number of seconds in (0, 600]")
        if mode not in MODES:
            raise BadInput(f"mode must be one of {MODES}")
        if copy_impl not in COPY_IMPLS:
            raise BadInput(f"copy_impl must be one of {COPY_IMPLS}")
        if checksum_impl not in CHECKSUM_IMPLS:
            raise BadInput(f"checksum_impl must be one of {CHECKSUM_IMPLS}")
        self.mode = mode
        self.copy_impl = copy_impl
        self.checksum_impl = checksum_impl
        # (engine URL, layout digest) pairs the engine has accepted in full since
        # connect(): later updates of that layout name it instead of listing it.
        self._delivered: set[tuple[str, str]] = set()
        self.device = torch.device(device)
        self.compute_checksum = compute_checksum
        #: ask the workers to hash the updated slices inside /finish_weight_update
        #: (the finish then takes the hash's time; the check only collects values).
        #: Off by default: VllmAdapter starts the check as the transfer returns,
        #: beside the cache reset, which costs the paused window less.
        self.hash_at_finish = hash_at_finish
        #: how the workers' checksum comes back: ``ipc``, written by the workers at
        #: finish into a small buffer of the trainer's (no round trip while the
        #: engine is paused; ``rpc`` is asked if it is not there within
        #: ``results_wait_s``); ``rpc``, asked through ``/collective_rpc``.
        self.checksum_results = checksum_results
        self.results_wait_s = float(results_wait_s)
        self._ranks: dict[str, list[int]] = {}
        self._slot: tuple[torch.Tensor, BufferHandle] | None = None
        self._expect: tuple[ResultSlot, str] | None = None
        self._read_stream: Any = None
        self._client: Any = None
        self._lock = threading.Lock()
        self._staging: PackedWeights | None = None
        self._routes: frozenset[str] = frozenset()
        self.label_supported = False
        self.last_timings = SendTimings()
        self.last_sent_checksum: list[int] = []
        self.last_sent_names: tuple[str, ...] = ()
        self._msg_cache: tuple[PackedWeights, str, UpdateMessage] | None = None
        self._adopted: list[PackedWeights] = []
        self.last_zero_copy = False
        self._pre: tuple[PackedWeights, list[int], tuple[str, ...]] | None = None
        self.last_check: dict[str, Any] = {}
        self._digest_cache: tuple[tuple[str, ...], list[int], str, str] | None = None

    def precompute_checksum(self, packed: PackedWeights) -> float:
        """Checksum ``packed`` now (at staging, outside the engine's pause window).

        The next ``send`` of this buffer uses it instead of hashing again; the
        buffer must not change in between, and if it does the engine's
        checksum will not match and the paused validation fails (fail-closed).
        Returns the seconds it took.
        """
        t = time.monotonic()
        self._pre = (packed, packed.checksum(self.checksum_impl), packed.names())
        return time.monotonic() - t

    def adopt(self, packed: PackedWeights) -> None:
        """Register a trainer buffer: a source whose tensors are its views is sent as is."""
        if not isinstance(packed, PackedWeights):
            raise BadInput("adopt() takes a PackedWeights")
        if packed not in self._adopted:
            self._adopted.append(packed)

    # -- RolloutCore transport interface ---------------------------------------

    def engine_config(self) -> dict[str, Any]:
        """What the engine must be started with (flags) for this transport."""
        return {"backend": BACKEND, "flags": engine_flags(),
                "weight_transfer_config": {"backend": BACKEND},
                "worker_extension_cls": WORKER_EXTENSION}

    def connect(self, base_url: str, *, timeout_s: float = 30.0) -> dict[str, Any]:
        """Check the engine offers the update session, init the backend, say hello."""
        self._check_url(base_url)
        r = self._call("GET", base_url, "/openapi.json", timeout_s, step="connect",
                       mutation=False)
        paths = frozenset(r.get("paths", {}))
        need = {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                "/finish_weight_update", "/collective_rpc"}
        if not need <= paths:
            raise EngineUnavailable("connect", f"engine lacks routes {sorted(need - paths)}",
                                    mutation_started=False)
        self._routes = paths
        # Weight versions came with /update_weight_version and /weight_info; a finish
        # body with weight_version is read only where those exist (not in 0.26).
        self.label_supported = "/weight_info" in paths and "/update_weight_version" in paths
        self._delivered = {d for d in self._delivered if d[0] != base_url}
        self._call("POST", base_url, "/init_weight_transfer_engine", timeout_s,
                   step="connect", mutation=False,
                   body={"init_info": {"protocol": PROTOCOL, "copy_impl": self.copy_impl,
                                       "checksum_impl": self.checksum_impl}})
        hello = self.rpc(base_url, "rc_cuda_ipc_hello", timeout_s=timeout_s)
        uuid = str(torch.cuda.get_device_properties(self.device).uuid) \
            if self.device.type == "cuda" else ""
        ranks = sorted(h.get("rank", -1) if isinstance(h, dict) else -1 for h in hello)
        self._ranks[base_url] = ranks if ranks == list(range(len(hello))) else []
        for h in hello:
            if not isinstance(h, dict) or h.get("backend") != BACKEND:
                raise EngineUnavailable("connect", f"worker is not running {BACKEND}: {h!r}",
                                        mutation_started=False)
            if uuid and h.get("device_uuid") != uuid:
                raise EngineUnavailable("connect", f"worker GPU {h.get('device_uuid')} is not "
                                        f"the trainer's {uuid}: CUDA IPC needs one host GPU",
                                        mutation_started=False)
        return {"label_supported": self.label_supported, "workers": hello}

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float = 300.0) -> TransferEvidence:
        """One update session. ``source``: a PackedWeights, or (name, tensor) pairs."""
        self._check_url(base_url)
        if not isinstance(target_label, str) or not target_label:
            raise BadInput("target_label must be a non-empty string")
        t0 = time.monotonic()
        tm = SendTimings()
        packed = self._packed(source, tm)
        msg = self._message(packed)
        delivered = (base_url, msg.layout_digest)
        body = encode_update(msg, by_reference=delivered in self._delivered)
        if self.compute_checksum and self.hash_at_finish:
            body[HASH_AT_FINISH] = True
        self._expect = None
        slot = self._result_slot(base_url, len(msg.entries))
        if slot is not None:
            body[RESULTS] = slot.to_json()
        mutation = False
        try:
            torch.cuda.synchronize(packed.device)  # the engine reads after our writes
            t = time.monotonic()
            self._call("POST", base_url, "/start_weight_update", timeout_s, step="transfer",
                       mutation=False)
            tm.start_s = time.monotonic() - t
            mutation = True
            t = time.monotonic()
            self._call("POST", base_url, "/update_weights", timeout_s, step="transfer",
                       mutation=True, body={"update_info": body})
            tm.update_s = time.monotonic() - t
            self._delivered.add(delivered)
            pre, self._pre = self._pre, None
            if pre is not None and pre[0] is packed:
                self.last_sent_checksum, self.last_sent_names = pre[1], pre[2]
            elif self.compute_checksum:
                t = time.monotonic()
                self.last_sent_checksum = packed.checksum(self.checksum_impl)
                self.last_sent_names = packed.names()
                tm.trainer_checksum_s = time.monotonic() - t
            t = time.monotonic()
            fin = {"weight_version": target_label} if self.label_supported else None
            self._call("POST", base_url, "/finish_weight_update", timeout_s, step="transfer",
                       mutation=True, body=fin)
            tm.finish_s = time.monotonic() - t
            if slot is not None:
                self._expect = (slot, base_url)
        except (EngineUnavailable, TransferError) as exc:
            raise TransferError("transfer", exc.reason, mutation_started=mutation) from exc
        self.last_timings = tm
        unverified: tuple[str, ...] = ()
        if not self.label_supported:
            unverified = ("engine has no weight_version: the label was not passed through "
                          "finish_weight_update",)
        return TransferEvidence(
            completed=True, mutation_started=True, backend=BACKEND,
            tensors=len(packed.entries), bytes=packed.nbytes,
            finish_label=target_label if self.label_supported else None,
            elapsed_s=time.monotonic() - t0, unverified=unverified)

    def abort(self) -> None:
        """From another thread: make a stuck HTTP call return (closes the connection pool)."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()

    def close(self) -> None:
        self.abort()
        self._staging = None
        self._msg_cache = None
        self._delivered = set()

    # -- engine-side evidence --------------------------------------------------

    def rpc(self, base_url: str, method: str, *args: str, timeout_s: float = 60.0) -> list[Any]:
        """``/collective_rpc`` of a worker-extension method; one result per worker."""
        r = self._call("POST", base_url, "/collective_rpc", timeout_s, step="rpc",
                       mutation=False, body={"method": method, "args": list(args),
                                             "timeout": timeout_s})
        res = r.get("results") if isinstance(r, dict) else None
        if not isinstance(res, list) or not res:
            raise EngineUnavailable("rpc", f"{method}: no results in {r!r}",
                                    mutation_started=False)
        return res

    def engine_checksum(self, base_url: str, *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Compare the workers' checksum of the last update with the trainer's.

        Returns a dict with ``passed``, ``coverage`` (fraction of entries the
        engine could hash: fallback-loaded entries cannot be), ``mismatched``
        names and the engine's own timing.
        """
        t0 = time.monotonic()
        expect, self._expect = self._expect, None
        via, note = "rpc", ""
        res: list[Any] | None = None
        if expect is not None and expect[1] == base_url:
            res, note = self._collect(expect[0], min(timeout_s, self.results_wait_s))
            via = "ipc" if res is not None else "rpc"
        if res is None:
            res = self.rpc(base_url, "rc_cuda_ipc_checksum", self.checksum_impl,
                           timeout_s=timeout_s)
        names, mine = self.last_sent_names, self.last_sent_checksum
        want_names = self._digests(names, mine)[0]
        out: dict[str, Any] = {"evidence": "worker block checksum of updated slices vs "
                               "trainer block checksum of the sent buffer",
                               "workers": len(res), "via": via,
                               **({"ipc_note": note} if note else {})}
        mism: list[str] = []
        covered = len(names)
        engine_s = wait_s = 0.0
        prefetched = True
        uncovered = 0
        for w in res:
            if not isinstance(w, dict):
                raise EngineUnavailable("rpc", f"bad checksum reply {w!r}",
                                        mutation_started=False)
            theirs = w.get("values")
            same_names = (w.get("names_digest") == want_names if "names_digest" in w
                          else w.get("names_digest60") == names_digest60(want_names))
            if not same_names or not isinstance(theirs, list) \
                    or len(theirs) != len(names):
                mism.append("<layout differs from the last update sent>")
                covered = 0
                continue
            engine_s = max(engine_s, float(w.get("elapsed_s", 0.0)))
            wait_s = max(wait_s, float(w.get("wait_s", 0.0)))
            prefetched = prefetched and bool(w.get("prefetched"))
            uncovered = max(uncovered, int(w.get("n_uncovered", 0)))
            for n, a, b in zip(names, mine, theirs, strict=True):
                if b is None:
                    covered -= 1
                elif a != b:
                    mism.append(n)
        out.update(passed=bool(names) and not mism and covered == len(names) and not uncovered,
                   n_uncovered=uncovered,
                   coverage=(covered / len(names)) if names else 0.0,
                   mismatched=mism[:20], n_mismatched=len(mism),
                   engine_s=engine_s, engine_wait_s=wait_s, prefetched=prefetched,
                   rpc_s=time.monotonic() - t0,
                   trainer_s=self.last_timings.trainer_checksum_s,
                   digest=self._digests(names, mine)[1] if names else None)
        self.last_check = out
        return out

    def _result_slot(self, base_url: str, n_entries: int) -> ResultSlot | None:
        """This update's result slot (a fresh nonce), or None where ``ipc`` cannot be used."""
        ranks = self._ranks.get(base_url)
        if not (self.compute_checksum and self.checksum_results == "ipc" and ranks
                and self.device.type == "cuda"):
            return None
        rows, row_len = len(ranks), ROW_HEADER + n_entries
        s = self._slot
        if s is None or s[0].shape != (rows, row_len):
            buf = torch.zeros(8 * rows * row_len, dtype=torch.uint8, device=self.device)
            torch.cuda.synchronize(self.device)  # zeroed before anyone maps it
            s = self._slot = (buf.view(torch.int64).view(rows, row_len), share_buffer(buf))
        return ResultSlot(s[1], secrets.randbelow((1 << 62) - 1) + 1, rows, row_len)

    def _collect(self, slot: ResultSlot, wait_s: float) -> tuple[list[Any] | None, str]:
        """The workers' rows of ``slot``, once each carries its nonce; (None, why) if not."""
        assert self._slot is not None
        rows = self._slot[0]
        if self._read_stream is None and rows.is_cuda:
            # Reads on a stream of their own: trainer work queued on the default
            # stream does not delay the validation.
            self._read_stream = torch.cuda.Stream(rows.device)  # type: ignore[no-untyped-call]
        t = time.monotonic()
        deadline = t + wait_s
        with (torch.cuda.stream(self._read_stream) if rows.is_cuda
              else contextlib.nullcontext()):
            # A row's nonce is written after its values (stream order on the worker):
            # once every row shows ours, a second read gets the values it covers.
            while not bool((rows[:, ROW_NONCE].cpu() == slot.nonce).all()):
                if time.monotonic() >= deadline:
                    return None, f"no result for this update within {wait_s:.3g}s: asked"
                time.sleep(5e-5)
            data = rows.cpu().tolist()
        waited = time.monotonic() - t
        out: list[Any] = []
        for r in data:
            count = r[ROW_COUNT]
            if r[ROW_NONCE] != slot.nonce or not 0 <= count <= slot.row_len - ROW_HEADER:
                return None, "a worker published no values at finish: asked"
            out.append({"values": [v if v >= 0 else None
                                   for v in r[ROW_HEADER:ROW_HEADER + count]],
                        "names_digest60": r[ROW_NAMES], "n_uncovered": r[ROW_UNCOVERED],
                        "elapsed_s": waited, "wait_s": waited, "prefetched": True})
        return out, ""

    def _digests(self, names: tuple[str, ...], values: list[int]) -> tuple[str, str]:
        """(names digest, checksum digest) of what was sent, computed once per send."""
        c = self._digest_cache
        if c is None or c[0] is not names or c[1] is not values:
            c = self._digest_cache = (names, values, names_digest(names),
                                      checksum_digest(names, values))
        return c[2], c[3]

    def validation_check(self, base_url: str, *, timeout_s: float = 60.0) -> Check:
        """The paused validation's evidence on an engine without a version label.

        A ``Check`` at ``ENGINE_CHECKSUM`` level: the workers' block checksum
        of the slices the last update wrote equals the trainer's checksum of
        the buffer it sent, for every tensor (coverage 1.0) and with every
        model parameter covered by the update.
        """
        r = self.engine_checksum(base_url, timeout_s=timeout_s)
        detail = (f"{r['evidence']} (via {r['via']}); workers={r['workers']} "
                  f"coverage={r['coverage']:.3f} "
                  f"mismatched={r['n_mismatched']} uncovered_params={r['n_uncovered']} "
                  f"engine_s={r['engine_s']:.4f} trainer_s={r['trainer_s']:.4f}")
        if r["mismatched"]:
            detail += f" first mismatches: {r['mismatched'][:3]}"
        return Check("worker_block_checksum", bool(r["passed"]), detail=detail,
                     coverage=float(r["coverage"]), level=VerificationLevel.ENGINE_CHECKSUM)

    # -- internals -------------------------------------------------------------

    def _packed(self, source: Any, tm: SendTimings) -> PackedWeights:
        self.last_zero_copy = True
        if isinstance(source, PackedWeights):
            return source
        t = time.monotonic()
        if callable(getattr(source, "named_tensors", None)):  # a rolloutcore WeightSource
            items = list(source.named_tensors())
        elif isinstance(source, Mapping):
            items = list(source.items())
        else:
            items = list(source)
        if not items:
            raise BadInput("nothing to send")
        for n, x in items:
            if not isinstance(n, str) or not isinstance(x, torch.Tensor):
                raise BadInput("source must yield (name, tensor) pairs")
        for pk in self._adopted:
            if pk.holds(items):
                tm.pack_s = time.monotonic() - t
                return pk
        self.last_zero_copy = False
        st = self._staging
        if st is None or st.names() != tuple(n for n, _ in items) or any(
                tuple(x.shape) != tuple(st.tensor(n).shape) or x.dtype != st.tensor(n).dtype
                for n, x in items):
            st = self._staging = PackedWeights.like(items, device=self.device)
        st.load_(items)
        tm.pack_s = time.monotonic() - t
        return st

    def _message(self, packed: PackedWeights) -> UpdateMessage:
        c = self._msg_cache
        if c is not None and c[0] is packed and c[1] == self.mode:
            return c[2]
        msg = packed.message(self.mode)
        self._msg_cache = (packed, self.mode, msg)
        return msg

    @staticmethod
    def _check_url(base_url: str) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise BadInput(f"base_url must be an http(s) URL, got {base_url!r}")

    def _http(self) -> Any:
        with self._lock:
            if self._client is None:
                import httpx

                self._client = httpx.Client(
                    limits=httpx.Limits(max_keepalive_connections=4))
            return self._client

    def _call(self, method: str, base_url: str, path: str, timeout_s: float, *, step: str,
              mutation: bool, body: Any = None) -> Any:
        import httpx

        client = self._http()
        try:
            if method == "GET":
                r = client.get(base_url.rstrip("/") + path, timeout=timeout_s)
            else:
                r = client.post(base_url.rstrip("/") + path, timeout=timeout_s,
                                **({"json": body} if body is not None else {}))
        except (httpx.HTTPError, RuntimeError) as exc:
            # RuntimeError: the client was closed under us by abort().
            raise EngineUnavailable(step, f"{path}: {type(exc).__name__}: {exc}",
                                    mutation_started=mutation) from exc
        if r.status_code >= 300:
            raise EngineUnavailable(step, f"{path} answered HTTP {r.status_code}: "
                                    f"{r.text[:300]}", mutation_started=mutation)
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"text": r.text[:300]}


def names_digest(names: Sequence[str]) -> str:
    """Identifies an ordered list of tensor names (what a checksum was taken over)."""
    return hashlib.sha256("\0".join(names).encode()).hexdigest()
