"""Controller crash restore from the journal, and recovery from TAINTED (fast lane)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from coretools import drive_to
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, JournalRecord, read_journal, restore_controller
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.errors import AdmissionRefused, UpdateFailed
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeRecoverer, FakeWeights, FaultKind


def _restore(j: Journal) -> tuple[LifecycleController, Journal]:
    j2 = Journal()
    c = LifecycleController.restore(j.records, listener=j2.listener)
    return c, j2


@pytest.mark.parametrize("state", [State.DRAINING, State.QUIESCED, State.UPDATING,
                                   State.INVALIDATING, State.VALIDATING, State.RESUMING])
def test_restore_mid_update_is_tainted_never_resumed(state: State) -> None:
    j = Journal()
    c, _ = drive_to(state, j)
    committed = c.committed
    r, _ = _restore(j)
    assert r.state is State.TAINTED
    assert r.committed == committed
    with pytest.raises(AdmissionRefused):
        r.admit("x")


def test_restore_ready_keeps_versions_and_releases_the_dead_process_bindings() -> None:
    j = Journal()
    c, _ = drive_to(State.RESUMING, j)
    t = c.current_ticket
    assert t is not None
    from coretools import resume_ev

    c.resumed(t, resume_ev())
    c.admit("a")
    c.admit("b")
    c.complete("a")
    r, j2 = _restore(j)
    assert r.state is State.READY
    assert r.committed == c.committed and r.identity == c.identity
    # "b" was bound by the process that wrote the journal: released, not attributable.
    assert r.active == {}
    done = [x for x in j2.records if x.kind == "complete"]
    assert [(x.data["rollout_id"], x.data["attributable"]) for x in done] == [("b", False)]
    assert done[0].data["version"] == c.committed.to_dict()  # type: ignore[union-attr]
    assert [v.label for v in r.published] == ["rc-0", "rc-1"]
    nxt = r.request_update(c.identity, "trainer")  # type: ignore[arg-type]
    assert nxt.target.version.label == "rc-2"


def test_recovery_after_taint_on_fake_engine() -> None:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0)
    ad = FakeAdapter(eng)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, Deadlines(transfer_s=0.3, cancel_grace_s=0.2, fence_s=0.3),
                        record=j.write)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    old_epoch = eng.epoch
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.DIE)
    with pytest.raises(UpdateFailed):
        r.run_update(w1.identity())
    assert c.state is State.TAINTED
    with pytest.raises(UpdateFailed):
        r.recover(FakeRecoverer(ad, w0, fail=True))
    assert c.state is State.TAINTED
    v = r.recover(FakeRecoverer(ad, w0))
    assert v.accepted and c.state is State.READY
    assert c.committed is not None and c.committed.engine_epoch != old_epoch
    assert c.committed.label == "rc-2"  # rc-1 burnt by the tainted attempt
    assert ad.engine.label == "rc-2"
    b = c.admit("after-recovery")
    assert b.version == c.committed
    c.complete("after-recovery")
    assert check_journal(j.records) == []


def test_controller_process_killed_mid_update_restores_tainted(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    helper = Path(__file__).parent / "helpers" / "controller_proc.py"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with subprocess.Popen([sys.executable, str(helper), str(path)], stdout=subprocess.PIPE,
                          text=True, env=env) as p:
        try:
            assert p.stdout is not None
            line = p.stdout.readline()
            assert "READY-TO-KILL" in line
            os.kill(p.pid, signal.SIGKILL)
        finally:
            p.wait(10)
    recs = read_journal(path)
    assert any(r.kind == "begin_update" for r in recs)
    c, j = restore_controller(path)
    assert c.state is State.TAINTED
    assert c.committed is not None and c.committed.label == "default"
    j.close()
    recs2 = read_journal(path)
    assert recs2[-1].kind == "taint"
    assert check_journal(recs2) == []


def test_torn_last_line_is_cut_on_restore_but_damage_elsewhere_raises(tmp_path: Path) -> None:
    from rolloutcore.errors import JournalError

    path = tmp_path / "j.jsonl"
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    from coretools import boot_ev, ident

    c.bootstrap(boot_ev(), ident(0))
    c.admit("r1")
    j.close()
    good = path.read_bytes()
    path.write_bytes(good + b'{"seq": 99, "kind": "adm')  # the crash cut this write
    with pytest.raises(JournalError, match="torn last line"):
        read_journal(path)
    # a reader of a file still being written leaves the half-written line for later
    assert [x.seq for x in read_journal(path, live=True)] == [x.seq for x in
                                                              read_journal_bytes(good)]
    r, j2 = restore_controller(path)
    j2.close()
    assert r.state is State.READY and r.active == {}
    assert [x.kind for x in read_journal(path)[-2:]] == ["restore", "complete"]
    lines = good.split(b"\n")
    lines[1] = b"garbage"
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(JournalError, match="bad JSON"):
        restore_controller(path)
    with pytest.raises(JournalError, match="bad JSON"):  # damage inside is damage, live or not
        read_journal(path, live=True)


def read_journal_bytes(data: bytes) -> list[JournalRecord]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "j.jsonl"
        p.write_bytes(data)
        return read_journal(p)


def test_labels_never_repeat_across_bootstrap_updates_and_recovery() -> None:
    """An engine already labelled rc-2 continues at generation 2; recovery never reuses a label."""
    from coretools import drain_ev, ident, preflight_ev, recovery_ev
    from rolloutcore.core.evidence import BootstrapEvidence
    from rolloutcore.core.lifecycle import FailureKind, Step
    from rolloutcore.errors import BadInput

    c = LifecycleController()
    ev = BootstrapEvidence(engine_epoch="e1", healthy=True, observed_label="rc-2",
                           label_supported=True)
    c.bootstrap(ev, ident(0), label="rc-2")
    assert c.committed is not None and c.committed.generation == 2
    t = c.request_update(ident(1), "trainer")
    assert t.target.version.label == "rc-3"
    c.drained(t, drain_ev())
    c.preflighted(t, preflight_ev(t))
    c.fail(t, Step.TRANSFER, FailureKind.ERROR, "cut")
    c.begin_recovery("op")
    assert c.recovery_target().label == "rc-4"
    c.recovered(recovery_ev(c, "e2"))
    labels = [v.label for v in c.published]
    assert labels == ["rc-2", "rc-4"] and len(set(labels)) == len(labels)
    with pytest.raises(BadInput):
        c.request_update(ident(2), "trainer", label="rc-3")  # burnt at begin_update


def test_a_stuck_recovery_is_cancelled_through_the_recoverer() -> None:
    import threading

    w0 = FakeWeights.from_seed(0)
    ad = FakeAdapter(FakeEngine(w0))
    c = LifecycleController()
    r = LifecycleRunner(c, ad, Deadlines(recover_s=0.3, cancel_grace_s=2.0))
    ad.stage(w0)
    r.bootstrap(w0.identity())
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.DIE)
    with pytest.raises(UpdateFailed):
        r.run_update(w1.identity())
    assert c.state is State.TAINTED

    class Stuck:
        def __init__(self) -> None:
            self.released = threading.Event()
            self.cancelled = 0

        def replace_engine(self, target: object) -> object:
            self.released.wait(30)
            raise RuntimeError("cancelled")

        def cancel(self) -> None:
            self.cancelled += 1
            self.released.set()

    s = Stuck()
    with pytest.raises(UpdateFailed):
        r.recover(s)  # type: ignore[arg-type]
    assert s.cancelled == 1 and c.state is State.TAINTED
