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

Nobody holds the gateway hostage either (#16). Every request is a
``Flight`` (``liveness``) that one sweeper task looks at a few times a
second (one timer for all of them, not one per request: the hot path only
writes two timestamps):

* a body that has not fully arrived after ``client_body_s`` is answered 408;
* a send to the client still pending after ``client_send_s`` (a client that
  stopped reading) cuts the request: its upstream request is closed (vLLM
  aborts it), its binding released, the connection closed;
* when an update's drain deadline expires, the runner hands the stragglers
  to ``abort_stragglers``: each is cut (a stream ends with an ``error``
  event of type ``Aborted`` and ``[DONE]`` if the client still reads, else
  the connection closes; an answer not started yet is a 503) and aborted in
  vLLM (``/abort_requests`` with the request ids vLLM gave them); the
  controller has released it unattributable already.

Bounds: at most ``max_concurrent_requests`` data requests at once (beyond:
503 with ``Retry-After``), a non-streamed answer of at most
``max_response_bytes``, at most ``max_record_bytes`` of a stream collected
for the recorder, request JSON nested at most ``max_json_depth`` deep and
without ``NaN``/``Infinity`` (not JSON; vLLM would take them as numbers).

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
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.lifecycle import Binding, UpdateMode
from rolloutcore.core.lifecycle_state import Completion
from rolloutcore.core.media import MediaError
from rolloutcore.core.versions import WeightVersion
from rolloutcore.engine.routes import DATA_ROUTES
from rolloutcore.engine.upstream import UpstreamPool, UpstreamResponse
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    EffectError,
    EngineUnreachable,
    InvalidTransition,
    RouteRefused,
)
from rolloutcore.service.admission import Admission, OneEngine, Target
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.carried import CarriedRelay, check_one_sample
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.images import inspect_media
from rolloutcore.service.liveness import Flight, Flights
from rolloutcore.service.marks import ATTRIBUTABLE_HEADER, UNATTRIBUTABLE_HEADER, marks_headers
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.service.salting import check_client_salt, salted_body
from rolloutcore.service.wire import (
    BODY_FIELD,
    DATA_HEADERS,
    GENERATION_HEADER,
    IDENTITY_HEADER,
    ROLLOUT_HEADER,
    VERSION_HEADER,
    Message,
    Receive,
    Scope,
    Send,
    SseRelay,
    VersionView,
    body_or_answer,
    error_body,
    headers_of_interest,
    inject_json,
    json_depth,
    retry_headers,
    send_auth_refusal,
    send_error,
    send_json,
    splice_field,
    upstream_failure,
    validate_request,
    vllm_request_ids,
)

__all__ = [
    "ATTRIBUTABLE_HEADER",
    "BODY_FIELD",
    "DATA_ROUTES",
    "GENERATION_HEADER",
    "IDENTITY_HEADER",
    "ROLLOUT_HEADER",
    "UNATTRIBUTABLE_HEADER",
    "VERSION_HEADER",
    "ENDINGS",
    "DataPlane",
    "FinishedRequest",
    "Target",
    "error_body",
    "json_depth",
    "send_json",
    "splice_field",
    "vllm_request_ids",
]


log = logging.getLogger("rolloutcore.service")
#: Matched with ``fullmatch`` (``$`` alone lets a trailing newline through).
_ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
#: Upstream response headers that describe the upstream connection, not the answer.
_HOP = frozenset({b"content-length", b"transfer-encoding", b"connection", b"keep-alive",
                  b"date", b"server", b"content-encoding", b"x-request-id"})
_ROLLOUT_HEADER_B = ROLLOUT_HEADER.encode()
_MEDIA_KIND = {400: "BadRequest", 413: "PayloadTooLarge", 415: "UnsupportedMediaType"}
#: How long the gateway tries to hand a cut request its clear ending (an error
#: event, a 408 or 503) before it closes the connection instead.
_LAST_WORD_S = 1.0
#: Endings of a request (the metric's label values).
ENDINGS = ("complete", "client_disconnect", "upstream_error", "client_slow", "aborted")


def _unattributed(fin: FinishedRequest) -> dict[str, Any]:
    """The body-field entries of an answer released unattributable (else none)."""
    if fin.attributable:
        return {}
    return {"attributable": False,
            "unattributable": fin.unattributable or "the controller credits it to no version"}


def _retryable(exc: AdmissionRefused | RouteRefused) -> bool:
    """A refusal that says when to ask again (a queued request waits for it)."""
    if isinstance(exc, RouteRefused):
        return exc.status == 503
    return exc.retry_after_s is not None


@dataclass(slots=True)
class FinishedRequest:
    """What the data plane saw of one request, handed to the optional recorder."""

    route: str
    binding: Binding
    request: dict[str, Any]
    status: int
    ending: str                         # complete | client_disconnect | upstream_error
    #: Where it went (the one engine, or a fleet's replica with its fleet version).
    target: Target | None = None
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
    #: What the controller said at the release: False when it credits the
    #: answer to no version (a policy abort, an engine tainted meanwhile).
    attributable: bool = True
    #: Why it is not attributable (``None`` when it is).
    unattributable: str | None = None
    #: The stream was longer than the recorder may collect (events incomplete).
    record_overflow: bool = False
    #: The request's images, described (``core.media.ImageRef``), in request order.
    media: tuple[Any, ...] = ()
    #: The version salt the request was forwarded with (``service.salting``), if any.
    cache_salt: str | None = None
    #: The version the controller credited at the release (``Completion.committed``).
    committed: WeightVersion | None = None
    #: Asynchronous modes: the answer's per-token versions (``TokenVersions``), its
    #: staleness, and the engine's spans over the whole output (``service.carried``).
    token_versions: Any = None
    staleness: int | None = None
    engine_spans: tuple[tuple[str, int, int], ...] | None = None
    #: Whether the versions derived from the read instants equal the engine's spans.
    derived_agrees: bool | None = None


def _rid(b: Binding) -> str:
    """The rollout id of a binding the controller handed out (admission always names one)."""
    rid = b.rollout_id
    assert rid is not None
    return rid


class DataPlane:
    """ASGI app of the three data routes. ``start``/``aclose`` manage the upstream clients.

    ``admission`` says where requests go (``service.admission``): a controller
    stands for its one engine at ``config.upstream_url``; a fleet passes its
    router (``fleet.gateway.FleetAdmission``). Everything else is the same.
    """

    def __init__(self, admission: Admission | LifecycleController, config: ServiceConfig,
                 metrics: ServiceMetrics, *,
                 on_finished: Callable[[FinishedRequest], None] | None = None) -> None:
        if isinstance(admission, LifecycleController):
            admission = OneEngine(admission, lambda: self.config.upstream_url)
        self.admission = admission
        #: The one engine's controller (``None`` behind a fleet's router).
        self.controller: LifecycleController | None = getattr(admission, "controller", None)
        self.config = config
        self.metrics = metrics
        self._on_finished = on_finished
        self.upstreams: dict[str, UpstreamPool] = {}
        self._paths = {r: r.encode() for r in DATA_ROUTES}
        self._views: dict[tuple[int, int, str], VersionView] = {}
        # Metric children, looked up once (``labels()`` hashes and locks).
        self._requests: dict[tuple[str, int], Any] = {}
        self._seconds = {r: metrics.request_seconds.labels(r) for r in DATA_ROUTES}
        self._endings = {e: metrics.stream_endings.labels(e) for e in ENDINGS}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._waiting = 0
        self._wanted = DATA_HEADERS | frozenset(getattr(admission, "headers", ()))
        self.flights = Flights(config, metrics, self.upstreams.get)
        admission.on_change(self._wake_threadsafe)
        #: Under keep or recompute controllers: one relay of carried requests per
        #: controller (one engine's, or each replica's behind a fleet's router: a fleet
        #: carries its requests exactly as one engine does). ``carried``: the one
        #: engine's relay (``None`` behind a fleet or in strict mode).
        self._relays: dict[int, CarriedRelay] = {}
        listed = getattr(admission, "controllers", None)
        ctls = ([self.controller] if self.controller is not None
                else list(listed().values()) if callable(listed) else [])
        for ctl in ctls:
            self.relay_for(ctl)
        self.carried: CarriedRelay | None = (
            None if self.controller is None else self._relays.get(id(self.controller)))

    def relay_for(self, controller: LifecycleController) -> CarriedRelay | None:
        """The carried relay of ``controller``'s requests (``None`` in strict mode)."""
        if controller.update_mode is UpdateMode.STRICT:
            return None
        relay = self._relays.get(id(controller))  # the relay holds its controller
        if relay is None:
            relay = self._relays[id(controller)] = CarriedRelay(self, controller)
        return relay

    @property
    def asynchronous(self) -> bool:
        """Whether requests may be carried across updates (keep or recompute)."""
        return bool(self._relays)

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the data plane runs on (once started)."""
        return self._loop

    @property
    def collecting(self) -> bool:
        """Whether answers are collected for a recorder (``on_finished``)."""
        return self._on_finished is not None

    def route_path(self, route: str) -> bytes:
        return self._paths[route]

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
        for name, url in self.admission.upstreams().items():
            self.upstreams[name] = UpstreamPool(
                url, max_connections=cfg.upstream_max_connections,
                connect_s=cfg.upstream_connect_s, pool_s=cfg.upstream_read_s,
                read_s=cfg.upstream_read_s, keepalive_s=cfg.upstream_keepalive_s)
        self.flights.start()

    async def aclose(self) -> None:
        await self.flights.aclose()
        pools = list(self.upstreams.values())
        self.upstreams.clear()
        for pool in pools:
            await pool.aclose()

    @property
    def upstream(self) -> UpstreamPool | None:
        """The one engine's pool (a gateway over one engine), else None."""
        return self.upstreams.get("")

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def in_progress(self) -> int:
        """Data-plane requests in progress (reading, queued, relaying)."""
        return len(self.flights)

    def _wake_threadsafe(self) -> None:
        """The admission's listener (any thread): wake queued requests at a change, if any
        (none lost: ``_admit`` counts itself in ``_waiting`` before it reads the state)."""
        loop = self._loop
        if self._waiting and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        if ev is not None:
            ev.set()

    # ------------------------------------------------------------ stragglers
    def abort_stragglers(self, bindings: tuple[Binding, ...], reason: str) -> dict[str, Any]:
        """The runner's ``stragglers`` hook (``liveness.Flights.abort_stragglers``)."""
        return self.flights.abort_stragglers(bindings, reason)

    # ------------------------------------------------------------ admission
    async def _admit(self, rollout_id: str, routing: Any) -> tuple[Binding, Target]:
        """Choose and admit now, or (queue configured) wait for a change, bounded.

        A refusal that says when to retry (an update in progress, no engine
        on the version asked for now) waits in the queue; one that is final
        (a tainted engine, a version never published) is answered at once.
        """
        cfg = self.config
        adm = self.admission
        try:
            return adm.try_admit(rollout_id, routing)
        except (AdmissionRefused, RouteRefused) as exc:
            if not _retryable(exc) or cfg.queue_max == 0 or self._waiting >= cfg.queue_max:
                raise
        self._waiting += 1
        deadline = time.monotonic() + cfg.queue_wait_s
        try:
            while True:
                changed = self._changed
                assert changed is not None
                left = deadline - time.monotonic()
                if adm.worth_retry() or left <= 0:
                    try:
                        got = adm.try_admit(rollout_id, routing)
                    except (AdmissionRefused, RouteRefused) as exc:
                        if not _retryable(exc) or left <= 0:
                            self.metrics.queued.labels(
                                "timeout" if left <= 0 else "refused").inc()
                            raise
                    else:
                        self.metrics.queued.labels("admitted").inc()
                        return got
                with anyio.move_on_after(max(0.0, left)):
                    await changed.wait()
        finally:
            self._waiting -= 1

    def _view(self, b: Binding, t: Target | None) -> VersionView:
        """What every answer of ``b``'s version (through ``t``) carries, built once.

        The identity digest is a hash over the identity's JSON; recomputing it
        (and the headers) for every request was a measurable share of the
        gateway's own path.
        """
        tk = "" if t is None else t.name
        key = (id(b.version), id(b.identity), tk)
        v = self._views.get(key)
        if v is None or v.version is not b.version or v.identity is not b.identity or (
                t is not None and v.extra is not t.info):
            if len(self._views) > 256:
                self._views.clear()
            v = self._views[key] = VersionView(b, {} if t is None else t.info)
        return v

    def info(self, b: Binding, t: Target | None = None) -> dict[str, Any]:
        """The ``rolloutcore`` body field of ``b``'s answer."""
        return {**self._view(b, t).info, "rollout_id": b.rollout_id}

    def info_json(self, b: Binding, t: Target | None = None) -> bytes:
        """``info(b)`` serialized (the same bytes ``json.dumps`` makes of it)."""
        return self._view(b, t).info_head + _rid(b).encode() + b'"}'

    def version_headers(self, b: Binding, t: Target | None = None
                        ) -> list[tuple[bytes, bytes]]:
        extra = () if t is None else t.headers
        return [*self._view(b, t).headers, (_ROLLOUT_HEADER_B, _rid(b).encode()), *extra]

    def _count(self, route: str, status: int) -> None:
        key = (route, status)
        child = self._requests.get(key)
        if child is None:
            child = self._requests[key] = self.metrics.requests.labels(route, str(status))
        child.inc()

    # ------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"]
        cfg = self.config
        if len(self.flights) >= cfg.max_concurrent_requests:
            self.metrics.overloaded.inc()
            await send_error(send, 503, f"the gateway has {cfg.max_concurrent_requests} "
                             "requests in progress", "ServiceUnavailable",
                             [(b"retry-after", b"1")])
            self._count(route, 503)
            return
        task = asyncio.current_task()
        assert task is not None
        f = self.flights.add(task)

        async def guarded(msg: Message) -> None:
            # The sweeper cuts a send that stays pending past client_send_s.
            f.send_since = time.monotonic()
            try:
                await send(msg)
            finally:
                f.send_since = 0.0

        try:
            status = await self._handle(scope, receive, guarded, route, f)
        finally:
            self.flights.discard(f)
        self._count(route, status)

    async def _last_word(self, send: Send, status: int, message: str, kind: str,
                         close: bool = False, **extra: Any) -> None:
        """A cut request's clear ending, if the client takes it in time (else nothing).

        ``close``: the connection cannot carry another request (its body was not
        read to the end), so the answer says ``Connection: close``.
        """
        hdrs = [(b"connection", b"close")] if close else []
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_LAST_WORD_S):
                await send_error(send, status, message, kind, hdrs, **extra)

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: str,
                      f: Flight) -> int:
        cfg = self.config
        if scope["method"] != "POST":
            return await send_error(send, 405, "use POST", "MethodNotAllowed",
                                    [(b"allow", b"POST")])
        hdrs = headers_of_interest(scope, self._wanted)
        auth = check_bearer(hdrs.get(b"authorization"), cfg.data_token)
        if not auth.ok:
            return await send_auth_refusal(send, auth)
        ctype = hdrs.get(b"content-type", b"")
        if ctype.split(b";")[0].strip().lower() != b"application/json":
            return await send_error(send, 415, "Content-Type must be application/json",
                                    "UnsupportedMediaType")
        try:
            raw = await body_or_answer(receive, send, cfg.max_body_bytes,
                                       hdrs.get(b"content-length"))
        except asyncio.CancelledError:
            if not self.flights.consume_cut(f):
                raise
            self.metrics.body_timeouts.inc()
            await self._last_word(send, 408, f"the request body did not arrive within "
                                  f"{cfg.client_body_s:g}s", "RequestTimeout", close=True)
            return 408
        if isinstance(raw, int):
            return raw
        f.phase = "checking"
        problem, payload = validate_request(raw, cfg.max_json_depth)
        problem = problem or check_client_salt(payload)
        if problem or (self.asynchronous and (problem := check_one_sample(route, payload))):
            return await send_error(send, 400, problem, "BadRequest")
        try:  # images: checked and described before anything is admitted
            media = inspect_media(route, payload, cfg.media)
        except MediaError as exc:
            return await send_error(send, exc.status, str(exc), _MEDIA_KIND[exc.status])
        rid_h = hdrs.get(_ROLLOUT_HEADER_B)
        # 128 random bits, the same "r-" + 32 hex digits a uuid4 gave, without
        # the UUID object.
        rid = rid_h.decode("latin-1") if rid_h is not None else f"r-{os.urandom(16).hex()}"
        if not _ROLLOUT_ID.fullmatch(rid):
            return await send_error(send, 400, f"{ROLLOUT_HEADER} must match "
                                    f"{_ROLLOUT_ID.pattern}", "BadRequest")
        try:
            routing, changed = self.admission.routing(payload, hdrs)
        except RouteRefused as exc:
            return await self._route_refused(send, exc)
        if changed:  # the routing fields are the gateway's: never forwarded
            raw = json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()
        if not self.flights.claim(f, rid):
            # One rollout id is bound once, whichever engine would take it.
            return await send_error(send, 409, f"rollout {rid!r} is already active",
                                    "Conflict")
        try:
            binding, target = await self._admit(rid, routing)
        except RouteRefused as exc:
            self.flights.unclaim(f)
            return await self._route_refused(send, exc)
        except AdmissionRefused as exc:
            self.flights.unclaim(f)
            # Retry an update's refusal, never a tainted engine's.
            return await send_error(
                send, 503, str(exc), "ServiceUnavailable",
                retry_headers(exc.retry_after_s is not None, exc.retry_after_s),
                state=exc.state, retry_after_s=exc.retry_after_s)
        except BadInput as exc:  # the rollout id is already active
            self.flights.unclaim(f)
            return await send_error(send, 409, str(exc), "Conflict")
        t0 = time.monotonic()
        fin = FinishedRequest(route, binding, payload, 502, "upstream_error", target,
                              admitted_wall=time.time(), admitted_mono=t0, media=media)
        raw = target.body(raw, payload)  # an adapter version's: sent as its name
        if cfg.salt_prefix_cache:  # no block computed by another version is reused
            raw, fin.cache_salt = salted_body(raw, payload, binding)
        if self._on_finished is not None:
            fin.headers = {k.decode("latin-1"): v.decode("latin-1")
                           for k, v in scope["headers"] if k.startswith(b"x-rolloutcore-")}
        f.route, f.payload, f.fin, f.target = route, payload, fin, target.name
        self.flights.bind(f, rid)
        try:
            await self._forward(receive, send, route, raw, binding, target, fin, f)
        finally:
            self._release(fin)
            fin.seconds = time.monotonic() - t0
            self._seconds[route].observe(fin.seconds)
            self._endings[fin.ending].inc()
        if self._on_finished is not None:
            self._on_finished(fin)
        return fin.status

    async def _route_refused(self, send: Send, exc: RouteRefused) -> int:
        """No engine for this request: its 4xx, or a 503 with Retry-After."""
        self.metrics.route_refused.labels(str(exc.status)).inc()
        return await send_error(send, exc.status, str(exc), exc.kind,
                                retry_headers(True, exc.retry_after_s)
                                if exc.status == 503 else ())

    def _release(self, fin: FinishedRequest) -> None:
        """Release the binding once: when the last byte from vLLM is in hand, or at the end.

        Released *before* the final send: everything the client is still to
        receive was computed already, so an update may begin while it is on
        the wire, and a client that reads its answer and then asks for an
        update never waits on its own request. What the controller says of
        the release (attributable or not, and why) goes into ``fin``.
        """
        if fin.released:
            return
        fin.released = True
        fin.completed_mono, fin.completed_wall = time.monotonic(), time.time()
        done: Completion | None = None
        ctl = fin.target.controller if fin.target is not None else self.controller
        if fin.target is not None and fin.target.on_release is not None:
            try:
                fin.target.on_release(_rid(fin.binding))  # an adapter version's binding
            except Exception as exc:  # the base's binding is released all the same
                log.warning("the adapter binding of %s was not released: %r",
                            _rid(fin.binding), exc)
        with contextlib.suppress(BadInput, InvalidTransition):
            if ctl is not None:
                done = ctl.complete(_rid(fin.binding))
        if done is None:
            fin.attributable = False
            fin.unattributable = (
                f"ended by an update: its oldest tokens would have been more than "
                f"max_staleness={ctl.max_staleness} published versions old"
                if ctl is not None and ctl.over_bound(_rid(fin.binding))
                else "the controller no longer held it")
            return
        fin.committed = done.committed
        if not done.attributable:
            fin.attributable = False
            fin.unattributable = done.aborted or (
                f"released in {done.state.value}" if done.committed == fin.binding.version
                else f"released in {done.state.value} after {done.committed} was committed")

    async def _forward(self, receive: Receive, send: Send, route: str, raw: bytes,
                       binding: Binding, target: Target, fin: FinishedRequest,
                       f: Flight) -> None:
        """Relay one admitted request while watching for the client going away.

        Plain asyncio rather than an anyio task group: the group's cancel
        scope machinery cost more than the rest of the gateway's own path.
        The watcher, the sweeper and an abort stop the relay the same way
        (``_cut``: one ``cancel()`` per request, delivered where the relay
        waits, consumed here with ``uncancel``); a cancellation from anyone
        else (server shutdown) still propagates.
        """

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if not f.finishing:
                        self.flights.cut(f, "client_disconnect")
                    return

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await self._relay(send, route, raw, binding, target, fin, f)
        except asyncio.CancelledError:
            if not self.flights.consume_cut(f):
                raise
            await self._after_cut(send, binding, target, fin, f)
        finally:
            watcher.cancel()

    async def _after_cut(self, send: Send, binding: Binding, target: Target,
                         fin: FinishedRequest, f: Flight) -> None:
        """The ending of a request the gateway cut (the upstream side is closed already)."""
        why = f.cut
        if f.finishing:
            return  # the answer was whole; only its last send was cut
        if why == "client_disconnect":
            fin.ending, fin.status = "client_disconnect", 499
            return
        if why == "client_slow":
            # It does not read: nothing more can reach it. The connection closes
            # (the response is left incomplete, so the server closes it).
            fin.ending, fin.status = "client_slow", 408
            return
        fin.ending, fin.status = "aborted", 503
        if f.sse is not None:  # what it got before the cut: recorded, unattributable
            fin.events, fin.record_overflow = f.sse.events, f.sse.overflow
        self._release(fin)
        msg = f.reason or "aborted by the gateway"
        kind = "OverStalenessBound" if why == "over_bound" else "Aborted"
        if f.started_response and f.sse is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(_LAST_WORD_S):
                    await send({"type": "http.response.body", "more_body": False,
                                "body": f.sse.flush() + f.sse.error_tail(msg, 503, kind)})
        elif not f.started_response:
            await self._last_word(send, 503, msg, kind, **self.info(binding, target),
                                  attributable=False, unattributable=msg)

    def finishing(self, f: Flight, fin: FinishedRequest) -> None:
        f.finishing = True
        self._release(fin)

    async def _relay(self, send: Send, route: str, raw: bytes, binding: Binding,
                     target: Target, fin: FinishedRequest, f: Flight) -> None:
        upstream = self.upstreams.get(target.name)
        if upstream is None:
            raise RuntimeError("data plane not started")
        vh = self.version_headers(binding, target)
        info = self.info(binding, target)
        carried = self.relay_for(target.controller)
        if carried is not None:
            await carried.relay(send, route, fin.request, binding, target, fin, f, vh, info)
            return
        try:
            resp = await upstream.post(self._paths[route], raw, _rid(binding).encode())
        except EffectError as exc:  # EffectTimeout, EngineUnavailable, EngineUnreachable
            fin.status, msg, kind = upstream_failure(exc)
            self.finishing(f, fin)
            # A connection the engine refused is its own signal (it is gone).
            self.admission.observe(target, False, isinstance(exc, EngineUnreachable))
            await send_error(send, fin.status, msg, kind, vh, **info)
            return
        try:
            headers = [(k, v) for k, v in resp.raw_headers if k.lower() not in _HOP]
            fin.status = resp.status
            if resp.content_type == "text/event-stream":
                await self._relay_stream(send, resp, headers + vh, info, fin, f)
                self.admission.observe(target, fin.ending != "upstream_error", False)
            else:
                try:
                    body = await resp.read(self.config.max_response_bytes)
                except EffectError as exc:
                    fin.status = 502
                    self.finishing(f, fin)
                    # An answer too large for the gateway is the request's doing, not
                    # the engine's: it says nothing about the engine's health.
                    self.admission.observe(target, resp.too_large, False)
                    await send_error(send, 502, f"vLLM answer broke off: {exc!r}",
                                     "UpstreamError", vh, **info)
                    return
                self.admission.observe(target, True, False)
                fin.ending = "complete"
                # Released first: the answer says what the release was (unattributable).
                self.finishing(f, fin)
                marks = _unattributed(fin)
                if self._on_finished is None and not marks:
                    out = splice_field(body, self.info_json(binding, target))
                    body, obj = (body if out is None else out), None
                else:
                    body, obj = inject_json(body, {**info, **marks})
                fin.response = obj
                headers = headers + vh + marks_headers(marks) + [
                    (b"content-length", str(len(body)).encode())]
                f.started_response = True
                await send({"type": "http.response.start", "status": resp.status,
                            "headers": headers})
                await send({"type": "http.response.body", "body": body, "more_body": False})
        finally:
            # A whole answer has already gone back to the pool; anything else
            # (client gone or cut, upstream broken) closes the connection,
            # which is what makes vLLM abort the request.
            if fin.ending == "complete":
                resp.release()
            else:
                resp.close()

    async def _relay_stream(self, send: Send, resp: UpstreamResponse,
                            headers: list[tuple[bytes, bytes]], info: dict[str, Any],
                            fin: FinishedRequest, f: Flight) -> None:
        sse = f.sse = SseRelay(info, collect=self._on_finished is not None,
                                collect_limit=self.config.max_record_bytes)
        f.started_response = True
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
            fin.ending = "upstream_error"
            fin.status = 502
        else:
            fin.ending = "complete"
        fin.events = sse.events
        fin.record_overflow = sse.overflow
        self.finishing(f, fin)
        marks = _unattributed(fin)
        if marks and error is None:
            # The release made it unattributable: a last event says so, before [DONE].
            tail += SseRelay.event({BODY_FIELD: {**info, **marks}})
        tail += sse.take_held()
        if error is not None:
            tail += sse.error_tail(error)
        await send({"type": "http.response.body", "body": tail, "more_body": False})
