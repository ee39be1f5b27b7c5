"""Group commit: the steps inside an update reach the file with the next sync.

A crash is what the file holds at that moment (every batch is flushed before a
sync returns; nothing else is on disk). At every effect of an update the file
is copied as a crash would leave it, and each copy must restore to the update
in flight failed (TAINTED), with the target's label burned from the moment the
transfer may write it; after the publish every record is on the file.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, read_journal, restore_controller
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.lifecycle import State
from rolloutcore.core.records import Note
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

_EFFECTS = ("drain", "preflight", "transfer", "reset_cache", "validate", "resume")


def _update_with_crash_copies(tmp_path: Path) -> tuple[dict[str, bytes], Journal, Any, Any]:
    path = tmp_path / "journal.jsonl"
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    ad = FakeAdapter(FakeEngine(w0))
    j = Journal(path, defer_s=3600.0)  # only a sync (or close) writes a deferred record
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.defer)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    ad.stage(w1)
    copies: dict[str, bytes] = {}
    for name in _EFFECTS:
        orig = getattr(ad, name)

        def at_effect(*a: Any, _name: str = name, _orig: Any = orig, **kw: Any) -> Any:
            if _name not in copies:  # validate runs twice (paused, live): the first
                copies[_name] = path.read_bytes()
            return _orig(*a, **kw)

        setattr(ad, name, at_effect)
    out = r.run_update(w1.identity())
    return copies, j, out, c


def test_a_crash_at_any_step_of_an_update_restores_tainted_with_its_label_burned(
        tmp_path: Path) -> None:
    copies, j, out, c = _update_with_crash_copies(tmp_path)
    target = out.published
    assert target is not None and set(copies) == set(_EFFECTS)
    j.close()
    for name, data in copies.items():
        crash = tmp_path / f"crash-at-{name}.jsonl"
        crash.write_bytes(data)
        kinds = [r.kind for r in read_journal(crash)]
        assert "request_update" in kinds, name  # synced before the first effect
        # begin_update is on the file before anything can write the target's label
        assert ("begin_update" in kinds) == (name not in ("drain", "preflight")), (name, kinds)
        rc, rj = restore_controller(crash)
        try:
            assert rc.state is State.TAINTED, name
            assert rc.committed is not None and rc.committed.generation == target.generation - 1
            if "begin_update" in kinds:
                # the restarted controller never hands the burned generation out again
                nxt = rc.recovery_target()
                assert nxt.generation > target.generation and nxt.label != target.label, name
        finally:
            rj.close()


def test_an_update_syncs_three_times_and_leaves_no_record_behind(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    ad = FakeAdapter(FakeEngine(w0))
    j = Journal(path, defer_s=3600.0)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.defer)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    ad.stage(w1)
    syncs: list[str] = []
    orig = j.sync

    def counted() -> None:
        # The machine's state (the view shows the publish only once it is on record).
        syncs.append(c._shell.read(lambda: c._shell.machine.state).value)
        orig()

    j.sync = counted  # type: ignore[method-assign]
    out = r.run_update(w1.identity())
    assert out.published is not None
    # request_update (DRAINING), begin_update (UPDATING), the publish (READY): the four
    # steps between them are carried by these syncs, not synced one by one
    assert syncs == ["DRAINING", "UPDATING", "READY"]
    assert c.state is State.READY and c.committed == out.published  # shown once synced
    on_file = [x.seq for x in read_journal(path)]
    assert on_file == [x.seq for x in j.records]  # every record, before run_update returned
    j.close()


def test_a_refused_step_inside_an_update_is_synced_at_once(tmp_path: Path) -> None:
    """A transfer the controller refuses (bad evidence) ends the update: that decision
    (the taint) is on the file when the runner raises, not deferred."""
    import pytest

    from rolloutcore.errors import UpdateFailed

    path = tmp_path / "journal.jsonl"
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    ad = FakeAdapter(FakeEngine(w0))
    j = Journal(path, defer_s=3600.0)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.defer)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    ad.stage(w1)
    orig = ad.transfer

    def incomplete(target: Any) -> Any:
        import dataclasses

        return dataclasses.replace(orig(target), completed=False, mutation_started=True)

    ad.transfer = incomplete  # type: ignore[method-assign]
    with pytest.raises(UpdateFailed):
        r.run_update(w1.identity())
    kinds = [x.kind for x in read_journal(path)]
    assert kinds[-1] != "begin_update" and c.state is State.TAINTED
    assert "taint" in kinds
    j.close()


def test_a_deferred_record_waits_for_a_sync_and_at_most_defer_s(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path, defer_s=3600.0)
    j.defer(Note("deferred", {"i": 1}))
    time.sleep(0.2)  # the writer was not woken for it
    assert read_journal(path) == []
    j.sync()
    assert [x.kind for x in read_journal(path)] == ["note"]
    j.close()
    # with a short defer_s the writer takes it without any sync or close
    path2 = tmp_path / "j2.jsonl"
    j2 = Journal(path2, defer_s=0.05)
    try:
        j2.defer(Note("deferred", {"i": 2}))
        deadline = time.monotonic() + 30
        while not read_journal(path2, live=True) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [x.kind for x in read_journal(path2, live=True)] == ["note"]
    finally:
        j2.close()
    # an urgent record carries the deferred ones before it, in order
    path3 = tmp_path / "j3.jsonl"
    j3 = Journal(path3, defer_s=3600.0)
    try:
        j3.defer(Note("first"))
        j3.write(Note("second"))
        deadline = time.monotonic() + 30
        while len(read_journal(path3, live=True)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [x.record.what for x in read_journal(path3, live=True)] == ["first", "second"]
    finally:
        j3.close()
