"""The demo end to end, as a subprocess, and the CLI's answers to bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rolloutcore.control.journal import first_index, read_journal
from rolloutcore.core.invariants import check_journal


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rolloutcore.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_demo_subprocess_writes_journal(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    p = _cli("demo", "--tokens", "40", "--token-delay-ms", "5", "--json", str(path))
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "DRAINING" in out and "VALIDATING" in out and "published: rc-1" in out
    assert "complete(R-long) before begin_update: True" in out
    recs = read_journal(path)
    assert check_journal(recs) == []
    i_done = first_index(recs, "complete", rollout_id="R-long")
    i_begin = first_index(recs, "begin_update")
    assert 0 <= i_done < i_begin
    long_admit = recs[first_index(recs, "admit", rollout_id="R-long")]
    assert long_admit.data["version"]["label"] == "default"
    commit = [r for r in recs if r.kind == "commit"][-1]
    assert commit.data["identity"]["verification"] == "probe"
    for line in path.read_text().splitlines():
        json.loads(line)


def test_bad_arguments_exit_nonzero_with_message() -> None:
    for args in (["demo", "--tokens", "0"], ["demo", "--tokens", "x"],
                 ["demo", "--token-delay-ms", "-1"], ["nonsense"], []):
        p = _cli(*args)
        assert p.returncode == 2, args
        assert "error" in p.stderr


def test_demo_unwritable_journal_is_a_clear_error(tmp_path: Path) -> None:
    p = _cli("demo", "--json", str(tmp_path / "no" / "such" / "dir" / "j.jsonl"))
    assert p.returncode == 2
    assert "cannot open journal" in p.stderr
