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
from collections.abc import Sequence
from typing import Any

__all__ = ["HelpFormatter", "add_json", "deprecated", "warn_deprecated"]


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
