"""A fault-injecting HTTP proxy on loopback, in front of a real vLLM server.

The failure policy is only as good as the failures it has been shown. A real
engine rarely answers 500, hangs, drops a connection or says ``success:
false`` on cue, so this proxy makes it do so, per route, at run time, while
everything else passes through to the real server untouched::

    controller / transport / rollouts  --HTTP-->  FaultProxy  --HTTP-->  vLLM
                                                   |
                                   inject("/update_weights", Fault.status(500))

Faults (``FaultKind``):

* ``status``: answer an HTTP status (default 500) with a vLLM-shaped error
  body. With ``upstream=True`` the request is forwarded first (the engine
  acted; the answer is lost), otherwise the engine never sees it.
* ``delay``: hold the request ``delay_s`` (long past any deadline). With
  ``upstream=True`` (default) the request is forwarded at once and only the
  answer is held, the nastiest case: the effect happened, its answer is late.
  With ``upstream=False`` it is forwarded after the delay, and only if the
  client is still connected.
* ``close``: send the response head and cut the connection before the body
  (the client sees the peer close mid-response). ``upstream`` as for status.
* ``swallow``: answer an empty 200 without forwarding, as vLLM's
  ``/reset_encoder_cache`` answers whatever happened: a silent no-op.
* ``engine_failure``: forward, then rewrite a 2xx JSON object body to
  ``"success": false`` (an empty body becomes ``{"success": false}``): HTTP
  200, engine-level failure, as ``/reset_prefix_cache`` says when blocks are
  still held.

Each rule matches one route (the path without query, or ``"*"``) and
optionally one method, skips its first ``skip`` matches and applies at most
``times`` times (``None``: until cleared). Every application is logged as a
``FaultHit`` with its monotonic time, so a test can measure how long the
controller took to classify the fault it caused.

The proxy is a plain ASGI app (Starlette's request and response helpers)
served by uvicorn on a daemon thread with its own event loop; the upstream
client is ``httpx.AsyncClient`` with a timeout on every request. ``inject``,
``clear`` and the hit log are thread-safe. Nothing here knows about vLLM's
semantics beyond the shape of an error body: the proxy is a tool for tests
and the soak, not part of the control plane.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rolloutcore.core.records import fields_dict
from rolloutcore.engine.errors import map_errors
from rolloutcore.errors import BadInput, EffectError, EffectTimeout, EngineUnavailable
from rolloutcore.transports.base import check_url

if TYPE_CHECKING:  # the service extra; imported where the proxy starts
    import httpx
    import uvicorn
    from starlette.requests import Request

__all__ = ["Fault", "FaultHit", "FaultKind", "FaultProxy", "Rule"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Any]
Send = Callable[[Message], Any]

_HOP = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                  b"upgrade", b"proxy-connection", b"host", b"content-length"})
_HOP_RESPONSE = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te",
                           b"trailer", b"upgrade", b"proxy-connection"})

#: Set while the proxy cuts a connection on purpose, so that uvicorn's
#: "returned without completing response" error for it is not logged.
_CUTTING: contextvars.ContextVar[bool] = contextvars.ContextVar("rolloutcore_faultproxy_cut",
                                                                 default=False)


class _QuietCut(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not _CUTTING.get()


_FILTER = _QuietCut()


class FaultKind(enum.StrEnum):
    STATUS = "status"
    DELAY = "delay"
    CLOSE = "close"
    ENGINE_FAILURE = "engine_failure"
    SWALLOW = "swallow"


def _positive(name: str, v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf"):
        raise BadInput(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


@dataclass(frozen=True)
class Fault:
    """What to do to a matching request. Build with the class methods."""

    kind: FaultKind
    status: int = 500
    delay_s: float = 3600.0
    upstream: bool = False
    body: str = "injected fault"

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise BadInput(f"kind must be a FaultKind, got {self.kind!r}")
        if isinstance(self.status, bool) or not isinstance(self.status, int) or not (
                100 <= self.status <= 599):
            raise BadInput(f"status must be an HTTP status code, got {self.status!r}")
        _positive("delay_s", self.delay_s)
        if self.kind is FaultKind.ENGINE_FAILURE and not self.upstream:
            raise BadInput("engine_failure rewrites the engine's answer: it needs upstream=True")
        if self.kind is FaultKind.SWALLOW and self.upstream:
            raise BadInput("swallow never forwards: it needs upstream=False")

    @classmethod
    def http_status(cls, status: int = 500, *, upstream: bool = False,
                    body: str = "injected fault") -> Fault:
        return cls(FaultKind.STATUS, status=status, upstream=upstream, body=body)

    @classmethod
    def delay(cls, delay_s: float = 3600.0, *, upstream: bool = True) -> Fault:
        return cls(FaultKind.DELAY, delay_s=delay_s, upstream=upstream)

    @classmethod
    def close(cls, *, upstream: bool = False) -> Fault:
        return cls(FaultKind.CLOSE, upstream=upstream)

    @classmethod
    def engine_failure(cls) -> Fault:
        return cls(FaultKind.ENGINE_FAILURE, upstream=True)

    @classmethod
    def swallow(cls) -> Fault:
        """An empty 200 without forwarding: the engine never acts, the client sees success.

        What ``/reset_encoder_cache`` and ``/reset_mm_cache`` answer whatever
        happened: a reset that silently did nothing looks exactly like this.
        """
        return cls(FaultKind.SWALLOW, status=200, upstream=False)

    def describe(self) -> str:
        where = "after forwarding" if self.upstream else "without forwarding"
        if self.kind is FaultKind.STATUS:
            return f"HTTP {self.status} {where}"
        if self.kind is FaultKind.DELAY:
            return f"hold {self.delay_s:g}s ({'answer' if self.upstream else 'request'})"
        if self.kind is FaultKind.CLOSE:
            return f"connection cut {where}"
        if self.kind is FaultKind.SWALLOW:
            return "empty 200 without forwarding"
        return "2xx rewritten to success=false"


@dataclass
class Rule:
    """One programmed fault. ``applied`` counts its applications so far."""

    route: str
    fault: Fault
    method: str | None = None
    times: int | None = None
    skip: int = 0
    seen: int = 0
    applied: int = 0

    def matches(self, method: str, path: str) -> bool:
        return (self.route in ("*", path)) and (self.method is None or self.method == method)

    @property
    def exhausted(self) -> bool:
        return self.times is not None and self.applied >= self.times


@dataclass(frozen=True)
class FaultHit:
    """One application of a fault: when (monotonic and wall), to which request."""

    route: str
    method: str
    kind: FaultKind
    t_mono: float
    t_wall: float
    detail: str = ""
    upstream_status: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


@dataclass
class _State:
    rules: list[Rule] = field(default_factory=list)
    hits: list[FaultHit] = field(default_factory=list)
    requests: dict[str, int] = field(default_factory=dict)


class FaultProxy:
    """Forwards everything to ``upstream``, except what a rule says to break.

    Use as a context manager (or ``start()``/``stop()``); ``base_url`` is
    the proxy's own URL, to give the adapter, the transport and rollouts in
    place of the engine's.
    """

    def __init__(self, upstream: str, *, host: str = "127.0.0.1",
                 upstream_timeout_s: float = 600.0, start_timeout_s: float = 10.0) -> None:
        self._upstream = check_url(upstream, "upstream")
        self.host = host
        self.upstream_timeout_s = _positive("upstream_timeout_s", upstream_timeout_s)
        self.start_timeout_s = _positive("start_timeout_s", start_timeout_s)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._st = _State()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------ control
    @property
    def upstream(self) -> str:
        with self._lock:
            return self._upstream

    def set_upstream(self, url: str) -> None:
        """Point at another server (an engine restarted on another port)."""
        u = check_url(url, "upstream")
        with self._lock:
            self._upstream = u

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise BadInput("the proxy is not started")
        return f"http://{self.host}:{self._port}"

    def inject(self, route: str, fault: Fault, *, method: str | None = None,
               times: int | None = None, skip: int = 0) -> Rule:
        """Break requests to ``route`` (path without query, or ``"*"``) from now on."""
        if not isinstance(route, str) or not (route == "*" or route.startswith("/")):
            raise BadInput(f"route must be a path starting with '/' or '*', got {route!r}")
        if not isinstance(fault, Fault):
            raise BadInput("fault must be a Fault")
        if method is not None and (not isinstance(method, str) or not method.isalpha()):
            raise BadInput(f"method must be an HTTP method name, got {method!r}")
        for name, v in (("times", times), ("skip", skip)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise BadInput(f"{name} must be an int >= 0, got {v!r}")
        rule = Rule(route, fault, None if method is None else method.upper(), times, skip)
        with self._lock:
            self._st.rules.append(rule)
        return rule

    def clear(self, route: str | None = None) -> None:
        """Remove every rule (or those for ``route``); held requests stay held."""
        with self._lock:
            self._st.rules = [r for r in self._st.rules
                              if route is not None and r.route != route]

    def reset(self) -> None:
        """Remove every rule and forget the hit log and request counts."""
        with self._lock:
            self._st = _State()

    @property
    def rules(self) -> list[Rule]:
        with self._lock:
            return list(self._st.rules)

    @property
    def hits(self) -> list[FaultHit]:
        with self._lock:
            return list(self._st.hits)

    def requests(self, route: str | None = None) -> int:
        """Requests seen (all, or to ``route``), faulted or not."""
        with self._lock:
            if route is None:
                return sum(self._st.requests.values())
            return self._st.requests.get(route, 0)

    def wait_hit(self, route: str | None = None, *, timeout_s: float,
                 after: int = 0) -> FaultHit:
        """Block until a fault (on ``route``) has been applied; ``after``: skip that many."""
        t = _positive("timeout_s", timeout_s)
        deadline = time.monotonic() + t
        with self._changed:
            while True:
                hits = [h for h in self._st.hits if route is None or h.route == route]
                if len(hits) > after:
                    return hits[after]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EffectTimeout("faultproxy", t, mutation_started=False)
                self._changed.wait(left)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> FaultProxy:
        import uvicorn

        if self._thread is not None:
            raise BadInput("the proxy is already started")
        logging.getLogger("uvicorn.error").addFilter(_FILTER)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self._sock = sock
        self._port = int(sock.getsockname()[1])
        cfg = uvicorn.Config(self._app, interface="asgi3", log_level="warning", lifespan="on",
                             access_log=False,
                             timeout_graceful_shutdown=1)
        self._server = uvicorn.Server(cfg)
        th = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                              name="rolloutcore-faultproxy", daemon=True)
        self._thread = th
        th.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not th.is_alive():
                self.stop()
                raise EngineUnavailable("faultproxy", "the proxy's uvicorn did not start",
                                        mutation_started=False)
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Release held requests, stop uvicorn (bounded), close the socket. Idempotent."""
        loop, ev = self._loop, self._stopping
        if loop is not None and ev is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(ev.set)
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(15)
        if self._sock is not None:
            self._sock.close()
        self._thread = self._server = self._sock = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        where = f"on :{self._port}" if self._port is not None else "stopped"
        return f"FaultProxy({where} -> {self._upstream}, {len(self.rules)} rules)"

    # ------------------------------------------------------------ ASGI
    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        from rolloutcore.engine.client import AsyncEngineClient

        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                self._stopping = asyncio.Event()
                self._client = AsyncEngineClient(timeout_s=self.upstream_timeout_s).http
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._stopping is not None:
                    self._stopping.set()
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _match(self, method: str, path: str) -> tuple[Rule | None, str]:
        with self._lock:
            self._st.requests[path] = self._st.requests.get(path, 0) + 1
            upstream = self._upstream
            for r in self._st.rules:
                if r.exhausted or not r.matches(method, path):
                    continue
                r.seen += 1
                if r.seen <= r.skip:
                    continue
                r.applied += 1
                return r, upstream
            return None, upstream

    def _hit(self, rule: Rule, method: str, path: str, detail: str = "",
             upstream_status: int | None = None) -> None:
        hit = FaultHit(path, method, rule.fault.kind, time.monotonic(), time.time(), detail,
                       upstream_status)
        with self._changed:
            self._st.hits.append(hit)
            self._changed.notify_all()

    async def _hold(self, seconds: float) -> None:
        """Sleep, but wake at once when the proxy stops."""
        ev = self._stopping
        if ev is None:
            await asyncio.sleep(seconds)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ev.wait(), seconds)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        from starlette.requests import Request

        req = Request(scope, receive)
        method, path = req.method, req.url.path
        body = await req.body()
        rule, upstream = self._match(method, path)
        fault = None if rule is None else rule.fault
        if rule is None or fault is None:
            await self._forward(req, body, upstream, send, stream=True)
            return
        if fault.kind is FaultKind.DELAY and not fault.upstream:
            self._hit(rule, method, path, fault.describe())
            await self._hold(fault.delay_s)
            if await req.is_disconnected():
                return  # the client gave up: the engine never sees the request
            await self._forward(req, body, upstream, send, stream=True)
            return
        if fault.kind is FaultKind.DELAY:
            status, held_headers, held = await self._fetch(req, body, upstream)
            self._hit(rule, method, path, fault.describe(), status)
            await self._hold(fault.delay_s)
            await self._respond(send, status, held_headers, held)
            return
        if fault.kind is FaultKind.SWALLOW:
            self._hit(rule, method, path, fault.describe())
            await self._respond(send, 200, [], b"")
            return
        upstream_status: int | None = None
        content = b""
        headers: list[tuple[bytes, bytes]] = []
        if fault.upstream:
            upstream_status, headers, content = await self._fetch(req, body, upstream)
        if fault.kind is FaultKind.STATUS:
            self._hit(rule, method, path, fault.describe(), upstream_status)
            err = {"error": {"message": fault.body, "type": "InternalServerError",
                             "code": fault.status}}
            await self._respond(send, fault.status, [(b"content-type", b"application/json")],
                                json.dumps(err).encode())
        elif fault.kind is FaultKind.CLOSE:
            self._hit(rule, method, path, fault.describe(), upstream_status)
            _CUTTING.set(True)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", b"4096")]})
            # Returning with the body incomplete: uvicorn closes the connection.
        else:  # ENGINE_FAILURE
            new = _rewrite_failure(upstream_status, content)
            self._hit(rule, method, path, fault.describe(), upstream_status)
            if new is not None:
                headers = [(k, v) for k, v in headers if k != b"content-type"]
                headers.append((b"content-type", b"application/json"))
                content = new
            await self._respond(send, upstream_status or 502, headers, content)

    async def _send(self, req: Request, body: bytes, upstream: str, *, stream: bool = False
                    ) -> httpx.Response:
        """``req`` sent on to ``upstream``; ``EffectError`` when the engine cannot be
        reached."""
        assert self._client is not None, "made at the lifespan's startup, before a request"
        hdrs = [(k, v) for k, v in req.headers.raw if k.lower() not in _HOP]
        url = upstream + req.url.path + (f"?{req.url.query}" if req.url.query else "")
        with map_errors("faultproxy", req.url.path, timeout_s=self.upstream_timeout_s):
            return await self._client.send(
                self._client.build_request(req.method, url, headers=hdrs, content=body),
                stream=stream)

    async def _fetch(self, req: Request, body: bytes, upstream: str
                     ) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        try:
            r = await self._send(req, body, upstream)
        except EffectError as exc:
            return _bad_gateway(exc)
        hdrs = [(k, v) for k, v in r.headers.raw
                if k.lower() not in _HOP_RESPONSE and k.lower() != b"content-length"]
        return r.status_code, hdrs, r.content

    async def _forward(self, req: Request, body: bytes, upstream: str, send: Send, *,
                       stream: bool) -> None:
        """Pass-through, streamed: a 502 when the engine cannot be reached."""
        try:
            r = await self._send(req, body, upstream, stream=stream)
        except EffectError as exc:
            await self._respond(send, *_bad_gateway(exc))
            return
        try:
            hdrs = [(k, v) for k, v in r.headers.raw if k.lower() not in _HOP_RESPONSE]
            await send({"type": "http.response.start", "status": r.status_code,
                        "headers": hdrs})
            try:
                with map_errors("faultproxy", req.url.path, timeout_s=self.upstream_timeout_s):
                    async for chunk in r.aiter_raw():
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
            except EffectError:
                # The engine cut its answer: cut ours too, as it did.
                _CUTTING.set(True)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await r.aclose()

    @staticmethod
    async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]],
                       content: bytes) -> None:
        hdrs = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        hdrs.append((b"content-length", str(len(content)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": hdrs})
        await send({"type": "http.response.body", "body": content, "more_body": False})


def _bad_gateway(exc: EffectError) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The 502 a client gets when the engine cannot be reached."""
    return 502, [(b"content-type", b"application/json")], json.dumps(
        {"error": {"message": f"faultproxy: upstream failed: {exc.__cause__!r}",
                   "type": "BadGateway", "code": 502}}).encode()


def _rewrite_failure(status: int | None, content: bytes) -> bytes | None:
    """A 2xx body with ``success`` forced to false; ``None`` leaves it alone."""
    if status is None or not 200 <= status < 300:
        return None
    text = content.strip()
    if not text:
        return json.dumps({"success": False}).encode()
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    obj["success"] = False
    return json.dumps(obj).encode()

