"""The ``rc_cuda_ipc`` wire format: what travels in ``update_info``, and its validation.

Everything here is plain data checked on receipt: base64 bytes, integers,
strings from an allow-list. Nothing on the wire names a Python class or a
callable, so the receiver builds tensors itself from validated numbers
(``decode_update``) and never unpickles. The module needs neither torch nor
CUDA: both sides, and tests without a GPU, use it as is.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.errors import BadInput

__all__ = [
    "ALIGN",
    "BACKEND",
    "DTYPES",
    "HASH_AT_FINISH",
    "MODES",
    "HANDLE_KINDS",
    "HANDLE_VERSIONS",
    "PROTOCOL",
    "REF_COUNTER_FILE_BYTES",
    "REF_COUNTER_RE",
    "REF_COUNTER_SLOTS",
    "RESULTS",
    "RESULT_ROUTES",
    "ROW_COUNT",
    "ROW_HEADER",
    "ROW_NAMES",
    "ROW_NONCE",
    "ROW_UNCOVERED",
    "WORKER_EXTENSION",
    "BufferHandle",
    "EntrySpec",
    "ResultSlot",
    "UpdateMessage",
    "decode_results",
    "decode_update",
    "dtype_name",
    "encode_update",
    "layout_digest",
    "names_digest",
    "handle_kind",
    "names_digest60",
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
# torch's CUDA storage handle: a kind byte, then cudaIpcMemHandle_t (64 bytes) for a
# cudaMalloc'd segment ("c"), or a share header and per-chunk handles for an
# expandable segment ("e"). CUDA itself validates the handle when the receiver opens
# it; here its kind and size are checked, and the receiver checks the declared sizes
# against the allocation it opened (``loader.map_buffer``).
_MAX_HANDLE = 1024
#: torch's CUDA storage handle (``CUDACachingAllocator::shareIpcHandle``): a version byte
#: (``SHAREABLE_HANDLE_VERSION``: 2 in torch 2.x, 3 from torch 2.13, which vLLM 0.33/0.34
#: pin as 2.14: seen on the H200 on 2026-12-06 as ``b"\x03c"``), a kind byte (``c``:
#: cudaMalloc, then the 64-byte ``cudaIpcMemHandle_t``, the same payload in versions 2 and
#: 3; ``e``: an expandable segment, then its own bounded payload, which torch 2.13 changed
#: and which only the receiver's torch parses). Kind byte -> exact length of the payload
#: after it (None: bounded).
HANDLE_VERSIONS = frozenset({2, 3})
HANDLE_KINDS = {b"c"[0]: 64, b"e"[0]: None}


def handle_kind(handle: bytes) -> tuple[int, int]:
    """(kind byte, header length) of a torch CUDA storage handle, or ``BadInput``.

    The versioned form is ``<version><kind><payload>``; a handle that starts
    with a kind byte is the versionless form of older torch releases.
    """
    if len(handle) >= 2 and handle[0] in HANDLE_VERSIONS and handle[1] in HANDLE_KINDS:
        return handle[1], 2
    if handle[0] in HANDLE_KINDS:
        return handle[0], 1
    raise BadInput(f"handle kind {handle[:2]!r} is not a torch CUDA storage handle "
                   f"(version {sorted(HANDLE_VERSIONS)}, then one of "
                   f"{sorted(bytes([k]) for k in HANDLE_KINDS)})")
_MAX_REF_COUNTER_HANDLE = 1024       # a shared-memory file name
_EVENT_HANDLE = 64                    # sizeof(cudaIpcEventHandle_t)
#: The producer's reference counters: a shared-memory file of this many int64 slots
#: (torch's ``CUDA_IPC_REF_COUNTER_FILE_SIZE``), named ``/torch_<pid>_<random>_<n>``
#: (``at::NewProcessWideShmHandle``). When the receiver releases a mapping, torch
#: decrements slot ``ref_counter_offset`` of that file with no bound check: an offset
#: at or past the end would be a write outside the file's mapping in the worker.
REF_COUNTER_SLOTS = 10_000
#: The file's size: torch's ``RefcountedMapAllocator`` puts a 64-byte header (its own
#: reference count, ``map_alloc_alignment``) before the slots.
REF_COUNTER_FILE_BYTES = 8 * REF_COUNTER_SLOTS + 64
REF_COUNTER_RE = re.compile(r"/torch_([0-9]{1,10})_([0-9]{1,20})_([0-9]{1,20})")  # fullmatch
ALIGN = 256                           # entries start on 256-byte boundaries
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_UUID_RE = re.compile(r"^(GPU-)?[0-9a-fA-F-]{16,64}$")


# --------------------------------------------------------------------------- codec

def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: object, what: str, *, max_len: int) -> bytes:
    if not isinstance(s, str):
        raise BadInput(f"{what} must be a base64 string, got {type(s).__name__}")
    if len(s) > 4 * (max_len // 3 + 2):
        raise BadInput(f"{what} is too long")
    try:
        b = base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadInput(f"{what} is not valid base64: {exc}") from exc
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
        if not isinstance(self.device_uuid, str) or not _UUID_RE.fullmatch(self.device_uuid):
            raise BadInput(f"device_uuid is not a GPU UUID: {self.device_uuid!r}")
        if not isinstance(self.handle, bytes) or not 0 < len(self.handle) <= _MAX_HANDLE:
            raise BadInput(f"handle must be 1..{_MAX_HANDLE} bytes")
        kind, header = handle_kind(self.handle)
        exact = HANDLE_KINDS[kind]
        if exact is not None and len(self.handle) != header + exact:
            raise BadInput(f"a {bytes([kind])!r} handle is {header + exact} bytes, got "
                           f"{len(self.handle)}")
        if not isinstance(self.ref_counter_handle, bytes) or not (
                0 < len(self.ref_counter_handle) <= _MAX_REF_COUNTER_HANDLE):
            raise BadInput("ref_counter_handle must be 1..1024 bytes")
        if not REF_COUNTER_RE.fullmatch(self.ref_counter_handle.decode("ascii", "replace")):
            raise BadInput(f"ref_counter_handle {self.ref_counter_handle[:64]!r} is not a "
                           "torch reference-counter file name (/torch_<pid>_<n>_<n>)")
        if not isinstance(self.event_handle, bytes) or len(self.event_handle) > _MAX_HANDLE:
            raise BadInput(f"event_handle must be at most {_MAX_HANDLE} bytes")
        if not isinstance(self.event_sync_required, bool):
            raise BadInput("event_sync_required must be a boolean")
        # torch reads a whole cudaIpcEventHandle_t from these bytes when it must sync:
        # a shorter string would be read past its end in the worker.
        if self.event_sync_required and len(self.event_handle) != _EVENT_HANDLE:
            raise BadInput(f"event_handle must be {_EVENT_HANDLE} bytes when "
                           f"event_sync_required, got {len(self.event_handle)}")
        for name in ("storage_size_bytes", "storage_offset_bytes", "ref_counter_offset",
                     "tensor_offset_bytes", "nbytes"):
            _int(getattr(self, name), name)
        if self.ref_counter_offset >= REF_COUNTER_SLOTS:
            raise BadInput(f"ref_counter_offset {self.ref_counter_offset} is outside the "
                           f"{REF_COUNTER_SLOTS} slots of a reference-counter file")
        if self.storage_size_bytes == 0:
            raise BadInput("storage_size_bytes must be > 0")
        if self.tensor_offset_bytes + self.nbytes > self.storage_size_bytes:
            raise BadInput(f"buffer [{self.tensor_offset_bytes}, +{self.nbytes}) exceeds its "
                           f"storage of {self.storage_size_bytes} bytes")

    @property
    def producer_pid(self) -> int:
        """The pid of the process that made the reference counter (its owner's)."""
        m = REF_COUNTER_RE.fullmatch(self.ref_counter_handle.decode("ascii"))
        assert m is not None  # checked at construction
        return int(m.group(1))

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
                not _NAME_RE.fullmatch(self.name)):
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
        pids = {b.producer_pid for b in self.buffers}
        if len(pids) != 1:
            raise BadInput(f"buffers come from several processes ({sorted(pids)}): one "
                           "update has one producer")
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
            object.__setattr__(self, "layout_digest", layout_digest(self.entries))

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def layout_digest(entries: Sequence[EntrySpec]) -> str:
    """Names a layout (entries in order): a later update may send this instead of them."""
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
    slot = decode_results(o) if RESULTS in o else None  # the engine side reads it again
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
    if slot is not None and buffers and slot.buffer.producer_pid != buffers[0].producer_pid:
        raise BadInput(f"update_info.{RESULTS} comes from process {slot.buffer.producer_pid}, "
                       f"the buffers from {buffers[0].producer_pid}")
    if "layout" in o:
        return _by_layout(o["layout"], mode, buffers, known)
    ents = o["entries"]
    if not isinstance(ents, list) or len(ents) > _MAX_ENTRIES:
        raise BadInput(f"update_info.entries must be a list of at most {_MAX_ENTRIES}")
    return UpdateMessage(
        mode, buffers,
        tuple(EntrySpec.from_json(e, f"entries[{i}]") for i, e in enumerate(ents)),
    )


def _by_layout(digest: object, mode: str, buffers: tuple[BufferHandle, ...],
               known: Mapping[str, UpdateMessage] | None) -> UpdateMessage:
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise BadInput("update_info.layout must be a sha256 hex digest")
    prev = (known or {}).get(digest)
    if prev is None:
        raise BadInput(f"unknown layout {digest[:12]}: this engine has not received its "
                       "entries (send them in full)")
    if prev.mode == mode and prev.buffers == buffers:
        return prev
    return UpdateMessage(mode, buffers, prev.entries, layout_digest=digest)


def decode_results(d: Mapping[str, Any]) -> ResultSlot | None:
    """The ``results`` slot of an ``update_info`` (validated), or None when absent."""
    r = d.get(RESULTS)
    return None if r is None else ResultSlot.from_json(r)


def names_digest(names: Sequence[str]) -> str:
    """Identifies an ordered list of tensor names (what a checksum was taken over)."""
    return hashlib.sha256("\0".join(names).encode()).hexdigest()

def dtype_name(dt: object) -> str:
    """A torch dtype's name as the wire spells it (``torch.bfloat16`` -> ``bfloat16``)."""
    return str(dt).rsplit(".", 1)[-1]
