"""A fleet gateway restarted on its journals, as ``serve --journal`` restarts one (issue 28).

The pool's journal and every replica's are the one journal format; a restart
reads them like a single gateway's: the fleet's published versions and every
engine's versions continue (no label is given twice), an update in flight at
the crash is recorded as interrupted, and each new engine process is taken
over as the replacement of its replica's previous one, verified like a
recovery. The engines are FakeEngines (new processes: new epochs) under the
real coordinator, controllers and file journals.
"""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from pathlib import Path

import pytest

from fleettools import FakeFleet, fake_fleet, weights
from rolloutcore.control.journal import read_journal
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import FleetRestore, FleetUpdateEnd, ReplicaState
from rolloutcore.errors import BadInput
from rolloutcore.fleet import FleetConfig
from rolloutcore.fleet.serve import check_journal_dir
from rolloutcore.provenance.audit import read_journal_summary
from rolloutcore.testing.fake import FaultKind

S = ReplicaState
CFG = FleetConfig(health_interval_s=0)


def _labels(path: Path) -> list[str]:
    """Every engine label a replica's journal committed, in order."""
    return [r.data["version"]["label"] for r in read_journal(path) if r.kind == "commit"]


def _restored(d: Path, n: int = 3, **kw: object) -> FakeFleet:
    return fake_fleet(n, config=CFG, journal_dir=d, **kw)  # type: ignore[arg-type]


def _wait_kinds(path: Path, kinds: set[str], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and kinds <= {r.kind for r in read_journal(path, live=True)}:
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} never held {kinds}")


def test_a_restart_continues_every_version_and_never_repeats_a_label(tmp_path: Path) -> None:
    f = fake_fleet(3, config=CFG, journal_dir=tmp_path)
    f.coord.update(weights(1))
    f.coord.update(weights(2), strategy="rolling")
    before = {n: _labels(tmp_path / f"{n}.journal.jsonl") for n in f.adapters}
    epochs = {n: f.engine(n).epoch for n in f.adapters}
    f.coord.close()

    g = _restored(tmp_path)  # new engine processes, on the start checkpoint (seed 0)
    try:
        assert [v.label for v in g.coord.versions] == ["fleet-0", "fleet-1", "fleet-2",
                                                       "fleet-3"]
        newest = g.coord.newest
        assert newest is not None and newest.identity.same_weights(weights(0).identity)
        assert sorted(g.coord.serving()) == ["r0", "r1", "r2"]
        (rest,) = g.coord.journal.of(FleetRestore)
        assert rest.new and rest.newest == 2 and rest.generation == 3
        assert rest.interrupted is None and rest.records > 0
        for n in g.adapters:
            c = g.coord.replicas[n].controller
            assert c.state is State.READY and g.engine(n).epoch != epochs[n]
            after = _labels(tmp_path / f"{n}.journal.jsonl")
            assert after[:len(before[n])] == before[n] and len(after) == len(before[n]) + 1
            assert len(set(after)) == len(after)  # an engine label is never given twice
            assert c.committed is not None and c.committed.label == after[-1]
            assert g.coord.view().replicas[int(n[1])].engine_version == c.committed
            recs = read_journal(tmp_path / f"{n}.journal.jsonl")
            assert check_journal(recs) == []
            assert any(r.kind == "restore" for r in recs)
        # the pool's journal is one sequence across both processes
        seqs = [r.seq for r in read_journal(tmp_path / "fleet.jsonl")]
        assert seqs == list(range(1, len(seqs) + 1))
        # and the next update follows the restored versions
        assert g.coord.update(weights(4)).published.label == "fleet-4"
        summary = read_journal_summary(tmp_path)
        assert summary.fleet_versions == {0: "fleet-0", 1: "fleet-1", 2: "fleet-2",
                                          3: "fleet-3", 4: "fleet-4"}
        assert summary.skipped == 0
    finally:
        g.coord.close()


def test_restarted_on_the_newest_weights_it_serves_the_newest_version(tmp_path: Path) -> None:
    f = fake_fleet(2, config=CFG, journal_dir=tmp_path)
    f.coord.update(weights(5))
    f.coord.close()
    g = _restored(tmp_path, 2, start_seed=5)  # the operator starts them on fleet-1's weights
    try:
        assert [v.label for v in g.coord.versions] == ["fleet-0", "fleet-1"]
        (rest,) = g.coord.journal.of(FleetRestore)
        assert not rest.new and rest.generation == 1
        assert {r.generation for r in g.coord.view().replicas} == {1}
        assert sorted(g.coord.serving()) == ["r0", "r1"]
    finally:
        g.coord.close()


def test_a_crash_in_the_middle_of_an_update_restores_it_interrupted(tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    f = fake_fleet(3, config=CFG, journal_dir=live)
    f.adapters["r1"].inject("transfer", FaultKind.HANG)
    th = threading.Thread(target=lambda: _quiet(f), daemon=True)
    th.start()
    # What a SIGKILL leaves: the journals as they are while r1's transfer hangs.
    _wait_kinds(live / "fleet.jsonl", {"fleet_update"})
    for n in f.adapters:
        _wait_kinds(live / f"{n}.journal.jsonl", {"begin_update"})
    crash = tmp_path / "crash"
    shutil.copytree(live, crash)
    th.join(60)
    f.coord.close()

    g = _restored(crash)
    try:
        (rest,) = g.coord.journal.of(FleetRestore)
        # fleet-1 was never published: the new engines hold fleet-0's weights, verified
        assert rest.interrupted == 1 and not rest.new and rest.label == "fleet-0"
        assert not g.coord.journal.of(FleetUpdateEnd)  # the dead process never ended it
        assert sorted(g.coord.serving()) == ["r0", "r1", "r2"]
        for n in g.adapters:
            recs = read_journal(crash / f"{n}.journal.jsonl")
            # the update it was in restores as a failure (TAINTED), then the adoption
            assert any(r.kind == "taint" for r in recs), n
            assert check_journal(recs) == []
            assert g.coord.replicas[n].controller.state is State.READY
    finally:
        g.coord.close()


def _quiet(f: FakeFleet) -> None:
    with contextlib.suppress(Exception):
        f.coord.update(weights(1))


def test_a_new_engine_that_cannot_be_verified_stays_out(tmp_path: Path) -> None:
    f = fake_fleet(3, config=CFG, journal_dir=tmp_path)
    f.coord.update(weights(1))
    f.coord.close()
    g = _restored(tmp_path, adopt_fails=frozenset({"r2"}))
    try:
        assert sorted(g.coord.serving()) == ["r0", "r1"]
        assert g.coord.state_of("r2") is S.FENCED
        assert g.coord.replicas["r2"].controller.state is State.TAINTED
        assert g.coord.newest is not None and g.coord.newest.label == "fleet-2"
    finally:
        g.coord.close()


def test_a_journal_of_other_replicas_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    f = fake_fleet(3, config=CFG, journal_dir=tmp_path)
    f.coord.close()
    pool = tmp_path / "fleet.jsonl"
    size = pool.stat().st_size
    with pytest.raises(BadInput, match="replicas"):
        fake_fleet(2, config=CFG, journal_dir=tmp_path)
    assert pool.stat().st_size == size


def test_serve_checks_the_journal_directory_before_starting_anything(tmp_path: Path) -> None:
    assert check_journal_dir(tmp_path / "new", 2) == 0
    (tmp_path / "afile").write_text("")
    with pytest.raises(BadInput, match="directory"):
        check_journal_dir(tmp_path / "afile", 2)
    # ``serve --engines N`` names its replicas e0..e{N-1}
    d = tmp_path / "fleet"
    d.mkdir()
    f = fake_fleet(2, config=CFG, journal_dir=d)
    f.coord.close()
    for i in range(2):
        (d / f"r{i}.journal.jsonl").rename(d / f"e{i}.journal.jsonl")
    pool = (d / "fleet.jsonl").read_text().replace('"r0"', '"e0"').replace('"r1"', '"e1"')
    (d / "fleet.jsonl").write_text(pool)
    assert check_journal_dir(d, 2) > 0
    with pytest.raises(BadInput, match="cannot restore"):
        check_journal_dir(d, 3)
    (d / "e1.journal.jsonl").rename(d / "gone")
    with pytest.raises(BadInput, match="missing"):
        check_journal_dir(d, 2)
    (d / "gone").rename(d / "e1.journal.jsonl")
    lines = (d / "e1.journal.jsonl").read_text().splitlines(keepends=True)
    lines[1] = "garbage\n"
    (d / "e1.journal.jsonl").write_text("".join(lines))
    with pytest.raises(BadInput, match="bad JSON"):
        check_journal_dir(d, 2)


def test_a_replica_whose_own_journal_is_gone_stays_out(tmp_path: Path) -> None:
    f = fake_fleet(2, config=CFG, journal_dir=tmp_path)
    f.coord.update(weights(1))
    f.coord.close()
    (tmp_path / "r1.journal.jsonl").unlink()
    g = _restored(tmp_path, 2)
    try:
        assert g.coord.serving() == ["r0"]
        assert g.coord.state_of("r1") is S.FENCED
        assert g.coord.replicas["r1"].controller.state is State.UNINITIALIZED
        g.coord.supervise_once()  # nothing heals it into the pool on its own
        assert g.coord.serving() == ["r0"]
    finally:
        g.coord.close()
