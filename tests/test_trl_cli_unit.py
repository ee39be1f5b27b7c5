"""``rolloutcore train`` without an engine: its reward, its refusals, its outputs.

The run itself (TRL, vLLM) is tests/engine/test_trl_slow.py.
"""

from __future__ import annotations

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
def test_bad_arguments_are_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(argv)
    assert ei.value.code == 2


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
