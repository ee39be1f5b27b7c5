"""One-launch multi-tensor kernels for ``rc_cuda_ipc``: the copy and the block checksum.

Why they exist. On the H200 (vLLM 0.26, Qwen3-8B shapes, 399 tensors,
16.38 GB) an update of 399 per-tensor ``Tensor.copy_`` calls kept the GPU
waiting on the CPU (views rebuilt, one launch per tensor): 11-15 ms of GPU
time for copies that take 8.9 ms back to back. ``MultiCopy`` is one launch
over a work table of (tensor, chunk) items built once per layout: 9.8 ms
(results/gpu/h200-8b-ipc.json ``impl_compare``). ``MultiChecksum`` hashes
the same 16.4 GB in 4.2 ms (3.9 TB/s; a plain read is 3.75 ms) where torch's
per-tensor reductions take 10-11 ms, most of it launching ~1,600 small
kernels from Python (results/gpu/csum-bench.json, every form and tile size;
an earlier measurement that had the kernel slower was timing a quadratic
Python loop after it).

Addressing: every tensor is reached as ``base + offset`` in elements, where
``base`` is the first tensor of the call and ``offset`` the difference of
data pointers (one address space per process, so any two device pointers
differ by a whole number of 4-byte words when both are 4-byte aligned).
This avoids integer-to-pointer casts and keeps one kernel signature.

The checksum definition is ``cuda_ipc.block_checksum``'s, bit for bit:
per 512-byte block (128 int32 words) the int32 sum of its words mod 2**32,
times an odd weight of the block's position in the whole call, mod 2**32,
summed per tensor in int64. Integer arithmetic in any order gives the same
value, so the kernel agrees with the torch implementation exactly; a test
runs both (under ``TRITON_INTERPRET=1`` on the CPU, on the GPU in the
diagnostics).

``available(device)`` says whether the kernels can run; callers fall back
to torch otherwise. Triton is imported lazily: the CPU install never needs it.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "CHECKSUM_COLS", "COPY_WORDS", "CSUM_KERNEL", "CSUM_KERNELS", "CSUM_PER_SM", "CSUM_ROWS",
    "CSUM_WARPS", "W_ADD", "W_MUL", "MultiChecksum", "MultiCopy", "available",
    "block_checksum_device", "block_shape", "forget_programs",
    "multi_copy",
]

#: int32 words per checksum block (512 bytes).
CHECKSUM_COLS = 128


def _tile(env: str, default: int, lo: int, hi: int) -> int:
    """A power-of-two tile size, from the environment (set per process) or the default."""
    raw = os.environ.get(env)
    if raw is None:
        return default
    try:
        v = int(raw)
    except ValueError:
        raise ValueError(f"{env} must be an integer, got {raw!r}") from None
    if not lo <= v <= hi or v & (v - 1):
        raise ValueError(f"{env} must be a power of two in [{lo}, {hi}], got {v}")
    return v


#: 512-byte blocks per checksum program, int32 words per copy program; a
#: program streams one tile. Tunable per process (the H200 diagnostics sweep them).
CSUM_ROWS = _tile("RC_CUDA_IPC_CSUM_ROWS", 64, 16, 1024)
COPY_WORDS = _tile("RC_CUDA_IPC_COPY_WORDS", 16384, 1024, 65536)
CSUM_WARPS = _tile("RC_CUDA_IPC_CSUM_WARPS", 8, 1, 32)
#: How the checksum kernel reads a tile: ``2d`` (rows of blocks), ``flat`` (one
#: run of words, the copy kernel's pattern), and each of them as persistent
#: programs walking the work table (``2d-loop``, ``flat-loop``). Same values.
CSUM_KERNELS = ("2d", "flat", "2d-loop", "flat-loop")
CSUM_KERNEL = os.environ.get("RC_CUDA_IPC_CSUM_KERNEL", "flat")
if CSUM_KERNEL not in CSUM_KERNELS:
    raise ValueError(f"RC_CUDA_IPC_CSUM_KERNEL must be one of {CSUM_KERNELS}, "
                     f"got {CSUM_KERNEL!r}")
#: persistent programs per SM for the ``-loop`` kernels
CSUM_PER_SM = 4
#: the block-position weight is ((pos * W_MUL + W_ADD) & 0x7FFFFFFF) | 1
W_MUL = 0x9E3779B1
W_ADD = 0x7F4A7C15

_lock = threading.Lock()
_built: dict[str, Any] = {}


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA, or the CPU interpreter)."""
    if device.type != "cuda" and not (device.type == "cpu" and _interpret()):
        return False
    try:
        _kernels()
    except Exception:  # no triton, or it cannot compile here: torch fallback
        return False
    return True


def _kernels() -> dict[str, Any]:
    """The kernels, imported once per process (``triton.jit`` reads ``TRITON_INTERPRET``
    when the module is first imported: the interpreted tests run in a child process)."""
    with _lock:
        if not _built:
            from rolloutcore.transports.cuda_ipc import _triton as tk

            _built.update(csum=tk.csum_kernel, csum_loop=tk.csum_loop_kernel,
                          csum_small=tk.csum_small_kernel, copy=tk.copy_kernel)
        return _built


def _words(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, length in int32 words) of a contiguous tensor, else ValueError.

    16-byte alignment and size let the kernels use vector loads (the hints
    ``tl.multiple_of(..., 4)`` promise it); anything else takes the torch path.
    """
    nb = t.numel() * t.element_size()
    if not t.is_contiguous() or nb % 16 or t.data_ptr() % 16:
        raise ValueError("multi-tensor kernels need contiguous, 16-byte aligned tensors "
                         "whose size is a multiple of 16 bytes")
    return t.data_ptr(), nb // 4


def _items(lengths: Sequence[int], per: int, device: torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The work table: for each program, its tensor index and its first unit (on device)."""
    counts = torch.tensor([-(-n // per) for n in lengths], dtype=torch.int64, device=device)
    t = torch.repeat_interleave(torch.arange(len(lengths), device=device), counts)
    first = torch.cumsum(counts, 0) - counts
    idx = torch.arange(int(t.numel()), dtype=torch.int64, device=device)
    return t, (idx - first[t]) * per


def _programs(device: torch.device) -> int:
    """Persistent programs for ``device``: ``CSUM_PER_SM`` per SM (4 in the interpreter)."""
    if device.type != "cuda":
        return 4
    return CSUM_PER_SM * int(torch.cuda.get_device_properties(device).multi_processor_count)


def _flat32(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8).view(torch.int32)


def block_shape(nbytes: int) -> tuple[int, int]:
    """(blocks, words per block) of a tensor of ``nbytes``: 128-word blocks, or the
    widest power of two that divides its word count (the checksum's definition)."""
    n32 = nbytes // 4
    c = CHECKSUM_COLS
    while c > 1 and n32 % c:
        c //= 2
    return n32 // c, c


class MultiChecksum:
    """The block checksum of a fixed list of tensors: checked once, launched many times.

    ``first_rows[i]`` is the global position of tensor ``i``'s first block
    (default: the running sum, as ``cuda_ipc.block_checksum`` defines it).
    Tensors of whole 128-word blocks, 16-byte aligned, go to one vectorized
    launch; the rest (4-byte aligned) to a second, small one. ``run`` queues
    the work on the current stream and returns the per-tensor values as an
    int64 device tensor without waiting: all the per-tensor CPU work
    (pointers, shapes, work tables) was done here, once. The tensors are
    held, so their memory stays valid while this object lives.
    """

    def __init__(self, tensors: Sequence[torch.Tensor],
                 first_rows: Sequence[int] | None = None) -> None:
        if not tensors:
            raise ValueError("nothing to hash")
        device = tensors[0].device
        shapes = []
        for t in tensors:
            if t.device != device:
                raise ValueError("tensors are on different devices")
            if not t.is_contiguous() or t.data_ptr() % 4 or t.numel() * t.element_size() % 4:
                raise ValueError("the checksum kernels need contiguous, 4-byte aligned "
                                 "tensors of whole 4-byte words")
            shapes.append(block_shape(t.numel() * t.element_size()))
        if first_rows is None:
            first, start = [], 0
            for r, _ in shapes:
                first.append(start)
                start += r
        else:
            first = [int(r) for r in first_rows]
            if len(first) != len(tensors):
                raise ValueError("one first row per tensor")
        self.device = device
        self.n = len(tensors)
        self.kernel, self.rows_per_item, self.warps = CSUM_KERNEL, CSUM_ROWS, CSUM_WARPS
        if self.kernel not in CSUM_KERNELS:
            raise ValueError(f"CSUM_KERNEL must be one of {CSUM_KERNELS}, got {self.kernel!r}")
        i64 = torch.int64
        main = [i for i, (t, (r, c)) in enumerate(zip(tensors, shapes, strict=True))
                if r and c == CHECKSUM_COLS and t.data_ptr() % 16 == 0]
        mset = set(main)
        small = [i for i, (r, _) in enumerate(shapes) if r and i not in mset]
        self._held = list(tensors)
        self._launches: list[tuple[str, torch.Tensor, tuple[torch.Tensor, ...],
                                   torch.Tensor, torch.Tensor]] = []
        for name, idx in (("main", main), ("small", small)):
            if not idx:
                continue
            ptrs = [tensors[i].data_ptr() for i in idx]
            rows = [shapes[i][0] for i in idx]
            per = self.rows_per_item if name == "main" else 16
            item_t, item_r = _items(rows, per, device)
            table = [torch.tensor([(p - ptrs[0]) // 4 for p in ptrs], dtype=i64, device=device),
                     torch.tensor(rows, dtype=i64, device=device)]
            if name == "small":
                table.append(torch.tensor([shapes[i][1] for i in idx], dtype=i64,
                                          device=device))
            table += [torch.tensor([first[i] for i in idx], dtype=i64, device=device),
                      item_t, item_r]
            owner = torch.tensor(idx, dtype=i64, device=device)[item_t]
            out = torch.empty(int(item_t.numel()), dtype=i64, device=device)
            self._launches.append((name, _flat32(tensors[idx[0]]), tuple(table), out, owner))
        self.items = sum(int(x[3].numel()) for x in self._launches)

    def run(self) -> torch.Tensor:
        kern = _kernels()
        per = torch.zeros(self.n, dtype=torch.int64, device=self.device)
        for name, base, table, out, owner in self._launches:
            n_items = int(out.numel())
            if name == "small":
                kern["csum_small"][(n_items,)](base, *table, out, R=16, C=CHECKSUM_COLS,
                                               W_MUL=W_MUL, W_ADD=W_ADD, num_warps=4)
            elif self.kernel.endswith("-loop"):
                kern["csum_loop"][(min(n_items, _programs(self.device)),)](
                    base, *table, out, n_items, R=self.rows_per_item, C=CHECKSUM_COLS,
                    W_MUL=W_MUL, W_ADD=W_ADD, FLAT=self.kernel.startswith("flat"),
                    num_warps=self.warps)
            else:
                kern["csum"][(n_items,)](
                    base, *table, out, R=self.rows_per_item, C=CHECKSUM_COLS,
                    W_MUL=W_MUL, W_ADD=W_ADD, FLAT=self.kernel.startswith("flat"),
                    num_warps=self.warps)
            per.index_add_(0, owner, out)
        return per


_programs_cache: dict[tuple[int, ...], MultiChecksum] = {}


def forget_programs() -> None:
    """Drop the prepared checksum programs (and with them their hold on memory)."""
    with _lock:
        _programs_cache.clear()


def block_checksum_device(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``MultiChecksum(tensors).run()``, the prepared program reused for the same tensors.

    Keyed by every tensor's address and size and the kernel settings, so a
    new list of the same memory (a parameter walk, an update's slices) costs
    one dictionary lookup, not a new work table.
    """
    key = (CSUM_ROWS, CSUM_WARPS, CSUM_KERNELS.index(CSUM_KERNEL),
           *(x for t in tensors for x in (t.data_ptr(), t.numel() * t.element_size())))
    with _lock:
        prog = _programs_cache.get(key)
    if prog is None or prog.device != tensors[0].device:
        prog = MultiChecksum(tensors)
        with _lock:
            if len(_programs_cache) >= 4:  # it holds its tensors: keep few
                _programs_cache.clear()
            _programs_cache[key] = prog
    return prog.run()


class MultiCopy:
    """``dst.copy_(src)`` for a fixed list of pairs, checked once, launched many times.

    Pairs must have equal byte sizes and be contiguous and 16-byte aligned;
    ``run`` is one launch on the current stream (SM loads and stores), so an
    update of a known layout costs no per-tensor CPU work at all. The
    tensors are held: their memory stays valid while this object lives.
    """

    def __init__(self, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
        if len(dsts) != len(srcs):
            raise ValueError("dsts and srcs differ in length")
        if not dsts:
            raise ValueError("nothing to copy")
        dp, sp, words = [], [], []
        device = dsts[0].device
        for d, s in zip(dsts, srcs, strict=True):
            if d.device != device or s.device != device:
                raise ValueError("tensors are on different devices")
            a, n = _words(d)
            b, m = _words(s)
            if n != m:
                raise ValueError("a destination and its source differ in size")
            dp.append(a)
            sp.append(b)
            words.append(n)
        i64 = torch.int64
        self.tile = COPY_WORDS
        item_t, item_w = _items(words, self.tile, device)
        self._held = (list(dsts), list(srcs))
        self._dbase, self._sbase = _flat32(dsts[0]), _flat32(srcs[0])
        self._args = (torch.tensor([(p - dp[0]) // 4 for p in dp], dtype=i64, device=device),
                      torch.tensor([(p - sp[0]) // 4 for p in sp], dtype=i64, device=device),
                      torch.tensor(words, dtype=i64, device=device), item_t, item_w)
        self.items = int(item_t.numel())
        self.words = sum(words)

    def run(self) -> None:
        copy_kernel = _kernels()["copy"]
        copy_kernel[(self.items,)](self._dbase, self._sbase, *self._args,
                                   B=self.tile, num_warps=8)


def multi_copy(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """One-shot ``MultiCopy(dsts, srcs).run()`` (no-op for empty lists)."""
    if dsts or srcs:
        MultiCopy(dsts, srcs).run()
