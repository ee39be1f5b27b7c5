"""The data plane's HTTP/1.1 client towards its one vLLM server.

Why not a general client: the gateway's added latency is the CPU it spends
per request, and next to a running vLLM (whose 3-5 ms per request leave the
gateway idle, so its caches go cold) every microsecond of Python counts
about twice. aiohttp's request path (session, request and response objects,
payload registry, auto headers, a new parser and a timer per chunk) was the
largest single share of the gateway's CPU per request: 0.26 ms of 0.48 ms
in the handler, measured against the real vLLM (docs/service.md, "What the
gateway costs"). This client does only what the gateway needs: ``POST``
with a known body to one fixed origin, over a pool of keep-alive
connections, the answer parsed by ``httptools`` (llhttp, the parser uvicorn
serves the gateway's own side with), so framing (content length, chunked
encoding, keep-alive) is a library's, not ours.

Semantics kept from the aiohttp client it replaces:

* deadlines: ``connect_s`` for a new connection, ``pool_s`` for waiting on a
  full pool, ``read_s`` for the longest silence while the answer is read;
* failures are the package's, as every client of vLLM has them
  (``rolloutcore.engine.errors``, whose ``transport_error`` maps the
  socket's): a deadline ``EffectTimeout``, no connection
  ``EngineUnreachable``, an answer that broke off or was not HTTP
  ``EngineUnavailable``. They are made where the failure is seen, off the
  path of a request that succeeds;
* idle connections are dropped after ``keepalive_s`` (below vLLM's own 5 s,
  so a request is never written into a connection the server is closing; a
  POST is never retried);
* a complete answer returns its connection to the pool (``release``); any
  other ending closes it (``close``), which makes vLLM abort the request;
* the answer's bytes are read with flow control: reading from vLLM pauses
  while more than ``high_water`` bytes wait for the client (the gateway bounds
  how long the client may leave them unread: ``proxy``'s send deadline);
* an answer is complete only when its framing says so: one without length
  or chunking ends at a *clean* end of the connection, and one cut by a
  reset is an error, never a short complete answer;
* a whole answer (``read``) is bounded in size; the few requests the gateway
  makes of vLLM itself (``call``: aborting stragglers) use a connection of
  their own, so a pool full of stragglers cannot block them.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

from rolloutcore.engine.errors import transport_error
from rolloutcore.errors import BadInput, EffectTimeout, EngineUnavailable
from rolloutcore.transports import engine_key

__all__ = ["STEP", "UpstreamPool", "UpstreamResponse"]

_HIGH_WATER = 1 << 20

#: The ``step`` of every error this client raises.
STEP = "upstream"


class _Conn(asyncio.Protocol):
    """One keep-alive connection; the parser's callbacks fill the current response."""

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self.resp: UpstreamResponse | None = None
        # One parser per connection: llhttp starts over after each complete
        # message of a keep-alive connection (uvicorn uses its own the same way).
        self._parser = httptools.HttpResponseParser(self)

    # -- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        resp = self.resp
        if resp is None or resp.done:  # bytes nobody asked for: the connection is unusable
            self.abort()
            return
        resp.active = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp.fail(EngineUnavailable(STEP, f"malformed HTTP answer from vLLM: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.resp
        if resp is not None and not resp.done:
            if resp.status and not resp.framed and exc is None:
                # No length, not chunked: the answer ends at a clean EOF. A reset
                # (``exc``) cut it short: that is an error, not an answer.
                resp.complete(keep_alive=False)
            else:
                what = "vLLM closed the connection before its answer was complete"
                resp.fail(EngineUnavailable(STEP, what) if exc is None else
                          transport_error(exc, STEP, what, timeout_s=self._pool.read_s))
        self._pool._lost(self)

    # -- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        resp = self.resp
        assert resp is not None
        resp.raw_headers.append((name, value))
        ln = name.lower()
        if ln == b"content-type":
            resp.content_type = value.split(b";", 1)[0].strip().lower().decode("latin-1")
        elif ln in (b"content-length", b"transfer-encoding"):
            resp.framed = True

    def on_headers_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        status = self._parser.get_status_code()
        if status < 200:  # informational (1xx): the answer proper is still to come
            resp.raw_headers.clear()
            resp.content_type = ""
            resp.framed = False
            return
        resp.status = status
        resp.wake()

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        assert resp is not None
        resp.feed(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        assert resp is not None
        if not resp.status:  # the end of a 1xx
            return
        resp.complete(keep_alive=self._parser.should_keep_alive())

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class UpstreamResponse:
    """One answer: status and raw headers once ``post`` returns; the body read or streamed."""

    __slots__ = ("_buf", "_buffered", "_conn", "_error", "_keep_alive", "_paused", "_pool",
                 "_streaming", "_timer", "_waiter", "active", "content_type", "done", "framed",
                 "raw_headers", "status", "too_large")

    def __init__(self, pool: UpstreamPool, conn: _Conn) -> None:
        self._pool = pool
        self._conn: _Conn | None = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.content_type = ""
        self.done = False
        self.framed = False
        self.active = time.monotonic()
        #: ``read`` refused the answer as larger than its bound (the request's doing).
        self.too_large = False
        self._keep_alive = False
        self._error: BaseException | None = None
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._streaming = False
        self._waiter: asyncio.Future[None] | None = None
        # One timer per answer, re-armed only when it fires early: the
        # longest silence allowed is ``read_s`` (aiohttp's ``sock_read``).
        self._timer: asyncio.TimerHandle | None = pool._loop.call_later(
            pool.read_s, self._check_silence)

    # -- fed by the connection
    def wake(self) -> None:
        w = self._waiter
        if w is not None:
            self._waiter = None
            if not w.done():
                w.set_result(None)

    def feed(self, body: bytes) -> None:
        self._buf.append(body)
        self._buffered += len(body)
        if self._streaming and self._buffered > _HIGH_WATER:
            self._pause()
        self.wake()

    def _pause(self) -> None:
        conn = self._conn
        if not self._paused and conn is not None and conn.transport is not None:
            self._paused = True
            conn.transport.pause_reading()

    def complete(self, keep_alive: bool) -> None:
        self.done = True
        self._keep_alive = keep_alive
        self._stop_timer()
        self.wake()

    def fail(self, exc: BaseException) -> None:
        if self.done:
            return
        self.done = True
        self._error = exc
        self._stop_timer()
        self.wake()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check_silence(self) -> None:
        self._timer = None
        if self.done:
            return
        left = self.active + self._pool.read_s - time.monotonic()
        if left > 0 or self._paused:  # heard from recently, or we are the slow side
            self._timer = self._pool._loop.call_later(max(left, 0.1), self._check_silence)
            return
        self.fail(EffectTimeout(STEP, self._pool.read_s, detail="vLLM sent nothing"))
        conn = self._conn
        if conn is not None:
            conn.abort()

    # -- for the caller
    async def _wait(self) -> None:
        w = self._waiter = self._pool._loop.create_future()
        await w

    def _take(self) -> bytes:
        buf = self._buf
        if len(buf) == 1:
            out = buf.popleft()
        else:
            out = b"".join(buf)
            buf.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            conn = self._conn
            if conn is not None and conn.transport is not None:
                conn.transport.resume_reading()
        return out

    async def read(self, max_bytes: int | None = None) -> bytes:
        """The whole body; raises what broke it off, or ``EngineUnavailable`` once more
        than ``max_bytes`` arrived (the gateway does not hold an unbounded answer)."""
        while not self.done:
            if max_bytes is not None and self._buffered > max_bytes:
                self.too_large = True
                raise EngineUnavailable(STEP, f"vLLM's answer exceeds {max_bytes} bytes")
            await self._wait()
        if self._error is not None:
            raise self._error
        if max_bytes is not None and self._buffered > max_bytes:
            self.too_large = True
            raise EngineUnavailable(STEP, f"vLLM's answer exceeds {max_bytes} bytes")
        return self._take() if self._buf else b""

    async def iter_any(self) -> AsyncIterator[bytes]:
        """The body as it arrives, in whatever pieces vLLM sent (reading pauses while
        more than 1 MiB waits for the caller)."""
        self._streaming = True
        if self._buffered > _HIGH_WATER:
            self._pause()
        while True:
            if self._buf:
                yield self._take()
                continue
            if self.done:
                if self._error is not None:
                    raise self._error
                return
            await self._wait()

    def release(self) -> None:
        """Back to the pool if the answer is complete and the server keeps it open."""
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is None:
            return
        conn.resp = None
        if self.done and self._error is None and self._keep_alive and not self._buf \
                and not conn.closed:
            self._pool._put(conn)
        else:
            self._pool._discard(conn)

    def close(self) -> None:
        """Close the connection (vLLM sees the client gone and aborts the request)."""
        self._stop_timer()
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.resp = None
            self._pool._discard(conn)


class UpstreamPool:
    """Keep-alive connections to one origin (``http`` or ``https``, optional path prefix).

    Made inside the event loop it serves (``asyncio.get_running_loop()``).
    """

    def __init__(self, base_url: str, *, max_connections: int, connect_s: float,
                 pool_s: float, read_s: float, keepalive_s: float) -> None:
        p = urlsplit(base_url)
        if p.scheme not in ("http", "https") or not p.hostname:
            raise BadInput(f"not an http(s) URL: {base_url!r}")
        self._host = p.hostname
        self._port = p.port or (443 if p.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = (ssl.create_default_context()
                                            if p.scheme == "https" else None)
        self._prefix = p.path.rstrip("/").encode()
        self._url = base_url
        self._host_header = p.netloc.rsplit("@", 1)[-1].encode("idna")
        self.max_connections = max_connections
        self.connect_s = connect_s
        self.pool_s = pool_s
        self.read_s = read_s
        self.keepalive_s = keepalive_s
        self._loop = asyncio.get_running_loop()
        self._idle: list[_Conn] = []
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    # -- pool
    def _put(self, conn: _Conn) -> None:
        if self._closed:
            self._discard(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)
        self._notify()

    def _discard(self, conn: _Conn) -> None:
        # ``connection_lost`` does the accounting, once the transport is gone.
        if not conn.closed:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.close()

    def _lost(self, conn: _Conn) -> None:
        self._open -= 1
        if conn in self._idle:
            self._idle.remove(conn)
        self._notify()

    def _notify(self) -> None:
        while self._waiters:
            w = self._waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def _acquire(self) -> _Conn:
        deadline: float | None = None
        while True:
            if self._closed:
                raise EngineUnavailable(STEP, "upstream client closed")
            now = time.monotonic()
            while self._idle:
                conn = self._idle.pop()
                if conn.closed:
                    continue
                if now - conn.idle_since > self.keepalive_s:
                    self._discard(conn)
                    continue
                return conn
            if self._open < self.max_connections:
                return await self._connect()
            if deadline is None:
                deadline = now + self.pool_s
            left = deadline - now
            if left <= 0:
                raise EffectTimeout(STEP, self.pool_s, detail="no upstream connection free")
            w = self._loop.create_future()
            self._waiters.append(w)
            try:
                await asyncio.wait_for(w, left)
            except TimeoutError:
                raise EffectTimeout(STEP, self.pool_s,
                                    detail="no upstream connection free") from None
            except BaseException:
                if w.done() and not w.cancelled():
                    self._notify()  # pass on the turn this waiter was given
                raise

    async def _connect(self) -> _Conn:
        self._open += 1
        try:
            async with asyncio.timeout(self.connect_s):
                _, conn = await self._loop.create_connection(
                    lambda: _Conn(self), self._host, self._port, ssl=self._ssl)
        except OSError as exc:  # a TimeoutError too: transport_error tells them apart
            self._open -= 1
            raise transport_error(exc, STEP, "cannot connect to vLLM", timeout_s=self.connect_s,
                                  connecting=True) from exc
        except BaseException:
            self._open -= 1
            raise
        return conn

    # -- requests
    async def post(self, path: bytes, body: bytes, request_id: bytes) -> UpstreamResponse:
        """Send one JSON POST; returns once the answer's status and headers are in.

        ``request_id`` goes out as ``X-Request-Id``; the caller has checked it
        (the gateway's rollout-id pattern: no spaces or control characters).
        """
        return await self._send(await self._acquire(), path, body, request_id)

    async def _send(self, conn: _Conn, path: bytes, body: bytes,
                    request_id: bytes, extra: bytes = b"", method: bytes = b"POST"
                    ) -> UpstreamResponse:
        resp = UpstreamResponse(self, conn)
        conn.resp = resp
        transport = conn.transport
        assert transport is not None
        transport.write(b"".join((
            method, b" ", self._prefix, path, b" HTTP/1.1\r\nHost: ", self._host_header,
            b"\r\nContent-Type: application/json\r\nAccept-Encoding: identity\r\n"
            b"X-Request-Id: ", request_id, b"\r\n", extra, b"Content-Length: ",
            str(len(body)).encode(), b"\r\n\r\n", body)))
        try:
            while not resp.status and not resp.done:
                await resp._wait()
            if not resp.status:
                assert resp._error is not None
                raise resp._error
        except BaseException:
            resp.close()
            raise
        return resp

    async def call(self, path: bytes, body: bytes, *, timeout_s: float,
                   max_bytes: int = 1 << 20) -> tuple[int, bytes]:
        """One POST of the gateway's own on a connection outside the pool: (status, body).

        Outside the pool's limit, so it is never queued behind the requests it
        is about (aborting stragglers that hold every pooled connection). The
        connection is closed afterwards. Bounded by ``timeout_s`` as a whole.
        """
        if self._closed:
            raise EngineUnavailable(STEP, "upstream client closed")
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._send(await self._connect(), path, body, b"rolloutcore",
                                        self._key_header())
                try:
                    return resp.status, await resp.read(max_bytes)
                finally:
                    resp.close()
        except TimeoutError:
            raise EffectTimeout(STEP, timeout_s, detail=f"POST {path.decode()}") from None

    async def exchange(self, method: str, path: str, body: bytes, *, timeout_s: float,
                       max_bytes: int = 1 << 20) -> tuple[int, bytes]:
        """One request of the gateway's own on a pooled keep-alive connection, with the
        engine's route key (a weight route of a launched engine is closed without it):
        (status, body). ``path`` may carry a query. Bounded by ``timeout_s`` as a whole
        (``EffectTimeout``; the connection is closed, so vLLM sees the client gone); a
        complete answer returns its connection to the pool. For a caller with a pool of
        its own (the native routes' relay), which nothing else can fill."""
        try:
            async with asyncio.timeout(timeout_s):
                resp = await self._send(await self._acquire(), path.encode("latin-1"), body,
                                        b"rolloutcore", self._key_header(),
                                        method.encode("ascii"))
                try:
                    out = resp.status, await resp.read(max_bytes)
                except BaseException:
                    resp.close()
                    raise
                resp.release()
                return out
        except TimeoutError:
            raise EffectTimeout(STEP, timeout_s, detail=f"{method} {path}") from None

    def _key_header(self) -> bytes:
        # The gateway's own calls (the abort route) are closed on an engine RolloutCore
        # launched: they carry its route key. The data routes are open (engine_key).
        hs = engine_key.headers_for(self._url)
        return b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in hs.items())

    async def aclose(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            self._discard(conn)
        for w in self._waiters:
            if not w.done():
                w.cancel()
        self._waiters.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run
