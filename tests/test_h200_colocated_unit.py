"""The colocated H200 harness's CPU-runnable part (fast lane), before device time is spent.

``diagnostics/gpu/h200_colocated.py`` runs on one H200 with vLLM 0.26; what it
decides and records without a GPU is checked here: the configuration, the
plan (the engine command, the one engine start, the time budget, the device
calls) and the checks that catch a wrong one, the bare sequence, the
memory parsing, and every stage's logic run against the fake engine
(``--selftest``: the same stage functions, the artifact the H200 run writes),
including that each negative control can fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from helpers.scripts import load_script

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200_colocated.py"


def _load() -> Any:
    name = "h200_colocated"
    return load_script(name, HARNESS)


h = _load()


@pytest.mark.parametrize("kw", [
    {"reps_l2": 8}, {"reps_l1": 0}, {"reps_l2": True}, {"gpu_util": 0.9}, {"gpu_util": 0.0},
    {"trainer_fraction": 1.0}, {"probe_tokens": 17}, {"budget_s": 700}, {"skip_param": ""},
    {"ablation_reps": -1},
])
def test_config_refuses_bad_values(kw: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        h.HarnessConfig(**kw)


def _plan(**kw: Any) -> dict[str, Any]:
    cfg = h.HarnessConfig(**kw)
    cmd = ["python3", "-m", "vllm.entrypoints.openai.api_server", "--weight-transfer-config",
           '{"backend": "rc_cuda_ipc"}', *h.engine_args(cfg)]
    return h.build_plan(cfg, engine_command=cmd, tree_bytes=3 << 20,
                        piece_bytes={f".carry/piece-{i:02d}": 52_000_000 for i in range(7)})


def test_the_default_plan_is_valid_and_fits_one_device_call() -> None:
    plan = _plan()
    assert h.validate_plan(plan) == []
    assert plan["engine"]["starts"] == 1
    assert plan["estimate_total_s"] < plan["config"]["budget_s"] < 600
    args = plan["engine"]["args"]
    assert "--enable-sleep-mode" in args and args[args.index("--load-format") + 1] == "dummy"
    assert args[args.index("--worker-extension-cls") + 1] == h.WORKER_EXTENSION
    calls = plan["device_calls"]
    assert [c["carry"] for c in calls] == [[".carry/piece-00", ".carry/MANIFEST"],
                                           *[[f".carry/piece-{i:02d}"] for i in range(1, 7)]]
    run = calls[-1]["command"]
    assert "install_on_device.sh" in run and "h200_colocated.py --out $OUT" in run
    assert "timeout 560" in run and calls[-1]["timeout_s"] <= 600
    assert all(len(c["command"]) <= 2000 and c["bytes"] <= 64 << 20 for c in calls)
    assert set(h.ARTIFACT_KEYS) <= {m for st in plan["stages"] for m in st["measures"]}


def test_plan_checks_catch_each_kind_of_mistake() -> None:
    def broken(edit: Any) -> list[str]:
        plan = json.loads(json.dumps(_plan()))
        edit(plan)
        return h.validate_plan(plan)

    def no_sleep(p: dict[str, Any]) -> None:
        p["engine"]["args"].remove("--enable-sleep-mode")
        p["engine"]["command"].remove("--enable-sleep-mode")

    def other_backend(p: dict[str, Any]) -> None:
        i = p["engine"]["command"].index("--weight-transfer-config")
        p["engine"]["command"][i + 1] = '{"backend": "ipc"}'

    def two_starts(p: dict[str, Any]) -> None:
        p["engine"]["starts"] = 2

    def few_reps(p: dict[str, Any]) -> None:
        p["config"]["reps_l2"] = 5

    def slow(p: dict[str, Any]) -> None:
        p["estimate_total_s"] = 590

    def unmeasured(p: dict[str, Any]) -> None:
        p["stages"][-1]["measures"] = []

    def long_cmd(p: dict[str, Any]) -> None:
        p["device_calls"][-1]["command"] += " " * 2000

    def big(p: dict[str, Any]) -> None:
        p["device_calls"][0]["bytes"] = 70 << 20

    def twice(p: dict[str, Any]) -> None:
        p["device_calls"].append(dict(p["device_calls"][-1]))

    for edit, words in [(no_sleep, "--enable-sleep-mode"), (other_backend, "rc_cuda_ipc"),
                        (two_starts, "exactly once"), (few_reps, "at least 9"),
                        (slow, "budget"), (unmeasured, "update_while_asleep_refused"),
                        (long_cmd, "2000"), (big, "64 MiB"), (twice, "exactly one")]:
        problems = broken(edit)
        assert len(problems) == 1 and words in problems[0], (edit.__name__, problems)


def test_plan_mode_runs_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    assert h.main(["--plan"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PLAN OK")
    plan = json.loads(out[:out.rindex("PLAN OK")])
    cmd = plan["engine"]["command"]
    assert "--enable-sleep-mode" in cmd and '{"backend": "rc_cuda_ipc"}' in cmd
    assert plan["problems"] == []
    assert h.main(["--plan", "--reps-l2", "3"]) == 2  # refused before anything runs


def test_the_bare_sequence_is_the_colocated_order() -> None:
    two = [p for p, _, _ in h.bare_sequence(2)]
    assert two == ["sleep", "train", "wake_weights", "start", "update", "finish",
                   "wake_kv_cache", "reset", "resume"]
    routes = dict((p, (r, q)) for p, r, q in h.bare_sequence(2))
    assert routes["sleep"] == ("/sleep", {"level": "2", "mode": "wait"})
    assert routes["wake_weights"] == ("/wake_up", {"tags": "weights"})
    assert routes["wake_kv_cache"] == ("/wake_up", {"tags": "kv_cache"})
    assert [p for p, _, _ in h.bare_sequence(1)] == ["sleep", "train", "wake", "reset",
                                                     "resume"]
    with pytest.raises(ValueError):
        h.bare_sequence(0)


def test_the_trainer_takes_most_of_the_freed_memory_never_all_that_is_free() -> None:
    gib = 1 << 30
    assert h.trainer_alloc_bytes(120 * gib, 64 * gib, 0.9) == int(64 * gib * 0.9)
    assert h.trainer_alloc_bytes(40 * gib, 64 * gib, 0.9) == int(40 * gib * 0.9)
    assert h.trainer_alloc_bytes(10 * gib, None, 0.5) == 5 * gib
    assert h.trainer_alloc_bytes(0, 64 * gib, 0.9) == 0


def test_nvidia_smi_answers_are_parsed() -> None:
    assert h.parse_smi_gpu("66912, 143771\n") == (66912, 143771)
    assert h.parse_smi_gpu("[N/A], 143771") is None
    assert h.parse_smi_apps("1234, 900\n1234, 100\n5678, 16000\n") == {1234: 1000, 5678: 16000}
    assert h.parse_smi_apps("No running processes found") == {}


def test_selftest_runs_every_stage_on_the_fake_engine(tmp_path: Path) -> None:
    assert h.main(["--selftest", "--out", str(tmp_path)]) == 0
    a = json.loads((tmp_path / h.ARTIFACT_NAME).read_text())
    assert set(h.ARTIFACT_KEYS) <= set(a) and a["problems"] == []
    assert a["coverage"] == 1.0 and a["update_while_asleep_refused"] is True
    assert a["wake_without_update_published"] is False and a["unwritten_param_caught"] is True
    assert a["mem_asleep_mib"] < a["mem_serving_mib"]
    d = a["detail"]
    l2 = d["colocated_l2"]
    assert len(l2["verified"]) == 9 and len(l2["bare"]) == 9
    assert all(r["published"] and r["coverage"] == 1.0 for r in l2["verified"])
    assert [w["tags"] for w in l2["verified"][0]["wakes"]] == ["weights", "kv_cache"]
    assert all(r["same_version"] and r["coverage"] == 1.0
               for r in d["colocated_l1"]["verified"])
    neg = d["negative"]
    assert neg["update_while_asleep"]["sends"] == 0
    assert neg["update_while_asleep"]["adapter"].startswith("TransferError")
    assert neg["wake_without_update"]["state"] == "TAINTED"
    assert neg["unwritten_param"]["whole_check"]["coverage"] == 0.75
    assert (tmp_path / "colocated.md").read_text().startswith("| measure |")
    assert all(st["ok"] for st in d["stages"].values()), d["errors"]
    # The probe-less ablation still verifies every parameter, and publishes.
    nop = d["ablation_probe"]["noprobe"]["verified"]
    assert len(nop) == 5 and all(r["published"] and r["coverage"] == 1.0 for r in nop)
    assert a["verified_l2_noprobe_s"] is not None and a["verified_l2_probe1_s"] is None
    assert "no live probe" in (tmp_path / "colocated.md").read_text()


def test_the_artifact_check_flags_a_control_that_does_not_hold() -> None:
    good = {k: 1.0 for k in h.ARTIFACT_KEYS}
    good.update(update_while_asleep_refused=True, wake_without_update_published=False,
                unwritten_param_caught=True)
    assert h.check_artifact(good) == []
    assert h.check_artifact({**good, "coverage": 0.99}) == ["coverage is 0.99, must be 1.0"]
    assert "published" in h.check_artifact({**good, "wake_without_update_published": True})[0]
    assert h.check_artifact({**good, "bare_l2_s": None}) == ["bare_l2_s was not measured"]


def test_each_negative_control_can_fail() -> None:
    """A guard taken away shows in the control's result, not as a pass."""
    cfg = h.HarnessConfig()

    class NoGuard(h.FakeRig):  # type: ignore[name-defined,misc]
        def stage(self, seed: int, *, probe: bool = True, skip: str | None = None) -> Any:
            ident = super().stage(seed, probe=probe, skip=skip)
            self.adapter.forget_sleep()  # the adapter no longer knows the engine sleeps
            return ident

    rig = NoGuard()
    neg = h.negative_controls(rig, cfg)
    r1 = neg["update_while_asleep"]
    assert r1["refused"] is False and "error" in r1  # the write reached asleep memory
    assert rig.engine.epoch is not None

    class Lenient(h.FakeRig):  # type: ignore[name-defined,misc]
        """Skips nothing when asked to leave a parameter unwritten."""

        def stage(self, seed: int, *, probe: bool = True, skip: str | None = None) -> Any:
            return super().stage(seed, probe=probe, skip=None)

    neg2 = h.negative_controls(Lenient(), cfg)
    assert neg2["unwritten_param"]["caught"] is False
    assert neg2["update_while_asleep"]["refused"] is True
    assert neg2["wake_without_update"]["published"] is False


def test_summary_of_partial_results_names_what_is_missing() -> None:
    a = h.summarize({"colocated_l2": {"verified": [{"published": "rc-1", "total_s": 0.2,
                                                    "coverage": 1.0}],
                                      "bare": [{"total_s": 0.1}]}})
    assert a["verified_l2_s"] == 0.2 and a["bare_l2_s"] == 0.1
    assert a["verified_over_bare"] == pytest.approx(2.0) and a["coverage"] == 1.0
    missing = h.check_artifact(a)
    assert "verified_l1_s was not measured" in missing
    assert "update_while_asleep_refused was not measured" in missing
