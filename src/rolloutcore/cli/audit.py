"""``rolloutcore audit``: the offline audits of ``rolloutcore.provenance.audit``."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def _run(args: argparse.Namespace) -> int:
    from rolloutcore.provenance.audit import DiversityBaseline, run_audit

    return run_audit(args.trajectories, args.journal,
                     baseline=DiversityBaseline(prefix_tokens=args.prefix_tokens,
                                                short_answer_tokens=args.short_answer_tokens,
                                                alpha=args.alpha),
                     as_json=args.json, max_rows=args.max_rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore audit``."""
    p.description = (
        "Report samples whose engine weight-version spans are mixed, disagree with the "
        "controller binding or name an uncommitted version, and groups whose siblings are "
        "less diverse than independent seeds give. Exit status 0 when clean, 1 when "
        "anything is reported, 2 on bad input.")
    p.add_argument("--trajectories", required=True, metavar="FILE",
                   help="trajectory file written by TrajectoryRecorder")
    p.add_argument("--journal", default=None, metavar="FILE",
                   help="lifecycle journal (JSON lines); enables the committed-version checks")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.add_argument("--max-rows", type=int, default=50, metavar="N",
                   help="rows per table in the text report (default 50)")
    p.add_argument("--prefix-tokens", type=int, default=16, metavar="N",
                   help="shared-prefix length that counts as a near-duplicate (default 16)")
    p.add_argument("--short-answer-tokens", type=int, default=8, metavar="N",
                   help="identical answers up to this length are expected (default 8)")
    p.add_argument("--alpha", type=float, default=1e-3,
                   help="binomial-tail threshold of the screens (default 1e-3)")
    p.set_defaults(func=_run)
