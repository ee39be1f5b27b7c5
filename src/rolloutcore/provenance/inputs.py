"""What a file handed to ``audit`` or ``replay`` is, before anything is checked in it.

An audit or a replay of nothing must never say OK. This module owns the
answer to "is this file what the command was told it is?": a trajectory
file holds ``sample``/``commit`` records (``provenance.recorder``), a
lifecycle journal holds ``{"seq", "kind", "data"}`` records
(``control.journal``). An empty file, a file of which no line is such a
record, or the one passed where the other belongs (the journal as the
trajectory file, or the reverse) is refused with ``BadInput`` (the CLI's exit
2), the reason first; so is a trajectory file without one committed sample.
It reads at most ``SNIFF_LINES`` lines to tell the kinds apart, and knows
nothing of what the records mean.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from rolloutcore.errors import BadInput

__all__ = [
    "SNIFF_LINES",
    "Sniff",
    "check_journal_file",
    "check_journal_lines",
    "check_trajectory_file",
    "require_samples",
    "sniff",
]

#: Lines read to tell a trajectory file from a journal from anything else.
SNIFF_LINES = 200


@dataclass(frozen=True)
class Sniff:
    """What the first ``SNIFF_LINES`` non-blank lines of a file are."""

    path: str
    lines: int              # non-blank lines read (at most SNIFF_LINES)
    trajectory: int         # trajectory records ("record": "sample" or "commit")
    journal: int            # journal records ("seq", "kind", "data")
    other_json: int         # JSON, but neither
    not_json: int           # not JSON at all
    first: str              # the first non-blank line, cut to 80 characters

    @property
    def empty(self) -> bool:
        return self.lines == 0

    def describe(self) -> str:
        parts = [f"{n} {what}" for n, what in (
            (self.trajectory, "trajectory records"), (self.journal, "journal records"),
            (self.other_json, "other JSON"), (self.not_json, "not JSON")) if n]
        return (f"of its first {self.lines} lines: {', '.join(parts) or 'none'}; "
                f"first line {self.first!r}")


def sniff(path: str | os.PathLike[str], limit: int = SNIFF_LINES) -> Sniff:
    """Classify the first ``limit`` non-blank lines of ``path`` (a file that exists)."""
    p = os.fspath(path)
    lines = traj = jour = other = bad = 0
    first = ""
    try:
        with open(p, encoding="utf-8", errors="replace") as fh:
            for raw in fh:
                if not raw.strip():
                    continue
                if not lines:
                    first = raw.strip()[:80]
                lines += 1
                try:
                    obj = json.loads(raw)
                except ValueError:
                    bad += 1
                else:
                    if isinstance(obj, dict) and obj.get("record") in ("sample", "commit"):
                        traj += 1
                    elif isinstance(obj, dict) and {"seq", "kind", "data"} <= set(obj):
                        jour += 1
                    else:
                        other += 1
                if lines >= limit:
                    break
    except OSError as exc:
        raise BadInput(f"cannot read {p!r}: {exc}") from exc
    return Sniff(p, lines, traj, jour, other, bad, first)


def check_trajectory_file(path: str | os.PathLike[str]) -> None:
    """Refuse a path that is not a trajectory file, with the reason (``BadInput``)."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise BadInput(f"trajectory file {p!r} does not exist")
    if os.path.isdir(p):
        raise BadInput(f"trajectory file {p!r} is a directory")
    s = sniff(p)
    if s.empty:
        raise BadInput(f"trajectory file {p!r} is empty: nothing to check (the trajectory "
                       "file is the one TrajectoryRecorder, train or serve --trajectories "
                       "wrote)")
    if s.journal and not s.trajectory:
        raise BadInput(f"{p!r} is a lifecycle journal, not a trajectory file: give it as "
                       "--journal, and the trajectory file as --trajectories "
                       f"({s.describe()})")
    if not s.trajectory:
        raise BadInput(f"{p!r} is not a trajectory file: no line is a trajectory record "
                       f"({s.describe()})")


def require_samples(path: str | os.PathLike[str], samples: int) -> None:
    """Refuse a trajectory file that gave no committed sample: nothing was checked."""
    if samples == 0:
        raise BadInput(f"trajectory file {os.fspath(path)!r} holds no committed sample "
                       "(no group was committed: an interrupted first group, or records "
                       "without their commit line): nothing to check")


def check_journal_file(path: str | os.PathLike[str]) -> None:
    """Refuse a single journal file that is a trajectory file (the paths swapped)."""
    p = os.fspath(path)
    if not os.path.isfile(p):
        return   # missing or a fleet's directory: the journal reader says
    s = sniff(p)
    if s.trajectory and not s.journal:
        raise BadInput(f"{p!r} is a trajectory file, not a lifecycle journal: give it as "
                       f"--trajectories, and the journal as --journal ({s.describe()})")


def check_journal_lines(path: str | os.PathLike[str], lines: int, skipped: int) -> None:
    """Refuse a journal that was empty or of which no line could be read."""
    p = os.fspath(path)
    if lines == 0:
        raise BadInput(f"journal {p!r} is empty: no version can be checked against it "
                       "(leave --journal out to audit the trajectories alone)")
    if skipped >= lines:
        detail = f"; {sniff(p).describe()}" if os.path.isfile(p) else ""
        raise BadInput(f"journal {p!r} is not a lifecycle journal: none of its {lines} "
                       f"lines is a journal record{detail}")
