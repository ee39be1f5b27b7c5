"""The gateway's upstream client against a real loopback server that answers as scripted.

The data-plane tests drive it through the gateway against the fake vLLM;
these pin what they cannot reach: connection reuse and expiry, framing
(length, chunked, until EOF), each deadline, the pool bound, and that an
abandoned answer closes its connection (which is how vLLM learns to abort).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from rolloutcore.engine.upstream import STEP, UpstreamPool
from rolloutcore.errors import EffectTimeout, EngineUnavailable, EngineUnreachable

pytestmark = pytest.mark.anyio

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter, "Server"], Awaitable[None]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Server:
    """A loopback server running ``script`` once per request it reads."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.connections = 0
        self.requests: list[bytes] = []
        self.eof = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def _conn(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.connections += 1
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.requests.append(head + await r.readexactly(length))
                await self.script(r, w, self)
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eof.set()
        finally:
            w.close()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"


def pool(url: str, **kw: float) -> UpstreamPool:
    args: dict[str, float] = {"max_connections": 4, "connect_s": 2.0, "pool_s": 2.0,
                              "read_s": 2.0, "keepalive_s": 4.0}
    args.update(kw)
    return UpstreamPool(url, max_connections=int(args["max_connections"]),
                        connect_s=args["connect_s"], pool_s=args["pool_s"],
                        read_s=args["read_s"], keepalive_s=args["keepalive_s"])


async def answer_json(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
    body = b'{"n":%d}' % len(s.requests)
    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json; charset=utf-8\r\n"
            b"content-length: %d\r\n\r\n" % len(body))
    w.write(body)  # headers and body in separate writes, as uvicorn does
    await w.drain()


@pytest.fixture
async def json_server() -> AsyncIterator[Server]:
    async with Server(answer_json) as s:
        yield s


async def test_answers_are_read_and_connections_reused(json_server: Server) -> None:
    p = pool(json_server.url + "/prefix")
    for i in range(3):
        resp = await p.post(b"/v1/completions", b'{"a":1}', b"r-%d" % i)
        assert resp.status == 200
        assert resp.content_type == "application/json"
        assert (b"content-type", b"application/json; charset=utf-8") in resp.raw_headers
        assert await resp.read() == b'{"n":%d}' % (i + 1)
        resp.release()
    assert json_server.connections == 1
    assert p.open_connections == 1
    req = json_server.requests[0]
    assert req.startswith(b"POST /prefix/v1/completions HTTP/1.1\r\n")
    assert b"\r\nX-Request-Id: r-0\r\n" in req
    assert b"\r\nContent-Length: 7\r\n" in req and req.endswith(b"\r\n\r\n{\"a\":1}")
    await p.aclose()


async def test_idle_connections_expire_before_reuse(json_server: Server) -> None:
    p = pool(json_server.url, keepalive_s=0.05)
    (await p.post(b"/x", b"{}", b"r")).release()  # never read: not complete, closed
    resp = await p.post(b"/x", b"{}", b"r")
    await resp.read()
    resp.release()
    await asyncio.sleep(0.1)
    resp = await p.post(b"/x", b"{}", b"r")
    await resp.read()
    resp.release()
    assert json_server.connections == 3
    await p.aclose()


async def test_chunked_stream_is_yielded_as_it_comes() -> None:
    async def chunked(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n")
        for part in (b"data: 1\n\n", b"data: [DONE]\n\n"):
            w.write(b"%x\r\n%s\r\n" % (len(part), part))
            await w.drain()
            await asyncio.sleep(0.01)
        w.write(b"0\r\n\r\n")
        await w.drain()

    async with Server(chunked) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        assert resp.content_type == "text/event-stream"
        got = [c async for c in resp.iter_any()]
        assert b"".join(got) == b"data: 1\n\ndata: [DONE]\n\n" and len(got) >= 2
        resp.release()
        resp = await p.post(b"/x", b"{}", b"r")  # the same connection, parser reused
        assert b"".join([c async for c in resp.iter_any()]).endswith(b"[DONE]\n\n")
        resp.release()
        assert s.connections == 1
        await p.aclose()


async def test_large_answers_arrive_whole_read_or_streamed_slowly() -> None:
    blob = bytes(range(256)) * (4 * 4096)  # 4 MiB: past the 1 MiB at which reading pauses

    async def big(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n")
        if len(s.requests) == 1:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n" % len(blob))
            w.write(blob)
        else:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n")
            for i in range(0, len(blob), 1 << 16):
                part = blob[i:i + (1 << 16)]
                w.write(b"%x\r\n%s\r\n" % (len(part), part))
            w.write(b"0\r\n\r\n")
        await w.drain()

    async with Server(big) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        assert resp.status == 200 and resp.content_type == "application/json"
        assert all(k != b"link" for k, _ in resp.raw_headers)  # the 1xx's are not the answer's
        assert await resp.read() == blob
        resp.release()
        resp = await p.post(b"/x", b"{}", b"r")
        got = []
        async for chunk in resp.iter_any():
            got.append(chunk)
            await asyncio.sleep(0.001)  # a slow client
        assert b"".join(got) == blob
        resp.release()
        assert s.connections == 1
        await p.aclose()


async def test_answer_without_length_ends_at_eof_and_is_not_reused() -> None:
    async def until_eof(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it")
        await w.drain()
        w.close()
        raise ConnectionError

    async with Server(until_eof) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        assert await resp.read() == b"all of it"
        resp.release()
        resp = await p.post(b"/x", b"{}", b"r")
        assert await resp.read() == b"all of it"
        resp.release()
        assert s.connections == 2
        await p.aclose()


async def test_answer_cut_short_is_an_error() -> None:
    async def short(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        await w.drain()
        raise ConnectionError

    async with Server(short) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        with pytest.raises(EngineUnavailable, match="before its answer was complete"):
            await resp.read()
        resp.close()
        await p.aclose()


async def test_not_http_is_an_error() -> None:
    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await w.drain()

    async with Server(garbage) as s:
        p = pool(s.url)
        with pytest.raises(EngineUnavailable, match="malformed"):
            await p.post(b"/x", b"{}", b"r")
        await p.aclose()


async def test_silence_longer_than_read_s_times_out_and_closes() -> None:
    async def headers_then_nothing(r: asyncio.StreamReader, w: asyncio.StreamWriter,
                                   s: Server) -> None:
        if len(s.requests) > 1:
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nab")
            await w.drain()
        await r.read(1)  # then nothing, until the client goes (b"" at its EOF)
        raise ConnectionError

    async with Server(headers_then_nothing) as s:
        p = pool(s.url, read_s=0.2)
        with pytest.raises(EffectTimeout, match="vLLM sent nothing") as ei:
            await p.post(b"/x", b"{}", b"r")
        assert ei.value.deadline_s == 0.2 and ei.value.step == STEP
        resp = await p.post(b"/x", b"{}", b"r")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(EffectTimeout):
            await resp.read()
        assert 0.15 < loop.time() - t0 < 2
        resp.close()
        await asyncio.wait_for(s.eof.wait(), 2)  # the server saw the connection go
        await p.aclose()


async def test_closing_an_unfinished_answer_closes_the_connection() -> None:
    async def slow_stream(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await w.drain()
        await r.read(1)  # returns b"" (or raises) once the client has gone
        raise ConnectionError

    async with Server(slow_stream) as s:
        p = pool(s.url)
        resp = await p.post(b"/x", b"{}", b"r")
        async for chunk in resp.iter_any():
            assert chunk == b"first"
            break
        resp.close()
        await asyncio.wait_for(s.eof.wait(), 2)
        await asyncio.sleep(0.01)
        assert p.open_connections == 0
        await p.aclose()


async def test_full_pool_waits_at_most_pool_s(json_server: Server) -> None:
    p = pool(json_server.url, max_connections=1, pool_s=0.1)
    held = await p.post(b"/x", b"{}", b"r")
    with pytest.raises(EffectTimeout, match="no upstream connection free"):
        await p.post(b"/x", b"{}", b"r")
    waiting = asyncio.ensure_future(p.post(b"/x", b"{}", b"r2"))
    await asyncio.sleep(0.02)
    await held.read()
    held.release()
    resp = await asyncio.wait_for(waiting, 2)
    assert await resp.read() == b'{"n":2}'
    resp.release()
    assert json_server.connections == 1
    await p.aclose()


async def test_unreachable_is_engine_unreachable() -> None:
    async with Server(answer_json) as s:
        url = s.url
    await asyncio.sleep(0.01)
    p = pool(url)
    with pytest.raises(EngineUnreachable, match="cannot connect") as ei:
        await p.post(b"/x", b"{}", b"r")
    assert isinstance(ei.value.__cause__, ConnectionRefusedError)
    assert p.open_connections == 0
    await p.aclose()


async def test_exchange_sends_the_route_key_and_reuses_its_connection(
        json_server: Server) -> None:
    """``exchange`` (the native routes' relay): any method, a query, the engine's route
    key on every call, the answer read whole; the connection goes back to the pool."""
    from rolloutcore.transports import engine_key

    engine_key.register(json_server.url, "k" * 32)
    try:
        p = pool(json_server.url)
        assert await p.exchange("POST", "/update_weights", b'{"a":1}', timeout_s=2) == (
            200, b'{"n":1}')
        assert await p.exchange("GET", "/is_paused?x=1", b"", timeout_s=2) == (
            200, b'{"n":2}')
    finally:
        engine_key.forget(json_server.url)
    assert json_server.connections == 1 and p.open_connections == 1
    post, get = json_server.requests
    assert post.startswith(b"POST /update_weights HTTP/1.1\r\n")
    assert post.endswith(b"\r\n\r\n{\"a\":1}")
    assert get.startswith(b"GET /is_paused?x=1 HTTP/1.1\r\n")
    assert all(f"\r\n{engine_key.HEADER}: {'k' * 32}\r\n".encode() in r
               for r in (post, get))
    await p.aclose()


async def test_exchange_past_its_deadline_times_out_and_closes() -> None:
    """A call bounded as a whole: past ``timeout_s`` it is an ``EffectTimeout`` naming the
    call, and its connection is closed (vLLM sees the client gone), however long the
    pool's own silence allowance."""
    async def never(r: asyncio.StreamReader, w: asyncio.StreamWriter, s: Server) -> None:
        await r.read(1)  # nothing, until the client goes
        raise ConnectionError

    async with Server(never) as s:
        p = pool(s.url, read_s=60)
        with pytest.raises(EffectTimeout, match="POST /finish_weight_update") as ei:
            await p.exchange("POST", "/finish_weight_update", b"{}", timeout_s=0.2)
        assert ei.value.deadline_s == 0.2 and ei.value.step == STEP
        await asyncio.wait_for(s.eof.wait(), 5)
        assert p.open_connections == 0
        await p.aclose()
