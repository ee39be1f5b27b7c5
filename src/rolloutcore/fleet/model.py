"""The fleet's value types: a replica, the weights an update installs, the fleet's
versions, its configuration, an update's result, and the fan-out transport port.

Apart from the coordinator so that placement, the gateway and the CLI use them
without loading the coordinator's machinery.
"""


from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.port import Recoverer
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.pool import FleetVersion, Outcome, Strategy
from rolloutcore.core.records import fields_dict
from rolloutcore.core.versions import VerificationLevel, WeightIdentity
from rolloutcore.errors import (
    BadInput,
    RolloutCoreError,
)

__all__ = ["TRANSFERS", "FanoutTransport", "FleetConfig", "FleetUpdateFailed", "FleetUpdateResult",
           "FleetVersion", "FleetWeights", "Replica"]

TRANSFERS = ("fanout", "per-engine")


@dataclass
class Replica:
    """One engine of the fleet: its runner (controller, adapter) and how to reach it.

    ``stage(payload)`` puts an update's payload on the adapter (what the next
    transfer sends, what the validation compares with); ``fanout_url`` is
    the engine's URL for a fan-out transport; ``on_fanout`` is called after
    a fan-out round replaced the engine's transfer group (drop the
    per-engine one); ``on_recovered`` after a recovery replaced its process
    (rebind the adapter to the new incarnation). ``close`` releases what the
    replica holds (adapter, journal, process). ``adopt(previous_epoch)``: for
    a fleet restarted on its journals, the recoverer that accepts the engine
    process this start launched as the replacement of the journal's one
    (verified like any recovery; see ``take_over``). ``on_round(nonce, sent,
    reports)``: what a fan-out round wrote on this engine's ranks (their write
    reports, the tensors as broadcast), handed to the replica's adapter so its
    validation checks every rank's writes as after a per-engine round.
    """

    name: str
    runner: LifecycleRunner
    stage: Callable[[Any], None]
    url: str | None = None
    recoverer: Recoverer | None = None
    fanout_url: str | None = None
    engine: object = None
    on_fanout: Callable[[], None] | None = None
    close: Callable[[], None] | None = None
    journal: Journal | None = None
    on_recovered: Callable[[], None] | None = None
    adopt: Callable[[str], Recoverer] | None = None
    on_round: Callable[[str, Any, Any], None] | None = None

    @property
    def controller(self) -> LifecycleController:
        return self.runner.controller


@dataclass(frozen=True)
class FleetWeights:
    """What an update installs: its identity, the payload each replica stages, and the
    source a fan-out transport broadcasts (``None``: per-engine sends only).

    ``probe`` is the policy probe of these weights, computed once for every
    engine: a replica taken over on them (the fleet's first version) runs it as
    ``serve --upstream`` does, to ``min_verification``.
    """

    identity: WeightIdentity
    payload: object
    source: object = None
    min_verification: VerificationLevel = VerificationLevel.DECLARED
    probe: object = None

    def __post_init__(self) -> None:
        if not isinstance(self.identity, WeightIdentity):
            raise BadInput("FleetWeights.identity must be a WeightIdentity")
        if not isinstance(self.min_verification, VerificationLevel):
            raise BadInput("FleetWeights.min_verification must be a VerificationLevel")


@runtime_checkable
class FanoutTransport(Protocol):
    """One transfer to several engines (``transports.fanout.GlooFanout``)."""

    def send_all(self, targets: Sequence[tuple[str, str]], source: Any, *,
                 timeout_s: float) -> Mapping[str, Any]:
        """url -> result with ``ok``, ``evidence``, ``error``, ``closed``."""
        ...

    def invalidate(self) -> None:
        ...

    def abort(self) -> None:
        ...


@dataclass(frozen=True)
class FleetConfig:
    """Defaults of updates and supervision; every one can be given per update too."""

    #: synchronous: replicas that must pass for a publish (None: every participant).
    quorum: int | None = None
    #: rolling: replicas that must keep serving at every instant (None: N - 1).
    min_serving: int | None = None
    #: rolling: replicas per wave (None: as many as min_serving allows).
    wave_size: int | None = None
    #: synchronous transfer: one fan-out broadcast (when a fan-out transport was
    #: given), or per-engine sends. Rolling waves always send per engine.
    transfer: str = "fanout"
    #: deadline of a whole fan-out round (the per-engine runner deadlines apply
    #: to every other step)
    transfer_s: float = 300.0
    #: the supervisor's period (0: call supervise_once yourself)
    health_interval_s: float = 1.0
    health_timeout_s: float = 5.0
    health_failures: int = 2
    retry_after_s: float = 1.0
    #: recover tainted replicas and bring fenced ones back onto the current version
    heal: bool = True
    #: how long a rolling wave waits for enough replicas to serve before the roll stops
    wave_wait_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("quorum", "min_serving", "wave_size"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0
                                  or (name != "min_serving" and v < 1)):
                raise BadInput(f"{name} must be None or a positive integer, got {v!r}")
        if self.transfer not in TRANSFERS:
            raise BadInput(f"transfer must be one of {TRANSFERS}, got {self.transfer!r}")
        for name in ("transfer_s", "health_timeout_s", "retry_after_s", "wave_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e9:
                raise BadInput(f"{name} must be a positive number, got {v!r}")
        if isinstance(self.health_interval_s, bool) or not isinstance(
                self.health_interval_s, (int, float)) or self.health_interval_s < 0:
            raise BadInput("health_interval_s must be >= 0")
        if isinstance(self.health_failures, bool) or not isinstance(
                self.health_failures, int) or self.health_failures < 1:
            raise BadInput("health_failures must be an int >= 1")


@dataclass
class FleetUpdateResult:
    update_id: int
    strategy: Strategy
    target_label: str
    published: FleetVersion | None
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    waves: list[tuple[str, ...]] = field(default_factory=list)
    transfer: str = ""
    transfer_s: float = 0.0
    seconds: float = 0.0
    decision: str = ""

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


class FleetUpdateFailed(RolloutCoreError):
    """A fleet update published nothing; ``result`` says what each replica did."""

    def __init__(self, result: FleetUpdateResult) -> None:
        self.result = result
        why = "; ".join(f"{n}: {r[:300]}" for n, r in sorted(result.reasons.items()))
        super().__init__(f"fleet update {result.update_id} ({result.strategy.value}) "
                         f"published nothing: {result.decision}"
                         + (f" ({why})" if why else ""))


