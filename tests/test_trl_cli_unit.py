"""``rolloutcore train`` without an engine: its reward, its refusals, its outputs.

The run itself (TRL, vLLM) is tests/engine/test_trl_slow.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rolloutcore.cli import build_parser, main
from rolloutcore.cli.train import TARGET_BYTE, _plot, format_summary, target_reward


def test_the_reward_is_the_fraction_of_target_bytes() -> None:
    a = TARGET_BYTE
    assert target_reward([[a, a, 1, 2], [a], [], [257, a]]) == [0.5, 1.0, 0.0, 0.5]


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "5"], ["train", "--steps", "x"], ["train", "--lr", "0"],
    ["train", "--lr", "-1"], ["train", "--seed", "-3"], ["train", "--min-gain", "nan"],
])
def test_bad_arguments_are_refused_by_the_parser(argv: list[str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    # The train options loaded (a parser without them refuses every option, whatever it is).
    assert build_parser("train").parse_args(["train", "--steps", "12"]).steps == 12
    with pytest.raises(SystemExit) as ei:
        build_parser("train").parse_args(argv)
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments" not in err and "argument --" in err


def test_a_gateway_without_a_token_is_refused_before_anything_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("ROLLOUTCORE_TOKEN", raising=False)
    work = tmp_path / "w"
    rc = main(["train", "--gateway", "http://127.0.0.1:9", "--workdir", str(work), "--quiet"])
    assert rc == 2 and "control token" in capsys.readouterr().err
    assert not work.exists()


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"step": k, "reward": 0.01 * (k + 1), "version": f"rc-{k}", "update_s": 1.0 * (k > 0),
             "drain_s": 0.04 * (k > 0), "generate_s": 0.9, "reward_s": 0.001, "train_s": 0.8,
             "step_s": 2.8} for k in range(n)]


def test_the_plot_is_a_png_with_a_row_per_step(tmp_path: Path) -> None:
    out = _plot(_rows(6), tmp_path / "p.png")
    assert out == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _plot([], tmp_path / "none.png") is None and not (tmp_path / "none.png").exists()


def test_the_summary_has_every_step_the_split_and_the_restart_comparison() -> None:
    rows = _rows(6)
    rep = {"rows": rows, "time_split_s": {"generate_s": 0.9, "reward_s": 0.001,
                                          "train_s": 0.8, "update_s": 0.83, "drain_s": 0.03,
                                          "step_s": 2.8},
           "reward_first5": 0.03, "reward_last5": 0.04, "reward_gain": 4 / 3,
           "updates_published": 5, "update_share_of_step": 0.3, "restart_s": 50.0,
           "restart_share_of_step": 0.95, "samples_generated": 192, "samples_recorded": 192,
           "trajectories": "t.jsonl", "journal": "j.jsonl", "plot": "p.png",
           "audit": {"table": "audit of t.jsonl: OK"}}
    text = format_summary(rep)
    for k in range(1, 7):
        assert f"\n{k:>4}  " in text
    assert "share of the step spent updating: 30.0%" in text
    assert "a vLLM restart per step (50.0 s" in text and "95.0% of the step" in text
    assert text.rstrip().endswith("audit of t.jsonl: OK")


def test_a_journal_is_only_taken_with_a_gateway(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    work = tmp_path / "w"
    rc = main(["train", "--journal", str(tmp_path / "j"), "--workdir", str(work), "--quiet"])
    assert rc == 2 and "--journal is for --gateway" in capsys.readouterr().err
    assert not work.exists()


def test_the_plot_s_step_axis_has_whole_steps_only() -> None:
    """#29: the step axis had ticks at 1.25, 1.5, ... (a step is a whole optimizer step)."""
    import matplotlib.pyplot as plt

    from rolloutcore.cli.train import _figure

    for n in (2, 3, 7):
        fig = _figure(_rows(n))
        try:
            for ax in fig.axes:
                lo, hi = ax.get_xlim()
                ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
                assert ticks and all(float(t).is_integer() for t in ticks), (n, ticks)
        finally:
            plt.close(fig)


# --------------------------------------------------------------------------- Ctrl-C (#29)

def _workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Any]:
    """A work directory holding the start checkpoint of a tiny model, and that model."""
    from helpers.trl_fakes import Tiny, write_checkpoint

    work = tmp_path / "w"
    work.mkdir()
    model = Tiny()
    write_checkpoint(work / "policy-0", model)
    _no_imports(monkeypatch)
    return work, model


def _no_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRL, torch and transformers stand-ins: these tests never reach TRL's trainer."""
    from types import SimpleNamespace

    from rolloutcore.cli import train

    monkeypatch.setattr(train, "_imports", lambda: (
        SimpleNamespace(__version__="trl-test"), None,
        SimpleNamespace(__version__="tf-test"), None))


def test_ctrl_c_during_the_engine_start_exits_130_with_the_report(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The engine start is announced (with the engine's own progress), and a Ctrl-C
    there still ends with exit 130 and a report that says where it stopped."""
    from helpers.trl_fakes import Tiny, write_checkpoint
    from rolloutcore.cli import train

    work = tmp_path / "w"
    work.mkdir()
    write_checkpoint(work / "policy-0", Tiny())
    _no_imports(monkeypatch)
    asked: dict[str, Any] = {}

    def launch(ckpt: Path, run: str, traj: Path, journal: Path, progress: bool,
               lora_rank: int | None = None) -> Any:
        asked["progress"] = progress
        asked["announced"] = "[3/4] starting vLLM" in capsys.readouterr().out
        raise KeyboardInterrupt

    monkeypatch.setattr(train, "_launch", launch)
    rc = main(["train", "--workdir", str(work)])
    out, err = capsys.readouterr()
    assert rc == 130 and asked == {"progress": True, "announced": True}
    rep = json.loads((work / "report.json").read_text())
    assert rep["interrupted"]["phase"] == "engine_start"
    assert rep["interrupted"]["steps_finished"] == 0 and rep["steps"] == 0
    assert rep["engine"] is None and rep["audit"] is None and rep["plot"] is None
    assert "INTERRUPTED (Ctrl-C) during engine_start" in out and "interrupted" in err


def test_ctrl_c_during_an_update_exits_130_with_the_report_plot_audit_and_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """#29: an interrupted run wrote no report, plot or audit for the steps it finished,
    and its journal did not say what was interrupted. Three steps finish on the fake
    session, the fourth's update is interrupted while its weights are sent."""
    from helpers.trl_fakes import (
        FakeSession,
        calls,
        make_trainer,
        prompts,
        sigint_when,
        train_step,
    )
    from rolloutcore.cli import train
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.records import Interrupted, RequestUpdate
    from rolloutcore.integrations.trl import RolloutCoreRollout
    from rolloutcore.integrations.trl.engines import _SessionEngine
    from rolloutcore.testing.fake import FaultKind

    work, model = _workdir(tmp_path, monkeypatch)
    made: dict[str, Any] = {}

    def launch(ckpt: Path, run: str, traj: Path, journal: Path, progress: bool,
               lora_rank: int | None = None) -> Any:
        made["session"] = s = FakeSession(ckpt, run, journal=journal)
        return RolloutCoreRollout(_SessionEngine(s, owns=True), checkpoint=ckpt, run=run,
                                  trajectories=traj, probe=False)

    def fake_train(rollout: Any, ckpt: Path, *a: Any, rows: list[dict[str, Any]],
                   at: dict[str, Any], **kw: Any) -> float:
        at["phase"] = "training"
        trainer = make_trainer(model)
        for k in range(3):
            at["step"] = k
            rollout(prompts(), trainer)
            rows.append({"step": k, "reward": 0.1 * k, "version": rollout.version.label,
                         "update_s": 0.5 * (k > 0), "drain_s": 0.01 * (k > 0),
                         "generate_s": 0.2, "reward_s": 0.001, "train_s": 0.3,
                         "record_s": 0.01, "step_s": 1.0})
            train_step(model, trainer)
        at["step"] = 3
        c = made["session"].controller
        made["session"].vllm.inject("transfer", FaultKind.HANG)
        sigint_when(lambda st: c.state.value == "UPDATING"
                    and calls(st, "LifecycleRunner._effect",
                              "rolloutcore.control.effects.Job.wait"))
        rollout(prompts(), trainer)
        raise AssertionError("not interrupted")

    monkeypatch.setattr(train, "_launch", launch)
    monkeypatch.setattr(train, "_train", fake_train)
    rc = main(["train", "--workdir", str(work), "--steps", "10"])
    out, err = capsys.readouterr()
    assert rc == 130, (out, err)
    rep = json.loads((work / "report.json").read_text())
    stop = rep["interrupted"]
    assert (stop["phase"], stop["step"], stop["steps_finished"]) == ("update", 3, 3)
    assert stop["rollout"]["update"]["classification"] == "ambiguous"
    assert rep["steps"] == 3 and len(rep["rows"]) == 3 and rep["updates_published"] == 2
    assert rep["engine"]["state"] == "TAINTED" and made["session"].closed
    assert (work / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    audit = json.loads((work / "audit.json").read_text())
    assert audit["ok"] and audit["purity"]["samples"] == 3 * 8
    (inter,) = audit["purity"]["journal"]["interruptions"]
    recs = [r.record for r in read_journal(work / "journal.jsonl")]
    req = [r for r in recs if type(r) is RequestUpdate][-1]
    last = recs[-1]
    assert isinstance(last, Interrupted) and last.update_id == req.update_id == inter["update_id"]
    assert (last.phase, last.step, last.state.value) == ("update", 3, "TAINTED")
    assert "INTERRUPTED (Ctrl-C) during update of step 4" in out
    assert "interrupted: KeyboardInterrupt during update at global_step 3" in out
    assert "rolloutcore train: interrupted during update" in err


def test_a_run_that_finishes_exits_0_and_its_journal_has_no_interruption(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The uninterrupted path through the same finishing: exit 0, no ``interrupted``."""
    from helpers.trl_fakes import (
        FakeSession,
        make_trainer,
        prompts,
        train_step,
    )
    from rolloutcore.cli import train
    from rolloutcore.control.journal import read_journal
    from rolloutcore.integrations.trl import RolloutCoreRollout
    from rolloutcore.integrations.trl.engines import _SessionEngine

    work, model = _workdir(tmp_path, monkeypatch)

    def launch(ckpt: Path, run: str, traj: Path, journal: Path, progress: bool,
               lora_rank: int | None = None) -> Any:
        return RolloutCoreRollout(_SessionEngine(FakeSession(ckpt, run, journal=journal),
                                                 owns=True), checkpoint=ckpt, run=run,
                                  trajectories=traj, probe=False)

    def fake_train(rollout: Any, ckpt: Path, *a: Any, rows: list[dict[str, Any]],
                   at: dict[str, Any], steps: int, **kw: Any) -> float:
        trainer = make_trainer(model)
        for k in range(steps):
            rollout(prompts(), trainer)
            rows.append({"step": k, "reward": 0.01 * (k + 1) ** 2, "version": rollout.version.label,
                         "update_s": 0.5, "drain_s": 0.01, "generate_s": 0.2,
                         "reward_s": 0.001, "train_s": 0.3, "record_s": 0.01, "step_s": 1.0})
            train_step(model, trainer)
        return 1.0

    monkeypatch.setattr(train, "_launch", launch)
    monkeypatch.setattr(train, "_train", fake_train)
    rc = main(["train", "--workdir", str(work), "--steps", "10"])
    out, err = capsys.readouterr()
    assert rc == 0, (out[-3000:], err)
    rep = json.loads((work / "report.json").read_text())
    assert rep["interrupted"] is None and rep["steps"] == 10 and rep["audit"]["ok"]
    assert (work / "reward.png").exists() and (work / "audit.json").exists()
    assert "INTERRUPTED" not in out
    assert "interrupted" not in [r.kind for r in read_journal(work / "journal.jsonl")]
