"""The data plane: OpenAI-style and token-in/token-out requests, forwarded to vLLM.

Every request is a rollout of the lifecycle controller::

    read + validate body -> admit (bound to the committed version)
        -> forward to vLLM (streaming or not) -> relay the answer
        -> release the binding (always: finished, client gone, upstream broken)

The binding is what makes a response attributable: admission happens only in
READY, and an update cannot begin while any binding is held (the runner
drains first), so everything a bound request receives was computed by the
version it was bound to. The answer carries that version twice: in the
``X-RolloutCore-Version`` header (and its siblings) and in a body field
``rolloutcore`` (a JSON response's top level; the first event of an SSE
stream).

A response is never cut off silently. If vLLM's stream breaks, or ends
without its ``data: [DONE]`` terminator, the client gets an ``error`` event
(vLLM's own shape for mid-stream errors) and then ``[DONE]``; a client that
goes away has its upstream request closed at once, which makes vLLM abort
it, and its binding released, so a drain is never held up by a dead client.

This module is a plain ASGI application rather than Starlette endpoints: the
gateway's added latency is its main cost, and the request/response wrappers
are not needed to move bytes. For the same reason the upstream client is the
gateway's own (``upstream``: a keep-alive pool to the one vLLM, answers
parsed by httptools): measured against a real vLLM it spends well under
half the CPU per request of aiohttp's, which was the largest share of the
gateway's cost (docs/service.md, "What the gateway costs").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import anyio

from rolloutcore.core.lifecycle import Binding, LifecycleController, State
from rolloutcore.core.media import MediaError
from rolloutcore.core.records import Record, Transition
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    EffectError,
    EffectTimeout,
    InvalidTransition,
    RequestTooLarge,
)
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.images import inspect_media
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.service.salting import check_client_salt, salted_body
from rolloutcore.service.upstream import UpstreamPool, UpstreamResponse

__all__ = [
    "BODY_FIELD",
    "DATA_ROUTES",
    "READ_ONLY_ROUTES",
    "GENERATION_HEADER",
    "IDENTITY_HEADER",
    "ROLLOUT_HEADER",
    "VERSION_HEADER",
    "DataPlane",
    "FinishedRequest",
    "ReadOnlyRoutes",
    "read_body",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DATA_ROUTES = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate")
#: vLLM's read-only routes that OpenAI-style clients ask before (or besides)
#: generating (the OpenAI SDK, TRL and vLLM's own benchmark list ``/v1/models``
#: first), with their one method. They read no weights, so they are passed
#: through without admission or binding, during updates too. The dev and control
#: routes (``/pause``, ``/update_weights``, ``/collective_rpc``, ``/server_info``,
#: ...) are never among them: only the gateway changes the engine.
READ_ONLY_ROUTES: Mapping[str, str] = MappingProxyType({
    "/v1/models": "GET", "/version": "GET", "/tokenizer_info": "GET",
    "/tokenize": "POST", "/detokenize": "POST"})
VERSION_HEADER = "x-rolloutcore-version"
GENERATION_HEADER = "x-rolloutcore-generation"
IDENTITY_HEADER = "x-rolloutcore-identity"
ROLLOUT_HEADER = "x-rolloutcore-rollout-id"
BODY_FIELD = "rolloutcore"

_ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
#: Upstream response headers that describe the upstream connection, not the answer.
_HOP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
                  b"date", b"server", b"content-encoding", b"x-request-id"})
_DONE = b"data: [DONE]"
_ROLLOUT_HEADER_B = ROLLOUT_HEADER.encode()
_MAX_FIRST_EVENT = 1 << 20
_MEDIA_KIND = {400: "BadRequest", 413: "PayloadTooLarge", 415: "UnsupportedMediaType"}


class _ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int, content_length: bytes | None) -> bytes:
    """The whole request body, refused as soon as it is known to exceed ``limit``."""
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadInput("Content-Length is not an integer") from None
        if declared > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    msg = await receive()
    if msg["type"] == "http.disconnect":
        raise _ClientGone
    body = msg.get("body", b"")
    if len(body) > limit:
        raise RequestTooLarge(f"request body exceeds {limit} bytes")
    if not msg.get("more_body", False):  # the usual case: the whole body at once
        return bytes(body)
    chunks = [body]
    n = len(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise _ClientGone
        body = msg.get("body", b"")
        n += len(body)
        if n > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(body)
        if not msg.get("more_body", False):
            return b"".join(chunks)


_WANTED = frozenset({b"authorization", b"content-type", b"content-length", _ROLLOUT_HEADER_B})


def _headers_of_interest(scope: Scope) -> dict[bytes, bytes]:
    """The request headers the data plane reads, first occurrence of each, in one pass."""
    out: dict[bytes, bytes] = {}
    for k, v in scope["headers"]:
        if k in _WANTED and k not in out:
            out[k] = bytes(v)
    return out


async def send_json(send: Send, status: int, obj: Any,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def error_body(status: int, message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """vLLM's (OpenAI's) error shape, so existing clients read it."""
    out: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if extra:
        out[BODY_FIELD] = extra
    return out


@dataclass(slots=True)
class FinishedRequest:
    """What the data plane saw of one request, handed to the optional recorder."""

    route: str
    binding: Binding
    request: dict[str, Any]
    status: int
    ending: str                         # complete | client_disconnect | upstream_error
    response: dict[str, Any] | None = None            # a JSON answer
    events: list[dict[str, Any]] = field(default_factory=list)  # an SSE answer's events
    seconds: float = 0.0
    #: The request's ``x-rolloutcore-*`` headers (names lower-case).
    headers: dict[str, str] = field(default_factory=dict)
    admitted_wall: float = 0.0
    admitted_mono: float = 0.0
    completed_wall: float = 0.0
    completed_mono: float = 0.0
    released: bool = field(default=False, repr=False)
    #: The request's images, described (``core.media.ImageRef``), in request order.
    media: tuple[Any, ...] = ()
    #: The version salt the request was forwarded with (``service.salting``), if any.
    cache_salt: str | None = None


class _SseRelay:
    """Passes an SSE stream through, adding the version field to its first event.

    Only the first event is parsed; after it the bytes flow untouched and only
    a short tail is kept, to tell a complete stream (``data: [DONE]``) from a
    truncated one. With ``collect`` every event is parsed (for the recorder).
    """

    def __init__(self, info: dict[str, Any], collect: bool) -> None:
        self._info = info
        self._buf = bytearray()
        self._first_done = False
        self._tail = b""
        self._collect = collect
        self._cbuf = bytearray()
        self.events: list[dict[str, Any]] = []

    def _keep(self, out: bytes) -> bytes:
        self._tail = (self._tail + out)[-64:]
        if self._collect:
            self._cbuf += out
            while (i := self._cbuf.find(b"\n\n")) >= 0:
                ev = bytes(self._cbuf[:i])
                del self._cbuf[:i + 2]
                if ev.startswith(b"data:") and ev[5:].strip() != b"[DONE]":
                    try:
                        obj = json.loads(ev[5:])
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self.events.append(obj)
        return out

    def _inject(self, ev: bytes) -> bytes:
        payload = ev[5:].lstrip() if ev.startswith(b"data:") else b""
        if payload.startswith(b"{"):
            out = splice_field(payload, _dumps(self._info))
            if out is not None:
                return b"data: " + out
        # Not a JSON event (an empty stream's [DONE], a comment): put the
        # version in an event of its own in front of it.
        return b"data: " + _dumps({BODY_FIELD: self._info}) + b"\n\n" + ev

    def feed(self, chunk: bytes) -> bytes:
        if self._first_done:
            return self._keep(chunk)
        self._buf += chunk
        i = self._buf.find(b"\n\n")
        if i < 0:
            if len(self._buf) > _MAX_FIRST_EVENT:  # not SSE as we know it: pass through
                self._first_done = True
                out = bytes(self._buf)
                self._buf.clear()
                return self._keep(out)
            return b""
        first = bytes(self._buf[:i])
        rest = bytes(self._buf[i + 2:])
        self._buf.clear()
        self._first_done = True
        return self._keep(self._inject(first) + b"\n\n" + rest)

    def flush(self) -> bytes:
        """Whatever is still held back (a stream that ended inside its first event)."""
        out = bytes(self._buf)
        self._buf.clear()
        return self._keep(out) if out else b""

    @property
    def complete(self) -> bool:
        return self._tail.rstrip(b"\r\n").endswith(_DONE)

    def error_tail(self, message: str) -> bytes:
        ev = error_body(502, message, "UpstreamError", **self._info)
        out = b""
        if self._tail and not self._tail.endswith(b"\n\n"):
            out += b"\n\n"  # close a torn event so the error parses on its own
        out += b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
        return self._keep(out + _DONE + b"\n\n")


class _VersionView:
    """A version's answer decorations: body field (less the rollout id) and headers."""

    __slots__ = ("headers", "identity", "info", "info_head", "version")

    def __init__(self, b: Binding) -> None:
        self.version = b.version
        self.identity = b.identity
        digest = b.identity.digest
        self.info: dict[str, Any] = {
            "version": b.version.label, "generation": b.version.generation,
            "engine_epoch": b.version.engine_epoch, "identity_digest": digest}
        # The serialized body field up to the rollout id, which is all that
        # differs between this version's answers (ids match _ROLLOUT_ID: no
        # character needs escaping in JSON).
        self.info_head = _dumps({**self.info, "rollout_id": ""})[:-2]
        self.headers = ((VERSION_HEADER.encode(), b.version.label.encode()),
                        (GENERATION_HEADER.encode(), str(b.version.generation).encode()),
                        (IDENTITY_HEADER.encode(), digest.encode()))


def _rid(b: Binding) -> str:
    """The rollout id of a binding the controller handed out (admission always names one)."""
    rid = b.rollout_id
    assert rid is not None
    return rid


class DataPlane:
    """ASGI app of the three data routes. ``start``/``aclose`` manage the upstream client."""

    def __init__(self, controller: LifecycleController, config: ServiceConfig,
                 metrics: ServiceMetrics, *,
                 on_finished: Callable[[FinishedRequest], None] | None = None) -> None:
        self.controller = controller
        self.config = config
        self.metrics = metrics
        self._on_finished = on_finished
        self.upstream: UpstreamPool | None = None
        self._paths = {r: r.encode() for r in DATA_ROUTES}
        self._vview: _VersionView | None = None
        # Metric children, looked up once (``labels()`` hashes and locks).
        self._requests: dict[tuple[str, int], Any] = {}
        self._seconds = {r: metrics.request_seconds.labels(r) for r in DATA_ROUTES}
        self._endings = {e: metrics.stream_endings.labels(e)
                         for e in ("complete", "client_disconnect", "upstream_error")}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._waiting = 0
        controller.add_listener(self._record)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        cfg = self.config
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        # One pool towards one fixed origin. Deadlines: ``connect_s`` for a new
        # connection, ``pool_s`` for waiting on a full pool, ``read_s`` for
        # the longest silence while the answer is read. Idle connections are
        # dropped before vLLM's own keep-alive (5 s) would, so a request is
        # never written into a connection the server is closing (a POST is
        # not retried). No cookies, no redirects, no decompression.
        self.upstream = UpstreamPool(
            cfg.upstream_url, max_connections=cfg.upstream_max_connections,
            connect_s=cfg.upstream_connect_s, pool_s=cfg.upstream_read_s,
            read_s=cfg.upstream_read_s, keepalive_s=cfg.upstream_keepalive_s)

    async def aclose(self) -> None:
        if self.upstream is not None:
            await self.upstream.aclose()
            self.upstream = None

    @property
    def waiting(self) -> int:
        return self._waiting

    def _record(self, rec: Record) -> None:
        """Controller listener (any thread): wake queued requests on every transition."""
        loop = self._loop
        if type(rec) is Transition and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        if ev is not None:
            ev.set()

    # ------------------------------------------------------------ admission
    async def _admit(self, rollout_id: str) -> Binding:
        """Admit now, or (queue configured) wait for the update to end, bounded."""
        cfg = self.config
        try:
            return self.controller.admit(rollout_id)
        except AdmissionRefused as exc:
            if exc.retry_after_s is None or cfg.queue_max == 0 or self._waiting >= cfg.queue_max:
                raise
        self._waiting += 1
        deadline = time.monotonic() + cfg.queue_wait_s
        try:
            while True:
                changed = self._changed
                assert changed is not None
                left = deadline - time.monotonic()
                # Ask again only when it can change the answer (READY, or a final
                # TAINTED) or at the deadline, so a queued request leaves one
                # refusal in the journal, not one per transition of the update.
                if self.controller.state in (State.READY, State.TAINTED) or left <= 0:
                    try:
                        b = self.controller.admit(rollout_id)
                    except AdmissionRefused as exc:
                        if exc.retry_after_s is None or left <= 0:
                            self.metrics.queued.labels(
                                "timeout" if left <= 0 else "refused").inc()
                            raise
                    else:
                        self.metrics.queued.labels("admitted").inc()
                        return b
                with anyio.move_on_after(max(0.0, left)):
                    await changed.wait()
        finally:
            self._waiting -= 1

    def _view(self, b: Binding) -> _VersionView:
        """What every answer of ``b``'s version carries, built once per version.

        The identity digest is a hash over the identity's JSON; recomputing it
        (and the headers) for every request was a measurable share of the
        gateway's own path.
        """
        v = self._vview
        if v is None or v.version is not b.version or v.identity is not b.identity:
            v = self._vview = _VersionView(b)
        return v

    def info(self, b: Binding) -> dict[str, Any]:
        """The ``rolloutcore`` body field of ``b``'s answer."""
        return {**self._view(b).info, "rollout_id": b.rollout_id}

    def info_json(self, b: Binding) -> bytes:
        """``info(b)`` serialized (the same bytes ``json.dumps`` makes of it)."""
        return self._view(b).info_head + _rid(b).encode() + b'"}'

    def version_headers(self, b: Binding) -> list[tuple[bytes, bytes]]:
        return [*self._view(b).headers, (_ROLLOUT_HEADER_B, _rid(b).encode())]

    def _count(self, route: str, status: int) -> None:
        key = (route, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.metrics.requests.labels(route, str(status))
        child.inc()

    # ------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"]
        status = await self._handle(scope, receive, send, route)
        self._count(route, status)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: str) -> int:
        cfg = self.config
        if scope["method"] != "POST":
            await send_json(send, 405, error_body(405, "use POST", "MethodNotAllowed"),
                            [(b"allow", b"POST")])
            return 405
        hdrs = _headers_of_interest(scope)
        auth = check_bearer(hdrs.get(b"authorization"), cfg.data_token)
        if not auth.ok:
            assert auth.status is not None
            await send_json(send, auth.status, error_body(auth.status, auth.reason,
                                                          "Unauthorized"),
                            [(b"www-authenticate", b"Bearer")])
            return auth.status
        ctype = hdrs.get(b"content-type", b"")
        if ctype.split(b";")[0].strip().lower() != b"application/json":
            await send_json(send, 415, error_body(415, "Content-Type must be application/json",
                                                  "UnsupportedMediaType"))
            return 415
        try:
            raw = await read_body(receive, cfg.max_body_bytes, hdrs.get(b"content-length"))
        except RequestTooLarge:
            await send_json(send, 413, error_body(
                413, f"request body exceeds {cfg.max_body_bytes} bytes", "PayloadTooLarge"))
            return 413
        except _ClientGone:
            return 499
        except BadInput as exc:
            await send_json(send, 400, error_body(400, str(exc), "BadRequest"))
            return 400
        problem, payload = _validate(raw)
        if problem:
            await send_json(send, 400, error_body(400, problem, "BadRequest"))
            return 400
        try:  # images: checked and described before anything is admitted
            media = inspect_media(route, payload, cfg.media)
        except MediaError as exc:
            await send_json(send, exc.status, error_body(exc.status, str(exc),
                                                         _MEDIA_KIND[exc.status]))
            return exc.status
        rid_h = hdrs.get(_ROLLOUT_HEADER_B)
        # 128 random bits, the same "r-" + 32 hex digits a uuid4 gave, without
        # the UUID object.
        rid = rid_h.decode("latin-1") if rid_h is not None else f"r-{os.urandom(16).hex()}"
        if not _ROLLOUT_ID.match(rid):
            await send_json(send, 400, error_body(
                400, f"{ROLLOUT_HEADER} must match {_ROLLOUT_ID.pattern}", "BadRequest"))
            return 400
        try:
            binding = await self._admit(rid)
        except AdmissionRefused as exc:
            # ``x-should-retry`` is what OpenAI's SDKs obey before their own status
            # rules: retry an update's refusal, never a tainted engine's.
            retry = [(b"x-should-retry", b"false" if exc.retry_after_s is None else b"true")]
            if exc.retry_after_s is not None:
                retry.append((b"retry-after", str(max(1, math.ceil(exc.retry_after_s))).encode()))
            await send_json(send, 503, error_body(503, str(exc), "ServiceUnavailable",
                                                  state=exc.state,
                                                  retry_after_s=exc.retry_after_s), retry)
            return 503
        except BadInput as exc:  # the rollout id is already active
            await send_json(send, 409, error_body(409, str(exc), "Conflict"))
            return 409
        t0 = time.monotonic()
        fin = FinishedRequest(route, binding, payload, 502, "upstream_error",
                              admitted_wall=time.time(), admitted_mono=t0, media=media)
        if cfg.salt_prefix_cache:  # no block computed by another version is reused
            raw, fin.cache_salt = salted_body(raw, payload, binding)
        if self._on_finished is not None:
            fin.headers = {k.decode("latin-1"): v.decode("latin-1")
                           for k, v in scope["headers"] if k.startswith(b"x-rolloutcore-")}
        try:
            await self._forward(scope, receive, send, route, raw, binding, fin)
        finally:
            self._release(fin)
            fin.seconds = time.monotonic() - t0
            self._seconds[route].observe(fin.seconds)
            self._endings[fin.ending].inc()
        if self._on_finished is not None:
            self._on_finished(fin)
        return fin.status

    def _release(self, fin: FinishedRequest) -> None:
        """Release the binding once: when the last byte from vLLM is in hand, or at the end.

        Released *before* the final send: everything the client is still to
        receive was computed already, so an update may begin while it is on
        the wire, and a client that reads its answer and then asks for an
        update never waits on its own request.
        """
        if fin.released:
            return
        fin.released = True
        fin.completed_mono, fin.completed_wall = time.monotonic(), time.time()
        with contextlib.suppress(BadInput, InvalidTransition):
            self.controller.complete(_rid(fin.binding))

    async def _forward(self, scope: Scope, receive: Receive, send: Send, route: str,
                       raw: bytes, binding: Binding, fin: FinishedRequest) -> None:
        """Relay one admitted request while watching for the client going away.

        Plain asyncio rather than an anyio task group: the group's cancel
        scope machinery cost more than the rest of the gateway's own path.
        The watcher can only run while this task is suspended in an await, so
        its ``cancel()`` is always delivered there, as a ``CancelledError``
        that is consumed below (``uncancel``); a cancellation from anyone
        else (server shutdown) still propagates.
        """
        state = {"finishing": False, "gone": False}
        task = asyncio.current_task()
        assert task is not None

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not state["finishing"]:
                        fin.ending = "client_disconnect"
                        fin.status = 499
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._relay(send, route, raw, binding, fin, state)
        except asyncio.CancelledError:
            if not state["gone"] or task.uncancel() > 0:
                raise
        finally:
            watcher.cancel()

    def _finishing(self, state: dict[str, bool], fin: FinishedRequest) -> None:
        state["finishing"] = True
        self._release(fin)

    async def _relay(self, send: Send, route: str, raw: bytes, binding: Binding,
                     fin: FinishedRequest, state: dict[str, bool]) -> None:
        upstream = self.upstream
        if upstream is None:
            raise RuntimeError("data plane not started")
        vh = self.version_headers(binding)
        try:
            resp = await upstream.post(self._paths[route], raw, _rid(binding).encode())
        except EffectTimeout as exc:
            fin.status = 504
            self._finishing(state, fin)
            await send_json(send, 504, error_body(504, f"vLLM did not answer in time: {exc!r}",
                                                  "UpstreamTimeout", **self.info(binding)), vh)
            return
        except EffectError as exc:  # EngineUnavailable, EngineUnreachable
            fin.status = 502
            self._finishing(state, fin)
            await send_json(send, 502, error_body(502, f"vLLM unreachable: {exc!r}",
                                                  "UpstreamError", **self.info(binding)),
                            vh)
            return
        try:
            headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in _HOP]
            fin.status = resp.status
            if resp.content_type == "text/event-stream":
                await self._relay_stream(send, resp, headers + vh, self.info(binding), fin,
                                         state)
            else:
                try:
                    body = await resp.read()
                except EffectError as exc:
                    fin.status = 502
                    self._finishing(state, fin)
                    await send_json(send, 502, error_body(
                        502, f"vLLM answer broke off: {exc!r}", "UpstreamError",
                        **self.info(binding)), vh)
                    return
                if self._on_finished is None:
                    out = splice_field(body, self.info_json(binding))
                    body, obj = (body if out is None else out), None
                else:
                    body, obj = _inject_json(body, self.info(binding))
                fin.response = obj
                fin.ending = "complete"
                headers = headers + vh + [(b"content-length", str(len(body)).encode())]
                self._finishing(state, fin)
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            # A whole answer has already gone back to the pool; anything else
            # (client gone, upstream broken) closes the connection, which is
            # what makes vLLM abort the request.
            if fin.ending == "complete":
                resp.release()
            else:
                resp.close()

    async def _relay_stream(self, send: Send, resp: UpstreamResponse,
                            headers: list[tuple[bytes, bytes]], info: dict[str, Any],
                            fin: FinishedRequest, state: dict[str, bool]) -> None:
        sse = _SseRelay(info, collect=self._on_finished is not None)
        await send({"type": "http.response.start", "status": resp.status,
                    "headers": headers})
        error: str | None = None
        try:
            async for chunk in resp.iter_any():
                out = sse.feed(chunk)
                if out:
                    await send({"type": "http.response.body", "body": out, "more_body": True})
        except EffectError as exc:
            error = f"vLLM stream broke off: {exc!r}"
        tail = sse.flush()
        if error is None and not sse.complete:
            error = "vLLM stream ended without its [DONE] terminator"
        if error is not None:
            tail += sse.error_tail(error)
            fin.ending = "upstream_error"
            fin.status = 502
        else:
            fin.ending = "complete"
        fin.events = sse.events
        self._finishing(state, fin)
        await send({"type": "http.response.body", "body": tail, "more_body": False})


class ReadOnlyRoutes:
    """ASGI app of ``READ_ONLY_ROUTES``: answered by vLLM, relayed as they are.

    Its own small connection pool (httpx), so the data plane's pool, sized and
    tuned for generation, is not shared with lookups. The data token applies
    as on the data routes.
    """

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._client: Any = None

    async def start(self) -> None:
        import httpx

        cfg = self.config
        self._client = httpx.AsyncClient(
            base_url=cfg.upstream_url, follow_redirects=False,
            timeout=httpx.Timeout(cfg.upstream_read_s, connect=cfg.upstream_connect_s),
            limits=httpx.Limits(max_connections=16, max_keepalive_connections=4,
                                keepalive_expiry=cfg.upstream_keepalive_s))

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"]
        status = await self._handle(scope, receive, send, route)
        self.metrics.requests.labels(route, str(status)).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: str) -> int:
        import httpx

        cfg = self.config
        method = READ_ONLY_ROUTES[route]
        if scope["method"] != method:
            await send_json(send, 405, error_body(405, f"use {method}", "MethodNotAllowed"),
                            [(b"allow", method.encode())])
            return 405
        hdrs = _headers_of_interest(scope)
        auth = check_bearer(hdrs.get(b"authorization"), cfg.data_token)
        if not auth.ok:
            assert auth.status is not None
            await send_json(send, auth.status, error_body(auth.status, auth.reason,
                                                          "Unauthorized"),
                            [(b"www-authenticate", b"Bearer")])
            return auth.status
        body = b""
        if method == "POST":
            try:
                body = await read_body(receive, cfg.max_body_bytes,
                                       hdrs.get(b"content-length"))
            except RequestTooLarge:
                await send_json(send, 413, error_body(
                    413, f"request body exceeds {cfg.max_body_bytes} bytes",
                    "PayloadTooLarge"))
                return 413
            except _ClientGone:
                return 499
            except BadInput as exc:
                await send_json(send, 400, error_body(400, str(exc), "BadRequest"))
                return 400
        client = self._client
        if client is None:
            raise RuntimeError("read-only routes not started")
        headers = {}
        if b"content-type" in hdrs:
            headers["content-type"] = hdrs[b"content-type"].decode("latin-1")
        qs = scope.get("query_string", b"")
        try:
            resp = await client.request(method, route + ("?" + qs.decode("latin-1")
                                                         if qs else ""),
                                        content=body or None, headers=headers)
        except httpx.TimeoutException as exc:
            await send_json(send, 504, error_body(504, f"vLLM did not answer in time: "
                                                  f"{exc!r}", "UpstreamTimeout"))
            return 504
        except httpx.HTTPError as exc:
            await send_json(send, 502, error_body(502, f"vLLM unreachable: {exc!r}",
                                                  "UpstreamError"))
            return 502
        out = [(b"content-type", resp.headers.get("content-type", "application/json")
                .encode("latin-1")), (b"content-length", str(len(resp.content)).encode())]
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": out})
        await send({"type": "http.response.body", "body": resp.content, "more_body": False})
        return int(resp.status_code)


def _validate(raw: bytes) -> tuple[str, dict[str, Any]]:
    """The gateway's own checks; everything else is vLLM's to validate (it answers 400)."""
    try:
        payload = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"malformed JSON: {exc}", {}
    if not isinstance(payload, dict):
        return "the request body must be a JSON object", {}
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "'stream' must be a boolean", {}
    if BODY_FIELD in payload:
        return f"'{BODY_FIELD}' is reserved for the gateway's answer", {}
    return check_client_salt(payload), payload


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def splice_field(obj: bytes, value: bytes) -> bytes | None:
    """Add ``"rolloutcore": value`` to a serialized JSON object without re-parsing it.

    vLLM's answers are JSON objects; splicing before the closing brace costs
    one copy, where a parse and a dump cost a multiple of the gateway's whole
    budget for large answers (logprobs). ``None`` when ``obj`` is no object.
    """
    body = obj.strip()
    if len(body) < 2 or body[:1] != b"{" or body[-1:] != b"}":
        return None
    head = body[:-1].rstrip()
    sep = b"" if head == b"{" else b","
    return head + sep + b'"' + BODY_FIELD.encode() + b'":' + value + b"}"


def _inject_json(body: bytes, info: dict[str, Any]) -> tuple[bytes, dict[str, Any] | None]:
    """Parse, add the field and re-serialize (for the recorder, which keeps the parsed answer)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, None
    if not isinstance(obj, dict):
        return body, None
    obj[BODY_FIELD] = info
    return _dumps(obj), obj
