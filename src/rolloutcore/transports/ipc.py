"""Driver for vLLM's CUDA IPC trainer engine (trainer and engine share one GPU).

The transport is vLLM's ``IPCTrainerWeightTransferEngine`` from
``WeightTransferTrainerFactory``; ``VllmTrainerTransport`` adds the
target-aware finish, the CUDA device check and the identity preflight. The
engine must be started with ``--weight-transfer-config '{"backend": "ipc"}'``
and, because vLLM's HTTP sync client sends the IPC handles pickled,
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (``engine_env()``): use it only on a
trusted loopback.

The trainer keeps each shared tensor alive until ``send_weights`` returns
(vLLM's engine holds the references across the finish call), so a source
must not be mutated while a send runs.
"""

from __future__ import annotations

from typing import Any

from rolloutcore.transports.driver import VllmTrainerTransport

__all__ = ["IpcTransport"]


class IpcTransport(VllmTrainerTransport):
    """Trainer side of vLLM's ``ipc`` backend, with RolloutCore's guards."""

    backend = "ipc"

    def __init__(self, *, packed: bool = False, **kwargs: Any) -> None:
        # IPC needs no rendezvous and no world size.
        kwargs.setdefault("engine_world_size", 1)
        super().__init__(**kwargs)
        self.packed = bool(packed)

    def engine_env(self) -> dict[str, str]:
        return {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}

    def init_info(self, base_url: str, engine_world_size: int) -> Any:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=self.packed, rank=0)
