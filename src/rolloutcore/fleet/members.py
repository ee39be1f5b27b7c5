"""The fleet coordinator's membership: its replicas, their pool, and the one move.

``FleetMembers`` is the part of ``fleet.coordinator.FleetCoordinator`` every
other part stands on: the replicas and their working memory (``Member``),
the pool's machine in its shell (``core.pool.ReplicaTable`` under
``control.shell.Shell``, journaled), the read-only queries the router and
``/fleet/status`` take from published snapshots without a lock, running a
function on every member at once (``_each``), and the one way a replica
moves in the pool (``_move``). The updates (``fleet.updates``) and the
supervision (``fleet.coordinator``) are built on it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.control.runner import UpdateOutcome
from rolloutcore.control.shell import Shell
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import (
    FleetVersion,
    Keep,
    PoolView,
    ReplicaEvent,
    ReplicaState,
    ReplicaTable,
)
from rolloutcore.core.records import Record, Taint, Transition
from rolloutcore.core.versions import generation_of
from rolloutcore.errors import (
    BadInput,
    JournalError,
)
from rolloutcore.fleet.model import (
    FanoutTransport,
    FleetConfig,
    FleetWeights,
    Replica,
)
from rolloutcore.fleet.routing import FleetView, ReplicaView

__all__ = ["FleetMembers", "Member", "check_fleet_label"]

E, S = ReplicaEvent, ReplicaState
#: Events that put a replica in the pool on the engine version its controller serves.
_ENTERS = frozenset({E.BOOTSTRAPPED, E.PASSED, E.REJOINED})


@dataclass
class Member:
    """Working memory of one replica (not durable: the pool's table holds that)."""

    replica: Replica
    busy: bool = False              # a recovery or rejoin runs on it
    issued: set[str] = field(default_factory=set)
    suspect: bool = False           # the data plane saw its engine refuse a connection
    rebind: bool = False            # recovered, but not yet rebound to the new process
    out: UpdateOutcome | None = None  # its part of the fleet update running now


T = TypeVar("T")


class FleetMembers:
    """The replicas and their pool (see the module docstring); ``FleetCoordinator``'s base.

    ``fanout``: a ``FanoutTransport`` over the replicas' ``fanout_url``s
    (synchronous updates then broadcast once). ``journal_path``: the pool's
    journal (the one journal format; memory only without one), ``journal_keep``
    how many of its records memory holds (``None``: all).
    """

    def __init__(self, replicas: Sequence[Replica], *, config: FleetConfig | None = None,
                 fanout: FanoutTransport | None = None, journal_path: str | None = None,
                 journal_keep: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(replicas, (str, bytes)) or not replicas:
            raise BadInput("a fleet needs at least one replica")
        names = [r.name for r in replicas if isinstance(r, Replica)]
        if len(names) != len(replicas):
            raise BadInput("replicas must be Replica objects")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise BadInput(f"replica names must be distinct non-empty strings: {names}")
        if fanout is not None and not isinstance(fanout, FanoutTransport):
            raise BadInput("fanout must implement send_all/invalidate/abort")
        self.config = config or FleetConfig()
        self.fanout = fanout
        self.journal = Journal(journal_path, keep=journal_keep)
        # A journal that holds records is a previous gateway's: its versions are
        # replayed (labels never repeat), and ``bootstrap`` restores onto them.
        earlier = (read_journal(journal_path) if journal_path is not None
                   and os.path.exists(journal_path) and os.path.getsize(journal_path)
                   else [])
        try:
            self._table = ReplicaTable.replay(earlier, names, now=clock())
        except BadInput:
            self.journal.close()
            raise
        self._shell: Shell[ReplicaTable, PoolView] = Shell(
            self._table, ReplicaTable.view, clock=clock, listener=self.journal.listener)
        self._members: dict[str, Member] = {r.name: Member(r) for r in replicas}
        self._order = list(names)
        self._mem = threading.Lock()    # working memory (busy flags); nothing waits under it
        self._update_lock = threading.Lock()  # one update at a time
        self._payloads: dict[int, FleetWeights] = {}
        self._update_id = self._table.last_update_id
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._heals: dict[str, threading.Thread] = {}
        self._restored = False
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(names)),
                                        thread_name_prefix="rc-fleet")
        for r in replicas:
            r.controller.add_listener(self._engine_record)

    # ------------------------------------------------------------------ queries
    @property
    def replicas(self) -> dict[str, Replica]:
        return {n: m.replica for n, m in self._members.items()}

    @property
    def pool(self) -> PoolView:
        """The pool as its last decision left it (read without any lock)."""
        return self._shell.view

    @property
    def versions(self) -> tuple[FleetVersion, ...]:
        return self._shell.view.versions

    @property
    def newest(self) -> FleetVersion | None:
        return self._shell.view.newest

    @property
    def failed_closed(self) -> str | None:
        return self._shell.view.failed_closed

    def state_of(self, name: str) -> ReplicaState:
        return self._shell.view.entry(name).state

    def generation_of(self, name: str) -> int | None:
        return self._shell.view.entry(name).generation

    def serving(self) -> list[str]:
        """The replicas the router may choose from now."""
        return [r.name for r in self.view().replicas if r.in_pool]

    def view(self) -> FleetView:
        """What the router needs, from published snapshots only (no lock is taken).

        A replica is routable when the pool has it SERVING a fleet version and
        its controller is READY, not failed closed, on exactly the engine
        version it entered the pool with.
        """
        pool = self._shell.view
        reps: list[ReplicaView] = []
        for e in pool.replicas:
            if e.state is S.REMOVED:
                continue
            c = self._members[e.name].replica.controller.view
            ok = (e.in_pool and c.state is State.READY and c.failed_closed is None
                  and c.committed is not None and c.committed == e.engine_version)
            reps.append(ReplicaView(e.name, ok, e.generation, c.load, e.engine_version))
        closed = pool.closed
        if pool.failed_closed is not None:
            closed = f"the fleet failed closed ({pool.failed_closed})"
        return FleetView(tuple(reps), None if pool.newest is None else pool.newest.generation,
                         {v.label: v.generation for v in pool.versions}, closed,
                         self.config.retry_after_s)

    def status(self) -> dict[str, Any]:
        pool = self._shell.view
        routable = {r.name: r.in_pool for r in self.view().replicas}
        reps = []
        served: dict[str, int] = {}
        for e in pool.replicas:
            m = self._members[e.name]
            c = m.replica.controller.view
            ver = pool.version(e.generation)
            if routable.get(e.name) and ver is not None:
                served[ver.label] = served.get(ver.label, 0) + 1
            reps.append({
                "name": e.name, "url": m.replica.url, "state": e.state.value,
                "in_pool": bool(routable.get(e.name)), "fleet_generation": e.generation,
                "fleet_label": None if ver is None else ver.label,
                "engine_state": c.state.value,
                "engine_version": None if c.committed is None else c.committed.to_dict(),
                "engine_failed_closed": c.failed_closed,
                "load": c.load, "reason": e.reason, "busy": m.busy})
        return {
            "replicas": reps,
            "serving": sum(1 for r in reps if r["in_pool"]),
            "newest": None if pool.newest is None else pool.newest.to_dict(),
            "published": [v.to_dict() for v in pool.versions],
            "versions_served": served,
            "admission_closed": pool.closed,
            "failed_closed": pool.failed_closed,
            "update": None if pool.update is None else dict(pool.update),
        }

    def _each(self, fn: Callable[[Member], T], members: Sequence[Member]) -> list[T]:
        """``fn`` on every member at once, every one run to its end before anything is
        raised: a replica whose part failed unexpectedly never leaves another one's
        still running behind the update's end (its transition would stay open)."""
        futures = [self._pool.submit(fn, m) for m in members]
        out: list[T] = []
        err: BaseException | None = None
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:  # raised below, once all have ended
                err = err or exc
        if err is not None:
            raise err
        return out

    def _member(self, name: str) -> Member:
        m = self._members.get(name)
        if m is None:
            raise BadInput(f"no replica named {name!r} in this fleet")
        return m

    def on_change(self, callback: Callable[[], None]) -> None:
        """Called (from any thread, never under a lock) when the pool or an engine changes:
        after every decision of the pool, and every transition of a replica's engine."""
        self._shell.watch(callback)

        def listener(rec: Record) -> None:
            if type(rec) is Transition:
                with contextlib.suppress(Exception):  # a watcher cannot break an engine
                    callback()

        for m in self._members.values():
            m.replica.controller.add_listener(listener)
            m.replica.controller.on_recorded(callback)  # its publish admits from here

    def _engine_record(self, rec: Record) -> None:
        """A replica's own record: a taint (or its controller failing) wakes the supervisor."""
        if type(rec) is Taint or (type(rec) is Transition and rec.after is State.TAINTED):
            self._wake.set()

    # ------------------------------------------------------------------ the pool's decisions
    def _move(self, m: Member, event: ReplicaEvent, *, generation: int | Keep | None = Keep.KEEP,
              reason: str = "", only_from: ReplicaState | None = None) -> None:
        """One replica's pool event, recorded; the engine version it serves, when it enters.

        A journal that fails here does not stop the move (it is applied, the
        pool fails closed and refuses what comes next): a replica must always
        be able to leave an update.
        """
        kw: dict[str, Any] = {"reason": reason, "only_from": only_from}
        if not isinstance(generation, Keep):
            kw["generation"] = generation
            if generation is None:
                kw["engine_version"] = None
        if event in _ENTERS:
            kw["engine_version"] = m.replica.controller.committed
        # Applied in memory even when the journal failed; the pool is failed closed then.
        with contextlib.suppress(JournalError):
            self._shell.run(self._table.move, m.replica.name, event, **kw)
        self._wake.set()

    def _record(self, fn: Callable[..., None], *args: object) -> None:
        """A record of the running update (its outcome may not become durable: the pool
        then fails closed and the update decides nothing more)."""
        with contextlib.suppress(JournalError):
            self._shell.run(fn, *args)


def check_fleet_label(label: object) -> str:
    from rolloutcore.core.versions import check_label

    lab = check_label(label)
    if generation_of(lab) is not None:
        raise BadInput(f"fleet label {lab!r}: rc-N labels are the engines' own (recovery "
                       "uses them); give another, e.g. fleet-N")
    return lab
