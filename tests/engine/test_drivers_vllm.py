"""The NCCL/IPC drivers with vLLM's real trainer-engine classes, on a CPU machine.

No CUDA here, so no transfer can complete; what can run for real does: the
source slot passes vLLM's own metadata/iteration check, and vLLM's real
``NCCLTrainerWeightTransferEngine`` drives our target-aware client in its
order (start before any data moves), so its CUDA-less failure after start
is classified as a possible mutation. Marked ``engine``: it imports vLLM.
"""

from __future__ import annotations

from typing import Any

import pytest

from rolloutcore.engine.process import vllm_available
from rolloutcore.errors import TransferError
from rolloutcore.transports.driver import DeviceGuard, SourceSlot, TargetAwareSyncClient
from rolloutcore.transports.nccl import NcclTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

torch = pytest.importorskip("torch")
URL = "http://127.0.0.1:9"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append("init")

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update_info: Any) -> None:
        self.calls.append("update")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(f"finish:{weight_version}")


def _source() -> WeightSource:
    return WeightSource.of({"model.norm.weight": torch.ones(8, dtype=torch.bfloat16),
                            "lm_head.weight": torch.zeros(4, 8, dtype=torch.bfloat16)})


def test_source_slot_passes_vllms_own_consistency_check() -> None:
    from vllm.distributed.weight_transfer.base import WeightSource as VllmSource
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    slot = SourceSlot()
    slot.fill(_source(), torch.device("cpu"))
    vs = slot.as_vllm()
    assert isinstance(vs, VllmSource)
    meta = vs.metadata()
    assert [m.name for m in meta] == ["lm_head.weight", "model.norm.weight"]
    assert meta[0].dtype == torch.bfloat16 and meta[0].shape == (4, 8)
    pairs = list(NCCLTrainerWeightTransferEngine._checked_iter(vs, meta))
    assert [n for n, _ in pairs] == ["lm_head.weight", "model.norm.weight"]
    # Re-iterable, as vLLM's full-resync engines require.
    assert len(list(vs)) == 2


def test_real_nccl_trainer_engine_failure_after_start_is_a_possible_mutation() -> None:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

    rec = Recorder()

    def trainer_init(info: Any, *, client: TargetAwareSyncClient,
                     source: SourceSlot) -> Any:
        # vLLM's own engine class; only the NCCL endpoint (CUDA) is not opened.
        eng = NCCLTrainerWeightTransferEngine(client=client, source=source.as_vllm(),
                                              packed=False)
        eng.model_update_group = object()  # type: ignore[assignment]  # CUDA fails first
        return eng

    class CpuNccl(NcclTransport):
        def torch_device(self, index: int) -> Any:
            return torch.device("cpu")

    tr = CpuNccl(guard=DeviceGuard(get_device=lambda: 0, set_device=lambda i: None),
                       trainer_init=trainer_init, client_factory=lambda u, t: rec,
                       engine_world_size=1)
    tr.connect(URL, timeout_s=30)
    with pytest.raises(TransferError) as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=30)
    assert ei.value.mutation_started is True
    assert rec.calls[0] == "start"  # vLLM starts the round before any data moves
    assert not any(c.startswith("finish") for c in rec.calls)
    assert tr.connected_to is None
