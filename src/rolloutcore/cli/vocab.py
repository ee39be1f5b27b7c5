"""The option vocabulary every subcommand shares: one word, one meaning.

* ``--json``: print the result as JSON on stdout (nothing else there).
* ``--report PATH``: write the full report (JSON) to a file.
* ``--trajectories FILE``: the trajectory file, read or written (``audit`` and
  ``replay`` also take it as their first positional argument).
* ``--journal PATH``: the lifecycle journal, read or written.

Older spellings stay as deprecated aliases that do what they did and print a
one-line warning on stderr (``serve --record``; ``demo --json PATH``, the
journal; ``train`` and ``live-update --json PATH``, the report), so scripts
keep working. ``HelpFormatter`` shows every option's default in ``--help``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["HelpFormatter", "add_json", "add_report", "deprecated", "emit", "timeline_lines",
           "warn_deprecated"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions of several lines as written (one line is wrapped); each option's
    default appended where its help does not give it."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text.strip():
            return super()._fill_text(text, width, indent)
        return argparse.HelpFormatter._fill_text(self, text, width, indent)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (action.option_strings and "default" not in text
                and default not in (None, False, [], (), argparse.SUPPRESS)
                and action.nargs != 0):
            text += " (default: %(default)s)"
        return text


def warn_deprecated(old: str, new: str) -> None:
    """The one-line warning of a deprecated spelling."""
    print(f"rolloutcore: warning: {old} is deprecated: use {new} (it does the same)",
          file=sys.stderr)


def deprecated(new: str) -> type[argparse.Action]:
    """An action storing its value like ``new`` does, after the deprecation warning."""

    class _Deprecated(argparse.Action):
        def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                     values: str | Sequence[Any] | None,
                     option_string: str | None = None) -> None:
            warn_deprecated(option_string or self.dest, new)
            setattr(namespace, self.dest, values)

    return _Deprecated


class _JsonOrOld(argparse.Action):
    """``--json``: print JSON; ``--json PATH`` (the old spelling): ``old_dest`` = PATH."""

    old_dest = ""
    old_new = ""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None,
                 option_string: str | None = None) -> None:
        if values is None:
            setattr(namespace, self.dest, True)
            return
        warn_deprecated(f"--json {values}", f"{self.old_new} {values}")
        setattr(namespace, self.old_dest, values)


def add_json(p: argparse.ArgumentParser | Any, what: str, *, old_dest: str | None = None,
             old_new: str = "") -> None:
    """``--json``: print ``what`` as JSON on stdout. ``old_dest``: this verb's ``--json
    PATH`` used to write a file, now ``old_new PATH`` (stored in ``old_dest``)."""
    if old_dest is None:
        p.add_argument("--json", action="store_true", help=f"print {what} as JSON on stdout")
        return
    action = type("_Json", (_JsonOrOld,), {"old_dest": old_dest, "old_new": old_new})
    p.add_argument("--json", nargs="?", action=action, default=False, metavar="PATH",
                   help=f"print {what} as JSON on stdout (--json PATH, the old spelling "
                        f"of {old_new} PATH, still works, with a warning)")


def add_report(p: argparse.ArgumentParser, what: str, *, old_json: bool = False) -> None:
    """``--json`` (print ``what``) and ``--report PATH`` (write it). ``old_json``: this
    verb's ``--json PATH`` is the old spelling of ``--report PATH``."""
    if old_json:
        add_json(p, what, old_dest="report", old_new="--report")
    else:
        add_json(p, what)
    p.add_argument("--report", default=None, metavar="PATH",
                   help=f"write {what} (JSON) to PATH")


def emit(args: argparse.Namespace, doc: str, text: str) -> None:
    """``doc`` (JSON) on stdout with ``--json``, else ``text``; ``doc`` to ``--report``."""
    print(doc if args.json else text)
    if args.report:
        Path(args.report).write_text(doc + "\n", encoding="utf-8")


def timeline_lines(timeline: Sequence[Mapping[str, Any]],
                   phases: Mapping[str, float]) -> list[str]:
    """The controller's state timeline and an update's phases, one line each."""
    lines = ["state timeline (time spent in each state):"]
    lines += [f"  {t['from']:<13} -> {t['to']:<13} on {t['event']:<14} "
              f"{t['duration_s'] * 1000:9.1f} ms" for t in timeline]
    return lines + ["update phases:"] + [f"  {k:<20} {v * 1000:9.1f} ms"
                                         for k, v in phases.items()]
