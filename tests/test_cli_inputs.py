"""``audit`` and ``replay`` never say OK about nothing (#48).

An empty file, a file of garbage, the journal passed as the trajectory file
or the trajectory file as the journal, and a trajectory file without a
committed sample: each is exit 2 with the reason on the first line of
stderr, before anything is audited or any engine is called.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers.trajtools import IDENTITY, make_group, version
from rolloutcore.cli import main
from rolloutcore.control.journal import Journal
from rolloutcore.core.records import Commit
from rolloutcore.provenance.recorder import TrajectoryRecorder

# Nothing listens here: a replay that got as far as the engine would fail otherwise.
NO_ENGINE = "http://127.0.0.1:9"


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    traj, journal = tmp_path / "traj.jsonl", tmp_path / "journal.jsonl"
    with TrajectoryRecorder(traj) as rec:
        rec.append_group(make_group(prompt_index=0, n=4, seed_mode="derived"))
    j = Journal(journal)
    for gen in range(4):
        j.write(Commit(version(gen), IDENTITY))
    j.close()
    garbage, empty = tmp_path / "garbage.jsonl", tmp_path / "empty.jsonl"
    garbage.write_text("hello\nnot json\n{\"a\": 1}\n")
    empty.write_text("")
    uncommitted = tmp_path / "uncommitted.jsonl"   # sample lines without their commit
    uncommitted.write_text("".join(ln for ln in traj.read_text().splitlines(True)
                                   if '"record":"commit"' not in ln.replace(" ", "")))
    return {"traj": traj, "journal": journal, "garbage": garbage, "empty": empty,
            "uncommitted": uncommitted}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], reason: str) -> None:
    assert main(argv) == 2
    cap = capsys.readouterr()
    assert cap.out == ""   # no report, no "OK"
    first = cap.err.splitlines()[0]
    assert first.startswith("rolloutcore: error: ") and reason in first, cap.err


def test_the_fixture_audits_clean(files: dict[str, Path],
                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "--trajectories", str(files["traj"]),
                 "--journal", str(files["journal"])]) == 0
    assert ": OK" in capsys.readouterr().out


@pytest.mark.parametrize(("which", "reason"), [
    ("empty", "is empty"),
    ("garbage", "is not a trajectory file"),
    ("journal", "is a lifecycle journal, not a trajectory file"),
    ("uncommitted", "holds no committed sample"),
])
def test_audit_refuses_a_bad_trajectory_file(files: dict[str, Path], which: str, reason: str,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["audit", "--trajectories", str(files[which])], capsys, reason)


@pytest.mark.parametrize(("which", "reason"), [
    ("empty", "is empty"),
    ("garbage", "is not a lifecycle journal: none of its 3 lines"),
    ("traj", "is a trajectory file, not a lifecycle journal"),
])
def test_audit_refuses_a_bad_journal(files: dict[str, Path], which: str, reason: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    _refused(["audit", "--trajectories", str(files["traj"]), "--journal", str(files[which])],
             capsys, reason)


@pytest.mark.parametrize(("which", "reason"), [
    ("empty", "is empty"),
    ("garbage", "is not a trajectory file"),
    ("journal", "is a lifecycle journal, not a trajectory file"),
    ("uncommitted", "holds no committed sample"),
])
def test_replay_refuses_a_bad_trajectory_file_before_the_engine(
        files: dict[str, Path], which: str, reason: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("httpx")
    _refused(["replay", "--trajectories", str(files[which]), "--engine", NO_ENGINE,
              "--timeout", "1"], capsys, reason)
