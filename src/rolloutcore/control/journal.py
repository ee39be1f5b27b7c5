"""An append-only JSON-lines journal of everything the controller and runner saw.

One JSON object per line: ``seq`` (gap-free, from 1), ``t_mono`` (monotonic
seconds, for durations and ordering), ``t_wall`` (for people), ``kind`` and
``data``. Each record is flushed as it is written, so a crash loses at most
the record being written; a torn last line is reported, never silently
skipped in the middle of a file.

The controller calls the journal's listener *under its lock*, so the order
of lines is the order of events: the journal alone shows that an old
rollout's ``complete`` came before ``begin_update``.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rolloutcore.core.records import KINDS, JournalRecord
from rolloutcore.errors import JournalError

if TYPE_CHECKING:
    from rolloutcore.core.lifecycle import LifecycleController

__all__ = [
    "KINDS",
    "Journal",
    "JournalRecord",
    "first_index",
    "read_journal",
    "repair_journal",
    "restore_controller",
]

class Journal:
    """Writes records; usable as a controller listener (``journal.listener``).

    ``keep`` bounds the records held in memory (``records``): ``None`` keeps
    all (a short run, a test), a number keeps the most recent ones. A
    long-running writer of a file journal (the service) passes a bound, else
    memory grows with every request; the file has everything either way.
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, fsync: bool = False,
                 repair_torn_tail: bool = False, keep: int | None = None) -> None:
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int)
                                 or keep < 0):
            raise JournalError(f"keep must be None or an int >= 0, got {keep!r}")
        self._lock = threading.Lock()
        self._seq = 0
        self._records: collections.deque[JournalRecord] = collections.deque(maxlen=keep)
        self._fsync = fsync
        self._fh: IO[str] | None = None
        self.path = Path(path) if path is not None else None
        if self.path is not None:
            if repair_torn_tail:
                repair_journal(self.path)
            try:
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as exc:
                raise JournalError(f"cannot open journal {self.path}: {exc}") from exc
            if self.path.stat().st_size:
                self._seq = max((r.seq for r in read_journal(self.path)), default=0)

    def listener(self, kind: str, data: dict[str, Any]) -> None:
        self.write(kind, data)

    def write(self, kind: str, data: dict[str, Any]) -> JournalRecord:
        if kind not in KINDS:
            raise JournalError(f"unknown record kind {kind!r}")
        with self._lock:
            self._seq += 1
            rec = JournalRecord(self._seq, time.monotonic(), time.time(), kind, data)
            self._records.append(rec)
            if self._fh is not None:
                try:
                    self._fh.write(rec.to_json() + "\n")
                    self._fh.flush()
                    if self._fsync:
                        os.fsync(self._fh.fileno())
                except (OSError, TypeError, ValueError) as exc:
                    raise JournalError(f"cannot write journal record: {exc}") from exc
            return rec

    @property
    def records(self) -> list[JournalRecord]:
        """The records written through this object (the most recent ``keep`` of them)."""
        with self._lock:
            return list(self._records)

    def close(self) -> None:
        with self._lock:
            if self._fh is not None:
                self._fh.close()
                self._fh = None


def _parse_lines(lines: Iterable[str], name: str) -> Iterator[JournalRecord]:
    buf = list(lines)
    for i, line in enumerate(buf, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            last = i == len(buf) and not line.endswith("\n")
            raise JournalError(f"{name}:{i}: {'torn last line' if last else 'bad JSON'}"
                               ) from exc
        yield JournalRecord.from_obj(obj, f"{name}:{i}")


def read_journal(path: str | os.PathLike[str]) -> list[JournalRecord]:
    """Read a journal back into typed records; checks that ``seq`` is gap-free."""
    try:
        with open(path, encoding="utf-8") as fh:
            recs = list(_parse_lines(fh, str(path)))
    except OSError as exc:
        raise JournalError(f"cannot read journal {path}: {exc}") from exc
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
    if not p.exists():
        return 0
    data = p.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    keep = data.rfind(b"\n") + 1
    with open(p, "r+b") as fh:
        fh.truncate(keep)
        fh.flush()
        os.fsync(fh.fileno())
    return len(data) - keep


def first_index(records: Sequence[JournalRecord], kind: str, **match: Any) -> int:
    """Index of the first record of ``kind`` whose data matches; -1 if none."""
    for i, r in enumerate(records):
        if r.kind == kind and all(r.data.get(k) == v for k, v in match.items()):
            return i
    return -1


def restore_controller(path: str | os.PathLike[str], **kw: Any
                       ) -> tuple[LifecycleController, Journal]:
    """A ``LifecycleController`` rebuilt from the journal at ``path``, appending to it."""
    from rolloutcore.core.lifecycle import LifecycleController

    repair_journal(path)
    recs = read_journal(path) if Path(path).exists() else []
    journal = Journal(path)
    c = LifecycleController.restore(((r.kind, r.data) for r in recs), listener=journal.listener,
                                    **kw)
    return c, journal
