"""Crash-safe, append-only trajectory files: one group of n samples, one transaction.

Theory of operation. A trajectory file is JSON lines. A group is appended as
its n canonical sample lines followed by one *commit marker* line that names
the group and carries the sha256 of those sample bytes, all in a single
``write`` followed by ``fsync``. A group is *committed* exactly when its
commit marker is on disk and verifies against the lines before it; nothing
else is ever visible to readers. The grammar of a file is therefore::

    file   := group* tail
    group  := sample-line{n} commit-line      (commit verifies the n lines)
    tail   := anything that is not a verified group (a torn write)

Recovery (on every ``TrajectoryRecorder`` open, under the writer lock) cuts
the tail off with ``ftruncate`` so the next append starts on a clean line
boundary. A verified group can never follow damage in a file this module
wrote (a group is written only after the previous one was fsynced), so when
one does the file is reported as damaged (``JournalError``) and nothing is
truncated: committed data is never dropped silently.

One writer at a time: the recorder holds an exclusive ``fcntl.flock`` on the
file from open to close. Readers (``read_groups``/``read_trajectories``)
take no lock; they stop at the last verified group, so a write in progress
looks to them like a torn tail and is ignored.

Resuming a generator: the file is the truth about which prompts are done.
Group ids are a pure function of (run, step, prompt index)
(``trajectory.group_id_for``), so ``recorder.cursor(run, step)`` tells a
restarted generator exactly which prompt indices are still pending, and a
``GenerationCursor`` saved atomically beside the file (write temp, fsync,
rename, fsync dir) is reconciled against it: the file may be ahead of the
cursor (crash between commit and cursor save), never behind.

Standard library only.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import hashlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType, TracebackType
from typing import Any, BinaryIO

from rolloutcore.core.records import fields_dict
from rolloutcore.core.strict import check_int
from rolloutcore.errors import BadInput, JournalError, RolloutCoreError
from rolloutcore.provenance.trajectory import (
    TrajectoryGroup,
    TrajectorySample,
    check_schema_version,
    encode_line,
)

__all__ = [
    "AppendOutcome",
    "CommittedGroup",
    "GenerationCursor",
    "RecoveryReport",
    "TrajectoryRecorder",
    "read_groups",
    "read_trajectories",
]

_COMMIT_KEYS = frozenset({"schema_version", "record", "group_id", "run", "step",
                          "prompt_index", "group_size", "content_digest", "bytes",
                          "committed_wall"})
_CURSOR_VERSION = 1
_LOCK_POLL_S = 0.01

PathLike = str | os.PathLike[str]


class AppendOutcome(enum.StrEnum):
    COMMITTED = "committed"                  # written and fsynced now
    ALREADY_COMMITTED = "already-committed"  # identical group was on disk; nothing written


@dataclass(frozen=True)
class CommittedGroup:
    """What the recorder remembers of a committed group (from its commit marker)."""

    group_id: str
    content_digest: str
    run: str
    step: int
    prompt_index: int
    group_size: int
    offset: int  # byte offset of the group's first sample line


@dataclass(frozen=True)
class RecoveryReport:
    """What recovery removed when the file was opened for writing."""

    truncated_bytes: int = 0
    dropped_lines: int = 0       # complete lines of uncommitted groups
    torn_line: bool = False      # the file ended in a partial line
    dropped_group_ids: tuple[str, ...] = ()

    @property
    def clean(self) -> bool:
        return self.truncated_bytes == 0

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


# --------------------------------------------------------------------------- scanning

@dataclass
class _Line:
    offset: int
    lineno: int
    raw: bytes
    obj: dict[str, Any] | None  # None: damaged (not JSON, not an object, unknown record)


class _Scan:
    """Walks a trajectory file and yields verified groups; the rest is the tail."""

    def __init__(self, f: BinaryIO, name: str) -> None:
        self._f = f
        self._name = name
        self.committed_end = 0
        self.tail_lines = 0
        self.torn_line = False
        self.foreign_lineno: int | None = None  # first complete tail line that is not ours
        self.tail_group_ids: tuple[str, ...] = ()

    def _lines(self) -> Iterator[_Line]:
        offset = 0
        for lineno, raw in enumerate(self._f, start=1):
            if not raw.endswith(b"\n"):
                self.torn_line = True
                return
            obj: dict[str, Any] | None = None
            try:
                parsed = json.loads(raw)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict) and "schema_version" in parsed:
                # A complete line from a newer writer: refuse, do not truncate it away.
                check_schema_version(parsed, f"{self._name} line {lineno}")
                if parsed.get("record") in ("sample", "commit"):
                    obj = parsed
            yield _Line(offset, lineno, raw, obj)
            offset += len(raw)

    @staticmethod
    def _verify(pending: list[_Line], commit: _Line) -> CommittedGroup | None:
        """The group that ``commit`` commits, if the lines before it verify against it."""
        c = commit.obj
        assert c is not None
        n = c.get("group_size")
        if set(c) != _COMMIT_KEYS or isinstance(n, bool) or not isinstance(n, int) \
                or not 0 < n <= len(pending):
            return None
        body_lines = pending[-n:]
        if any(p.obj is None for p in body_lines):
            return None
        body = b"".join(p.raw for p in body_lines)
        if len(body) != c["bytes"] or hashlib.sha256(body).hexdigest() != c["content_digest"]:
            return None
        for p in body_lines:
            assert p.obj is not None
            if p.obj.get("record") != "sample" or any(
                    p.obj.get(k) != c[k] for k in ("group_id", "run", "step", "prompt_index",
                                                   "group_size")):
                return None
        return CommittedGroup(c["group_id"], c["content_digest"], c["run"], c["step"],
                              c["prompt_index"], n, body_lines[0].offset)

    def groups(self) -> Iterator[tuple[CommittedGroup, list[_Line]]]:
        pending: list[_Line] = []  # lines since the last verified group
        damage: _Line | None = None  # first line that can no longer be part of a group
        for line in self._lines():
            if line.obj is None or line.obj.get("record") != "commit":
                pending.append(line)
                continue
            marker = self._verify(pending, line)
            if marker is None:
                damage = damage or (pending[0] if pending else line)
                pending.append(line)
                continue
            if damage is None and len(pending) > marker.group_size:
                damage = pending[0]
            if damage is not None:
                raise JournalError(
                    f"{self._name}: line {damage.lineno} is damaged but the committed group "
                    f"{marker.group_id!r} follows at line {line.lineno}; refusing to drop "
                    "committed data (restore the file or cut it by hand)")
            self.committed_end = line.offset + len(line.raw)
            yield marker, pending
            pending = []
        self.tail_lines = len(pending)
        self.foreign_lineno = next((p.lineno for p in pending if p.obj is None), None)
        gids: list[str] = []
        for p in pending:
            gid = p.obj.get("group_id") if p.obj is not None else None
            if isinstance(gid, str) and gid not in gids:
                gids.append(gid)
        self.tail_group_ids = tuple(gids)


@contextlib.contextmanager
def _open_errors(path: PathLike, missing: str) -> Iterator[None]:
    """Opening a trajectory file: ``missing`` names what a ``FileNotFoundError`` lacks."""
    p = os.fspath(path)
    try:
        yield
    except FileNotFoundError as exc:
        raise BadInput(f"{missing} {p!r} does not exist") from exc
    except IsADirectoryError as exc:
        raise BadInput(f"trajectory file {p!r} is a directory") from exc
    except OSError as exc:
        raise JournalError(f"cannot open {p!r}: {exc}") from exc


def read_groups(path: PathLike) -> Iterator[TrajectoryGroup]:
    """The committed groups of a trajectory file, in commit order; never a partial group.

    Takes no lock and changes nothing, so it may run while a writer appends.
    """
    with _open_errors(path, "trajectory file"):
        f = open(path, "rb")  # noqa: SIM115 (closed below)
    with f:
        scan = _Scan(f, os.fspath(path))
        for _, lines in scan.groups():
            samples = []
            for line in lines:
                try:
                    samples.append(TrajectorySample.from_dict(line.obj))
                except BadInput as exc:
                    raise BadInput(f"{os.fspath(path)} line {line.lineno}: {exc}") from exc
            yield TrajectoryGroup(tuple(samples))


def read_trajectories(path: PathLike) -> Iterator[TrajectorySample]:
    """The samples of the committed groups of a trajectory file, group by group."""
    for g in read_groups(path):
        yield from g.samples


# --------------------------------------------------------------------------- writer

def _write_all(fd: int, data: bytes) -> None:
    """``os.write`` until done. A module-level function so crash tests can replace it."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class TrajectoryRecorder:
    """The single writer of one trajectory file.

    Opening takes the writer lock (waiting at most ``lock_timeout_s``) and
    recovers the file; ``recovery`` says what was cut off. Use as a context
    manager, or call ``close()``.
    """

    def __init__(self, path: PathLike, *, lock_timeout_s: float = 0.0) -> None:
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) \
                or not lock_timeout_s >= 0:
            raise BadInput(f"lock_timeout_s must be a number >= 0, got {lock_timeout_s!r}")
        self.path = Path(path)
        self._mutex = threading.Lock()  # appends from several generator threads are fine
        self._fd = -1
        self._broken: str | None = None
        self._index: dict[str, CommittedGroup] = {}
        self._by_prompt: dict[tuple[str, int, int], str] = {}
        existed = self.path.exists()
        with _open_errors(self.path, "the directory of"):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            self._lock(fd, float(lock_timeout_s))
            if not existed:
                _fsync_dir(self.path.parent)
            self.recovery = self._recover(fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _lock(self, fd: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise JournalError(f"cannot lock {str(self.path)!r}: {exc}") from exc
            if time.monotonic() >= deadline:
                raise JournalError(f"{str(self.path)!r} is locked by another writer "
                                   f"(waited {timeout_s:g}s)")
            time.sleep(_LOCK_POLL_S)

    def _recover(self, fd: int) -> RecoveryReport:
        with open(self.path, "rb") as f:
            scan = _Scan(f, str(self.path))
            for marker, _ in scan.groups():
                self._remember(marker)
            size = f.seek(0, os.SEEK_END)
        self._size = scan.committed_end
        cut = size - scan.committed_end
        if scan.foreign_lineno is not None:
            raise JournalError(
                f"{str(self.path)!r}: line {scan.foreign_lineno} is not a RolloutCore "
                f"trajectory record and no committed group follows it; a crashed append "
                f"leaves no such line, so recovery will not truncate it (if this file is "
                f"yours and damaged, cut it to its first {scan.committed_end} bytes)")
        if cut:
            try:
                os.ftruncate(fd, scan.committed_end)
                os.fsync(fd)
            except OSError as exc:
                raise JournalError(f"recovery could not truncate {str(self.path)!r}: {exc}") \
                    from exc
        return RecoveryReport(cut, scan.tail_lines, scan.torn_line,
                              tuple(scan.tail_group_ids))

    def _remember(self, m: CommittedGroup) -> None:
        if m.group_id in self._index:
            raise JournalError(f"{str(self.path)!r}: group {m.group_id!r} is committed twice")
        key = (m.run, m.step, m.prompt_index)
        if key in self._by_prompt:
            raise JournalError(f"{str(self.path)!r}: prompt {key} is committed as both "
                               f"{self._by_prompt[key]!r} and {m.group_id!r}")
        self._index[m.group_id] = m
        self._by_prompt[key] = m.group_id

    # ----------------------------------------------------------------- public API

    def append_group(self, group: TrajectoryGroup) -> AppendOutcome:
        """Commit ``group`` durably, or find it already committed byte for byte.

        Raises ``BadInput`` (nothing written) when another group holds the same
        id or the same (run, step, prompt index), and ``JournalError`` when the
        write fails (the partial write is cut off again before raising).
        """
        if not isinstance(group, TrajectoryGroup):
            raise BadInput(f"append_group takes a TrajectoryGroup, got {type(group).__name__}")
        with self._mutex:
            return self._append(group)

    def _append(self, group: TrajectoryGroup) -> AppendOutcome:
        self._check_usable()
        have = self._index.get(group.group_id)
        if have is not None:
            if have.content_digest == group.content_digest:
                return AppendOutcome.ALREADY_COMMITTED
            raise BadInput(f"group {group.group_id!r} is already committed with different "
                           f"content (digest {have.content_digest[:12]}, "
                           f"new {group.content_digest[:12]})")
        key = (group.run, group.step, group.prompt_index)
        if key in self._by_prompt:
            raise BadInput(f"prompt (run={group.run!r}, step={group.step}, "
                           f"prompt_index={group.prompt_index}) is already committed as group "
                           f"{self._by_prompt[key]!r}, not {group.group_id!r}")
        body = group.lines
        marker = encode_line({
            # The newest version among its samples: a text-only group stays version 1.
            "schema_version": max(x.schema_version for x in group.samples),
            "record": "commit", "group_id": group.group_id,
            "run": group.run, "step": group.step, "prompt_index": group.prompt_index,
            "group_size": len(group), "content_digest": group.content_digest,
            "bytes": len(body), "committed_wall": time.time()})
        start = self._size
        try:
            _write_all(self._fd, body + marker)
            os.fsync(self._fd)
        except OSError as exc:
            self._rollback(start)
            raise JournalError(f"could not commit group {group.group_id!r} to "
                               f"{str(self.path)!r}: {exc}") from exc
        self._size = start + len(body) + len(marker)
        self._remember(CommittedGroup(group.group_id, group.content_digest, group.run,
                                      group.step, group.prompt_index, len(group), start))
        return AppendOutcome.COMMITTED

    def _rollback(self, start: int) -> None:
        try:
            os.ftruncate(self._fd, start)
            os.fsync(self._fd)
        except OSError as exc:
            self._broken = f"a failed append could not be cut off ({exc}); reopen to recover"

    def committed_groups(self) -> Mapping[str, CommittedGroup]:
        """Committed groups by id, in commit order (a snapshot)."""
        with self._mutex:
            self._check_usable()
            return MappingProxyType(dict(self._index))

    def is_committed(self, group_id: str) -> bool:
        with self._mutex:
            self._check_usable()
            return group_id in self._index

    def cursor(self, run: str, step: int) -> GenerationCursor:
        """Which prompts of (run, step) are committed, straight from the file."""
        with self._mutex:
            self._check_usable()
            done = [p for (r, s, p) in self._by_prompt if r == run and s == step]
        return GenerationCursor.from_indices(run, step, done)

    def _check_usable(self) -> None:
        if self._fd < 0:
            raise JournalError(f"recorder for {str(self.path)!r} is closed")
        if self._broken:
            raise JournalError(f"recorder for {str(self.path)!r} is unusable: {self._broken}")

    def close(self) -> None:
        with self._mutex:
            if self._fd >= 0:
                fd, self._fd = self._fd, -1
                os.close(fd)  # releases the flock

    def __enter__(self) -> TrajectoryRecorder:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


# --------------------------------------------------------------------------- cursor

@dataclass(frozen=True)
class GenerationCursor:
    """Which prompt indices of (run, step) are committed, compactly.

    ``next_prompt_index`` is the low-water mark (every index below it is
    committed); ``committed_ahead`` lists committed indices above it, which
    exist when groups finish out of order.
    """

    run: str
    step: int
    next_prompt_index: int = 0
    committed_ahead: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.run, str) or not self.run:
            raise BadInput(f"cursor.run must be a non-empty string, got {self.run!r}")
        for name in ("step", "next_prompt_index"):
            v = getattr(self, name)
            check_int(f"cursor.{name}", v)
        ahead = set()
        for i in self.committed_ahead:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise BadInput(f"cursor.committed_ahead holds {i!r}, not an index")
            if i < self.next_prompt_index:
                raise BadInput(f"cursor.committed_ahead holds {i}, below next_prompt_index "
                               f"{self.next_prompt_index}")
            ahead.add(i)
        nxt = self.next_prompt_index
        while nxt in ahead:
            ahead.discard(nxt)
            nxt += 1
        object.__setattr__(self, "next_prompt_index", nxt)
        object.__setattr__(self, "committed_ahead", tuple(sorted(ahead)))

    @classmethod
    def from_indices(cls, run: str, step: int, indices: Iterable[int]) -> GenerationCursor:
        return cls(run, step, 0, tuple(indices))

    def is_committed(self, prompt_index: int) -> bool:
        return prompt_index < self.next_prompt_index or prompt_index in self.committed_ahead

    def committed_indices(self) -> list[int]:
        return [*range(self.next_prompt_index), *self.committed_ahead]

    def pending(self, total: int) -> list[int]:
        """Prompt indices below ``total`` still to generate, in order."""
        check_int("total", total)
        ahead = set(self.committed_ahead)
        return [i for i in range(self.next_prompt_index, total) if i not in ahead]

    def advance(self, prompt_index: int) -> GenerationCursor:
        """The cursor with ``prompt_index`` committed as well."""
        check_int("prompt_index", prompt_index)
        if self.is_committed(prompt_index):
            return self
        return GenerationCursor(self.run, self.step, self.next_prompt_index,
                                (*self.committed_ahead, prompt_index))

    def reconcile(self, recorder: TrajectoryRecorder) -> GenerationCursor:
        """The cursor the file supports; the file may be ahead of a saved cursor, not behind.

        A saved cursor that claims prompts the file lacks means committed
        data was lost (file replaced or cut): ``JournalError``, so the
        generator does not silently skip those prompts.
        """
        truth = recorder.cursor(self.run, self.step)
        lost = [i for i in self.committed_indices() if not truth.is_committed(i)]
        if lost:
            shown = ", ".join(map(str, lost[:10])) + (" ..." if len(lost) > 10 else "")
            raise JournalError(f"cursor for run {self.run!r} step {self.step} says prompts "
                               f"[{shown}] are committed but {str(recorder.path)!r} lacks them")
        return truth

    def to_dict(self) -> dict[str, Any]:
        return {"cursor_version": _CURSOR_VERSION, "run": self.run, "step": self.step,
                "next_prompt_index": self.next_prompt_index,
                "committed_ahead": list(self.committed_ahead)}

    @classmethod
    def from_dict(cls, d: object) -> GenerationCursor:
        if not isinstance(d, Mapping):
            raise BadInput("a cursor is a JSON object")
        v = d.get("cursor_version")
        if v != _CURSOR_VERSION:
            raise BadInput(f"cursor_version {v!r} is not supported (this reader knows "
                           f"{_CURSOR_VERSION})")
        try:
            return cls(d["run"], d["step"], d["next_prompt_index"],
                       tuple(d["committed_ahead"]))
        except (KeyError, TypeError) as exc:
            raise BadInput(f"not a generation cursor: {exc}") from exc

    def save(self, path: PathLike) -> None:
        """Replace ``path`` atomically: write a temp file, fsync, rename, fsync the dir."""
        p = Path(path)
        data = json.dumps(self.to_dict(), sort_keys=True).encode() + b"\n"
        tmp: Path | None = None
        try:
            fd, tmp_name = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
            tmp = Path(tmp_name)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
            _fsync_dir(p.parent)
        except OSError as exc:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
            raise JournalError(f"could not save cursor to {str(p)!r}: {exc}") from exc

    @classmethod
    def load(cls, path: PathLike) -> GenerationCursor | None:
        """The saved cursor, or ``None`` when none was saved yet."""
        try:
            raw = Path(path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise JournalError(f"could not read cursor {os.fspath(path)!r}: {exc}") from exc
        try:
            return cls.from_dict(json.loads(raw))
        except ValueError as exc:  # includes BadInput
            if isinstance(exc, RolloutCoreError):
                raise
            raise BadInput(f"cursor {os.fspath(path)!r} is not JSON: {exc}") from exc
