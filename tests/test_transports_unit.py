"""Transport logic that needs neither CUDA nor vLLM (fast lane).

The NCCL/IPC drivers wrap vLLM trainer engines that cannot run here. Their
own logic is tested with a trainer engine that follows vLLM's documented
client protocol (``send_weights``: start, update, finish with no version),
injected in place of ``WeightTransferTrainerFactory.trainer_init``, and a
sync client that records calls in place of vLLM's HTTP client. The real
vLLM engine classes are exercised in tests/engine/ (CPU) and on the GPU.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from rolloutcore.engine.errors import is_refusal, status_error, transport_error
from rolloutcore.errors import BadInput, EffectError, EffectTimeout, TransferError
from rolloutcore.transports.base import (
    TransportBase,
    check_label,
    check_targets,
    check_url,
    local_address_towards,
    preflight,
    run_side,
)
from rolloutcore.transports.driver import DeviceGuard, TargetAwareSyncClient
from rolloutcore.transports.gloo import GlooInitInfo, GlooTransport, GlooUpdateInfo
from rolloutcore.transports.ipc import IpcTransport
from rolloutcore.transports.nccl import NcclTransport
from rolloutcore.transports.source import WeightSource

torch = pytest.importorskip("torch")

URL = "http://127.0.0.1:9"  # discard port: nothing listens there


def answered(path: str, status: int, body: str) -> EffectError:
    """What the one HTTP translation point makes of ``status`` on ``POST path``."""
    err = status_error(path.lstrip("/"), f"POST {path}", status, body)
    assert err is not None
    return err


def unreachable(path: str) -> EffectError:
    import httpx

    return transport_error(httpx.ConnectError("refused"), path.lstrip("/"), f"POST {path}",
                           timeout_s=5)


def _source() -> WeightSource:
    return WeightSource.of({"a.weight": torch.ones(2, 3, dtype=torch.bfloat16),
                            "b.bias": torch.zeros(3)})


class RecordingClient:
    """Stands in for vLLM's HTTP sync client; records calls, can refuse or fail."""

    def __init__(self, start_error: BaseException | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.start_error = start_error

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.calls.append(("init", init_info))

    def start_weight_update(self) -> None:
        self.calls.append(("start", None))
        if self.start_error is not None:
            raise self.start_error

    def update_weights(self, update_info: Any) -> None:
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self.calls.append(("shutdown", None))


class ProtocolEngine:
    """A trainer engine doing what vLLM's do in ``send_weights``.

    ``block`` = "before_start" / "in_update" makes it hang there (a stuck
    collective, ``stuck`` set) until ``release`` is set; ``finish=False`` skips finishing.
    """

    def __init__(self, client: Any, source: Any, block: str = "", finish: bool = True) -> None:
        self.client = client
        self.source = source
        self.block = block
        self.finish = finish
        self.release = threading.Event()
        self.stuck = threading.Event()
        self.sent: list[tuple[str, Any]] = []
        self.shutdowns = 0

    def send_weights(self) -> None:
        if self.block == "before_start":
            self.stuck.set()
            self.release.wait(30)
            self._check_aborted()
        specs = self.source.specs()
        self.client.start_weight_update()
        self.client.update_weights({"names": [n for n, _, _ in specs]})
        if self.block == "in_update":
            self.stuck.set()
            self.release.wait(30)
            self._check_aborted()
        self.sent = list(self.source)
        if self.finish:
            self.client.finish_weight_update()  # no version: vLLM's engines pass none

    def _check_aborted(self) -> None:
        if self.shutdowns:
            raise RuntimeError("collective on an aborted communicator")

    def shutdown(self) -> None:
        # Destroying the communicator is what frees a collective stuck on a dead
        # peer; the collective then fails.
        self.shutdowns += 1
        self.release.set()


def _driver(cls: type[Any] = NcclTransport, *, block: str = "", finish: bool = True,
            client: RecordingClient | None = None, device: list[int] | None = None
            ) -> tuple[Any, RecordingClient, list[ProtocolEngine]]:
    rec = client or RecordingClient()
    dev = device if device is not None else [0]
    engines: list[ProtocolEngine] = []

    def trainer_init(info: Any, *, client: Any, source: Any) -> ProtocolEngine:
        client.init_weight_transfer_engine({"info": info})
        eng = ProtocolEngine(client, source, block, finish)
        engines.append(eng)
        return eng

    guard = DeviceGuard(get_device=lambda: dev[0], set_device=lambda i: None)
    tr = cls(guard=guard, trainer_init=trainer_init, client_factory=lambda u, t: rec,
             engine_world_size=1)
    tr.init_info = lambda url, ws: {"url": url, "ws": ws}  # vLLM's init info needs vLLM
    tr.torch_device = lambda i: torch.device("cpu")
    return tr, rec, engines


# ------------------------------------------------------------------ target-aware finish


def test_finish_carries_the_pending_target_label() -> None:
    rec = RecordingClient()
    c = TargetAwareSyncClient(rec)
    c.set_target("rc-3")
    c.start_weight_update()
    c.finish_weight_update()  # as vLLM's trainer engines call it: no version
    assert rec.calls == [("start", None), ("finish", "rc-3")]
    assert c.finished_label == "rc-3"


def test_finish_without_target_is_refused_and_sends_nothing() -> None:
    rec = RecordingClient()
    c = TargetAwareSyncClient(rec)
    with pytest.raises(TransferError, match="no target"):
        c.finish_weight_update()
    with pytest.raises(TransferError, match="no target") as ei:
        c.start_weight_update()
    assert ei.value.mutation_started is False
    assert rec.calls == []
    c.set_target("rc-1")
    c.clear_target()
    with pytest.raises(TransferError, match="no target"):
        c.finish_weight_update()
    assert rec.calls == []


def test_finish_with_a_different_label_is_refused() -> None:
    rec = RecordingClient()
    c = TargetAwareSyncClient(rec)
    c.set_target("rc-2")
    with pytest.raises(TransferError, match="rc-9"):
        c.finish_weight_update(weight_version="rc-9")
    c.finish_weight_update(weight_version="rc-2")
    assert rec.calls == [("finish", "rc-2")]


@pytest.mark.parametrize(("error", "state", "possible"), [
    (answered("/start_weight_update", 409, "busy"), "refused", False),
    (unreachable("/start_weight_update"), "refused", False),
    (answered("/start_weight_update", 500, "boom"), "sent", True),
    (EffectTimeout("start_weight_update", 5), "sent", True),
    (TimeoutError("read timed out"), "sent", True),
])
def test_start_outcome_classifies_mutation(error: BaseException, state: str,
                                           possible: bool) -> None:
    c = TargetAwareSyncClient(RecordingClient(start_error=error))
    c.set_target("rc-1")
    with pytest.raises(type(error)):
        c.start_weight_update()
    assert c.start_state == state and c.mutation_possible is possible


def test_sync_client_needs_the_four_methods() -> None:
    with pytest.raises(BadInput, match="lacks"):
        TargetAwareSyncClient(object())
    with pytest.raises(BadInput):
        TargetAwareSyncClient(RecordingClient()).set_target("bad label")


# ------------------------------------------------------------------ device guard


def test_device_guard_refuses_another_threads_device() -> None:
    current = {"dev": 0}
    entered: list[int] = []
    g = DeviceGuard(get_device=lambda: current["dev"], set_device=entered.append)
    with pytest.raises(TransferError, match="connect"):
        g.check()
    assert g.bind() == 0
    assert g.check() == 0
    current["dev"] = 1
    with pytest.raises(TransferError, match=r"set_device\(0\)") as ei:
        g.check()
    assert ei.value.mutation_started is False
    g.enter(0)
    assert entered == [0]


# ------------------------------------------------------------------ the NCCL/IPC drivers


@pytest.mark.parametrize("cls", [NcclTransport, IpcTransport])
def test_driver_round_finishes_with_the_target_label(cls: type[Any]) -> None:
    tr, rec, engines = _driver(cls)
    tr.connect(URL, timeout_s=5)
    src = _source()
    ev = tr.send(URL, "rc-7", src, timeout_s=5,
                 expected_manifest_digest=src.manifest().digest)
    assert ev.completed and ev.finish_label == "rc-7" and ev.backend == cls.backend
    assert ev.tensors == 2 and ev.bytes == src.nbytes
    assert [c[0] for c in rec.calls] == ["init", "start", "update", "finish"]
    assert rec.calls[-1] == ("finish", "rc-7")
    assert [n for n, _ in engines[0].sent] == ["a.weight", "b.bias"]
    assert tr.engine_config() == {"backend": cls.backend}
    tr.close()
    assert engines[0].shutdowns == 1 and ("shutdown", None) in rec.calls


def test_ipc_engine_needs_insecure_serialization_for_http() -> None:
    assert IpcTransport().engine_env() == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def test_driver_preflight_refuses_before_any_engine_call() -> None:
    tr, rec, engines = _driver()
    tr.connect(URL, timeout_s=5)
    n = len(rec.calls)
    with pytest.raises(TransferError, match="preflight") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=5, expected_manifest_digest="0" * 64)
    assert ei.value.mutation_started is False
    assert len(rec.calls) == n and engines[0].sent == []


def test_driver_refuses_a_thread_on_another_device() -> None:
    dev = [0]
    tr, rec, engines = _driver(device=dev)
    tr.connect(URL, timeout_s=5)
    n = len(rec.calls)
    dev[0] = 1
    with pytest.raises(TransferError, match="CUDA device is 1") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=5)
    assert ei.value.mutation_started is False and len(rec.calls) == n
    dev[0] = 0
    assert tr.send(URL, "rc-1", _source(), timeout_s=5).finish_label == "rc-1"


def test_driver_refuses_when_not_connected_or_on_bad_input() -> None:
    tr, rec, _ = _driver()
    with pytest.raises(TransferError, match="connect") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=5)
    assert ei.value.mutation_started is False
    tr.connect(URL, timeout_s=5)
    with pytest.raises(BadInput):
        tr.send(URL, "rc-1", {"w": torch.zeros(1)}, timeout_s=5)
    with pytest.raises(BadInput):
        tr.send(URL, "", _source(), timeout_s=5)
    with pytest.raises(BadInput):
        tr.send(URL, "rc-1", _source(), timeout_s=-1)
    with pytest.raises(BadInput):
        tr.send("ftp://x", "rc-1", _source(), timeout_s=5)
    with pytest.raises(TransferError, match="not connected"):
        tr.send("http://127.0.0.1:10", "rc-1", _source(), timeout_s=5)


def test_driver_round_that_never_finishes_is_a_mutation_failure() -> None:
    tr, _, _ = _driver(finish=False)
    tr.connect(URL, timeout_s=5)
    with pytest.raises(TransferError, match="without finishing") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=5)
    assert ei.value.mutation_started is True


@pytest.mark.parametrize(("block", "mutation"), [("in_update", True), ("before_start", False)])
def test_abort_from_another_thread_unblocks_a_stuck_round(block: str, mutation: bool) -> None:
    tr, _, engines = _driver(block=block)
    tr.connect(URL, timeout_s=5)

    def abort_once_stuck() -> None:
        deadline = time.monotonic() + 10
        while not (engines and engines[0].stuck.is_set()) and time.monotonic() < deadline:
            time.sleep(0.005)
        tr.abort()

    aborter = threading.Thread(target=abort_once_stuck, daemon=True)
    aborter.start()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="aborted") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=60)
    assert time.monotonic() - t0 < 2.0
    aborter.join(10)
    assert ei.value.mutation_started is mutation
    assert tr.connected_to is None  # the engine (maybe stuck) was dropped
    assert engines[0].shutdowns == 1  # ...and its communicator torn down
    assert engines[0].release.is_set()


def test_deadline_unblocks_a_stuck_round() -> None:
    tr, _, engines = _driver(block="in_update")
    tr.connect(URL, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="deadline") as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 2.0
    assert ei.value.mutation_started is True
    engines[0].release.set()


def test_refused_start_is_not_a_mutation() -> None:
    rec = RecordingClient(start_error=answered("/start_weight_update", 400, "no"))
    tr, _, _ = _driver(client=rec)
    tr.connect(URL, timeout_s=5)
    with pytest.raises(TransferError) as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=5)
    assert ei.value.mutation_started is False
    assert tr.connected_to == URL  # nothing pending: the connection is kept


# ------------------------------------------------------------------ gloo wire format


def _info(**kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"],
                            "shapes": [[2, 3], [3]]}
    base.update(kw)
    return base


def test_gloo_update_info_round_trips_a_source() -> None:
    src = _source()
    info = GlooUpdateInfo.of(src)
    assert info.names == ["a.weight", "b.bias"]
    assert info.dtype_names == ["bfloat16", "float32"]
    assert info.manifest().digest == src.manifest().digest == info.manifest_digest
    GlooUpdateInfo(**_info())  # valid


@pytest.mark.parametrize("bad", [
    _info(names=[]), _info(names=["a"]), _info(names=["a", "a"]), _info(names=["a", ""]),
    _info(dtype_names=["bfloat16", "complex64"]), _info(shapes=[[2, -1], [3]]),
    _info(shapes=[[2, 3], "3"]), _info(shapes=[[2, True], [3]]), _info(names="ab"),
    _info(manifest_digest="0" * 64),
])
def test_gloo_update_info_refuses_malformed_metadata(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        GlooUpdateInfo(**bad)


@pytest.mark.parametrize("bad", [
    {"master_port": 0}, {"rank_offset": 0}, {"world_size": 1}, {"timeout_s": 0},
    {"master_address": ""},
])
def test_gloo_init_info_refuses_bad_values(bad: dict[str, Any]) -> None:
    good: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": 1234,
                            "rank_offset": 1, "world_size": 2}
    GlooInitInfo(**good)
    with pytest.raises(ValueError):
        GlooInitInfo(**{**good, **bad})


def test_gloo_send_refusals_change_nothing() -> None:
    tr = GlooTransport()
    src = _source()
    with pytest.raises(TransferError, match="preflight") as ei:
        tr.send(URL, "rc-1", src, timeout_s=5, expected_manifest_digest="1" * 64)
    assert ei.value.mutation_started is False
    with pytest.raises(BadInput):
        tr.send(URL, "rc-1", {"w": torch.zeros(1)}, timeout_s=5)  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        GlooTransport(op_timeout_s=0)
    assert tr.engine_config() == {"backend": "rolloutcore_gloo"}


def test_gloo_send_to_nothing_fails_fast_without_mutation() -> None:
    tr = GlooTransport()
    t0 = time.monotonic()
    with pytest.raises(TransferError) as ei:
        tr.send(URL, "rc-1", _source(), timeout_s=10)
    assert ei.value.mutation_started is False
    assert time.monotonic() - t0 < 5


# ------------------------------------------------------------------ shared pieces


def test_preflight_and_checks() -> None:
    src = _source()
    preflight(src, None)
    preflight(src, src.manifest().digest)
    with pytest.raises(TransferError):
        preflight(src, "a" * 64)
    assert check_label("rc-1") == "rc-1"
    for bad in ("", "a b", 3, "x" * 200):
        with pytest.raises(BadInput):
            check_label(bad)
    assert check_url("http://h:1/") == "http://h:1"
    with pytest.raises(BadInput):
        check_url("localhost:8000")
    assert local_address_towards("127.0.0.1") == "127.0.0.1"
    assert local_address_towards("localhost") == "127.0.0.1"


def test_fanout_targets_are_checked_in_one_place() -> None:
    """Both fan-outs (gloo's, CUDA IPC's) read ``(url, label)`` targets through
    ``check_targets``: url -> label in order, anything else refused before a send."""
    assert check_targets([("http://a:1/", "v1"), ("http://b:2", "v1")]) == {
        "http://a:1": "v1", "http://b:2": "v1"}
    for bad, msg in (([], "non-empty"), ("http://a:1", "non-empty"),
                     ([("http://a:1",)], "each target"), ([["http://a:1", "v1"]], "each target"),
                     ([("a:1", "v1")], "http"), ([("http://a:1", "a b")], "label"),
                     ([("http://a:1", "v1"), ("http://a:1/", "v2")], "targeted twice")):
        with pytest.raises(BadInput, match=msg):
            check_targets(bad)


def test_only_a_4xx_or_no_connection_is_a_refusal() -> None:
    assert is_refusal(answered("/x", 404, "")) and is_refusal(answered("/x", 409, ""))
    assert not is_refusal(answered("/x", 500, ""))
    assert is_refusal(unreachable("/x"))
    assert not is_refusal(EffectTimeout("x", 1.0))  # the request may have arrived


def test_run_side_delivers_results_and_errors() -> None:
    assert run_side(lambda: 5, "t").result(timeout=5) == 5

    def boom() -> None:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        run_side(boom, "t").result(timeout=5)


def test_wait_reports_the_first_failure_and_honours_abort() -> None:
    tb = TransportBase()
    slow = run_side(lambda: time.sleep(5), "slow")

    def fail() -> None:
        raise answered("/update_weights", 500, "nope")

    with pytest.raises(TransferError, match="nope") as ei:
        tb.wait([slow, run_side(fail, "f")], time.monotonic() + 10, "update",
                mutation_started=True)
    assert ei.value.mutation_started is True
    threading.Timer(0.2, tb.abort).start()
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="aborted"):
        tb.wait([run_side(lambda: time.sleep(5), "s")], time.monotonic() + 10, "x",
                mutation_started=False)
    assert time.monotonic() - t0 < 1.5


# ---------------------------------------------------------------- backend registry


class VllmLikeFactory:
    """``WeightTransferEngineFactory``'s registration, as vLLM 0.26-0.32 has it."""

    _registry: dict[str, Any]

    @classmethod
    def register_engine(cls, name: str, module: str, class_name: str | None = None) -> None:
        import importlib

        if name in cls._registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls._registry[name] = lambda: getattr(importlib.import_module(module), class_name or "")


def _factory(**held: Any) -> type[VllmLikeFactory]:
    return type("Factory", (VllmLikeFactory,), {"_registry": dict(held)})


def test_registry_loads_lazily_and_refuses_duplicates_and_unknown_names() -> None:
    from rolloutcore.transports.registry import BackendConflict, BackendRegistry

    reg = BackendRegistry("trainer transport")
    reg.register("x", "rolloutcore.transports.nccl", "NcclTransport")
    assert reg.names() == ("x",) and "x" in reg and len(reg) == 1
    assert reg.load("x") is NcclTransport
    with pytest.raises(BackendConflict, match=r"'x' is already registered to .*NcclTransport"):
        reg.register("x", "rolloutcore.transports.nccl", "NcclTransport")
    with pytest.raises(BadInput, match=r"unknown trainer transport 'y'; registered: x"):
        reg.load("y")
    for bad in ("", "a b", None, "x" * 65):
        with pytest.raises(BadInput):
            reg.register(bad, "m", "C")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="dotted"):
        reg.register("z", "not a module", "C")
    assert reg.names() == ("x",)  # refusals changed nothing
    reg.register("z", "rolloutcore.transports", "__all__")
    with pytest.raises(BadInput, match="not a class"):
        reg.load("z")
    reg.register("gone", "rolloutcore.no_such_module", "C")  # registering imports nothing
    with pytest.raises(ImportError):
        reg.load("gone")


def test_builtin_backends_are_registered_in_one_place() -> None:
    from rolloutcore.transports import registry
    from rolloutcore.transports.cuda_ipc import BACKEND as CUDA_IPC
    from rolloutcore.transports.cuda_ipc import CudaIpcTransport

    assert registry.ENGINE_BACKENDS.names() == ("rc_cuda_ipc", "rolloutcore_gloo")
    assert registry.TRAINER_TRANSPORTS.names() == ("ipc", "nccl", "rc_cuda_ipc",
                                                   "rolloutcore_gloo")
    for name in registry.TRAINER_TRANSPORTS.names():
        # A trainer transport answers to the backend name the engine is started with.
        assert registry.TRAINER_TRANSPORTS.load(name).backend == name
    assert registry.TRAINER_TRANSPORTS.load(CUDA_IPC) is CudaIpcTransport
    t = registry.trainer_transport("nccl", packed=False)
    assert isinstance(t, NcclTransport) and t.packed is False
    with pytest.raises(BadInput, match="registered: ipc, nccl"):
        registry.trainer_transport("gloo")
    # Engine halves are checked by path only: their modules import vLLM.
    assert {n: lo.path for n, lo in registry.ENGINE_BACKENDS.items()} == {
        "rc_cuda_ipc": "rolloutcore.transports.cuda_ipc.engine.CudaIpcWeightTransferEngine",
        "rolloutcore_gloo": "rolloutcore.transports.gloo.GlooWeightTransferEngine"}


def test_install_into_vllm_is_idempotent_and_imports_nothing() -> None:
    from rolloutcore.transports.registry import BackendRegistry, install_into_vllm

    reg = BackendRegistry("weight transfer engine")
    reg.register("rc_a", "rolloutcore.transports.nccl", "NcclTransport")
    reg.register("rc_b", "rolloutcore.no_such_module", "Engine")  # lazy: never imported here
    f = _factory(nccl=lambda: NcclTransport)
    assert install_into_vllm(f, reg) == ("rc_a", "rc_b")
    assert install_into_vllm(f, reg) == ("rc_a", "rc_b")  # every vLLM process calls it again
    assert set(f._registry) == {"nccl", "rc_a", "rc_b"}
    assert f._registry["rc_a"]() is NcclTransport


def test_install_into_vllm_after_a_reimport_accepts_its_own_loader_only() -> None:
    from rolloutcore.transports import registry as r

    reg = r.BackendRegistry("weight transfer engine")
    reg.register("rc_a", "rolloutcore.transports.nccl", "NcclTransport")
    # A forked or re-imported process: vLLM's factory has the name, our record is gone.
    f = _factory(rc_a=lambda: NcclTransport)
    assert r.install_into_vllm(f, reg) == ("rc_a",)
    # Someone else's class under our name: refused, naming both.
    g = _factory(rc_a=lambda: IpcTransport)
    with pytest.raises(r.BackendConflict, match=r"'rc_a' is already registered in vLLM to "
                       r"rolloutcore\.transports\.ipc\.IpcTransport; RolloutCore's "
                       r"rolloutcore\.transports\.nccl\.NcclTransport"):
        r.install_into_vllm(g, reg)
    assert g._registry["rc_a"]() is IpcTransport  # left as it was

    def broken() -> Any:
        raise ImportError("no module named foreign")

    with pytest.raises(r.BackendConflict, match="loader fails"):
        r.install_into_vllm(_factory(rc_a=broken), reg)

    class Opaque:
        """A vLLM whose factory keeps no readable registry: who holds the name is unknown."""

        @classmethod
        def register_engine(cls, name: str, module: str, class_name: str) -> None:
            raise ValueError("already registered")

    with pytest.raises(r.BackendConflict, match="does not let us inspect"):
        r.install_into_vllm(Opaque, reg)


def test_the_plugin_entry_point_is_the_registrys_install() -> None:
    import importlib
    import tomllib
    from pathlib import Path

    from rolloutcore.transports import vllm_plugin

    pyproject = Path(vllm_plugin.__file__).parents[3] / "pyproject.toml"
    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {
        "rolloutcore": "rolloutcore.transports.vllm_plugin:register"}
    mod, fn = eps["vllm.general_plugins"]["rolloutcore"].split(":")
    assert getattr(importlib.import_module(mod), fn) is vllm_plugin.register


@pytest.mark.slow  # imports vLLM (about 6 s on these CPUs)
def test_the_old_cuda_ipc_entry_point_is_the_same_registration() -> None:
    """Installs made from an older pyproject name ``cuda_ipc.engine:register``."""
    from rolloutcore.transports import vllm_plugin
    from rolloutcore.transports.cuda_ipc import engine

    assert engine.register is vllm_plugin.register


def test_a_dropped_group_is_abandoned_by_both_gloo_senders_alike() -> None:
    """``gloo.abandon``: what ``GlooTransport`` and ``GlooFanout`` do with the group they
    drop: kept referenced (a collective may be pending), aborted first on ``abort``
    (best effort: an abort that raises still abandons it)."""
    from rolloutcore.transports import gloo

    class Group:
        def __init__(self, fails: bool) -> None:
            self.fails, self.aborted = fails, 0

        def abort(self) -> None:
            self.aborted += 1
            if self.fails:
                raise RuntimeError("already torn down")

    class Held:
        def __init__(self, fails: bool = False) -> None:
            self.group = Group(fails)

    before = len(gloo._ABANDONED)
    gloo.abandon(None, abort=True)
    kept, aborted, failing = Held(), Held(), Held(fails=True)
    gloo.abandon(kept)
    gloo.abandon(aborted, abort=True)
    gloo.abandon(failing, abort=True)
    assert gloo._ABANDONED[before:] == [kept, aborted, failing]
    assert (kept.group.aborted, aborted.group.aborted, failing.group.aborted) == (0, 1, 1)
    del gloo._ABANDONED[before:]
