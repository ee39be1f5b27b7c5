"""A tensor x pipeline parallel (TP=2 x PP=2) CPU vLLM updated hot: four workers, each checked.

Two stages of two tensor-parallel ranks each: every worker receives the whole
broadcast, loads the slices of its own layers, and reports what it wrote; the
paused validation checks each worker's slices (``rank_checksums``) and that
every tensor was written exactly once per tensor-parallel rank across the
stages (``stage_coverage``).

Four workers need four cores to run one per core (``tp_thread_binding``
refuses fewer); this 2-core host runs them by sharing
(``VLLM_CPU_OMP_THREADS_BIND=0|1|0|1``, given as an operator accepting it, with
vLLM's idle spin shortened): slow lane, a cold TP x PP reference and the rig,
one at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from test_tp_engine import TARGET, Rig, _greedy, _prompts, cold_greedy, fault_rig

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import vllm_available
from rolloutcore.errors import UpdateFailed

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores"),
]

Greedy = list[tuple[list[int], list[float]]]
SHARED = {"VLLM_CPU_OMP_THREADS_BIND": "0|1|0|1", "ROLLOUTCORE_VLLM_IDLE_SPIN_S": "0.05"}
LAYOUT = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}


@pytest.fixture(scope="module")
def cold_b(engine_factory: EngineFactory, tiny_models: TinyModels) -> Greedy:
    return cold_greedy(engine_factory, tiny_models.B, env=SHARED, **LAYOUT)


@pytest.fixture(scope="module")
def rig(cold_b: Greedy, engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with fault_rig(engine_factory, tiny_models, tmp_path_factory.mktemp("tpppfault"),
                   SHARED, **LAYOUT) as r:
        yield r


def test_a_tp2_x_pp2_update_checks_all_four_workers_and_equals_a_cold_start(
        rig: Rig, cold_b: Greedy) -> None:
    s = rig.session(rig.models.A)
    try:
        h = s.http
        for ids in _prompts():
            h.generate(ids, max_tokens=2)
        r = s.update(rig.models.B, Provenance(str(rig.models.B), "tp-pp-test", 1))
        assert r.version.label == "rc-1"
        check = s.transport.last_check
        assert check["passed"], check
        assert check["coverage_per_rank"] == [1.0] * 4
        assert sorted((rk["pp_rank"], rk["tp_rank"]) for rk in check["ranks"]) == [
            (0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(rk["compared"] == rk["model_params"] > 0 for rk in check["ranks"])
        stages = check["stages"]
        assert stages["passed"] and stages["n_unwritten"] == stages["n_written_twice"] == 0
        for tp in (0, 1):  # per tensor-parallel rank, the two stages split the tensors
            per = {st["pp_rank"]: st for st in stages["per_stage"] if st["tp_rank"] == tp}
            assert per[0]["wrote"] + per[1]["wrote"] == stages["tensors"]
            assert per[0]["skipped"] == per[1]["wrote"] > 0
        assert _greedy(h) == cold_b  # greedy ids and logprobs, bit for bit
    finally:
        s.close()


def test_one_workers_wrong_slice_is_caught_on_that_worker_nothing_published(
        rig: Rig) -> None:
    rig.install(rig.models.A)
    s = rig.session(rig.models.A)
    before = [v.label for v in s.controller.published]
    rig.fault.write_text(f"other 1 {TARGET}")  # layer 0: stage 0's tensor-parallel rank 1
    try:
        with pytest.raises(UpdateFailed):
            s.update(rig.models.B, Provenance(str(rig.models.B), "tp-pp-test", 2))
    finally:
        rig.fault.write_text("")
    try:
        check = s.transport.last_check
        assert not check["passed"]
        bad = [(rk["pp_rank"], rk["tp_rank"]) for rk in check["ranks"] if not rk["passed"]]
        assert bad == [(0, 1)], check["ranks"]
        assert s.controller.state is State.TAINTED
        assert [v.label for v in s.controller.published] == before
    finally:
        s.close()
