"""``docs/cli.md``, generated from the parsers: ``python -m rolloutcore.cli.reference``.

The reference is each subcommand's own ``--help`` (``model make`` included),
formatted at a fixed width so that the file does not depend on the terminal;
``tests/test_docs_current.py`` checks that the file is what this prints.
"""

from __future__ import annotations

import argparse
import os

__all__ = ["WIDTH", "render"]

#: Columns of the generated help (argparse reads ``COLUMNS``).
WIDTH = 100


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def render() -> str:
    """The whole of ``docs/cli.md``."""
    from rolloutcore.cli import COMMANDS, build_parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        top = build_parser()
        out = ["# CLI reference", "",
               "Generated from the parsers by `python -m rolloutcore.cli.reference > "
               "docs/cli.md`; `tests/test_docs_current.py` keeps it current. Exit "
               "statuses and error messages: [troubleshooting.md](troubleshooting.md).",
               "", "```", top.format_help().rstrip(), "```", ""]
        for cmd in COMMANDS:
            parser = _subparsers(build_parser(cmd.name))[cmd.name]
            todo = [(f"rolloutcore {cmd.name}", parser)]
            while todo:
                name, p = todo.pop(0)
                out += [f"## {name}", "", "```", p.format_help().rstrip(), "```", ""]
                todo += [(f"{name} {n}", sp) for n, sp in _subparsers(p).items()]
        return "\n".join(out)
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


if __name__ == "__main__":
    print(render(), end="")
