"""A commit is visible only once it is durable (``control.shell``'s ``unrecorded`` mark).

The hole this closes: the shell published the new view and reopened admission
before the journal had confirmed the ``commit`` record on disk, so a client
could be served under version N while a crash (or a failing disk) left a
journal that restores to N-1. Here the journal's sync is held (an ``fsync``
that blocks until the test lets it go) or fails, at the publish of an update,
and a concurrent admission must be refused retryably meanwhile, then admitted
under N once the record is on disk; a sync that fails leaves the engine
TAINTED with N never shown nor admitted under; a replay never sets the mark.
The same shell runs the fleet's pool and the adapter table: their commits wait
the same way.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from coretools import boot_ev, ident
from rolloutcore.control import journal as journal_mod
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, read_journal, restore_controller
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.control.shell import Shell
from rolloutcore.core.adapters import AdapterEvent, AdapterTable, AdapterVersion
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import FleetVersion, ReplicaTable
from rolloutcore.core.records import Admit, Commit, Record
from rolloutcore.errors import AdmissionRefused, JournalError, UpdateFailed
from rolloutcore.service.admission import OneEngine
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

_COMMIT = b'"kind": "commit"'


class _Fsync:
    """``os.fsync`` for the journal module: blocks (``hold``) or fails (``fail``) once the
    file holds ``commits`` commit records; otherwise the real one."""

    def __init__(self, path: Path, commits: int) -> None:
        self.path, self.commits = path, commits
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fail = False
        self.real = os.fsync

    def __call__(self, fd: int) -> None:
        if self.path.exists() and self.path.read_bytes().count(_COMMIT) >= self.commits:
            self.entered.set()
            assert self.release.wait(30), "the test never released the sync"
            if self.fail:
                raise OSError(errno.ENOSPC, "No space left on device")
        self.real(fd)


@pytest.fixture
def update(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
           ) -> Iterator[tuple[LifecycleController, LifecycleRunner, Journal, _Fsync, Any]]:
    """A bootstrapped engine whose journal fsyncs; the second commit's fsync is gated."""
    path = tmp_path / "journal.jsonl"
    gate = _Fsync(path, commits=2)
    monkeypatch.setattr(journal_mod.os, "fsync", gate)
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    ad = FakeAdapter(FakeEngine(w0))
    j = Journal(path, fsync=True)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.defer)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    ad.stage(w1)
    yield c, r, j, gate, w1
    gate.release.set()
    j.close()


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # handed to the test
            out["error"] = exc

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


def test_an_admission_waits_until_the_commit_record_is_on_disk(update: Any) -> None:
    c, r, j, gate, w1 = update
    v0 = c.committed
    wakes: list[int] = []
    gw = OneEngine(c, "http://engine")
    gw.on_change(lambda: wakes.append(1))
    th, out = _in_thread(lambda: r.run_update(w1.identity()))
    assert gate.entered.wait(30), "the publish never synced"
    # The publish is decided, its commit record is being written: not admitted under.
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("during-the-sync")
    assert ei.value.retry_after_s is not None and "being recorded" in ei.value.reason
    assert c.committed == v0 and c.state is State.RESUMING  # the view on record
    assert not gw.worth_retry()                              # the gateway's queue holds it
    assert "during-the-sync" not in c.active
    woken = len(wakes)
    gate.release.set()
    th.join(30)
    assert "error" not in out, out.get("error")
    published = out["value"].published
    assert published is not None and published != v0
    # On disk before the update returned, and the mark cleared as the shell's decision.
    assert any(isinstance(x.record, Commit) and x.record.version == published
               for x in read_journal(j.path))
    assert c.committed == published and c.state is State.READY and gw.worth_retry()
    assert len(wakes) > woken  # the queue was woken when the record was on disk
    b = c.admit("after-the-sync")
    assert b.version == published
    j.sync()
    admits = [x.record for x in read_journal(j.path) if isinstance(x.record, Admit)]
    assert [a.rollout_id for a in admits] == ["after-the-sync"]


def test_a_commit_whose_sync_fails_is_never_shown_nor_admitted_under(update: Any) -> None:
    c, r, j, gate, w1 = update
    v0 = c.committed
    gate.fail = True
    th, out = _in_thread(lambda: r.run_update(w1.identity()))
    assert gate.entered.wait(30)
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("during-the-sync")
    assert ei.value.retry_after_s is not None
    gate.release.set()
    th.join(30)
    assert isinstance(out.get("error"), UpdateFailed), out
    assert out["error"].classification == "ambiguous"
    # Fails closed as before (TAINTED), and the version that never reached the disk
    # does not replace the old one in the view.
    assert c.state is State.TAINTED and c.failed_closed
    assert c.committed == v0 and c.view.committed == v0
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("after-the-failure")
    assert ei.value.retry_after_s is None
    assert c.active == {}
    assert not [x for x in j.records if isinstance(x.record, Admit)]


def test_a_restart_replays_without_the_mark(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    ad = FakeAdapter(FakeEngine(w0))
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.defer)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    ad.stage(w1)
    published = r.run_update(w1.identity()).published
    j.close()
    c2, j2 = restore_controller(path)
    try:
        assert not c2._shell.machine.unrecorded
        assert c2.state is State.READY and c2.committed == published
        assert c2.admit("first-after-restart").version == published
    finally:
        j2.close()
    # The fleet's pool replays its versions without its shell: nothing marked either.
    t = ReplicaTable.replay([], ["r0"])
    assert not t.unrecorded


class _GatedSink:
    """A sink whose ``sync`` waits for ``release`` (and then fails, with ``fail``)."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.release = threading.Event()
        self.release.set()
        self.entered = threading.Event()
        self.fail: str | None = None
        self.syncs = 0
        self._cbs: list[Callable[[str], None]] = []

    def __call__(self, record: Record, *, defer: bool = False) -> None:
        self.records.append(record)

    def sync(self) -> None:
        self.entered.set()
        assert self.release.wait(30)
        self.syncs += 1
        if self.fail is not None:
            raise JournalError(self.fail)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        self._cbs.append(callback)


def test_a_commit_asked_not_to_wait_still_waits_for_its_record() -> None:
    """The trap: a commit made by a call that does not wait would hold the mark for
    ever. The shell waits for the sync whatever the call asked."""
    sink = _GatedSink()
    shell = Shell(ReplicaTable(["r0"]), ReplicaTable.view, listener=sink)
    shell.run(shell.machine.bootstrap, FleetVersion(0, "fleet-0", ident(0)), wait=False)
    assert sink.syncs == 1 and not shell.machine.unrecorded
    assert shell.view.newest is not None and shell.view.newest.label == "fleet-0"


def test_the_pool_shows_a_fleet_version_only_once_it_is_on_record() -> None:
    sink = _GatedSink()
    shell = Shell(ReplicaTable(["r0"]), ReplicaTable.view, listener=sink)
    sink.release.clear()
    recorded: list[int] = []
    shell.on_recorded(lambda: recorded.append(1))
    th, out = _in_thread(lambda: shell.run(shell.machine.bootstrap,
                                           FleetVersion(0, "fleet-0", ident(0))))
    assert sink.entered.wait(30)
    assert shell.machine.unrecorded and shell.view.newest is None and not recorded
    sink.release.set()
    th.join(30)
    assert "error" not in out
    assert shell.view.newest is not None and not shell.machine.unrecorded and recorded


def _adapter(gen: int) -> AdapterVersion:
    return AdapterVersion(gen, f"rcl-a{gen}", f"/adapters/a{gen}", f"{gen:064x}", "rc-0")


def test_an_adapter_is_bound_to_only_once_its_publish_is_on_record() -> None:
    sink = _GatedSink()
    shell = Shell(AdapterTable(), AdapterTable.view, listener=sink)
    t = shell.machine
    for gen in (1, 2):
        v = _adapter(gen)
        shell.run(t.propose, v)
        shell.run(t.move, v.name, AdapterEvent.LOADED)
        if gen == 2:
            sink.release.clear()
        th, out = _in_thread(lambda n=v.name: shell.run(t.move, n, AdapterEvent.VERIFIED))
        if gen == 2:
            assert sink.entered.wait(30)
            # the view still names the adapter on record; a binding is refused, retryably
            assert shell.view.current is not None and shell.view.current.name == "rcl-a1"
            with pytest.raises(AdmissionRefused) as ei:
                shell.run(t.admit, "during", wait=False)
            assert ei.value.retry_after_s is not None
            sink.release.set()
        th.join(30)
        assert "error" not in out, out
    assert shell.view.current is not None and shell.view.current.name == "rcl-a2"
    assert shell.run(t.admit, "after", wait=False).adapter.name == "rcl-a2"


def test_a_failed_commit_sync_keeps_the_mark_and_fails_closed() -> None:
    sink = _GatedSink()
    sink.fail = "No space left on device"
    shell = Shell(ReplicaTable(["r0"]), ReplicaTable.view, listener=sink)
    with pytest.raises(JournalError):
        shell.run(shell.machine.bootstrap, FleetVersion(0, "fleet-0", ident(0)))
    assert shell.machine.unrecorded
    assert shell.view.failed_closed and "No space" in shell.view.failed_closed


def test_an_engine_bootstrap_is_admitted_under_once_on_record() -> None:
    sink = _GatedSink()
    c = LifecycleController(listener=sink)
    sink.release.clear()
    th, out = _in_thread(lambda: c.bootstrap(boot_ev(), ident(0)))
    assert sink.entered.wait(30)
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("early")
    assert ei.value.retry_after_s is not None and c.committed is None
    sink.release.set()
    th.join(30)
    assert out["value"].accepted and c.committed is not None
    assert c.admit("on-time").version == c.committed


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_the_gateway_holds_a_request_until_the_publish_is_on_record() -> None:
    """Through the real gateway (in process, over the FakeEngine): a request that comes
    while the publish's sync is held waits in the queue, reaches no engine, and is
    answered under the new version once the sync returns."""
    import anyio
    import httpx

    from helpers.gateway_rig import AUTH, begin_body, lease, remote_transfer, rig, transfer_body
    from rolloutcore.service.proxy import VERSION_HEADER

    gen = "/inference/v1/generate"
    body = {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 3}}
    async with rig(queue_max=4, queue_wait_s=20) as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        m = r.controller._shell.machine
        entered, release = threading.Event(), threading.Event()
        real_sync = r.journal.sync

        def gated() -> None:
            if m.state is State.READY and m.committed is not None and \
                    m.committed.label == "rc-1":
                entered.set()
                assert release.wait(30)
            real_sync()

        r.journal.sync = gated  # type: ignore[method-assign]
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        ev = remote_transfer(r.adapter, w1, "rc-1")
        results: list[httpx.Response] = []

        async def report() -> None:
            await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(b.json()))

        async def one() -> None:
            results.append(await r.client.post(gen, json=body))

        async with anyio.create_task_group() as tg:
            tg.start_soon(report)
            while not entered.is_set():
                await anyio.sleep(0.005)
            tg.start_soon(one)
            await anyio.sleep(0.3)
            assert results == [] and r.fake.bodies == []  # held: no engine saw it
            assert r.gateway.data.waiting == 1
            release.set()
        assert [x.status_code for x in results] == [200]
        assert results[0].headers[VERSION_HEADER] == "rc-1"
        assert not m.unrecorded


def test_a_commit_made_inside_a_delivery_is_synced_by_that_delivery() -> None:
    """A listener that decides a commit while its record is delivered: the inner call
    cannot sync (its records are the outer loop's to deliver); the delivery that hands
    them on syncs them and clears the mark, even one that did not ask to wait."""
    from rolloutcore.core.pool import FleetUpdateBegin, Strategy

    sink = _GatedSink()
    shell = Shell(ReplicaTable(["r0"]), ReplicaTable.view, listener=sink)
    t = shell.machine
    shell.run(t.bootstrap, FleetVersion(0, "fleet-0", ident(0)))
    begin = FleetUpdateBegin(1, Strategy.SYNCHRONOUS, 1, "fleet-1", "0" * 64, ("r0",), 1,
                             None, "fanout")

    def publish_on_begin(rec: Record) -> None:
        if rec is begin:
            shell.run(t.publish, FleetVersion(1, "fleet-1", ident(1), 1), ["r0"])

    shell.add_listener(publish_on_begin)
    syncs = sink.syncs
    shell.run(t.begin_update, begin, wait=False)
    assert sink.syncs > syncs and not t.unrecorded
    assert shell.view.newest is not None and shell.view.newest.label == "fleet-1"
