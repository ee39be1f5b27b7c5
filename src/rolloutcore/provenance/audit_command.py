"""``rolloutcore audit`` as a library call: the audit of a file, printed, as an exit status.

Apart from ``provenance.audit`` (what is checked) and ``provenance.inputs``
(what a file is): this module prints and writes, they do not.
"""

from __future__ import annotations

import json
import os

from rolloutcore.errors import BadInput
from rolloutcore.provenance.audit import DiversityBaseline, audit_file

__all__ = ["run_audit"]


def run_audit(trajectories: str | os.PathLike[str],
              journal: str | os.PathLike[str] | None = None, *,
              baseline: object = None, as_json: bool = False, max_rows: int = 50,
              report: str | os.PathLike[str] | None = None) -> int:
    """``rolloutcore audit``: print the report; 0 when clean, 1 when anything is reported.

    The exit status is the point: a pipeline gates on it. Bad input (an empty,
    unreadable or swapped file; no committed sample) raises ``BadInput`` before
    anything is printed.
    """
    if baseline is not None and not isinstance(baseline, DiversityBaseline):
        raise BadInput("baseline must be a DiversityBaseline")
    audit = audit_file(trajectories, journal, baseline or DiversityBaseline())
    doc = json.dumps(audit.to_dict(), indent=2, sort_keys=True)
    print(doc if as_json else audit.format_table(max_rows))
    if report is not None:
        with open(report, "w", encoding="utf-8") as f:
            f.write(doc + "\n")
    return 0 if audit.ok else 1
