"""Driver for vLLM's NCCL trainer engine (two GPUs: trainer on one, engine on another).

The transport is vLLM's ``NCCLTrainerWeightTransferEngine``, obtained from
``WeightTransferTrainerFactory``; ``VllmTrainerTransport`` adds the
target-aware finish, the CUDA device check and the identity preflight. The
engine must be started with ``--weight-transfer-config '{"backend": "nccl"}'``.

The NCCL group is trainer rank 0 plus every engine worker (``1 +
/get_world_size``), rendezvousing over a TCPStore on the trainer's host.
A broadcast to a dead peer may never return (the seed saw more than 120 s):
``abort()`` and the send deadline return control to the caller, and the
blocked side thread is abandoned with its group.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from rolloutcore.transports.driver import VllmTrainerTransport
from rolloutcore.transports.net import free_port, local_address_towards

__all__ = ["NcclTransport"]


class NcclTransport(VllmTrainerTransport):
    """Trainer side of vLLM's ``nccl`` backend, with RolloutCore's guards."""

    backend = "nccl"

    def __init__(self, *, packed: bool = True, master_address: str | None = None,
                 master_port: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.packed = bool(packed)
        self.master_address = master_address
        self.master_port = master_port

    def init_info(self, base_url: str, engine_world_size: int) -> Any:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        host = urlsplit(base_url).hostname or "127.0.0.1"
        addr = self.master_address or local_address_towards(host)
        return NCCLTrainerInitInfo(
            master_address=addr, master_port=self.master_port or free_port(addr),
            world_size=1 + engine_world_size, packed=self.packed, rank=0)
