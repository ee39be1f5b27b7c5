"""Render the machines' tables as Markdown, so the docs cannot drift from the code.

Four machines, one shell (``control.shell``): the engine's lifecycle
(``core.lifecycle``), a fleet's replica pool (``core.pool``), the trainer
protocol's leases (``core.lease``) and an engine's LoRA-adapter versions
(``core.adapters``).

``python -m rolloutcore.core.tables > docs/state-machine.md`` regenerates the
document; a test checks the committed copy is current.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar

from rolloutcore.core.adapters import (
    ADAPTER_TRANSITIONS,
    LOADED_STATES,
    AdapterEvent,
    AdapterState,
)
from rolloutcore.core.evidence import CacheKind
from rolloutcore.core.lease import FINAL, LEASE_TRANSITIONS, LeaseEvent, LeaseState
from rolloutcore.core.pool import IN_POOL, REPLICA_TRANSITIONS, ReplicaEvent, ReplicaState
from rolloutcore.core.records import Classification, Event, FailureKind, State, Step
from rolloutcore.core.rules import (
    ABORT_STEPS,
    ESCALATION,
    FAIL_STEPS,
    FAILURE_POLICY,
    FAILURE_TARGETS,
    RESETS_DONE,
    TRANSITIONS,
    UPDATE_MODES,
    WAKE_TARGETS,
    Lookup,
)

__all__ = ["render"]

_INTRO = """# The state machines: the engine's lifecycle, a fleet's pool, the leases, the adapters

Generated from `rolloutcore.core.lifecycle`, `core.pool`, `core.lease` and
`core.adapters` by
`python -m rolloutcore.core.tables`; do not edit. Each machine is pure (no lock,
clock or I/O) and runs in the one shell, `rolloutcore.control.shell`: its
decisions are made under the shell's lock, its records delivered to the journal
after the lock is released, and its snapshot published for readers that do not
lock.

## The engine's lifecycle (`core.lifecycle`)

A rollout is admitted only in READY. `request_update` closes admission; the
update's owner feeds the controller evidence step by step; the target is
published only on `resumed`. Each legal (state, event) names its one target,
or the one outcome table that picks it; evidence that does not hold is a
failure of its step (`bad_evidence`) and leaves through the state's `fail`
entry. Illegal (state, event) pairs raise `InvalidTransition` and change
nothing.
"""


def render() -> str:
    lines = [_INTRO, "## Transitions", "",
             "| state | event | target |", "|---|---|---|"]
    for (s, e), rule in TRANSITIONS.items():
        to = rule.value if isinstance(rule, State) else f"*{rule.value}* (below)"
        lines.append(f"| {s.value} | {e.value} | {to} |")
    lines += ["", "## Legal events per state", "",
              "| state | " + " | ".join(e.value for e in Event) + " |",
              "|---|" + "---|" * len(Event)]
    for s in State:
        row = ["x" if (s, e) in TRANSITIONS else "" for e in Event]
        lines.append(f"| {s.value} | " + " | ".join(row) + " |")
    lines += ["", f"## Outcome: {Lookup.RESETS.value}", "",
              "| every required cache reset | target |", "|---|---|"]
    for done, to in RESETS_DONE.items():
        lines.append(f"| {'yes' if done else 'no'} | {to.value} |")
    lines += ["", f"## Outcome: {Lookup.WAKE.value}", "",
              "Colocated training: who wakes the sleeping engine (an update, which writes "
              "the weights between the two wake calls, or a restore on the engine's own "
              "weights) and what one wake call brought back. A combination not listed is "
              "refused (`InvalidTransition`, nothing changes).", "",
              "| state | who wakes | woke | target |", "|---|---|---|---|"]
    for (s, who, tags), to in WAKE_TARGETS.items():
        lines.append(f"| {s.value} | {who} | {tags} | {to.value} |")
    lines += ["", f"## Outcome: {Lookup.FAILURE.value}", "",
              "A `fail` (or evidence that does not hold) is decided by the three tables "
              "below, in order: the policy row the reported step falls in, in this state "
              "(no row: `InvalidTransition`, nothing changes); the row's class for the "
              "failure's kind; where that class leads from this state.", "",
              "### Which row", "",
              "| state | step reported | row | while an abandoned update resumes |",
              "|---|---|---|---|"]
    for (s, st), policy_row in FAIL_STEPS.items():
        abort = ABORT_STEPS.get((s, st))
        lines.append(f"| {s.value} | {st.value} | {policy_row.value} | "
                     f"{abort.value if abort else 'refused'} |")
    lines += ["", "### The failure policy", "",
              "`no_mutation`: the update is abandoned, the engine resumed on the old version "
              "(RESUMING -> READY), nothing published. `incomplete`: state unchanged, retried "
              "at most `max_incomplete` times, then escalated. `ambiguous`: TAINTED, nothing "
              "published or admitted until recovery. A `no_mutation` failure after the "
              "controller saw a mutation start is ambiguous.", "",
              "| step | " + " | ".join(k.value for k in FailureKind) + " | after retries |",
              "|---|" + "---|" * (len(FailureKind) + 1)]
    for st in Step:
        row = [FAILURE_POLICY[(st, k)].value for k in FailureKind]
        esc = ESCALATION[st].value if st in ESCALATION else ""
        lines.append(f"| {st.value} | " + " | ".join(row) + f" | {esc} |")
    lines += ["", "### Where the class leads", "",
              "| state | " + " | ".join(c.value for c in Classification) + " |",
              "|---|" + "---|" * len(Classification)]
    for s in State:
        if (s, Event.FAIL) not in TRANSITIONS:
            continue
        row = [FAILURE_TARGETS[(s, c)].value if (s, c) in FAILURE_TARGETS else ""
               for c in Classification]
        lines.append(f"| {s.value} | " + " | ".join(row) + " |")
    lines += ["", "## Update modes", "",
              "What an update does with the rollouts bound when it begins (the controller's "
              "`update_mode`, one row each; `docs/async-modes.md` explains them). The pause "
              "is the drain step's; deferred resets are not done while paused but once "
              "nothing admitted under an older version runs (`runner.sweep`), the version "
              "salt of every request isolating the old entries until then.", "",
              "| mode | pause | rollouts in flight | drain waits for them | later tokens "
              "attend to old KV | resets deferred | needs the version salt |",
              "|---|---|---|---|---|---|---|"]
    for mode, mrow in UPDATE_MODES.items():
        pause = mrow.pause.value if mrow.pause else "the runner's drain mode (wait)"
        if mrow.clear_cache:
            pause += ", clear_cache"
        deferred = ", ".join(k.value for k in CacheKind if k in mrow.deferred_resets)
        lines.append(f"| {mode.value} | {pause} | {mrow.in_flight.value} | "
                     f"{'yes' if mrow.drains else 'no'} | "
                     f"{'yes' if mrow.kv_crosses_versions else 'no'} | {deferred or '-'} | "
                     f"{'yes' if mrow.needs_salt else 'no'} |")
    lines += _other_machines()
    return "\n".join(lines) + "\n"


_S = TypeVar("_S", bound=enum.StrEnum)
_E = TypeVar("_E", bound=enum.StrEnum)


def _grid(states: list[_S], events: list[_E], table: Mapping[tuple[_S, _E], _S]) -> list[str]:
    out = ["| state | " + " | ".join(e.value for e in events) + " |",
           "|---|" + "---|" * len(events)]
    for s in states:
        row = [table[(s, e)].value if (s, e) in table else "" for e in events]
        out.append(f"| {s.value} | " + " | ".join(row) + " |")
    return out


def _other_machines() -> list[str]:
    lines = ["", "## A fleet's replica pool (`core.pool`)", "",
             "Generated from `rolloutcore.core.pool.REPLICA_TRANSITIONS`. The router sends "
             "requests only to replicas in " + ", ".join(s.value for s in sorted(IN_POOL))
             + ", on a published fleet version, whose engine is READY on exactly the engine "
             "version it entered the pool with. A pair not listed is an `InvalidTransition` "
             "and changes nothing. Each cell: the state the event leads to.", ""]
    lines += _grid(list(ReplicaState), list(ReplicaEvent), REPLICA_TRANSITIONS)
    lines += ["", "## The trainer protocol's leases (`core.lease`)", "",
              "Generated from `rolloutcore.core.lease.LEASE_TRANSITIONS`. A begin grants a "
              "lease (open); the trainer's report or the lease's expiry decides it, and it "
              "ends in one final state (" + ", ".join(s.value for s in LeaseState
                                                     if s in FINAL)
              + ") with its result. One lease at a time is not final.", ""]
    lines += _grid(list(LeaseState), list(LeaseEvent), LEASE_TRANSITIONS)
    lines += ["", "## LoRA-adapter versions (`core.adapters`)", "",
              "Generated from `rolloutcore.core.adapters.ADAPTER_TRANSITIONS`. One machine "
              "per engine, beside the lifecycle: an adapter version is loaded into a new "
              "slot under a new name, so no request on another version or on the base is "
              "touched and no drain is needed (`docs/lora.md`). `verified` publishes it and "
              "supersedes the one published before in the same decision. One version at a "
              "time is loading, verifying or refusing; the states that hold a slot of the "
              "budget: " + ", ".join(s.value for s in AdapterState if s in LOADED_STATES)
              + ". A pair not listed is an `InvalidTransition` and changes nothing.", ""]
    lines += _grid(list(AdapterState), list(AdapterEvent), ADAPTER_TRANSITIONS)
    return lines


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
