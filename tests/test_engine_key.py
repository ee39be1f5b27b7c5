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

from rolloutcore.errors import BadInput
from rolloutcore.service.upstream import UpstreamPool
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
    from rolloutcore.adapters.vllm.process import ManagedEngine
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
