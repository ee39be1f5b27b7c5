"""The gateway's data plane, in process, over the FakeEngine (fast lane).

What is checked here is the contract of every forwarded request: admitted
through the controller, bound to the committed version, released at the end
whatever the ending, and answered with the version it was bound to, which
must equal the engine's own per-token version spans.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import anyio
import httpx
import pytest

from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import (
    AUTH,
    DATA_TOKEN,
    RIG_ENGINES,
    begin_body,
    lease,
    remote_transfer,
    rig,
    sse_events,
    transfer_body,
)
from rolloutcore.control.journal import first_index
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.evidence import PauseMode
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.service.proxy import BODY_FIELD, VERSION_HEADER
from rolloutcore.testing.fake import FakeWeights, reference_tokens

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


GEN = "/inference/v1/generate"

#: Fault-matrix rows (with ROLLOUTCORE_FAULT_MATRIX set: helpers.fault_matrix).
MATRIX = PromiseRows("tests/test_service_dataplane.py", engines=RIG_ENGINES)
_fault_matrix = MATRIX.fixture()


def gen_body(n: int = 6, stream: bool = False, prompt: list[int] | None = None) -> dict[str, Any]:
    return {"token_ids": prompt or [1, 2, 3, 4], "sampling_params": {"max_tokens": n},
            "stream": stream}


def snapshot(r: Any) -> tuple[Any, ...]:
    return (r.controller.snapshot(), len(r.journal.records), len(r.fake.bodies))


async def test_generate_is_bound_answered_with_its_version_and_released() -> None:
    async with rig() as r:
        resp = await r.client.post(GEN, json=gen_body(8))
        assert resp.status_code == 200
        body = resp.json()
        info = body[BODY_FIELD]
        assert resp.headers[VERSION_HEADER] == info["version"] == "default"
        assert info["identity_digest"] == r.controller.identity.digest  # type: ignore[union-attr]
        assert resp.headers["x-rolloutcore-rollout-id"] == info["rollout_id"]
        spans = body["choices"][0]["weight_versions"]
        assert {s["version"] for s in spans} == {info["version"]}
        assert body["choices"][0]["token_ids"] == reference_tokens(
            FakeWeights.from_seed(0).digest, [1, 2, 3, 4], 8)
        assert r.controller.active == {}
        admits = [d for d in r.kinds("admit") if d["rollout_id"] == info["rollout_id"]]
        done = [d for d in r.kinds("complete") if d["rollout_id"] == info["rollout_id"]]
        assert len(admits) == len(done) == 1 and done[0]["attributable"] is True


async def test_streaming_generate_carries_version_in_first_event_and_ends_with_done() -> None:
    async with rig(streaming=True) as r:
        resp = await r.client.post(GEN, json=gen_body(5, stream=True))
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        assert events[0][BODY_FIELD]["version"] == resp.headers[VERSION_HEADER] == "default"
        assert all(BODY_FIELD not in e for e in events[1:-1])
        toks = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
        assert len(toks) == 5
        spans = events[-2]["choices"][0]["weight_versions"]
        assert spans == [{"version": "default", "start": 0, "end": 5}]
        assert r.controller.active == {}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route,body", [
    ("/v1/completions", {"model": "policy", "prompt": "hello", "max_tokens": 4}),
    ("/v1/chat/completions", {"model": "policy", "max_tokens": 4,
                              "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_openai_routes_stream_and_not(route: str, body: dict[str, Any],
                                            stream: bool) -> None:
    async with rig(streaming=True) as r:
        resp = await r.client.post(route, json={**body, "stream": stream})
        assert resp.status_code == 200, resp.text
        assert resp.headers[VERSION_HEADER] == "default"
        if stream:
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]" and events[0][BODY_FIELD]["version"] == "default"
            assert len(events) == 4 + 1
        else:
            assert resp.json()[BODY_FIELD]["version"] == "default"
        # Forwarded unchanged but for the version salt (service.salting).
        committed = r.controller.committed
        assert committed is not None
        assert r.fake.bodies[-1] == {**body, "stream": stream,
                                       "cache_salt": salt_for(committed)}
        assert r.controller.active == {}


async def test_rollout_id_header_is_used_and_duplicates_are_refused() -> None:
    async with rig(streaming=True, event_delay_s=0.05) as r:
        h = {"x-rolloutcore-rollout-id": "run7/step3/p0"}
        async with r.client.stream("POST", GEN, json=gen_body(100, stream=True), headers=h) as s:
            assert s.headers["x-rolloutcore-rollout-id"] == "run7/step3/p0"
            dup = await r.client.post(GEN, json=gen_body(2), headers=h)
            assert dup.status_code == 409
        # leaving the block closes the stream early: a disconnect, which releases the id
        with anyio.fail_after(5):
            while r.controller.active:
                await anyio.sleep(0.01)
        again = await r.client.post(GEN, json=gen_body(2), headers=h)
        assert again.status_code == 200


async def test_requests_during_an_update_get_503_retry_after_and_never_reach_vllm() -> None:
    async with rig() as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        assert b.status_code == 201 and r.controller.state is State.UPDATING
        n_before = len(r.fake.bodies)
        for route, body in ((GEN, gen_body()), ("/v1/completions", {"prompt": "x"})):
            resp = await r.client.post(route, json=body)
            assert resp.status_code == 503
            assert resp.headers["retry-after"] == "1"
            assert resp.json()[BODY_FIELD]["state"] == "UPDATING"
            assert VERSION_HEADER not in resp.headers
        assert len(r.fake.bodies) == n_before
        ev = remote_transfer(r.adapter, w1, b.json()["target"]["label"])
        done = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                   json=transfer_body(ev), headers=lease(b.json()))
        assert done.json()["status"] == "published"
        after = await r.client.post(GEN, json=gen_body(4))
        assert after.headers[VERSION_HEADER] == "rc-1"
        assert after.json()["choices"][0]["weight_versions"] == [
            {"version": "rc-1", "start": 0, "end": 4}]


async def test_queue_holds_requests_during_an_update_and_admits_them_after_the_commit() -> None:
    async with rig(queue_max=4, queue_wait_s=10) as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        results: list[httpx.Response] = []

        async def one() -> None:
            results.append(await r.client.post(GEN, json=gen_body(3)))

        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(one)
            while r.gateway.data.waiting < 4:
                await anyio.sleep(0.005)
            over = await r.client.post(GEN, json=gen_body(3))  # the queue is full
            assert over.status_code == 503
            assert r.fake.bodies == []  # nobody ran before the commit
            ev = remote_transfer(r.adapter, w1, "rc-1")
            await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(b.json()))
        assert [x.status_code for x in results] == [200] * 4
        for x in results:
            assert x.headers[VERSION_HEADER] == "rc-1"
            assert {s["version"] for s in x.json()["choices"][0]["weight_versions"]} == {"rc-1"}
        text = (await r.client.get("/metrics")).text
        assert 'rolloutcore_queued_requests_total{result="admitted"} 4.0' in text
        # one refusal each (the 4 queued and the one over capacity), not one per transition
        assert len(r.kinds("refuse")) == 5


async def test_an_update_with_nobody_queued_wakes_no_one_and_a_queued_request_still_runs(
        ) -> None:
    """Every change of the controller reaches the data plane; it wakes the event loop only
    for a queued request (issue 31: an update's seven changes each woke the loop's
    thread in the middle of the update's critical path)."""
    async with rig(queue_max=4, queue_wait_s=10) as r:
        dp = r.gateway.data
        woken: list[int] = []
        real = dp._wake

        def wake() -> None:
            woken.append(dp.waiting)
            real()

        dp._wake = wake  # type: ignore[method-assign]
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        ev = remote_transfer(r.adapter, w1, b.json()["target"]["label"])
        done = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                   json=transfer_body(ev), headers=lease(b.json()))
        assert done.json()["status"] == "published"
        assert len(r.kinds("transition")) >= 7  # the changes were made, and told
        assert woken == []
        # The second update has a request queued: it is woken, and admitted after the commit.
        w2 = FakeWeights.from_seed(2, step=2)
        r.adapter.stage(w2)
        b = await r.client.post("/control/updates", json=begin_body(w2), headers=AUTH)
        results: list[httpx.Response] = []

        async def one() -> None:
            results.append(await r.client.post(GEN, json=gen_body(3)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(one)
            while dp.waiting < 1:
                await anyio.sleep(0.005)
            ev = remote_transfer(r.adapter, w2, b.json()["target"]["label"])
            await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(b.json()))
        # A wake is scheduled (from the controller's thread) only while one is queued; it
        # runs on the loop later, when the request may already be admitted (it then sees
        # none waiting): the first one saw it queued.
        assert woken and woken[0] == 1 and all(n <= 1 for n in woken)
        assert [x.status_code for x in results] == [200]
        assert results[0].headers[VERSION_HEADER] == "rc-2"
        assert check_journal(r.journal.records) == []


async def test_queue_wait_is_bounded() -> None:
    async with rig(queue_max=2, queue_wait_s=0.2) as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        t0 = anyio.current_time()
        resp = await r.client.post(GEN, json=gen_body())
        assert resp.status_code == 503 and anyio.current_time() - t0 >= 0.2
        assert r.gateway.data.waiting == 0


async def test_client_disconnect_mid_stream_releases_binding_and_closes_upstream() -> None:
    async with rig(streaming=True, event_delay_s=0.05) as r:
        async with r.client.stream("POST", GEN, json=gen_body(40, stream=True)) as s:
            it = s.aiter_bytes()
            first = await it.__anext__()
            assert b'"rolloutcore"' in first
            assert len(r.controller.active) == 1
        # the response is closed after one event: the client went away
        with anyio.fail_after(5):
            while r.controller.active or r.fake.streams_closed_early == 0:
                await anyio.sleep(0.01)
        text = (await r.client.get("/metrics")).text
        assert 'rolloutcore_stream_endings_total{ending="client_disconnect"} 1.0' in text
        # an update can begin at once: nothing is left bound
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        assert b.status_code == 201


async def test_upstream_break_mid_stream_ends_with_an_error_event_not_silence() -> None:
    async with rig(streaming=True) as r:
        r.fake.break_after_events = 2
        resp = await r.client.post(GEN, json=gen_body(6, stream=True))
        events = sse_events(resp.text)
        assert events[-1] == "[DONE]"
        err = events[-2]
        assert err["error"]["code"] == 502 and "broke off" in err["error"]["message"]
        assert err[BODY_FIELD]["version"] == "default"
        assert len([e for e in events if isinstance(e, dict) and "choices" in e]) == 2
        assert r.controller.active == {}


async def test_upstream_stream_without_terminator_is_reported_as_truncated() -> None:
    async with rig(streaming=True) as r:
        r.fake.omit_done = True
        resp = await r.client.post(GEN, json=gen_body(3, stream=True))
        events = sse_events(resp.text)
        assert events[-2]["error"]["message"].endswith("without its [DONE] terminator")
        assert r.controller.active == {}


async def test_upstream_unreachable_is_502_with_version_and_released() -> None:
    async with rig() as r:
        await r.gateway.data.aclose()
        r.gateway.data.config = r.gateway.config.__class__(
            upstream_url="http://127.0.0.1:9", control_token=r.gateway.config.control_token)
        await r.gateway.data.start()  # nothing listens on the discard port
        resp = await r.client.post(GEN, json=gen_body())
        assert resp.status_code == 502
        assert resp.headers[VERSION_HEADER] == "default"
        assert r.controller.active == {}


async def test_upstream_silence_past_read_s_is_504_with_version_and_released() -> None:
    # The upstream client's EffectTimeout (the one translation's class) is the 504.
    async with rig(token_delay_s=0.05, upstream_read_s=0.2) as r:
        resp = await r.client.post(GEN, json=gen_body(40))
        assert resp.status_code == 504
        assert "did not answer in time" in resp.json()["error"]["message"]
        assert resp.headers[VERSION_HEADER] == "default"
        assert r.controller.active == {}


async def test_upstream_errors_pass_through_with_version() -> None:
    async with rig() as r:
        bad = await r.client.post(GEN, json={"token_ids": [999], "sampling_params": {}})
        assert bad.status_code == 400 and bad.json()[BODY_FIELD]["version"] == "default"
        r.fake.fail(GEN, 500)
        err = await r.client.post(GEN, json=gen_body())
        assert err.status_code == 500 and err.json()["error"]["message"]
        assert r.controller.active == {}


async def test_tainted_engine_refuses_without_retry_after() -> None:
    async with rig() as r:
        w1 = FakeWeights.from_seed(1, step=1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                            json={"failure": {"kind": "error", "reason": "nccl died"}},
                            headers=lease(b.json()))
        assert r.controller.state is State.TAINTED
        resp = await r.client.post(GEN, json=gen_body())
        assert resp.status_code == 503 and "retry-after" not in resp.headers
        assert (await r.client.get("/health")).status_code == 503


async def test_data_token_when_configured() -> None:
    async with rig(data_token=DATA_TOKEN) as r:
        before = snapshot(r)
        assert (await r.client.post(GEN, json=gen_body())).status_code == 401
        wrong = await r.client.post(GEN, json=gen_body(), headers={"authorization": "Bearer x"})
        assert wrong.status_code == 403
        ctl = await r.client.post(GEN, json=gen_body(), headers=AUTH)  # control token != data
        assert ctl.status_code == 403
        assert snapshot(r) == before
        ok = await r.client.post(GEN, json=gen_body(),
                                 headers={"authorization": f"Bearer {DATA_TOKEN}"})
        assert ok.status_code == 200


@pytest.mark.parametrize("content,headers,status", [
    (b"{not json", {}, 400),
    (b"[1, 2, 3]", {}, 400),
    (b'"a string"', {}, 400),
    (b'{"token_ids": [1], "stream": "yes"}', {}, 400),
    (b'{"token_ids": [1], "rolloutcore": {}}', {}, 400),
    (b"\xff\xfe\x00", {}, 400),
    (b'{"token_ids": [1]}', {"content-type": "text/plain"}, 415),
    (b'{"token_ids": [1]}', {"x-rolloutcore-rollout-id": "bad id with spaces"}, 400),
    (b'{"token_ids": [1]}', {"x-rolloutcore-rollout-id": "x" * 300}, 400),
    (b"{" + b" " * 5000 + b"}", {}, 413),
])
async def test_bad_requests_are_4xx_and_change_nothing(content: bytes, headers: dict[str, str],
                                                       status: int) -> None:
    async with rig(max_body_bytes=4096) as r:
        before = snapshot(r)
        h = {"content-type": "application/json", **headers}
        resp = await r.client.post(GEN, content=content, headers=h)
        assert resp.status_code == status
        assert "error" in resp.json()
        assert snapshot(r) == before


async def test_wrong_method_unknown_route_and_huge_body_without_length() -> None:
    async with rig(max_body_bytes=1024) as r:
        before = snapshot(r)
        assert (await r.client.get(GEN)).status_code == 405
        nf = await r.client.post("/v1/embeddings", json={})
        assert nf.status_code == 404 and nf.json()["error"]

        async def chunks() -> Any:
            for _ in range(100):
                yield b"x" * 100

        big = await r.client.post(GEN, content=chunks(),
                                  headers={"content-type": "application/json"})
        assert big.status_code == 413
        assert snapshot(r) == before


@pytest.mark.parametrize("rejects_while_paused", [False, True], ids=["vllm032", "vllm033"])
async def test_concurrent_streams_across_updates_are_version_pure(
        rejects_while_paused: bool) -> None:
    """Many clients while a trainer updates three times: each answer is one version,
    equal to its binding, and nothing is admitted while an update is in flight. With
    vLLM 0.33+'s pause (a request reaching the paused engine is answered 503
    ``engine_paused``) no client sees that 503: none is forwarded while it is paused."""
    async with rig(streaming=True, token_delay_s=0.0003, event_delay_s=0.001,
                   queue_max=64, queue_wait_s=20,
                   rejects_while_paused=rejects_while_paused) as r:
        answers: list[tuple[str, list[Any]]] = []
        rnd = random.Random(7)
        stop = anyio.Event()

        async def client(i: int) -> None:
            while not stop.is_set():
                stream = rnd.random() < 0.7
                resp = await r.client.post(GEN, json=gen_body(rnd.randint(2, 12), stream,
                                                              [i % 200 + 1, 5, 6]))
                assert resp.status_code == 200, resp.text
                if stream:
                    evs = sse_events(resp.text)
                    assert evs[-1] == "[DONE]"
                    answers.append((resp.headers[VERSION_HEADER], evs[:-1]))
                else:
                    answers.append((resp.headers[VERSION_HEADER], [resp.json()]))

        async def trainer() -> None:
            for step in (1, 2, 3):
                await anyio.sleep(0.05)
                w = FakeWeights.from_seed(step, step=step)
                r.adapter.stage(w)
                b = await r.client.post("/control/updates", json=begin_body(w), headers=AUTH)
                assert b.status_code == 201, b.text
                label = b.json()["target"]["label"]
                ev = await anyio.to_thread.run_sync(remote_transfer, r.adapter, w, label)
                d = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                        json=transfer_body(ev), headers=lease(b.json()))
                assert d.json()["status"] == "published", d.text
            await anyio.sleep(0.05)
            stop.set()

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(client, i)
            tg.start_soon(trainer)
        seen = set()
        for version, events in answers:
            assert events[0][BODY_FIELD]["version"] == version
            spans = [s for e in events for s in (e["choices"][0].get("weight_versions") or [])]
            assert spans and {s["version"] for s in spans} == {version}
            seen.add(version)
        assert {"default", "rc-3"} <= seen
        recs = r.journal.records
        # between each begin_update and its commit, no admission happened
        for k in range(1, 4):
            i_begin = first_index(recs, "begin_update", update_id=k)
            i_commit = next(i for i, x in enumerate(recs) if x.kind == "commit"
                            and x.data["version"]["label"] == f"rc-{k}")
            assert i_begin >= 0
            assert not [x for x in recs[i_begin:i_commit] if x.kind == "admit"]
        assert r.controller.active == {}
        if rejects_while_paused:
            assert r.engine.rejected_while_paused == 0
            # The control: a request that does reach the paused engine is refused.
            r.engine.pause(PauseMode.WAIT)
            try:
                async with httpx.AsyncClient(timeout=10) as direct:
                    d = await direct.post(r.upstream_url + GEN, json=gen_body())
                assert d.status_code == 503 and d.json()["error"]["code"] == "engine_paused"
                assert r.engine.rejected_while_paused == 1
            finally:
                r.engine.resume()


async def test_metrics_count_admissions_and_requests() -> None:
    async with rig() as r:
        await r.client.post(GEN, json=gen_body())
        await r.client.post(GEN, content=b"{", headers={"content-type": "application/json"})
        text = (await r.client.get("/metrics")).text
        assert 'rolloutcore_admissions_total{result="accepted"} 1.0' in text
        assert 'rolloutcore_requests_total{route="/inference/v1/generate",status="200"} 1.0' in text
        assert 'rolloutcore_requests_total{route="/inference/v1/generate",status="400"} 1.0' in text
        assert 'rolloutcore_state{state="READY"} 1.0' in text
        assert "rolloutcore_active_rollouts 0.0" in text


def test_sse_relay_injects_only_the_first_event_across_chunk_boundaries() -> None:
    from rolloutcore.service.wire import SseRelay

    relay = SseRelay({"version": "v"}, collect=True)
    raw = b'data: {"a": 1}\n\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    out = b"".join(relay.feed(raw[i:i + 3]) for i in range(0, len(raw), 3)) + relay.flush()
    assert not out.rstrip().endswith(b"[DONE]")  # held back: the gateway may speak before it
    out += relay.take_held()
    evs = sse_events(out.decode())
    assert evs == [{"a": 1, "rolloutcore": {"version": "v"}}, {"b": 2}, "[DONE]"]
    assert relay.complete
    assert [e for e in relay.events] == [{"a": 1, "rolloutcore": {"version": "v"}}, {"b": 2}]
    empty = SseRelay({"version": "v"}, collect=False)
    out2 = empty.feed(b"data: [DONE]\n\n") + empty.flush() + empty.take_held()
    assert sse_events(out2.decode()) == [{"rolloutcore": {"version": "v"}}, "[DONE]"]
    assert json.loads(out2.split(b"\n\n")[0][6:])["rolloutcore"]["version"] == "v"


async def test_lifespan_closes_cleanly_with_requests_done() -> None:
    async with rig() as r:
        await asyncio.gather(*(r.client.post(GEN, json=gen_body(2)) for _ in range(8)))
        assert r.controller.active == {}


async def test_an_engine_lost_between_updates_is_tainted_by_the_watch_and_refused() -> None:
    async with rig(health_interval_s=0.02, health_timeout_s=5.0) as r:
        ok = await r.client.post(GEN, json=gen_body(4))
        assert ok.status_code == 200
        # A supervisor restarts the engine behind the gateway: it answers again,
        # healthy, on its start checkpoint. It must not be served as the committed
        # version.
        r.engine.restart(FakeWeights.from_seed(0))
        with anyio.fail_after(10):
            while r.controller.state is not State.TAINTED:
                await anyio.sleep(0.02)
        n_before = len(r.fake.bodies)
        resp = await r.client.post(GEN, json=gen_body(4))
        assert resp.status_code == 503
        assert resp.json()[BODY_FIELD]["state"] == "TAINTED"
        assert len(r.fake.bodies) == n_before
        assert (await r.client.get("/health")).status_code == 503
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["state"] == "TAINTED"
        assert "rolloutcore_engine_lost_total 1.0" in (await r.client.get("/metrics")).text
        # The shell publishes the state under its lock and delivers the record just
        # after, outside it (control.shell): the record may trail what a reader sees.
        with anyio.fail_after(10):
            while not r.kinds("taint"):
                await anyio.sleep(0.02)
        taint = r.kinds("taint")[-1]
        assert "engine failed while serving" in taint["problems"][0]
        assert "restarted" in taint["problems"][0]
        with anyio.fail_after(10):  # the fence is the runner's effect after the taint
            while not r.engine.paused:
                await anyio.sleep(0.02)


async def test_the_watch_leaves_a_healthy_engine_and_updates_alone() -> None:
    async with rig(health_interval_s=0.01, health_timeout_s=0.5) as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        await anyio.sleep(0.1)  # several watch periods inside the update
        ev = remote_transfer(r.adapter, w1, b.json()["target"]["label"])
        done = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                   json=transfer_body(ev), headers=lease(b.json()))
        assert done.json()["status"] == "published"
        await anyio.sleep(0.1)
        assert r.controller.state is State.READY and r.kinds("taint") == []


async def test_an_answer_released_unattributable_says_so() -> None:
    """#29: an engine tainted while a request ran: the answer said 200 with the old
    version and no marker. Now a header and the body field say it is credited to no
    version (a non-streamed answer), and a last event before [DONE] (a stream)."""
    from rolloutcore.core.lifecycle import FailureKind, Step
    from rolloutcore.service.proxy import ATTRIBUTABLE_HEADER, UNATTRIBUTABLE_HEADER

    async with rig(token_delay_s=0.01, event_delay_s=0.01) as r:
        ok = await r.client.post(GEN, json=gen_body(4))
        assert ok.status_code == 200 and ATTRIBUTABLE_HEADER not in ok.headers
        assert "attributable" not in ok.json()[BODY_FIELD]

        async def taint_soon() -> None:
            await anyio.sleep(0.15)
            await asyncio.to_thread(r.controller.fail, None, Step.SERVE, FailureKind.DIED,
                                    "engine lost (test)")
            r.engine.token_delay_s = 0  # tainted: the rest of the answer may come at once

        async with anyio.create_task_group() as tg:
            tg.start_soon(taint_soon)
            late = await r.client.post(GEN, json=gen_body(60))
        assert late.status_code == 200
        assert late.headers[ATTRIBUTABLE_HEADER] == "false"
        assert "TAINTED" in late.headers[UNATTRIBUTABLE_HEADER]
        info = late.json()[BODY_FIELD]
        assert info["attributable"] is False and "TAINTED" in info["unattributable"]
        assert info["version"] == "default"   # the binding, honestly: credited to nothing
        done = [d for d in r.kinds("complete") if d["rollout_id"] == info["rollout_id"]]
        assert len(done) == 1 and done[0]["attributable"] is False
        assert r.controller.state is State.TAINTED and check_journal(r.journal.records) == []
        MATRIX.row("unattributable_answer", "the engine tainted (died) while a non-streamed "
                   "generate ran", "200 marked (x-rolloutcore-attributable: false + the reason, "
                   "the body's attributable: false), the journal's completion unattributable",
                   "TAINTED", part="non_streamed", mislabeled_answers=0,
                   published_unvalidated=0)


async def test_a_stream_released_unattributable_ends_with_an_event_that_says_so() -> None:
    from helpers.gateway_rig import sse_events
    from rolloutcore.core.lifecycle import FailureKind, Step

    async with rig(streaming=True, token_delay_s=0.002, event_delay_s=0.02) as r:
        async with r.client.stream("POST", GEN, json=gen_body(40, stream=True)) as resp:
            assert resp.status_code == 200
            seen = b""
            tainted = False
            async for chunk in resp.aiter_bytes():
                seen += chunk
                if not tainted and seen.count(b"\n\n") >= 3:
                    tainted = True
                    await asyncio.to_thread(r.controller.fail, None, Step.SERVE,
                                            FailureKind.DIED, "engine lost (test)")
                    r.fake.event_delay_s = 0  # tainted: the rest may come at once
        events = sse_events(seen.decode())
        assert events[-1] == "[DONE]"
        last = events[-2]
        assert last[BODY_FIELD]["attributable"] is False
        assert "TAINTED" in last[BODY_FIELD]["unattributable"]
        assert events[0][BODY_FIELD]["version"] == "default"
        MATRIX.row("unattributable_answer", "the same while a stream ran (after its third "
                   "event)", "the stream's last event before [DONE] says attributable: false "
                   "+ the reason", "TAINTED", part="stream", mislabeled_answers=0)


def test_a_keep_or_recompute_controller_is_refused_not_run_as_strict() -> None:
    """#29: create_app accepted a keep-mode controller and ran it as strict (a begin
    granted while a stream was bound, nothing drained, the stream kept its old label)."""
    from helpers.gateway_rig import TOKEN, make_parts
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.core.lifecycle import UpdateMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.errors import BadInput
    from rolloutcore.service import ServiceConfig
    from rolloutcore.service.app import create_app

    eng, ad, c, r, j, fake = make_parts()
    cfg = ServiceConfig(upstream_url="http://127.0.0.1:9", control_token=TOKEN)
    assert create_app(r, cfg) is not None                      # strict: served
    for mode in (UpdateMode.KEEP, UpdateMode.RECOMPUTE):
        ctl = LifecycleController(config=ControllerConfig(update_mode=mode))
        with pytest.raises(BadInput, match=r"configured for .strict."):
            create_app(LifecycleRunner(ctl, ad), cfg)
