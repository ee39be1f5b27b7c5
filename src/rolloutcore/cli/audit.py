"""``rolloutcore audit``: the offline audits of ``rolloutcore.provenance.audit``."""

from __future__ import annotations

import argparse
import json
from typing import Any, Protocol

from rolloutcore.cli.vocab import add_report, emit

__all__ = ["add_arguments", "print_report", "trajectory_file"]


class Report(Protocol):
    """What ``audit`` and ``replay`` print: ``AuditReport``, ``ReplayReport``."""

    @property
    def ok(self) -> bool: ...

    def to_dict(self) -> dict[str, Any]: ...

    def format_table(self, max_rows: int = 50) -> str: ...


def print_report(result: Report, args: argparse.Namespace) -> int:
    """Print the result (``--json``: the full report; else its table, ``--max-rows``),
    write the full report to ``--report``; the exit status: 0 when ``ok``, 1 when
    anything is reported (a pipeline gates on it)."""
    emit(args, json.dumps(result.to_dict(), indent=2, sort_keys=True),
         result.format_table(args.max_rows))
    return 0 if result.ok else 1


def trajectory_file(args: argparse.Namespace) -> str:
    """The trajectory file: the first positional argument or --trajectories, one of them."""
    from rolloutcore.errors import BadInput

    pos, opt = args.trajectory_file, args.trajectories
    if pos is not None and opt is not None and pos != opt:
        raise BadInput(f"two trajectory files: {pos!r} and --trajectories {opt!r}; give one")
    if pos is None and opt is None:
        raise BadInput("give the trajectory file (first argument, or --trajectories FILE)")
    return str(pos if pos is not None else opt)


def _run(args: argparse.Namespace) -> int:
    """Bad input (an empty, unreadable or swapped file; no committed sample) raises
    ``BadInput`` before anything is printed."""
    from rolloutcore.provenance.audit import DiversityBaseline, audit_file

    return print_report(audit_file(trajectory_file(args), args.journal, DiversityBaseline(
        prefix_tokens=args.prefix_tokens, short_answer_tokens=args.short_answer_tokens,
        alpha=args.alpha)), args)


def add_trajectories(p: argparse.ArgumentParser) -> None:
    """The trajectory file, positional or ``--trajectories`` (audit and replay)."""
    p.add_argument("trajectory_file", nargs="?", default=None, metavar="TRAJECTORIES",
                   help="trajectory file written by TrajectoryRecorder (train, serve "
                        "--trajectories)")
    p.add_argument("--trajectories", default=None, metavar="FILE",
                   help="the same, as an option")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore audit``."""
    p.description = (
        "Report samples whose engine weight-version spans are mixed, disagree with the "
        "controller binding or name an uncommitted version, and groups whose siblings are "
        "less diverse than independent seeds give. Exit status 0 when clean, 1 when "
        "anything is reported, 2 on bad input.")
    add_trajectories(p)
    p.add_argument("--journal", default=None, metavar="PATH",
                   help="lifecycle journal (JSON lines), or a fleet's journal directory; "
                        "enables the committed-version checks")
    add_report(p, "the full report")
    p.add_argument("--max-rows", type=int, default=50, metavar="N",
                   help="rows per table in the text report (default 50)")
    p.add_argument("--prefix-tokens", type=int, default=16, metavar="N",
                   help="shared-prefix length that counts as a near-duplicate (default 16)")
    p.add_argument("--short-answer-tokens", type=int, default=8, metavar="N",
                   help="identical answers up to this length are expected (default 8)")
    p.add_argument("--alpha", type=float, default=1e-3,
                   help="binomial-tail threshold of the screens (default 1e-3)")
    p.set_defaults(func=_run)
