"""A pipeline-parallel (PP=2) CPU vLLM launched by the gateway, updated through it.

``serve --model A --pipeline-parallel-size 2``: the trainer (``RolloutCoreClient`` with
a ``GlooTransport``) declares what each worker wrote; the gateway asks each worker for
its own report (``/collective_rpc``) and requires, besides each worker's checksums, that
the stages' reports together write every tensor exactly once
(``rank_checksums.stage_coverage`` inside ``compare_declared``).

Slow lane (one PP=2 engine start, ~2 min on 2 cores): A -> B published with both
stages' coverage 1.0; a stage that takes one of its own tensors for the other stage's
(``rankfault`` ``disown``) is refused by the gateway, TAINTED, nothing published.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
import rankfault
from test_tp_engine import TARGET
from test_tp_gateway_engine import ROOT, Rig

from enginetools import TinyModels
from rolloutcore.engine.process import vllm_available
from rolloutcore.errors import UpdateFailed

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="PP=2 needs 2 cores"),
]


@pytest.fixture(scope="module")
def rig(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("pp-gateway")
    fault = work / "fault"
    fault.write_text("")
    r = Rig(fault, tiny_models, work,
            {**os.environ, **rankfault.fault_env(fault, str(ROOT / "src"))},
            parallel=("--pipeline-parallel-size", "2"))
    try:
        r.start_gateway(tiny_models.A)
        yield r
    finally:
        r.stop_gateway()


def _ready(rig: Rig) -> dict[str, Any]:
    """The gateway's status once it serves (its takeover may still run after /health)."""
    deadline = time.monotonic() + 120
    while True:
        st = rig.status()
        if st["state"] == "READY" or time.monotonic() > deadline:
            assert st["state"] == "READY", (st, rig.log()[-3000:])
            return st
        time.sleep(0.5)


def test_a_pp2_update_through_the_gateway_writes_every_tensor_once(rig: Rig) -> None:
    _ready(rig)
    res = rig.update(rig.models.B, 1)
    assert res.status == "published" and res.published is not None
    result = res.raw["result"]
    assert "worker_shard_checksum=pass coverage=1.000" in result["verification"]["evidence"]
    shards = result["worker_shards"]
    assert shards["passed"] and shards["coverage_per_rank"] == [1.0, 1.0], shards
    assert sorted(r["pp_rank"] for r in shards["ranks"]) == [0, 1]
    stages = shards["stages"]
    assert stages["passed"] and stages["n_unwritten"] == stages["n_written_twice"] == 0
    per = {s["pp_rank"]: s for s in stages["per_stage"]}
    assert per[0]["skipped"] == per[1]["wrote"] > 0 and per[1]["skipped"] == per[0]["wrote"]
    assert all(s["coverage"] == 1.0 for s in per.values())


def test_a_stage_skipping_its_own_tensor_is_refused_by_the_gateway(rig: Rig) -> None:
    st = _ready(rig)
    rig.fault.write_text(f"disown 0 {TARGET}")  # layer 0 is stage 0's
    try:
        with pytest.raises(UpdateFailed) as ei:
            rig.update(rig.models.A, 2)
    finally:
        rig.fault.write_text("")
    result = ei.value.outcome.raw["result"]  # type: ignore[attr-defined]
    assert result["status"] == "failed", result
    shards = result["worker_shards"]
    assert all(r["passed"] for r in shards["ranks"]) and not shards["passed"], shards
    assert shards["stages"]["unwritten"] == [TARGET]
    after = rig.status()
    assert after["state"] == "TAINTED", after
    assert after["committed"] == st["committed"] and after["published"] == st["published"]
