"""RolloutCore's NCCL driver on vLLM 0.26: the trainer round that release does not ship.

vLLM 0.26.0 (the last release matching the H200 image's torch) has the
worker half of the ``nccl`` backend but registers no trainer engine in
``WeightTransferTrainerFactory``, has no ``NCCLTrainerInitInfo``, and its HTTP
sync client's finish takes no version. ``make_nccl_transport`` therefore gives
``NcclTransport`` a trainer engine that runs vLLM's own round (as 0.32's
``NCCLTrainerWeightTransferEngine`` does) on 0.26's pieces:
``nccl_common.trainer_init`` for the rendezvous and
``NCCLWeightTransferEngine.trainer_send_weights`` for the broadcast. Where the
factory has ``nccl`` (vLLM >= 0.27) the driver's default path is used.

The guards are the driver's either way (target-aware finish, CUDA device
check, identity preflight, abort): only the trainer engine differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any
from urllib.parse import urlsplit

from rolloutcore.transports.base import run_side
from rolloutcore.transports.driver import SourceSlot, _factory_trainer_init
from rolloutcore.transports.nccl import NcclTransport
from rolloutcore.transports.net import free_port, local_address_towards
from rolloutcore.transports.registry import trainer_transport

__all__ = [
    "Nccl026TrainerEngine",
    "Nccl026Transport",
    "TrainerEngineHolder",
    "broadcast_026",
    "make_nccl_transport",
    "native_nccl_trainer",
    "open_endpoint_026",
    "sync_client_026",
]

Broadcast = Callable[[Iterator[tuple[str, Any]], Any, bool], None]


class TrainerEngineHolder:
    """Keeps the trainer engine the driver builds, to reach its NCCL communicator."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.kind: str = ""

    def comm(self) -> Any:
        e = self.engine
        return None if e is None else getattr(e, "comm", getattr(e, "model_update_group", None))


def sync_client_026(url: str, timeout_s: float) -> Any:
    """vLLM's own HTTP sync client, whose finish also carries the target label.

    vLLM 0.26's ``/finish_weight_update`` ignores the body (no weight versions
    there), so the label is enforced by RolloutCore's wrapper but not recorded
    by the engine.
    """
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

    class _Client(HTTPVLLMWeightSyncClient):
        def finish_weight_update(self, weight_version: str | None = None) -> None:
            self._post("finish_weight_update",
                       None if weight_version is None else {"weight_version": weight_version})

    return _Client(url, timeout=timeout_s)


def broadcast_026(items: Iterator[tuple[str, Any]], comm: Any, packed: bool) -> None:
    """vLLM 0.26's trainer-side broadcast (packed: 1 GiB chunks, two in flight)."""
    from vllm.distributed.weight_transfer import nccl_engine  # 0.26: these two exist

    nccl_engine.NCCLWeightTransferEngine.trainer_send_weights(  # type: ignore[attr-defined]
        items, nccl_engine.NCCLTrainerSendWeightsArgs(  # type: ignore[attr-defined]
            group=comm, packed=packed))


def open_endpoint_026(worker_info: Mapping[str, Any]) -> Any:
    from vllm.distributed.weight_transfer.nccl_common import trainer_init

    return trainer_init(dict(worker_info))


class Nccl026TrainerEngine:
    """vLLM's NCCL trainer round (0.32's ``NCCLTrainerWeightTransferEngine``) on vLLM 0.26.

    ``send_weights`` does what vLLM's does: start, ``update_weights`` on a side
    thread while this thread broadcasts, then finish; a broadcast to a dead
    peer blocks here exactly as it does there. ``open_endpoint`` and
    ``broadcast`` default to vLLM 0.26's ``nccl_common.trainer_init`` and
    ``NCCLWeightTransferEngine.trainer_send_weights``.
    """

    def __init__(self, client: Any, source: Any, comm: Any, packed: bool,
                 broadcast: Broadcast = broadcast_026) -> None:
        self.client, self.source, self.comm, self.packed = client, source, comm, packed
        self._broadcast = broadcast

    @classmethod
    def trainer_init(cls, info: Mapping[str, Any], *, client: Any, source: Any,
                     open_endpoint: Callable[[Mapping[str, Any]], Any] = open_endpoint_026,
                     broadcast: Broadcast = broadcast_026) -> Nccl026TrainerEngine:
        worker = {"master_address": info["master_address"], "master_port": info["master_port"],
                  "rank_offset": 1, "world_size": info["world_size"]}
        # The workers block in init until the trainer joins: their call goes on a
        # side thread while this one opens rank 0 (vLLM's own pattern).
        fut = run_side(lambda: client.init_weight_transfer_engine(worker), "nccl026-init")
        comm = open_endpoint(worker)
        fut.result()
        return cls(client, source, comm, bool(info.get("packed", True)), broadcast)

    def update_info(self) -> dict[str, Any]:
        specs = self.source.specs()
        return {"names": [n for n, _, _ in specs],
                "dtype_names": [str(d).rsplit(".", 1)[-1] for _, d, _ in specs],
                "shapes": [list(s) for _, _, s in specs], "packed": self.packed}

    def send_weights(self) -> None:
        info = self.update_info()
        self.client.start_weight_update()
        fut = run_side(lambda: self.client.update_weights(info), "nccl026-update")
        if fut.done():
            fut.result()
        self._broadcast(iter(self.source), self.comm, self.packed)
        fut.result()
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        destroy = getattr(self.comm, "destroy", None)
        if callable(destroy):
            destroy()


class Nccl026Transport(NcclTransport):
    """``NcclTransport`` whose init info is a plain dict (0.26 has no ``NCCLTrainerInitInfo``)."""

    def init_info(self, base_url: str, engine_world_size: int) -> Any:
        host = urlsplit(base_url).hostname or "127.0.0.1"
        addr = self.master_address or local_address_towards(host)
        return {"master_address": addr, "master_port": self.master_port or free_port(addr),
                "world_size": 1 + engine_world_size, "packed": self.packed}


def native_nccl_trainer() -> bool:
    """Whether this vLLM's trainer factory has ``nccl`` (0.27 and later)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    return "nccl" in getattr(WeightTransferTrainerFactory, "_registry", {})


def make_nccl_transport(*, packed: bool = True, **kwargs: Any
                        ) -> tuple[NcclTransport, TrainerEngineHolder]:
    """RolloutCore's NCCL driver, with the trainer engine this vLLM needs (module doc)."""
    holder = TrainerEngineHolder()
    if native_nccl_trainer():
        def init(info: Any, *, client: Any, source: SourceSlot) -> Any:
            holder.engine = _factory_trainer_init(info, client=client, source=source)
            return holder.engine

        holder.kind = "vllm WeightTransferTrainerFactory nccl (native)"
        t: NcclTransport = trainer_transport("nccl", packed=packed, trainer_init=init, **kwargs)
        return t, holder

    def init026(info: Any, *, client: Any, source: Any) -> Any:
        holder.engine = Nccl026TrainerEngine.trainer_init(info, client=client, source=source)
        return holder.engine

    holder.kind = ("vLLM 0.26 shim: nccl_common.trainer_init + "
                   "NCCLWeightTransferEngine.trainer_send_weights (no trainer engine in 0.26)")
    return Nccl026Transport(packed=packed, trainer_init=init026, client_factory=sync_client_026,
                            **kwargs), holder
