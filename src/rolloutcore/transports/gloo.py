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

The engine half trusts nothing in a request body (anyone who can reach the
engine's HTTP port can post one):

* ``/init_weight_transfer_engine``: ``master_address`` must be an IP address
  (or ``localhost``) that is loopback or inside ``ROLLOUTCORE_GLOO_PEERS``
  (comma-separated addresses or CIDR networks, read by the engine's worker;
  empty by default: loopback only); ``timeout_s`` must not exceed
  ``ROLLOUTCORE_GLOO_MAX_TIMEOUT_S`` (default 300 s), which bounds the
  rendezvous and every later broadcast; ``world_size`` at most
  ``MAX_WORLD_SIZE``. Refused before any connection is made
  (``check_init_info``).
* ``/update_weights``: every name must be a parameter of the engine's model
  (or a shard of one of its fused parameters), sent once, not as an alias
  of a tied one; each shape must fit its target (the engine's own size,
  times its tensor-parallel degree along the sharded dimension) and each
  dtype convert to it (``check_against_model``). Refused before the
  layerwise reload opens and before a byte is received or allocated: the
  engine keeps serving its current weights.
* ``/start_weight_update``: a model whose tied weights cannot be rebuilt
  exactly after an update (``derived.plan_rederive``) is refused; at
  finish, derived copies of the weights the round wrote are rebuilt
  (``derived.rederive``: the tied ``lm_head``'s packed GEMM on the CPU
  backend).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import secrets
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from rolloutcore.core.evidence import Check, TransferEvidence
from rolloutcore.core.versions import ParameterManifest
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports import derived, rank_checksums
from rolloutcore.transports.base import (
    TransportBase,
    check_label,
    check_timeout,
    check_url,
    local_address_towards,
    preflight,
    remaining,
    run_side,
)
from rolloutcore.transports.gloo_policy import (
    MAX_TIMEOUT_ENV,
    MAX_WORLD_SIZE,
    PEERS_ENV,
    GlooInitInfo,
    ReceiverPolicy,
    check_init_info,
)
from rolloutcore.transports.gloo_rounds import Round, receive_reports
from rolloutcore.transports.model_index import ModelIndex, check_against_model
from rolloutcore.transports.rank_capture import build_capture_class
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKEND",
    "MAX_TIMEOUT_ENV",
    "MAX_WORLD_SIZE",
    "PEERS_ENV",
    "GlooInitInfo",
    "GlooTransport",
    "GlooUpdateInfo",
    "GlooWeightTransferEngine",
    "ModelIndex",
    "ReceiverPolicy",
    "check_against_model",
    "check_init_info",
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


def _trainer_store(addr: str, world: int, timeout_s: float) -> Any:
    """The rendezvous ``TCPStore`` the trainer (rank 0) owns, on a free port of ``addr``."""
    return _dist().TCPStore(addr, 0, world, True, timeout=datetime.timedelta(seconds=timeout_s),
                            wait_for_workers=False)


def _dist() -> Any:
    """``torch.distributed``, untyped: its stubs do not export the c10d classes."""
    import torch.distributed

    return torch.distributed


# ------------------------------------------------------------------ wire format


@dataclass
class GlooUpdateInfo:
    """One round's tensor metadata, in send order, as vLLM's NCCL backend spells it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    manifest_digest: str | None = field(default=None)
    #: Echoed in every rank's write report at finish (``rank_checksums``): a report
    #: of another round does not pass for this one.
    nonce: str | None = field(default=None)

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
        if self.nonce is not None and (not isinstance(self.nonce, str)
                                       or not 0 < len(self.nonce) <= 128):
            raise ValueError("nonce must be a string of 1..128 characters")
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


@dataclass
class _Subset:
    """The part of a round's metadata one pipeline stage holds (``RoundMetadata``)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    @classmethod
    def of(cls, info: GlooUpdateInfo, keep: set[str]) -> _Subset:
        rows = [(n, d, s) for n, d, s in zip(info.names, info.dtype_names, info.shapes,
                                              strict=True) if n in keep]
        return cls([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows])


def _pp_elsewhere(model: Any) -> list[str]:
    """Module prefixes of the layers another pipeline stage holds (vLLM's own
    ``get_pp_missing_layer_names``; none without pipeline parallelism)."""
    from vllm.model_executor.models.utils import get_pp_missing_layer_names

    return list(get_pp_missing_layer_names(model))


def _build_engine_class() -> type[Any]:
    import importlib

    import torch
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    from rolloutcore.transports.compat.reload import reload_api

    reload = reload_api()
    layerwise: Any = importlib.import_module(
        "vllm.model_executor.model_loader.reload.layerwise")

    def _reload_layout(module: Any) -> Mapping[str, Any] | None:
        # The model-format parameters vLLM recorded for its layerwise reload (read
        # without creating an entry: get_layerwise_info would add one).
        info = layerwise.LAYERWISE_INFO.get(module)
        return None if info is None else info.restore_metadata[0]

    capture_cls = build_capture_class()

    class GlooWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
        """vLLM worker side of ``rolloutcore_gloo``: receive over gloo, ``load_weights``.

        The layerwise reload opens only once a round's metadata has passed
        ``check_against_model``: a refused round leaves the model as it was,
        serving. At finish, derived copies of what the round wrote are rebuilt
        (``derived.rederive``).
        """

        init_info_cls = GlooInitInfo
        update_info_cls = GlooUpdateInfo

        def __init__(self, config: Any, vllm_config: Any, device: Any, model: Any) -> None:
            super().__init__(config, vllm_config, device, model)
            self._group: Any = None
            self._store: Any = None
            self._policy = ReceiverPolicy.from_env()
            self._rederive: derived.RederivePlan | None = None
            self._index: ModelIndex | None = None
            # The layerwise reload is open on the model (from the first accepted round
            # until a finish closes it, across a failed session too) and what it wrote.
            self._opened = False
            self._written: set[str] = set()
            # What each parameter received this session (checkpoint name, shard ids),
            # the round's nonce, and the checksums taken as the layers loaded.
            self._placed: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
            # The round's tensors this stage loaded and those another pipeline stage
            # holds (skipped here): reported, so the trainer sees every tensor written
            # exactly once across the stages.
            self._wrote: dict[str, None] = {}
            self._skipped: dict[str, None] = {}
            self._nonce = ""
            self._capture: Any = None
            #: The last finished round's report of this rank, kept for whoever asks the
            #: engine itself (``gloo_report``: the gateway, through ``/collective_rpc``).
            self.last_report: rank_checksums.RankReport | None = None

        def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
            """Join the trainer's group; blocks until the trainer (rank 0) joins too."""
            check_init_info(init_info, self._policy)
            pc = self.parallel_config
            rank = (pc.data_parallel_index * pc.world_size + pc.rank
                    + init_info.rank_offset)
            if rank >= init_info.world_size:
                raise ValueError(f"worker rank {rank} outside a world of "
                                 f"{init_info.world_size}")
            self.shutdown()
            td = datetime.timedelta(seconds=init_info.timeout_s)
            self._store = _dist().TCPStore(init_info.master_address, init_info.master_port,
                                   init_info.world_size, False, timeout=td)
            self._group = _new_group(self._store, rank, init_info.world_size,
                                     init_info.timeout_s, init_info.master_address)

        def start_weight_update(self) -> None:
            if self._opened:
                # A session that failed mid-round (its trainer killed mid-broadcast) left
                # vLLM's reload open: the layers it completed processed in place (the CPU
                # backend may leave a packed layer's parameter empty, outside the reload's
                # loaders), the rest buffered on meta. It is closed, every layer back in
                # its own storage, and this round opens a reload of its own (a round
                # loading into the old one failed on the emptied parameter). The failed
                # session TAINTED the engine; this round is verified as any other.
                self._close_reload()
            # Refuses, writing nothing, a model whose shared weights could not be exact.
            # (Planned before the reload moves any tensor to meta.)
            self._rederive = derived.plan_rederive(self.model)
            # A draft round (vLLM retargeted ``self.model``) must not write what the
            # draft borrows from the target (``_default_model``, vLLM's base class).
            target = getattr(self, "_default_model", None)
            self._index = ModelIndex(self.model, _reload_layout,
                                     elsewhere=_pp_elsewhere(self.model),
                                     shared_with=None if target is self.model else target)

        def _close_reload(self) -> tuple[set[str], dict[str, Any], tuple[str, ...],
                                         tuple[str, ...], Any]:
            """Close vLLM's open reload; what the session wrote, placed, loaded, skipped
            and its (closed) capture, taken from the engine half."""
            out = (self._written, self._placed, tuple(self._wrote), tuple(self._skipped),
                   self._capture)
            self._written, self._opened, self._placed = set(), False, {}
            self._wrote, self._skipped, self._capture = {}, {}, None
            try:
                reload.close(self.model, self.model_config, self.device)
            finally:
                if out[4] is not None:
                    out[4].close()
            return out

        def finish_weight_update(self) -> None:
            if not self._opened:
                return  # nothing was received: nothing was opened, nothing to rebuild
            written, placed, wrote, skipped, capture = self._close_reload()
            plan = self._rederive
            if plan is None:  # opened without a start (cannot happen through vLLM's worker)
                plan = derived.plan_rederive(self.model)
            derived.rederive(self.model, plan, written)
            if capture is not None:
                borrowed = self._index.borrowed if self._index is not None else ()
                self.last_report = capture.report(placed, written, self._worker_rank(),
                                                  self._nonce, wrote, skipped, borrowed)
            if capture is not None and self._group is not None:
                # What this rank wrote, to the trainer over the round's own group.
                report = self.last_report
                assert report is not None
                raw = rank_checksums.encode(report)
                self._group.send([torch.tensor([len(raw)], dtype=torch.int64)], 0,
                                 rank_checksums.REPORT_TAG).wait()
                self._group.send([torch.frombuffer(bytearray(raw), dtype=torch.uint8)], 0,
                                 rank_checksums.REPORT_TAG).wait()

        def _worker_rank(self) -> int:
            return int(self.parallel_config.rank)

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
            if self._index is None:
                raise RuntimeError("start_weight_update() first")
            # A pipeline stage takes the names its own layers hold; the others are
            # another stage's (received, as the broadcast needs every rank, not loaded).
            mine, other = self._index.split(update_info.names)
            written = check_against_model(_Subset.of(update_info, set(mine)), self._index)
            placed: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
            for name in mine:
                for slot in self._index.resolve(name):
                    placed.setdefault(slot.param, []).append((name, slot.parts))
            if not self._opened:
                # Checksums of each layer as loaded, before its quant method repacks it
                # (only when the trainer asked for a report: a nonce in the round).
                if update_info.nonce is not None:
                    self._capture = capture_cls(self.model)
                self.last_report = None  # a round that does not finish reports nothing
                reload.open(self.model)
                self._opened = True
            self._written |= written
            self._wrote.update(dict.fromkeys(mine))
            self._skipped.update(dict.fromkeys(other))
            for k, v in placed.items():
                self._placed.setdefault(k, []).extend(v)
            self._nonce = update_info.nonce or ""
            model: Any = self.model
            skip = set(other)
            with reload.mtp_ok():
                for name, dt, shape in zip(update_info.names, update_info.dtype_names,
                                           update_info.shapes, strict=True):
                    buf = torch.empty(shape, dtype=getattr(torch, dt))
                    self._group.broadcast(buf, 0).wait()
                    if name in skip:
                        continue
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


class _HoldsGroup(Protocol):
    """What a sender drops: its connection (``_Conn``) or its fan-out's group."""

    @property
    def group(self) -> Any: ...


def abandon(held: _HoldsGroup | None, *, abort: bool = False) -> None:
    """Keep a dropped connection's group alive (``_ABANDONED``); ``abort``: first make a
    collective pending in it raise (best effort: it is abandoned anyway). ``None``: none."""
    if held is None:
        return
    if abort:
        with contextlib.suppress(Exception):
            held.group.abort()
    _ABANDONED.append(held)


@dataclass
class _Conn:
    base_url: str
    store: Any
    group: Any
    world_size: int


class GlooSender(TransportBase):
    """What the trainer ends of ``rolloutcore_gloo`` share (``GlooTransport``, one engine;
    ``GlooFanout``, several in one group): the rendezvous and the broadcast."""

    op_timeout_s: float

    def rendezvous(self, store: Any, world: int, addr: str, f_init: list[Future[Any]],
                   deadline: float) -> Any:
        """Rank 0 of a new group over ``store``, made while the engines join it (their
        ``/init_weight_transfer_engine``: ``f_init``); its collectives then get the op
        timeout, not what was left of the connect deadline. Nothing mutates."""
        f_group = run_side(lambda: _new_group(store, 0, world,
                                              min(remaining(deadline), self.op_timeout_s),
                                              addr), "rendezvous")
        try:
            self.wait([*f_init, f_group], deadline, "init_weight_transfer_engine",
                      mutation_started=False)
        except BaseException:
            _ABANDONED.append((store, f_group))
            raise
        group = f_group.result()
        group._set_default_timeout(datetime.timedelta(seconds=self.op_timeout_s))
        return group

    def broadcast(self, group: Any, source: WeightSource) -> dict[str, torch.Tensor]:
        """Send every tensor from rank 0 of ``group``; returns them as sent (the rank
        check's reference, so that the source is not read a second time)."""
        sent: dict[str, torch.Tensor] = {}
        for name, t in source.named_tensors():
            if self._abort.is_set():
                raise TransferError("transfer", "aborted", mutation_started=True)
            cpu = _as_cpu(t)
            group.broadcast(cpu, 0).wait()
            sent[name] = cpu
        return sent


class GlooTransport(GlooSender):
    """Trainer end of ``rolloutcore_gloo``: rank 0, store owner, sender.

    ``op_timeout_s`` bounds every collective on both ends (the engine gets
    it at init): a peer that disappears mid-broadcast fails the other side
    after at most that long, even without ``abort()``. The engine refuses,
    at connect and before any mutation, a value above its own cap
    (``ROLLOUTCORE_GLOO_MAX_TIMEOUT_S``, default 300 s), and a rendezvous
    address that is neither loopback nor in its ``ROLLOUTCORE_GLOO_PEERS``
    (a trainer on another host must be listed there).
    """

    backend = BACKEND

    def __init__(self, *, op_timeout_s: float = 120.0) -> None:
        super().__init__()
        self.op_timeout_s = check_timeout(op_timeout_s, "op_timeout_s")
        self._conn: _Conn | None = None
        self._rounds: dict[str, Round] = {}  # engine URL -> its last finished round
        self.last_check: dict[str, Any] = {}

    def engine_config(self) -> dict[str, Any]:
        return {"backend": BACKEND}

    @property
    def connected_to(self) -> str | None:
        return None if self._conn is None else self._conn.base_url

    # -- connect ----------------------------------------------------------------

    def _connect(self, url: str, deadline: float) -> None:
        self._drop(notify_engine=False)
        world = 1 + self.engine_world_size(url, deadline)
        addr = local_address_towards(urlsplit(url).hostname or "127.0.0.1")
        store = _trainer_store(addr, world, remaining(deadline))
        info = GlooInitInfo(addr, int(store.port), 1, world, self.op_timeout_s)
        f_init = run_side(lambda: self.post(url, Routes.INIT_TRANSFER,
                                            {"init_info": asdict(info)}, remaining(deadline)),
                          "init")
        self._conn = _Conn(url, store, self.rendezvous(store, world, addr, [f_init], deadline),
                           world)

    # -- send -------------------------------------------------------------------

    def send(self, base_url: str, target_label: str, source: WeightSource, *,
             timeout_s: float, expected_manifest_digest: str | None = None,
             nonce: str | None = None, draft: bool = False) -> TransferEvidence:
        """One full round: start, update (tensors over gloo), finish with the label.

        Connects first when not connected to ``base_url`` (no mutation). On a
        failure after ``/start_weight_update`` the group is dropped: the next
        send reconnects. ``nonce``: the round's nonce, echoed in every rank's
        report (a gateway's, from its grant: ``declared_checksums``); default a
        fresh random one. ``draft=True``: the round goes to the engine's
        speculative-decoding draft model (``/start_draft_weight_update``); its
        finish sets no weight version (the target's round carries the label) and
        its report is kept apart (``validation_check(..., draft=True)``).
        """
        if not isinstance(draft, bool):
            raise BadInput("draft must be a bool")
        url = check_url(base_url)
        label = check_label(target_label)
        t = check_timeout(timeout_s)
        if nonce is not None and (not isinstance(nonce, str) or not 0 < len(nonce) <= 128):
            raise BadInput("nonce must be a string of 1..128 characters")
        preflight(source, expected_manifest_digest)
        t0 = time.monotonic()
        deadline = t0 + t
        self._enter()
        try:
            if self._conn is None or self._conn.base_url != url:
                self._connect(url, deadline)
            assert self._conn is not None
            return self._send(self._conn, label, source, t0, deadline,
                              nonce or secrets.token_hex(8), draft)
        finally:
            self._busy = False

    def _send(self, conn: _Conn, label: str, source: WeightSource, t0: float,
              deadline: float, nonce: str, draft: bool = False) -> TransferEvidence:
        url = conn.base_url
        key = _round_key(url, draft)
        info = dataclasses.replace(GlooUpdateInfo.of(source), nonce=nonce)
        self._rounds.pop(key, None)
        start = Routes.START_DRAFT_UPDATE if draft else Routes.START_UPDATE
        f = run_side(lambda: self.post(url, start, None, remaining(deadline)), "start")
        self.wait([f], deadline, start.lstrip("/"), mutation_started=True,
                  refusal_is_safe=True)
        # From here on the engine's model is open for reload: any failure is a mutation.
        f_http = run_side(lambda: self.post(url, Routes.UPDATE_WEIGHTS, {
            "update_info": asdict(info)}, remaining(deadline)), "update")
        f_send = run_side(lambda: self._broadcast(conn, source), "broadcast")
        try:
            self.wait([f_send, f_http], deadline, "update_weights", mutation_started=True)
        except BaseException:
            self._drop(notify_engine=False)
            raise
        sent = f_send.result()
        # At finish every engine rank sends what it wrote (rank_checksums): received
        # here while the finish runs, checked by validation_check while paused.
        f = run_side(lambda: self.post(url, Routes.FINISH_UPDATE,
                                       {"weight_version": None if draft else label},
                                       remaining(deadline)), "finish")
        f_rep = run_side(lambda: receive_reports(conn.group, range(1, conn.world_size)),
                         "reports")
        try:
            self.wait([f, f_rep], deadline, "finish_weight_update", mutation_started=True)
        except BaseException:
            self._drop(notify_engine=False)
            raise
        self._rounds[key] = Round(nonce, sent, f_rep.result(), source)
        return TransferEvidence(completed=True, mutation_started=True, backend=BACKEND,
                                tensors=len(sent), bytes=source.nbytes, finish_label=label,
                                elapsed_s=time.monotonic() - t0)

    def adopt_round(self, base_url: str, nonce: str, sent: Mapping[str, torch.Tensor],
                    reports: Sequence[tuple[int, rank_checksums.RankReport]]) -> None:
        """Take a round another sender ran to ``base_url`` (a fleet's ``GlooFanout``)
        as this transport's last round to it, so that ``validation_check`` and
        ``declared_checksums`` check what that engine's ranks wrote in it.
        ``reports``: (rank within the engine, counted from 1 as in a round of
        this transport's own, report)."""
        url = check_url(base_url)
        if not isinstance(nonce, str) or not 0 < len(nonce) <= 128:
            raise BadInput("nonce must be a string of 1..128 characters")
        if not isinstance(sent, Mapping) or not sent:
            raise BadInput("sent must be a non-empty mapping of tensor names to tensors")
        reps = list(reports)
        if sorted(r for r, _ in reps) != list(range(1, len(reps) + 1)):
            raise BadInput(f"report ranks must be 1..{len(reps)}, got "
                           f"{[r for r, _ in reps]}")
        self._rounds[_round_key(url, False)] = Round(nonce, dict(sent), reps)

    def forget_round(self, base_url: str) -> None:
        """Drop what this transport kept of its last rounds to ``base_url`` (another
        sender is about to write there: an older round must not vouch for it)."""
        for draft in (False, True):
            self._rounds.pop(_round_key(base_url, draft), None)

    def validation_check(self, base_url: str, *,
                         reference: Mapping[str, torch.Tensor] | None = None,
                         draft: bool = False) -> Check:
        """Every engine rank's checksums of what it wrote, against the trainer's
        reconstruction of the same slices (``rank_checksums``) from ``reference``:
        the full tensors the engine must hold (default: those the last round sent;
        a checkpoint read from disk checks the send path too).

        A ``Check`` at ``ENGINE_CHECKSUM`` level, coverage the smallest rank's.
        Before anything was sent to ``base_url`` (a takeover's observation) it
        is a passing check of no level: it establishes nothing. ``draft=True``:
        the last draft round's (``send(..., draft=True)``).
        """
        rnd = self._rounds.get(_round_key(base_url, draft))
        if rnd is None:
            return Check("worker_shard_checksum", True, level=None, coverage=0.0,
                         detail="nothing sent to this engine by this transport yet: "
                                "no write to check")
        t0 = time.monotonic()
        tensors = rnd.sent if reference is None else reference
        # Every tensor the round sent written exactly once across the pipeline stages
        # (at one stage: by every rank).
        result = rank_checksums.compare_ranks(rnd.reports, tensors, nonce=rnd.nonce,
                                              names=list(rnd.sent))
        result["trainer_s"] = time.monotonic() - t0
        self.last_check = result
        chk = rank_checksums.to_check(result)
        return dataclasses.replace(chk, detail=f"{chk.detail}; trainer_s="
                                   f"{result['trainer_s']:.3f}")

    def declared_checksums(self, base_url: str) -> dict[str, Any] | None:
        """What this trainer declares the last round to ``base_url`` wrote on each engine
        rank, for a gateway to compare with the ranks' own reports (scheme
        ``rank_checksums.SCHEME``): per worker, the checksum of every parameter it
        wrote, rebuilt from the tensors as broadcast (``rank_checksums.declare``).
        ``None`` before a finished round."""
        rnd = self._rounds.get(base_url)
        if rnd is None or not rnd.reports:
            return None
        manifest, content = rnd.digests()  # the checkpoint the declaration stands for
        return {"scheme": rank_checksums.SCHEME, "nonce": rnd.nonce,
                "manifest_digest": manifest, "content_digest": content,
                "ranks": rank_checksums.declare(rnd.reports, rnd.sent)}

    def _broadcast(self, conn: _Conn, source: WeightSource) -> dict[str, torch.Tensor]:
        return self.broadcast(conn.group, source)

    # -- teardown ---------------------------------------------------------------

    def abort(self) -> None:
        """From any thread: a pending send/connect raises now; the group is dropped."""
        super().abort()
        conn, self._conn = self._conn, None
        abandon(conn, abort=True)

    def _drop(self, *, notify_engine: bool) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if notify_engine:
            with contextlib.suppress(Exception):
                self.post(conn.base_url, Routes.SHUTDOWN_TRANSFER, None, 5.0)
        # A failed round may leave a collective pending in this group; keep it alive.
        abandon(conn)

    def close(self) -> None:
        """Release the group; tells the engine to release its end (best effort, 5 s)."""
        self._drop(notify_engine=not self._abort.is_set())

    def __repr__(self) -> str:
        return f"GlooTransport(connected_to={self.connected_to!r})"


def _round_key(url: str, draft: bool) -> str:
    """Where a round's reports are kept: the target's by URL, a draft's apart."""
    return f"{url}#draft" if draft else url


def _as_cpu(t: torch.Tensor) -> torch.Tensor:
    out = t.detach()
    if out.device.type != "cpu":
        out = out.to("cpu")
    return out.contiguous()
