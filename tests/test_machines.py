"""The shell (``control.shell``) and the two machines besides the engine's (pool, leases).

Each machine is walked over every (state, event) pair with the whole state
compared: a legal pair reaches the table's target and records it, an
illegal one raises ``InvalidTransition`` and changes nothing (not even the
outbox). The shell is checked for what it promises: records delivered in
order, outside its lock; a failing listener fails the machine closed; a
refusal raises after its records were handed on; snapshots published after
every call; waiters woken on the injected clock.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from coretools import ident
from rolloutcore.control.shell import Shell
from rolloutcore.core.lease import (
    FINAL,
    LEASE_TRANSITIONS,
    LeaseChange,
    LeaseEvent,
    LeaseState,
    LeaseTable,
)
from rolloutcore.core.pool import (
    REPLICA_TRANSITIONS,
    FleetUpdateBegin,
    FleetVersion,
    ReplicaEvent,
    ReplicaState,
    ReplicaStateChange,
    ReplicaTable,
    Strategy,
)
from rolloutcore.core.versions import WeightVersion
from rolloutcore.errors import BadInput, InvalidTransition, JournalError, UpdateRefused

V0 = WeightVersion(0, "default", "epoch-a")


# --------------------------------------------------------------------------- the pool

def _pool_in(state: ReplicaState) -> ReplicaTable:
    """A one-replica pool whose replica is in ``state`` (reached through the table)."""
    t = ReplicaTable(["r0"])
    t.bootstrap(FleetVersion(0, "fleet-0", ident(0)))
    path = {
        ReplicaState.JOINING: [],
        ReplicaState.SERVING: [ReplicaEvent.BOOTSTRAPPED],
        ReplicaState.UPDATING: [ReplicaEvent.BOOTSTRAPPED, ReplicaEvent.SELECTED],
        ReplicaState.FENCED: [ReplicaEvent.FAILED],
        ReplicaState.RECOVERING: [ReplicaEvent.FAILED, ReplicaEvent.RECOVER],
        ReplicaState.REJOINING: [ReplicaEvent.FAILED, ReplicaEvent.REJOIN],
        ReplicaState.REMOVED: [ReplicaEvent.REMOVE],
    }[state]
    for ev in path:
        gen = 0 if ev in (ReplicaEvent.BOOTSTRAPPED, ReplicaEvent.REJOINED) else None
        t.move("r0", ev, generation=gen, engine_version=V0 if gen is not None else None)
    t.take()
    return t


@pytest.mark.parametrize("state", list(ReplicaState))
@pytest.mark.parametrize("event", list(ReplicaEvent))
def test_every_pool_pair_follows_the_table_or_changes_nothing(
        state: ReplicaState, event: ReplicaEvent) -> None:
    t = _pool_in(state)
    before = t.view()
    target = REPLICA_TRANSITIONS.get((state, event))
    kw: dict[str, Any] = {}
    if event in (ReplicaEvent.BOOTSTRAPPED, ReplicaEvent.PASSED, ReplicaEvent.REJOINED,
                 ReplicaEvent.KEPT):
        kw = {"generation": 0, "engine_version": V0}
    if target is None:
        with pytest.raises(InvalidTransition):
            t.move("r0", event, **kw)
        assert t.view() == before and t.take() == []
        return
    assert t.move("r0", event, **kw) is target
    e = t.entry("r0")
    assert e.state is target and e.in_pool == (target is ReplicaState.SERVING)
    (rec,) = t.take()
    assert isinstance(rec, ReplicaStateChange)
    assert (rec.before, rec.after, rec.event) == (state, target, event)


def test_a_replica_enters_the_pool_only_with_its_version_and_engine_version() -> None:
    t = _pool_in(ReplicaState.JOINING)
    for kw in ({}, {"generation": 0}, {"engine_version": V0},
               {"generation": 5, "engine_version": V0}):
        with pytest.raises(BadInput):
            t.move("r0", ReplicaEvent.BOOTSTRAPPED, **kw)
    assert t.entry("r0").state is ReplicaState.JOINING and t.take() == []


def test_a_supervisor_finding_about_a_replica_an_update_took_is_moot() -> None:
    t = _pool_in(ReplicaState.UPDATING)
    assert t.move("r0", ReplicaEvent.TAINTED, only_from=ReplicaState.SERVING) is \
        ReplicaState.UPDATING
    assert t.take() == []


def test_one_update_at_a_time_and_none_once_failed_closed() -> None:
    t = _pool_in(ReplicaState.SERVING)
    rec = FleetUpdateBegin(1, Strategy.ROLLING, 1, "fleet-1", "0" * 64, ("r0",), None, 0,
                           "per-engine")
    t.begin_update(rec)
    with pytest.raises(UpdateRefused, match="one at a time"):
        t.begin_update(FleetUpdateBegin(2, Strategy.ROLLING, 1, "fleet-1b", "0" * 64,
                                        ("r0",), None, 0, "per-engine"))
    t.end_update(1)
    t.fail_closed("disk full")
    with pytest.raises(UpdateRefused, match="failed closed"):
        t.begin_update(rec)
    # A replica still leaves (or enters) an update whatever the journal did.
    assert t.move("r0", ReplicaEvent.SELECTED) is ReplicaState.UPDATING
    assert t.view().failed_closed == "disk full"


# --------------------------------------------------------------------------- the leases

def _lease_in(state: LeaseState) -> LeaseTable:
    t = LeaseTable()
    t.grant(7, "trainer")
    path = {LeaseState.OPEN: [], LeaseState.REPORTING: [LeaseEvent.REPORT],
            LeaseState.EXPIRING: [LeaseEvent.EXPIRE],
            LeaseState.PUBLISHED: [LeaseEvent.REPORT, LeaseEvent.PUBLISHED],
            LeaseState.FAILED: [LeaseEvent.REPORT, LeaseEvent.FAILED],
            LeaseState.EXPIRED: [LeaseEvent.EXPIRE, LeaseEvent.CLASSIFIED]}[state]
    for ev in path:
        nxt = LEASE_TRANSITIONS[(t.get(7).state, ev)]  # type: ignore[union-attr]
        t.move(7, ev, result={"status": nxt.value} if nxt in FINAL else None)
    t.take()
    return t


@pytest.mark.parametrize("state", list(LeaseState))
@pytest.mark.parametrize("event", list(LeaseEvent))
def test_every_lease_pair_follows_the_table_or_changes_nothing(
        state: LeaseState, event: LeaseEvent) -> None:
    t = _lease_in(state)
    before = t.view()
    target = LEASE_TRANSITIONS.get((state, event))
    result = {"status": "x"} if target in FINAL else None
    if target is None:
        with pytest.raises(InvalidTransition):
            t.move(7, event, result=result)
        assert t.view() == before and t.take() == []
        return
    got = t.move(7, event, result=result)
    assert got.state is target and got.final == (target in FINAL)
    (rec,) = t.take()
    assert isinstance(rec, LeaseChange) and (rec.before, rec.after, rec.event) == (
        state, target, event)


def test_an_ending_carries_its_result_and_only_an_ending() -> None:
    t = _lease_in(LeaseState.REPORTING)
    with pytest.raises(BadInput, match="result"):
        t.move(7, LeaseEvent.PUBLISHED)
    t2 = _lease_in(LeaseState.OPEN)
    with pytest.raises(BadInput, match="result"):
        t2.move(7, LeaseEvent.REPORT, result={"status": "early"})
    assert t.get(7).state is LeaseState.REPORTING  # type: ignore[union-attr]


def test_one_lease_is_not_final_at_a_time_and_only_final_ones_are_forgotten() -> None:
    t = _lease_in(LeaseState.EXPIRING)
    with pytest.raises(UpdateRefused, match="one writer"):
        t.grant(8, "other")
    with pytest.raises(InvalidTransition):
        t.forget(7)
    t.move(7, LeaseEvent.CLASSIFIED, result={"status": "expired"})
    t.grant(8, "other")
    t.forget(7)
    assert t.get(7) is None and t.active is not None and t.active.update_id == 8


# --------------------------------------------------------------------------- the shell

class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_records_are_delivered_in_order_outside_the_lock() -> None:
    shell = Shell(LeaseTable(), LeaseTable.view)
    seen: list[tuple[Any, bool]] = []

    def listener(rec: Any) -> None:
        # Another thread can take the lock while this listener runs: it does not hold it.
        got = threading.Event()
        th = threading.Thread(target=lambda: (shell._lock.acquire(), got.set(),
                                              shell._lock.release()))
        th.start()
        th.join(5)
        seen.append((rec, got.is_set()))

    shell.add_listener(listener)
    shell.run(shell.machine.grant, 1, "trainer")
    shell.run(shell.machine.move, 1, LeaseEvent.REPORT)
    assert [r.after for r, _ in seen] == [LeaseState.OPEN, LeaseState.REPORTING]
    assert all(free for _, free in seen)


def test_the_snapshot_is_published_after_every_call_and_watchers_hear_of_it() -> None:
    shell = Shell(LeaseTable(), LeaseTable.view)
    heard: list[int] = []
    shell.watch(lambda: heard.append(len(shell.view)))
    shell.watch(lambda: 1 / 0)           # a broken watcher breaks nothing
    assert shell.view == {}
    shell.run(shell.machine.grant, 1, "trainer")
    assert shell.view[1].state is LeaseState.OPEN and heard == [1]


def test_a_failing_listener_fails_the_machine_closed() -> None:
    shell = Shell(ReplicaTable(["r0"]), ReplicaTable.view)

    def broken(rec: Any) -> None:
        raise OSError("no space left on device")

    shell.add_listener(broken)
    with pytest.raises(JournalError):
        shell.run(shell.machine.bootstrap, FleetVersion(0, "fleet-0", ident(0)))
    assert shell.view.failed_closed and "no space" in shell.view.failed_closed
    # the decision itself was made whole (applied), and the next update is refused
    assert shell.view.newest is not None
    with pytest.raises(UpdateRefused, match="failed closed"):
        shell.run(shell.machine.begin_update, FleetUpdateBegin(
            1, Strategy.SYNCHRONOUS, 1, "fleet-1", "0" * 64, ("r0",), 1, None, "fanout"))


def test_a_refusal_raises_itself_after_its_records_went_out() -> None:
    shell = Shell(LeaseTable(), LeaseTable.view)
    got: list[Any] = []
    shell.add_listener(got.append)
    shell.run(shell.machine.grant, 1, "a")
    with pytest.raises(UpdateRefused):
        shell.run(shell.machine.grant, 2, "b")
    assert [r.update_id for r in got] == [1]


def test_waiters_wake_on_a_decision_and_time_out_on_the_injected_clock() -> None:
    clock = _Clock()
    shell = Shell(LeaseTable(), LeaseTable.view, clock=clock)
    shell.run(shell.machine.grant, 1, "a")
    done = threading.Event()
    out: dict[str, bool] = {}

    def wait() -> None:
        out["r"] = shell.wait_for(lambda m: m.active is None, 60.0)
        done.set()

    th = threading.Thread(target=wait)
    th.start()
    shell.run(shell.machine.move, 1, LeaseEvent.EXPIRE)
    assert not done.wait(0.3)
    shell.run(shell.machine.move, 1, LeaseEvent.CLASSIFIED, result={"status": "expired"})
    assert done.wait(5) and out == {"r": True}
    shell.run(shell.machine.grant, 2, "b")
    gave_up = threading.Event()
    th2 = threading.Thread(target=lambda: shell.wait_for(lambda m: m.active is None, 60.0)
                           or gave_up.set())
    th2.start()
    assert not gave_up.wait(0.3)
    clock.t += 61           # a fake minute passes: the waiter gives up without real waiting
    assert gave_up.wait(5)
