"""A restart costs the state, not the history (#47, symptom 9).

Every request added two journal records and a restart replayed them all
(50,000 requests: 2.3-2.6 s, 100 MiB; 10 M would take minutes and GiBs). The
journal now keeps a snapshot beside the file (``control.journal_snapshot``): a
restart replays it and the file's tail after it. Checked here: what a restart
replays does not grow with the requests served, and the controller it restores
is the one the whole file restores (state, versions, open rollouts, the
admission capacity's count). ``benchmarks/journal_scale.py`` measures it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, open_controller, read_journal
from rolloutcore.control.journal_snapshot import snapshot_path
from rolloutcore.core.evidence import BootstrapEvidence
from rolloutcore.core.records import Compacted
from rolloutcore.testing.fake import FakeWeights


def _serve(path: Path, n: int, *, open_at_end: int = 0, close: bool = True,
           every: int = 5000) -> Journal:
    c, j = open_controller(path)
    j._snapshot_every = every
    if c.committed is None:
        c.bootstrap(BootstrapEvidence(engine_epoch="e1", healthy=True),
                    FakeWeights.from_seed(0).identity())
    for i in range(n):
        c.admit(f"r{i}")
        c.complete(f"r{i}")
    j.sync()
    if open_at_end:
        j._snapshot_every = 10**9  # these are in the tail after the last snapshot
    for i in range(open_at_end):
        c.admit(f"open{i}")
    j.sync()
    if close:
        j.close()
    return j


def _accepted(c: LifecycleController) -> int:
    return int(c._m._accepted)


def _same(a: LifecycleController, b: LifecycleController) -> None:
    sa, sb = a.snapshot(), b.snapshot()
    assert sa == sb
    assert set(a.active) == set(b.active) and _accepted(a) == _accepted(b)


@pytest.mark.parametrize("n", [300, 3000])
def test_a_restart_replays_the_state_not_every_request(tmp_path: Path, n: int) -> None:
    path = tmp_path / "journal.jsonl"
    _serve(path, n)
    assert snapshot_path(path).exists()
    j = Journal(path)
    try:
        recs = j.restore_records()
    finally:
        j.close()
    kinds = [getattr(r, "kind", None) for r in recs]
    assert isinstance(recs[0], Compacted) and recs[0].requests == n
    assert "admit" not in kinds and "complete" not in kinds
    assert len(recs) < 10  # the bootstrap's records: the same for any n
    full = LifecycleController.restore(read_journal(path))
    c, j2 = open_controller(path)
    try:
        _same(c, full)
        assert _accepted(c) == n
    finally:
        j2.close()


def test_after_a_crash_the_tail_is_read_and_open_rollouts_are_released(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    j = _serve(path, 700, open_at_end=3, close=False, every=250)  # killed -9: no close
    j._fh.close()
    j._fh = None
    snap_seq = int(snapshot_path(path).read_text().split('"seq": ')[1].split(",")[0])
    last = read_journal(path)[-1].seq
    assert snap_seq < last  # the tail after the snapshot is the crash's to read
    full = LifecycleController.restore(read_journal(path))
    c, j2 = open_controller(path)
    try:
        _same(c, full)
        assert set(c.active) == set()          # the dead process's rollouts released
        recs = read_journal(path)
        released = [r for r in recs if r.kind == "complete" and r.data["rollout_id"]
                    .startswith("open")]
        assert len(released) == 3 and not any(r.data["attributable"] for r in released)
    finally:
        j2.close()
    # and the next restart, after the clean close, agrees with the whole file again
    c3, j3 = open_controller(path)
    try:
        _same(c3, LifecycleController.restore(read_journal(path)))
    finally:
        j3.close()


def test_a_snapshot_that_does_not_fit_the_file_is_ignored(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    _serve(path, 50)
    snap = snapshot_path(path).read_bytes()
    # Another run's journal under the same name (train deletes its journal and starts
    # again): same size or larger, other first line.
    path.unlink()
    _serve(path, 80)
    snapshot_path(path).write_bytes(snap)   # the stale snapshot
    c, j = open_controller(path)
    try:
        _same(c, LifecycleController.restore(read_journal(path)))
        assert _accepted(c) == 80
    finally:
        j.close()
    # A snapshot past the file's end (the file was cut) is ignored too.
    os.truncate(path, path.stat().st_size // 2)
    from rolloutcore.control.journal import repair_journal

    repair_journal(path)
    c, j = open_controller(path)
    try:
        _same(c, LifecycleController.restore(read_journal(path)))
    finally:
        j.close()


def test_a_device_journal_writes_no_snapshot(tmp_path: Path) -> None:
    j = Journal("/dev/null")
    try:
        from rolloutcore.core.records import Note

        for _ in range(10):
            j.write(Note("x", {}))
        j.sync()
    finally:
        j.close()
    assert not Path("/dev/null.snapshot").exists()
