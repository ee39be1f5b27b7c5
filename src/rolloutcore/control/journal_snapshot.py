"""A journal's snapshot: what a restart replays instead of every request ever served.

A gateway's journal gains two lines per request (``admit``, ``complete``): a
restart that replays the whole file costs the history (50,000 requests: 2.5 s
and 100 MiB), not the state. The writer of a file journal (``Journal``, which
holds its lock) keeps, beside the file, ``<journal>.snapshot``:

* a header line: ``seq`` and ``offset`` (the last record and the file's byte
  length it covers), ``head`` (the digest of the file's first line: a snapshot
  of another file with the same name is never taken for this one's),
  ``requests`` and ``accepted`` (the finished requests it left out, and how many
  of their completions were attributable);
* then, in ``seq`` order, the lines of every record a restore needs: all of
  them except finished requests' ``admit``/``complete`` pairs and refusals (an
  admission still open is kept: a restore releases it).

A restart reads the snapshot and the file after ``offset`` (``Compactor``),
and replays ``Compacted`` (the counts) plus those records. The snapshot is
rewritten, atomically (a temporary file renamed over it), when the records
written since the last one reach ``every`` or the snapshot's own length
(whichever is more: its cost per record stays bounded), and when the journal
closes. A snapshot that does not fit the file (older, newer, another file) is
ignored: the file is read whole, as before. The file itself is never changed:
the audit reads every record.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from rolloutcore.core.records import Admit, Compacted, Complete, JournalRecord, Record, Refuse
from rolloutcore.errors import JournalError

__all__ = ["SUFFIX", "Compactor", "Snapshot", "head_digest", "line_before", "read_snapshot",
           "snapshot_path"]

SUFFIX = ".snapshot"
_FORMAT = 1


def snapshot_path(path: Path) -> Path:
    return path.with_name(path.name + SUFFIX)


def head_digest(path: Path) -> str | None:
    """The sha256 of the file's first line (None: empty or unreadable)."""
    try:
        with open(path, "rb") as fh:
            first = fh.readline(1 << 20)
    except OSError:
        return None
    return hashlib.sha256(first).hexdigest() if first.endswith(b"\n") else None


def line_before(path: Path, offset: int) -> bytes | None:
    """The complete line that ends at byte ``offset`` of the file (None: there is none).

    Read back from ``offset`` in a window that doubles until it holds the line's
    start (64 KiB first: the cost is the line's, not the file's)."""
    if offset <= 0:
        return None
    window = 1 << 16
    try:
        with open(path, "rb") as fh:
            while True:
                start = max(0, offset - window)
                fh.seek(start)
                buf = fh.read(offset - start)
                if not buf.endswith(b"\n"):
                    return None
                nl = buf.rfind(b"\n", 0, len(buf) - 1)
                if nl >= 0 or start == 0:
                    return buf[nl + 1:]
                if window >= 1 << 26:
                    return None  # a line over 64 MiB: not one this journal writes
                window *= 2
    except OSError:
        return None


@dataclass(frozen=True)
class Snapshot:
    seq: int
    offset: int
    head: str
    requests: int
    accepted: int
    lines: list[str]


def read_snapshot(path: Path) -> Snapshot | None:
    """The snapshot at ``path`` (``snapshot_path``), or None when absent or unreadable."""
    try:
        text = path.read_text(encoding="utf-8")
        header, *lines = text.splitlines()
        h: object = json.loads(header)
        if not isinstance(h, dict) or h.get("snapshot") != _FORMAT:
            return None
        return Snapshot(int(h["seq"]), int(h["offset"]), str(h["head"]), int(h["requests"]),
                        int(h["accepted"]), lines)
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Compactor:
    """The records a restore needs, kept as the journal writes them (the writer's only)."""

    def __init__(self, snap: Snapshot | None = None) -> None:
        self.kept: dict[int, str] = {}      # seq -> line, in seq order
        self.open: dict[str, int] = {}      # rollout id -> the seq of its admit
        self.requests = self.accepted = self.seq = 0
        if snap is not None:
            self.requests, self.accepted, self.seq = snap.requests, snap.accepted, snap.seq
            for i, line in enumerate(snap.lines, 2):
                jr = parse(line, f"snapshot:{i}")
                self.kept[jr.seq] = line
                if isinstance(jr.record, Admit):
                    self.open[jr.record.rollout_id] = jr.seq

    def feed(self, jr: JournalRecord, line: str) -> None:
        rec = jr.record
        self.seq = jr.seq
        if isinstance(rec, Refuse):
            return
        if isinstance(rec, Complete):
            at = self.open.pop(rec.rollout_id, None)
            if at is not None:
                del self.kept[at]
                self.requests += 1
                self.accepted += bool(rec.attributable)
                return
        elif isinstance(rec, Admit):
            self.open[rec.rollout_id] = jr.seq
        self.kept[jr.seq] = line

    def records(self) -> list[Record | JournalRecord]:
        """What a restore replays: the counts left out, then every record kept."""
        if not self.seq:
            return []
        out: list[Record | JournalRecord] = [
            Compacted(self.seq, self.requests, self.accepted)]
        out += [parse(line, f"journal seq {seq}") for seq, line in self.kept.items()]
        return out

    def write(self, path: Path, offset: int, head: str, *, fsync: bool) -> None:
        """The snapshot, written to a temporary file and renamed over ``path``."""
        tmp = path.with_name(path.name + ".tmp")
        header = json.dumps({"snapshot": _FORMAT, "seq": self.seq, "offset": offset,
                             "head": head, "requests": self.requests,
                             "accepted": self.accepted}, sort_keys=True)
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                fh.write(header + "\n")
                fh.writelines(line + "\n" for line in self.kept.values())
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError:
            # Only a restart's speed depends on it: the journal is what is written.
            with contextlib.suppress(OSError):
                tmp.unlink()


def parse(line: str, where: str) -> JournalRecord:
    try:
        return JournalRecord.from_obj(json.loads(line), where)
    except json.JSONDecodeError as exc:
        raise JournalError(f"{where}: bad JSON") from exc
