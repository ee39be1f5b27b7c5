"""The ``rolloutcore`` command line.

Subcommands register themselves through ``add_*_parser`` functions of the
modules that own them, so that importing the CLI does not import torch or
vLLM until a subcommand needs them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rolloutcore.errors import RolloutCoreError

__all__ = ["build_parser", "main"]


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {v}")
    return v


def _nonneg_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def _cmd_demo(args: argparse.Namespace) -> int:
    from rolloutcore.cli.demo import format_demo, run_demo

    r = run_demo(tokens=args.tokens, token_delay_s=args.token_delay_ms / 1000.0,
                 journal_path=args.json)
    print(format_demo(r))
    return 0 if r.ordering_ok else 1


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="a live update on the simulated engine (no install needed)")
    p.add_argument("--tokens", type=_positive_int, default=64,
                   help="length of the rollout that is mid-generation (default 64)")
    p.add_argument("--token-delay-ms", type=_nonneg_float, default=10.0,
                   help="simulated time per token (default 10)")
    p.add_argument("--json", metavar="PATH", default=None,
                   help="write the journal (JSON lines) to PATH")
    p.set_defaults(func=_cmd_demo)


def _optional_parsers() -> list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]],
                                         None]]:
    """Subcommands whose modules need the engine extras; imported lazily inside them."""
    out = []
    from rolloutcore.cli import commands as cli_engine

    out.extend(cli_engine.PARSERS)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutcore",
                                     description="Verified live policy updates for vLLM.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_demo(sub)
    for add in _optional_parsers():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc: int = args.func(args)
    except RolloutCoreError as exc:
        print(f"rolloutcore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc

