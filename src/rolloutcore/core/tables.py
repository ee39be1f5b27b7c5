"""Render the lifecycle's tables as Markdown, so the docs cannot drift from the code.

``python -m rolloutcore.core.tables > docs/state-machine.md`` regenerates the
document; a test checks the committed copy is current.
"""

from __future__ import annotations

from rolloutcore.core.lifecycle import (
    ESCALATION,
    FAILURE_POLICY,
    TRANSITIONS,
    Event,
    FailureKind,
    State,
    Step,
)

__all__ = ["render"]

_INTRO = """# The lifecycle: states, transitions, failure policy

Generated from `rolloutcore.core.lifecycle` by `python -m rolloutcore.core.tables`; do not edit.

A rollout is admitted only in READY. `request_update` closes admission; the
update's owner feeds the controller evidence step by step; the target is
published only on `resumed`. Illegal (state, event) pairs raise
`InvalidTransition` and change nothing.
"""


def render() -> str:
    lines = [_INTRO, "## Transitions", "",
             "| state | event | may lead to |", "|---|---|---|"]
    for (s, e), tos in TRANSITIONS.items():
        lines.append(f"| {s.value} | {e.value} | {', '.join(sorted(t.value for t in tos))} |")
    lines += ["", "## Legal events per state", "",
              "| state | " + " | ".join(e.value for e in Event) + " |",
              "|---|" + "---|" * len(Event)]
    for s in State:
        row = ["x" if (s, e) in TRANSITIONS else "" for e in Event]
        lines.append(f"| {s.value} | " + " | ".join(row) + " |")
    lines += ["", "## Failure policy", "",
              "`no_mutation`: the update is abandoned, the engine resumed on the old version "
              "(RESUMING -> READY), nothing published. `incomplete`: state unchanged, retried "
              "at most `max_incomplete` times, then escalated. `ambiguous`: TAINTED, nothing "
              "published or admitted until recovery.", "",
              "| step | " + " | ".join(k.value for k in FailureKind) + " | after retries |",
              "|---|" + "---|" * (len(FailureKind) + 1)]
    for st in Step:
        row = [FAILURE_POLICY[(st, k)].value for k in FailureKind]
        esc = ESCALATION[st].value if st in ESCALATION else ""
        lines.append(f"| {st.value} | " + " | ".join(row) + f" | {esc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover
    print(render(), end="")
