"""``rolloutcore_gloo`` as a trainer engine of vLLM's own trainer-side control plane.

vLLM 0.32 ships ``WeightTransferTrainerFactory`` (trainer engines, chosen by
the init info's ``backend``, registered through its public
``register_engine``) and ``HTTPVLLMWeightSyncClient(base_url)`` (the
inference-side client: init, start, update, finish over HTTP). Its own
engines (nccl, ipc) need GPUs; this one is their CPU stand-in, so that
vLLM's control plane can be driven unmodified on the CPU: the client posts
to a base URL (a vLLM, or a RolloutCore gateway's ``/rc/<token>``), and this
engine only broadcasts the tensors over a gloo group beside the
``update_weights`` call, exactly as the NCCL engine does beside its own.

    register()      # once per process
    engine = WeightTransferTrainerFactory.trainer_init(
        trainer_init_info(world_size=1 + <the engine's /get_world_size>),
        client=HTTPVLLMWeightSyncClient(base_url), source=<vLLM WeightSource>)
    engine.send_weights()

The receiving side is the ``rolloutcore_gloo`` worker engine
(``transports.gloo``); one trainer rank (rank 0, the sender). Rounds carry no
nonce, so the engine's ranks send no write report (vLLM's client would not
read one).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from rolloutcore.core.strict import check_int
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports.base import run_side
from rolloutcore.transports.gloo import BACKEND, GlooInitInfo, _as_cpu, _new_group, _trainer_store
from rolloutcore.transports.net import local_address_towards

__all__ = ["register", "trainer_engine_class", "trainer_init_info"]

_CLS: dict[str, Any] = {}


def _build() -> dict[str, Any]:
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
    )

    @dataclass
    class GlooTrainerInitInfo(TrainerInitInfo):
        """``world_size``: the trainer's rank and every engine rank behind the URL."""

        backend: ClassVar[str] = BACKEND
        world_size: int = 2
        peer_host: str = "127.0.0.1"   # where the engines are (the store binds toward it)
        timeout_s: float = 120.0
        rank: int = field(default=0, kw_only=True)

    class GlooTrainerEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
        init_info_cls = GlooTrainerInitInfo

        def __init__(self, *, client: Any, source: Any, store: Any, group: Any,
                     timeout_s: float) -> None:
            super().__init__(client=client, source=source, is_sender=True)
            self._store, self._group, self._timeout_s = store, group, timeout_s

        @classmethod
        def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any,
                         source: Any = None) -> GlooTrainerEngine:
            if not init_info.is_sender:
                raise BadInput("rolloutcore_gloo has one trainer rank (rank 0)")
            world, t = init_info.world_size, float(init_info.timeout_s)
            check_int("world_size", world, 2)
            addr = local_address_towards(init_info.peer_host)
            store = _trainer_store(addr, world, t)
            info = GlooInitInfo(addr, int(store.port), 1, world, t)
            f_init = run_side(lambda: client.init_weight_transfer_engine(asdict(info)),
                              "init")
            group = _new_group(store, 0, world, t, addr)
            f_init.result(timeout=t)
            group._set_default_timeout(datetime.timedelta(seconds=t))
            return cls(client=client, source=source, store=store, group=group,
                       timeout_s=t)

        def send_weights(self) -> None:
            if self.source is None or self._group is None:
                raise BadInput("send_weights needs the source given at trainer_init")
            meta = list(self.source.metadata())
            update_info = {"names": [m.name for m in meta],
                           "dtype_names": [str(m.dtype).removeprefix("torch.")
                                           for m in meta],
                           "shapes": [list(m.shape) for m in meta]}
            self.client.start_weight_update()
            f_http = run_side(lambda: self.client.update_weights(update_info), "update")
            for i, (name, tensor) in enumerate(self.source):
                if i >= len(meta) or name != meta[i].name:
                    raise TransferError("transfer", f"the source yields {name!r} where its "
                                        "metadata declared another", mutation_started=True)
                self._group.broadcast(_as_cpu(tensor), 0).wait()
            f_http.result(timeout=self._timeout_s)
            self.client.finish_weight_update(None)

        def shutdown(self) -> None:
            self._group = None
            self._store = None

    return {"info": GlooTrainerInitInfo, "engine": GlooTrainerEngine}


def trainer_engine_class() -> type[Any]:
    """The ``TrainerWeightTransferEngine`` subclass (vLLM imported on first use)."""
    if not _CLS:
        _CLS.update(_build())
    cls: type[Any] = _CLS["engine"]
    return cls


def trainer_init_info(*, world_size: int, peer_host: str = "127.0.0.1",
                      timeout_s: float = 120.0) -> Any:
    """vLLM's ``TrainerInitInfo`` for ``rolloutcore_gloo`` (its ``backend`` is ours)."""
    trainer_engine_class()
    return _CLS["info"](world_size=world_size, peer_host=peer_host, timeout_s=timeout_s,
                        rank=0)


def register() -> None:
    """Register the engine with vLLM's ``WeightTransferTrainerFactory`` (once)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    cls = trainer_engine_class()
    try:
        WeightTransferTrainerFactory.register_engine(BACKEND, cls)
    except ValueError:  # registered before (this process): the same class, or refused
        if WeightTransferTrainerFactory._registry[BACKEND]() is not cls:
            raise
