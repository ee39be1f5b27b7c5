"""Liveness of the gateway (#16): nobody holds an update, a connection or the gateway hostage.

In process, over the fake vLLM (served on loopback, so the gateway's own
upstream client is what runs). The hostile clients are driven through the
ASGI interface itself (``helpers.asgi_drive``): a reader whose socket stopped
taking bytes, a body that never ends. Each test fails on the gateway before
#16 (there it hangs, or the update is refused for ever).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
from typing import Any

import anyio
import httpx
import pytest
import uvicorn

from helpers.asgi_drive import Drive
from helpers.gateway_rig import (
    AUTH,
    QuickServer,
    begin_body,
    lease,
    remote_transfer,
    rig,
    sse_events,
    transfer_body,
)
from rolloutcore.control.runner import DrainPolicy
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.records import Record
from rolloutcore.service import proxy
from rolloutcore.service.server import http_protocol
from rolloutcore.testing.fake import FakeWeights

pytestmark = pytest.mark.anyio
GEN = "/inference/v1/generate"
W1 = FakeWeights.from_seed(1, step=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def gen(n: int, stream: bool) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": n}, "stream": stream}


def short_drain(r: Any, drain_s: float = 0.15) -> None:
    r.runner.deadlines = dataclasses.replace(r.runner.deadlines, drain_s=drain_s)


async def until(cond: Any, timeout_s: float = 10.0) -> None:
    with anyio.fail_after(timeout_s):
        while not cond():
            await anyio.sleep(0.005)


async def publish(r: Any) -> dict[str, Any]:
    """A whole update through the trainer protocol; its begin must not be refused."""
    r.adapter.stage(W1)
    b = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
    assert b.status_code == 201, b.text
    ev = remote_transfer(r.adapter, W1, b.json()["target"]["label"])
    rep = await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                              json=transfer_body(ev), headers=lease(b.json()))
    assert rep.status_code == 200 and rep.json()["status"] == "published", rep.text
    return b.json()


def completes(r: Any, rid: str) -> list[dict[str, Any]]:
    return [d for d in r.kinds("complete") if d["rollout_id"] == rid]


# ------------------------------------------------------------------ the drain deadline


async def test_a_stream_reader_that_stopped_reading_no_longer_holds_the_update(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reported defect: every begin got 503 "1 rollouts still active", for ever."""
    # This reader takes no last word: the gateway's try to hand it one (1 s) is short here.
    monkeypatch.setattr(proxy, "_LAST_WORD_S", 0.1)
    async with rig(client_send_s=600, event_delay_s=0.01) as r:
        short_drain(r)
        d = Drive(r.app, GEN, gen(400, True), block_after=2,
                  headers={"x-rolloutcore-rollout-id": "stuck-reader"})
        d.start()
        await until(lambda: d.blocked.is_set() and r.controller.active)
        upd = await publish(r)
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task  # the handler ended: nothing left holding a socket or a binding
        assert r.controller.active == {} and r.controller.state is State.READY
        assert r.controller.committed.label == upd["target"]["label"]  # type: ignore[union-attr]
        (done,) = completes(r, "stuck-reader")
        assert done["attributable"] is False and done["state"] == "DRAINING"
        assert done["version"]["label"] == "default"  # never credited to the new version
        assert [x["request_ids"] for x in r.fake.bodies if "request_ids" in x] == [
            ["generate-tokens-stuck-reader"]]  # vLLM told, by its id
        await until(lambda: r.fake.streams_closed_early >= 1)  # and the upstream closed
        assert r.gateway.metrics.aborted_rollouts._value.get() == 1
        note = [x.data for x in r.journal.records if x.kind == "note"
                and x.data["what"] == "stragglers_aborted"]
        assert note and note[0]["rollouts"] == ["stuck-reader"]
        assert note[0]["result"]["cut"] == ["stuck-reader"]


async def test_a_stream_still_read_gets_a_clear_end_when_aborted() -> None:
    async with rig(streaming=True, event_delay_s=0.05) as r:
        short_drain(r)
        got: dict[str, Any] = {"text": ""}
        first = anyio.Event()

        async def reader() -> None:
            async with r.client.stream("POST", GEN, json=gen(400, True)) as resp:
                got["status"] = resp.status_code
                async for text in resp.aiter_text():
                    got["text"] += text
                    first.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            with anyio.fail_after(10):
                await first.wait()  # mid-stream, whatever the machine's load
            await publish(r)
        events = sse_events(got["text"])
        assert got["status"] == 200 and events[-1] == "[DONE]"
        err = events[-2]["error"]
        assert err["type"] == "Aborted" and err["code"] == 503
        assert "drain deadline" in err["message"]
        assert events[-2]["rolloutcore"]["version"] == "default"
        assert r.controller.active == {}


async def test_a_request_still_waiting_for_its_answer_is_answered_503_when_aborted() -> None:
    async with rig(token_delay_s=0.01) as r:
        short_drain(r)
        got: dict[str, Any] = {}

        async def client() -> None:
            got["resp"] = await r.client.post(GEN, json=gen(400, False))

        async with anyio.create_task_group() as tg:
            tg.start_soon(client)
            await until(lambda: bool(r.controller.active))
            await publish(r)
        resp = got["resp"]
        assert resp.status_code == 503 and resp.json()["error"]["type"] == "Aborted"
        assert resp.json()["rolloutcore"]["version"] == "default"


async def test_refuse_policy_keeps_the_stragglers_and_refuses_the_update() -> None:
    async with rig(client_send_s=600, event_delay_s=0.01) as r:
        short_drain(r)
        r.runner.drain_policy = DrainPolicy.REFUSE
        d = Drive(r.app, GEN, gen(400, True), block_after=2)
        d.start()
        await until(lambda: d.blocked.is_set())
        b = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
        assert b.status_code == 503 and b.json()["classification"] == "no_mutation"
        assert len(r.controller.active) == 1
        assert not any("request_ids" in x for x in r.fake.bodies)  # no abort sent
        assert (await r.client.get("/control/status", headers=AUTH)).json()[
            "drain_policy"] == "refuse"
        d.gone.set()


# ------------------------------------------------------------------ client deadlines


@pytest.mark.parametrize("stream", [True, False])
async def test_a_client_that_stops_reading_is_cut_after_client_send_s(stream: bool) -> None:
    async with rig(client_send_s=0.3, event_delay_s=0.01) as r:
        d = Drive(r.app, GEN, gen(300, stream), block_after=0 if not stream else 2)
        t0 = time.monotonic()
        d.start()
        await until(lambda: d.blocked.is_set())
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task
        assert time.monotonic() - t0 >= 0.3
        assert r.controller.active == {}
        assert r.gateway.metrics.slow_clients._value.get() == 1
        ends = r.gateway.metrics.stream_endings.labels(
            "client_slow" if stream else "complete")._value.get()
        assert ends == 1
        # It was released attributable: the version did not change under it.
        assert [c["attributable"] for c in r.kinds("complete")] == [True]


async def test_a_body_that_never_ends_is_answered_408() -> None:
    async with rig(client_body_s=0.3) as r:
        d = Drive(r.app, GEN, gen(3, False), stall_body=True, body_parts=3)
        d.start()
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task
        assert d.status == 408 and d.complete and b"did not arrive" in d.body
        assert r.controller.active == {} and r.fake.bodies == []
        assert r.gateway.metrics.body_timeouts._value.get() == 1


async def test_a_control_body_that_never_ends_is_answered_408() -> None:
    async with rig(client_body_s=0.3) as r:
        d = Drive(r.app, "/control/updates", begin_body(W1), stall_body=True, body_parts=2,
                  headers=AUTH)
        d.start()
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task
        assert d.status == 408
        assert r.controller.state is State.READY and r.gateway.updates.open_update is None


async def test_requests_beyond_the_concurrency_bound_get_503_with_retry_after() -> None:
    async with rig(max_concurrent_requests=2, client_body_s=30) as r:
        stuck = [Drive(r.app, GEN, gen(3, False), stall_body=True, body_parts=2)
                 for _ in range(2)]
        for d in stuck:
            d.start()
        await until(lambda: r.gateway.data.in_progress == 2)
        over = await r.client.post(GEN, json=gen(3, False))
        assert over.status_code == 503 and over.headers["retry-after"] == "1"
        assert r.gateway.metrics.overloaded._value.get() == 1
        for d in stuck:
            d.gone.set()
        await until(lambda: r.gateway.data.in_progress == 0)
        ok = await r.client.post(GEN, json=gen(3, False))
        assert ok.status_code == 200


def test_request_headers_that_never_end_are_answered_408() -> None:
    """The server side (uvicorn) with the gateway's protocol: headers due in time."""

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never reached
        raise AssertionError("a request without complete headers reached the app")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = QuickServer(uvicorn.Config(app, lifespan="off", log_level="warning",
                                           http=http_protocol(0.15)))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.01)
        for first in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", b""):
            c = socket.create_connection(sock.getsockname(), timeout=10)
            c.sendall(first)
            t0 = time.monotonic()
            data = b""
            while chunk := c.recv(4096):
                data += chunk
            c.close()
            assert data.startswith(b"HTTP/1.1 408"), data
            assert 0.12 <= time.monotonic() - t0 < 5
    finally:
        server.stop()
        th.join(10)
        sock.close()


def test_a_connection_whose_peer_stopped_reading_is_dropped() -> None:
    """An answer handed over whole (a non-streamed one) no longer sits in the server's
    memory for as long as the client lives: the server side drops the connection."""
    body = b"x" * (24 << 20)
    sent = threading.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
        sent.set()

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = QuickServer(uvicorn.Config(app, lifespan="off", log_level="warning",
                                           http=http_protocol(5.0, 0.25)))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    try:
        while not server.started:
            time.sleep(0.01)
        c = socket.socket()
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(sock.getsockname())
        c.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sent.wait(10)  # the app is done: only the server holds the bytes
        deadline = time.monotonic() + 10
        while server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.server_state.connections  # dropped, its buffer freed
        got = 0
        c.settimeout(10)
        try:
            while chunk := c.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        c.close()
        assert got < len(body)
    finally:
        server.stop()
        th.join(10)
        sock.close()


# ------------------------------------------------------------------ the unexpected


async def test_a_journal_that_fails_during_the_report_ends_the_update() -> None:
    """Not "reporting" for ever with every later begin answered 409 "in progress"."""
    async with rig() as r:
        armed = threading.Event()

        def failing(rec: Record) -> None:
            if armed.is_set() and rec.KIND == "commit":
                raise OSError(28, "No space left on device")

        r.controller.add_listener(failing)
        r.adapter.stage(W1)
        b = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
        assert b.status_code == 201
        uid = b.json()["update_id"]
        ev = remote_transfer(r.adapter, W1, b.json()["target"]["label"])
        armed.set()
        rep = await r.client.post(f"/control/updates/{uid}/transfer", json=transfer_body(ev),
                                  headers=lease(b.json()))
        assert rep.status_code == 200, rep.text
        body = rep.json()
        assert body["status"] == "failed" and body["result"]["classification"] == "ambiguous"
        assert r.controller.state is State.TAINTED and r.gateway.updates.open_update is None
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["update"] is None and "No space left" in st["failed_closed"]
        again = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
        assert again.status_code == 409 and "failed closed" in again.json()["error"]
        assert (await r.client.get("/health")).status_code == 503


async def test_a_journal_that_fails_at_the_begin_ends_the_update() -> None:
    async with rig() as r:
        def failing(rec: Record) -> None:
            if rec.KIND == "request_update":
                raise OSError(28, "No space left on device")

        r.controller.add_listener(failing)
        b = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
        assert b.status_code == 503 and b.json()["classification"] == "ambiguous"
        assert r.controller.current_ticket is None and r.controller.state is State.TAINTED
        assert r.gateway.updates.open_update is None


# ------------------------------------------------------------------ attribution


async def test_an_answer_completed_after_a_taint_is_released_unattributable() -> None:
    async with rig(streaming=True, event_delay_s=0.02) as r:
        got: dict[str, Any] = {}

        async def reader() -> None:
            got["resp"] = await r.client.post(GEN, json=gen(30, True),
                                              headers={"x-rolloutcore-rollout-id": "late"})

        async with anyio.create_task_group() as tg:
            tg.start_soon(reader)
            await until(lambda: bool(r.controller.active))
            await asyncio.to_thread(r.controller.fail, None, Step.SERVE, FailureKind.DIED,
                                    "engine lost (test)")
            r.fake.event_delay_s = 0  # tainted: the rest of the answer may come at once
        assert got["resp"].status_code == 200
        (done,) = completes(r, "late")
        assert done["attributable"] is False and done["state"] == "TAINTED"


async def test_the_status_says_what_the_data_plane_is_doing() -> None:
    async with rig() as r:
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["drain_policy"] == "abort" and st["requests_in_progress"] == 0
        assert st["failed_closed"] is None and st["recorder"] is None
        metrics = (await r.client.get("/metrics")).text
        for name in ("rolloutcore_aborted_rollouts_total", "rolloutcore_slow_clients_total",
                     "rolloutcore_body_timeouts_total", "rolloutcore_overloaded_total"):
            assert name in metrics


async def test_a_stuck_body_never_blocks_an_update() -> None:
    """A client still sending its body holds no binding; the update runs past it."""
    async with rig(client_body_s=30) as r:
        d = Drive(r.app, GEN, gen(3, False), stall_body=True, body_parts=2)
        d.start()
        await until(lambda: r.gateway.data.in_progress == 1)
        await publish(r)
        d.gone.set()
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task


async def test_http_client_sees_the_stream_end_when_aborted_over_a_socket() -> None:
    """The same abort through a real socket (uvicorn, on this loop): the read ends cleanly."""
    async with rig(event_delay_s=0.05) as r:
        short_drain(r)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = QuickServer(uvicorn.Config(r.app, lifespan="off", log_level="warning",
                                               http=http_protocol(5.0)))
        serving = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
        try:
            await until(lambda: server.started)
            url = f"http://127.0.0.1:{sock.getsockname()[1]}"
            got: dict[str, Any] = {"text": ""}
            first = threading.Event()

            def read() -> None:
                with httpx.stream("POST", f"{url}{GEN}", json=gen(400, True), timeout=30) as s:
                    for text in s.iter_text():
                        got["text"] += text
                        first.set()

            th = threading.Thread(target=read, daemon=True)
            th.start()
            assert await asyncio.to_thread(first.wait, 10)  # mid-stream
            await publish(r)
            await asyncio.to_thread(th.join, 10)
            assert not th.is_alive()
        finally:
            server.stop()
            await serving
            sock.close()
        events = sse_events(got["text"])
        assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "Aborted"
