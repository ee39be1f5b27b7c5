"""The engine half's work, free of vLLM: map the buffer, plan the slices, copy, hash.

The engine (``engine.CudaIpcWeightTransferEngine``) maps the trainer's
buffer once (``map_buffer``), computes once a name -> parameter-slice plan
(``build_plan``: fused ``qkv_proj`` / ``gate_up_proj`` slices from the
model's own ``packed_modules_mapping`` and the layers' ``output_sizes``),
and then every update is a run of large device-to-device copies with no
per-tensor ``load_weights`` processing (``SliceLoader``). Kept apart from
``engine`` so that all of it runs, and is tested, on CPU tensors without a
vLLM engine.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rolloutcore.errors import BadInput
from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels
from rolloutcore.transports.cuda_ipc.checksum import (
    CHECKSUM_IMPLS,
    block_checksum_device,
    kernel_ok,
    resolve_impl,
)
from rolloutcore.transports.cuda_ipc.wire import (
    REF_COUNTER_FILE_BYTES,
    ROW_COUNT,
    ROW_HEADER,
    ROW_NAMES,
    ROW_NONCE,
    BufferHandle,
    EntrySpec,
    UpdateMessage,
    dtype_name,
    layout_digest,
    names_digest,
    names_digest60,
)

__all__ = [
    "COPY_IMPLS",
    "FAST_EXACT",
    "SHM_DIR",
    "SliceLoader",
    "SlicePlan",
    "build_plan",
    "check_mapped_range",
    "check_ref_counter_file",
    "driver_address_range",
    "map_buffer",
]

#: Where torch's reference-counter files live (``shm_open`` names on Linux).
SHM_DIR = "/dev/shm"


def check_ref_counter_file(b: BufferHandle, shm_dir: str = SHM_DIR) -> None:
    """Refuse a reference counter torch must not decrement, before anything is opened.

    When the receiver releases a mapping (or maps an allocation it already
    holds), torch opens the named shared-memory file, maps its header and
    ``REF_COUNTER_SLOTS`` int64 and decrements slot ``ref_counter_offset``
    (a slot past the file's end would be a SIGBUS in the worker). The name and
    the slot are checked by ``BufferHandle``; here the file: it must exist in
    ``shm_dir`` as a regular file (not a link) of exactly
    ``REF_COUNTER_FILE_BYTES``, as torch makes it.
    """
    name = b.ref_counter_handle.decode("ascii").lstrip("/")
    path = os.path.join(shm_dir, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInput(f"ref_counter_handle {name!r}: cannot open it as a reference-counter "
                       f"file ({exc.strerror}; links are not followed)") from exc
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    want = REF_COUNTER_FILE_BYTES
    if not stat.S_ISREG(st.st_mode) or st.st_size != want:
        raise BadInput(f"ref_counter_handle {name!r} is not a torch reference-counter file "
                       f"(a regular file of {want} bytes; this one: {st.st_size} bytes)")


def check_mapped_range(b: BufferHandle, storage_ptr: int, storage_nbytes: int,
                       range_base: int, range_size: int) -> None:
    """Refuse a mapping whose declared numbers do not fit the allocation really opened.

    torch opens the producer's allocation at ``base`` and places the storage
    at ``base + storage_offset_bytes``, with the *declared* size: nothing
    checks that it fits. ``range_base``/``range_size`` are the driver's
    answer for ``storage_ptr - storage_offset_bytes`` (the opened base): the
    allocation must start there and hold the whole declared storage.
    """
    base = storage_ptr - b.storage_offset_bytes
    if storage_nbytes != b.storage_size_bytes:
        raise BadInput(f"the opened storage holds {storage_nbytes} bytes, the handle declares "
                       f"{b.storage_size_bytes}")
    if range_base != base:
        raise BadInput(f"the opened allocation starts at {range_base:#x}, not at the mapped "
                       f"base {base:#x}: storage_offset_bytes {b.storage_offset_bytes} is "
                       "not inside it")
    end = b.storage_offset_bytes + b.storage_size_bytes
    if end > range_size:
        raise BadInput(f"declared storage [{b.storage_offset_bytes}, {end}) exceeds the "
                       f"opened allocation of {range_size} bytes")


def driver_address_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation containing ``ptr``: cuMemGetAddressRange.

    Asked of the CUDA driver (libcuda) directly: torch does not expose it.
    Raises ``BadInput`` when the driver does not know the address (then the
    size cannot be shown, and the buffer is refused).
    """
    import ctypes

    lib = _libcuda()
    base = ctypes.c_uint64(0)
    size = ctypes.c_size_t(0)
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size),
                                     ctypes.c_uint64(ptr))
    if rc != 0:
        raise BadInput(f"cuMemGetAddressRange({ptr:#x}) failed with CUresult {rc}: the "
                       "opened allocation's size cannot be shown")
    return int(base.value), int(size.value)


_LIBCUDA: Any = None


def _libcuda() -> Any:
    global _LIBCUDA
    if _LIBCUDA is None:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1")
        lib.cuMemGetAddressRange_v2.restype = ctypes.c_int
        lib.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64),
                                                ctypes.POINTER(ctypes.c_size_t),
                                                ctypes.c_uint64]
        _LIBCUDA = lib
    return _LIBCUDA


def map_buffer(b: BufferHandle, device_index: int, *, shm_dir: str = SHM_DIR,
               address_range: Callable[[int], tuple[int, int]] | None = None
               ) -> torch.Tensor:
    """Open a peer's shared allocation as a flat ``uint8`` tensor on this device.

    The classes and dtype are ours, not the sender's; the numbers come from a
    validated ``BufferHandle``. Before anything is opened the reference
    counter torch will decrement is checked (``check_ref_counter_file``);
    after the handle is opened, and before any byte is read or written, the
    declared storage is checked against the allocation the driver really
    mapped (``check_mapped_range``). A refused mapping is released at once.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    check_ref_counter_file(b, shm_dir)
    t: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, (b.nbytes,), (1,), b.tensor_offset_bytes,
        torch.storage.TypedStorage, torch.uint8, device_index, b.handle,
        b.storage_size_bytes, b.storage_offset_bytes, False, b.ref_counter_handle,
        b.ref_counter_offset, b.event_handle, b.event_sync_required)
    st = t.untyped_storage()
    try:
        ptr = int(st.data_ptr())
        rng = (address_range or driver_address_range)(ptr - b.storage_offset_bytes)
        check_mapped_range(b, ptr, int(st.nbytes()), *rng)
    except BaseException:
        del t, st  # drop our references: torch releases the mapping (counter checked)
        raise
    return t


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
    #: targets whose layer processes its weights after loading (``FAST_EXACT``)
    inexact: tuple[str, ...] = ()


#: Quant methods whose ``process_weights_after_loading`` leaves an unquantized weight
#: as it is on a CUDA device (vLLM's only packs on its CPU backend and, opted in, on
#: XPU): there the fast path's in-place copy is exactly what a load gives. A target
#: whose layer has any other quant method (fp8, int4, MoE kernels' layouts...) keeps
#: a transformed weight the copy cannot reproduce: a fast update is refused.
FAST_EXACT = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})


def _inexact(model: torch.nn.Module, targets: Sequence[str | None]) -> tuple[str, ...]:
    out = []
    for t in dict.fromkeys(x for x in targets if x is not None):
        mod = model.get_submodule(t.rsplit(".", 1)[0]) if "." in t else model
        qm = getattr(mod, "quant_method", None)
        if qm is not None and type(qm).__name__ not in FAST_EXACT:
            out.append(f"{t} ({type(qm).__name__})")
    return tuple(out)


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

    On an engine started with ``--enable-lora`` vLLM wraps each linear layer
    and the embedding (``...WithLoRA``): the weight ``x.weight`` is then the
    parameter ``x.base_layer.weight`` (its LoRA slots are not parameters). A
    name is looked up under both, as vLLM's own reload strips ``.base_layer.``
    (``transports.model_index`` does the same for the CPU transport).
    """
    params = dict(model.named_parameters())
    # checkpoint-style name -> the parameter's own name (the LoRA wrappers' base_layer)
    alias = {n.replace(".base_layer.", "."): n for n in params if ".base_layer." in n}

    def param(name: str) -> tuple[str, torch.nn.Parameter | None]:
        real = name if name in params else alias.get(name, name)
        return real, params.get(real)

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
        real, p = param(e.name)
        if p is not None:
            if tuple(p.shape) != e.shape or p.dtype != want_dt:
                raise BadInput(f"{e.name}: sent {list(e.shape)}/{e.dtype}, parameter is "
                               f"{list(p.shape)}/{dtype_name(p.dtype)}")
            dst, target = p.data, real
            direct_n += 1
        else:
            dotted = "." + e.name
            for fused, parts in packed.items():
                for i, part in enumerate(parts):
                    tag = f".{part}."
                    if tag not in dotted:
                        continue
                    fname, fp = param(dotted.replace(tag, f".{fused}.", 1)[1:])
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
                                       f"{fname} is {list(view.shape)}/{dtype_name(fp.dtype)}")
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
    return SlicePlan(layout_digest(entries), dsts, targets,
                     {n: p.data_ptr() for n, p in params.items()}, uncovered, fused_n, direct_n,
                     tuple(e.name for e in entries), _inexact(model, targets))


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
                kernel_ok(d) and kernel_ok(x)
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
        if msg.mode == "fast" and plan.inexact:
            raise BadInput(f"{len(plan.inexact)} targets process their weights after loading, "
                           f"which an in-place copy cannot reproduce: {list(plan.inexact[:5])}; "
                           "send them in mode 'reference'")
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
                ok = cuda_kernels.available(dsts[0].device) and all(kernel_ok(d) for d in dsts)
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

    def invalidate(self) -> dict[str, Any]:
        """Drop what a sleep may have made stale; say what was dropped.

        vLLM's sleep (CuMemAllocator) gives the weights' physical memory back and
        maps new memory at the same addresses on wake: a checksum prefetched at
        the last update then describes memory that is gone (after a level-2
        sleep, memory whose contents are anything), so it is always dropped. The
        plan and the copy and checksum programs hold the parameters' addresses:
        they are dropped, and rebuilt at the next use, when a parameter moved
        (another sleep backend, a re-created model).
        """
        dropped: list[str] = []
        if self._pending is not None:
            dropped.append("prefetched checksum")
        self._pending = None
        plan = self._plan
        moved = plan is not None and self._param_ptrs() != plan.ptrs
        if moved:
            self._plan = self._plan_checked = None
            self._prog = self._csum_prog = self._row_head = None
            dropped += ["slice plan", "copy program", "checksum program"]
        out = {"dropped": dropped, "params_moved": moved}
        self.stats["invalidated"] = out
        return out

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

