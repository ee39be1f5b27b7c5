"""The vLLM 0.26 stand-ins and the per-parameter checksum evidence, on the CPU (fast lane).

``rolloutcore.transports.compat``: the NCCL trainer round vLLM 0.26 does not
ship, run under RolloutCore's real NCCL driver with a fake communicator and a
recording sync client; and the worker extension + validator whose block
checksums of every parameter are the paused validation's evidence there,
exercised on a tiny model in vLLM's fused layout. The two-GPU runs of the
same code are ``diagnostics/gpu/h200x2_8b_nccl.py``.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import queue
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers.param_models import ORDER, engine_model, tiny_packed
from rolloutcore.errors import BadInput, EngineUnavailable, TransferError
from rolloutcore.transports.compat.param_checksums import (
    METHOD,
    WORKER_EXTENSION,
    ParamChecksumExtension,
    ParamChecksumValidator,
    compare_param_checksums,
    engine_layout_views,
    engine_param_sources,
)
from rolloutcore.transports.compat.vllm026 import (
    Nccl026TrainerEngine,
    Nccl026Transport,
    TrainerEngineHolder,
    sync_client_026,
)
from rolloutcore.transports.cuda_ipc import PackedWeights, block_checksum
from rolloutcore.transports.driver import DeviceGuard
from rolloutcore.transports.source import WeightSource

SEND_THREAD = "rolloutcore-nccl-send"  # the driver's side thread (run_side name)


def send_thread_alive() -> bool:
    return any(t.name == SEND_THREAD and t.is_alive() for t in threading.enumerate())


# ---------------------------------------------------------------- checksum layout

def test_engine_parameters_map_to_the_trainer_tensors_they_fuse() -> None:
    p = "model.layers.0."
    trainer = [p + f"self_attn.{x}_proj.weight" for x in "qkvo"] + [
        p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight", "lm_head.weight"]
    engine = [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight",
              p + "mlp.gate_up_proj.weight", "lm_head.weight",
              "model.layers.1.self_attn.qkv_proj.weight", "model.rotary.inv_freq"]
    m = engine_param_sources(engine, trainer)
    assert m[p + "self_attn.qkv_proj.weight"] == tuple(
        p + f"self_attn.{x}_proj.weight" for x in "qkv")
    assert m[p + "mlp.gate_up_proj.weight"] == (p + "mlp.gate_proj.weight",
                                                p + "mlp.up_proj.weight")
    assert m["lm_head.weight"] == ("lm_head.weight",)
    assert "model.layers.1.self_attn.qkv_proj.weight" not in m  # no such trainer tensors
    assert "model.rotary.inv_freq" not in m and len(m) == 4


def test_param_checksums_pass_only_complete_equal_and_in_order() -> None:
    f = compare_param_checksums
    assert f(["a", "b"], [1, 2], ["a", "b"], [1, 2])["passed"]
    r = f(["a", "b"], [1, 2], ["a", "b"], [1, 3])
    assert not r["passed"] and r["mismatched"] == ["b"]
    r = f(["a", "b"], [1, None], ["a", "b"], [1, 2])
    assert not r["passed"] and r["coverage"] == 0.5 and r["n_mismatched"] == 0
    r = f(["a", "b"], [1, 2], ["b", "a"], [2, 1])
    assert not r["passed"] and not r["same_layout"] and r["compared"] == 0
    assert not f([], [], [], [])["passed"]
    with pytest.raises(ValueError):
        f(["a"], [], ["a"], [1])


class Worker(ParamChecksumExtension):
    """vLLM's worker with the extension mixed in: its transfer engine holds the model."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.weight_transfer_engine = SimpleNamespace(model=model)


class Rpc:
    """``/collective_rpc`` to one worker, answered in process."""

    def __init__(self, *workers: Any) -> None:
        self.workers = workers
        self.calls = 0

    def __call__(self, method: str, timeout_s: float) -> tuple[list[Any], float]:
        assert method == METHOD
        self.calls += 1
        return [getattr(w, method)() for w in self.workers], 0.001


def _validator(model: torch.nn.Module, pk: PackedWeights) -> ParamChecksumValidator:
    v = ParamChecksumValidator(Rpc(Worker(model)),
                               lambda n, b: engine_layout_views(pk, n, b))
    v.learn_layout()
    return v


def test_the_worker_extension_names_path_is_importable() -> None:
    import importlib

    mod, cls = WORKER_EXTENSION.rsplit(".", 1)
    assert getattr(importlib.import_module(mod), cls) is ParamChecksumExtension


def test_the_extension_falls_back_to_the_model_runner() -> None:
    model = engine_model(tiny_packed(ORDER))
    w = ParamChecksumExtension()
    w.model_runner = SimpleNamespace(model=model)  # type: ignore[attr-defined]
    got = w.rc_nccl_param_checksums()
    assert got["names"] == [n for n, _ in model.named_parameters()]
    assert got["values"] == block_checksum([p.data for p in model.parameters()])
    assert got["nbytes"] == [p.numel() * p.element_size() for p in model.parameters()]


@pytest.mark.parametrize("order", [ORDER, ["q", "o", "k", "v", "up", "norm", "gate"]])
def test_paused_validation_matches_the_workers_checksums_in_vllm_layout(order: list[str]) -> None:
    pk = tiny_packed(order)
    model = engine_model(pk)
    v = _validator(model, pk)
    v.stage()
    chk = v.validation_check("http://unused")
    assert chk.passed and chk.coverage == 1.0 and chk.level.wire == "engine-checksum", chk
    views, covered = engine_layout_views(pk, v.names, v.nbytes)
    assert all(covered)
    qkv = dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"]
    i = v.names.index("model.layers.0.self_attn.qkv_proj.weight")
    assert torch.equal(views[i].view(torch.uint8).reshape(-1),
                       qkv.data.view(torch.uint8).reshape(-1))
    # One element of the engine's fused parameter differs: caught, and named.
    with torch.no_grad():
        qkv.data.view(-1)[5] += 1
    chk = v.validation_check("http://unused")
    assert not chk.passed and "qkv_proj" in chk.detail
    assert v.last["mismatched"] == ["model.layers.0.self_attn.qkv_proj.weight"]


def test_validation_fails_closed() -> None:
    pk = tiny_packed(ORDER)
    model = engine_model(pk)
    model.model.extra = torch.nn.Module()
    model.model.extra.weight = torch.nn.Parameter(torch.zeros(128, dtype=torch.bfloat16))
    v = _validator(model, pk)
    assert not v.validation_check("x").passed  # nothing staged
    v.stage()
    chk = v.validation_check("x")  # a parameter the trainer has no source for
    assert not chk.passed and chk.coverage < 1.0
    # The engine's parameters in another order than the layout learnt: not comparable.
    v2 = _validator(engine_model(pk), pk)
    v2.stage()
    v2.names = list(reversed(v2.names))
    assert not v2.validation_check("x").passed and v2.last["same_layout"] is False


def test_validator_refuses_misuse_and_odd_answers() -> None:
    pk = tiny_packed(ORDER)
    model = engine_model(pk)
    with pytest.raises(BadInput, match="learn_layout"):
        ParamChecksumValidator(Rpc(Worker(model)), lambda n, b: ([], [])).stage()
    with pytest.raises(BadInput):
        ParamChecksumValidator(Rpc(Worker(model))).stage()  # no trainer views
    # Two workers (tensor parallelism): the layout views assume one; refused.
    two = ParamChecksumValidator(Rpc(Worker(model), Worker(model)))
    with pytest.raises(EngineUnavailable, match="unexpected answer"):
        two.learn_layout()
    bad = ParamChecksumValidator(lambda m, t: (["not a dict"], 0.0))  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailable):
        bad.engine_params()


def test_holder_reaches_the_communicator() -> None:
    h = TrainerEngineHolder()
    assert h.comm() is None
    h.engine = SimpleNamespace(comm="c")
    assert h.comm() == "c"
    h.engine = SimpleNamespace(model_update_group="g")
    assert h.comm() == "g"


# ---------------------------------------------------------------- the vLLM 0.26 round

class FakeComm:
    def __init__(self) -> None:
        self.release = threading.Event()
        self.destroyed = False

    def destroy(self) -> None:
        self.destroyed = True
        self.release.set()


class FakeSyncClient:
    """vLLM's sync-client surface (0.26's finish plus the label, as ``sync_client_026``)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.calls.append(("init", info))

    def start_weight_update(self) -> None:
        self.calls.append(("start",))

    def update_weights(self, info: dict[str, Any]) -> None:
        self.calls.append(("update", info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.calls.append(("finish", weight_version))


def cpu_transport(block: bool) -> tuple[Any, FakeSyncClient, FakeComm, dict[str, Any]]:
    comm, client = FakeComm(), FakeSyncClient()
    box: dict[str, Any] = {"sent": [], "entered": threading.Event()}

    def bcast(items: Iterator[tuple[str, torch.Tensor]], c: Any, packed: bool) -> None:
        box["packed"] = packed
        box["sent"] = [(n, t.clone()) for n, t in items]
        box["entered"].set()
        if block:
            c.release.wait(30)
            if c.destroyed:  # a collective on an aborted communicator fails
                raise RuntimeError("NCCL communicator aborted")

    def init(info: Any, *, client: Any, source: Any) -> Any:
        box["info"] = info
        box["engine"] = Nccl026TrainerEngine.trainer_init(
            info, client=client, source=source,
            open_endpoint=lambda w: box.setdefault("worker", w) and comm, broadcast=bcast)
        return box["engine"]

    class CpuTransport(Nccl026Transport):
        def torch_device(self, index: int) -> Any:
            return torch.device("cpu")

    t = CpuTransport(trainer_init=init, client_factory=lambda url, s: client,
                     guard=DeviceGuard(lambda: 0, lambda i: None), engine_world_size=1)
    t.connect("http://127.0.0.1:9", timeout_s=5)
    return t, client, comm, box


def small_source() -> WeightSource:
    return WeightSource.from_state_dict({"b.weight": torch.ones(3, 2, dtype=torch.bfloat16),
                                         "a.bias": torch.arange(4, dtype=torch.float32)})


def test_the_026_round_runs_under_rolloutcores_driver_and_finishes_with_the_label() -> None:
    t, client, comm, box = cpu_transport(block=False)
    assert box["worker"]["rank_offset"] == 1 and box["worker"]["world_size"] == 2
    assert box["info"]["packed"] is True and client.calls[0] == ("init", box["worker"])
    src = small_source()
    ev = t.send("http://127.0.0.1:9", "rc-7", src, timeout_s=5,
                expected_manifest_digest=src.manifest().digest)
    assert ev.completed and ev.finish_label == "rc-7" and ev.bytes == src.nbytes
    kinds = [c[0] for c in client.calls]
    assert kinds == ["init", "start", "update", "finish"] and client.calls[-1][1] == "rc-7"
    info = client.calls[2][1]
    assert info == {"names": ["a.bias", "b.weight"], "dtype_names": ["float32", "bfloat16"],
                    "shapes": [[4], [3, 2]], "packed": True}
    assert [n for n, _ in box["sent"]] == ["a.bias", "b.weight"] and box["packed"] is True
    assert torch.equal(box["sent"][1][1], torch.ones(3, 2, dtype=torch.bfloat16))
    # The identity preflight refuses a source that is not the target, before any call.
    with pytest.raises(TransferError) as ei:
        t.send("http://127.0.0.1:9", "rc-8", src, timeout_s=5, expected_manifest_digest="0" * 64)
    assert not ei.value.mutation_started and len(client.calls) == 4


def test_driver_abort_returns_the_caller_and_its_comm_abort_frees_the_broadcast() -> None:
    t, client, comm, box = cpu_transport(block=True)
    result: queue.Queue[BaseException | object] = queue.Queue()

    def send() -> None:
        try:
            result.put(t.send("http://127.0.0.1:9", "rc-9", small_source(), timeout_s=30))
        except BaseException as exc:
            result.put(exc)

    threading.Thread(target=send, daemon=True).start()
    assert box["entered"].wait(5)
    t0 = time.monotonic()
    t.abort()  # what the runner's watchdog does, through adapter.cancel
    err = result.get(timeout=5)
    assert isinstance(err, TransferError) and err.mutation_started
    assert time.monotonic() - t0 < 5.0
    # The driver's abort shuts the trainer engine down (communicator destroy,
    # i.e. ncclCommAbort): the broadcast blocked on its peer is freed too.
    end = time.monotonic() + 5
    while send_thread_alive() and time.monotonic() < end:
        time.sleep(0.01)
    assert not send_thread_alive()
    # The abandoned round never finishes under a label (the target was cleared).
    assert [c[0] for c in client.calls] == ["init", "start", "update"]


@contextlib.contextmanager
def capture_server() -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    got: list[tuple[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(n) if n else b""
            got.append((self.path, json.loads(raw) if raw else None))
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    # polled every 10 ms, not 0.5 s: ``shutdown`` waits for the loop to see it
    th = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01},
                          daemon=True)
    th.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", got
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.slow  # imports vLLM (about 6 s on these CPUs)
def test_sync_client_026_is_vllms_client_with_the_label_in_finish() -> None:
    with capture_server() as (url, got):
        c = sync_client_026(url, 5.0)
        c.start_weight_update()
        c.update_weights({"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2]]})
        c.finish_weight_update(weight_version="rc-3")
        c.finish_weight_update()
    assert [p for p, _ in got] == ["/start_weight_update", "/update_weights",
                                   "/finish_weight_update", "/finish_weight_update"]
    assert got[1][1]["update_info"]["names"] == ["a"]
    assert got[2][1] == {"weight_version": "rc-3"} and got[3][1] is None
