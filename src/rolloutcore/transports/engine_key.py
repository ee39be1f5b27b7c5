"""A per-launch key on a launched engine's dev and weight routes (issue 29).

vLLM's dev routes (``VLLM_SERVER_DEV_MODE=1``: ``/pause``,
``/update_weights``, ``/reset_prefix_cache``, ``/update_weight_version``,
``/collective_rpc``...) answer every process that reaches the port; vLLM's own
``--api-key`` guards ``/v1`` only. A local process that writes weights or a
label out of band is then seen only at the gateway's next health tick, and
answers completed meanwhile keep the committed label. When RolloutCore
launches the engine (``ManagedEngine(guard_routes=True)``: ``rolloutcore
serve``, ``EngineSession.launch``, a fleet's engines), it closes those routes
instead, with vLLM's own interface for it: ``--middleware`` names
``RouteGuard``, an ASGI middleware vLLM adds to its app, and the launch puts
a fresh random key in the engine's environment (``ENV``). The guard answers
403 to any request whose path is not open (``OPEN_ROUTES``: health, version,
models, metrics, tokenize and the three generation routes; an unknown route
is closed) unless it carries the key in ``HEADER``. An engine started with
the guard and no key (or a short one) refuses to start.

The key's other half is this process's ``register`` table, by origin
(``scheme://host:port``). Every client of a vLLM server sends
``headers_for(url)`` with each request: ``VllmHTTP``, the transports' calls
(``engine.errors.request``), the gateway's data-path client
(``engine.upstream``), its read-only passthrough and the CUDA-IPC trainer.
A process that did not launch the engine learns the key from whoever did:
a remote trainer from the gateway's grant of an update (an answer to the
control token), a fleet's coordinator from its Ray actors.

The guard also answers one route of RolloutCore's own, behind the key:
``POST /rolloutcore/pause?mode=...&clear_cache=...`` (``FAST_PAUSE``). It makes
the very call vLLM's ``/pause`` makes into the engine core (the scheduler's
pause: in-flight requests waited for, aborted or frozen, new ones held or, from
0.33, refused) and answers once the core has paused; what it leaves out is the
fixed 20 ms ``asyncio.sleep`` vLLM's ``AsyncLLM.pause_generation`` adds after
that call, which its own comment says "is not required for correctness" (it
lets the API server hand the last outputs of finished requests to their
clients first; those outputs were computed before the pause, by the weights
still installed, and the weights change only with the next call). On the H200
that sleep was 20 of the 23.5 ms a pause with nothing in flight took, the
largest part of vLLM's bare update sequence (issue 49; ``docs/weight-receivers.md``).
And ``GET /rolloutcore/state`` (``engine.close_state``): a paused validation's label,
paused state and weight-operation counters in one round trip, read where vLLM's own
routes read them.

A key lent for one lease (#47). The launcher's key stays with the process that
launched the engine; a trainer granted an update is lent another one
(``LENT_KEY``: ``PUT`` with ``{"key", "seconds"}``, ``DELETE`` to take it
back; only the launcher's key may call it). The guard honours a lent key
until it is taken back, replaced, or its ``seconds`` (the lease's, counted on
the engine's own clock) run out, whichever is first: the gateway takes it back
(``engine.lent_key``) when the lease ends (the trainer's report, the lease's
expiry, shutdown), and a gateway that cannot is bounded by the engine's own
deadline. A call with a
key no longer lent is a 403 that reaches nothing behind the guard.

What it does not stop: a process of the same user can read the engine's
environment (``/proc/<pid>/environ``) or attach a debugger; the key keeps out
processes that were not given it (another user's, a script pointed at the
port), not the engine's owner. The data routes stay open on purpose: a
generation changes no weights, and the gateway labels only what it relays.
An engine RolloutCore did not launch has no guard; ``rolloutcore serve
--upstream`` says so at start, and out-of-band writes there are detected
(health ticks, the instance id, the label), not refused.
"""

from __future__ import annotations

import hmac
import os
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any
from urllib.parse import urlsplit

from rolloutcore.engine import close_state
from rolloutcore.engine.routes import keyless_routes
from rolloutcore.errors import BadInput

__all__ = [
    "ENV",
    "FAST_PAUSE",
    "HEADER",
    "LENT_KEY",
    "MIDDLEWARE",
    "OPEN_ROUTES",
    "RouteGuard",
    "check_key",
    "forget",
    "headers_for",
    "is_open",
    "new_key",
    "origin",
    "owns",
    "register",
]

#: The engine's environment variable that holds its key (a secret: never inherited
#: by an engine from RolloutCore's own environment, ``process._is_secret``).
ENV = "ROLLOUTCORE_ENGINE_ROUTE_SECRET"
#: The request header that carries it.
HEADER = "x-rolloutcore-engine-key"
#: What ``--middleware`` names.
MIDDLEWARE = "rolloutcore.transports.engine_key.RouteGuard"
#: RolloutCore's pause route on a guarded engine (keyed; see the module's doc).
FAST_PAUSE = "/rolloutcore/pause"
_PAUSE_MODES = frozenset({"wait", "abort", "keep"})
#: RolloutCore's route on a guarded engine that lends a key for one lease (launcher only).
LENT_KEY = "/rolloutcore/lent_key"
#: The longest a key is lent for (a lease's own bound, ``BeginBody.lease_s``).
MAX_LEND_S = 86400.0
#: A key shorter than this is refused (``new_key`` makes 43 characters).
MIN_KEY_CHARS = 32

#: (methods, path) open without the key: reading and generating change no weights
#: (the route table's ``keyless`` column, ``engine.routes``).
OPEN_ROUTES: Mapping[str, frozenset[str]] = keyless_routes()


def is_open(method: str, path: str) -> bool:
    """Whether ``method path`` is answered without the key."""
    return method.upper() in OPEN_ROUTES.get(path, frozenset())


def new_key() -> str:
    """A fresh random key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def check_key(key: object) -> str:
    """``key`` if it can be a route key (printable ASCII, no spaces, long enough).

    Else ``BadInput`` (a ``ValueError``): a key is sent as a header, so no line break may pass.
    """
    if not isinstance(key, str) or len(key) < MIN_KEY_CHARS or not key.isascii() \
            or not key.isprintable() or " " in key:
        raise BadInput(f"an engine route key is a printable ASCII string of at least "
                         f"{MIN_KEY_CHARS} characters without spaces")
    return key


# ----------------------------------------------------------------- client side

def origin(url: str) -> str:
    """``scheme://host:port`` of an http(s) URL (the port made explicit), else ``BadInput``."""
    p = urlsplit(url)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise BadInput(f"not an http(s) URL: {url!r}")
    port = p.port or (443 if p.scheme == "https" else 80)
    host = p.hostname if ":" not in p.hostname else f"[{p.hostname}]"
    return f"{p.scheme}://{host.lower()}:{port}"


_KEYS: dict[str, str] = {}
#: Keys lent to this process for a lease: sent only where it holds no key of its own.
_LENT: dict[str, str] = {}
_LOCK = threading.Lock()


def register(url: str, key: str, *, lent: bool = False) -> None:
    """This process's clients send ``key`` to the engine at ``url`` from now on
    (``lent``: a key lent for a lease, which replaces the last one lent and never
    the key of a launcher in the same process)."""
    o = origin(url)
    k = check_key(key)
    with _LOCK:
        (_LENT if lent else _KEYS)[o] = k


def forget(url: str, key: str | None = None) -> None:
    """Stop sending a key to ``url`` (only if it is still ``key``, when given)."""
    try:
        o = origin(url)
    except BadInput:
        return
    with _LOCK:
        for table in (_KEYS, _LENT):
            if key is None or table.get(o) == key:
                table.pop(o, None)


_ORIGINS: dict[str, str | None] = {}


def headers_for(url: str) -> dict[str, str]:
    """The headers a request to ``url`` carries: the key's, or none.

    The URL's origin is parsed once per URL (a pure function of the string;
    clients call this for every request); the key is looked up every time, so
    ``register`` and ``forget`` take effect at the next request.
    """
    o = _ORIGINS.get(url, "")
    if o == "":
        try:
            o = origin(url)
        except BadInput:
            o = None
        if len(_ORIGINS) >= 1024:
            _ORIGINS.clear()
        _ORIGINS[url] = o
    if o is None:
        return {}
    k = _KEYS.get(o) or _LENT.get(o)
    return {} if k is None else {HEADER: k}


def owns(url: str) -> bool:
    """Whether this process holds the engine at ``url``'s own key (it launched it), not
    only a key lent for a lease (which may have ended)."""
    try:
        return origin(url) in _KEYS
    except BadInput:
        return False


# ----------------------------------------------------------------- engine side

#: The ASGI types the engine-side middlewares (this one, ``adapter_store``) take.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_HEADER_B = HEADER.encode()
_MARK_B = close_state.MARK_HEADER.encode()


class RouteGuard:
    """ASGI middleware for vLLM's API server (``--middleware``): the key or 403.

    Reads its key from ``ENV`` once, when vLLM builds its app; without a
    valid one it raises and the engine does not start (fail closed).
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        try:
            key = check_key(os.environ.get(ENV))
        except BadInput as exc:
            raise BadInput(f"RouteGuard: {ENV} must hold the engine's route key: "
                               f"{exc}") from None
        self.app = app
        self._key = key.encode()
        #: The key lent for a lease and the engine's monotonic deadline of it.
        self._lent: tuple[bytes, float] | None = None
        #: The counters rendered at each marked reset (``engine.close_state``), by mark.
        self._marks: dict[str, str] = {}

    def _allowed(self, scope: Scope, *, own_only: bool = False) -> bool:
        given = next((v for k, v in scope.get("headers") or () if k.lower() == _HEADER_B), None)
        if given is None:
            return False
        if hmac.compare_digest(given, self._key):
            return True
        lent = self._lent
        if own_only or lent is None:
            return False
        if time.monotonic() >= lent[1]:
            self._lent = None  # the lease's time is up
            return False
        return hmac.compare_digest(given, lent[0])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "http" and scope.get("path") == LENT_KEY:
            if not self._allowed(scope, own_only=True):
                await send_json(send, 403, {"error": "only the engine's launcher lends its key"})
                return
            await self._lend(scope, receive, send)
            return
        if kind == "http":
            if scope.get("path") == FAST_PAUSE and self._allowed(scope):
                await _fast_pause(scope, send)
                return
            if scope.get("path") == close_state.CLOSE_STATE and self._allowed(scope):
                await _close_state(scope, send, self._marks)
                return
            if is_open(str(scope.get("method", "")), str(scope.get("path", ""))):
                await self.app(scope, receive, send)
                return
            if self._allowed(scope):
                _remember(scope, self._marks)
                await self.app(scope, receive, send)
                return
            body = (b'{"error": {"message": "this route of a RolloutCore-launched engine needs '
                    b'its route key", "type": "Forbidden", "code": 403}}')
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        if kind == "websocket" and not self._allowed(scope):
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)  # lifespan, and websockets with the key


    async def _lend(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``LENT_KEY``: ``PUT {"key", "seconds"}`` lends, ``DELETE`` takes back. A body
        that is not exactly that is a 400 and changes nothing."""
        import json

        method = scope.get("method")
        if method == "DELETE":
            self._lent = None
            await send_json(send, 200, {"lent": False})
            return
        if method != "PUT":
            await send_json(send, 405, {"error": "PUT or DELETE only"})
            return
        raw = b""
        while True:
            msg = await receive()
            raw += bytes(msg.get("body") or b"")
            if len(raw) > 4096:
                await send_json(send, 413, {"error": "body too large"})
                return
            if not msg.get("more_body"):
                break
        try:
            body = json.loads(raw)
            if not isinstance(body, dict) or set(body) != {"key", "seconds"}:
                raise BadInput('the body is {"key": str, "seconds": number}')
            key, secs = check_key(body["key"]).encode(), body["seconds"]
            if isinstance(secs, bool) or not isinstance(secs, (int, float)) \
                    or not 0 < secs <= MAX_LEND_S:
                raise BadInput(f"seconds must be in (0, {MAX_LEND_S:g}]")
            if hmac.compare_digest(key, self._key):
                raise BadInput("the launcher's own key is not lent")
        except ValueError as exc:  # BadInput and JSONDecodeError are ValueErrors
            await send_json(send, 400, {"error": str(exc)})
            return
        self._lent = (key, time.monotonic() + float(secs))
        await send_json(send, 200, {"lent": True, "seconds": float(secs)})


async def send_json(send: Send, status: int, body: Mapping[str, Any]) -> None:
    """Answer an ASGI request with ``body`` as JSON."""
    import json

    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(raw)).encode())]})
    await send({"type": "http.response.body", "body": raw})


async def _fast_pause(scope: Scope, send: Send) -> None:
    """``FAST_PAUSE``: the engine core's scheduler pause, as vLLM's ``/pause`` calls it.

    vLLM 0.26-0.32 name the core call ``pause_scheduler_async``, 0.33+
    ``pause_generation_async``; the multimodal cache is cleared first when
    asked, as ``AsyncLLM.pause_generation`` does.
    """
    from urllib.parse import parse_qs

    if scope.get("method") != "POST":
        await send_json(send, 405, {"error": "POST only"})
        return
    q = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1"),
                 keep_blank_values=True)
    mode = (q.get("mode") or ["abort"])[-1]
    clear = (q.get("clear_cache") or ["false"])[-1].lower()
    if mode not in _PAUSE_MODES or clear not in ("true", "false"):
        await send_json(send, 400, {"error": "mode must be wait, abort or keep and clear_cache "
                                           "true or false"})
        return
    app = scope.get("app")
    engine = getattr(getattr(app, "state", None), "engine_client", None)
    core = getattr(engine, "engine_core", None)
    pause = getattr(core, "pause_generation_async", None) or getattr(
        core, "pause_scheduler_async", None)
    if pause is None:
        await send_json(send, 404, {"error": "this vLLM has no engine-core pause to call"})
        return
    try:
        if clear == "true":
            await engine.renderer.clear_mm_cache_async()  # type: ignore[union-attr]
        await pause(mode=mode, clear_cache=clear == "true")
    except Exception as exc:  # the engine's own failure: the client fails the drain
        await send_json(send, 500, {"error": f"pause failed: {type(exc).__name__}: {exc}"})
        return
    await send_json(send, 200, {"status": "paused", "via": "engine_core"})


async def _close_state(scope: Scope, send: Send, marks: dict[str, str]) -> None:
    """``close_state.CLOSE_STATE`` on the guard (keyed): see the module's doc. ``marks``: the
    counters rendered at each marked reset, by mark (taken once)."""
    from urllib.parse import parse_qs

    if scope.get("method") != "GET":
        await send_json(send, 405, {"error": "GET only"})
        return
    q = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1"))
    mark = (q.get("mark") or [""])[-1]
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    version = getattr(engine, "get_weight_version", None)
    is_paused = getattr(engine, "is_paused", None)
    if version is None or is_paused is None:
        await send_json(send, 404, {"error": "this vLLM has no weight version or pause "
                                             "state to read"})
        return
    try:
        at_mark = marks.pop(mark, None) if mark else None
        text = at_mark if at_mark is not None else close_state.ops_text()
        if text is None:
            await send_json(send, 404, {"error": "this vLLM has no metrics registry"})
            return
        body = {"weight_version": await version(), "is_paused": bool(await is_paused()),
                "metrics": text, "marked": at_mark is not None}
    except Exception as exc:  # the engine's own failure: the client's read fails
        await send_json(send, 500, {"error": f"state read failed: {type(exc).__name__}: {exc}"})
        return
    await send_json(send, 200, body)


def _remember(scope: Scope, marks: dict[str, str]) -> None:
    """A keyed request carrying ``close_state.MARK_HEADER``: render the counters now,
    under its mark."""
    mark = next((v for k, v in scope.get("headers") or () if k.lower() == _MARK_B), None)
    if mark is None or not 8 <= len(mark) <= 64:
        return
    text = close_state.ops_text()
    if text is not None:
        if len(marks) >= 16:
            marks.clear()
        marks.setdefault(mark.decode("latin-1"), text)  # a retried reset's: the first
