"""``CudaIpcFanout`` (one trainer buffer into N engines) and the H200 fleet harness's plan.

The fan-out's per-engine transports need a CUDA device and a vLLM with the
``rc_cuda_ipc`` worker extension (the H200 run, ``diagnostics/gpu/h200_fleet.py``);
here each engine's transport is a stand-in that records what the fan-out asked
of it, so what the fan-out itself decides is checked: one staging and one
checksum for every engine, every session at once, results that claim no more
than each session answered, the deadline, and bad input refused before any
engine is called.
"""

from __future__ import annotations

import json
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest

from helpers.scripts import load_script
from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.fleet.model import FanoutTransport
from rolloutcore.transports.cuda_ipc.fanout import CudaIpcFanout

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200_fleet.py"


class Packed:
    """What a staged buffer offers the fan-out: its checksum (counted)."""

    def __init__(self) -> None:
        self.hashed = 0

    def checksum(self, impl: str = "auto") -> list[int]:
        self.hashed += 1
        return [11, 22, 33]


class Engine:
    """One engine's transport: records calls; ``fail``/``hang`` say how its session ends."""

    checksum_impl = "auto"

    def __init__(self, packed: Packed, *, fail: TransferError | None = None,
                 hang: bool = False, barrier: threading.Barrier | None = None) -> None:
        self.packed, self.fail, self.hang, self.barrier = packed, fail, hang, barrier
        self.staged: list[Any] = []
        self.pre: list[Any] = []
        self.sent: list[tuple[str, str, Any]] = []
        self.aborted = threading.Event()

    def stage(self, source: Any) -> Packed:
        self.staged.append(source)
        return self.packed

    def precompute_checksum(self, packed: Any, *, values: Any = None) -> float:
        self.pre.append((packed, values))
        return 0.0

    def send(self, url: str, label: str, packed: Any, *, timeout_s: float) -> TransferEvidence:
        if self.barrier is not None:
            self.barrier.wait(5)  # every engine's session runs at the same time
        self.sent.append((url, label, packed))
        if self.hang:
            self.aborted.wait(30)
            raise TransferError("transfer", "connection closed by abort", mutation_started=True)
        if self.fail is not None:
            raise self.fail
        return TransferEvidence(completed=True, mutation_started=True, backend="rc_cuda_ipc",
                                tensors=3, bytes=96, finish_label=None, elapsed_s=0.01)

    def abort(self) -> None:
        self.aborted.set()


U0, U1 = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def test_one_staging_one_checksum_and_every_session_at_once() -> None:
    p = Packed()
    bar = threading.Barrier(2)
    e0, e1 = Engine(p, barrier=bar), Engine(p, barrier=bar)
    fan = CudaIpcFanout({U0: e0, U1: e1})
    assert isinstance(fan, FanoutTransport)
    res = fan.send_all([(U0, "v1.e0"), (U1, "v1.e1")], "the source", timeout_s=10)
    assert set(res) == {U0, U1} and all(r.ok and r.sent and not r.closed for r in res.values())
    assert res[U0].label == "v1.e0" and res[U1].label == "v1.e1"
    # Staged once (by the first engine's transport), hashed once, handed to both.
    assert e0.staged == ["the source"] and e1.staged == [] and p.hashed == 1
    assert e0.pre == e1.pre == [(p, [11, 22, 33])]
    assert e0.sent == [(U0, "v1.e0", p)] and e1.sent == [(U1, "v1.e1", p)]
    # A checksum computed before the round (while the engines serve) is used as is.
    fan.precompute(p)
    assert p.hashed == 2
    fan.send_all([(U0, "v2.e0"), (U1, "v2.e1")], "the source", timeout_s=10)
    assert p.hashed == 2


def test_a_failed_session_is_that_engines_own_result() -> None:
    p = Packed()
    refused = TransferError("transfer", "start refused (409)", mutation_started=False)
    fan = CudaIpcFanout({U0: Engine(p), U1: Engine(p, fail=refused)})
    res = fan.send_all([(U0, "a"), (U1, "b")], None, timeout_s=10)
    assert res[U0].ok and not res[U1].ok
    assert res[U1].error is refused and res[U1].sent is False
    # An unexpected exception may have changed the weights: classified as a mutation.
    fan2 = CudaIpcFanout({U0: Engine(p, fail=RuntimeError("CUDA error")),  # type: ignore[arg-type]
                          U1: Engine(p)})
    r2 = fan2.send_all([(U0, "a"), (U1, "b")], None, timeout_s=10)
    assert r2[U0].error is not None and r2[U0].error.mutation_started and r2[U1].ok


def test_a_session_past_the_rounds_deadline_is_aborted_and_failed() -> None:
    p = Packed()
    stuck = Engine(p, hang=True)
    fan = CudaIpcFanout({U0: Engine(p), U1: stuck})
    t0 = time.monotonic()
    res = fan.send_all([(U0, "a"), (U1, "b")], None, timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert stuck.aborted.is_set()
    assert res[U0].ok and not res[U1].ok and res[U1].error is not None
    assert res[U1].error.mutation_started


@pytest.mark.parametrize("targets", [
    [], [("http://127.0.0.1:9", "a")], [(U0, "a"), (U0, "b")], [(U0, "")], [(U0,)],
    [("not a url", "a")], "nope",
])
def test_bad_targets_are_refused_before_any_engine_is_called(targets: Any) -> None:
    p = Packed()
    e0, e1 = Engine(p), Engine(p)
    fan = CudaIpcFanout({U0: e0, U1: e1})
    with pytest.raises(BadInput):
        fan.send_all(targets, None, timeout_s=5)
    assert e0.staged == e0.sent == e1.sent == [] and p.hashed == 0
    with pytest.raises(BadInput):
        fan.send_all([(U0, "a")], None, timeout_s=0)


def test_construction_refuses_what_cannot_work() -> None:
    p = Packed()
    e = Engine(p)
    for bad in ({}, {U0: e, U1: e}, {"ftp://x": Engine(p)}, {U0: object()}, [U0]):
        with pytest.raises(BadInput):
            CudaIpcFanout(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the harness

def _harness() -> Any:
    name = "h200_fleet"
    return load_script(name, HARNESS)


def test_the_fleet_harness_plan_fits_one_device_call(capsys: pytest.CaptureFixture[str]
                                                     ) -> None:
    h = _harness()
    assert h.main(["--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["engines"] == 2 and plan["concurrency"] == 64
    assert plan["series"] == ["single", "independent_parallel", "fanout", "sequential"]
    assert plan["async_modes"] == ["none", "keep", "recompute"]
    assert plan["lengths"] == {"median": 128, "sigma": 1.0, "cap": 2048, "prompt": 128}
    assert plan["updates_per_phase"] == 4 and plan["estimated_s"] <= plan["budget_s"]
    # Too long for one call: refused before anything starts.
    assert h.main(["--plan", "--phase-s", "300"]) == 2
    for bad in (["--gpu-util", "0.6"], ["--reps", "0"], ["--median-tokens", "4096"]):
        with pytest.raises(SystemExit):
            h.parse(bad)


def test_the_async_stage_runs_every_mode_per_round_on_one_workload_rotated(
        capsys: pytest.CaptureFixture[str]) -> None:
    h = _harness()
    order = h.async_order(3)
    assert [m for r, m in order if r == 0] == ["none", "keep", "recompute", "none_after"]
    assert [m for r, m in order if r == 1] == ["none", "recompute", "keep", "none_after"]
    assert [m for r, m in order if r == 2] == ["none", "keep", "recompute", "none_after"]
    # Two rounds of four phases (the no-update phase first and last) fit one call.
    assert h.main(["--plan", "--only", "async", "--no-death", "--async-rounds", "2",
                   "--phase-s", "20"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["only"] == ["async"] and plan["async_rounds"] == 2
    st = plan["stages_s"]
    assert st["sync"] == st["rolling"] == st["death"] == 0.0 and st["async"] > 0
    assert plan["fits"] and len(plan["async_order"]) == 8
    # The same rounds with every stage do not fit one call: refused before anything starts.
    assert h.main(["--plan", "--async-rounds", "3", "--phase-s", "20"]) == 2
    with pytest.raises(SystemExit):
        h.parse(["--async-rounds", "0"])


def test_retention_is_read_only_from_rounds_whose_no_update_phases_agree() -> None:
    """Two no-update phases bracket each round; a round where they differ by more than
    5% never reached a steady state, and its ratios are not read."""
    h = _harness()

    def rnd(n0: float, n1: float, keep: float, rec: float) -> dict[str, Any]:
        return {"none": {"tokens_per_s": n0}, "none_after": {"tokens_per_s": n1},
                "keep": {"tokens_per_s": keep}, "recompute": {"tokens_per_s": rec}}

    out = h.steady_retention([rnd(1000, 1020, 960, 910), rnd(700, 1000, 1100, 1050),
                              rnd(1000, 990, 950, 900)])
    assert out["steady_rounds"] == [0, 2] and out["unsteady_rounds"] == [1]
    assert out["keep"]["retained_per_round"] == pytest.approx([960 / 1010, 950 / 995])
    assert out["keep"]["retained"] == pytest.approx((960 / 1010 + 950 / 995) / 2)
    assert h.steady_retention([rnd(500, 1000, 900, 900)])["keep"]["retained"] is None


def test_the_fleet_harness_plan_under_ray_names_the_placement_and_its_calls(
        capsys: pytest.CaptureFixture[str]) -> None:
    h = _harness()
    # The kill/rejoin stage takes its own call (issue 49).
    assert h.main(["--plan", "--no-death"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["placement"] == "processes" and "ray" not in plain
    assert h.main(["--plan", "--ray", "--no-death"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["placement"] == "ray" and plan["fits"]
    assert plan["estimated_s"] == plain["estimated_s"] + plan["stages_s"]["ray"]
    ray = plan["ray"]
    assert ray["version"] == h.RAY_VERSION and ray["gpus_per_engine"] == 0.5
    assert ray["bundles"] == [{"CPU": 1.0, "GPU": 0.5}] * 2 and ray["strategy"] == "PACK"
    assert "signal_group" in ray["what"] and "restart" in ray["what"]
    # The vLLM pieces' calls as without ray; the ray pieces: one call more.
    calls = ray["calls"]
    assert ray["carry"]["extra_calls"] == 1 and ray["carry"]["device_calls"] == len(calls) == 8
    assert ray["carry"]["pieces"] == [".carry/ray-piece-00", ".carry/ray-piece-01"]
    carried = [c for call in calls for c in call["carry"]]
    assert carried == [".carry/piece-00", ".carry/MANIFEST",
                       *(f".carry/piece-0{i}" for i in range(1, 6)),
                       ".carry/ray-piece-00", ".carry/ray-MANIFEST",
                       ".carry/piece-06", ".carry/ray-piece-01"]
    last = calls[-1]["command"]
    assert "install_on_device.sh" in last and "h200_fleet.py --ray" in last
    assert all("install_on_device" not in c["command"] for c in calls[:-1])
    # The call installs ray before the harness: the harness's own end comes sooner.
    assert h.parse(["--ray"]).deadline_s == h.RAY_DEADLINE_S < h.parse([]).deadline_s


def test_the_harness_goals_and_table_read_the_issues_keys() -> None:
    h = _harness()
    r = {"fanout_over_single": 1.2, "rolling_retained_min": 0.4, "rolling_failed_any": 0,
         "served_by_dead_replica": 0, "rejoin_over_cold_start": 2.5, "keep_retained": 0.96,
         "recompute_retained": None, "errors": {}}
    g = h.goals(r)
    assert g["fanout_over_single<=1.3"] is True and g["rolling_retained_min>=0.45"] is False
    assert g["rolling_failed_any==0"] is True and g["rejoin<=2x_cold_start"] is False
    assert g["keep_retained>=0.95"] is True and g["recompute_retained>=0.90"] is None
    text = h.table({**r, "errors": {"death": "boom"}})
    assert "ERROR in death: boom" in text and text.endswith("FLEET HAS PROBLEMS")
    assert h.table(r).endswith("FLEET OK")


def test_the_timeline_picture_is_drawn_from_samples(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    h = _harness()
    tl = h.Timeline()
    tl.close()
    tl.stages = [("rolling", 0.0), ("death", 5.0)]
    tl.samples = [(0.1 * i, {"e0": str(i // 20), "e1": None if 60 < i < 80 else str(i // 25)})
                  for i in range(100)]

    tl.loads = [types.SimpleNamespace(done=[{"reads": [(tl.t0 + 0.1 * i, 3)
                                                        for i in range(100)]}])]
    assert tl.plot(tmp_path / "fleet.png") is None
    assert (tmp_path / "fleet.png").stat().st_size > 10_000


def test_before_anything_was_sent_the_transports_check_claims_nothing() -> None:
    """A takeover observes an engine this transport never wrote to: a passing check of
    no level (what the engine holds is the declaration's, not this transport's word)."""
    from rolloutcore.transports.cuda_ipc import CudaIpcTransport

    tr = CudaIpcTransport(device="cpu")
    chk = tr.validation_check("http://127.0.0.1:9")
    assert chk.passed and chk.level is None and chk.coverage == 0.0
    assert "nothing sent" in chk.detail


@pytest.mark.parametrize("in_process", [False, True])
def test_the_harness_clients_run_in_a_process_of_their_own(in_process: bool) -> None:
    """The load's clients (by default in a spawned process, apart from the gateway's
    interpreter lock) hand back every finished request and the CPU each side used. They
    meet what they meet on the GPU: the real fleet gateway (one replica, ``r0``) in front of
    the one fake of vLLM, each on a loopback port of its own."""
    from fleettools import fake_fleet, served
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.engine.routes import Routes
    from rolloutcore.fleet import FleetConfig
    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.service import ServiceConfig

    h = _harness()
    args = h.parse(["--concurrency", "3", "--median-tokens", "4", "--cap-tokens", "8",
                    "--prompt-tokens", "4"] + (["--clients-in-process"] if in_process else []))
    rig = types.SimpleNamespace(model=None, sampling_extra={}, vocab=50)
    fleet = fake_fleet(1, token_delay_s=0.0, config=FleetConfig(health_interval_s=0))

    def generated() -> int:
        return sum(1 for m, p in fakes["r0"].received if (m, p) == ("POST", Routes.GENERATE))

    with served(fleet) as fakes, uvicorn_thread(create_fleet_app(
            fleet.coord, ServiceConfig(upstream_url="http://127.0.0.1:1", control_token=TOKEN),
            supervise=False)) as url:
        load = h.Load(url, rig, args, seed=1)
        t0 = time.monotonic()
        load.start()
        deadline = time.monotonic() + 120   # a spawned interpreter starts slowly under load
        while time.monotonic() < deadline and generated() < 6:
            time.sleep(0.05)
        load.stop(wait_s=120)
    assert generated() >= 6, "the clients sent too few requests"
    assert len(load.done) >= 6, "the finished requests did not come back"
    assert all(r["status"] == 200 and not r["error"] and r["replica"] == "r0"
               for r in load.done), load.done[:3]
    assert all(r["tokens"] == sum(k for _, k in r["reads"]) for r in load.done)
    assert load.tokens_per_s(t0, time.monotonic() + 1) > 0
    assert load.cpu["clients_in_process"] is in_process
    assert (load.cpu["clients_process_cores"] is None) is in_process
    if not in_process:
        assert load.cpu["clients_process_cores"] > 0
