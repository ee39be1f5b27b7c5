"""A fleet of engines: one controller per engine, a coordinator above, a router in front.

The pool's machine (the replica table, its records, the update decisions)
is ``rolloutcore.core.pool``, run in the shell every machine runs in;
``routing`` (policies, eligibility, balance) is pure; ``coordinator``
bootstraps and supervises the pool, on ``updates`` (synchronous and rolling
updates) over ``members`` (the replicas, their pool and its queries); ``gateway`` is the
single gateway's data plane with a router in front (version-aware routing,
status, metrics); ``placement`` starts engines (URLs, local processes, Ray
actors) and builds their replicas.
"""

from rolloutcore.core.pool import FleetVersion, Outcome, ReplicaState, Strategy
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import (
    FanoutTransport,
    FleetConfig,
    FleetUpdateFailed,
    FleetUpdateResult,
    FleetWeights,
    Replica,
)
from rolloutcore.fleet.routing import Policy, PolicyKind, Router, RouteRefused

__all__ = [
    "FanoutTransport",
    "FleetConfig",
    "FleetCoordinator",
    "FleetUpdateFailed",
    "FleetUpdateResult",
    "FleetVersion",
    "FleetWeights",
    "Outcome",
    "Policy",
    "PolicyKind",
    "Replica",
    "ReplicaState",
    "RouteRefused",
    "Router",
    "Strategy",
]
