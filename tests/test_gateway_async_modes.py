"""Asynchronous update modes through the gateway (#29): keep and recompute over HTTP.

The real gateway app (data plane, trainer protocol) over a keep or recompute
controller, its upstream a FakeVllm that streams the FakeEngine's tokens as
they are made (so ``pause(keep)`` freezes a stream and ``pause(abort)`` ends
it with ``finish_reason: abort``, as vLLM does). Each test runs an update
through the trainer protocol while a request is bound and checks what the
client got: the admission version in the header, the per-token versions in
the body field equal to the engine's own spans, the version salt of each
engine request, the staleness bound, and the journal's records.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from helpers.gateway_rig import (
    AUTH,
    Rig,
    begin_body,
    lease,
    remote_transfer,
    rig,
    sse_events,
    transfer_body,
)
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State, UpdateMode
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.errors import BadInput
from rolloutcore.provenance.token_versions import TokenVersions
from rolloutcore.service import ServiceConfig
from rolloutcore.service.app import create_app
from rolloutcore.service.proxy import BODY_FIELD, VERSION_HEADER, FinishedRequest
from rolloutcore.testing.fake import FakeWeights

pytestmark = pytest.mark.anyio

GEN = "/inference/v1/generate"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _cfg(mode: UpdateMode, k: int | None = None) -> ControllerConfig:
    return ControllerConfig(update_mode=mode, max_staleness=k)


@contextlib.asynccontextmanager
async def _rig(mode: UpdateMode, k: int | None = None, **kw: Any) -> AsyncIterator[Rig]:
    async with rig(streaming=True, live=True, token_delay_s=0.01,
                   controller_config=_cfg(mode, k), **kw) as r:
        yield r


async def _update(r: Rig, seed: int) -> dict[str, Any]:
    """One update through the trainer protocol (begin, transfer, report): its result."""
    w = FakeWeights.from_seed(seed, step=seed)
    r.adapter.stage(w)
    b = await r.client.post("/control/updates", json=begin_body(w), headers=AUTH)
    assert b.status_code == 201, b.text
    grant = b.json()
    ev = await anyio.to_thread.run_sync(remote_transfer, r.adapter, w, grant["target"]["label"])
    done = await r.client.post(f"/control/updates/{grant['update_id']}/transfer",
                               json=transfer_body(ev), headers=lease(grant))
    assert done.status_code == 200, done.text
    out: dict[str, Any] = done.json()
    return out


async def _while_bound(r: Rig, request: Any, updates: int = 1,
                       seed: int = 1) -> tuple[Any, list[dict[str, Any]]]:
    """Start ``request`` (a coroutine function), run ``updates`` updates once it has
    tokens, and return its answer and the updates' results."""
    got: list[Any] = []
    results: list[dict[str, Any]] = []

    async def run() -> None:
        got.append(await request())

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        with anyio.fail_after(10):
            while not any(v >= 3 for v in r.engine.tokens_in_flight().values()):
                await anyio.sleep(0.005)
        # The answer must still be running when the updates land, however slowly a loaded
        # machine runs them: its next tokens come 10x slower until they are done (at the
        # first delay, 37 tokens left = 0.37 s, less than an update on two busy cores).
        delay, r.engine.token_delay_s = r.engine.token_delay_s, r.engine.token_delay_s * 10
        for i in range(updates):
            results.append(await _update(r, seed + i))
            await anyio.sleep(0.05)
        # The updates are done: the rest of the answer may come at once.
        r.engine.token_delay_s = 0.0
    r.engine.token_delay_s = delay
    return got[0], results


def _stream(r: Rig, route: str, body: dict[str, Any]) -> Any:
    async def go() -> tuple[httpx.Headers, list[Any]]:
        resp = await r.client.post(route, json={**body, "stream": True})
        assert resp.status_code == 200, resp.text
        return resp.headers, sse_events(resp.text)
    return go


def _gen(n: int, prompt: list[int] | None = None, logprobs: bool = False) -> dict[str, Any]:
    sp: dict[str, Any] = {"max_tokens": n}
    if logprobs:
        sp["logprobs"] = 0
    return {"token_ids": prompt or [5, 6, 7, 8, 9, 10, 11, 12], "sampling_params": sp}


def _versions(info: dict[str, Any]) -> list[tuple[str, int, int]]:
    tv = TokenVersions.from_dict(info["token_versions"])
    return [(s.label, s.start, s.end) for s in tv.spans]


async def test_keep_carries_a_stream_across_an_update_and_labels_every_token() -> None:
    async with _rig(UpdateMode.KEEP) as r:
        (headers, evs), (res,) = await _while_bound(r, _stream(r, GEN, _gen(40)))
        assert res["status"] == "published"
        assert evs[-1] == "[DONE]"
        toks = [t for e in evs[:-1] if isinstance(e, dict) for c in e.get("choices") or ()
                for t in c.get("token_ids") or ()]
        assert len(toks) == 40
        assert headers[VERSION_HEADER] == "default"          # the admission version
        last = evs[-2][BODY_FIELD]
        spans = _versions(last)
        assert [s[0] for s in spans] == ["default", "rc-1"]   # it crossed the update
        assert spans[0][1] == 0 and spans[-1][2] == 40
        engine = next(c["weight_versions"] for e in evs[:-1] if isinstance(e, dict)
                      for c in e.get("choices") or () if c.get("weight_versions"))
        assert [(s["version"], s["start"], s["end"]) for s in engine] == spans
        tv = TokenVersions.from_dict(last["token_versions"])
        assert tv.source == "engine" and tv.mode is UpdateMode.KEEP
        assert tv.spans[-1].kv == ("default", "rc-1")       # kept: attended to old KV
        assert last.get("attributable", True) is True and last["staleness"] == 1
        assert r.fake.bodies[0]["cache_salt"] == salt_for(
            r.controller.published[0])                          # salted by its version
        carry = [d for d in (x.data for x in r.journal.records) if "carried" in d]
        assert carry and carry[0]["carried"] == [last["rollout_id"]]
        assert check_journal(r.journal.records) == []


async def test_recompute_resubmits_transparently_under_the_new_version() -> None:
    async with _rig(UpdateMode.RECOMPUTE) as r:
        (headers, evs), (res,) = await _while_bound(
            r, _stream(r, GEN, _gen(40, logprobs=True)))
        assert res["status"] == "published"
        data = [e for e in evs[:-1] if isinstance(e, dict) and e.get("choices")]
        toks = [t for e in data for t in e["choices"][0].get("token_ids") or ()]
        assert len(toks) == 40
        finishes = [e["choices"][0].get("finish_reason") for e in data]
        assert finishes[-1] == "length" and "abort" not in finishes  # one answer, one end
        info = evs[-2][BODY_FIELD]
        spans = _versions(info)
        assert [s[0] for s in spans] == ["default", "rc-1"] and spans[-1][2] == 40
        tv = TokenVersions.from_dict(info["token_versions"])
        assert [s.kv for s in tv.spans] == [("default",), ("rc-1",)]  # no cross-version KV
        assert len(tv.segments) == 2 and tv.recomputed_tokens == 8 + spans[0][2]  # prompt + out
        # The engine's spans of the last event cover the whole stitched output.
        wv = data[-1]["choices"][0]["weight_versions"]
        assert [(s["version"], s["start"], s["end"]) for s in wv] == spans
        # The resubmission: prompt + output so far, salted by the new version.
        first, second = r.fake.bodies[0], r.fake.bodies[1]
        assert second["token_ids"] == first["token_ids"] + toks[:spans[0][2]]
        assert second["sampling_params"]["max_tokens"] == 40 - spans[0][2]
        rc1 = r.controller.committed
        assert rc1 is not None and second["cache_salt"] == salt_for(rc1)
        assert headers[VERSION_HEADER] == "default"
        assert check_journal(r.journal.records) == []


async def test_recompute_json_answer_is_merged_with_its_whole_output_spans() -> None:
    async with _rig(UpdateMode.RECOMPUTE) as r:
        async def post() -> httpx.Response:
            return await r.client.post(GEN, json=_gen(40, logprobs=True))

        resp, (res,) = await _while_bound(r, post)
        assert resp.status_code == 200 and res["status"] == "published"
        body = resp.json()
        ch = body["choices"][0]
        assert len(ch["token_ids"]) == 40 and len(ch["logprobs"]["content"]) == 40
        assert ch["finish_reason"] == "length"
        spans = _versions(body[BODY_FIELD])
        assert [s[0] for s in spans] == ["default", "rc-1"]
        assert [(s["version"], s["start"], s["end"]) for s in ch["weight_versions"]] == spans


@pytest.mark.parametrize("route,body", [
    (GEN, _gen(40)),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 40}),
])
async def test_engine_recompute_continues_every_route_over_recomputed_kv(
        route: str, body: dict[str, Any]) -> None:
    """vLLM's own keep-with-recompute: the stream continues (one engine request, any
    route), and its tokens after the update attend only to KV the new weights computed:
    they equal what the new weights generate for prompt + output so far."""
    async with _rig(UpdateMode.ENGINE_RECOMPUTE) as r:
        (headers, evs), (res,) = await _while_bound(r, _stream(r, route, body))
        assert res["status"] == "published"
        info = evs[-2][BODY_FIELD]
        tv = TokenVersions.from_dict(info["token_versions"])
        assert tv.mode is UpdateMode.ENGINE_RECOMPUTE and len(tv.segments) == 1
        assert [s.label for s in tv.spans] == ["default", "rc-1"]
        assert [s.kv for s in tv.spans] == [("default",), ("rc-1",)]  # recomputed KV
        assert info.get("attributable", True) is True and len(r.fake.bodies) == 1
        if route == GEN:
            toks = [t for e in evs[:-1] if isinstance(e, dict)
                    for c in e.get("choices") or () for t in c.get("token_ids") or ()]
            cut = tv.spans[0].end
            prompt = body["token_ids"]
            # The new weights' continuation of prompt + output so far (a fresh prefill;
            # a reference, so at no delay per token).
            r.engine.token_delay_s = 0.0
            again = r.engine.generate([*prompt, *toks[:cut]], len(toks) - cut)
            assert again.tokens == toks[cut:]
        assert check_journal(r.journal.records) == []


async def test_engine_recompute_refuses_a_pause_that_did_not_clear() -> None:
    """The mode's postcondition: an engine paused without clearing its caches would
    resume the frozen requests over KV of the old weights: the update is refused."""
    async with _rig(UpdateMode.ENGINE_RECOMPUTE) as r:
        orig = r.adapter.drain

        def no_clear(mode: Any, *, clear_cache: bool = False) -> Any:
            return orig(mode)
        r.adapter.drain = no_clear  # type: ignore[method-assign]
        w = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w)
        b = await r.client.post("/control/updates", json=begin_body(w), headers=AUTH)
        assert b.status_code >= 400 and "clear_cache" in b.text
        assert r.controller.state is State.READY and r.controller.committed is not None
        assert r.controller.committed.label == "default"


async def test_over_the_staleness_bound_a_kept_stream_ends_unattributable() -> None:
    async with _rig(UpdateMode.KEEP, k=0) as r:
        (headers, evs), (res,) = await _while_bound(r, _stream(r, GEN, _gen(200)))
        assert res["status"] == "published"
        assert evs[-1] == "[DONE]"
        err = evs[-2]["error"]
        assert err["type"] == "OverStalenessBound" and "max_staleness=0" in err["message"]
        done = [d for d in (x.data for x in r.journal.records)
                if d.get("over_bound")]
        assert done and done[0]["over_bound"]
        assert r.controller.active == {}
        # The engine's request is aborted, not left frozen: the cut ends the client's
        # stream first and then calls /abort_requests, which may land after the update
        # published (the stream is over either way; no token of it reaches anyone).
        with anyio.fail_after(5):
            while r.engine.in_flight:
                await anyio.sleep(0.01)


async def test_a_non_streamed_completion_across_an_update_is_marked_not_guessed() -> None:
    async with _rig(UpdateMode.KEEP) as r:
        async def post() -> httpx.Response:
            return await r.client.post("/v1/completions",
                                       json={"prompt": "hello there", "max_tokens": 40})

        resp, _ = await _while_bound(r, post)
        assert resp.status_code == 200
        info = resp.json()[BODY_FIELD]
        assert info["attributable"] is False and "non-streamed" in info["unattributable"]
        assert resp.headers["x-rolloutcore-attributable"] == "false"
        assert r.fake.bodies[0]["return_token_ids"] is True


async def test_a_streamed_chat_across_an_update_gets_derived_versions() -> None:
    async with _rig(UpdateMode.KEEP) as r:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
        (headers, evs), _ = await _while_bound(r, _stream(r, "/v1/chat/completions", body))
        info = evs[-2][BODY_FIELD]
        tv = TokenVersions.from_dict(info["token_versions"])
        assert tv.source == "stream"
        assert [s.label for s in tv.spans] == ["default", "rc-1"] and tv.spans[-1].end == 40


async def test_a_chat_the_recompute_pause_aborted_says_so() -> None:
    async with _rig(UpdateMode.RECOMPUTE) as r:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}
        (headers, evs), _ = await _while_bound(r, _stream(r, "/v1/chat/completions", body))
        info = evs[-2][BODY_FIELD]
        assert info["attributable"] is False and "recompute" in info["unattributable"]


@pytest.mark.parametrize("route,body", [
    (GEN, {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "n": 2}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}),
    ("/v1/completions", {"prompt": "x", "n": 3}),
    ("/v1/completions", {"prompt": ["a", "b"]}),
])
async def test_more_than_one_sample_per_request_is_refused_before_admission(
        route: str, body: dict[str, Any]) -> None:
    async with _rig(UpdateMode.KEEP) as r:
        before = len(r.journal.records)
        resp = await r.client.post(route, json=body)
        assert resp.status_code == 400 and "one sample per request" in resp.text
        assert len(r.journal.records) == before and r.fake.bodies == []


async def test_recorded_trajectory_carries_the_token_versions() -> None:
    seen: list[FinishedRequest] = []
    async with _rig(UpdateMode.KEEP, on_finished=seen.append) as r:
        (headers, evs), _ = await _while_bound(r, _stream(r, GEN, _gen(40)))
    assert len(seen) == 1 and seen[0].token_versions is not None
    assert [s.label for s in seen[0].token_versions.spans] == ["default", "rc-1"]


@pytest.mark.parametrize("mode", [UpdateMode.KEEP, UpdateMode.RECOMPUTE])
async def test_the_gateways_records_of_carried_answers_audit_clean(
        mode: UpdateMode, tmp_path: Any) -> None:
    """What the recorder wrote of an answer an update carried: its per-token versions and
    segments (salts, prefills) pass the audit, and a tampered copy does not."""
    from rolloutcore.core.versions import EngineIdentity
    from rolloutcore.provenance.audit import audit_file
    from rolloutcore.provenance.recorder import read_groups
    from rolloutcore.service.recording import GatewayRecorder

    path = tmp_path / "traj.jsonl"
    rec = GatewayRecorder(path, EngineIdentity("fake-0", "fake", {}, "http://vllm.test"))
    hdrs = {"x-rolloutcore-run": "r", "x-rolloutcore-step": "0",
            "x-rolloutcore-prompt-index": "0"}
    async with _rig(mode, on_finished=rec) as r:
        async def go() -> tuple[httpx.Headers, list[Any]]:
            resp = await r.client.post(GEN, json={**_gen(40), "stream": True}, headers=hdrs)
            return resp.headers, sse_events(resp.text)

        await _while_bound(r, go)
        assert rec.flush()
    rec.close()
    (g,) = list(read_groups(path))
    tv = g.samples[0].completion.versions
    assert tv is not None and [s.label for s in tv.spans] == ["default", "rc-1"]
    rep = audit_file(path)
    assert rep.purity.ok and rep.purity.mixed_within_bound == 1, rep.purity.format_table()
    # The same record unsalted, or (recompute) its resubmission salted by the old version:
    # findings of the audit.
    from rolloutcore.provenance.audit import PurityIssue, audit_purity
    from rolloutcore.provenance.trajectory import TrajectorySample

    def tampered(seg: int, salt: Any) -> set[PurityIssue]:
        d = g.samples[0].to_dict()
        d["completion"]["versions"]["segments"][seg]["cache_salt"] = salt
        return {f.issue for f in audit_purity([TrajectorySample.from_dict(d)]).findings}

    assert tampered(0, None) == {PurityIssue.UNSALTED}
    if mode is UpdateMode.RECOMPUTE:
        assert tampered(1, tv.segments[0].cache_salt) == {PurityIssue.SALT_MISMATCH}


def test_a_deployment_refuses_a_controller_of_another_mode() -> None:
    from helpers.gateway_rig import TOKEN, make_parts
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner

    eng, ad, c, r, j, fake = make_parts()
    keep = LifecycleRunner(LifecycleController(config=_cfg(UpdateMode.KEEP)), ad)
    strict_cfg = ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN)
    keep_cfg = ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN,
                             update_mode="keep")
    with pytest.raises(BadInput, match="configured for 'strict'"):
        create_app(keep, strict_cfg)
    with pytest.raises(BadInput, match="configured for 'keep'"):
        create_app(r, keep_cfg)
    assert create_app(keep, keep_cfg) is not None
    with pytest.raises(BadInput, match="update_mode"):
        ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN,
                      update_mode="lazy")
    with pytest.raises(BadInput, match="salt"):
        ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN,
                      update_mode="recompute", salt_prefix_cache=False)
    assert State.READY is c.state
