"""The fleet coordinator's tables: where a replica may go, and what an update decides.

The per-engine controller (``core.lifecycle``) decides whether *one* engine
may serve, mutate or publish; it is unchanged under a fleet. The coordinator
adds one question per replica, *is it in the pool?*, and answers it with a
table of its own, in the same house style: ``REPLICA_TRANSITIONS`` names the
one target of each legal (state, event); anything else is an
``InvalidTransition`` that changes nothing. Only ``SERVING`` is in the pool:
the router sends requests nowhere else.

The two decisions of an update are pure functions of per-replica outcomes:

* ``decide_synchronous``: publish when at least ``quorum`` replicas passed;
  then the failed ones are fenced (tainted: recovered; untouched: kept on
  the old version) and the passed ones serve the new one. Below the quorum
  nothing is published, and the passed replicas, which now hold weights the
  fleet never published, are *withheld* (fenced) until they are back on a
  published version.
* ``plan_waves``: the order and size of a rolling update's waves, refused
  when a wave would leave fewer than ``min_serving`` replicas serving.

Standard library only; no threads, clocks or I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rolloutcore.errors import BadInput, InvalidTransition

__all__ = [
    "REPLICA_TRANSITIONS",
    "IN_POOL",
    "Outcome",
    "ReplicaEvent",
    "ReplicaState",
    "Strategy",
    "SyncDecision",
    "decide_synchronous",
    "next_state",
    "plan_waves",
]


class ReplicaState(enum.StrEnum):
    JOINING = "JOINING"        # placed; not yet verified on a fleet version
    SERVING = "SERVING"        # in the pool, on a published fleet version
    UPDATING = "UPDATING"      # out of the pool for a fleet update (or its wave)
    FENCED = "FENCED"          # out of the pool: tainted, or holding unpublished weights
    RECOVERING = "RECOVERING"  # a replacement engine is being started and verified
    REJOINING = "REJOINING"    # being brought onto the fleet's current version
    REMOVED = "REMOVED"        # closed; never routed again


class ReplicaEvent(enum.StrEnum):
    BOOTSTRAPPED = "bootstrapped"  # its engine was taken over on a fleet version
    SELECTED = "selected"          # picked by a fleet update (or wave)
    PASSED = "passed"              # verified on the update's target, which is published
    KEPT = "kept"                  # the update did not touch it: back on its old version
    WITHHELD = "withheld"          # verified on a target the fleet did not publish
    TAINTED = "tainted"            # its engine taints (update, health watch, data plane)
    RECOVER = "recover"            # recovery starts
    RECOVERED = "recovered"        # replacement verified on a known checkpoint
    REJOIN = "rejoin"              # an update onto the fleet's current version starts
    REJOINED = "rejoined"          # verified on a published fleet version: back in the pool
    FAILED = "failed"              # bootstrap, recovery or rejoin did not succeed
    REMOVE = "remove"


S, E = ReplicaState, ReplicaEvent

#: (state, event) -> the one state it leads to.
REPLICA_TRANSITIONS: Mapping[tuple[ReplicaState, ReplicaEvent], ReplicaState] = {
    (S.JOINING, E.BOOTSTRAPPED): S.SERVING,
    (S.JOINING, E.FAILED): S.FENCED,
    (S.SERVING, E.SELECTED): S.UPDATING,
    (S.SERVING, E.TAINTED): S.FENCED,
    (S.UPDATING, E.PASSED): S.SERVING,
    (S.UPDATING, E.KEPT): S.SERVING,
    (S.UPDATING, E.WITHHELD): S.FENCED,
    (S.UPDATING, E.TAINTED): S.FENCED,
    (S.FENCED, E.SELECTED): S.UPDATING,   # a ready fenced engine joins the next update
    (S.FENCED, E.RECOVER): S.RECOVERING,
    (S.FENCED, E.REJOIN): S.REJOINING,
    (S.FENCED, E.REJOINED): S.SERVING,    # already verified on the current version
    (S.RECOVERING, E.RECOVERED): S.FENCED,  # then rejoins (or is already on the version)
    (S.RECOVERING, E.FAILED): S.FENCED,
    (S.REJOINING, E.REJOINED): S.SERVING,
    (S.REJOINING, E.FAILED): S.FENCED,
    (S.REJOINING, E.TAINTED): S.FENCED,
    **{(s, E.REMOVE): S.REMOVED for s in S if s is not S.REMOVED},
}

#: The states whose replicas the router may send requests to.
IN_POOL = frozenset({S.SERVING})


def next_state(state: ReplicaState, event: ReplicaEvent) -> ReplicaState:
    """The table's answer, or ``InvalidTransition`` naming both (nothing changes)."""
    to = REPLICA_TRANSITIONS.get((state, event))
    if to is None:
        raise InvalidTransition(event.value, state.value, "not in REPLICA_TRANSITIONS")
    return to


class Strategy(enum.StrEnum):
    SYNCHRONOUS = "synchronous"   # on-policy: every replica moves at once
    ROLLING = "rolling"           # waves; min_serving replicas always serve


class Outcome(enum.StrEnum):
    """How one replica's part of an update ended (its controller's classification)."""

    PASSED = "passed"             # its controller published the target
    NO_MUTATION = "no_mutation"   # refused before anything changed: old version, serving
    AMBIGUOUS = "ambiguous"       # tainted: fenced, recovered on its own
    SKIPPED = "skipped"           # not part of this update (busy, out of the pool)


@dataclass(frozen=True)
class SyncDecision:
    publish: bool
    serving: tuple[str, ...]      # on the new version (publish) ...
    kept: tuple[str, ...]         # back on their old version, serving
    withheld: tuple[str, ...]     # hold unpublished weights: fenced until back on a version
    tainted: tuple[str, ...]      # fenced, to be recovered
    reason: str


def decide_synchronous(outcomes: Mapping[str, Outcome], quorum: int) -> SyncDecision:
    """Publish iff at least ``quorum`` replicas passed; say what becomes of each."""
    if isinstance(quorum, bool) or not isinstance(quorum, int) or quorum < 1:
        raise BadInput(f"quorum must be an int >= 1, got {quorum!r}")
    passed = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.PASSED))
    kept = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.NO_MUTATION))
    tainted = tuple(sorted(n for n, o in outcomes.items() if o is Outcome.AMBIGUOUS))
    if len(passed) >= quorum:
        return SyncDecision(True, passed, kept, (), tainted,
                            f"{len(passed)} of {len(outcomes)} passed (quorum {quorum})")
    return SyncDecision(False, (), kept, passed, tainted,
                        f"only {len(passed)} of {len(outcomes)} passed (quorum {quorum}): "
                        "nothing published")


def plan_waves(order: Sequence[str], *, serving: int, min_serving: int,
               wave_size: int | None = None) -> list[tuple[str, ...]]:
    """Waves of a rolling update over ``order`` (the replicas to move, in order).

    ``serving`` is how many replicas serve now (those in ``order`` among
    them). Each wave takes ``wave_size`` of them out of the pool (default:
    as many as ``min_serving`` allows); refused, before anything moves, when
    no wave of at least one replica would keep ``min_serving`` serving.
    """
    names = list(order)
    if len(set(names)) != len(names):
        raise BadInput("a replica appears twice in the rolling order")
    for name, v in (("serving", serving), ("min_serving", min_serving)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise BadInput(f"{name} must be an int >= 0, got {v!r}")
    room = serving - min_serving
    if wave_size is None:
        wave_size = max(1, room)
    if isinstance(wave_size, bool) or not isinstance(wave_size, int) or wave_size < 1:
        raise BadInput(f"wave_size must be an int >= 1, got {wave_size!r}")
    if not names:
        return []
    if room < wave_size:
        raise BadInput(f"a wave of {wave_size} would leave {serving - wave_size} of {serving} "
                       f"replicas serving, below min_serving={min_serving}")
    return [tuple(names[i:i + wave_size]) for i in range(0, len(names), wave_size)]
