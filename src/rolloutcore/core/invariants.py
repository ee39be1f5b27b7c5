"""Check the lifecycle invariants from a journal alone.

The controller enforces the invariants as it runs; this module re-checks
them afterwards from the records it wrote, so that a test, a soak run or an
auditor does not have to trust the process that produced them:

* ``admission``: a rollout is admitted only in READY (so never while TAINTED);
* ``drain_before_mutation``: at ``begin_update`` no rollout is bound, except
  those the update's ``carry`` record names (asynchronous modes);
* ``version_pure``: no rollout's admission and completion straddle a
  ``begin_update`` unless a ``carry`` record carried it across, and it
  completes under the version it was bound to;
* ``staleness_bound``: a carried rollout that completes attributable saw at
  most ``max_staleness`` publishes since its admission;
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

from rolloutcore.core.records import (
    Abandon,
    Admit,
    BeginRecovery,
    BeginUpdate,
    Carry,
    Commit,
    Complete,
    Event,
    EvidenceSeen,
    JournalRecord,
    RequestUpdate,
    State,
    Taint,
    Transition,
    Verdict,
)
from rolloutcore.core.versions import WeightVersion

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
    state = State.UNINITIALIZED
    active: dict[str, WeightVersion] = {}
    mutations = 0                       # begin_update records seen so far
    admitted_at_mutation: dict[str, int] = {}
    in_update = False
    validated = resumed_ev = False
    recovering = recovery_ok = False
    tainted = False
    carried: dict[str, int | None] = {}  # rollout -> the bound of the last carry naming it
    commits = 0
    admitted_at_commit: dict[str, int] = {}
    carry_now: frozenset[str] = frozenset()
    for jr in records:
        r, seq = jr.record, jr.seq
        if isinstance(r, Carry):
            carry_now = frozenset(r.carried)
            for rid in r.carried:
                carried[rid] = r.max_staleness
        elif isinstance(r, Transition):
            state = r.after
        elif isinstance(r, Admit):
            if state is not State.READY:
                out.append(Violation("admission", seq, f"{r.rollout_id} admitted in {state}"))
            active[r.rollout_id] = r.version
            admitted_at_mutation[r.rollout_id] = mutations
            admitted_at_commit[r.rollout_id] = commits
        elif isinstance(r, Complete):
            rid = r.rollout_id
            bound = active.pop(rid, None)
            if bound is None:
                out.append(Violation("version_pure", seq, f"{rid} completed, never admitted"))
                continue
            was_carried = rid in carried
            bound_k = carried.pop(rid, None)
            age = commits - admitted_at_commit.pop(rid, commits)
            if admitted_at_mutation.pop(rid, mutations) != mutations and not was_carried:
                out.append(Violation("version_pure", seq, f"{rid} straddles a weight mutation"))
            if was_carried and r.attributable and bound_k is not None and age > bound_k:
                out.append(Violation("staleness_bound", seq,
                                     f"{rid} completed attributable {age} publishes after "
                                     f"its admission (max_staleness {bound_k})"))
            if r.version != bound:
                out.append(Violation("version_pure", seq,
                                     f"{rid} completed under {r.version}, bound {bound}"))
        elif isinstance(r, RequestUpdate):
            in_update, validated, resumed_ev = True, False, False
            carry_now = frozenset()
        elif isinstance(r, BeginUpdate):
            mutations += 1
            bound_now = sorted(set(active) - carry_now)
            if bound_now:
                out.append(Violation("drain_before_mutation", seq,
                                     f"mutation began with {bound_now} bound"))
        elif isinstance(r, Verdict):
            if r.event is Event.VALIDATED and r.accepted:
                validated = True
        elif isinstance(r, EvidenceSeen):
            if r.event is Event.RESUMED and not r.problems:
                resumed_ev = True
            elif r.event is Event.RECOVERED:
                recovery_ok = recovering and not r.problems
        elif isinstance(r, Taint):
            tainted, in_update = True, False
        elif isinstance(r, BeginRecovery):
            recovering, recovery_ok = True, False
        elif isinstance(r, Abandon):
            in_update = False
        elif isinstance(r, Commit):
            commits += 1
            if recovering:
                if not recovery_ok:
                    out.append(Violation("commit_after_validation", seq,
                                         "recovery published without clean recovery evidence"))
                recovering = tainted = False
            elif tainted:
                out.append(Violation("fail_closed", seq, "published while tainted"))
            elif in_update and not (validated and resumed_ev):
                out.append(Violation("commit_after_validation", seq,
                                     f"published without validation={validated} "
                                     f"resume={resumed_ev}"))
            in_update = False
    return out
