"""The tables that decide: every legal (state, event), and the failure policy.

Pure data and one lookup helper, standard library only. ``core.lifecycle``
applies them (one lookup per event; a missing key is one
``InvalidTransition``); ``core.tables`` renders them into
``docs/state-machine.md``, so the docs cannot drift. A change of the
lifecycle's behaviour is a change of these tables first.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.evidence import CacheKind, PauseMode
from rolloutcore.core.records import (
    Classification,
    Event,
    FailureKind,
    State,
    Step,
    UpdateMode,
)

__all__ = [
    "ABORT_STEPS",
    "ESCALATION",
    "FAILURE_POLICY",
    "FAILURE_TARGETS",
    "FAIL_STEPS",
    "InFlight",
    "Lookup",
    "ModeRule",
    "OUTCOMES",
    "RESETS_DONE",
    "SLEEP_STATES",
    "STEP_STATE",
    "TRANSITIONS",
    "UPDATE_MODES",
    "UPDATE_STATES",
    "WAKE_TARGETS",
    "targets",
]

S, E = State, Event
_NM, _INC, _AMB = Classification.NO_MUTATION, Classification.INCOMPLETE, Classification.AMBIGUOUS
_K = FailureKind
_ALL_BUT_UNINIT = tuple(s for s in State if s is not S.UNINITIALIZED)
#: The states an update owns (from the request to the publish or the abandon).
UPDATE_STATES = (S.DRAINING, S.QUIESCED, S.UPDATING, S.INVALIDATING, S.VALIDATING,
                  S.RESUMING)
#: Colocated training: the states a sleep owns (DOZING, SLEEPING) or its wake (all four).
SLEEP_STATES = (S.DOZING, S.SLEEPING, S.WAKING, S.WARMING)


class Lookup(enum.StrEnum):
    """A named outcome table: the target of an entry whose event can end two ways."""

    FAILURE = "failure policy"  # FAILURE_TARGETS[(state, FAILURE_POLICY[(step, kind)])]
    RESETS = "cache resets"     # RESETS_DONE[every required cache reset?]
    WAKE = "wake"               # WAKE_TARGETS[(state, who wakes, what woke)]


#: The one table of legal (state, event) pairs -> the target, or the named
#: outcome table that picks it. Evidence that does not hold is a failure of
#: its step, so it leaves through the state's FAIL entry.
TRANSITIONS: Mapping[tuple[State, Event], State | Lookup] = {
    (S.UNINITIALIZED, E.BOOTSTRAP): S.READY,
    (S.UNINITIALIZED, E.FAIL): Lookup.FAILURE,
    (S.READY, E.ADMIT): S.READY,
    **{(s, E.COMPLETE): s for s in _ALL_BUT_UNINIT},
    (S.READY, E.REQUEST_UPDATE): S.DRAINING,
    # The engine failed while serving (died, restarted, stopped answering): what it
    # serves next is unknown, so it leaves service until a recovery replaces it.
    (S.READY, E.FAIL): Lookup.FAILURE,
    (S.DRAINING, E.DRAINED): S.QUIESCED,
    (S.DRAINING, E.FAIL): Lookup.FAILURE,
    (S.QUIESCED, E.PREFLIGHTED): S.UPDATING,
    (S.QUIESCED, E.FAIL): Lookup.FAILURE,
    (S.UPDATING, E.TRANSFERRED): S.INVALIDATING,
    (S.UPDATING, E.FAIL): Lookup.FAILURE,
    (S.INVALIDATING, E.INVALIDATED): Lookup.RESETS,
    (S.INVALIDATING, E.FAIL): Lookup.FAILURE,
    (S.VALIDATING, E.VALIDATED): S.RESUMING,
    (S.VALIDATING, E.FAIL): Lookup.FAILURE,
    (S.RESUMING, E.RESUMED): S.READY,
    (S.RESUMING, E.FAIL): Lookup.FAILURE,
    (S.TAINTED, E.BEGIN_RECOVERY): S.RECOVERING,
    (S.RECOVERING, E.RECOVERED): S.READY,
    (S.RECOVERING, E.FAIL): Lookup.FAILURE,
    # Colocated training (issue 21). Nothing is admitted, transferred or reset while
    # the engine is asleep; a wake reaches READY only through the paused validation.
    (S.READY, E.REQUEST_SLEEP): S.DOZING,
    (S.DOZING, E.SLEPT): S.SLEEPING,
    (S.DOZING, E.FAIL): Lookup.FAILURE,
    (S.SLEEPING, E.REQUEST_WAKE): S.SLEEPING,  # the wake's owner (an update, or a restore)
    (S.SLEEPING, E.WOKE): Lookup.WAKE,
    (S.SLEEPING, E.FAIL): Lookup.FAILURE,
    (S.WAKING, E.TRANSFERRED): S.WARMING,
    (S.WAKING, E.FAIL): Lookup.FAILURE,
    (S.WARMING, E.WOKE): Lookup.WAKE,
    (S.WARMING, E.FAIL): Lookup.FAILURE,
}

#: (state, step reported) -> the failure-policy row that applies. A step that
#: does not run in a state has no entry. The live validation runs after the
#: resume, so its failure is a resume failure: it cannot be retried into service.
FAIL_STEPS: Mapping[tuple[State, Step], Step] = {
    (S.UNINITIALIZED, Step.BOOTSTRAP): Step.BOOTSTRAP,
    (S.READY, Step.SERVE): Step.SERVE,
    (S.DRAINING, Step.DRAIN): Step.DRAIN,
    (S.QUIESCED, Step.PREFLIGHT): Step.PREFLIGHT,
    (S.UPDATING, Step.TRANSFER): Step.TRANSFER,
    (S.INVALIDATING, Step.INVALIDATE): Step.INVALIDATE,
    (S.VALIDATING, Step.VALIDATE): Step.VALIDATE,
    (S.RESUMING, Step.RESUME): Step.RESUME,
    (S.RESUMING, Step.VALIDATE): Step.RESUME,
    (S.RECOVERING, Step.RECOVER): Step.RECOVER,
    **{(s, Step.RESTART): Step.RESTART for s in (*UPDATE_STATES, S.RECOVERING)},
    # Colocated training. A controller restarted while the engine sleeps cannot
    # vouch for what the engine holds (nor for the trainer that owns the sleep).
    (S.DOZING, Step.SLEEP): Step.SLEEP,
    (S.SLEEPING, Step.WAKE): Step.WAKE,
    (S.WAKING, Step.TRANSFER): Step.TRANSFER,
    (S.WARMING, Step.WAKE): Step.WAKE,
    **{(s, Step.RESTART): Step.RESTART for s in (S.DOZING, S.SLEEPING, S.WAKING, S.WARMING)},
}

#: The same, while an update that mutated nothing resumes the old version:
#: only the resume is left to fail.
ABORT_STEPS: Mapping[tuple[State, Step], Step] = {
    (S.RESUMING, Step.RESUME): Step.RESUME,
    (S.RESUMING, Step.RESTART): Step.RESTART,
}

#: Which state each step's effect runs in (derived from FAIL_STEPS: the first
#: state listed for it, so a step the colocated path shares keeps its own).
STEP_STATE: Mapping[Step, State] = {
    step: s for (s, step), row in reversed(list(FAIL_STEPS.items()))
    if row is step and step is not Step.RESTART}

#: The failure policy: (step, kind) -> class. Read by row: a drain that fails
#: in any way mutated nothing; a transfer that fails mutated nothing only when
#: it was refused up front; a cache reset or a label read that comes back
#: incomplete may be retried; once a mutation may have started, anything else
#: is ambiguous.
FAILURE_POLICY: Mapping[tuple[Step, FailureKind], Classification] = {
    # step              REFUSED       ERROR          TIMEOUT        BAD_EVIDENCE   DIED
    **dict(zip([(Step.BOOTSTRAP, k) for k in _K], [_NM, _NM, _NM, _NM, _NM], strict=True)),
    **dict(zip([(Step.DRAIN, k) for k in _K], [_NM, _NM, _NM, _INC, _NM], strict=True)),
    **dict(zip([(Step.PREFLIGHT, k) for k in _K], [_NM, _NM, _NM, _NM, _NM], strict=True)),
    **dict(zip([(Step.TRANSFER, k) for k in _K], [_NM, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.INVALIDATE, k) for k in _K], [_INC, _INC, _AMB, _INC, _AMB], strict=True)),
    **dict(zip([(Step.VALIDATE, k) for k in _K], [_INC, _INC, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.RESUME, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.RECOVER, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.SERVE, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.RESTART, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
    # A sleep refused up front (no sleep mode, rollouts still bound) left the engine
    # as it was; once /sleep was sent its memory is in an unknown state.
    **dict(zip([(Step.SLEEP, k) for k in _K], [_NM, _AMB, _AMB, _AMB, _AMB], strict=True)),
    **dict(zip([(Step.WAKE, k) for k in _K], [_AMB, _AMB, _AMB, _AMB, _AMB], strict=True)),
}

#: Where an incomplete observation ends up once its retries are used up.
ESCALATION: Mapping[Step, Classification] = {
    Step.DRAIN: _NM,
    Step.INVALIDATE: _AMB,
    Step.VALIDATE: _AMB,
}

#: (state, class) -> target: no_mutation resumes the old version (nothing to
#: resume before bootstrap), incomplete stays, ambiguous taints.
FAILURE_TARGETS: Mapping[tuple[State, Classification], State] = {
    (S.UNINITIALIZED, _NM): S.UNINITIALIZED,
    (S.READY, _AMB): S.TAINTED,
    (S.DRAINING, _NM): S.RESUMING,
    (S.DRAINING, _INC): S.DRAINING,
    (S.DRAINING, _AMB): S.TAINTED,
    (S.QUIESCED, _NM): S.RESUMING,
    (S.QUIESCED, _AMB): S.TAINTED,
    (S.UPDATING, _NM): S.RESUMING,
    (S.UPDATING, _AMB): S.TAINTED,
    (S.INVALIDATING, _INC): S.INVALIDATING,
    (S.INVALIDATING, _AMB): S.TAINTED,
    (S.VALIDATING, _INC): S.VALIDATING,
    (S.VALIDATING, _AMB): S.TAINTED,
    (S.RESUMING, _AMB): S.TAINTED,
    (S.RECOVERING, _AMB): S.TAINTED,
    # A sleep that never reached the engine: serve on, nothing was touched.
    (S.DOZING, _NM): S.READY,
    (S.DOZING, _AMB): S.TAINTED,
    (S.SLEEPING, _AMB): S.TAINTED,
    # Once woken, the old weights are gone (level 2) or unverified: there is no
    # old version to resume, even when the failed step itself changed nothing.
    (S.WAKING, _NM): S.TAINTED,
    (S.WAKING, _AMB): S.TAINTED,
    (S.WARMING, _AMB): S.TAINTED,
}

#: Every required cache reset? -> target.
RESETS_DONE: Mapping[bool, State] = {False: S.INVALIDATING, True: S.VALIDATING}

#: (state, who wakes, what the wake call brought back) -> target. An update
#: wakes the weights, writes them, then wakes the KV cache; a restore (a wake on
#: the engine's own weights) wakes everything at once. A key with no entry is
#: refused: the KV cache before the weights (vLLM restores the model's buffers
#: with the weights), the KV cache before the update wrote the weights, an
#: update that wakes everything before its transfer.
WAKE_TARGETS: Mapping[tuple[State, str, str], State] = {
    (S.SLEEPING, "update", "weights"): S.WAKING,
    (S.SLEEPING, "restore", "all"): S.INVALIDATING,
    (S.WARMING, "update", "kv_cache"): S.INVALIDATING,
}

OUTCOMES: Mapping[Lookup, Mapping[Any, State]] = {
    Lookup.FAILURE: FAILURE_TARGETS,
    Lookup.RESETS: RESETS_DONE,
    Lookup.WAKE: WAKE_TARGETS,
}


class InFlight(enum.StrEnum):
    """What an update does with the rollouts bound when it pauses the engine."""

    DRAINED = "drained"          # none are left: the drain waits for them (strict)
    KEPT = "kept"                # frozen in the engine, continue under the new version
    RESUBMITTED = "resubmitted"  # aborted at the pause; their owner resubmits prompt +
    #                              partial output under the new version (KV recomputed)
    RECOMPUTED = "recomputed"    # frozen, their KV freed at the pause; the engine
    #                              recomputes them under the new version on resume


@dataclass(frozen=True)
class ModeRule:
    """One update mode, as the controller applies it (issue 20).

    ``pause``: how the engine is paused (``None``: the runner's drain mode,
    WAIT or ABORT, after the bound rollouts finished); ``in_flight``: what
    happens to rollouts bound at the pause; ``kv_crosses_versions``: a
    carried rollout's later tokens attend to KV computed by an older
    version (its record says so); ``deferred_resets``: caches not reset
    while paused (they cannot be while requests are kept: vLLM refuses a
    prefix reset then) but isolated by the version salt of every request
    and reset once nothing admitted under an older version runs;
    ``needs_salt``: the data plane must salt every request's prefix cache
    by its admission version, or a new request could reuse KV of the old
    one; ``clear_cache``: the pause asks the engine to clear its caches
    (vLLM's ``clear_cache=true``, which with ``keep`` preempts the frozen
    requests so that their KV is recomputed on resume); every other pause
    pins ``clear_cache=false``, the resets being steps of their own.
    """

    pause: PauseMode | None
    in_flight: InFlight
    kv_crosses_versions: bool
    deferred_resets: frozenset[CacheKind]
    needs_salt: bool
    clear_cache: bool = False

    @property
    def drains(self) -> bool:
        """The drain waits until no rollout is bound (no rollout spans versions)."""
        return self.in_flight is InFlight.DRAINED


#: The update modes, one row each. Strict is today's behaviour; the two
#: asynchronous ones let rollouts span versions, within ``max_staleness``.
UPDATE_MODES: Mapping[UpdateMode, ModeRule] = {
    UpdateMode.STRICT: ModeRule(None, InFlight.DRAINED, False, frozenset(), False),
    UpdateMode.KEEP: ModeRule(PauseMode.KEEP, InFlight.KEPT, True,
                              frozenset({CacheKind.PREFIX}), True),
    UpdateMode.RECOMPUTE: ModeRule(PauseMode.ABORT, InFlight.RESUBMITTED, False,
                                   frozenset(), False),
    UpdateMode.ENGINE_RECOMPUTE: ModeRule(PauseMode.KEEP, InFlight.RECOMPUTED, False,
                                          frozenset(), True, clear_cache=True),
}


def targets(state: State, event: Event) -> frozenset[State]:
    """The states a legal (state, event) may lead to (for the docs and the restore)."""
    rule = TRANSITIONS[(state, event)]
    if isinstance(rule, State):
        return frozenset({rule})
    if rule is Lookup.FAILURE:
        return frozenset(t for (s, _), t in FAILURE_TARGETS.items() if s is state)
    if rule is Lookup.WAKE:
        return frozenset(t for (s, _, _), t in WAKE_TARGETS.items() if s is state)
    return frozenset(OUTCOMES[rule].values())


