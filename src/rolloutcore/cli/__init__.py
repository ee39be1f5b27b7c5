"""The ``rolloutcore`` command line: every argparse line of the project lives in this package.

Each subcommand is one module here with ``add_arguments(parser)``, which
declares the options and sets ``func`` (namespace -> exit status); the work
itself is a library function of the package that owns it. ``COMMANDS``
names them with their one-line help, so that ``rolloutcore --help`` lists
every subcommand without importing any, and only the module of the
subcommand that runs is imported. That is what keeps ``rolloutcore demo``
(standard library only) working without httpx, torch or vLLM installed; a
subcommand whose extra is missing says which one to install.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from rolloutcore import errors

__all__ = ["COMMANDS", "Command", "MissingExtra", "build_parser", "main"]


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, its help line, the module that declares it, its extra."""

    name: str
    help: str
    module: str
    extra: str | None = None   # what to install when its imports are missing


COMMANDS: tuple[Command, ...] = (
    Command("demo", "a live update on the simulated engine (no install needed)",
            "rolloutcore.cli.demo"),
    Command("model", "tiny offline checkpoints", "rolloutcore.cli.model", "cpu"),
    Command("train", "a short GRPO training (TRL) through RolloutCore on a real vLLM "
            "(tiny model, CPU)", "rolloutcore.cli.train", "trl"),
    Command("live-update", "a live policy update on a real vLLM (tiny model)",
            "rolloutcore.cli.live", "cpu"),
    Command("audit", "version purity and group diversity of a trajectory file",
            "rolloutcore.cli.audit"),
    Command("replay", "replay recorded samples against an engine at the same version",
            "rolloutcore.cli.replay", "service"),
    Command("serve", "the gateway in front of vLLM: versioned rollouts, trainer protocol",
            "rolloutcore.cli.serve", "service"),
)
_BY_NAME = {c.name: c for c in COMMANDS}


class MissingExtra(errors.BadInput):
    """A subcommand needs a package that is not installed."""


def _missing(cmd: Command, exc: ModuleNotFoundError) -> MissingExtra:
    """The error for a third-party import that failed; re-raises our own bugs."""
    if exc.name is None or exc.name.split(".")[0] == "rolloutcore":
        raise exc
    fix = (f"pip install 'rolloutcore[{cmd.extra}]'" if cmd.extra in ("service", "trl") else
           "pip install 'rolloutcore[cpu]' (or 'rolloutcore[gpu]' on a GPU machine)")
    return MissingExtra(f"'{cmd.name}' needs the {exc.name!r} package, which is not "
                        f"installed: {fix} (README, 'Install')")


def _load(cmd: Command, parser: argparse.ArgumentParser) -> None:
    try:
        module = importlib.import_module(cmd.module)
    except ModuleNotFoundError as exc:
        raise _missing(cmd, exc) from exc
    module.add_arguments(parser)


def _command_in(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line: the first word that is not an option."""
    for a in argv:
        if not a.startswith("-"):
            return a
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the options of ``command`` loaded (only its module is imported).

    Every subcommand is listed; the others parse no options until named.
    """
    from rolloutcore import __version__
    from rolloutcore.cli.vocab import HelpFormatter

    parser = argparse.ArgumentParser(prog="rolloutcore", formatter_class=HelpFormatter,
                                     description="Verified live policy updates for vLLM.")
    parser.add_argument("--version", action="version", version=f"rolloutcore {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for cmd in COMMANDS:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help,
                           formatter_class=HelpFormatter)
        if cmd.name == command:
            _load(cmd, p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (and ``python -m rolloutcore``): an exit status, 2 on bad input."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in args_in:   # ``serve ... -- VLLM OPTIONS``: vLLM's own, passed through
        cut = args_in.index("--")
        args_in, passthrough = args_in[:cut], args_in[cut + 1:]
    try:
        parser = build_parser(_command_in(args_in))
    except MissingExtra as exc:
        print(f"rolloutcore: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(args_in)
    if passthrough:
        if not hasattr(args, "vllm_args"):
            parser.error(f"'--' passes options to a launched vLLM: only serve takes them "
                         f"(got: {' '.join(passthrough)})")
        args.vllm_args = [*args.vllm_args, *passthrough]
    from rolloutcore.cli.signals import as_ctrl_c

    try:
        # SIGTERM and SIGHUP end the command as Ctrl-C does (#47)
        with as_ctrl_c():
            try:
                rc: int = args.func(args)
            except ModuleNotFoundError as exc:
                raise _missing(_BY_NAME[args.command], exc) from exc
    except errors.RolloutCoreError as exc:
        print(f"rolloutcore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return rc
