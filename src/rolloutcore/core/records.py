"""The records the controller and the runner write: the journal's schema.

Pure data, standard library only: the journal (``control.journal``) writes
and reads them, the invariant checker (``core.invariants``) and the audit
read them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rolloutcore.errors import JournalError

__all__ = ["KINDS", "JournalRecord"]

#: Record kinds written by the controller (``lifecycle``) and the runner.
KINDS = frozenset({
    "admit", "complete", "refuse", "request_update", "transition", "evidence", "verdict",
    "begin_update", "commit", "abandon", "failure", "taint", "begin_recovery",
    "effect", "note", "restore",
})


@dataclass(frozen=True)
class JournalRecord:
    seq: int
    t_mono: float
    t_wall: float
    kind: str
    data: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps({"seq": self.seq, "t_mono": self.t_mono, "t_wall": self.t_wall,
                           "kind": self.kind, "data": self.data}, sort_keys=True)

    @classmethod
    def from_obj(cls, obj: Any, where: str) -> JournalRecord:
        try:
            rec = cls(int(obj["seq"]), float(obj["t_mono"]), float(obj["t_wall"]),
                      str(obj["kind"]), dict(obj["data"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise JournalError(f"{where}: not a journal record") from exc
        if rec.kind not in KINDS:
            raise JournalError(f"{where}: unknown record kind {rec.kind!r}")
        return rec
