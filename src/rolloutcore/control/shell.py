"""The shell every state machine runs in: one lock, records delivered outside it.

The machines (``core.lifecycle.Lifecycle``, the fleet's ``core.pool.ReplicaTable``,
the trainer protocol's ``core.lease.LeaseTable``) decide and never lock; this
is where they meet threads. A ``Shell`` owns one machine and:

* runs every call of it under one lock (``run``), after setting the
  machine's ``now`` from the injected clock, so a decision is made whole;
* empties the machine's outbox inside the lock (the order of records is the
  order of decisions) and hands it to the listeners **after** the lock is
  released, under a second lock that only serialises delivery. A listener
  (the journal, the metrics, a gateway's wake-up) therefore never runs under
  the state lock, and a slow one cannot hold up a decision;
* after a call that asked to wait, returns only once every ``Sink`` (a
  listener that writes asynchronously: the journal's writer thread) has
  confirmed the records durable, so a published version is on disk before
  anyone is told; a call with ``durable=False`` (a step a restart reads as
  the one before it) is delivered at once but left to the sink's next sync
  (group commit: ``control.journal``);
* fails the machine closed when a listener or a sink fails (``fail_closed``):
  the machine then refuses what it can no longer record;
* never shows a commit before it is on record. A decision whose records include
  one the machine calls a commit (``commits``: a published version) while a sink
  listens is *unrecorded* until a sink's sync confirms it: the machine's
  ``unrecorded`` mark is set in the same hold of the lock as the decision (the
  machine refuses admissions under it, retryably), the view published meanwhile
  is the one before the commit, and the call waits for the sync even if it asked
  not to (a commit left unsynced would hold admissions for ever). Once a sync
  covers it, the shell clears the mark as a decision of its own, publishes the
  view and tells its watchers and ``on_recorded`` callbacks; a sync that fails
  fails the machine closed and leaves the mark set (its snapshot hides what was
  never recorded). A replay builds a machine without its shell: it never marks;
* wakes whoever waits on a condition of the machine (``wait_for``), on the
  injected clock;
* publishes a snapshot after every call (``view``), an immutable value that
  readers which must not lock (a router choosing a replica per request) take
  as it is, and tells its watchers (``watch``) that a new one is out, after
  the lock is released (a watcher wakes requests queued on the change).

Calls that do not wait (the data plane's ``admit``/``complete``) leave their
records to whoever is delivering: the thread holding the delivery lock
re-checks the outbox before it lets go, so nothing is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar, cast, runtime_checkable

from rolloutcore.core.records import Record
from rolloutcore.errors import BadInput, JournalError

__all__ = ["Listener", "Machine", "Shell", "Sink"]

T = TypeVar("T")
V = TypeVar("V")
#: How often a waiter re-reads the injected clock (a fake one moved by a test is
#: seen without real waiting).
_POLL_S = 0.1

#: A listener receives every record, in order, outside the machine's lock.
Listener = Callable[[Record], None]


@runtime_checkable
class Sink(Protocol):
    """A listener that writes asynchronously (the journal's writer thread).

    ``sync`` blocks until every record it accepted is durable (or raises);
    ``on_failure`` registers whom to tell when a write fails later.
    """

    def __call__(self, record: Record, *, defer: bool = False) -> None: ...

    def sync(self) -> None: ...

    def on_failure(self, callback: Callable[[str], None]) -> None: ...


class Machine(Protocol):
    """What a shell needs of a machine: its time, its outbox, its fail-closed switch,
    which of its records are commits, and the mark of a commit not yet on record."""

    now: float
    recording: bool
    unrecorded: bool

    def take(self) -> list[Record]: ...

    def fail_closed(self, reason: str) -> None: ...

    def commits(self, record: Record) -> bool: ...


M = TypeVar("M", bound=Machine)


class Shell(Generic[M, V]):
    """Runs one machine ``M`` and publishes its snapshot ``V`` (see the module docstring).

    ``snapshot`` builds the published value from the machine (under the lock,
    after each call); it should be cheap, it runs on every call.
    """

    def __init__(self, machine: M, snapshot: Callable[[M], V], *,
                 clock: Callable[[], float] = time.monotonic,
                 listener: Listener | None = None) -> None:
        self._m = machine
        self._snap = snapshot
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # Copy-on-write lists, so a delivery iterates a list nobody appends to.
        self._listeners: list[Listener] = []
        self._sinks: list[Sink] = []
        self._outbox: collections.deque[Record] = collections.deque()
        self._deliver_lock = threading.Lock()
        self._delivering: int | None = None  # the delivering thread, against re-entry
        self._watchers: list[Callable[[], None]] = []
        self._on_recorded: list[Callable[[], None]] = []
        # Commits not yet on record: the outbox position (``_queued``) of each one's last
        # record, in order; a sync that began once ``_handed`` reached it covers it.
        self._marks: list[int] = []
        self._queued = 0                # records ever appended to the outbox
        self._handed = 0                # records ever handed to the listeners
        self._held: V | None = None     # the view on record while a commit is unrecorded
        self._lost = False              # a commit's sync failed: it is never on record
        self._sync_due = False          # a commit made inside a delivery: that one syncs
        machine.now = clock()
        self._view: V = snapshot(machine)
        if listener is not None:
            self.add_listener(listener)

    # ---------------------------------------------------------------- running
    def run(self, fn: Callable[..., T], *args: object, wait: bool = True, durable: bool = True,
            **kw: object) -> T:
        """``fn(*args, **kw)`` (a method of the machine) as one decision, then delivery.

        What ``fn`` raises (a refusal, which changed nothing) is raised as it is,
        after its records (why it refused) were handed on without waiting for the
        sinks; otherwise a delivery failure raises ``JournalError``. ``durable=False``
        (with ``wait``): delivered now, made durable by the next call that syncs.
        """
        err: BaseException | None = None
        result: T | None = None
        with self._lock:
            self._m.now = self._clock()
            try:
                result = fn(*args, **kw)
            except BaseException as exc:  # re-raised below, after the delivery
                err = exc
            marked = self._settle()
        if marked:
            # A commit: on record before this call returns, whatever it asked (never
            # under the state lock: a failing sink's fail_closed takes it).
            wait = durable = True
        if err is not None:
            if marked:
                with contextlib.suppress(JournalError):
                    self._deliver(True, True, commit=True)
            elif self._outbox:
                self._deliver(False)
            raise err
        try:
            if self._outbox or (wait and durable and self._sinks):
                self._deliver(wait, durable, commit=marked)
        finally:
            self._tell_watchers()
        return cast(T, result)

    def on_recorded(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (outside the lock; what it raises is ignored) when the commits
        that were unrecorded are on record (or lost: their sync failed): admissions refused
        meanwhile may be retried (and get their answer)."""
        with self._lock:
            self._on_recorded = [*self._on_recorded, callback]

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after every decision, outside the lock (keep it quick; what
        it raises is ignored: a watcher cannot break the machine)."""
        with self._lock:
            self._watchers = [*self._watchers, callback]

    def _tell_watchers(self) -> None:
        for cb in self._watchers:
            try:
                cb()
            except Exception:
                continue

    def read(self, fn: Callable[..., T], *args: object, **kw: object) -> T:
        """A query of the machine under the lock (consistent with every decision)."""
        with self._lock:
            return fn(*args, **kw)

    def _settle(self) -> bool:
        """Under the lock: move the machine's records out, publish, wake the waiters.
        Returns whether the decision committed (its mark is set: the module docstring)."""
        recs = self._m.take()
        marked = False
        if recs and self._listeners:
            self._outbox.extend(recs)
            self._queued += len(recs)
            if self._sinks:
                commits = self._m.commits
                for r in recs:
                    if commits(r):
                        if not self._marks and not self._lost:
                            self._held = self._view
                        self._marks.append(self._queued)
                        self._m.unrecorded = marked = True
                        break
        self._publish()
        return marked

    def _publish(self) -> None:
        """Under the lock: the view on record (held while a commit is unrecorded)."""
        self._view = self._held if self._held is not None else self._snap(self._m)
        self._cond.notify_all()

    def _recorded(self, covered: int | None) -> None:
        """A sync returned: the commits it covers are on record (``covered``: the records
        handed before it began), or it failed (None): every pending one is lost."""
        with self._lock:
            if not self._marks or (covered is not None and self._marks[0] > covered):
                return
            if covered is None:
                self._marks, self._lost = [], True
            else:
                self._marks = [p for p in self._marks if p > covered]
            if self._marks:
                return
            # The shell's own decision: the commit is on record; show it, let admit in.
            self._held = None
            self._m.unrecorded = self._lost
            self._publish()
            told = self._on_recorded
        for cb in told:
            try:
                cb()
            except Exception:
                continue

    @property
    def view(self) -> V:
        """The snapshot published after the last call (no lock taken)."""
        return self._view

    @property
    def machine(self) -> M:
        """The machine itself, for code that already holds the lock (``read``)."""
        return self._m

    def wait_for(self, predicate: Callable[[M], bool], timeout_s: float) -> bool:
        """Block until ``predicate(machine)`` holds (re-checked after every call), or the
        timeout passes on the injected clock; returns whether it holds."""
        deadline = self._clock() + max(0.0, timeout_s)
        with self._cond:
            while not predicate(self._m):
                left = deadline - self._clock()
                if left <= 0:
                    return False
                self._cond.wait(min(left, _POLL_S))
            return True

    # ---------------------------------------------------------------- listeners
    def add_listener(self, listener: Listener) -> None:
        """Listeners see every record, in order, outside the lock (keep them quick).

        A ``Sink`` is also waited on after each decision that waits (``sync``) and
        tells the shell when it fails (``on_failure``): the machine then fails closed.
        """
        if not callable(listener):
            raise BadInput("a listener must be callable")
        with self._lock:
            self._listeners = [*self._listeners, listener]
            self._m.recording = True
            if isinstance(listener, Sink):
                self._sinks = [*self._sinks, listener]
        if isinstance(listener, Sink):
            listener.on_failure(self.fail_closed)

    def fail_closed(self, reason: str) -> None:
        """Something the records go to failed: the machine refuses what it cannot record."""
        with self._lock:
            self._m.fail_closed(reason)
            self._publish()

    def _deliver(self, wait: bool, durable: bool = True, *, commit: bool = False) -> None:
        """Hand the outbox to the listeners, in order, outside the state lock.

        One thread delivers at a time (``_deliver_lock``); it delivers every
        record appended before it finds the outbox empty, and re-checks after
        releasing the lock, so a record whose own thread did not wait
        (``wait=False``) is delivered by whoever holds the lock. With ``wait``
        the caller delivers (or waits for the delivery of) its records, then
        waits for every sink to confirm them durable (``durable``; otherwise the sinks
        hold them for the next sync); a failure then raises ``JournalError`` to that
        caller. Records a sync follows (or that wait for one) do not wake a sink's
        writer (``defer``). A sync that returns clears the marks of the commits it
        covers (``_recorded``); ``commit``: this call's decision committed.
        """
        if self._delivering == threading.get_ident():
            # A listener called back into the shell: the outer loop delivers (and syncs,
            # when this call committed).
            self._sync_due = self._sync_due or commit
            return
        err: BaseException | None = None
        due = False
        while True:
            if not self._deliver_lock.acquire(blocking=wait):
                if due:
                    break  # ours are delivered; the commit made inside is still to sync
                return  # the holder delivers ours: it re-checks after releasing
            self._delivering = threading.get_ident()
            try:
                out = self._outbox
                listeners, sinks = self._listeners, self._sinks
                while out:
                    rec = out.popleft()  # only the delivery lock's holder pops
                    for listener in listeners:
                        try:
                            if wait and listener in sinks:
                                listener(rec, defer=True)
                            else:
                                listener(rec)
                        except Exception as exc:
                            err = err or exc
                            self.fail_closed(f"a listener failed on a {rec.KIND} record: "
                                             f"{exc}")
                    self._handed += 1  # after the sinks took it: a sync begun now covers it
                # A commit a listener made inside this delivery (only while it is ours).
                due, self._sync_due = due or self._sync_due, False
            finally:
                self._delivering = None
                self._deliver_lock.release()
            if not self._outbox:
                break
        if (wait and durable) or due:
            covered: int | None = self._handed
            for sink in self._sinks:
                try:
                    sink.sync()
                except Exception as exc:
                    err, covered = err or exc, None
                    self.fail_closed(f"the journal failed: {exc}")
            if self._marks:
                self._recorded(covered)
        if wait and err is not None:
            raise JournalError(f"records could not be delivered; the machine now "
                               f"refuses every step: {err}") from err
