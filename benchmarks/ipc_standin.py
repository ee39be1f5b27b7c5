"""A CPU stand-in of one vLLM 0.26 engine with ``rc_cuda_ipc``'s worker extension.

Shared by ``hot_path_cpu.py`` and ``gateway_path_cpu.py``: the trainer's Qwen3-8B-named
``PackedWeights`` (shapes divided by ``scale``) with two contents and their checksums,
an ``httpx.MockTransport`` that answers the routes the H200 engine listed
(``results/gpu/h200-8b-ipc.json``) and writes the workers' result row at finish,
and the trainer's ``CudaIpcTransport`` on the ``ipc`` result route with its slot in host
memory. Nothing is imported until ``build`` runs, so a benchmark can build it against
whichever ``rolloutcore`` its child process has on the path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE = "http://engine.bench:8000"
_GPU_UUID = "GPU-00000000-0000-0000-0000-000000000000"


@dataclass
class StandIn:
    pk: Any                        # the trainer's PackedWeights
    contents: dict[int, Any]       # seed -> the buffer's bytes for that policy
    values: dict[int, list[int]]   # seed -> its block checksums
    engine: dict[str, Any]         # the stand-in's state: paused, seed (what it holds), nonce
    mock: Any                      # httpx.MockTransport: the engine
    transport: Any                 # the trainer's CudaIpcTransport, adopted pk
    source: Any                    # WeightSource over pk's views
    deadlines: Any

    def identity(self, seed: int) -> Any:
        """The policy of ``seed``, declared as the harness does (a manifest per update)."""
        from rolloutcore.core.versions import ParameterManifest, WeightIdentity

        man = ParameterManifest.from_items((e.name, e.shape, e.dtype) for e in self.pk.entries)
        return WeightIdentity.declare(man, self.provenance(seed))

    @staticmethod
    def provenance(seed: int) -> Any:
        from rolloutcore.core.versions import Provenance

        return Provenance(f"synthetic-qwen3-8b-seed{seed}", "cpu-bench", seed)


def _handle(nbytes: int) -> Any:
    """A buffer's IPC handle as ``share_buffer`` would give it on a GPU (never opened)."""
    from rolloutcore.transports.cuda_ipc.wire import BufferHandle

    return BufferHandle(
        device_uuid=_GPU_UUID, handle=b"\x02c" + bytes(64), storage_size_bytes=nbytes,
        storage_offset_bytes=0, ref_counter_handle=b"/torch_1_2_0", ref_counter_offset=0,
        event_handle=bytes(64), event_sync_required=False, tensor_offset_bytes=0,
        nbytes=nbytes)


def build(scale: int, on_call: Callable[[int, float], None]) -> StandIn:
    """The stand-in; ``on_call(ns, cpu_s)`` after each engine call (its wall and CPU time)."""
    import httpx
    import torch
    from qwen3_shapes import QWEN3_8B, qwen3_specs  # type: ignore[import-not-found]

    from rolloutcore.control.runner import Deadlines
    from rolloutcore.transports.cuda_ipc import trainer as trainer_mod
    from rolloutcore.transports.cuda_ipc.trainer import CudaIpcTransport, PackedWeights
    from rolloutcore.transports.cuda_ipc.wire import (
        ROW_COUNT,
        ROW_HEADER,
        ROW_NAMES,
        ROW_NONCE,
        ROW_UNCOVERED,
        ResultSlot,
        names_digest,
        names_digest60,
    )
    from rolloutcore.transports.source import WeightSource

    # No CUDA here: the one device synchronize of send() is a no-op on the CPU.
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]

    specs = [(n, tuple(max(1, d // scale) * (2 if len(s) == 1 else 1) for d in s))
             for n, s in qwen3_specs(QWEN3_8B)]
    pk = PackedWeights(((n, s, torch.bfloat16) for n, s in specs), device="cpu")
    names = [e.name for e in pk.entries]
    g = torch.Generator().manual_seed(0)
    contents = {seed: torch.randint(0, 255, pk.buffer.shape, dtype=torch.uint8, generator=g)
                for seed in (1, 2)}
    values: dict[int, list[int]] = {}
    for seed in (1, 2):
        pk.buffer.copy_(contents[seed])
        values[seed] = pk.checksum("torch")
    n60 = names_digest60(names_digest(names))
    routes = json.loads((ROOT / "results" / "gpu" / "h200-8b-ipc.json").read_text()
                        )["engine_routes"]
    routes = sorted(set(routes) | {"/init_weight_transfer_engine", "/openapi.json"})
    eng: dict[str, Any] = {"paused": False, "seed": 1, "nonce": None}
    rows = torch.zeros(1, ROW_HEADER + len(names), dtype=torch.int64)
    ok = {"status": "ok"}

    def handler(req: httpx.Request) -> httpx.Response:
        t, tc = time.perf_counter_ns(), time.thread_time()
        p = req.url.path
        body: Any = ok
        if p == "/openapi.json":
            body = {"paths": {r: {} for r in routes}}
        elif p == "/health":
            body = {}
        elif p == "/v1/models":
            body = {"data": [{"id": "policy"}]}
        elif p == "/version":
            body = {"version": "0.26.0"}
        elif p == "/server_info":
            body = {"vllm_config": {"instance_id": "bench-1",
                                    "weight_transfer_config": {"backend": "rc_cuda_ipc"},
                                    "model_config": {"enable_sleep_mode": False}}}
        elif p == "/pause":
            eng["paused"] = True
            body = {"status": "paused"}
        elif p == "/resume":
            eng["paused"] = False
            body = {"status": "resumed"}
        elif p == "/is_paused":
            body = {"is_paused": eng["paused"]}
        elif p == "/is_sleeping":   # vLLM's is true while paused too
            body = {"is_sleeping": eng["paused"]}
        elif p == "/reset_prefix_cache":
            body = {"success": True}
        elif p == "/update_weights":
            info = json.loads(req.content)["update_info"]
            eng["nonce"] = (info.get("results") or {}).get("nonce")
        elif p == "/finish_weight_update":
            if eng["nonce"] is not None:  # the workers' row, nonce written last
                row = rows[0]
                row[ROW_HEADER:] = torch.tensor(values[eng["seed"]], dtype=torch.int64)
                row[ROW_NAMES], row[ROW_UNCOVERED] = n60, 0
                row[ROW_COUNT] = len(names)
                row[ROW_NONCE] = eng["nonce"]
        elif p == "/collective_rpc":
            m = json.loads(req.content)["method"]
            if m == "rc_cuda_ipc_hello":
                body = {"results": [{"backend": "rc_cuda_ipc", "rank": 0, "device_uuid": "",
                                     "n_params": len(names)}]}
            elif m == "rc_cuda_ipc_checksum":
                body = {"results": [{"values": values[eng["seed"]],
                                     "names_digest": names_digest(names)}]}
            else:
                body = {"results": [{}]}
        resp = httpx.Response(200, json=body)
        on_call(time.perf_counter_ns() - t, time.thread_time() - tc)
        return resp

    mock = httpx.MockTransport(handler)
    slot_handle = _handle(8 * rows.numel())

    class CpuSlotTransport(CudaIpcTransport):
        """The H200 route (``checksum_results="ipc"``) with the slot in host memory."""

        def _result_slot(self, base_url: str, n_entries: int) -> ResultSlot | None:
            self._slot = (rows, slot_handle)
            return ResultSlot(slot_handle, int.from_bytes(os.urandom(7), "little") + 1,
                              1, ROW_HEADER + n_entries)

    pk._handle = _handle(int(pk.buffer.numel()))   # created once, as share_buffer's
    tr = CpuSlotTransport(device="cpu", checksum_impl="torch", copy_impl="memcpy"
                          if "memcpy" in trainer_mod.COPY_IMPLS else "auto")
    # The engine's weight-sync client (one per engine URL) over the stand-in.
    from rolloutcore.engine.weight_sync import HttpWeightSync

    sync = HttpWeightSync(BASE, pooled=True)
    sync._client = httpx.Client(transport=mock)
    tr._syncs[BASE] = sync
    tr.adopt(pk)
    deadlines = Deadlines(pause_s=60, transfer_s=120, validate_s=60, resume_s=30, reset_s=30,
                          preflight_s=30, live_validate_s=60, drain_s=120)
    source = WeightSource.from_state_dict(dict(pk.items()),
                                          description="trainer PackedWeights views")
    return StandIn(pk, contents, values, eng, mock, tr, source, deadlines)
