"""``rolloutcore model make``: a tiny offline checkpoint (``rolloutcore.testing.models``)."""

from __future__ import annotations

import argparse

__all__ = ["add_arguments"]


def _make(args: argparse.Namespace) -> int:
    from rolloutcore.testing.models import make_checkpoint

    print(make_checkpoint(args.out, args.seed, like=args.like, negate_layer=args.negate_layer))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore model`` and its one subcommand, ``make``."""
    sub = p.add_subparsers(dest="model_command", required=True)
    make = sub.add_parser("make", help="write a tiny Llama checkpoint (no network)")
    make.add_argument("--out", required=True, help="new or empty directory")
    make.add_argument("--seed", type=int, required=True)
    make.add_argument("--like", default=None, help="derive from this checkpoint")
    make.add_argument("--negate-layer", type=int, default=None,
                      help="with --like: negate this decoder layer")
    make.set_defaults(func=_make)
