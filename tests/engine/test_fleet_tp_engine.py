"""A fleet of two tensor-parallel (TP=2) CPU vLLM engines: one fan-out, every rank checked.

The fleet's synchronous update sends each tensor once, in one gloo group
holding the trainer and all four engine ranks (``GlooFanout``); every rank
reports at its finish what it wrote, and each replica's own paused validation
checks *its* two ranks' reports against the trainer's reconstruction of their
slices (``GlooTransport.adopt_round``). A rank of one engine that writes the
other rank's slice (``rankfault``, a worker extension in the real engine)
fails that replica's validation: it is tainted, the fleet publishes nothing,
and the other replica, verified, is withheld.

Four ranks need four cores to run one per core (``cpu_binding`` refuses
fewer); this 2-core host runs them by sharing (``VLLM_CPU_OMP_THREADS_BIND
0|1`` given to both engines, as an operator would to accept it) with vLLM's
idle spin shortened: slow, so the slow lane.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import rankfault
from fleettools_engine import greedy

from enginetools import TinyModels
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.wire import prefix_cache_delta
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import FleetConfig, FleetUpdateFailed
from rolloutcore.fleet.placement import build_fleet, prepare_checkpoint, start_all
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.net import free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,  # two TP=2 engines and a cold TP=2 reference on 2 shared cores
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 cores"),
]

TARGET = "model.layers.0.mlp.down_proj.weight"  # row-parallel: each rank holds half


def _env(fault: Path | None) -> dict[str, str]:
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "ROLLOUTCORE_VLLM_IDLE_SPIN_S": "0.05"}
    return {**env, **rankfault.fault_env(fault)} if fault is not None else env


@dataclass
class TpFleet:
    coord: FleetCoordinator
    engines: list[ManagedEngine]
    faults: list[Path]
    models: TinyModels
    cold_b: list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def tp_fleet(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[TpFleet]:
    logs = tmp_path_factory.mktemp("fleet-tp-logs")
    # The reference first, alone: a cold TP=2 engine on B.
    ref = ManagedEngine(tiny_models.B, backend=None, tensor_parallel_size=2,
                        log_dir=logs / "ref", startup_timeout_s=600, env=_env(None))
    try:
        ref.start()
        cold_b = greedy(ref.base_url)
    finally:
        ref.stop()
    faults = [tmp_path_factory.mktemp(f"fault{i}") / "fault" for i in range(2)]
    for f in faults:
        f.write_text("")
    engines = [ManagedEngine(tiny_models.A, port=free_port(), tensor_parallel_size=2,
                             guard_routes=True, log_dir=logs / f"e{i}", startup_timeout_s=900,
                             extra_args=("--worker-extension-cls", "rankfault.RankFault"),
                             env=_env(faults[i])) for i in range(2)]
    coord = None
    try:
        start_all({f"e{i}": e.start for i, e in enumerate(engines)}, progress=True,
                  timeout_s=960)
        coord = build_fleet(engines, checkpoint=tiny_models.A, op_timeout_s=60,
                            config=FleetConfig(health_interval_s=0),
                            journal_dir=tmp_path_factory.mktemp("fleet-tp-journals"))
        yield TpFleet(coord, engines, faults, tiny_models, cold_b)
    finally:
        if coord is not None:
            with contextlib.suppress(Exception):
                coord.close()
        for e in engines:
            e.stop()


def _rank_check(coord: FleetCoordinator, name: str) -> dict[str, object]:
    tr = coord.replicas[name].runner.adapter.transport
    assert isinstance(tr, GlooTransport)
    return tr.last_check


def test_one_fanout_to_two_tp2_engines_checks_every_rank_of_each(tp_fleet: TpFleet) -> None:
    f, m = tp_fleet, tp_fleet.models
    hits0 = {}
    for e in f.engines:  # prefixes cached under A on every engine
        greedy(e.base_url)
        with VllmHTTP(e.base_url) as h:
            hits0[e.base_url] = h.metrics()
    res = f.coord.update(prepare_checkpoint(m.B, Provenance(str(m.B), "fleet-tp", 1)),
                         strategy="synchronous")
    assert res.transfer == "fanout", res
    assert res.outcomes == {"e0": "passed", "e1": "passed"}, res.reasons
    for name in ("e0", "e1"):
        chk = _rank_check(f.coord, name)
        assert chk["passed"], chk
        assert chk["coverage_per_rank"] == [1.0, 1.0]
        ranks = chk["ranks"]
        assert isinstance(ranks, list)
        assert sorted(r["tp_rank"] for r in ranks) == [0, 1]
        assert all(r["compared"] == r["model_params"] > 0 for r in ranks)
    for e in f.engines:
        hot = greedy(e.base_url)
        with VllmHTTP(e.base_url) as h:
            stale = prefix_cache_delta(hits0[e.base_url], h.metrics()).hits
        assert hot == f.cold_b  # greedy ids and logprobs, bit for bit, on each engine
        assert stale == 0, f"{stale} prefix tokens hit across the update on {e.base_url}"


def test_one_ranks_wrong_slice_taints_its_replica_and_nothing_is_published(
        tp_fleet: TpFleet) -> None:
    f, m = tp_fleet, tp_fleet.models
    before = f.coord.newest
    assert before is not None
    f.faults[1].write_text(f"other 1 {TARGET}")
    try:
        with pytest.raises(FleetUpdateFailed) as got:
            f.coord.update(prepare_checkpoint(m.A, Provenance(str(m.A), "fleet-tp", 2)),
                           strategy="synchronous")
    finally:
        f.faults[1].write_text("")
    res = got.value.result
    assert res.published is None and f.coord.newest == before
    assert res.outcomes["e0"] == "passed" and res.outcomes["e1"] != "passed", res.outcomes
    bad = _rank_check(f.coord, "e1")
    ranks = {r["tp_rank"]: r for r in bad["ranks"]}  # type: ignore[union-attr]
    assert ranks[0]["passed"] and ranks[1]["mismatched"] == [TARGET]
    assert _rank_check(f.coord, "e0")["passed"]
    assert f.coord.replicas["e1"].controller.state is State.TAINTED
    assert "e1" not in f.coord.serving()
