"""The update-modes benchmark and its H200 harness, without an engine (issue 20).

``benchmarks/async_modes.py``'s phases run here over the simulated engine
(the same ``run_phase``, ``cache_control`` and ``summarize`` the CPU and
H200 runs use), checking what they report rather than how fast it is; the
H200 harness's ``--plan`` (what the lead's one device call will do, and
whether it fits the call) runs as a subprocess, as on a machine without a
GPU.
"""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner, UpdateOutcome
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.core.records import UpdateMode
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "diagnostics" / "gpu" / "h200_async.py"


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


bench = _load("rolloutcore_bench_async_modes", ROOT / "benchmarks" / "async_modes.py")
W = [FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)]
DL = Deadlines(drain_s=10, pause_s=5, preflight_s=5, transfer_s=5, reset_s=5, validate_s=5,
               resume_s=5, live_validate_s=10, bootstrap_s=5, fence_s=5, cancel_grace_s=1,
               retry_backoff_s=0.01)


def fake_harness() -> Any:
    eng = FakeEngine(W[0], token_delay_s=0.001, block_size=16)
    ad = FakeAdapter(eng)
    state = {"i": 0}

    def controller(mode: UpdateMode, k: int | None) -> tuple[LifecycleController,
                                                             LifecycleRunner]:
        j = Journal()
        c = LifecycleController(config=ControllerConfig(update_mode=mode, max_staleness=k),
                                listener=j.listener)
        r = LifecycleRunner(c, ad, DL, record=j.write)
        r.bootstrap(W[state["i"]].identity())
        return c, r

    def update(r: LifecycleRunner) -> UpdateOutcome:
        state["i"] ^= 1
        ad.stage(W[state["i"]])
        return r.run_update(W[state["i"]].identity())

    def abort_all() -> None:
        from rolloutcore.core.evidence import PauseMode

        eng.pause(PauseMode.ABORT)
        eng.resume()

    return bench.Harness(controller, update, eng, lambda: float(eng.prefix_hits),
                         lambda m: None, abort_all)


def test_the_long_tail_is_10_to_20_times_the_median() -> None:
    w = bench.Workload()
    rng = random.Random(0)
    lens = [w.length(rng) for _ in range(2000)]
    ratio = max(lens) / statistics.median(lens)
    assert 10 <= ratio <= 20 and max(lens) <= w.cap_tokens
    gpu = bench.Workload(64, 128, 1.0, 2048, 128, 150000)
    lens = [gpu.length(rng) for _ in range(2000)]
    assert 10 <= max(lens) / statistics.median(lens) <= 20


def test_rounds_rotate_so_every_mode_meets_the_same_drift() -> None:
    assert bench.plan_rounds(bench.MODES, 2) == [
        "none", "strict", "keep", "recompute", "strict", "keep", "recompute", "none"]


def test_every_mode_runs_end_to_end_on_the_fake_engine() -> None:
    h = fake_harness()
    work = bench.Workload(concurrency=4, median_tokens=8, cap_tokens=80, prompt_tokens=20)
    # Short phases: what is checked is what each mode reports, not its rate; two
    # updates are scheduled in each window, as in the real runs.
    raw = [bench.run_phase(h, m, workload=work, duration_s=0.3, warmup_s=0.05, period_s=0.12)
           for m in bench.MODES]
    s = bench.summarize(raw, period_s=0.12, concurrency=4)
    for m in bench.MODES:
        row = s[m]
        for key in ("tokens_per_s", "retained", "stall_median_s", "stall_max_s",
                    "recomputed_tokens", "max_staleness_seen"):
            assert key in row, (m, key)
        assert row["tokens"] > 0 and row["failed"] == 0 and row["unattributable"] == 0
        assert row["derived_disagrees"] == 0
    assert s["none"]["updates"] == 0 and s["none"]["retained"] == 1.0
    for m in ("strict", "keep", "recompute"):
        # Two are scheduled in the window; the second is skipped when the first ends
        # after the window (a strict drain on a loaded host): at least one ran.
        assert s[m]["updates"] >= 1 and s[m]["updates_failed"] == 0
        assert "lost_s_per_update" in s[m]
    assert s["strict"]["max_staleness_seen"] == 0 and s["keep"]["recomputed_tokens"] == 0
    assert s["update_period_s"] == 0.12 and s["concurrency"] == 4
    cache = bench.cache_control(h, prompt_tokens=48, kept_tokens=200)
    assert cache["salted"]["hits"] == 0 and cache["unsalted"]["hits"] >= 32
    table = bench.format_table({**s, "cross_version_prefix_hits_salted": 0,
                                "cross_version_prefix_hits_unsalted": 48})
    assert "recompute" in table and "cross-version prefix hits" in table


def test_summarize_computes_retained_and_the_lost_engine_time() -> None:
    def phase(mode: str, tokens: int, stalls: list[float]) -> dict[str, Any]:
        return {"mode": mode, "window_s": 10.0, "tokens": tokens, "rollouts": 5,
                "lengths": [1, 2, 3], "unattributable": 0, "over_bound": 0, "failed": 0,
                "recomputed_tokens": 7 if mode == "recompute" else 0,
                "derived_disagrees": 0, "staleness": {"0": 4, "1": 1},
                "updates": [{"ok": True, "total_s": x, "transition_s": x / 2} for x in stalls],
                "lost_s": [2 * x for x in stalls]}

    s = bench.summarize([phase("none", 1000, []), phase("keep", 900, [0.1, 0.3]),
                         phase("recompute", 800, [0.2])], period_s=5.0, concurrency=8)
    assert s["keep"]["retained"] == pytest.approx(0.9)
    assert s["keep"]["lost_s_per_update"] == pytest.approx(0.4)
    assert s["keep"]["lost_within_2x_transition"] is True
    assert s["keep"]["stall_median_s"] == pytest.approx(0.2)
    assert s["keep"]["stall_max_s"] == pytest.approx(0.3)
    assert s["keep"]["max_staleness_seen"] == 1
    assert s["recompute"]["recomputed_tokens"] == 7 and "strict" not in s


def test_engine_time_lost_is_the_deficit_around_each_update_at_the_phase_rate() -> None:
    series = [10] * 100                       # 100 tokens/s in 0.1 s bins
    for i in range(20, 30):
        series[i] = 0                         # a 1 s stall
    ups = [{"t_start": 2.0, "t_end": 2.5}, {"t_start": 6.0, "t_end": 6.2}]
    lost = bench.engine_time_lost(series, 0.0, ups)
    assert lost == [pytest.approx(1.0), pytest.approx(0.0)]
    assert bench.engine_time_lost(series, 0.0, []) == []


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GPU), "--plan", *args], capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "src"),
                                                       "PATH": "/usr/bin:/bin"})


def test_the_h200_plan_fits_one_device_call() -> None:
    r = _plan()
    assert r.returncode == 0, r.stderr
    p = json.loads(r.stdout)
    assert p["fits"] and p["estimated_s"] < 9 * 60 and p["budget_s"] <= 9 * 60
    assert p["phases"] == list(bench.MODES) and p["concurrency"] == 64
    assert p["service_phases"] == ["none", "keep", "recompute"]
    assert p["period_s"] == 5.0 and p["updates_per_phase"] >= 10
    assert p["lengths"] == {"median": 128, "sigma": 1.0, "cap": 2048, "prompt": 128}
    too_long = _plan("--phase-s", "200")
    assert too_long.returncode == 2 and not json.loads(too_long.stdout)["fits"]
    bad = _plan("--cap-tokens", "4096")
    assert bad.returncode == 2 and "max_model_len" in bad.stderr
