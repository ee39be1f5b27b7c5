"""Bad input to the gateway (#16): a clear error, nothing lost, nothing crashed.

The data plane's own checks (the rollout id exactly, JSON as the standard
has it, bounded nesting), the upstream client's framing and size bounds, the
trajectory recorder fed hostile requests (it must survive every one, count
it, report it, and never block shutdown), the records of answers the
controller credits to no version, and the data token a non-loopback bind
now needs. Each test fails on the gateway before #16.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from helpers.asgi_drive import Drive
from helpers.asgi_stream import lifespan
from helpers.gateway_rig import AUTH, TOKEN, begin_body, lease, make_parts, remote_transfer, rig
from helpers.gateway_rig import transfer_body as _transfer_body
from rolloutcore.core.lifecycle import Binding, FailureKind, Step
from rolloutcore.core.versions import Provenance, WeightIdentity, WeightVersion
from rolloutcore.errors import BadInput, EngineUnavailable
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.trajectory import EngineIdentity
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.config import check_bind
from rolloutcore.service.proxy import FinishedRequest
from rolloutcore.service.recording import (
    PROMPT_INDEX_HEADER,
    RUN_HEADER,
    STEP_HEADER,
    GatewayRecorder,
)
from rolloutcore.service.serve import ServeOptions, run_serve
from rolloutcore.testing.fake import FakeWeights
from test_service_upstream import Server, pool

pytestmark = pytest.mark.anyio
GEN = "/inference/v1/generate"
ENGINE = EngineIdentity("fake-0", "fake-model", {}, "http://vllm.test")
W1 = FakeWeights.from_seed(1, step=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def coords(step: int, index: int) -> dict[str, str]:
    return {RUN_HEADER: "run-h", STEP_HEADER: str(step), PROMPT_INDEX_HEADER: str(index)}


def deep(depth: int, leaf: Any = 1) -> Any:
    """A list nested ``depth`` deep, built without recursion."""
    x = leaf
    for _ in range(depth):
        x = [x]
    return x


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.005)


# ------------------------------------------------------------------ the data plane's checks


@pytest.mark.parametrize("rid", [b"run-1\n", b"run-1\r\nX-Evil: 1", b"run 1", b"-run",
                                 b"r" * 129])
async def test_the_rollout_id_must_match_exactly(rid: bytes) -> None:
    """A trailing newline passed ``re.match`` with ``$``: it reached vLLM's request head."""
    async with rig() as r:
        d = Drive(r.app, GEN, {"token_ids": [1], "sampling_params": {"max_tokens": 2}},
                  headers={"x-rolloutcore-rollout-id": rid.decode("latin-1")})
        await d.start()
        assert d.status == 400 and b"must match" in d.body
        assert r.fake.bodies == [] and r.controller.active == {}
        assert [x for x in r.journal.records if x.kind == "admit"] == []


@pytest.mark.parametrize("raw", [
    b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}',
    b'{"token_ids": [1], "sampling_params": {"temperature": Infinity}}',
    b'{"token_ids": [1], "sampling_params": {"temperature": -Infinity}}',
    b'{"token_ids": [1], "sampling_params": {"temperature": 1e999}}',
    b'{"token_ids": [1], "sampling_params": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    b'{"token_ids": [1], "sampling_params": {"x": ' + b"[" * 65 + b"]" * 65 + b"}}",
    b'{"token_ids": [1], "x": "\xff\xfe"}',
    b'{"token_ids": [1], "n": ' + b"9" * 5000 + b"}",
])
async def test_hostile_json_is_a_400_never_forwarded(raw: bytes) -> None:
    async with rig(max_body_bytes=1 << 20) as r:
        resp = await r.client.post(GEN, content=raw,
                                   headers={"content-type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "BadRequest"
        assert r.fake.bodies == []


async def test_nesting_within_the_bound_is_forwarded() -> None:
    async with rig() as r:
        body = {"token_ids": [1], "sampling_params": {"max_tokens": 2, "x": deep(60)}}
        resp = await r.client.post(GEN, json=body)
        assert resp.status_code == 200 and len(r.fake.bodies) == 1


@pytest.mark.parametrize("path", ["/control/updates", "/control/updates/1/transfer"])
async def test_control_bodies_nested_too_deep_are_a_400(path: str) -> None:
    async with rig() as r:
        raw = b'{"identity": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        resp = await r.client.post(path, content=raw,
                                   headers={**AUTH, "content-type": "application/json"})
        assert resp.status_code == 400
        assert r.gateway.updates.open_update is None


# ------------------------------------------------------------------ the upstream's answers


async def reset_after(w: asyncio.StreamWriter, data: bytes) -> None:
    w.write(data)
    await w.drain()
    await asyncio.sleep(0.05)
    sock = w.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()  # an RST, not a clean end


async def test_an_unframed_answer_cut_by_a_reset_is_an_error() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await reset_after(w, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"
                             b'{"choices": [{"tok')

    async with Server(script) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        with pytest.raises(EngineUnavailable):
            await resp.read()
        resp.close()
        await p.aclose()


@contextlib.asynccontextmanager
async def gateway_over(url: str, **cfg: Any) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    *_, c, runner, j, _fake = make_parts()
    app = create_app(runner, ServiceConfig(upstream_url=url, control_token=TOKEN, **cfg))
    async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                base_url="http://gw.test") as client:
        yield app, client


async def test_a_non_streamed_answer_larger_than_the_bound_is_a_502() -> None:
    big = b'{"x": "' + b"a" * (2 << 20) + b'"}'

    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n" % len(big))
        for i in range(0, len(big), 1 << 16):
            w.write(big[i:i + (1 << 16)])
            await w.drain()

    async with Server(script) as s, gateway_over(s.url, max_response_bytes=1 << 20) as (app, c):
        resp = await c.post(GEN, json={"token_ids": [1]})
        assert resp.status_code == 502 and "exceeds" in resp.json()["error"]["message"]
        assert app.state.gateway.controller.active == {}


async def test_the_reset_answer_through_the_gateway_is_a_502() -> None:
    async def script(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await reset_after(w, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n"
                             b'{"choices": []')

    async with Server(script) as s, gateway_over(s.url) as (app, c):
        resp = await c.post(GEN, json={"token_ids": [1]})
        assert resp.status_code == 502


# ------------------------------------------------------------------ the recorder


def fin(sp: Any, *, index: int = 0, token_ids: Any = (1, 2), choices: Any = None,
        **kw: Any) -> FinishedRequest:
    ident = WeightIdentity("a" * 64, Provenance("ckpt"))
    b = Binding(WeightVersion(3, "rc-3", "e1"), ident, f"r-{index}", 1.0)
    if choices is None:
        choices = [{"index": 0, "token_ids": [5, 6], "finish_reason": "length"}]
    return FinishedRequest(GEN, b, {"token_ids": list(token_ids), "sampling_params": sp},
                           200, "complete", response={"choices": choices},
                           headers=coords(0, index), admitted_wall=10.0, admitted_mono=1.0,
                           completed_wall=11.0, completed_mono=2.0, **kw)


HOSTILE: list[Any] = [
    {"max_tokens": 2, "nested": deep(5000)},        # killed the writer thread before #16
    {"max_tokens": 2, "nested": {"a": deep(40)}},   # deeper than a record keeps
    {"temperature": 10**400},                        # OverflowError in float()
    {"temperature": float("nan")},
    {"temperature": "hot"},
    {"top_k": [1]},
    {"seed": 2**70},
    [1, 2, 3],                                       # not an object
    {"max_tokens": 2, "s": "\ud800"},                # a lone surrogate
    {"max_tokens": 2, "n": {"x": 1}},
]


def test_the_recorder_survives_hostile_requests_and_counts_them(tmp_path: Path) -> None:
    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE)
    for i, sp in enumerate(HOSTILE):
        rec(fin(sp, index=i))
    rec(fin({"max_tokens": 2}, index=100, token_ids=["x"]))  # a prompt that is not ids
    rec(fin({"max_tokens": 2}, index=101, choices=[{"index": 0, "token_ids": deep(3000)}]))
    rec(fin({"max_tokens": 2, "temperature": 0.5}, index=200))  # a good one, after them all
    assert rec.flush(10)
    st = rec.stats()
    assert st["alive"] is True
    committed = st["counts"].get("committed", 0)
    assert committed >= 1 and st["counts"].get("failed", 0) >= len(HOSTILE) - 2
    assert committed + st["counts"]["failed"] == len(HOSTILE) + 3
    t0 = time.monotonic()
    rec.close()
    assert time.monotonic() - t0 < 5
    groups = {g.prompt_index: g for g in read_groups(tmp_path / "t.jsonl")}
    assert 200 in groups and groups[200].samples[0].sampling.temperature == 0.5


def test_closing_the_recorder_never_blocks_shutdown(tmp_path: Path) -> None:
    """A full queue and a writer stuck on its disk: close returns, bounded."""
    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE, max_pending=2)
    stuck, release = threading.Event(), threading.Event()
    real = rec._rec.append_group

    def slow(group: Any) -> Any:
        stuck.set()
        release.wait(60)
        return real(group)

    rec._rec.append_group = slow  # type: ignore[method-assign]
    for i in range(6):
        rec(fin({"max_tokens": 2}, index=i))
    assert stuck.wait(5)
    done = threading.Event()
    th = threading.Thread(target=lambda: (rec.close(timeout_s=0.3), done.set()), daemon=True)
    th.start()
    assert done.wait(5), "close blocked"
    assert rec.stats()["counts"]["dropped"] >= 3
    assert rec.stats()["counts"]["abandoned"] == 1
    rec(fin({"max_tokens": 2}, index=50))  # after close: counted, not queued, not blocking
    release.set()


async def test_recorder_errors_are_in_status_and_metrics(tmp_path: Path) -> None:
    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE)
    async with rig(on_finished=rec) as r:
        deep_body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2,
                                                              "x": deep(40)}}
        ok = await r.client.post(GEN, headers=coords(0, 0), json=deep_body)
        assert ok.status_code == 200  # within the gateway's bound; too deep for a record
        good = await r.client.post(GEN, headers=coords(0, 1),
                                   json={"token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
        assert good.status_code == 200
        await until(lambda: sum(rec.counts.values()) >= 2)
        st = (await r.client.get("/control/status", headers=AUTH)).json()["recorder"]
        assert st["alive"] and st["counts"] == {"failed": 1, "committed": 1}
        assert any("deeper" in e for e in st["recent_errors"])
        m = (await r.client.get("/metrics")).text
        assert 'rolloutcore_recorder_records_total{result="failed"} 1.0' in m
        assert "rolloutcore_recorder_alive 1.0" in m
    rec.close()


async def test_a_stream_longer_than_the_recorder_collects_is_counted_not_kept(
        tmp_path: Path) -> None:
    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE)
    async with rig(streaming=True, on_finished=rec, max_record_bytes=300) as r:
        resp = await r.client.post(GEN, headers=coords(0, 0), json={
            "token_ids": [1, 2], "stream": True, "sampling_params": {"max_tokens": 40}})
        assert resp.status_code == 200 and resp.text.rstrip().endswith("[DONE]")
        await until(lambda: sum(rec.counts.values()) >= 1)
    rec.close()
    assert rec.counts == {"too_large": 1}


async def test_unattributable_answers_are_recorded_as_such(tmp_path: Path) -> None:
    """A straggler the drain policy aborted, and an answer finished after a taint."""
    import dataclasses

    rec = GatewayRecorder(tmp_path / "t.jsonl", ENGINE)
    async with rig(streaming=True, event_delay_s=0.03, on_finished=rec) as r:
        r.runner.deadlines = dataclasses.replace(r.runner.deadlines, drain_s=0.3)
        got: dict[str, Any] = {}
        events = {0: anyio.Event(), 1: anyio.Event()}

        async def stream(name: str, index: int, max_tokens: int = 300) -> None:
            async with r.client.stream("POST", GEN, headers=coords(0, index), json={
                    "token_ids": [1, 2], "stream": True,
                    "sampling_params": {"max_tokens": max_tokens, "n": 1}}) as resp:
                text = ""
                async for t in resp.aiter_text():
                    text += t
                    if text.count("\n\n") >= 3:
                        events[index].set()
                got[name] = text

        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, "aborted", 0)
            with anyio.fail_after(10):
                await events[0].wait()  # a few tokens in, whatever the load
            r.adapter.stage(W1)
            b = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
            assert b.status_code == 201
            ev = remote_transfer(r.adapter, W1, b.json()["target"]["label"])
            rep = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                                      json=_transfer_body(ev), headers=lease(b.json()))
            assert rep.json()["status"] == "published"
        async with anyio.create_task_group() as tg:
            tg.start_soon(stream, "tainted", 1, 60)
            with anyio.fail_after(10):
                await events[1].wait()
            await asyncio.to_thread(r.controller.fail, None, Step.SERVE, FailureKind.DIED,
                                    "engine lost (test)")
            r.fake.event_delay_s = 0  # tainted: the rest of the answer may come at once
        await until(lambda: sum(rec.counts.values()) >= 2)
    rec.close()
    assert rec.counts == {"unattributable": 2}, (rec.counts, list(rec.errors))
    groups = {g.prompt_index: g for g in read_groups(tmp_path / "t.jsonl")}
    cut = groups[0].samples[0]
    assert cut.attribution.attributable is False and "drain deadline" in (
        cut.attribution.reason or "")
    assert cut.completion.finish_reason == "abort"
    assert cut.binding.version.label == "default"
    assert 0 < len(cut.completion.token_ids) < 300
    late = groups[1].samples[0]
    assert late.attribution.attributable is False and "TAINTED" in (late.attribution.reason
                                                                    or "")
    assert late.binding.version.label == "rc-1"


# ------------------------------------------------------------------ the data token


def test_a_non_loopback_bind_needs_a_data_token() -> None:
    check_bind("0.0.0.0", True, True)
    with pytest.raises(BadInput, match="open data plane"):
        check_bind("0.0.0.0", True)
    with pytest.raises(BadInput, match="open data plane"):
        check_bind("10.1.2.3", True, False)
    check_bind("127.0.0.1", False, False)  # loopback: the data plane may stay open


def test_serve_refuses_a_non_loopback_bind_without_a_data_token(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTCORE_DATA_TOKEN", raising=False)
    with pytest.raises(BadInput, match="--data-token"):
        run_serve(ServeOptions(upstream="http://127.0.0.1:1", checkpoint="/nonexistent",
                               host="0.0.0.0", token=TOKEN))


def test_the_trajectory_schema_bounds_what_it_keeps() -> None:
    from rolloutcore.provenance.trajectory import MAX_EXTRA_DEPTH, SamplingSpec

    SamplingSpec(1.0, extra={"x": deep(MAX_EXTRA_DEPTH - 1)})
    with pytest.raises(BadInput, match="deeper"):
        SamplingSpec(1.0, extra={"x": deep(5000)})
    assert math.isfinite(SamplingSpec(1.0).temperature)
