"""A fleet placed through a local Ray cluster runs one synchronous update (slow).

Two engines, each a Ray actor in its own bundle of one placement group
(``{"CPU": 1}`` on this machine; ``{"GPU": 1, "CPU": c}`` on GPUs), started
on A; the coordinator over them publishes B through one fan-out broadcast,
and both engines then answer alike, not as they did on A.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from fleettools_engine import greedy

from enginetools import TinyModels
from rolloutcore.adapters.vllm.process import vllm_available
from rolloutcore.fleet.placement import RayEngine, build_fleet, place_ray, prepare_checkpoint

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ray = pytest.importorskip("ray")


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
        coord = build_fleet(placement.engines, checkpoint=tiny_models.A)
        res = coord.update(prepare_checkpoint(tiny_models.B))
        assert res.published is not None and res.transfer == "fanout"
        assert res.outcomes == {"e0": "passed", "e1": "passed"}
        assert res.published.identity.verification.wire == "probe"
        outs = [greedy(e.base_url) for e in placement.engines]
        assert outs[0] == outs[1] != on_a
        assert coord.serving() == ["e0", "e1"]
    finally:
        if coord is not None:
            coord.close()
        placement.shutdown()
    assert not ray.is_initialized()
