"""A fleet placed through a local Ray cluster: one synchronous update, a death, a rejoin (slow).

Two engines, each a Ray actor in its own bundle of one placement group
(``{"CPU": 1}`` on this machine; ``{"GPU": 1, "CPU": c}`` on GPUs), started
on A; the coordinator over them publishes B through one fan-out broadcast,
and both engines then answer alike, not as they did on A. Then one engine's
process group is SIGKILLed through its actor while serving: the coordinator
fences it, its actor restarts it (the recovery the single-engine path runs,
on the start checkpoint), and it rejoins only once verified on B.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from fleettools_engine import greedy

from enginetools import TinyModels
from rolloutcore.core.pool import ReplicaStateChange
from rolloutcore.engine.process import vllm_available
from rolloutcore.fleet import FleetConfig, ReplicaState
from rolloutcore.fleet.placement import RayEngine, build_fleet, place_ray, prepare_checkpoint

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ray = pytest.importorskip("ray")

REJOIN_S = 900.0   # a cold restart of vLLM on a loaded 2-core host, then a verified update


def test_a_ray_placed_fleet_runs_a_synchronous_update(tiny_models: TinyModels,
                                                      tmp_path: object) -> None:
    placement = place_ray(2, tiny_models.A, cpus_per_engine=1, progress=True,
                          startup_timeout_s=900)
    coord = None
    try:
        assert len(placement.engines) == 2
        assert all(isinstance(e, RayEngine) and e.alive() for e in placement.engines)
        assert placement.bundles == [{"CPU": 1.0}, {"CPU": 1.0}]
        table = ray.util.placement_group_table(placement.placement_group)
        assert table["state"] == "CREATED" and len(table["bundles"]) == 2
        # On this host (the CPU build, no address): each engine's vLLM binds cores of its
        # own, as launch_local's do (read from the engine processes' environments).
        binds = []
        for e in placement.engines:
            pid = ray.get(e.actor.info.remote())["pid"]
            raw = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            env = dict(x.split("=", 1) for x in raw.split("\0") if "=" in x)
            binds.append(env.get("VLLM_CPU_OMP_THREADS_BIND"))
        assert None not in binds and len(set(binds)) == 2, binds
        on_a = greedy(placement.engines[0].base_url)
        coord = build_fleet(placement.engines, checkpoint=tiny_models.A, op_timeout_s=15,
                            config=FleetConfig(health_interval_s=0.5))
        res = coord.update(prepare_checkpoint(tiny_models.B))
        assert res.published is not None and res.transfer == "fanout"
        assert res.outcomes == {"e0": "passed", "e1": "passed"}
        assert res.published.identity.verification.wire == "probe"
        outs = [greedy(e.base_url) for e in placement.engines]
        assert outs[0] == outs[1] != on_a
        assert coord.serving() == ["e0", "e1"]
        # A death while serving: fenced, restarted by its actor, rejoined verified on B
        # (the supervisor a fleet gateway starts, started here without one).
        coord.start_supervisor()
        e1 = placement.engines[1]
        dead_epoch = coord.replicas["e1"].controller.committed.engine_epoch  # type: ignore
        kill_t = time.monotonic()
        e1.signal_group(signal.SIGKILL)
        fenced = coord.wait_for(lambda: coord.state_of("e1") is not ReplicaState.SERVING,
                                120, poll_s=0.2)
        assert fenced, coord.status()
        assert coord.serving() == ["e0"]
        ok = coord.wait_for(lambda: coord.state_of("e1") is ReplicaState.SERVING,
                            REJOIN_S, poll_s=0.5)
        assert ok, coord.status()
        trail = [(r.record.after, round(r.t_mono - kill_t, 1)) for r in coord.journal.records
                 if isinstance(r.record, ReplicaStateChange) and r.record.replica == "e1"
                 and r.t_mono >= kill_t]
        assert trail[0][0] == "FENCED" and trail[-1][0] == "SERVING", trail
        c = coord.replicas["e1"].controller
        assert c.committed is not None and c.committed.engine_epoch != dead_epoch
        assert coord.generation_of("e1") == 1
        assert greedy(e1.base_url) == outs[0]
        print(f"\ne1 after the kill: {trail}")
    finally:
        if coord is not None:
            coord.close()
        placement.shutdown()
    assert not ray.is_initialized()
