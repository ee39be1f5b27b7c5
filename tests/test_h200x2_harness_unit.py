"""The two-GPU NCCL harness's pure pieces, on the CPU (fast lane).

``diagnostics/gpu/h200x2_8b_nccl.py`` runs on an ``nvidia-h200-x2`` machine;
what it decides and records without a GPU is tested here: the plan and its
environments (multicast off everywhere), the half-broadcast kill timing,
the classification bookkeeping (driven through RolloutCore's real runner and
lease over the fake engine), the checksum validation as the harness wires it,
and the artifact. The product code the harness uses (the vLLM 0.26 trainer
round, the checksum worker extension and validator) lives in
``rolloutcore.transports.compat`` and is tested in
``tests/test_transports_compat_unit.py``.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from helpers.gateway_rig import remote_transfer
from helpers.param_models import engine_model, tiny_packed
from helpers.scripts import load_script
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.records import Event, State, Taint, Transition
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.control import UpdateManager
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights, FaultKind
from rolloutcore.transports.cuda_ipc import block_checksum
from rolloutcore.transports.source import WeightSource

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200x2_8b_nccl.py"


def _load() -> Any:
    name = "h200x2_8b_nccl"
    return load_script(name, HARNESS)


h = _load()
OFF = dict(h.MULTICAST_OFF)


# ---------------------------------------------------------------- environment hygiene

def test_child_env_forces_multicast_off_over_any_base() -> None:
    base = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0", "PATH": "/bin"}
    env = h.child_env({"CUDA_VISIBLE_DEVICES": "1"}, base=base)
    assert h.multicast_violations(env) == []
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PATH"] == "/bin"
    assert h.multicast_violations(base) == list(OFF)


@pytest.mark.parametrize("key", list(OFF))
def test_child_env_refuses_to_turn_multicast_on(key: str) -> None:
    with pytest.raises(ValueError, match="multicast"):
        h.child_env({key: "1" if OFF[key] == "0" else "0"}, base={})
    assert h.child_env({key: OFF[key]}, base={})[key] == OFF[key]


def test_apply_multicast_off_and_every_planned_process_env() -> None:
    env: dict[str, str] = {"NCCL_NVLS_ENABLE": "1"}
    h.apply_multicast_off(env)
    assert env == OFF
    cfg = h.HarnessConfig()
    for gpu in (0, 1):
        e = h.engine_env(cfg, gpu, "/x")
        assert h.multicast_violations(e) == [] and e["CUDA_VISIBLE_DEVICES"] == str(gpu)
        assert h.multicast_violations(h.trainer_child_env(cfg, gpu)) == []


# ---------------------------------------------------------------- configuration and plan

@pytest.mark.parametrize("kw", [
    {"trainer_gpu": 1, "engine_gpu": 0}, {"engine_gpu": 0}, {"engine_gpu": 2}, {"reps": 0},
    {"transfer_deadline_s": 0}, {"transfer_deadline_s": float("inf")}, {"kill_fraction": 1.0},
    {"kill_mode": "sometimes"}, {"recover_gpu": "2"}, {"phases": ("hot", "warm")},
    {"phases": ()}, {"gpu_util": 0.95}, {"reps": True},
])
def test_config_refuses_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        h.HarnessConfig(**kw)


def test_default_plan_is_valid_and_says_what_runs_where() -> None:
    cfg = h.HarnessConfig()
    plan = h.build_plan(cfg, engine_command=lambda g: ["vllm", f"--gpu{g}"])
    assert h.validate_plan(plan) == []
    phases = {p["name"]: p for p in plan["phases"]}
    assert list(phases) == list(h.PHASES)
    assert phases["hot"]["engine_gpu"] == 1 and phases["hot"]["trainer_gpu"] == 0
    # Recovery goes to the trainer's GPU; the next trainer takes the dead engine's.
    ke, kt = phases["kill-engine"], phases["kill-trainer"]
    assert [p["gpu"] for p in ke["processes"]] == [1, 0, 0]
    assert kt["engine_gpu"] == 0 and kt["trainer_gpu"] == 1
    assert [p["gpu"] for p in kt["processes"]] == [1, 1]
    assert ke["target"]["classify_within_s"] == cfg.transfer_deadline_s + 1
    assert kt["lease_s"] == cfg.transfer_deadline_s
    assert plan["adapter_transfer_timeout_s"] > plan["config"]["transfer_deadline_s"]
    d = ke["deadlines"]
    assert d["transfer_s"] == cfg.transfer_deadline_s and all(v > 0 for v in d.values())
    assert Deadlines(**h.runner_deadlines(cfg)).transfer_s == cfg.transfer_deadline_s
    for p in ke["processes"]:
        if "engine" in p["role"]:
            assert p["command"] == ["vllm", f"--gpu{p['gpu']}"]


def test_plan_checks_catch_each_kind_of_mistake() -> None:
    cfg = h.HarnessConfig()

    def broken(edit: Any) -> list[str]:
        plan = json.loads(json.dumps(h.build_plan(cfg)))
        edit(plan)
        return h.validate_plan(plan)

    def env_on(p: dict[str, Any]) -> None:
        p["phases"][1]["processes"][1]["env"]["NCCL_NVLS_ENABLE"] = "1"

    def same_gpu(p: dict[str, Any]) -> None:
        p["phases"][0]["trainer_gpu"] = 1

    def wrong_visible(p: dict[str, Any]) -> None:
        p["phases"][0]["processes"][0]["env"]["CUDA_VISIBLE_DEVICES"] = "0"

    def slack(p: dict[str, Any]) -> None:
        p["adapter_transfer_timeout_s"] = p["config"]["transfer_deadline_s"]

    def lease(p: dict[str, Any]) -> None:
        p["phases"][2]["lease_s"] = 60

    def big(p: dict[str, Any]) -> None:
        p["device_calls"][0]["bytes"] = 70 * 1024 * 1024

    def long_cmd(p: dict[str, Any]) -> None:
        p["device_calls"][-1]["command"] += " " * 2000

    def no_off(p: dict[str, Any]) -> None:
        p["device_calls"][-1]["command"] = p["device_calls"][-1]["command"].replace(
            "NCCL_NVLS_ENABLE=0", "")

    def unmeasured(p: dict[str, Any]) -> None:
        p["phases"][2]["measures"] = []

    for edit, words in [(env_on, "multicast"), (same_gpu, "same GPU"),
                        (wrong_visible, "CUDA_VISIBLE_DEVICES"), (slack, "watchdog"),
                        (lease, "lease"), (big, "64 MiB"), (long_cmd, "2000"),
                        (no_off, "multicast"), (unmeasured, "kill_trainer_classify_s")]:
        problems = broken(edit)
        assert len(problems) == 1 and words in problems[0], (edit.__name__, problems)


def test_device_calls_are_within_the_tools_limits() -> None:
    calls = h.device_calls(7)
    assert len(calls) == 8
    assert all(c["kind"] == "nvidia-h200-x2" and len(c["command"]) <= 2000 for c in calls)
    assert calls[0]["carry"] == [".carry/piece-00", ".carry/MANIFEST"]
    assert [c["carry"] for c in calls[1:7]] == [[f".carry/piece-{i:02d}"] for i in range(1, 7)]
    assert "install_on_device.sh" in calls[6]["command"] and "--phases hot" in calls[6]["command"]
    assert "kill-engine,kill-trainer" in calls[7]["command"] and "--assemble" in calls[7]["command"]
    for c in calls[6:]:
        assert h.multicast_violations(h._exports(c["command"])) == []
        assert c["timeout_s"] <= 600


def test_plan_mode_runs_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert h.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PLAN OK")
    plan = json.loads(out[:out.rindex("PLAN OK")])
    cmd = plan["phases"][0]["processes"][0]["command"]
    assert "--weight-transfer-config" in cmd and '{"backend": "nccl"}' in cmd
    assert cmd[cmd.index("--worker-extension-cls") + 1] == h.WORKER_EXTENSION
    assert "--load-format" in cmd and "dummy" in cmd
    assert plan["harness_env"] == OFF


# ---------------------------------------------------------------- kill timing

def test_trigger_fires_once_when_half_the_bytes_were_handed_over() -> None:
    trig = h.HalfwayTrigger(100, 0.5)
    fired: list[int] = []
    taken: list[str] = []
    for name, _ in h.tap_bytes(((f"t{i}", 10) for i in range(10)), lambda n: n, trig,
                               lambda: fired.append(len(taken))):
        taken.append(name)
    assert fired == [5] and trig.fired_at == 50 and trig.fraction_at_fire == 0.5
    assert len(taken) == 10


def test_trigger_counts_only_what_the_consumer_took() -> None:
    trig = h.HalfwayTrigger(100, 0.5)
    fired: list[bool] = []
    gen = h.tap_bytes([("a", 40), ("b", 40), ("c", 20)], lambda n: n, trig,
                      lambda: fired.append(True))
    next(gen)  # "a" handed over, not yet counted
    assert not fired and trig.seen == 0
    next(gen)  # counting "a" (40) does not cross 50
    assert not fired and trig.seen == 40
    next(gen)  # counting "b" crosses: fires before "c" is handed over
    assert fired == [True] and trig.fraction_at_fire == 0.8
    with pytest.raises(StopIteration):
        next(gen)
    assert fired == [True]


def test_trigger_and_timer_refuse_nonsense() -> None:
    for args in [(0, 0.5), (100, 0.0), (100, 1.0), (True, 0.5)]:
        with pytest.raises(ValueError):
            h.HalfwayTrigger(*args)
    with pytest.raises(ValueError):
        h.HalfwayTrigger(10).observe(-1)
    assert h.timer_delay_s(0.4, 0.5) == pytest.approx(0.2)
    for a in [(0.0, 0.5), (float("nan"), 0.5), (1.0, 1.0)]:
        with pytest.raises(ValueError):
            h.timer_delay_s(*a)


def test_gated_source_keeps_the_identity_and_fires_at_half() -> None:
    src = WeightSource.from_state_dict({f"w{i}": torch.full((4, 4), float(i)) for i in range(4)})
    trig = h.HalfwayTrigger(src.nbytes, 0.5)
    seen: list[int] = []
    g = h.gated_source(src, trig, lambda: seen.append(trig.seen))
    assert g.manifest().digest == src.manifest().digest and g.nbytes == src.nbytes
    got = list(g.named_tensors())
    assert [n for n, _ in got] == [n for n, _ in src.named_tensors()]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, src.named_tensors(),
                                                            strict=True))
    assert seen == [src.nbytes // 2]


# ---------------------------------------------------------------- bookkeeping over the runner

FAST = Deadlines(drain_s=2, pause_s=2, preflight_s=1, transfer_s=0.3, reset_s=1,
                 validate_s=1, resume_s=1, live_validate_s=2, bootstrap_s=2, fence_s=1,
                 cancel_grace_s=1, retry_backoff_s=0.01)


def fake_stack(deadlines: Deadlines = FAST) -> tuple[FakeAdapter, LifecycleController,
                                                     LifecycleRunner, Any, Any]:
    w0 = FakeWeights.from_seed(0)
    ad = FakeAdapter(FakeEngine(w0, token_delay_s=0.0))
    ad.stage(w0)
    clock = h.TransitionClock()
    c = LifecycleController(listener=clock)
    rec_ad = h.RecordingAdapter(ad)
    r = LifecycleRunner(c, rec_ad, deadlines)
    r.bootstrap(w0.identity())
    return ad, c, r, clock, rec_ad


def test_a_hung_transfer_is_classified_at_the_deadline_and_the_trainer_returns_typed() -> None:
    ad, c, r, clock, rec_ad = fake_stack()
    w1 = FakeWeights.from_seed(1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.HANG)  # stands in for a broadcast to a dead peer
    rec = h.KillRecord("kill-engine", FAST.transfer_s)
    rec_ad.on_transfer_start = lambda: setattr(rec, "t_kill", time.monotonic())
    out = h.supervised_update(r, clock, w1.identity(), rec, rec_ad)
    s = h.summarize_kill(rec)
    assert out is None and s["classified"] and s["state_after"] == "TAINTED"
    assert s["classification"] == "ambiguous" and s["failed_phase"] == "transfer"
    assert FAST.transfer_s - 0.05 <= s["classify_from_transfer_start_s"] <= FAST.transfer_s + 1
    assert s["within_target"] and s["killed"]
    assert s["trainer_returned"] and s["trainer_error_typed"]
    assert s["trainer_error"].startswith("EngineUnavailable")
    assert abs(s["trainer_return_after_classify_s"]) <= FAST.cancel_grace_s
    assert s["trainer_return_from_transfer_start_s"] <= FAST.transfer_s + FAST.cancel_grace_s
    assert s["published_during"] == [] and s["published_unvalidated"] is False
    assert c.committed is not None and c.committed.generation == 0


def test_an_engine_dying_mid_transfer_is_classified_before_the_deadline() -> None:
    ad, c, r, clock, rec_ad = fake_stack(FAST.scaled(10))
    w1 = FakeWeights.from_seed(1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.DIE)
    rec = h.KillRecord("kill-engine", 3.0)
    rec_ad.on_transfer_start = lambda: setattr(rec, "t_kill", time.monotonic())
    h.supervised_update(r, clock, w1.identity(), rec, rec_ad)
    s = h.summarize_kill(rec)
    assert s["state_after"] == "TAINTED" and s["classify_from_kill_s"] < 1.0
    assert s["trainer_error"].startswith("TransferError") and s["trainer_error_typed"]
    assert not s["published_unvalidated"]


def test_a_publication_during_a_kill_scenario_is_flagged() -> None:
    ad, c, r, clock, rec_ad = fake_stack()
    w1 = FakeWeights.from_seed(1)
    ad.stage(w1)
    rec = h.KillRecord("kill-engine", FAST.transfer_s)
    out = h.supervised_update(r, clock, w1.identity(), rec, rec_ad)
    s = h.summarize_kill(rec)
    assert out is not None and s["published_during"] == ["rc-1"]
    assert s["published_unvalidated"] is True and not s["classified"]
    assert not s["within_target"]


def test_transition_clock_times_only_transitions_after_a_mark() -> None:
    t = [0.0]
    clock = h.TransitionClock(lambda: t[0])
    clock(Transition(State.READY, State.TAINTED, Event.FAIL, 0.0))
    t[0] = 5.0
    clock(Taint(("x",), None))
    clock(Transition(State.RECOVERING, State.TAINTED, Event.FAIL, 0.0))
    assert clock.first_to("TAINTED", 0.0) == 0.0
    assert clock.first_to("TAINTED", 1.0) == 5.0 and clock.first_to("READY", 0.0) is None


class FakeRemote(h.RemoteTrainer):
    """A trainer process stand-in: dies at half, or transfers into the fake engine."""

    def __init__(self, adapter: FakeAdapter, weights: FakeWeights, die: bool) -> None:
        self.q: queue.Queue[dict[str, Any]] = queue.Queue()
        self.adapter, self.weights, self.die = adapter, weights, die
        self.killed: float | None = None

    def go(self, label: str) -> None:
        if self.die:
            self.q.put({"event": "sending"})
            e = self.adapter.engine  # half the tensors really reach the engine
            e.start_update()
            items = sorted(self.weights.tensors.items())
            for name, data in items[:len(items) // 2]:
                e.load(name, data)
            self.q.put({"event": "half", "fraction": 0.5})
            return
        ev = remote_transfer(self.adapter, self.weights, label)
        self.q.put({"event": "report", "transfer": {
            "completed": ev.completed, "mutation_started": ev.mutation_started,
            "backend": ev.backend, "tensors": ev.tensors, "bytes": ev.bytes,
            "finish_label": ev.finish_label, "elapsed_s": ev.elapsed_s}})

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        if self.killed is not None:
            time.sleep(timeout_s)
            return None
        try:
            return self.q.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def kill(self) -> float:
        self.killed = time.monotonic()
        return self.killed


def remote(die: bool, lease_s: float = 0.5) -> tuple[dict[str, Any], Any, FakeRemote,
                                                     LifecycleController]:
    ad, c, r, clock, _ = fake_stack()
    metrics = ServiceMetrics(c)
    c.add_listener(metrics.listener)
    mgr = UpdateManager(r, ServiceConfig(upstream_url="http://vllm.test",
                                         control_token="t" * 20, lease_s=lease_s,
                                         min_verification="declared"), metrics)
    w1 = FakeWeights.from_seed(1)
    ad.stage(w1)  # what the paused validation compares the engine with
    ident = w1.identity()
    body = {"identity": {"manifest_digest": ident.manifest_digest,
                         "provenance": ident.provenance.to_dict(),
                         "content_digest": ident.content_digest},
            "owner": "trainer-child", "lease_s": lease_s}
    rec = h.KillRecord("kill-trainer", lease_s)
    trainer = FakeRemote(ad, w1, die)
    out = asyncio.run(h.drive_remote_update(mgr, body, trainer, clock, rec, max_wait_s=10))
    return out, rec, trainer, c


def test_a_trainer_killed_at_half_is_classified_by_the_lease() -> None:
    out, rec, trainer, c = remote(die=True)
    s = h.summarize_kill(rec)
    assert out["begin_status"] == 201 and out["status"] == "expired"
    assert trainer.killed == rec.t_dead and s["kill_fraction_at_fire"] == 0.5
    assert s["classification"] == "ambiguous" and s["state_after"] == "TAINTED"
    # Classified by the lease's expiry (0.5 s), not before it, and not by the drive's own
    # give-up (max_wait_s=10); how far past the lease depends on the host's load (a
    # bound of lease + 1 s failed with the machine's load average at 27).
    assert 0.4 <= s["classify_from_transfer_start_s"] < 10
    assert s["target_s"] == 0.5 + 1.0 and not s["published_unvalidated"]
    assert [e["event"] for e in out["events"]] == ["sending", "half"]
    assert c.committed is not None and c.committed.generation == 0


def test_a_trainer_that_reports_publishes_through_the_same_driver() -> None:
    out, rec, trainer, c = remote(die=False, lease_s=5.0)
    assert out["status"] == "published" and out["report_status"] == 200
    assert trainer.killed is None and rec.t_kill is None
    s = h.summarize_kill(rec)
    assert s["published_during"] == ["rc-1"] and not s["classified"]
    assert c.state.value == "READY"


def test_recovery_gpu_choice() -> None:
    f = h.choose_recovery_gpu
    assert f("other", engine_gpu=1, trainer_gpu=0, trainer_gpu_clean=True)[0] == 0
    gpu, why = f("other", engine_gpu=1, trainer_gpu=0, trainer_gpu_clean=False)
    assert gpu == 1 and "blocked" in why
    assert f("same", engine_gpu=1, trainer_gpu=0, trainer_gpu_clean=True)[0] == 1
    assert f("1", engine_gpu=1, trainer_gpu=0, trainer_gpu_clean=False)[0] == 1
    assert f("0", engine_gpu=1, trainer_gpu=0, trainer_gpu_clean=False)[0] == 1
    assert f("other", engine_gpu=0, trainer_gpu=1, trainer_gpu_clean=True)[0] == 1


# ---------------------------------------------------------------- checksum layout

def test_engine_parameters_map_to_the_trainer_tensors_they_fuse() -> None:
    h4 = h.load_helper4()
    trainer = [n for n, _ in h4.qwen3_specs(h4.QWEN3_8B)]
    engine = ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
              "model.layers.0.self_attn.o_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
              "model.layers.35.mlp.down_proj.weight", "model.layers.3.self_attn.q_norm.weight",
              "lm_head.weight", "model.layers.36.self_attn.qkv_proj.weight",
              "model.rotary.inv_freq"]
    m = h.engine_param_sources(engine, trainer)
    p = "model.layers.0."
    assert m["model.layers.0.self_attn.qkv_proj.weight"] == tuple(
        p + f"self_attn.{x}_proj.weight" for x in "qkv")
    assert m["model.layers.0.mlp.gate_up_proj.weight"] == (p + "mlp.gate_proj.weight",
                                                            p + "mlp.up_proj.weight")
    assert m["lm_head.weight"] == ("lm_head.weight",)
    assert "model.layers.36.self_attn.qkv_proj.weight" not in m  # no layer 36
    assert "model.rotary.inv_freq" not in m
    assert len(m) == 7


def test_checksum_lists_pass_only_complete_equal_and_in_order() -> None:
    f = h.compare_checksum_lists
    assert f(["a", "b"], [1, 2], ["a", "b"], [1, 2])["passed"]
    r = f(["a", "b"], [1, 2], ["a", "b"], [1, 3])
    assert not r["passed"] and r["mismatched"] == ["b"]
    r = f(["a", "b"], [1, None], ["a", "b"], [1, 2])
    assert not r["passed"] and r["coverage"] == 0.5 and r["n_mismatched"] == 0
    r = f(["a", "b"], [1, 2], ["b", "a"], [2, 1])
    assert not r["passed"] and not r["same_layout"]
    assert not f([], [], [], [])["passed"]
    with pytest.raises(ValueError):
        f(["a"], [], ["a"], [1])


class WorkerStub(h.NcclChecksumExtension):
    def __init__(self, model: torch.nn.Module) -> None:
        self.weight_transfer_engine = SimpleNamespace(model=model)


class RpcStub:
    """``/collective_rpc`` of one worker, answered in process (helper-4's ``Http.post`` shape)."""

    def __init__(self, worker: WorkerStub) -> None:
        self.worker = worker
        self.calls = 0

    def post(self, path: str, body: Any = None, timeout: float = 0) -> tuple[Any, float]:
        assert path == "/collective_rpc" and body["method"] == "rc_nccl_param_checksums"
        self.calls += 1
        return {"results": [getattr(self.worker, body["method"])()]}, 0.001


@pytest.mark.parametrize("order", [["q", "k", "v", "o", "gate", "up", "norm"],
                                   ["q", "o", "k", "v", "up", "norm", "gate"]])
def test_paused_validation_matches_the_workers_checksums_in_vllm_layout(order: list[str]) -> None:
    pk = tiny_packed(order)
    model = engine_model(pk)
    tr = h.Trainer.__new__(h.Trainer)
    tr.packed = pk
    rpc = RpcStub(WorkerStub(model))
    v = h.nccl_checksum_validator(rpc, tr)
    v.learn_layout()
    v.stage()
    chk = v.validation_check("http://unused")
    assert chk.passed and chk.coverage == 1.0 and chk.level.wire == "engine-checksum", chk
    views, covered = tr.engine_layout_views(v.names, v.nbytes)
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
    assert block_checksum([views[i]]) != block_checksum([qkv.data])


def test_validation_fails_closed_without_a_staged_checksum_or_with_unknown_params() -> None:
    pk = tiny_packed(["q", "k", "v", "o", "gate", "up", "norm"])
    model = engine_model(pk)
    model.model.extra = torch.nn.Module()
    model.model.extra.weight = torch.nn.Parameter(torch.zeros(128, dtype=torch.bfloat16))
    tr = h.Trainer.__new__(h.Trainer)
    tr.packed = pk
    v = h.nccl_checksum_validator(RpcStub(WorkerStub(model)), tr)
    v.learn_layout()
    assert not v.validation_check("x").passed  # nothing staged
    v.stage()
    chk = v.validation_check("x")
    assert not chk.passed and chk.coverage < 1.0


# ---------------------------------------------------------------- what moved into src/

def test_the_harness_uses_the_product_code_it_moved_into_src() -> None:
    from rolloutcore.transports.compat import param_checksums, vllm026

    assert h.NcclChecksumExtension is param_checksums.ParamChecksumExtension
    assert h.WORKER_EXTENSION == param_checksums.WORKER_EXTENSION
    assert h.nccl026_transport_class() is vllm026.Nccl026Transport
    assert h.Nccl026TrainerEngine is vllm026.Nccl026TrainerEngine
    assert h.sync_client_026 is vllm026.sync_client_026
    with pytest.raises(AttributeError):
        _ = h.no_such_name


# ---------------------------------------------------------------- NCCL logs and the artifact

def test_nccl_transports_are_counted_from_debug_lines() -> None:
    text = ("host:1:2 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
            "host:1:2 [0] NCCL INFO Channel 01/0 : 0[0] -> 1[1] via P2P/CUMEM/read\n"
            "host:1:2 [0] NCCL INFO Channel 00 : 1[1] -> 0[0] via SHM/direct/direct\n"
            "host:1:2 [0] NCCL INFO Connected all rings\n")
    assert h.nccl_transports(text) == {"P2P/CUMEM/read": 2, "SHM/direct/direct": 1}
    assert h.nccl_transports("") == {}


def _parts() -> dict[str, dict[str, Any]]:
    base = {"device": ["NVIDIA H200", "NVIDIA H200"], "versions": {"vllm": "0.26.0"}}
    return {
        "hot": {**base, "commands": ["a"], "hot_s": 0.5, "bare_primitives_s": 0.4,
                "restart_s": 60.0, "nccl_gbps": 40.0, "p2p_copy_gbps": 400.0,
                "published_unvalidated": False},
        "kill-engine": {**base, "commands": ["b"], "recovery": {"ready": True},
                        "summary": {"classify_from_kill_s": 9.7, "within_target": True,
                                    "published_unvalidated": False}},
        "kill-trainer": {**base, "commands": ["c"], "recovery": {"ready": True},
                         "summary": {"classify_from_kill_s": 9.9, "within_target": True,
                                     "published_unvalidated": False}},
    }


def test_artifact_from_all_phases_is_complete_and_consistent() -> None:
    a = h.assemble_artifact(_parts())
    assert h.check_artifact(a) == [] and a["complete"] and a["missing_keys"] == []
    assert a["ratio"] == pytest.approx(120.0) and a["nccl_fraction_of_p2p"] == pytest.approx(0.1)
    assert a["kill_engine_classify_s"] == 9.7 and a["kill_trainer_classify_s"] == 9.9
    assert a["published_unvalidated"] is False and a["commands"] == ["a", "b", "c"]
    assert a["recovered"] == {"kill-engine": True, "kill-trainer": True}
    assert set(h.ARTIFACT_KEYS) <= set(a) and a["summary"]["ratio"] == a["ratio"]
    json.dumps(a)
    assert "| ratio restart / hot | 120 |" in h.results_table(a)


def test_artifact_records_what_is_missing_and_any_publication() -> None:
    parts = _parts()
    del parts["kill-trainer"]
    parts["kill-engine"]["summary"]["published_unvalidated"] = True
    a = h.assemble_artifact(parts)
    assert a["missing_keys"] == ["kill_trainer_classify_s"] and not a["complete"]
    assert a["published_unvalidated"] is True and h.check_artifact(a) == []
    assert "Missing: kill_trainer_classify_s" in h.results_table(a)
    none = h.assemble_artifact({})
    assert none["published_unvalidated"] is None and len(none["missing_keys"]) == 9


def test_check_artifact_catches_bad_values() -> None:
    a = h.assemble_artifact(_parts())
    bad = dict(a, ratio=7.0)
    assert any("ratio" in p for p in h.check_artifact(bad))
    bad = dict(a, hot_s=-1.0)
    assert any("hot_s" in p for p in h.check_artifact(bad))
    bad = dict(a, published_unvalidated="no")
    assert any("published_unvalidated" in p for p in h.check_artifact(bad))
    bad = {k: v for k, v in a.items() if k != "p2p_copy_gbps"}
    assert any("p2p_copy_gbps absent" in p for p in h.check_artifact(bad))
    bad = dict(a, nccl_gbps=None)
    assert any("missing_keys" in p for p in h.check_artifact(bad))
