"""A fleet of engines: one controller per engine, a coordinator above, a router in front.

``rules`` (the replica pool table and the update decisions) and ``routing``
(policies, eligibility, balance) are pure; ``records`` is the coordinator's
journal; ``coordinator`` runs synchronous and rolling updates and supervises
the pool; ``gateway`` is the HTTP front (version-aware routing, status,
metrics); ``placement`` starts engines (URLs, local processes, Ray actors)
and builds their replicas.
"""

from rolloutcore.fleet.coordinator import (
    FanoutTransport,
    FleetConfig,
    FleetCoordinator,
    FleetUpdateFailed,
    FleetUpdateResult,
    FleetVersion,
    FleetWeights,
    Replica,
)
from rolloutcore.fleet.routing import Policy, PolicyKind, Router, RouteRefused
from rolloutcore.fleet.rules import Outcome, ReplicaState, Strategy

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
