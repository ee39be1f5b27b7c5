"""An append-only JSON-lines journal of everything the controller and runner saw.

One JSON object per line: ``v`` (the schema version), ``seq`` (gap-free,
from 1), ``t_mono`` (monotonic seconds, for durations and ordering),
``t_wall`` (for people), ``kind`` and ``data`` (the typed record's JSON
form; ``docs/journal-schema.md``). A torn last line (a crash in the middle
of a write) is cut when the journal is opened again, and how many bytes were
cut is kept (``repaired_bytes``); damage anywhere else is never skipped.

Why a writer thread. The controller hands records to its listeners outside
its lock, in the order it decided them (``core.lifecycle``); the journal
numbers them as they arrive, so the order of lines is the order of events:
the journal alone shows that an old rollout's ``complete`` came before
``begin_update``. Writing them is another matter: the gateway admits on its
event loop, and one write + flush per admission there is what the journal
must not cost. So a file journal accepts a record into a bounded queue
(``queue_max``; a full queue makes the caller wait, at most ``put_timeout_s``)
and one writer thread writes whatever has queued up, then flushes once (and
``fsync``s, when asked) per batch; a data-plane record is on disk shortly
after the call that made it returned, not before. The controller calls ``sync`` after every
decision a restart reads differently (the update's opening, a publish, a taint, an
abandon): it returns once everything accepted so far is written, so a published
version is on disk before the trainer is told.

Group commit. A record ``write(..., defer=True)`` does not wake the writer: it
goes to the file with the next ``sync`` (one write, one flush for the lot), with
the next record that does wake it, or at the latest ``defer_s`` later (the
writer's idle wait is bounded by it). The steps inside an update (drained,
transferred, invalidated, validated), the runner's effect notes and the trainer
protocol's lease changes are deferred: a crash before they reach the file
restores to the same decision (an update in flight fails ``restart``: TAINTED),
so a sync of their own only cost a write, a flush and a thread wake each on the
update's critical path. The request_update, the begin_update (it burns the
target's label before the label can reach the engine), the publish and every
failure still sync.

Nothing accepted is lost silently: a record is either written, or the write
fails and the journal is *failed*: ``sync`` and every later ``write`` raise
``JournalError``, and whoever registered with ``on_failure`` (the
controller, when this journal is its listener) is told at once, from the
writer thread, and refuses every further step (it fails closed).

One writer per file. A file journal holds an exclusive ``flock`` on the
file for as long as it is open: a second ``Journal`` on the same file (a
second gateway given the same ``--journal``, in this process or another) is
refused with a ``JournalError`` naming the holder, before it repairs or
numbers anything; two writers would number the same ``seq`` twice and make
the file unreadable. The lock is the kernel's, so a writer killed -9 leaves
none behind.

A restart costs the state, not the history: the writer keeps a snapshot beside
the file (``control.journal_snapshot``) and ``restore_records`` is that
snapshot plus the file's tail after it.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import itertools
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, TypeVar

from rolloutcore.control.journal_snapshot import (
    Compactor,
    head_digest,
    line_before,
    read_snapshot,
    snapshot_path,
)
from rolloutcore.core.records import KINDS, RECORD_TYPES, JournalRecord, Record
from rolloutcore.errors import JournalError

if TYPE_CHECKING:
    from rolloutcore.control.controller import LifecycleController

_TYPES = frozenset(RECORD_TYPES.values())
R = TypeVar("R", bound=Record)

__all__ = [
    "KINDS",
    "Journal",
    "JournalRecord",
    "first_index",
    "open_controller",
    "read_journal",
    "repair_journal",
    "restore_controller",
]


class Journal:
    """Writes records; it is itself the controller's listener (``journal.listener``).

    ``keep`` bounds the records held in memory (``records``): ``None`` keeps
    all (a short run, a test), a number keeps the most recent ones. A
    long-running writer of a file journal (the service) passes a bound, else
    memory grows with every request; the file has everything either way.
    Without a path the journal is memory only and writes synchronously.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, fsync: bool = False,
                 keep: int | None = None, queue_max: int = 4096,
                 put_timeout_s: float = 30.0, defer_s: float = 1.0) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 0):
            raise JournalError(f"keep must be None or an int >= 0, got {keep!r}")
        if isinstance(queue_max, bool) or not isinstance(queue_max, int) or queue_max < 1:
            raise JournalError(f"queue_max must be an int >= 1, got {queue_max!r}")
        for name, v in (("put_timeout_s", put_timeout_s), ("defer_s", defer_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise JournalError(f"{name} must be a positive number, got {v!r}")
        self._cond = threading.Condition(threading.Lock())
        self._io = threading.Lock()        # held while a batch is written (writer or sync)
        self._seq = 0
        self._written = 0                  # highest seq on disk (flushed)
        self._pending: list[JournalRecord] = []
        self._urgent = False               # a pending record woke the writer
        self._failed: str | None = None
        self._closing = False
        self._watchers: list[Callable[[str], None]] = []
        self._records: collections.deque[JournalRecord] = collections.deque(maxlen=keep)
        self._fsync = fsync
        self._queue_max = queue_max
        self._put_timeout_s = float(put_timeout_s)
        self._sync_timeout_s = 60.0
        self._defer_s = float(defer_s)
        self._fh: IO[str] | None = None
        self._writer: threading.Thread | None = None
        self.path = Path(path) if path is not None else None
        #: Bytes of a torn last line cut when the file was opened (0: none).
        self.repaired_bytes = 0
        self._compactor = Compactor()
        self._snapshot_every = 5000
        self._since_snapshot = 0
        self._head: str | None = None
        self._regular = False  # a regular file (a device has no snapshot)
        if self.path is not None:
            # The lock first: repairing (truncating) a file another writer appends to
            # would cut its records.
            self._fh = fh = _open_locked(self.path)
            self._regular = self.path.is_file()
            try:
                # A restart after a crash mid-write must not be fatal: appending
                # after the torn line would make it damage in the middle of the file.
                self.repaired_bytes = repair_journal(self.path)
                if self._regular:
                    self._compactor = self._read_state(self.path)
                self._seq = self._written = self._compactor.seq
            except BaseException:
                fh.close()  # the lock goes with it
                raise
            self._writer = threading.Thread(target=self._write_loop, daemon=True,
                                            name=f"rolloutcore-journal-{self.path.name}")
            self._writer.start()

    # ---------------------------------------------------------------- the listener
    @property
    def listener(self) -> Journal:
        """The journal itself: a controller listener that is a ``Sink`` (sync, on_failure)."""
        return self

    def __call__(self, record: Record, *, defer: bool = False) -> None:
        self.write(record, defer=defer)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` when a write fails (at once if it already has)."""
        with self._cond:
            failed = self._failed
            if failed is None:
                self._watchers.append(callback)
        if failed is not None:
            callback(failed)

    @property
    def failed(self) -> str | None:
        """Why the journal stopped writing, or None."""
        with self._cond:
            return self._failed

    def defer(self, record: Record) -> JournalRecord:
        """``write(record, defer=True)``: the runner's ``record=`` (its effect notes)."""
        return self.write(record, defer=True)

    def write(self, record: Record, *, defer: bool = False) -> JournalRecord:
        """Number ``record`` and queue it for the file (memory only: keep it now).

        ``defer``: do not wake the writer for it (group commit; the module doc)."""
        if type(record) not in _TYPES:
            raise JournalError(f"not a journal record: {record!r}")
        with self._cond:
            if self._failed is not None:
                raise JournalError(f"journal failed earlier: {self._failed}")
            if self._closing:
                raise JournalError("journal is closed")
            if self._fh is not None and len(self._pending) >= self._queue_max:
                self._urgent = True
                self._cond.notify_all()  # a full queue of deferred records: write it now
                deadline = time.monotonic() + self._put_timeout_s
                while len(self._pending) >= self._queue_max and self._failed is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self._failed = (f"journal queue full for {self._put_timeout_s:g}s "
                                        f"(the disk is not keeping up)")
                        break
                    self._cond.wait(left)
            failed = self._failed
            if failed is None:
                self._seq += 1
                jr = JournalRecord(self._seq, time.monotonic(), time.time(), record)
                self._records.append(jr)
                if self._fh is None:
                    self._written = self._seq
                else:
                    self._pending.append(jr)
                    if not defer and not self._urgent:
                        self._urgent = True
                        self._cond.notify_all()  # wake the writer
        if failed is not None:
            self._tell(failed)
            raise JournalError(f"journal failed: {failed}")
        return jr

    def sync(self) -> None:
        """Return once every record accepted so far is written; raise if it cannot be.

        The caller writes what is pending itself rather than waiting for the
        writer thread to wake (an update step's latency is one write + flush,
        as when the journal wrote synchronously), but outside the controller's
        lock. ``sync_timeout_s`` bounds the wait for a write in progress.
        """
        with self._cond:
            target, failed = self._seq, self._failed
        if failed is None and self._written < target:
            if not self._io.acquire(timeout=self._sync_timeout_s):
                with self._cond:
                    self._failed = self._failed or (
                        f"journal write did not complete in {self._sync_timeout_s:g}s")
            else:
                try:
                    self._write_pending()
                finally:
                    self._io.release()
            with self._cond:
                failed = None if self._written >= target else self._failed
        if failed is not None:
            self._tell(failed)
            raise JournalError(f"journal failed: {failed}")

    # ---------------------------------------------------------------- the writer
    def _write_pending(self) -> None:
        """Write and flush everything pending as one batch. Caller holds ``_io``: whoever
        holds it takes the next batch, so batches reach the file in ``seq`` order."""
        fh = self._fh
        with self._cond:
            if self._failed is not None or not self._pending or fh is None:
                return
            batch, self._pending, self._urgent = self._pending, [], False
            if len(batch) >= self._queue_max:
                self._cond.notify_all()  # room in the queue (only a full one has waiters)
        try:
            lines = [jr.to_json() for jr in batch]
            fh.write("".join(line + "\n" for line in lines))
            fh.flush()
            if self._fsync:
                os.fsync(fh.fileno())
        except (OSError, TypeError, ValueError) as exc:
            seqs = f"{batch[0].seq}" + ("" if len(batch) == 1 else f"..{batch[-1].seq}")
            with self._cond:
                if self._failed is None:
                    self._failed = f"cannot write journal records {seqs}: {exc}"
                failed = self._failed
            self._tell(failed)
            return
        for jr, line in zip(batch, lines, strict=True):
            self._compactor.feed(jr, line)
        self._since_snapshot += len(batch)
        if self._since_snapshot >= max(self._snapshot_every, len(self._compactor.kept)):
            self._snapshot(fh)
        with self._cond:
            self._written = batch[-1].seq

    def _snapshot(self, fh: IO[str]) -> None:
        """Write the snapshot of what is on disk now (the caller holds ``_io``)."""
        if self.path is None or not self._compactor.seq or not self._regular:
            return
        self._since_snapshot = 0
        if self._head is None:
            self._head = head_digest(self.path)
        with contextlib.suppress(OSError):
            offset = os.fstat(fh.fileno()).st_size  # the lock's holder: no other writer
            if self._head is not None:
                self._compactor.write(snapshot_path(self.path), offset, self._head,
                                      fsync=self._fsync)

    def _read_state(self, path: Path) -> Compactor:
        """What a restore needs from the file: its snapshot and the lines after it when
        the snapshot fits the file, else every line."""
        snap = read_snapshot(snapshot_path(path))
        size = path.stat().st_size
        if snap is not None and snap.offset <= size and snap.head == head_digest(path):
            last = line_before(path, snap.offset)
            try:
                fits = last is not None and json.loads(last)["seq"] == snap.seq
            except (ValueError, KeyError, TypeError):
                fits = False
            if fits:
                comp = Compactor(snap)
                for jr in read_journal(path, start=snap.offset, after_seq=snap.seq):
                    comp.feed(jr, jr.to_json())
                self._head = snap.head
                return comp
        comp = Compactor()
        if size:
            for jr in read_journal(path):
                comp.feed(jr, jr.to_json())
        return comp

    def restore_records(self) -> list[Record | JournalRecord]:
        """What the file held when this journal opened it, as a restore replays it: the
        counts of the finished requests left out (``Compacted``), then every other
        record (``control.journal_snapshot``). Call it before writing."""
        with self._io:
            return self._compactor.records()

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._urgent and not self._closing and self._failed is None:
                    # Deferred records wait for a sync or an urgent record, at most defer_s.
                    if not self._cond.wait(self._defer_s) and self._pending:
                        break
                if self._failed is not None or (self._closing and not self._pending):
                    return
            # No artificial delay: while one batch is written (the GIL released in the
            # write), the next one accumulates, so batches grow with the load and an
            # idle journal has each record on disk within one thread switch.
            with self._io:
                self._write_pending()

    def _tell(self, reason: str) -> None:
        """Wake every waiter and tell the watchers (once), outside the journal's lock:
        a watcher (the controller) takes its own lock."""
        with self._cond:
            self._cond.notify_all()
            watchers, self._watchers = self._watchers, []
        for w in watchers:
            w(reason)

    # ---------------------------------------------------------------- reading back
    @property
    def records(self) -> list[JournalRecord]:
        """The records written through this object (the most recent ``keep`` of them)."""
        with self._cond:
            return list(self._records)

    def of(self, kind: type[R]) -> list[R]:
        """The records of one type among ``records``, in order."""
        return [r.record for r in self.records if isinstance(r.record, kind)]

    def close(self) -> None:
        """Write what is queued, stop the writer, close the file (a failure stays readable
        in ``failed``; it was already reported)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        with self._cond:
            fh, failed = self._fh, self._failed
        if fh is not None and failed is None and self._since_snapshot:
            with self._io:
                self._snapshot(fh)  # a clean stop's restart reads no tail
        with self._cond:
            fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError as exc:
                with self._cond:
                    self._failed = self._failed or f"cannot close journal: {exc}"
                self._tell(f"cannot close journal: {exc}")


def _lock_holder(fh: IO[str]) -> str:
    """Who holds the lock on ``fh``'s file, in words (from ``/proc/locks``; best effort)."""
    st = os.fstat(fh.fileno())
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/locks").read_text().splitlines():
            f = line.split()
            if len(f) > 5 and f[1] == "FLOCK" and f[5] == ident:
                pid = int(f[4])
                return "this process" if pid == os.getpid() else f"process {pid}"
    return "another writer"


def _open_locked(path: Path) -> IO[str]:
    """``path`` opened for appending, with its exclusive lock held; refused (``JournalError``)
    while another open journal holds it. Devices are not locked (nothing to tear)."""
    try:
        fh = open(path, "a", encoding="utf-8")  # noqa: SIM115
    except OSError as exc:
        raise JournalError(f"cannot open journal {path}: {exc}") from exc
    try:
        if path.is_file():
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _lock_holder(fh)
        fh.close()
        raise JournalError(
            f"journal {path} is already being written by {holder}: one writer per "
            f"journal (stop that gateway first, or give this one another --journal)"
        ) from None
    except OSError as exc:
        fh.close()
        raise JournalError(f"cannot lock journal {path}: {exc}") from exc
    return fh


def _parse_lines(lines: Iterable[str], name: str, *, live: bool = False
                 ) -> Iterator[JournalRecord]:
    buf = list(lines)
    for i, line in enumerate(buf, 1):
        if not line.strip():
            continue
        last = i == len(buf) and not line.endswith("\n")
        if last and live:
            return  # still being written: the rest of the line is on its way
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise JournalError(f"{name}:{i}: {'torn last line' if last else 'bad JSON'}"
                               ) from exc
        yield JournalRecord.from_obj(obj, f"{name}:{i}")


def read_journal(path: str | os.PathLike[str], *, live: bool = False, start: int = 0,
                 after_seq: int | None = None) -> list[JournalRecord]:
    """Read a journal back into typed records; checks that ``seq`` is gap-free.

    ``live``: the file is being written by a running process (a batch can be
    half on disk), so a last line without its newline is left out rather than
    refused as torn. Without it, such a line is damage (``repair_journal``).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            if start:
                fh.seek(start)
            recs = list(_parse_lines(fh, str(path) if not start else f"{path}@{start}",
                                     live=live))
    except OSError as exc:
        raise JournalError(f"cannot read journal {path}: {exc}") from exc
    if after_seq is not None and recs and recs[0].seq != after_seq + 1:
        raise JournalError(f"{path}: sequence gap between {after_seq} and {recs[0].seq} "
                           f"(after its snapshot)")
    for a, b in itertools.pairwise(recs):
        if b.seq != a.seq + 1:
            raise JournalError(f"{path}: sequence gap between {a.seq} and {b.seq}")
    return recs


def repair_journal(path: str | os.PathLike[str]) -> int:
    """Cut a torn last line (a crash in the middle of a write); return the bytes cut.

    Only an unterminated *last* line is cut: damage anywhere else is not a
    crash artefact and still raises when the journal is read.
    """
    p = Path(path)
    if not p.is_file():
        return 0  # nothing to repair (absent), or not a file a crash can tear (a device)
    try:
        with open(p, "r+b") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return 0
            # Only the tail is read: back from the end, a block at a time, to the last newline.
            keep, pos = 0, size
            while pos > 0:
                start = max(0, pos - 65536)
                fh.seek(start)
                nl = fh.read(pos - start).rfind(b"\n")
                if nl >= 0:
                    keep = start + nl + 1
                    break
                pos = start
            fh.truncate(keep)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise JournalError(f"cannot repair journal {p}: {exc}") from exc
    return size - keep


def first_index(records: Sequence[JournalRecord], kind: type[Record] | str,
                **match: object) -> int:
    """Index of the first record of type ``kind`` whose fields match; -1 if none.

    ``kind`` may also be a kind's name, matched against the JSON form (``data``).
    """
    for i, r in enumerate(records):
        rec = r.record
        if isinstance(kind, str):
            if r.kind == kind and all(r.data.get(k) == v for k, v in match.items()):
                return i
        elif isinstance(rec, kind) and all(getattr(rec, k) == v for k, v in match.items()):
            return i
    return -1


def open_controller(path: str | os.PathLike[str] | None, *, keep: int | None = None,
                    **kw: Any) -> tuple[LifecycleController, Journal]:
    """The journal at ``path`` and the controller that writes it: replayed from the
    records it holds (a previous process's, ``LifecycleController.restore``), or new.

    What ``serve --journal`` does for one engine and a fleet does for each of
    its replicas. Without ``path``: a new controller over a memory journal.
    """
    from rolloutcore.control.controller import LifecycleController

    journal = Journal(path, keep=keep)  # cuts a torn last line first
    try:
        earlier = journal.restore_records()  # its snapshot and the lines after it
        if earlier:
            return LifecycleController.restore(earlier, listener=journal.listener,
                                               **kw), journal
        return LifecycleController(listener=journal.listener, **kw), journal
    except BaseException:
        journal.close()
        raise


def restore_controller(path: str | os.PathLike[str], **kw: Any
                       ) -> tuple[LifecycleController, Journal]:
    """A ``LifecycleController`` replayed from the journal at ``path``, appending to it."""
    from rolloutcore.control.controller import LifecycleController

    journal = Journal(path)  # cuts a torn last line first
    try:
        recs = journal.restore_records()
        c = LifecycleController.restore(recs, listener=journal.listener, **kw)
    except BaseException:
        journal.close()
        raise
    return c, journal
