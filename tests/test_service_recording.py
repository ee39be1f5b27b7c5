"""Optional trajectory recording of finished generate requests (fast lane, FakeEngine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from helpers.gateway_rig import (
    AUTH,
    begin_body,
    lease,
    remote_transfer,
    rig,
    sse_events,
    transfer_body,
)
from rolloutcore.core.lifecycle import Binding
from rolloutcore.core.versions import WeightVersion
from rolloutcore.errors import BadInput
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.trajectory import EngineIdentity, validate_spans
from rolloutcore.service.proxy import FinishedRequest
from rolloutcore.service.recording import (
    PROMPT_INDEX_HEADER,
    RUN_HEADER,
    STEP_HEADER,
    GatewayRecorder,
    build_group,
)
from rolloutcore.testing.fake import FakeWeights

pytestmark = pytest.mark.anyio
ENGINE = EngineIdentity("fake-0", "fake-model", {"dtype": "bytes"}, "http://vllm.test")
GEN = "/inference/v1/generate"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def settle(rec: GatewayRecorder, n: int) -> None:
    """The hook runs once the answer is sent: wait for ``n`` requests to be handled."""
    with anyio.fail_after(10):
        while sum(rec.counts.values()) < n:
            await anyio.sleep(0.005)


def coords(step: int, index: int) -> dict[str, str]:
    return {RUN_HEADER: "run-7", STEP_HEADER: str(step), PROMPT_INDEX_HEADER: str(index)}


async def test_generate_answers_are_recorded_with_their_binding(tmp_path: Path) -> None:
    path = tmp_path / "traj.jsonl"
    rec = GatewayRecorder(path, ENGINE)
    async with rig(streaming=True, on_finished=rec) as r:
        plain = await r.client.post(GEN, headers=coords(0, 0), json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 6, "temperature": 0.7,
                                                        "seed": 11}})
        stream = await r.client.post(GEN, headers=coords(0, 1), json={
            "token_ids": [8, 9], "stream": True, "sampling_params": {"max_tokens": 4}})
        await r.client.post(GEN, json={"token_ids": [1], "sampling_params": {}})  # no coords
        await r.client.post("/v1/completions", headers=coords(0, 2), json={"prompt": "x"})
        # a new version, then a sample under it
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        ev = remote_transfer(r.adapter, w1, "rc-1")
        await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                            json=transfer_body(ev), headers=lease(b.json()))
        after = await r.client.post(GEN, headers=coords(1, 0), json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
        await settle(rec, 5)
    rec.close()
    groups = {g.group_id: g for g in read_groups(path)}
    assert set(groups) == {"run-7:s0:p0", "run-7:s0:p1", "run-7:s1:p0"}, (rec.counts, rec.errors)
    assert rec.counts == {"committed": 3, "skipped": 2}

    s0 = groups["run-7:s0:p0"].samples[0]
    body = plain.json()
    assert list(s0.completion.token_ids) == body["choices"][0]["token_ids"]
    assert s0.binding.version.label == body["rolloutcore"]["version"] == "default"
    assert s0.binding.rollout_id == body["rolloutcore"]["rollout_id"]
    assert s0.sampling.seed == 11 and s0.sampling.temperature == 0.7
    assert s0.prompt.token_ids == (5, 6, 7)
    assert s0.completion.weight_versions is not None
    validate_spans(s0.completion.weight_versions, len(s0.completion.token_ids))
    assert s0.timestamps.completed_mono >= s0.timestamps.admitted_mono

    s1 = groups["run-7:s0:p1"].samples[0]
    evs = sse_events(stream.text)
    assert list(s1.completion.token_ids) == [t for e in evs[:-1]
                                             for t in e["choices"][0]["token_ids"]]
    assert {sp.version for sp in s1.completion.weight_versions or ()} == {"default"}

    s2 = groups["run-7:s1:p0"].samples[0]
    assert s2.binding.version.label == after.json()["rolloutcore"]["version"] == "rc-1"
    assert {sp.version for sp in s2.completion.weight_versions or ()} == {"rc-1"}


async def test_a_second_answer_for_the_same_prompt_is_refused_not_overwritten(
        tmp_path: Path) -> None:
    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE)
    async with rig(on_finished=rec) as r:
        for _ in range(2):
            resp = await r.client.post(GEN, headers=coords(0, 0), json={
                "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
            assert resp.status_code == 200  # the answer is never affected
        bad = await r.client.post(GEN, headers={**coords(0, 1), STEP_HEADER: "x"},
                                  json={"token_ids": [1], "sampling_params": {}})
        assert bad.status_code == 200
        await settle(rec, 3)
    rec.close()
    assert rec.counts == {"committed": 1, "failed": 2}
    assert len(list(read_groups(tmp_path / "t.jsonl"))) == 1


def _fin(choices: list[dict[str, Any]], **headers: str) -> FinishedRequest:
    from rolloutcore.core.versions import Provenance, WeightIdentity

    ident = WeightIdentity("a" * 64, Provenance("ckpt"))
    b = Binding(WeightVersion(3, "rc-3", "e1"), ident, "r-1", 1.0)
    return FinishedRequest(GEN, b, {"token_ids": [1, 2], "sampling_params": {
        "n": len(choices), "max_tokens": 2, "logprobs": 0}}, 200, "complete",
        response={"choices": choices}, headers=headers, admitted_wall=10.0,
        admitted_mono=1.0, completed_wall=11.0, completed_mono=2.0)


def test_build_group_has_one_sample_per_choice() -> None:
    spans = [{"version": "rc-3", "start": 0, "end": 2}]
    choices = [{"index": i, "token_ids": [i, i + 1], "finish_reason": "length",
                "weight_versions": spans,
                "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -1.5}]}}
               for i in range(2)]
    g = build_group(_fin(choices, **coords(4, 9)), ENGINE)
    assert g.group_id == "run-7:s4:p9" and len(g) == 2
    assert [s.sample_index for s in g.samples] == [0, 1]
    assert g.samples[1].completion.logprobs == (-0.5, -1.5)
    assert dict(g.samples[0].sampling.extra) == {"n": 2, "logprobs": 0}


@pytest.mark.parametrize("headers", [{}, {RUN_HEADER: "r"}, {**coords(1, 1), STEP_HEADER: "-1"},
                                     {**coords(1, 1), RUN_HEADER: "bad run id"}])
def test_build_group_refuses_missing_or_bad_coordinates(headers: dict[str, str]) -> None:
    with pytest.raises(BadInput):
        build_group(_fin([{"index": 0, "token_ids": [1], "finish_reason": "stop"}],
                         **headers), ENGINE)
