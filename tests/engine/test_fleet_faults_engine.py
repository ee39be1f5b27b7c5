"""One replica of a real two-engine fleet SIGKILLed mid-update (slow: engines restart).

The engine's whole process group is killed just as the synchronous update's
fan-out round begins (its ``on_fanout`` hook, so the kill lands while the
fleet is drained and paused, in or just before the broadcast):

* with ``quorum=1`` the fleet publishes on the survivor (whose broken round,
  if the kill broke it, is repaired by a fresh per-engine send); the dead
  replica is fenced at once (no request routed to it after the kill is
  answered as if served), recovered on the start checkpoint on its own, and
  rejoins only once verified on the fleet's version;
* with the default quorum (all) nothing is published, and every replica
  goes back to the old version (the survivor is withheld, then brought back
  onto it; the dead one is recovered and brought onto it) or stays fenced.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fleettools_engine import Load, greedy

from enginetools import TinyModels
from helpers.gateway_rig import TOKEN, uvicorn_thread
from rolloutcore.core.pool import ReplicaStateChange
from rolloutcore.core.records import Admit
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.fleet import FleetConfig, FleetCoordinator, FleetUpdateFailed, ReplicaState
from rolloutcore.fleet.gateway import REPLICA_HEADER, create_fleet_app
from rolloutcore.fleet.placement import build_fleet, launch_local, prepare_checkpoint
from rolloutcore.service import ServiceConfig

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

REJOIN_S = 900.0   # a cold restart of vLLM on a loaded 2-core host, then a verified update


@dataclass
class Fleet:
    coord: FleetCoordinator
    engines: list[ManagedEngine]
    url: str
    models: TinyModels


@pytest.fixture(scope="module", name="f")
def fleet(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    engines = launch_local(2, tiny_models.A, log_dir=tmp_path_factory.mktemp("fleet-kill"),
                           progress=True)
    coord = None
    try:
        coord = build_fleet(engines, checkpoint=tiny_models.A, op_timeout_s=15,
                            config=FleetConfig(health_interval_s=0.5))
        app = create_fleet_app(coord, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                                    control_token=TOKEN))
        with uvicorn_thread(app) as url:
            yield Fleet(coord, engines, url, tiny_models)
    finally:
        if coord is not None:
            with contextlib.suppress(Exception):
                coord.close()
        for e in engines:
            e.stop()


def _kill_at_fanout(f: Fleet, name: str) -> dict[str, float]:
    """Arm a SIGKILL of ``name``'s process group for the next fan-out round."""
    rep = f.coord.replicas[name]
    orig = rep.on_fanout
    at: dict[str, float] = {}

    def hook() -> None:
        if orig is not None:
            orig()
        rep.on_fanout = orig

        def kill() -> None:
            at["t"] = time.monotonic()
            rep.engine.signal_group(signal.SIGKILL)

        threading.Timer(0.05, kill).start()

    rep.on_fanout = hook
    return at


def _fenced_at(f: Fleet, name: str, after: float) -> float:
    return next(r.t_mono for r in f.coord.journal.records
                if isinstance(r.record, ReplicaStateChange) and r.record.replica == name
                and r.record.after == "FENCED" and r.t_mono >= after)


def test_with_a_quorum_the_survivor_publishes_and_the_dead_replica_rejoins(f: Fleet) -> None:
    wb = prepare_checkpoint(f.models.B)
    dead_epoch = f.coord.replicas["e1"].controller.committed.engine_epoch  # type: ignore
    at = _kill_at_fanout(f, "e1")
    # Paced: a recovery restarts vLLM on this 2-core host while the load goes on.
    with Load(f.url, ["any", "any"], pause_s=0.1) as load:
        time.sleep(0.5)
        res = f.coord.update(wb, quorum=1)
        kill_t = at["t"]
        assert res.published is not None and res.published.generation == 1
        # Killed mid-broadcast the dead one is ambiguous; killed while the group forms,
        # nothing was sent to it (no_mutation) and the survivor got its own send.
        assert res.outcomes["e0"] == "passed"
        assert res.outcomes["e1"] in ("ambiguous", "no_mutation"), res.reasons
        fenced = _fenced_at(f, "e1", kill_t)
        assert f.coord.state_of("e1") is not ReplicaState.SERVING
        assert f.coord.serving() == ["e0"]
        ok = f.coord.wait_for(lambda: f.coord.state_of("e1") is ReplicaState.SERVING,
                              REJOIN_S, poll_s=0.5)
        rejoined = time.monotonic()
        time.sleep(0.5)
    assert ok, f.coord.status()
    assert not load.errors
    # Nothing was answered from the dead process after the kill, and nothing from its
    # replacement before it rejoined verified on the fleet's version: every 200 from e1
    # sent after the kill names the new process and the fleet version it rejoined on.
    back = next(r.t_mono for r in f.coord.journal.records
                if isinstance(r.record, ReplicaStateChange) and r.record.replica == "e1"
                and r.record.event == "rejoined" and r.t_mono >= kill_t)
    assert back <= rejoined
    new_epoch = f.coord.replicas["e1"].controller.committed.engine_epoch  # type: ignore
    assert new_epoch != dead_epoch
    served_dead = [a for a in load.answers if a.status == 200
                   and a.headers[REPLICA_HEADER] == "e1" and a.sent > kill_t
                   and (a.body["rolloutcore"]["engine_epoch"] != new_epoch
                        or a.body["rolloutcore"]["fleet_version"] != 1)]
    assert not served_dead
    # Admitted on e1 only once it was back in the pool (the admissions are its journal's).
    early = [r for r in f.coord.replicas["e1"].journal.records
             if isinstance(r.record, Admit) and kill_t < r.t_mono
             and r.record.version.engine_epoch == new_epoch
             and not r.record.version.label.startswith("fleet-1")]
    assert not early
    assert {a.status for a in load.answers} <= {200, 503}
    assert f.coord.generation_of("e1") == 1
    c = f.coord.replicas["e1"].controller
    assert c.committed is not None and c.committed.label.startswith("fleet-1")
    assert greedy(f.engines[1].base_url) == greedy(f.engines[0].base_url)
    print(f"\nfenced {fenced - kill_t:.2f}s after the kill, rejoined after "
          f"{rejoined - kill_t:.1f}s")


def test_without_a_quorum_nothing_is_published_and_all_return_to_the_old_version(
        f: Fleet) -> None:
    on_b = greedy(f.engines[1].base_url)
    wa = prepare_checkpoint(f.models.A)
    at = _kill_at_fanout(f, "e0")
    with pytest.raises(FleetUpdateFailed, match="nothing published") as ei:
        f.coord.update(wa)               # every replica must pass
    kill_t = at["t"]
    assert ei.value.result.published is None
    assert f.coord.newest is not None and f.coord.newest.generation == 1
    assert f.coord.state_of("e0") is not ReplicaState.SERVING
    for name in ("e0", "e1"):
        st = f.coord.state_of(name)
        gen = f.coord.generation_of(name)
        assert (st is ReplicaState.SERVING and gen == 1) or gen is None, (name, st, gen)
    _fenced_at(f, "e0", kill_t)
    assert f.coord.wait_for(lambda: f.coord.serving() == ["e0", "e1"], REJOIN_S, poll_s=0.5), \
        f.coord.status()
    for name, e in zip(("e0", "e1"), f.engines, strict=True):
        assert f.coord.generation_of(name) == 1
        assert greedy(e.base_url) == on_b
