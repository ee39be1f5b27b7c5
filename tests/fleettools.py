"""A fleet of simulated engines for the fleet's fast tests (coordinator, gateway).

``fake_fleet(n)``: n FakeEngines, each with its own adapter, controller,
runner, in-memory journal and recoverer (a replacement engine on the start
weights), a ``FakeFanout`` over all of them, and a coordinator bootstrapped on
seed 0 with those weights retained (so fenced replicas can rejoin).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from helpers.asgi_stream import lifespan
from helpers.gateway_rig import TOKEN, uvicorn_threads
from rolloutcore.control.journal import Journal, open_controller
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.fleet import FleetConfig, FleetCoordinator, FleetWeights, Replica
from rolloutcore.fleet.gateway import create_fleet_app
from rolloutcore.service import ServiceConfig
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeRecoverer, FakeWeights
from rolloutcore.testing.fake_engine import fake_probe
from rolloutcore.testing.fake_vllm import FakeVllm
from rolloutcore.testing.fleetfake import FakeFanout

__all__ = ["FAST", "AdapterVllm", "FakeFleet", "fake_fleet", "fleet_client", "served",
           "weights"]

FAST = Deadlines(drain_s=5, pause_s=5, preflight_s=2, transfer_s=2, reset_s=1, validate_s=2,
                 resume_s=1, live_validate_s=5, bootstrap_s=2, fence_s=1, cancel_grace_s=1,
                 retry_backoff_s=0.01, recover_s=5)


#: The file journals each journal directory's last fake fleet holds open (one writer per
#: journal: ``control.journal``).
_HELD: dict[str, list[Journal]] = {}


def _previous_process_gone(journal_dir: Any) -> None:
    """A fake fleet over a journal directory an earlier one (in this process) still holds:
    that one's "process" is gone, and with it its journals' locks, as after a crash."""
    for j in _HELD.pop(str(journal_dir), []):
        with contextlib.suppress(Exception):
            j.close()


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
               config: FleetConfig | None = None, recover: bool = True,
               before_bootstrap: Any = None, journal_dir: Any = None, start_seed: int = 0,
               adopt_fails: frozenset[str] = frozenset(),
               controller_kw: dict[str, Any] | None = None) -> FakeFleet:
    """``before_bootstrap(adapters)``: change the engines before the fleet takes them over;
    ``journal_dir``: file journals there (``fleet.jsonl`` and one per replica); journals
    that hold records are a previous fleet's, restored (the fleet's restart);
    ``start_seed``: the weights the engines start on; ``adopt_fails``: replicas whose
    new engine dies when a restart adopts it; ``controller_kw``: each replica's
    controller's arguments (e.g. its ``config``: an update mode)."""
    w0 = FakeWeights.from_seed(start_seed, step=start_seed)
    if journal_dir is not None:
        _previous_process_gone(journal_dir)
    reps: list[Replica] = []
    adapters: dict[str, FakeAdapter] = {}
    journals: dict[str, Journal] = {}
    for i in range(n):
        name = f"r{i}"
        ad = FakeAdapter(FakeEngine(w0, token_delay_s=token_delay_s))
        ad.stage(w0)
        c, j = open_controller(None if journal_dir is None
                               else f"{journal_dir}/{name}.journal.jsonl",
                               **(controller_kw or {}))
        runner = LifecycleRunner(c, ad, FAST, record=j.write)

        def adopt(previous_epoch: str, ad: FakeAdapter = ad, name: str = name) -> Any:
            return FakeRecoverer(ad, w0, fail=name in adopt_fails)

        reps.append(Replica(name, runner, ad.stage, url=f"http://fake-{i}.test",
                            recoverer=FakeRecoverer(ad, w0) if recover else None,
                            fanout_url=f"http://fake-{i}.test", journal=j, adopt=adopt))
        adapters[name] = ad
        journals[name] = j
    fan = FakeFanout({r.fanout_url: adapters[r.name] for r in reps if r.fanout_url})
    coord = FleetCoordinator(reps, config=config or FleetConfig(health_interval_s=0),
                             fanout=fan, journal_path=None if journal_dir is None
                             else f"{journal_dir}/fleet.jsonl")
    if journal_dir is not None:
        _HELD[str(journal_dir)] = [*journals.values(), coord.journal]
    if before_bootstrap is not None:
        before_bootstrap(adapters)
    coord.bootstrap(w0.identity(), weights=weights(start_seed))
    return FakeFleet(coord, adapters, journals, fan)


class AdapterVllm(FakeVllm):
    """The fake vLLM of whatever engine the adapter holds now (a recovery replaces it)."""

    def __init__(self, adapter: FakeAdapter) -> None:
        self.adapter = adapter
        super().__init__(adapter.engine, model="policy")  # as RolloutCore launches vLLM

    @property  # type: ignore[override]
    def engine(self) -> Any:
        return self.adapter.engine

    @engine.setter
    def engine(self, _: Any) -> None:
        pass


@contextlib.contextmanager
def served(f: FakeFleet) -> Iterator[dict[str, AdapterVllm]]:
    fakes = {n: AdapterVllm(ad) for n, ad in f.adapters.items()}
    with uvicorn_threads(list(fakes.values()), lifespan="off") as urls:
        for n, url in zip(fakes, urls, strict=True):
            f.coord.replicas[n].url = url
        yield fakes


@contextlib.asynccontextmanager
async def fleet_client(n: int = 3, *, fleet: FakeFleet | None = None,
                       on_finished: Any = None, **cfg: Any
                       ) -> AsyncIterator[tuple[FakeFleet, Any, dict[str, AdapterVllm]]]:
    """A fake fleet behind the real fleet gateway (in process, ASGI), each replica's
    upstream a ``FakeVllm`` on its own loopback port."""
    f = fleet or fake_fleet(n, config=FleetConfig(health_interval_s=0))

    def updater(body: Any) -> Any:
        return f.coord.update(weights(int(body["seed"])), strategy=body.get("strategy",
                                                                             "synchronous"))

    with served(f) as fakes:
        app = create_fleet_app(f.coord, ServiceConfig(
            upstream_url="http://127.0.0.1:1", control_token=TOKEN, **cfg),
            updater=updater, supervise=False, on_finished=on_finished)
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://fleet.test",
                                                    timeout=30) as client:
            yield f, client, fakes
