"""Check the lifecycle invariants from a journal alone.

The controller enforces the invariants as it runs; this module re-checks
them afterwards from the records it wrote, so that a test, a soak run or an
auditor does not have to trust the process that produced them:

* ``admission``: a rollout is admitted only in READY (so never while TAINTED);
* ``drain_before_mutation``: at ``begin_update`` no rollout is bound;
* ``version_pure``: no rollout's admission and completion straddle a
  ``begin_update``, and it completes under the version it was bound to;
* ``commit_after_validation``: every publish of an update follows, within
  that update, an accepted paused validation and the resume evidence; a
  recovery publish follows recovery evidence without problems;
* ``fail_closed``: nothing is published between a taint and a recovery.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.records import JournalRecord

__all__ = ["Violation", "check_journal"]


@dataclass(frozen=True)
class Violation:
    invariant: str
    seq: int
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {"invariant": self.invariant, "seq": self.seq, "detail": self.detail}


def check_journal(records: Iterable[JournalRecord]) -> list[Violation]:
    out: list[Violation] = []
    state = "UNINITIALIZED"
    active: dict[str, dict[str, Any]] = {}
    mutations = 0                       # begin_update records seen so far
    admitted_at_mutation: dict[str, int] = {}
    in_update = False
    validated = resumed_ev = False
    recovering = recovery_ok = False
    tainted = False
    for r in records:
        d = r.data
        if r.kind == "transition":
            state = str(d.get("to"))
        elif r.kind == "admit":
            rid = str(d.get("rollout_id"))
            if state != "READY":
                out.append(Violation("admission", r.seq, f"{rid} admitted in {state}"))
            active[rid] = dict(d.get("version") or {})
            admitted_at_mutation[rid] = mutations
        elif r.kind == "complete":
            rid = str(d.get("rollout_id"))
            bound = active.pop(rid, None)
            if bound is None:
                out.append(Violation("version_pure", r.seq, f"{rid} completed, never admitted"))
                continue
            if admitted_at_mutation.pop(rid, mutations) != mutations:
                out.append(Violation("version_pure", r.seq,
                                     f"{rid} straddles a weight mutation"))
            if d.get("version") != bound:
                out.append(Violation("version_pure", r.seq,
                                     f"{rid} completed under {d.get('version')}, bound {bound}"))
        elif r.kind == "request_update":
            in_update, validated, resumed_ev = True, False, False
        elif r.kind == "begin_update":
            mutations += 1
            if active:
                out.append(Violation("drain_before_mutation", r.seq,
                                     f"mutation began with {sorted(active)} bound"))
        elif r.kind == "verdict" and d.get("event") == "validated" and d.get("accepted"):
            validated = True
        elif r.kind == "evidence" and d.get("event") == "resumed" and not d.get("problems"):
            resumed_ev = True
        elif r.kind == "evidence" and d.get("event") == "recovered":
            recovery_ok = recovering and not d.get("problems")
        elif r.kind == "taint":
            tainted, in_update = True, False
        elif r.kind == "begin_recovery":
            recovering, recovery_ok = True, False
        elif r.kind == "abandon":
            in_update = False
        elif r.kind == "commit":
            if recovering:
                if not recovery_ok:
                    out.append(Violation("commit_after_validation", r.seq,
                                         "recovery published without clean recovery evidence"))
                recovering = tainted = False
            elif tainted:
                out.append(Violation("fail_closed", r.seq, "published while tainted"))
            elif in_update and not (validated and resumed_ev):
                out.append(Violation("commit_after_validation", r.seq,
                                     f"published without validation={validated} "
                                     f"resume={resumed_ev}"))
            in_update = False
    return out
