"""The block checksum: version evidence that needs no engine label.

vLLM 0.26 has no ``weight_version``. Both sides compute ``block_checksum``
over the same tensors in the same order: the trainer over what it sent, the
engine's workers over the parameter memory the update wrote. It is one pass
over the bytes on the device: int32 sums of 512-byte blocks of the raw bits,
weighted by block position and reduced per tensor. The arithmetic is exact
integer arithmetic, so both sides agree bit for bit whatever the reduction
order, on any device and with either implementation (torch reductions, or
``kernels.MultiChecksum``). It detects stale, missing, shifted or swapped
data at block granularity; it is not cryptographic.

Comparing two sets of values is not done here: ``verification.checksums``
holds the one comparison (coverage, and what never counts as a match).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence

import torch

from rolloutcore.errors import BadInput
from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels

__all__ = [
    "CHECKSUM_IMPLS",
    "block_checksum",
    "block_checksum_device",
    "checksum_digest",
    "kernel_ok",
    "resolve_impl",
]


_MASK32 = 0xFFFFFFFF
_weights_cache: dict[tuple[int, str], torch.Tensor] = {}
_weights_lock = threading.Lock()


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
    """One integer per tensor over its raw bits (the definition is the module's).

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
        if cuda_kernels.available(device) and all(kernel_ok(t) for t in tensors):
            return cuda_kernels.block_checksum_device(tensors)
        if impl == "kernel":
            raise BadInput("the checksum kernel cannot run here: it needs Triton on the "
                           "tensors' device and contiguous, 4-byte aligned tensors")
    rows = [cuda_kernels.block_shape(t.numel() * t.element_size()) for t in tensors]
    return _block_checksum_device(tensors, rows)


def resolve_impl(impl: str, device: torch.device) -> str:
    """``auto`` is the kernel where it can run (CUDA with Triton), else torch."""
    if impl != "auto":
        return impl
    return "kernel" if cuda_kernels.available(device) else "torch"


def kernel_ok(t: torch.Tensor) -> bool:
    """Whether the one-launch kernels can address ``t`` (contiguous, whole 4-byte words)."""
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
