"""A CPU weight-transfer backend for vLLM over ``torch.distributed`` gloo.

vLLM's built-in backends (NCCL, CUDA IPC) need a GPU. This one moves the
same checkpoint-format tensors over a ``ProcessGroupGloo`` so that the whole
update path (``/init_weight_transfer_engine`` ... ``/finish_weight_update``)
runs for real on a CPU machine, in CI. It has two halves:

* the **engine half**, ``GlooWeightTransferEngine``, a vLLM
  ``WeightTransferEngine`` registered in ``WeightTransferEngineFactory`` as
  ``rolloutcore_gloo`` by the ``vllm.general_plugins`` entry point
  (``vllm_plugin.register``). It mirrors the built-in NCCL engine: it joins
  the trainer's group at init, opens vLLM's layerwise reload at start,
  receives every tensor with ``broadcast(t, 0)`` and hands it to
  ``model.load_weights``, and closes the reload at finish. It subclasses a
  vLLM class, so it is built on first access (module ``__getattr__``): the
  trainer half imports without vLLM.
* the **trainer half**, ``GlooTransport``, a ``WeightTransport``: rank 0 of
  the group, owner of the TCPStore rendezvous.

Group layout: trainer rank 0; engine worker ``w`` at rank ``rank_offset +
dp_index * world_size_per_dp + w``, as vLLM's NCCL backend computes it.

Wire: the per-round metadata (names, dtype names, shapes) travels in the
``/update_weights`` body exactly as vLLM's NCCL backend sends it, plus the
manifest digest over them; the engine validates it all before receiving a
byte, so a malformed body is refused before the model is touched by this
round's tensors.
"""

from __future__ import annotations

import contextlib
import datetime
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.versions import ParameterManifest
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports.base import (
    TransportBase,
    check_label,
    check_timeout,
    check_url,
    local_address_towards,
    preflight,
    run_side,
)
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKEND",
    "GlooInitInfo",
    "GlooTransport",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
]

BACKEND = "rolloutcore_gloo"

# What can travel: the dtypes a checkpoint holds. Anything else in a body is refused.
_DTYPES = frozenset({
    "bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
    "uint8", "bool", "float8_e4m3fn", "float8_e5m2",
})
_MAX_TENSORS = 1_000_000
_MAX_RANK = 8


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def _new_group(store: Any, rank: int, world_size: int, timeout_s: float,
               host: str) -> Any:
    """A gloo group over ``store``; blocks until every rank has joined (or times out)."""
    pgg = _dist().ProcessGroupGloo
    opts = pgg._Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    # On loopback, bind gloo to loopback too: the default device resolves the
    # hostname, which on some machines is an address the peer cannot reach.
    opts._devices = [pgg.create_device(hostname="127.0.0.1")
                     if _is_loopback(host) else pgg.create_default_device()]
    return pgg(store, rank, world_size, opts)


def _dist() -> Any:
    """``torch.distributed``, untyped: its stubs do not export the c10d classes."""
    import torch.distributed

    return torch.distributed


# ------------------------------------------------------------------ wire format


@dataclass
class GlooInitInfo:
    """Engine-side init info: where the trainer's TCPStore is, and the group's shape."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address must be a non-empty string")
        for name in ("master_port", "rank_offset", "world_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port out of range: {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError("need 0 < rank_offset < world_size")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s <= 86400:
            raise ValueError(f"timeout_s must be in (0, 86400], got {self.timeout_s!r}")


@dataclass
class GlooUpdateInfo:
    """One round's tensor metadata, in send order, as vLLM's NCCL backend spells it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    manifest_digest: str | None = field(default=None)

    def __post_init__(self) -> None:
        """Refuse anything malformed before a single tensor is received."""
        for name in ("names", "dtype_names", "shapes"):
            if not isinstance(getattr(self, name), list):
                raise ValueError(f"{name} must be a list")
        n = len(self.names)
        if not 0 < n <= _MAX_TENSORS:
            raise ValueError(f"need 1..{_MAX_TENSORS} tensors, got {n}")
        if len(self.dtype_names) != n or len(self.shapes) != n:
            raise ValueError(f"names, dtype_names and shapes differ in length: "
                             f"{n}, {len(self.dtype_names)}, {len(self.shapes)}")
        if not all(isinstance(x, str) and x for x in self.names):
            raise ValueError("names must be non-empty strings")
        if len(set(self.names)) != n:
            raise ValueError("duplicate names")
        bad = [d for d in self.dtype_names if d not in _DTYPES]
        if bad:
            raise ValueError(f"unsupported dtype names: {sorted(set(map(str, bad)))[:5]}")
        for name, shape in zip(self.names, self.shapes, strict=True):
            if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ValueError(f"bad shape for {name}: {shape!r}")
        if self.manifest_digest is not None:
            got = self.manifest().digest
            if got != self.manifest_digest:
                raise ValueError(f"manifest digest mismatch: body says "
                                 f"{self.manifest_digest!r}, metadata hashes to {got!r}")

    def manifest(self) -> ParameterManifest:
        return ParameterManifest.from_items(
            zip(self.names, self.shapes, self.dtype_names, strict=True))

    @classmethod
    def of(cls, source: WeightSource) -> GlooUpdateInfo:
        """The metadata of ``source`` in its iteration order (manifest order)."""
        man = source.manifest()
        return cls([p.name for p in man.params], [p.dtype for p in man.params],
                   [list(p.shape) for p in man.params], man.digest)


# ------------------------------------------------------------------ engine half

_ENGINE_CLS: type[Any] | None = None
GlooWeightTransferEngine: type[Any]  # built on first access, see __getattr__


def _build_engine_class() -> type[Any]:
    import importlib

    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    reload: Any = importlib.import_module("vllm.model_executor.model_loader.reload")

    class GlooWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
        """vLLM worker side of ``rolloutcore_gloo``: receive over gloo, ``load_weights``."""

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self._group: Any = None
            self._store: Any = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            """Join the trainer's group; blocks until the trainer (rank 0) joins too."""
            self.shutdown()
            pc = self.parallel_config
            rank = (pc.data_parallel_index * pc.world_size + pc.rank
                    + init_info.rank_offset)
            if rank >= init_info.world_size:
                raise ValueError(f"worker rank {rank} outside a world of "
                                 f"{init_info.world_size}")
            td = datetime.timedelta(seconds=init_info.timeout_s)
            self._store = _dist().TCPStore(init_info.master_address, init_info.master_port,
                                   init_info.world_size, False, timeout=td)
            self._group = _new_group(self._store, rank, init_info.world_size,
                                     init_info.timeout_s, init_info.master_address)

        def start_weight_update(self) -> None:
            reload.initialize_layerwise_reload(self.model)

        def finish_weight_update(self) -> None:
            reload.finalize_layerwise_reload(self.model, self.model_config)

        def update_weights(self, update_info: dict[str, Any]) -> None:
            # The base class ends with torch.accelerator.synchronize(), which raises
            # on a machine without an accelerator.
            self.receive_weights(self.parse_update_info(update_info))
            if torch.accelerator.is_available():
                torch.accelerator.synchronize()

        def receive_weights(self, update_info: GlooUpdateInfo) -> None:
            if self._group is None:
                raise RuntimeError("rolloutcore_gloo weight transfer not initialized. "
                                   "Call init_transfer_engine() first.")
            ctx: Any = contextlib.nullcontext()
            with contextlib.suppress(ImportError):
                from vllm.model_executor.model_loader.mtp_validation import (
                    disable_mtp_completeness_check,
                )
                ctx = disable_mtp_completeness_check()
            model: Any = self.model
            with ctx:
                for name, dt, shape in zip(update_info.names, update_info.dtype_names,
                                           update_info.shapes, strict=True):
                    buf = torch.empty(shape, dtype=getattr(torch, dt))
                    self._group.broadcast(buf, 0).wait()
                    weight = buf if self.device.type == "cpu" else buf.to(self.device)
                    model.load_weights([(name, weight)])

        def shutdown(self) -> None:
            self._group = None
            self._store = None

    GlooWeightTransferEngine.__module__ = __name__
    return GlooWeightTransferEngine


def __getattr__(name: str) -> Any:
    """Build the engine half on first access (it needs vLLM; the trainer half does not)."""
    global _ENGINE_CLS
    if name == "GlooWeightTransferEngine":
        if _ENGINE_CLS is None:
            _ENGINE_CLS = _build_engine_class()
        return _ENGINE_CLS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ trainer half

# Groups dropped while a collective may still be blocked in them. Their
# destructors could wait for that collective, so they are never destroyed.
_ABANDONED: list[Any] = []


@dataclass
class _Conn:
    base_url: str
    store: Any
    group: Any
    world_size: int


class GlooTransport(TransportBase):
    """Trainer end of ``rolloutcore_gloo``: rank 0, store owner, sender.

    ``op_timeout_s`` bounds every collective on both ends (the engine gets
    it at init): a peer that disappears mid-broadcast fails the other side
    after at most that long, even without ``abort()``.
    """

    backend = BACKEND

    def __init__(self, *, op_timeout_s: float = 120.0) -> None:
        super().__init__()
        self.op_timeout_s = check_timeout(op_timeout_s, "op_timeout_s")
        self._conn: _Conn | None = None

    def engine_config(self) -> dict[str, Any]:
        return {"backend": BACKEND}

    @property
    def connected_to(self) -> str | None:
        return None if self._conn is None else self._conn.base_url

    # -- connect ----------------------------------------------------------------

    def _connect(self, url: str, deadline: float) -> None:
        self._drop(notify_engine=False)

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        f_ws = run_side(lambda: self.get(url, "/get_world_size", left()), "world-size")
        self.wait([f_ws], deadline, "get_world_size", mutation_started=False)
        ws = f_ws.result()
        engine_ws = ws.get("world_size") if isinstance(ws, Mapping) else None
        if isinstance(engine_ws, bool) or not isinstance(engine_ws, int) or engine_ws < 1:
            raise TransferError("transfer", f"engine reported world size {ws!r}",
                                mutation_started=False)
        world = 1 + engine_ws
        host = urlsplit(url).hostname or "127.0.0.1"
        addr = local_address_towards(host)
        store = _dist().TCPStore(addr, 0, world, True, timeout=datetime.timedelta(seconds=left()),
                         wait_for_workers=False)
        info = GlooInitInfo(addr, int(store.port), 1, world, self.op_timeout_s)
        f_init = run_side(lambda: self.post(url, "/init_weight_transfer_engine",
                                            {"init_info": asdict(info)}, left()), "init")
        f_group = run_side(lambda: _new_group(store, 0, world, min(left(), self.op_timeout_s),
                                              addr), "rendezvous")
        try:
            self.wait([f_init, f_group], deadline, "init_weight_transfer_engine",
                      mutation_started=False)
        except BaseException:
            _ABANDONED.append((store, f_group))
            raise
        group = f_group.result()
        # Later collectives get the op timeout, not what was left of the connect deadline.
        group._set_default_timeout(datetime.timedelta(seconds=self.op_timeout_s))
        self._conn = _Conn(url, store, group, world)

    # -- send -------------------------------------------------------------------

    def send(self, base_url: str, target_label: str, source: WeightSource, *,
             timeout_s: float, expected_manifest_digest: str | None = None
             ) -> TransferEvidence:
        """One full round: start, update (tensors over gloo), finish with the label.

        Connects first when not connected to ``base_url`` (no mutation). On a
        failure after ``/start_weight_update`` the group is dropped: the next
        send reconnects.
        """
        url = check_url(base_url)
        label = check_label(target_label)
        t = check_timeout(timeout_s)
        if not isinstance(source, WeightSource):
            raise BadInput(f"source must be a rolloutcore WeightSource, "
                           f"got {type(source).__name__}")
        preflight(source, expected_manifest_digest)
        t0 = time.monotonic()
        deadline = t0 + t
        self._enter()
        try:
            if self._conn is None or self._conn.base_url != url:
                self._connect(url, deadline)
            assert self._conn is not None
            return self._send(self._conn, label, source, t0, deadline)
        finally:
            self._busy = False

    def _send(self, conn: _Conn, label: str, source: WeightSource, t0: float,
              deadline: float) -> TransferEvidence:
        url = conn.base_url
        info = GlooUpdateInfo.of(source)

        def left() -> float:
            return max(0.1, deadline - time.monotonic())

        f = run_side(lambda: self.post(url, "/start_weight_update", None, left()), "start")
        self.wait([f], deadline, "start_weight_update", mutation_started=True,
                  refusal_is_safe=True)
        # From here on the engine's model is open for reload: any failure is a mutation.
        f_http = run_side(lambda: self.post(url, "/update_weights",
                                            {"update_info": asdict(info)}, left()), "update")
        f_send = run_side(lambda: self._broadcast(conn, source), "broadcast")
        try:
            self.wait([f_send, f_http], deadline, "update_weights", mutation_started=True)
        except BaseException:
            self._drop(notify_engine=False)
            raise
        sent = f_send.result()
        f = run_side(lambda: self.post(url, "/finish_weight_update",
                                       {"weight_version": label}, left()), "finish")
        self.wait([f], deadline, "finish_weight_update", mutation_started=True)
        return TransferEvidence(completed=True, mutation_started=True, backend=BACKEND,
                                tensors=sent, bytes=source.nbytes, finish_label=label,
                                elapsed_s=time.monotonic() - t0)

    def _broadcast(self, conn: _Conn, source: WeightSource) -> int:
        n = 0
        for _name, t in source.named_tensors():
            if self._abort.is_set():
                raise TransferError("transfer", "aborted", mutation_started=True)
            cpu = _as_cpu(t)
            conn.group.broadcast(cpu, 0).wait()
            n += 1
        return n

    # -- teardown ---------------------------------------------------------------

    def abort(self) -> None:
        """From any thread: a pending send/connect raises now; the group is dropped."""
        super().abort()
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.group.abort()
            _ABANDONED.append(conn)

    def _drop(self, *, notify_engine: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if notify_engine:
            with contextlib.suppress(Exception):
                self.post(conn.base_url, "/shutdown_weight_transfer_engine", None, 5.0)
        # A failed round may leave a collective pending in this group; keep it alive.
        _ABANDONED.append(conn)

    def close(self) -> None:
        """Release the group; tells the engine to release its end (best effort, 5 s)."""
        self._drop(notify_engine=not self._abort.is_set())

    def __repr__(self) -> str:
        return f"GlooTransport(connected_to={self.connected_to!r})"


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    out = t.detach()
    if out.device.type != "cpu":
        out = out.to("cpu")
    return out.contiguous()
