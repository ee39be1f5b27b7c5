"""``rolloutcore replay``: the replay validator of ``rolloutcore.provenance.replay``."""

from __future__ import annotations

import argparse

from rolloutcore.cli import argtypes
from rolloutcore.cli.audit import add_trajectories, print_report, trajectory_file
from rolloutcore.cli.vocab import add_report
from rolloutcore.provenance.replay_options import DEFAULT_TOLERANCE, MismatchPolicy

__all__ = ["add_arguments"]


def _run(args: argparse.Namespace) -> int:
    """1 also when a sample was skipped (``--on-mismatch skip``: not verified). A refused
    replay (``ReplayRefused``) and bad input raise before anything is printed."""
    from rolloutcore.provenance.replay import replay_file  # needs httpx: only when it runs

    return print_report(replay_file(
        trajectory_file(args), args.engine, tolerance=args.tolerance, policy=args.on_mismatch,
        checksum_cache=args.checksum_cache, timeout_s=args.timeout), args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore replay``."""
    p.description = (
        "Regenerate greedy and seeded samples (token lane, exact) and re-score every "
        "recorded prompt + completion (logprob lane, within a tolerance) on a vLLM engine "
        "serving the records' version. Refuses an engine at another version. Exit status 0 "
        "when everything replayed matches, 1 when anything differs, 2 when refused or on "
        "bad input.")
    add_trajectories(p)
    p.add_argument("--engine", required=True, metavar="URL",
                   help="base URL of the vLLM server (dev mode, --enable-scale-out)")
    p.add_argument("--tolerance", type=argtypes.tolerance, default=DEFAULT_TOLERANCE,
                   metavar="NATS",
                   help=f"logprob lane tolerance in nats (default {DEFAULT_TOLERANCE})")
    p.add_argument("--on-mismatch", choices=[m.value for m in MismatchPolicy],
                   default=MismatchPolicy.REFUSE.value,
                   help="samples at another version: refuse the replay (default), report "
                        "them as mismatches, or skip them (replays the others; the skipped "
                        "are not verified, so the verdict is NOT VERIFIED, exit 1)")
    p.add_argument("--checksum-cache", default=None, metavar="DIR",
                   help="reference checksums (rolloutcore.engine.verify.ChecksumCache):"
                        " verify the engine's weights against the bound checkpoints,"
                        " not just labels")
    p.add_argument("--timeout", type=argtypes.positive_seconds, default=120.0, metavar="S",
                   help="timeout of each engine call in seconds (default 120)")
    add_report(p, "the full report")
    p.add_argument("--max-rows", type=int, default=50, metavar="N",
                   help="rows in the text report (default 50)")
    p.set_defaults(func=_run)
