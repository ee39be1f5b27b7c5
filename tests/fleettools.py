"""A fleet of simulated engines for the fleet's fast tests (coordinator, gateway).

``fake_fleet(n)``: n FakeEngines, each with its own adapter, controller,
runner, in-memory journal and recoverer (a replacement engine on the start
weights), a ``FakeFanout`` over all of them, and a coordinator bootstrapped on
seed 0 with those weights retained (so fenced replicas can rejoin).
"""

from __future__ import annotations

from dataclasses import dataclass

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.fleet import FleetConfig, FleetCoordinator, FleetWeights, Replica
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeRecoverer, FakeWeights
from rolloutcore.testing.fake_engine import fake_probe
from rolloutcore.testing.fleetfake import FakeFanout

__all__ = ["FAST", "FakeFleet", "fake_fleet", "weights"]

FAST = Deadlines(drain_s=5, pause_s=5, preflight_s=2, transfer_s=2, reset_s=1, validate_s=2,
                 resume_s=1, live_validate_s=5, bootstrap_s=2, fence_s=1, cancel_grace_s=1,
                 retry_backoff_s=0.01, recover_s=5)


def weights(seed: int) -> FleetWeights:
    w = FakeWeights.from_seed(seed, step=seed)
    return FleetWeights(w.identity(), w, w, VerificationLevel.PROBE, probe=fake_probe(w))


@dataclass
class FakeFleet:
    coord: FleetCoordinator
    adapters: dict[str, FakeAdapter]
    journals: dict[str, Journal]
    fanout: FakeFanout

    def engine(self, name: str) -> FakeEngine:
        return self.adapters[name].engine


def fake_fleet(n: int = 3, *, token_delay_s: float = 0.0005,
               config: FleetConfig | None = None, recover: bool = True) -> FakeFleet:
    w0 = FakeWeights.from_seed(0)
    reps: list[Replica] = []
    adapters: dict[str, FakeAdapter] = {}
    journals: dict[str, Journal] = {}
    for i in range(n):
        name = f"r{i}"
        ad = FakeAdapter(FakeEngine(w0, token_delay_s=token_delay_s))
        ad.stage(w0)
        j = Journal()
        c = LifecycleController(listener=j.listener)
        runner = LifecycleRunner(c, ad, FAST, record=j.write)
        reps.append(Replica(name, runner, ad.stage, url=f"http://fake-{i}.test",
                            recoverer=FakeRecoverer(ad, w0) if recover else None,
                            fanout_url=f"http://fake-{i}.test", journal=j))
        adapters[name] = ad
        journals[name] = j
    fan = FakeFanout({r.fanout_url: adapters[r.name] for r in reps if r.fanout_url})
    coord = FleetCoordinator(reps, config=config or FleetConfig(health_interval_s=0),
                             fanout=fan)
    coord.bootstrap(w0.identity(), weights=weights(0))
    return FakeFleet(coord, adapters, journals, fan)
