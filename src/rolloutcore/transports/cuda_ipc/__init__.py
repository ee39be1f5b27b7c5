"""CUDA IPC weight transfer with no pickle (``rc_cuda_ipc``).

vLLM 0.26's built-in ``ipc`` backend sends its CUDA IPC handles over HTTP as
a base64 pickle (and so needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; its
module also imports ray). Here the same handles travel as plain JSON:
base64 bytes, integers, strings from an allow-list. Nothing on the wire
names a Python class or a callable; the receiver builds the tensors itself
from validated numbers.

The fast path. The trainer keeps its weights in ONE contiguous device
buffer and shares it through a single IPC handle, created once. The engine
maps it once, plans once where each tensor lands in the model's (possibly
fused) parameters, and then every update is a run of large device-to-device
copies. A ``reference`` mode runs vLLM's normal path (layerwise reload
around ``model.load_weights``) for the bit-exactness check. Version
evidence without an engine label: both sides compute the same block
checksum, the trainer over what it sent, the workers over what the update
wrote.

The package, by concern (this module re-exports the public names):

* ``wire``: the ``update_info`` format and its validation (no torch needed);
* ``checksum``: the block checksum (torch on any device, Triton kernel on CUDA);
* ``loader``: the engine half's work without vLLM (map, plan, copy, hash);
* ``trainer``: ``PackedWeights``, ``share_buffer`` and ``CudaIpcTransport``;
* ``engine``: the vLLM weight transfer engine and worker extension (imports vLLM);
* ``kernels``: the one-launch multi-tensor copy and checksum.
"""

from __future__ import annotations

from rolloutcore.transports.cuda_ipc.checksum import (
    CHECKSUM_IMPLS,
    block_checksum,
    block_checksum_device,
    checksum_digest,
    resolve_impl,
)
from rolloutcore.transports.cuda_ipc.loader import (
    COPY_IMPLS,
    SliceLoader,
    SlicePlan,
    build_plan,
    map_buffer,
)
from rolloutcore.transports.cuda_ipc.trainer import (
    CudaIpcTransport,
    PackedWeights,
    SendTimings,
    engine_flags,
    share_buffer,
)
from rolloutcore.transports.cuda_ipc.wire import (
    BACKEND,
    DTYPES,
    HASH_AT_FINISH,
    MODES,
    PROTOCOL,
    RESULT_ROUTES,
    RESULTS,
    ROW_COUNT,
    ROW_HEADER,
    ROW_NAMES,
    ROW_NONCE,
    ROW_UNCOVERED,
    WORKER_EXTENSION,
    BufferHandle,
    EntrySpec,
    ResultSlot,
    UpdateMessage,
    decode_results,
    decode_update,
    encode_update,
    names_digest,
    names_digest60,
)

__all__ = [
    "BACKEND",
    "CHECKSUM_IMPLS",
    "COPY_IMPLS",
    "DTYPES",
    "HASH_AT_FINISH",
    "MODES",
    "PROTOCOL",
    "RESULTS",
    "RESULT_ROUTES",
    "ROW_COUNT",
    "ROW_HEADER",
    "ROW_NAMES",
    "ROW_NONCE",
    "ROW_UNCOVERED",
    "WORKER_EXTENSION",
    "BufferHandle",
    "CudaIpcTransport",
    "EntrySpec",
    "PackedWeights",
    "ResultSlot",
    "SendTimings",
    "SliceLoader",
    "SlicePlan",
    "UpdateMessage",
    "block_checksum",
    "block_checksum_device",
    "build_plan",
    "checksum_digest",
    "decode_results",
    "decode_update",
    "encode_update",
    "engine_flags",
    "map_buffer",
    "names_digest",
    "names_digest60",
    "resolve_impl",
    "share_buffer",
]
