"""The trainer's one shared buffer: ``PackedWeights`` and its IPC handle (``share_buffer``).

The trainer keeps its weights in ONE contiguous device buffer (a module can
be re-based onto it, the way a flat parameter is) and shares that buffer
through a single IPC handle, created once and reused for every update. What
follows from the layout (names, size, where each entry sits, the checksum
program) is derived once per buffer: a new layout is a new ``PackedWeights``.
``trainer.CudaIpcTransport`` sends it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rolloutcore.errors import BadInput
from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels
from rolloutcore.transports.cuda_ipc.checksum import (
    CHECKSUM_IMPLS,
    block_checksum,
    kernel_ok,
    resolve_impl,
)
from rolloutcore.transports.cuda_ipc.wire import (
    ALIGN,
    BufferHandle,
    EntrySpec,
    UpdateMessage,
    dtype_name,
)

__all__ = ["PackedWeights", "share_buffer"]

_PTR = torch.Tensor.data_ptr
_SHAPE = operator.attrgetter("shape")
_DTYPE = operator.attrgetter("dtype")
_STRIDE = torch.Tensor.stride


class PackedWeights:
    """Named tensors laid out in one contiguous device buffer; ``load_`` copies
    tensors in (one device copy each)."""

    def __init__(self, specs: Iterable[tuple[str, Sequence[int], torch.dtype]], *,
                 device: torch.device | str = "cuda") -> None:
        entries: list[EntrySpec] = []
        off = 0
        for name, shape, dt in specs:
            dn = dtype_name(dt)
            e = EntrySpec(name, dn, tuple(int(s) for s in shape), 0, off)
            entries.append(e)
            off += -(-e.nbytes // ALIGN) * ALIGN
        if not entries:
            raise BadInput("PackedWeights needs at least one tensor")
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise BadInput("PackedWeights: duplicate tensor names")
        self.entries: tuple[EntrySpec, ...] = tuple(entries)
        self.device = torch.device(device)
        self.buffer = torch.empty(max(off, ALIGN), dtype=torch.uint8, device=self.device)
        self._views: dict[str, torch.Tensor] = {}
        for e in entries:
            raw = self.buffer[e.offset_bytes:e.offset_bytes + e.nbytes]
            self._views[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
        self._handle: BufferHandle | None = None
        # Derived once from the layout (which never changes: a new layout is a new
        # PackedWeights): what the hot path would otherwise recompute per tensor.
        self._names = tuple(names)
        self._nbytes = sum(e.nbytes for e in entries)
        self._view_list = [self._views[n] for n in self._names]
        #: where each entry lives in the buffer, as the views were made: (data
        #: pointers, shapes, dtypes, strides), in entry order. A tensor is this
        #: buffer's entry only if it has all four (``holds``, ``holds_tensors``).
        self._layout = self._meta(self._view_list)
        self._by_name = {n: i for i, n in enumerate(self._names)}
        self._kernel_ok = all(kernel_ok(v) for v in self._view_list)
        self._csum_prog: tuple[tuple[Any, ...], cuda_kernels.MultiChecksum] | None = None

    @staticmethod
    def _meta(ts: Sequence[torch.Tensor]) -> tuple[list[int], list[Any], list[Any], list[Any]]:
        """(data pointers, shapes, dtypes, strides) of ``ts``: four C-level passes."""
        return (list(map(_PTR, ts)), list(map(_SHAPE, ts)), list(map(_DTYPE, ts)),
                list(map(_STRIDE, ts)))

    @classmethod
    def like(cls, named: Iterable[tuple[str, torch.Tensor]], *,
             device: torch.device | str = "cuda") -> PackedWeights:
        return cls(((n, tuple(t.shape), t.dtype) for n, t in named), device=device)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (without alignment padding)."""
        return self._nbytes

    def names(self) -> tuple[str, ...]:
        """The entries' names in order (one tuple, the same object every call)."""
        return self._names

    def tensor(self, name: str) -> torch.Tensor:
        try:
            return self._views[name]
        except KeyError:
            raise BadInput(f"no tensor {name!r} in this PackedWeights") from None

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for e in self.entries:
            yield e.name, self._views[e.name]

    def holds(self, named: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """True when ``named`` are exactly this buffer's entries (then sending copies nothing).

        Every name once, each tensor at its entry's place in the buffer with its
        entry's shape, dtype and strides (as the views were made). One Python
        step per tensor: ``holds_tensors`` is the same test for a list in entry
        order, in a few C-level passes.
        """
        n = len(self._names)
        if len(named) != n:
            return False
        ptrs, shapes, dtypes, strides = self._layout
        seen: set[int] = set()
        for name, t in named:
            i = self._by_name.get(name)
            if i is None or i in seen or t.data_ptr() != ptrs[i] or t.shape != shapes[i] or (
                    t.dtype != dtypes[i]) or t.stride() != strides[i]:
                return False
            seen.add(i)
        return True

    def holds_tensors(self, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> bool:
        """``holds(zip(names, tensors))`` for names in entry order: the hot path's test.

        The names must be this buffer's, in order (a tuple comparison, free when
        it is ``names()`` itself); then the tensors' data pointers, shapes, dtypes
        and strides are read in four C-level passes and compared with the layout
        as the views were made. Nothing is cached about the tensors: every call
        reads them, so a tensor moved, reshaped or re-typed since is seen.
        """
        if tuple(names) != self._names or len(tensors) != len(self._names):
            return False
        return self._meta(tensors) == self._layout

    def load_(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors in by name; every name must exist with the same shape and dtype."""
        with torch.no_grad():
            for name, t in named:
                dst = self.tensor(name)
                if tuple(t.shape) != tuple(dst.shape) or t.dtype != dst.dtype:
                    raise BadInput(f"{name}: {tuple(t.shape)}/{t.dtype} does not match "
                                   f"{tuple(dst.shape)}/{dst.dtype}")
                dst.copy_(t)

    def handle(self) -> BufferHandle:
        """The buffer's IPC handle, created once (re-sharing would add ref counters)."""
        if self._handle is None:
            self._handle = share_buffer(self.buffer)
        return self._handle

    def message(self, mode: str = "fast") -> UpdateMessage:
        return UpdateMessage(mode, (self.handle(),), self.entries)

    def checksum(self, impl: str = "auto") -> list[int]:
        """``block_checksum`` of the entries' views, in entry order.

        Where the kernel runs, the prepared program (``kernels.MultiChecksum``:
        pointers, shapes and work tables) is this buffer's own, made once, and
        reused while the views are still where they were made (read in a few
        C-level passes each call): no per-tensor Python per checksum. Anything
        else is ``block_checksum`` as is. Same values either way.
        """
        views = self._view_list
        if self._kernel_ok and impl in CHECKSUM_IMPLS and \
                resolve_impl(impl, self.device) == "kernel" and \
                cuda_kernels.available(self.device) and self._meta(views) == self._layout:
            key = (cuda_kernels.CSUM_ROWS, cuda_kernels.CSUM_WARPS, cuda_kernels.CSUM_KERNEL,
                   str(self.device))
            c = self._csum_prog
            if c is None or c[0] != key:
                c = self._csum_prog = (key, cuda_kernels.MultiChecksum(views))
            return [int(x) for x in c[1].run().tolist()]
        return block_checksum(views, impl=impl)


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
