"""transports.engine_key: the guard vLLM runs (``--middleware``) and this process's key table.

The guard is driven as vLLM drives it: an ASGI middleware around an app,
requests through httpx's ``ASGITransport``. The real-vLLM side (the engine
loads it, an out-of-band write is refused) is in
``tests/engine/test_service_engine.py``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from rolloutcore.engine.upstream import UpstreamPool
from rolloutcore.errors import BadInput
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import HEADER, RouteGuard


async def _inner(scope: Any, receive: Any, send: Any) -> None:
    """The engine behind the guard: says which route it served."""
    if scope["type"] == "lifespan":
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        return
    body = json.dumps({"served": scope["path"]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


KEY = engine_key.new_key()


@pytest.fixture
def guard(monkeypatch: pytest.MonkeyPatch) -> RouteGuard:
    monkeypatch.setenv(engine_key.ENV, KEY)
    return RouteGuard(_inner)


def _call(app: Any, method: str, path: str, headers: dict[str, str] | None = None
          ) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as c:
            return await c.request(method, path, headers=headers, json={})
    return asyncio.run(go())


@pytest.mark.parametrize("method,path", [
    ("POST", "/pause"), ("POST", "/resume"), ("POST", "/update_weights"),
    ("POST", "/init_weight_transfer_engine"), ("POST", "/start_weight_update"),
    ("POST", "/finish_weight_update"), ("POST", "/update_weight_version"),
    ("POST", "/reset_prefix_cache"), ("POST", "/collective_rpc"), ("POST", "/sleep"),
    ("POST", "/wake_up"), ("POST", "/abort_requests"), ("GET", "/weight_info"),
    ("GET", "/server_info"), ("POST", "/a_route_vllm_adds_next_year"),
    ("GET", "/pause"), ("POST", "/health"), ("DELETE", "/v1/completions"),
    ("POST", "/v1/completions/"), ("POST", "//pause"),
])
def test_a_closed_route_without_the_key_is_403_and_never_reaches_the_engine(
        guard: RouteGuard, method: str, path: str) -> None:
    for headers in (None, {HEADER: "x" * 43}, {HEADER: KEY[:-1]}, {HEADER: KEY + "x"},
                    {"authorization": f"Bearer {KEY}"}):
        r = _call(guard, method, path, headers)
        assert r.status_code == 403, (path, headers, r.text)
        assert "served" not in r.text
        assert r.json()["error"]["code"] == 403


@pytest.mark.parametrize("method,path", [
    ("GET", "/health"), ("GET", "/version"), ("GET", "/v1/models"), ("GET", "/metrics"),
    ("GET", "/openapi.json"), ("GET", "/is_paused"), ("POST", "/tokenize"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/inference/v1/generate"),
])
def test_reading_and_generating_stay_open(guard: RouteGuard, method: str, path: str) -> None:
    r = _call(guard, method, path)
    assert r.status_code == 200 and r.json() == {"served": path}


def test_the_key_opens_every_route(guard: RouteGuard) -> None:
    for path in ("/pause", "/update_weights", "/collective_rpc", "/health"):
        r = _call(guard, "POST", path, {HEADER: KEY})
        assert r.status_code == 200 and r.json() == {"served": path}
    # header names are case-insensitive, as HTTP's are
    assert _call(guard, "POST", "/pause", {HEADER.upper(): KEY}).status_code == 200


def test_a_websocket_without_the_key_is_closed_before_it_opens(guard: RouteGuard) -> None:
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(msg)

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    asyncio.run(guard({"type": "websocket", "path": "/v1/realtime", "headers": []},
                      receive, send))
    assert sent == [{"type": "websocket.close", "code": 1008}]


@pytest.mark.parametrize("value", [None, "", "short", "k" * 31, "k" * 40 + "\n",
                                   "k" * 20 + " " + "k" * 20, "é" * 40])
def test_an_engine_without_a_valid_key_does_not_start(monkeypatch: pytest.MonkeyPatch,
                                                      value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(engine_key.ENV, raising=False)
    else:
        monkeypatch.setenv(engine_key.ENV, value)
    with pytest.raises(BadInput, match=engine_key.ENV):
        RouteGuard(_inner)


def test_the_table_is_by_origin_and_forget_takes_only_its_own_key() -> None:
    url = "http://127.0.0.1:18431"
    k1, k2 = engine_key.new_key(), engine_key.new_key()
    try:
        assert engine_key.headers_for(url) == {}
        engine_key.register(url + "/", k1)
        for same in (url, url + "/v1/completions", "http://127.0.0.1:18431/x?y=1",
                     "HTTP://127.0.0.1:18431"):
            assert engine_key.headers_for(same) == {HEADER: k1}, same
        for other in ("http://127.0.0.1:18432", "https://127.0.0.1:18431",
                      "http://localhost:18431", "not a url", ""):
            assert engine_key.headers_for(other) == {}, other
        engine_key.register(url, k2)          # a restarted engine's new key replaces it
        engine_key.forget(url, k1)            # an old owner's forget leaves the new one
        assert engine_key.headers_for(url) == {HEADER: k2}
        engine_key.forget(url, k2)
        assert engine_key.headers_for(url) == {}
        assert engine_key.origin("http://[::1]/a") == "http://[::1]:80"
    finally:
        engine_key.forget(url)


@pytest.mark.parametrize("bad", ["short", "k" * 40 + "\r\nX-Evil: 1", 7, None])
def test_register_refuses_a_key_that_could_not_be_a_header(bad: Any) -> None:
    with pytest.raises(ValueError):
        engine_key.register("http://127.0.0.1:18433", bad)
    assert engine_key.headers_for("http://127.0.0.1:18433") == {}
    with pytest.raises(ValueError):
        engine_key.register("ftp://x", KEY)


def test_the_gateways_own_calls_carry_the_key_and_its_data_requests_need_none() -> None:
    """``UpstreamPool.call`` (the abort route) sends the key; ``post`` (data) does not."""
    seen: list[bytes] = []

    async def go() -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                         if line.lower().startswith(b"content-length")))
            await reader.readexactly(n)
            seen.append(head)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        engine_key.register(url, KEY)
        try:
            pool = UpstreamPool(url, max_connections=2, connect_s=5, pool_s=5, read_s=5,
                                keepalive_s=1)
            status, _ = await pool.call(b"/abort_requests", b"{}", timeout_s=10)
            assert status == 200
            resp = await pool.post(b"/v1/completions", b"{}", b"rid-1")
            await resp.read()
            resp.close()
            await pool.aclose()
        finally:
            engine_key.forget(url)
            server.close()
            await server.wait_closed()

    asyncio.run(go())
    abort, data = seen
    assert f"{HEADER}: {KEY}".encode() in abort.split(b"\r\n")
    assert HEADER.encode() not in data.lower()


def test_a_managed_engine_asks_vllm_for_the_guard_and_keeps_the_key_out_of_argv(
        tmp_path: Any) -> None:
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.models import make_checkpoint

    ckpt = make_checkpoint(tmp_path / "m", seed=0)
    plain = ManagedEngine(ckpt, port=18440)
    assert "--middleware" not in plain.command() and plain.route_key is None
    assert engine_key.ENV not in plain.environment()
    guarded = ManagedEngine(ckpt, port=18441, guard_routes=True)
    cmd = guarded.command()
    assert cmd[cmd.index("--middleware") + 1] == engine_key.MIDDLEWARE
    with pytest.raises(BadInput):
        ManagedEngine(ckpt, guard_routes="yes")  # type: ignore[arg-type]


class _Core:
    """An engine core as vLLM's API server holds it (``app.state.engine_client``)."""

    def __init__(self, name: str, fail: bool = False) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail

        async def pause(**kw: Any) -> None:
            if self.fail:
                raise RuntimeError("core gone")
            self.calls.append((name, kw))
        setattr(self, name, pause)


class _Renderer:
    def __init__(self) -> None:
        self.cleared = 0

    async def clear_mm_cache_async(self) -> None:
        self.cleared += 1


def _engine_app(core: Any) -> Any:
    """The guard inside an app whose state holds an engine client, as vLLM's does."""
    import types

    state = types.SimpleNamespace(engine_client=types.SimpleNamespace(
        engine_core=core, renderer=_Renderer()))
    app = types.SimpleNamespace(state=state)
    guard = RouteGuard(_inner)

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = app  # Starlette sets it before its middleware runs
        await guard(scope, receive, send)
    asgi.state = state  # type: ignore[attr-defined]
    return asgi


@pytest.mark.parametrize("core_name", ["pause_scheduler_async", "pause_generation_async"])
def test_the_fast_pause_is_the_engine_cores_own_pause_behind_the_key(
        monkeypatch: pytest.MonkeyPatch, core_name: str) -> None:
    """/rolloutcore/pause calls the engine core's pause as vLLM's /pause does (0.26-0.32:
    pause_scheduler_async, 0.33+: pause_generation_async), without vLLM's fixed sleep."""
    monkeypatch.setenv(engine_key.ENV, KEY)
    core = _Core(core_name)
    app = _engine_app(core)
    path = engine_key.FAST_PAUSE + "?mode=wait&clear_cache=false"
    assert _call(app, "POST", path).status_code == 403 and core.calls == []
    r = _call(app, "POST", path, {HEADER: KEY})
    assert r.status_code == 200 and r.json() == {"status": "paused", "via": "engine_core"}
    assert core.calls == [(core_name, {"mode": "wait", "clear_cache": False})]
    r = _call(app, "POST", engine_key.FAST_PAUSE + "?mode=keep&clear_cache=true", {HEADER: KEY})
    assert r.status_code == 200 and core.calls[-1][1] == {"mode": "keep", "clear_cache": True}
    assert app.state.engine_client.renderer.cleared == 1  # as AsyncLLM does, when clearing


@pytest.mark.parametrize("query", ["?mode=later", "?mode=wait&clear_cache=maybe", "?mode="])
def test_the_fast_pause_refuses_bad_input_and_pauses_nothing(
        monkeypatch: pytest.MonkeyPatch, query: str) -> None:
    monkeypatch.setenv(engine_key.ENV, KEY)
    core = _Core("pause_scheduler_async")
    r = _call(_engine_app(core), "POST", engine_key.FAST_PAUSE + query, {HEADER: KEY})
    assert r.status_code == 400 and core.calls == []
    r = _call(_engine_app(core), "GET", engine_key.FAST_PAUSE, {HEADER: KEY})
    assert r.status_code == 405 and core.calls == []


def test_the_fast_pause_says_when_it_cannot_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    """No core pause to call: 404 (the client then uses /pause); the core fails: 500."""
    monkeypatch.setenv(engine_key.ENV, KEY)
    r = _call(_engine_app(object()), "POST", engine_key.FAST_PAUSE + "?mode=wait",
              {HEADER: KEY})
    assert r.status_code == 404
    r = _call(_engine_app(_Core("pause_scheduler_async", fail=True)), "POST",
              engine_key.FAST_PAUSE + "?mode=wait", {HEADER: KEY})
    assert r.status_code == 500 and "core gone" in r.json()["error"]


@pytest.mark.parametrize("fast_status", [200, 404, 500])
def test_a_keyed_engine_is_drained_through_the_fast_pause_else_through_pause(
        fast_status: int) -> None:
    """The adapter's drain: an engine this process holds the key of is paused through
    /rolloutcore/pause; a guard without it (404) or a failed core pause (500) falls back to
    vLLM's /pause; an engine without a key is paused through /pause alone."""
    from rolloutcore.core.evidence import PauseMode
    from rolloutcore.engine.port import VllmAdapter
    from test_vllm_http_unit import BASE, answer, client, requests, sent, vllm

    e = vllm(overrides={engine_key.FAST_PAUSE: answer(fast_status, {
        "status": "paused", "via": "engine_core"} if fast_status == 200 else {"error": "x"})})
    engine_key.register(BASE, KEY)
    try:
        d = VllmAdapter(client(e), engine_epoch="ep").drain(PauseMode.WAIT)
    finally:
        engine_key.forget(BASE, KEY)
    assert d.paused
    assert sent(e, engine_key.FAST_PAUSE) == 1
    assert sent(e, "/pause") == (0 if fast_status == 200 else 1)
    fast = requests(e, engine_key.FAST_PAUSE)[0]
    assert fast.url.params["mode"] == "wait" and fast.url.params["clear_cache"] == "false"
    assert fast.headers[HEADER] == KEY
    e2 = vllm()
    assert VllmAdapter(client(e2), engine_epoch="ep").drain(PauseMode.WAIT).paused
    assert sent(e2, engine_key.FAST_PAUSE) == 0 and sent(e2, "/pause") == 1
