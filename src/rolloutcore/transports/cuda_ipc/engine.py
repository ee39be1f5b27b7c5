"""vLLM side of ``rc_cuda_ipc``: the weight transfer engine and its worker extension.

The ``vllm.general_plugins`` entry point (``vllm_plugin.register``) adds
the backend to vLLM's own ``WeightTransferEngineFactory`` under the name
``rc_cuda_ipc`` (``registry.ENGINE_BACKENDS``), by module path: vLLM imports
this module only in the worker that creates the engine. The server selects it with
``--weight-transfer-config '{"backend": "rc_cuda_ipc"}'``. The engine never
unpickles anything: ``parse_update_info`` hands the JSON body to
``wire.decode_update`` (validation), the buffer is mapped from the
validated numbers with classes fixed here, and the copy work is
``loader.SliceLoader``.

``CudaIpcWorkerExtension`` (``--worker-extension-cls``) gives
``/collective_rpc`` the methods that return evidence from the workers: the
checksum of the last update, per-parameter checksums, and a snapshot
compare used once to check the fast path bit-exact against vLLM's
``load_weights`` path.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# Imported only where vLLM is present (its factory, a worker, the plugin loader).
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rolloutcore.transports import derived
from rolloutcore.transports.compat.reload import reload_api
from rolloutcore.transports.cuda_ipc.checksum import CHECKSUM_IMPLS, block_checksum
from rolloutcore.transports.cuda_ipc.loader import COPY_IMPLS, SliceLoader, map_buffer
from rolloutcore.transports.cuda_ipc.wire import (
    BACKEND,
    HASH_AT_FINISH,
    PROTOCOL,
    RESULTS,
    ROW_COUNT,
    ROW_NONCE,
    BufferHandle,
    ResultSlot,
    UpdateMessage,
    decode_results,
    decode_update,
)

# An older entry point names this module's ``register``: it is the plugin's one
# registration (every RolloutCore backend, one policy), not a second one.
from rolloutcore.transports.vllm_plugin import register

__all__ = ["CudaIpcWeightTransferEngine", "CudaIpcWorkerExtension", "register"]


@dataclass
class CudaIpcInitInfo(WeightTransferInitInfo):
    protocol: str = PROTOCOL
    allow_fallback: bool = False
    copy_impl: str = "auto"
    checksum_impl: str = "auto"

    def __post_init__(self) -> None:
        if self.protocol != PROTOCOL:
            raise ValueError(f"rc_cuda_ipc speaks {PROTOCOL!r}, trainer sent {self.protocol!r}")
        if not isinstance(self.allow_fallback, bool):
            raise ValueError("allow_fallback must be a boolean")
        if self.copy_impl not in COPY_IMPLS:
            raise ValueError(f"copy_impl must be one of {COPY_IMPLS}")
        if self.checksum_impl not in CHECKSUM_IMPLS:
            raise ValueError(f"checksum_impl must be one of {CHECKSUM_IMPLS}")


@dataclass
class CudaIpcUpdateInfo(WeightTransferUpdateInfo):
    message: UpdateMessage = field(default=None)  # type: ignore[assignment]
    hash_at_finish: bool = False
    results: ResultSlot | None = None


def worker_rank() -> int:
    """This worker's rank in vLLM's world (its row in a ``ResultSlot``); 0 alone."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return 0


class CudaIpcWeightTransferEngine(
        WeightTransferEngine[CudaIpcInitInfo, CudaIpcUpdateInfo]):
    """Receives ``rc_cuda_ipc`` updates: map once, plan once, copy in place.

    ``start_weight_update`` and ``finish_weight_update`` do nothing in the
    fast mode (parameters are written in place; their storage never moves,
    so CUDA graphs stay valid). The ``reference`` mode wraps
    ``load_weights`` in vLLM's layerwise reload exactly as its built-in
    ``ipc`` engine does, started lazily at the first reference chunk.
    """

    init_info_cls = CudaIpcInitInfo
    update_info_cls = CudaIpcUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device,
                 model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.loader = SliceLoader(model)
        self._mapped: dict[tuple[bytes, int], torch.Tensor] = {}
        # Layouts validated here, by digest: later updates may name them instead of
        # listing their entries again (the trainer does so once one went through).
        self._layouts: dict[str, UpdateMessage] = {}
        self._layerwise = False
        self._hash_at_finish = False
        self._results: ResultSlot | None = None
        self._uuid: str | None = None
        # The tied weights of the model being updated, checked before its first write,
        # and whether this session wrote anything (then they are rebuilt at finish).
        self._tied: tuple[torch.nn.Module, derived.RederivePlan] | None = None
        self._received = False

    @property
    def device_uuid(self) -> str | None:
        """This worker's GPU UUID (None off CUDA: nothing can be mapped there)."""
        if self._uuid is None and self.device.type == "cuda":
            self._uuid = str(torch.cuda.get_device_properties(self.device).uuid)
        return self._uuid

    def parse_init_info(self, init_dict: dict[str, Any]) -> CudaIpcInitInfo:
        if not isinstance(init_dict, dict):
            raise ValueError("init_info must be an object")
        try:
            return CudaIpcInitInfo(**init_dict)
        except TypeError as exc:
            raise ValueError(f"bad init_info for {BACKEND}: {exc}") from exc

    def parse_update_info(self, update_dict: dict[str, Any]) -> CudaIpcUpdateInfo:
        try:
            msg = decode_update(update_dict, self._layouts)
        except ValueError as exc:  # BadInput is a ValueError
            raise ValueError(f"rejected {BACKEND} update_info: {exc}") from exc
        if msg.layout_digest not in self._layouts and len(self._layouts) >= 4:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[msg.layout_digest] = msg
        try:
            results = decode_results(update_dict)
        except ValueError as exc:
            raise ValueError(f"rejected {BACKEND} update_info.{RESULTS}: {exc}") from exc
        if results is not None and worker_rank() >= results.rows:
            raise ValueError(f"rejected {BACKEND} update_info.{RESULTS}: {results.rows} rows "
                             f"for worker rank {worker_rank()}")
        return CudaIpcUpdateInfo(message=msg,
                                 hash_at_finish=update_dict.get(HASH_AT_FINISH) is True,
                                 results=results)

    def init_transfer_engine(self, init_info: CudaIpcInitInfo) -> None:
        self.loader.allow_fallback = init_info.allow_fallback
        self.loader.copy_impl = init_info.copy_impl
        self.loader.checksum_impl = init_info.checksum_impl

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        super().set_weight_update_target(model, model_config)
        if self.loader.model is not model:
            self.loader = SliceLoader(model, allow_fallback=self.loader.allow_fallback,
                                      copy_impl=self.loader.copy_impl)

    def reset_weight_update_target(self) -> None:
        super().reset_weight_update_target()
        if self.loader.model is not self.model:
            self.loader = SliceLoader(self.model, allow_fallback=self.loader.allow_fallback,
                                      copy_impl=self.loader.copy_impl)

    def start_weight_update(self) -> None:
        self._layerwise = False
        self._received = False

    def _tied_plan(self) -> derived.RederivePlan:
        """``derived.plan_rederive`` of the target model (raises before anything is
        mapped or written when a shared weight could not be exact), once per model."""
        if self._tied is None or self._tied[0] is not self.model:
            self._tied = (self.model, derived.plan_rederive(self.model))
        return self._tied[1]

    def _map(self, b: BufferHandle) -> torch.Tensor:
        if b.device_uuid != self.device_uuid:
            raise ValueError(f"buffer lives on GPU {b.device_uuid}, this worker is on "
                             f"{self.device_uuid}")
        t = self._mapped.get(b.key)
        if t is None or t.numel() != b.nbytes:
            t = map_buffer(b, int(self.device.index or 0))
            if len(self._mapped) >= 8:
                self._mapped.clear()
            self._mapped[b.key] = t
        return t

    def receive_weights(self, update_info: CudaIpcUpdateInfo) -> None:
        msg = update_info.message
        self._hash_at_finish = update_info.hash_at_finish
        self._results = update_info.results
        for k in ("prefetched", "prefetch_error", "published", "publish_s"):
            self.loader.stats.pop(k, None)  # per update: set again at finish
        self._tied_plan()
        t0 = time.monotonic()
        bufs = [self._map(b) for b in msg.buffers]
        map_s = time.monotonic() - t0
        if msg.mode == "reference" and not self._layerwise:
            reload_api().open(self.model)
            self._layerwise = True
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        self._received = True
        self.loader.load(bufs, msg)
        end.record()
        end.synchronize()
        # Base update_weights synchronizes the device after us; the event pair is
        # the GPU time of the copies alone.
        self.loader.stats.update(map_s=map_s, copy_gpu_s=start.elapsed_time(end) / 1e3,
                                 receive_s=time.monotonic() - t0)

    def finish_weight_update(self) -> None:
        received, self._received = self._received, False
        if self._layerwise:
            reload_api().close(self.model, self.model_config, self.device)
            self._layerwise = False
            derived.rederive(self.model, self._tied_plan())
            return
        if received:
            # On a CUDA device the rebuild is a no-op for unquantized layers; it also
            # checks that the tied weights still share one storage.
            derived.rederive(self.model, self._tied_plan())
        # The session is over and the engine still paused: when the sender asked
        # (it validates by checksum), hash what the update wrote now, so the
        # paused validation only collects the values. A failure here only means
        # the validation hashes itself.
        # With a result slot, the values also go into the trainer's buffer (its
        # validation then reads its own memory); the nonce is written last.
        slot, self._results = self._results, None
        at_finish, self._hash_at_finish = self._hash_at_finish, False
        if slot is not None:
            t = time.monotonic()
            row = None
            try:
                row = self._map(slot.buffer).view(torch.int64).view(
                    slot.rows, slot.row_len)[worker_rank()]
                self.loader.stats["published"] = self.loader.publish_checksum(row, slot.nonce)
                self.loader.stats["prefetched"] = self.loader.stats["published"]
            except Exception as exc:  # recorded; the trainer asks instead (count -1)
                self.loader.stats["prefetch_error"] = f"{type(exc).__name__}: {exc}"
                if row is not None:
                    with contextlib.suppress(Exception):
                        row[ROW_COUNT].fill_(-1)
                        row[ROW_NONCE].fill_(slot.nonce)
            self.loader.stats["publish_s"] = time.monotonic() - t
            return
        if not at_finish:
            return
        try:
            self.loader.stats["prefetched"] = self.loader.prefetch_checksum()
        except Exception as exc:  # recorded; the validation recomputes
            self.loader.stats["prefetch_error"] = f"{type(exc).__name__}: {exc}"

    def shutdown(self) -> None:
        self._mapped.clear()

    @staticmethod
    def trainer_send_weights(iterator: object, trainer_args: object) -> None:
        raise NotImplementedError("the trainer side is rolloutcore.transports.cuda_ipc."
                                  "CudaIpcTransport")


class CudaIpcWorkerExtension:
    """Worker methods for ``/collective_rpc`` (names prefixed to avoid clashes).

    Mixed into vLLM's worker class by ``--worker-extension-cls``; ``self``
    is the worker, whose ``weight_transfer_engine`` is ours.
    """

    def _rc_engine(self) -> CudaIpcWeightTransferEngine:
        eng = getattr(self, "weight_transfer_engine", None)
        if not isinstance(eng, CudaIpcWeightTransferEngine):
            raise RuntimeError(f"weight transfer backend is not {BACKEND}: {type(eng).__name__}")
        return eng

    def _rc_model(self) -> torch.nn.Module:
        """The model the worker's updates write: its weight-transfer engine's target
        under any backend (vLLM's own ``ipc`` too), else the worker's own model. The
        parameter checks below need nothing of ``rc_cuda_ipc``."""
        model = getattr(getattr(self, "weight_transfer_engine", None), "model", None)
        if model is None:
            model = self.get_model()  # type: ignore[attr-defined]
        if not isinstance(model, torch.nn.Module):
            raise RuntimeError(f"the worker's model is a {type(model).__name__}, not a "
                               "torch.nn.Module")
        return model

    def rc_cuda_ipc_hello(self) -> dict[str, Any]:
        eng = getattr(self, "weight_transfer_engine", None)
        if not isinstance(eng, CudaIpcWeightTransferEngine):
            return {"backend": type(eng).__name__, "protocol": None, "device_uuid": None}
        return {"backend": BACKEND, "protocol": PROTOCOL, "device_uuid": eng.device_uuid,
                "device": str(eng.device), "torch": str(torch.__version__),
                "rank": worker_rank(),
                "n_params": sum(1 for _ in eng.model.named_parameters())}

    def rc_cuda_ipc_after_wake(self) -> dict[str, Any]:
        """After a wake of the weights: drop what the sleep made stale (``SliceLoader``)."""
        return self._rc_engine().loader.invalidate()

    def rc_cuda_ipc_memory(self) -> dict[str, Any]:
        """The device memory as this worker sees it, and vLLM's sleep-mode pools by tag.

        ``used_bytes`` is the device's (every process on the GPU: the trainer's
        too); the ``cumem_*`` counts are vLLM's own pools (weights, KV cache)
        mapped or asleep, where its CuMemAllocator exists.
        """
        eng = self._rc_engine()
        free, total = torch.cuda.mem_get_info(eng.device)
        out: dict[str, Any] = {"free_bytes": int(free), "total_bytes": int(total),
                               "used_bytes": int(total - free),
                               "torch_reserved_bytes": int(torch.cuda.memory_reserved(
                                   eng.device))}
        try:
            from vllm.device_allocator.cumem import CuMemAllocator

            inst = CuMemAllocator.instance
        except Exception:  # no sleep-mode allocator in this build
            inst = None
        if inst is not None:
            for data in list(inst.pointer_to_data.values()):
                asleep = getattr(data, "is_asleep", None)
                where = "unknown" if asleep is None else ("asleep" if asleep else "mapped")
                key = f"cumem_{data.tag}_{where}_bytes"
                out[key] = out.get(key, 0) + int(data.handle[1])
        return out

    def rc_cuda_ipc_checksum(self, impl: str = "auto") -> dict[str, Any]:
        if impl not in CHECKSUM_IMPLS:
            raise ValueError(f"impl must be one of {CHECKSUM_IMPLS}")
        return self._rc_engine().loader.checksum(impl)

    def rc_cuda_ipc_stats(self) -> dict[str, Any]:
        return dict(self._rc_engine().loader.stats)

    def rc_cuda_ipc_copy_probe(self) -> dict[str, Any]:
        """Where the update's copy time goes: the IPC-mapped source or the parameters.

        Times (GPU events, median of 3) one flat copy of the last update's
        mapped buffer into a fresh local buffer, the same local-to-local, a
        read-only pass over each, and the planned slice copies from a local
        copy of the source and from the mapped one. The parameters end with
        the bytes they had (the last update's source). Diagnostic: it
        allocates twice the buffer on this GPU, freed before returning.
        """
        eng = self._rc_engine()
        loader = eng.loader
        msg = loader.last
        if msg is None or len(msg.buffers) != 1:
            raise RuntimeError("copy probe needs one earlier single-buffer update")
        src = eng._map(msg.buffers[0])
        plan = loader.plan(msg)

        def timed(fn: Callable[[], object]) -> float:
            ts = []
            for _ in range(3):
                a = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                b = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b) / 1e3)
            return float(sorted(ts)[1])

        def measure() -> dict[str, Any]:
            local = torch.empty_like(src)
            local2 = torch.empty_like(src)
            out: dict[str, Any] = {"bytes": int(src.numel())}
            out["ipc_to_local_flat_s"] = timed(lambda: local.copy_(src))
            out["local_to_local_flat_s"] = timed(lambda: local2.copy_(local))
            out["ipc_read_s"] = timed(lambda: src.view(torch.int32).sum(dtype=torch.int32))
            out["local_read_s"] = timed(lambda: local.view(torch.int32).sum(dtype=torch.int32))
            pairs = [(d, i) for i, d in enumerate(plan.dsts) if d is not None]
            s_ipc = loader.sources([src], msg)
            s_loc = loader.sources([local], msg)

            def copies(srcs: list[torch.Tensor]) -> None:
                for d, i in pairs:
                    d.copy_(srcs[i], non_blocking=True)

            out["local_to_params_s"] = timed(lambda: copies(s_loc))
            out["ipc_to_params_s"] = timed(lambda: copies(s_ipc))
            return out

        with torch.no_grad():
            res = measure()
        torch.cuda.empty_cache()
        return res

    def rc_cuda_ipc_param_checksums(self) -> dict[str, Any]:
        named = list(self._rc_model().named_parameters())
        t = time.monotonic()
        vals = block_checksum([p.data for _, p in named])
        return {"names": [n for n, _ in named], "values": vals,
                "elapsed_s": time.monotonic() - t}

    def rc_cuda_ipc_snapshot(self, action: str) -> dict[str, Any]:
        """``take``: clone every parameter; ``compare``: bitwise against it; ``drop``."""
        model = self._rc_model()
        store: dict[str, torch.Tensor] = getattr(self, "_rc_snapshot", {})
        if action == "take":
            store = {n: p.data.detach().clone() for n, p in model.named_parameters()}
            self._rc_snapshot = store
            return {"taken": len(store), "bytes": sum(t.numel() * t.element_size()
                                                      for t in store.values())}
        if action == "compare":
            mism = []
            n = 0
            for name, p in model.named_parameters():
                ref = store.get(name)
                n += 1
                if ref is None or ref.shape != p.shape or not torch.equal(
                        ref.view(torch.uint8), p.data.view(torch.uint8)):
                    mism.append(name)
            return {"compared": n, "snapshot": len(store), "mismatched": mism[:20],
                    "n_mismatched": len(mism)}
        if action == "drop":
            self._rc_snapshot = {}
            torch.cuda.empty_cache()
            return {"dropped": True}
        raise ValueError(f"unknown snapshot action {action!r}")
