"""Source files parsed once per process.

``test_layering.py`` and ``test_errors_tree.py`` both read every module of the package
as a syntax tree and every node of it; parsing and walking the ~180 modules is most of
their time, and the fast lane's schedule (``helpers.schedule``: they are among the
heaviest files, handed out first) runs them in one worker. The trees are read, never
changed.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

__all__ = ["parsed"]


@functools.cache
def parsed(path: Path) -> tuple[ast.Module, tuple[ast.AST, ...]]:
    """The file's tree and every node of it, in ``ast.walk`` order (parsed once per
    process and path: a file a test rewrites must be given a new path)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return tree, tuple(ast.walk(tree))
