"""``rolloutcore model make``: a tiny offline checkpoint (``rolloutcore.testing.models``).

``--arch llama`` (default) writes the tiny text model; ``--arch vlm`` the tiny
Idefics3 vision-language model (``rolloutcore.testing.vlm``), whose "next
policy" keeps the text weights and redraws the vision tower
(``--like A --new-vision-seed N``).
"""

from __future__ import annotations

import argparse

from rolloutcore.errors import BadInput

__all__ = ["add_arguments"]


def _make(args: argparse.Namespace) -> int:
    if args.arch == "vlm":
        if args.negate_layer is not None:
            raise BadInput("--negate-layer is for --arch llama")
        if args.like is not None and args.new_vision_seed is None:
            raise BadInput("--arch vlm --like needs --new-vision-seed")
        from rolloutcore.testing.vlm import make_vlm_checkpoint

        print(make_vlm_checkpoint(args.out, args.seed, like=args.like,
                                  new_vision_seed=args.new_vision_seed))
        return 0
    if args.new_vision_seed is not None:
        raise BadInput("--new-vision-seed is for --arch vlm")
    from rolloutcore.testing.models import make_checkpoint

    print(make_checkpoint(args.out, args.seed, like=args.like, negate_layer=args.negate_layer))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore model`` and its one subcommand, ``make``."""
    from rolloutcore.cli.vocab import HelpFormatter

    sub = p.add_subparsers(dest="model_command", required=True, metavar="SUBCOMMAND")
    make = sub.add_parser("make", help="write a tiny checkpoint (no network)",
                          formatter_class=HelpFormatter)
    make.add_argument("--out", required=True, help="new or empty directory")
    make.add_argument("--seed", type=int, required=True,
                      help="the random weights' seed (the same seed, the same weights)")
    make.add_argument("--arch", choices=("llama", "vlm"), default="llama",
                      help="llama: the tiny text model (default); vlm: a tiny Idefics3 "
                           "vision-language model")
    make.add_argument("--like", default=None, help="derive from this checkpoint")
    make.add_argument("--negate-layer", type=int, default=None,
                      help="llama with --like: negate this decoder layer")
    make.add_argument("--new-vision-seed", type=int, default=None,
                      help="vlm with --like: keep the text weights, draw a new vision tower "
                           "and connector from this seed")
    make.set_defaults(func=_make)
