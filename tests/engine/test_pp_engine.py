"""A pipeline-parallel (PP=2) CPU vLLM updated hot: each stage writes its own layers.

vLLM's CPU build runs ``--pipeline-parallel-size 2`` with one worker process
per stage, each bound to its own core (``tp_thread_binding`` over tensor x
pipeline ranks). A stage holds only its own layers (vLLM's ``get_pp_indices``;
the others are ``PPMissingLayer``): its receiver skips the tensors another
stage holds (``ModelIndex.owned_elsewhere``, vLLM's ``is_pp_missing_parameter``)
and reports what it wrote and what it skipped. The trainer's paused validation
requires every tensor of the round written by exactly one stage
(``rank_checksums.stage_coverage``) on top of each stage's checksums.

Slow lane (two PP=2 engine starts, ~2 min each on 2 cores, one at a time): A -> B
published, both stages' coverage 1.0, greedy ids and logprobs bit-identical to a
cold PP=2 engine on B; a stage that takes one of its own tensors for another
stage's (``rankfault`` ``disown``) is refused, TAINTED, nothing published.
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
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="PP=2 needs 2 cores"),
]

Greedy = list[tuple[list[int], list[float]]]


@pytest.fixture(scope="module")
def cold_b(engine_factory: EngineFactory, tiny_models: TinyModels) -> Greedy:
    """Greedy ids and logprobs of a cold PP=2 engine on B, stopped before the rig
    starts (one PP engine at a time on this machine)."""
    return cold_greedy(engine_factory, tiny_models.B, pipeline_parallel_size=2)


@pytest.fixture(scope="module")
def rig(cold_b: Greedy, engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with fault_rig(engine_factory, tiny_models, tmp_path_factory.mktemp("ppfault"),
                   pipeline_parallel_size=2) as r:
        yield r


def test_a_pp2_update_writes_every_tensor_once_and_equals_a_cold_pp2_start(
        rig: Rig, cold_b: Greedy) -> None:
    s = rig.session(rig.models.A)
    try:
        h = s.http
        for ids in _prompts():  # cached under A
            h.generate(ids, max_tokens=2)
        r = s.update(rig.models.B, Provenance(str(rig.models.B), "pp-test", 1))
        assert r.version.label == "rc-1"
        assert [v.label for v in s.controller.published][-1] == "rc-1"
        check = s.transport.last_check
        assert check["passed"], check
        assert check["coverage_per_rank"] == [1.0, 1.0]
        assert sorted(rk["pp_rank"] for rk in check["ranks"]) == [0, 1]
        assert all(rk["compared"] == rk["model_params"] > 0 for rk in check["ranks"])
        stages = check["stages"]
        assert stages["passed"] and stages["n_unwritten"] == 0, stages
        assert stages["n_written_twice"] == 0
        per = {st["pp_rank"]: st for st in stages["per_stage"]}
        assert sorted(per) == [0, 1] and all(st["coverage"] == 1.0 for st in per.values())
        # Each stage skipped what the other wrote: the layers are split between them.
        assert per[0]["wrote"] + per[1]["wrote"] == stages["tensors"]
        assert per[0]["skipped"] == per[1]["wrote"] > 0
        assert per[1]["skipped"] == per[0]["wrote"] > 0
        assert _greedy(h) == cold_b  # greedy ids and logprobs, bit for bit
    finally:
        s.close()


def test_a_stage_skipping_a_tensor_it_holds_is_refused_nothing_published(
        rig: Rig) -> None:
    rig.install(rig.models.A)
    s = rig.session(rig.models.A)
    before = [v.label for v in s.controller.published]
    rig.fault.write_text(f"disown 0 {TARGET}")  # layer 0 is stage 0's
    try:
        with pytest.raises(UpdateFailed):
            s.update(rig.models.B, Provenance(str(rig.models.B), "pp-test", 2))
    finally:
        rig.fault.write_text("")
    try:
        check = s.transport.last_check
        assert not check["passed"]
        stages = check["stages"]
        assert not stages["passed"] and stages["unwritten"] == [TARGET], stages
        assert any("no stage" in p for p in stages["problems"])
        assert s.controller.state is State.TAINTED
        assert [v.label for v in s.controller.published] == before
    finally:
        s.close()
