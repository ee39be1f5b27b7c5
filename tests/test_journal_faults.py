"""The journal on real files that fail: a full filesystem, a reader that stops reading.

The filesystem is a 64 KiB tmpfs (root can mount one here and in CI); where
mounting is refused the journal is written to ``/dev/full`` instead, which
fails every flush with ENOSPC. Either way the claims are the same: the
controller's state stays consistent, every step after the failure is refused
with a clear error, and every record it accepted is either in the file or
the failure was reported: nothing is lost silently.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from coretools import boot_ev, ident
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, read_journal, repair_journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.records import SCHEMA_VERSION, Admit, Commit, JournalRecord, Note
from rolloutcore.errors import AdmissionRefused, JournalError, UpdateFailed, UpdateRefused
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

PAGE = 4096


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path | None]:
    """A 64 KiB tmpfs, or None when it cannot be mounted (then use /dev/full)."""
    d = tmp_path / "fs"
    d.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)],
        capture_output=True, check=False).returncode == 0
    try:
        yield d if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, check=False)


def _fill(d: Path, leave_pages: int = 0) -> None:
    """Use up every free block of the filesystem at ``d`` but ``leave_pages``."""
    fd = os.open(d / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * PAGE)
        os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave_pages * PAGE))
    finally:
        os.close(fd)


def _journal_path(fs: Path | None) -> str:
    return str(fs / "journal.jsonl") if fs is not None else "/dev/full"


def _on_disk(path: str, tmp: Path) -> list:  # type: ignore[type-arg]
    """The journal as the file has it (a torn last line cut, as a restart would)."""
    if path == "/dev/full":
        return []
    copy = tmp / "journal-copy.jsonl"
    shutil.copyfile(path, copy)
    repair_journal(copy)
    return read_journal(copy)


def _assert_prefix(disk: list, memory: list) -> None:  # type: ignore[type-arg]
    """What the file has is exactly the first records the journal accepted."""
    assert [r.seq for r in disk] == list(range(1, len(disk) + 1))
    assert [r.to_json() for r in disk] == [r.to_json() for r in memory[:len(disk)]]


def _refuses_everything(c: LifecycleController) -> None:
    reason = c.failed_closed
    assert reason
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("after-the-failure")
    assert ei.value.retry_after_s is None and "failed closed" in ei.value.reason
    with pytest.raises(UpdateRefused, match="failed closed"):
        c.request_update(ident(7), "trainer")
    if c.state is State.TAINTED:
        with pytest.raises(JournalError, match="failed closed"):
            c.begin_recovery("operator")
    elif c.state is not State.READY:
        t = c.current_ticket
        with pytest.raises(JournalError, match="failed closed"):
            c.fail(t, Step.RESTART, FailureKind.ERROR, "x")


def test_data_plane_fills_the_disk(small_fs: Path | None, tmp_path: Path) -> None:
    path = _journal_path(small_fs)
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    if small_fs is None:
        with pytest.raises(JournalError, match="No space left"):
            c.bootstrap(boot_ev(), ident(0))
        _refuses_everything(c)
        return
    c.bootstrap(boot_ev(), ident(0))
    _fill(small_fs)
    admitted: list[str] = []
    for i in range(5000):
        try:
            b = c.admit(f"r-{i}")
        except AdmissionRefused:
            break
        admitted.append(b.rollout_id or "")
        if i % 2:
            c.complete(f"r-{i - 1}")
    else:
        pytest.fail("the disk never filled")
    assert "No space left" in (c.failed_closed or "")
    assert j.failed and "No space left" in j.failed
    _refuses_everything(c)
    # The in-memory state is whole: READY, nothing half done, bindings as admitted.
    snap = c.snapshot()
    assert snap["state"] == "READY" and snap["update"] is None
    assert set(c.active) <= set(admitted)
    # A release still works (it decides nothing) and says nothing false.
    for rid in list(c.active):
        assert c.complete(rid).attributable
    j.close()
    disk = _on_disk(path, tmp_path)
    _assert_prefix(disk, j.records)
    # The admissions in the file are the first ones made; those after them were made
    # while the disk failed, and that failure was reported (failed_closed above).
    disk_order = [r.record.rollout_id for r in disk if isinstance(r.record, Admit)]
    assert admitted[:len(disk_order)] == disk_order
    assert check_journal(disk) == []
    r = LifecycleController.restore(disk)
    assert r.state is State.READY and r.committed == c.committed


#: Bytes left on the disk when the update starts: it fills in DRAINING, QUIESCED,
#: UPDATING, INVALIDATING, VALIDATING, at the publish (READY), or not at all.
@pytest.mark.parametrize("room", [0, 1000, 2000, 5000, 7000, 9000, 12000])
def test_an_update_meets_a_full_disk(small_fs: Path | None, tmp_path: Path, room: int) -> None:
    """The disk fills at a different step of the update for each ``room`` (bytes left)."""
    if small_fs is None and room:
        pytest.skip("without a small filesystem only the /dev/full case runs")
    path = _journal_path(small_fs)
    w0 = FakeWeights.from_seed(0)
    ad = FakeAdapter(FakeEngine(w0))
    ad.stage(w0)
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, Deadlines(retry_backoff_s=0.01), record=j.write)
    if small_fs is None:
        with pytest.raises(JournalError):
            r.bootstrap(w0.identity())
        _refuses_everything(c)
        return
    r.bootstrap(w0.identity())
    _fill(small_fs, room // PAGE)
    room %= PAGE
    # Pad the journal so that about ``room`` bytes (and the pages left) remain.
    size = os.path.getsize(path)
    overhead = len(JournalRecord(len(j.records) + 1, time.monotonic(), time.time(),
                                 Note("pad", {"x": ""})).to_json()) + 8  # + clock digits
    pad = PAGE - size % PAGE - room
    if pad > overhead:
        j.write(Note("pad", {"x": "p" * (pad - overhead)}))
        j.sync()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    try:
        out = r.run_update(w1.identity())
    except UpdateFailed as exc:
        # The runner classifies the journal's failure like any other (#16): the
        # caller gets UpdateFailed, naming it, with the update ended.
        assert "No space left" in str(exc) or "failed closed" in str(exc)
        assert exc.classification == "ambiguous"
        out = None
    if out is not None:  # the update fitted
        assert c.failed_closed is None and c.committed == out.published
        j.close()
        assert check_journal(_on_disk(path, tmp_path)) == []
        return
    assert "No space left" in (c.failed_closed or "")
    _refuses_everything(c)
    snap = c.snapshot()
    # Whole, whatever step it reached, and ended: a failure the controller cannot
    # record is ambiguous, so the update is over, TAINTED (in memory; the file may
    # lack the taint) and the engine fenced, rather than left open refusing every
    # later begin as "in progress" (#16).
    assert snap["update"] is None and c.state is State.TAINTED
    assert ad.engine.paused
    assert c.active == {}
    j.close()
    disk = _on_disk(path, tmp_path)
    _assert_prefix(disk, j.records)
    assert check_journal(disk) == []
    restored = LifecycleController.restore(disk)
    commits = [x.record.version for x in disk if isinstance(x.record, Commit)]
    assert restored.committed == commits[-1]
    # Restored from what the file has: the old version, the new one if its commit made
    # it, or TAINTED when the file ends mid-update; never a version the file lacks.
    assert restored.state in (State.READY, State.TAINTED)
    assert restored.committed in (c.published[0], c.committed)


def test_admission_does_not_wait_for_a_stalled_writer(tmp_path: Path) -> None:
    """A reader that stops reading (a FIFO) stalls the writer; admissions go on."""
    fifo = tmp_path / "journal.fifo"
    os.mkfifo(fifo)
    release = threading.Event()
    got: list[bytes] = []

    def reader() -> None:
        with open(fifo, "rb") as f:
            release.wait(60)
            got.append(f.read())

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    j = Journal(fifo)
    c = LifecycleController(listener=j.listener)
    c.bootstrap(boot_ev(), ident(0))
    done = threading.Event()

    def admissions() -> None:
        for i in range(1500):  # far more than the pipe holds: the writer blocks
            c.admit(f"r-{i}")
            c.complete(f"r-{i}")
        done.set()

    a = threading.Thread(target=admissions, daemon=True)
    a.start()
    assert done.wait(60), "admissions waited for the disk"
    assert not release.is_set() and c.failed_closed is None
    release.set()
    j.sync()
    j.close()
    th.join(60)
    lines = got[0].decode().splitlines()
    assert len(lines) == len(j.records) == 4 + 3000  # evidence, commit, transition, verdict
    assert all(f'"v": {SCHEMA_VERSION}' in line for line in lines)


def test_a_full_queue_fails_closed_after_its_timeout(tmp_path: Path) -> None:
    fifo = tmp_path / "journal.fifo"
    os.mkfifo(fifo)
    release = threading.Event()

    def reader() -> None:
        with open(fifo, "rb") as f:
            release.wait(60)
            f.read()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    j = Journal(fifo, queue_max=8, put_timeout_s=0.2)
    c = LifecycleController(listener=j.listener)
    c.bootstrap(boot_ev(), ident(0))
    with pytest.raises(AdmissionRefused, match="queue full"):
        for i in range(100_000):
            c.admit(f"r-{i}")
    assert "queue full" in (c.failed_closed or "")
    with pytest.raises(JournalError, match="queue full"):
        j.write(Note("late"))
    release.set()
    j.close()
    th.join(60)


def test_a_failing_listener_fails_closed_and_the_step_says_so() -> None:
    """Any listener that raises: the decision stands whole, the next step is refused."""
    seen: list[object] = []

    def flaky(rec: object) -> None:
        seen.append(rec)
        if isinstance(rec, Commit) and len(seen) > 5:
            raise OSError(errno.EIO, "input/output error")

    c = LifecycleController(listener=flaky)
    c.bootstrap(boot_ev(), ident(0))
    t = c.request_update(ident(1), "trainer")
    from coretools import (
        drain_ev,
        preflight_ev,
        reset_ev,
        resume_ev,
        transfer_ev,
        validation_ev,
    )
    from rolloutcore.core.evidence import CacheKind

    c.drained(t, drain_ev())
    c.preflighted(t, preflight_ev(t))
    c.transferred(t, transfer_ev(t))
    for k in CacheKind:
        c.invalidated(t, reset_ev(k))
    c.validated(t, validation_ev(t))
    with pytest.raises(JournalError, match="input/output error"):
        c.resumed(t, resume_ev())
    # The publish was decided whole (committed, READY, no update left over)...
    assert c.state is State.READY and c.current_ticket is None
    assert c.committed is not None and c.committed.label == "rc-1"
    # ...and nothing after it is: the records say less than memory, so it stops here.
    _refuses_everything(c)


def _held_by_me(lock: Any) -> bool:
    """Whether the calling thread holds ``lock`` (another thread cannot take it now)."""
    got: list[bool] = []

    def probe() -> None:
        ok = lock.acquire(timeout=0.0)
        got.append(ok)
        if ok:
            lock.release()

    th = threading.Thread(target=probe)
    th.start()
    th.join(5)
    return not (got and got[0])


def test_a_fleet_on_a_full_disk_writes_no_record_under_a_lock_and_strands_nothing(
        small_fs: Path | None, tmp_path: Path) -> None:
    """The pool's journal and every replica's on a 64 KiB filesystem that fills up while
    requests and updates run: every record is written with no shell's lock held (the
    pool's or any controller's), the fleet fails closed, and no replica is left in an
    update."""
    from fleettools import fake_fleet, weights
    from rolloutcore.core.pool import ReplicaState

    if small_fs is None:
        pytest.skip("a tmpfs cannot be mounted here")
    f = fake_fleet(2, journal_dir=small_fs)
    try:
        locks = [f.coord._shell._lock] + [r.controller._shell._lock
                                          for r in f.coord.replicas.values()]
        under_lock: list[str] = []
        journals = [f.coord.journal, *f.journals.values()]
        for j in journals:
            orig = j.write

            def checked(rec: Any, orig: Any = orig, **kw: Any) -> Any:
                if any(_held_by_me(lk) for lk in locks):
                    under_lock.append(rec.KIND)
                return orig(rec, **kw)

            j.write = checked  # type: ignore[method-assign]
        _fill(small_fs, leave_pages=2)
        seed = 1
        for _ in range(400):
            for name, rep in f.coord.replicas.items():
                c = rep.controller
                with contextlib.suppress(AdmissionRefused):
                    c.admit(f"{name}-{seed}")
                    c.complete(f"{name}-{seed}")
            with contextlib.suppress(Exception):
                f.coord.update(weights(seed % 3 + 1), strategy="rolling" if seed % 2 else
                               "synchronous")
            seed += 1
            failed = [j.failed for j in journals if j.failed]
            if failed and (f.coord.failed_closed or all(
                    r.controller.failed_closed for r in f.coord.replicas.values())):
                break
        else:
            pytest.fail(f"the disk never filled: {[j.failed for j in journals]}, "
                        f"{f.coord.status()}")
        assert under_lock == []
        assert "No space left" in " ".join(str(j.failed) for j in journals if j.failed)
        assert ReplicaState.UPDATING not in {f.coord.state_of(n) for n in f.adapters}
        for rep in f.coord.replicas.values():
            assert rep.controller.current_ticket is None
        st = f.coord.status()
        assert st["failed_closed"] or all(r["engine_failed_closed"] for r in st["replicas"])
        assert f.coord.view().closed is not None or f.coord.serving() == []
    finally:
        with contextlib.suppress(Exception):
            f.coord.close()
        for j in f.journals.values():
            with contextlib.suppress(Exception):
                j.close()
