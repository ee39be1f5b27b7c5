"""The coordinator's journal: typed records of fleet updates, waves and replicas.

Each engine keeps its own journal (``control.journal``, written by its own
controller); this one records what only the coordinator knows: which
versions the *fleet* published, which replicas an update took, in which
waves, how each one ended, and every change of a replica's pool state
(``fleet.rules``). As ``core.records``: frozen classes, each with a ``KIND``,
written as one JSON line (``v``, ``seq``, ``t_mono``, ``t_wall``, ``kind``,
``data``) and read back into the same classes; a consumer matches on types.

``t_mono`` is the writing process's monotonic clock, the same clock the
engines' journals use when they are written by the same process, so a test
can put a replica's ``admit`` records between a fleet's ``fleet_closed`` and
its ``fleet_publish``.

Fleet records are rare (a few per update), so the journal writes and flushes
synchronously; a write that fails raises ``JournalError`` to the coordinator,
which then refuses further updates.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar, TypeVar

from rolloutcore.errors import JournalError

__all__ = [
    "FLEET_RECORD_TYPES",
    "FLEET_SCHEMA_VERSION",
    "FleetAbandon",
    "FleetBootstrap",
    "FleetClosed",
    "FleetJournal",
    "FleetJournalRecord",
    "FleetPublish",
    "FleetRecord",
    "FleetUpdateBegin",
    "ReplicaOutcome",
    "ReplicaStateChange",
    "WaveBegin",
    "WaveEnd",
    "read_fleet_journal",
]

FLEET_SCHEMA_VERSION = 1
R = TypeVar("R", bound="FleetRecord")


@dataclass(frozen=True)
class FleetRecord:
    KIND: ClassVar[str] = ""

    def to_data(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_data(cls: type[R], d: Mapping[str, Any]) -> R:
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        return cls(**kw)


@dataclass(frozen=True)
class FleetBootstrap(FleetRecord):
    """The fleet's first version: what every replica was taken over on."""

    KIND: ClassVar[str] = "fleet_bootstrap"
    generation: int
    label: str
    identity_digest: str
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class FleetUpdateBegin(FleetRecord):
    """An update starts: its strategy, target and the replicas it takes."""

    KIND: ClassVar[str] = "fleet_update"
    update_id: int
    strategy: str
    generation: int
    label: str
    identity_digest: str
    replicas: tuple[str, ...]
    quorum: int | None
    min_serving: int | None
    transfer: str


@dataclass(frozen=True)
class FleetClosed(FleetRecord):
    """Synchronous: every participant's controller has left READY; nothing is admitted
    anywhere until ``fleet_publish`` or ``fleet_abandon``."""

    KIND: ClassVar[str] = "fleet_closed"
    update_id: int
    replicas: tuple[str, ...]


@dataclass(frozen=True)
class WaveBegin(FleetRecord):
    KIND: ClassVar[str] = "wave"
    update_id: int
    wave: int
    replicas: tuple[str, ...]
    serving: int            # replicas still in the pool while this wave runs


@dataclass(frozen=True)
class WaveEnd(FleetRecord):
    KIND: ClassVar[str] = "wave_end"
    update_id: int
    wave: int
    passed: tuple[str, ...]
    failed: tuple[str, ...]
    seconds: float


@dataclass(frozen=True)
class ReplicaOutcome(FleetRecord):
    """How one replica's part of an update ended, as its controller classified it."""

    KIND: ClassVar[str] = "replica_outcome"
    update_id: int
    wave: int
    replica: str
    outcome: str                   # fleet.rules.Outcome
    engine_label: str | None       # the label its engine was given (its own target)
    engine_state: str
    transfer: str                  # fanout | per-engine | fanout+resend
    seconds: float
    reason: str = ""


@dataclass(frozen=True)
class FleetPublish(FleetRecord):
    KIND: ClassVar[str] = "fleet_publish"
    update_id: int
    generation: int
    label: str
    identity_digest: str
    replicas: tuple[str, ...]      # serving it at publication


@dataclass(frozen=True)
class FleetAbandon(FleetRecord):
    KIND: ClassVar[str] = "fleet_abandon"
    update_id: int
    reason: str


@dataclass(frozen=True)
class ReplicaStateChange(FleetRecord):
    """A replica's pool state changed (``fleet.rules.REPLICA_TRANSITIONS``)."""

    KIND: ClassVar[str] = "replica_state"
    replica: str
    before: str
    after: str
    event: str
    generation: int | None         # the fleet version it serves afterwards, if any
    engine_label: str | None
    reason: str = ""


FLEET_RECORD_TYPES: Mapping[str, type[FleetRecord]] = {t.KIND: t for t in (
    FleetBootstrap, FleetUpdateBegin, FleetClosed, WaveBegin, WaveEnd, ReplicaOutcome,
    FleetPublish, FleetAbandon, ReplicaStateChange)}


@dataclass(frozen=True)
class FleetJournalRecord:
    seq: int
    t_mono: float
    t_wall: float
    record: FleetRecord = field(compare=False)

    @property
    def kind(self) -> str:
        return self.record.KIND

    def to_json(self) -> str:
        return json.dumps({"v": FLEET_SCHEMA_VERSION, "seq": self.seq, "t_mono": self.t_mono,
                           "t_wall": self.t_wall, "kind": self.kind,
                           "data": self.record.to_data()}, sort_keys=True)


class FleetJournal:
    """Append-only JSON lines (or memory only without a path); every write is flushed."""

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 fsync: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self._fsync = fsync
        self._lock = threading.Lock()
        self._seq = 0
        self._records: list[FleetJournalRecord] = []
        self._fh: IO[str] | None = None
        self.failed: str | None = None
        if self.path is not None:
            try:
                if self.path.exists() and self.path.stat().st_size:
                    self._seq = max((r.seq for r in read_fleet_journal(self.path)), default=0)
                self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115
            except OSError as exc:
                raise JournalError(f"cannot open fleet journal {self.path}: {exc}") from exc

    def write(self, record: FleetRecord) -> FleetJournalRecord:
        if type(record) not in FLEET_RECORD_TYPES.values():
            raise JournalError(f"not a fleet record: {record!r}")
        with self._lock:
            if self.failed is not None:
                raise JournalError(f"fleet journal failed earlier: {self.failed}")
            self._seq += 1
            jr = FleetJournalRecord(self._seq, time.monotonic(), time.time(), record)
            if self._fh is not None:
                try:
                    self._fh.write(jr.to_json() + "\n")
                    self._fh.flush()
                    if self._fsync:
                        os.fsync(self._fh.fileno())
                except (OSError, ValueError) as exc:
                    self.failed = f"cannot write fleet record {jr.seq}: {exc}"
                    raise JournalError(self.failed) from exc
            self._records.append(jr)
            return jr

    @property
    def records(self) -> list[FleetJournalRecord]:
        with self._lock:
            return list(self._records)

    def of(self, kind: type[R]) -> list[R]:
        """The records of one type, in order."""
        return [r.record for r in self.records if isinstance(r.record, kind)]

    def close(self) -> None:
        with self._lock:
            fh, self._fh = self._fh, None
        if fh is not None:
            fh.close()


def read_fleet_journal(path: str | os.PathLike[str]) -> list[FleetJournalRecord]:
    """Every record of a fleet journal file, typed; ``JournalError`` on a bad line."""
    out: list[FleetJournalRecord] = []
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                if obj.get("v") != FLEET_SCHEMA_VERSION:
                    raise JournalError(f"{path}:{i}: fleet schema version {obj.get('v')!r}")
                t = FLEET_RECORD_TYPES[str(obj["kind"])]
                rec = t.from_data(obj["data"])
                out.append(FleetJournalRecord(int(obj["seq"]), float(obj["t_mono"]),
                                              float(obj["t_wall"]), rec))
            except JournalError:
                raise
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise JournalError(f"{path}:{i}: not a fleet journal record ({exc!r})") from exc
    return out
