"""vLLM's own RL routes on the gateway: an unmodified trainer gets RolloutCore's update.

A trainer that speaks only vLLM's contract (TRL server mode, TRL's
AsyncGRPO, vLLM's ``HTTPVLLMWeightSyncClient``) changes one URL: its base
URL becomes ``http://gateway/rc/<token>`` (``engine.routes.NATIVE_PREFIX``).
The token is the secret; a wrong one is answered 404, as a path that does
not exist, and the bare paths stay refused by the rest of the gateway.

A **round** is one RolloutCore update through the same runner as the
trainer protocol (``runner.open_update`` -> ``report_transfer`` ->
``close_update``), never a second path::

    /pause (any mode) or /start_weight_update with no round open
        -> open_update: admission closes, the engine drains and pauses
    /start_weight_update, /update_weights  -> forwarded to vLLM as sent;
        the update bodies' names/dtypes/shapes make the round's manifest
        (an empty one from a 0.33+ sender carries the last round's forward)
    /finish_weight_update -> forwarded with RolloutCore's label, whatever
        the trainer sent; then, if no /pause opened the round, the round
        closes here (caches reset and checked, validated while paused,
        resumed, published); otherwise it closes at /resume
    /resume with nothing sent -> the round ends with no mutation

What the round checks without a reference (``native-unreferenced``, see
``docs/native-routes.md``): every parameter written exactly once (a name
sent twice, or a round that covers fewer names than the last, is refused),
at least one tensor, the label the engine reports, the cache resets by
their bodies (the runner's own invalidation), and whatever validation the
engine adapter runs while paused and live. It cannot prove the values are
the trainer's: no reference is declared.

Errors: a weight route never answers 500, 502 or 503 (TRL re-POSTs on
those, and a replayed ``/update_weights`` would wait for a broadcast
already sent): 4xx or 504, in vLLM's error shape with the reason. A call
out of order (a finish with no update, a second finish, an update with no
start) is 409 and changes nothing. A round not finished within
``ServiceConfig.lease_s`` is expired as a trainer protocol lease is:
classified from the engine's own counters, TAINTED when anything may have
been written, nothing published.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import parse_qs

from rolloutcore.core.lifecycle import FailureKind
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.routes import NATIVE_PREFIX, NATIVE_ROUTES, Routes
from rolloutcore.errors import BadInput, RolloutCoreError
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.wire import (
    VERSION_HEADER,
    Receive,
    Scope,
    Send,
    body_or_answer,
    error_body,
    send_json,
)

__all__ = ["NATIVE_LEVEL", "VERIFICATION_HEADER", "Failed", "NativeRefusal", "NativeRoutes",
           "RoundBackend"]

#: The verification level a round reaches when the trainer declares nothing.
NATIVE_LEVEL = "native-unreferenced"
#: The header of the answer that published a round: the level it reached (beside
#: ``x-rolloutcore-version``, the label it was published under); the body stays vLLM's.
VERIFICATION_HEADER = "x-rolloutcore-verification"
_MODES = ("abort", "wait", "keep")
_MAX_NAMES = 1 << 20

Manifest = dict[str, tuple[str, tuple[int, ...]]]


class NativeRefusal(RolloutCoreError):
    """A native route's answer other than 200: a 4xx or 504, in vLLM's error shape."""

    def __init__(self, status: int, message: str, kind: str = "Conflict") -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


_Refusal = NativeRefusal


@dataclass(frozen=True)
class Failed:
    """A round's call to vLLM that failed: the answer's status, the failure's kind for
    the failure policy (``None``: decided by whether anything was written), the reason."""

    status: int
    reason: str
    timeout: bool = False


class RoundBackend(Protocol):
    """What a round drives: one engine's runner (``service.native_engine``) or a fleet's
    coordinator (``fleet.native``). Every method that ends a round returns the result
    (``{"status": "published" | "failed" | "expired", ...}``) and raises nothing else."""

    floor: VerificationLevel

    def health(self) -> str | None:
        """None when healthy, else why not."""

    def paused(self) -> bool: ...

    def weight_version(self) -> str | None: ...

    async def relay(self, method: str, route: str, query: Mapping[str, str],
                    body: Any) -> tuple[int, Any]:
        """A read-only or cache route, vLLM's answer (never a 5xx)."""

    async def init(self, body: dict[str, Any]) -> tuple[int, Any]: ...

    async def open(self, seq: int) -> tuple[Any, str]:
        """Open a round (admission closes, the engines drain and pause): (handle, label).
        Raises ``NativeRefusal`` when it cannot open (nothing changed, or the failure
        policy already ended it)."""

    async def send(self, handle: Any, route: str, body: dict[str, Any] | bytes | None
                   ) -> Failed | None:
        """Forward a start/update/finish (a finish with the round's own labels); an
        update's body as the bytes the sender sent (read, never changed)."""

    async def close(self, handle: Any, written: Manifest, note: dict[str, Any]
                    ) -> dict[str, Any]: ...

    async def fail(self, handle: Any, kind: FailureKind, reason: str) -> dict[str, Any]: ...

    async def expire(self, handle: Any, reason: str, writes: int) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


@dataclass
class _Round:
    """One open round: the backend's handle and what the trainer sent so far."""

    handle: Any
    label: str
    opened_by: str  # "pause" or "start"
    mode: str
    started: bool = False
    finished: bool = False
    written: Manifest = field(default_factory=dict)
    writes: int = 0
    trainer_label: str | None = None
    timer: asyncio.Task[None] | None = None
    #: The gateway's own time in the round: the open (drain, pause) and each call
    #: forwarded to vLLM, by route (recorded in the round's note).
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class _Published:
    """The answer of the call that published a round: vLLM's body, and headers naming
    the label and the level it was published at."""

    body: Any
    headers: tuple[tuple[bytes, bytes], ...]


class NativeRoutes:
    """ASGI app of ``NATIVE_ROUTES`` under ``/rc/<token>``; one round at a time.

    ``backend``: a ``RoundBackend`` (``native_engine.EngineRounds``, ``fleet.native``)."""

    def __init__(self, backend: RoundBackend, config: ServiceConfig, token: str) -> None:
        if not isinstance(token, str) or len(token) < 16 or not token.isascii() or \
                not token.replace("-", "").replace("_", "").isalnum():
            raise BadInput("the native routes' token must be 16+ URL-safe ASCII characters")
        if not isinstance(config, ServiceConfig):
            raise BadInput("config must be a ServiceConfig")
        self.backend = backend
        self.config = config
        self._token = token.encode()
        self.round: _Round | None = None
        self._lock = asyncio.Lock()
        #: The last round's manifest (name -> dtype, shape), carried when a 0.33+
        #: sender sends an unchanged round's metadata empty.
        self.manifest: Manifest = {}
        self.rounds = 0
        self.last: dict[str, Any] | None = None

    # ------------------------------------------------------------ ASGI
    def path_of(self, path: str) -> str | None:
        """The vLLM route a request names, or None when its token is wrong or absent."""
        rest = path[len(NATIVE_PREFIX):]
        tok, sep, route = rest.partition("/")
        if not sep or not hmac.compare_digest(tok.encode("utf-8", "replace"), self._token):
            return None
        return "/" + route

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrived = time.monotonic()
        route = self.path_of(scope["path"])
        if route is None or route not in NATIVE_ROUTES:
            await send_json(send, 404, error_body(404, "Not Found", "NotFoundError"))
            return
        method = NATIVE_ROUTES[route]
        if scope["method"] != method:
            await send_json(send, 405, error_body(405, f"use {method}", "MethodNotAllowed"),
                            [(b"allow", method.encode())])
            return
        raw = b""
        if method == "POST":
            hdrs = dict(scope.get("headers") or [])
            got = await body_or_answer(receive, send, self.config.max_body_bytes,
                                       hdrs.get(b"content-length"))
            if isinstance(got, int):
                return
            raw = got
        query = {k: v[-1] for k, v in parse_qs(scope.get("query_string", b"").decode(
            "latin-1")).items()}
        try:
            status, body = await self.handle(route, query, raw, arrived=arrived)
        except _Refusal as r:
            status, body = r.status, error_body(r.status, r.message, r.kind)
        if route == Routes.HEALTH and status == 200:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        if isinstance(body, _Published):
            await send_json(send, status, body.body, body.headers)
            return
        await send_json(send, status, body)

    async def aclose(self) -> None:
        rnd = self.round
        if rnd is not None:
            self._end(rnd, await self.backend.expire(
                rnd.handle, "service shut down during a native round", rnd.writes))
        await self.backend.aclose()

    # ------------------------------------------------------------ routes
    async def handle(self, route: str, query: Mapping[str, str], raw: bytes, *,
                     arrived: float | None = None) -> tuple[int, Any]:
        b = self.backend
        if route == Routes.HEALTH:
            why = b.health()
            return (200, None) if why is None else (503, error_body(503, why, "Unavailable"))
        if route == Routes.IS_PAUSED:
            return 200, {"is_paused": self.round is not None or b.paused()}
        if route == Routes.WEIGHT_INFO:
            return 200, {"weight_version": b.weight_version()}
        if route in (Routes.MODELS, Routes.VERSION, Routes.SERVER_INFO, Routes.GET_WORLD_SIZE):
            return await b.relay("GET", route, query, None)
        if route == Routes.RESET_PREFIX:
            # Part of the round (or after it): never a mutation of the weights. The
            # round's own reset is the runner's, checked by its body; this one is relayed.
            if set(query) - {"reset_external"}:
                raise _Refusal(422, "only reset_external is passed on: a reset that "
                               "preempts running requests is the round's own decision",
                               "BadRequestError")
            return await b.relay("POST", route, query, None)
        body = _json_object(raw, route)
        async with self._lock:
            if route == Routes.INIT_TRANSFER:
                if self.round is not None:
                    raise _Refusal(409, "a round is open: initialise the weight transfer "
                                   "engine before /pause or /start_weight_update")
                return await b.init(body)
            if route == Routes.PAUSE:
                return await self._pause(query, arrived)
            if route == Routes.START_UPDATE:
                return await self._start(body, arrived)
            if route == Routes.UPDATE_WEIGHTS:
                return await self._update(body, raw)
            if route == Routes.FINISH_UPDATE:
                return await self._finish(body)
            assert route == Routes.RESUME
            return await self._resume()

    async def _pause(self, query: Mapping[str, str], arrived: float | None) -> tuple[int, Any]:
        mode = query.get("mode", "abort")
        if mode not in _MODES:
            raise _Refusal(422, f"mode must be one of {', '.join(_MODES)}, got {mode!r}",
                           "BadRequestError")
        if query.get("clear_cache", "true").lower() not in ("true", "false", "1", "0"):
            raise _Refusal(422, "clear_cache must be a boolean", "BadRequestError")
        if self.round is None:
            await self._open("pause", mode, arrived)
        return 200, {"status": "paused"}

    async def _start(self, body: dict[str, Any], arrived: float | None) -> tuple[int, Any]:
        rnd = self.round
        if rnd is not None and rnd.started:
            raise _Refusal(409, "this round's weight update has already started (one "
                           "trainer, one start per round)")
        if rnd is None:
            rnd = await self._open("start", "wait", arrived)
        await self._engine(rnd, Routes.START_UPDATE, body or None, mutation_started=False)
        rnd.started = True
        return 200, {"message": "Weight update started"}

    async def _update(self, body: dict[str, Any], raw: bytes) -> tuple[int, Any]:
        rnd = self.round
        if rnd is None or not rnd.started or rnd.finished:
            raise _Refusal(409, "no weight update is open: /start_weight_update first")
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise _Refusal(422, "update_info must be an object", "BadRequestError")
        names = _manifest_of(info, self.manifest)
        twice = sorted(set(names) & set(rnd.written))
        if twice:
            await self._fail(rnd, FailureKind.BAD_EVIDENCE,
                             f"parameters written twice in one round: {twice[:5]}")
            raise _Refusal(409, "parameters written twice in one round")
        # Forwarded as sent: the bytes just read (a large round's names are not
        # encoded a second time).
        await self._engine(rnd, Routes.UPDATE_WEIGHTS, raw, mutation_started=True)
        rnd.written.update(names)
        rnd.writes += 1
        return 200, {"message": "Weights updated"}

    async def _finish(self, body: dict[str, Any]) -> tuple[int, Any]:
        rnd = self.round
        if rnd is None or not rnd.started or rnd.finished:
            raise _Refusal(409, "no weight update is open to finish (a replayed finish "
                           "changes nothing)")
        wv = body.get("weight_version")
        if wv is not None and not isinstance(wv, str):
            raise _Refusal(422, "weight_version must be a string", "BadRequestError")
        rnd.trainer_label = wv
        # Forwarded with the round's own label(s), whatever the trainer sent.
        await self._engine(rnd, Routes.FINISH_UPDATE, {"weight_version": rnd.label},
                           mutation_started=True)
        rnd.finished = True
        answer = {"message": "Weight update finished"}
        if rnd.opened_by == "start":
            return 200, await self._close(rnd, answer)
        return 200, answer

    async def _resume(self) -> tuple[int, Any]:
        rnd = self.round
        if rnd is None:
            return 200, {"status": "resumed"}
        if not rnd.started:
            self._end(rnd, await self.backend.fail(rnd.handle, FailureKind.REFUSED,
                                                   "paused and resumed with nothing sent"))
            return 200, {"status": "resumed"}
        if not rnd.finished:
            await self._fail(rnd, FailureKind.ERROR, "resumed before /finish_weight_update: "
                             "the weights may be half-written")
            raise _Refusal(409, "resumed before /finish_weight_update")
        return 200, await self._close(rnd, {"status": "resumed"})

    # ------------------------------------------------------------ the round
    async def _open(self, opened_by: str, mode: str, arrived: float | None) -> _Round:
        floor = self.backend.floor
        if floor > VerificationLevel.DECLARED:
            raise _Refusal(422, f"this gateway's verification floor is {floor.wire!r}; a "
                           f"trainer that declares nothing reaches {NATIVE_LEVEL!r} "
                           "(serve --min-verification declared to accept it)",
                           "BadRequestError")
        self.rounds += 1
        t0 = time.monotonic()
        handle, label = await self.backend.open(self.rounds)
        rnd = _Round(handle, label, opened_by, mode)
        rnd.seconds["open"] = time.monotonic() - t0
        if arrived is not None:  # the opening call's wait for the round lock, its body
            rnd.seconds["before_open"] = t0 - arrived
        self.round = rnd
        rnd.timer = asyncio.get_running_loop().create_task(self._deadline(rnd))
        return rnd

    async def _close(self, rnd: _Round, answer: dict[str, Any]) -> _Published:
        """Report what was forwarded, then the backend's close: reset, validate, publish;
        ``answer`` (vLLM's body) with the headers that say what was published."""
        missing = sorted(set(self.manifest) - set(rnd.written))
        if missing:
            await self._fail(rnd, FailureKind.BAD_EVIDENCE,
                             f"{len(missing)} parameters the last round wrote were not "
                             f"written: {missing[:5]}")
            raise _Refusal(409, "the round did not cover the last round's parameters")
        # What the round wrote, in the journal before anything is published: the
        # manifest's digest names the exact set a sample's version was made from.
        digest = hashlib.sha256(json.dumps(
            sorted([n, d, list(s)] for n, (d, s) in rnd.written.items())).encode()).hexdigest()
        note = {"level": NATIVE_LEVEL, "values_checked": False,  # no reference was declared
                "opened_by": rnd.opened_by, "pause_mode": rnd.mode,
                "tensors": len(rnd.written), "update_calls": rnd.writes,
                "sent_manifest_digest": digest, "trainer_label": rnd.trainer_label,
                "gateway_s": {k: round(v, 6) for k, v in rnd.seconds.items()}}
        result = await self.backend.close(rnd.handle, dict(rnd.written), note)
        self._end(rnd, result)
        if result.get("status") != "published":
            raise _Refusal(409, f"the round failed ({result.get('classification')}): "
                           f"{result.get('reason')}")
        self.manifest = dict(rnd.written)
        return _Published(answer, (
            (VERSION_HEADER.encode(), str(result.get("label", rnd.label)).encode()),
            (VERIFICATION_HEADER.encode(), str(result.get("verification", NATIVE_LEVEL)).encode())))

    async def _fail(self, rnd: _Round, kind: FailureKind, reason: str, *,
                    status: int = 409) -> None:
        """End the round through the failure policy; raises the 4xx (or 504) ``status``."""
        result = await self.backend.fail(rnd.handle, kind, reason)
        self._end(rnd, result)
        raise _Refusal(status, f"the round failed ({result.get('classification')}): "
                       f"{result.get('reason') or reason}")

    async def _deadline(self, rnd: _Round) -> None:
        await asyncio.sleep(self.config.lease_s)
        async with self._lock:
            if self.round is rnd:
                self._end(rnd, await self.backend.expire(
                    rnd.handle, f"the round was not finished within {self.config.lease_s:g}s",
                    rnd.writes))

    def _end(self, rnd: _Round, result: dict[str, Any]) -> None:
        if self.round is rnd:
            self.round = None
        self.last = result
        t, rnd.timer = rnd.timer, None
        if t is not None and t is not asyncio.current_task():
            t.cancel()

    async def _engine(self, rnd: _Round, route: str, body: dict[str, Any] | bytes | None, *,
                      mutation_started: bool) -> None:
        """A round's call to vLLM: any failure ends the round (TAINTED once written)."""
        t0 = time.monotonic()
        got = await self.backend.send(rnd.handle, route, body)
        key = route.lstrip("/")
        rnd.seconds[key] = rnd.seconds.get(key, 0.0) + time.monotonic() - t0
        if got is None:
            return
        wrote = mutation_started or rnd.writes > 0
        kind = (FailureKind.REFUSED if not wrote else
                FailureKind.TIMEOUT if got.timeout else FailureKind.ERROR)
        await self._fail(rnd, kind, got.reason, status=got.status)


def _json_object(raw: bytes, route: str) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _Refusal(400, f"malformed JSON for {route}: {exc}", "BadRequestError") from exc
    if not isinstance(obj, dict):
        raise _Refusal(422, f"the body of {route} must be a JSON object", "BadRequestError")
    return obj


def _manifest_of(info: Mapping[str, Any], last: Mapping[str, tuple[str, tuple[int, ...]]]
                 ) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from vLLM's update_info; an empty one carries ``last``."""
    names, dtypes, shapes = (info.get("names"), info.get("dtype_names"), info.get("shapes"))
    if not names and not dtypes and not shapes and last:
        return dict(last)  # vLLM 0.33+: an unchanged round's metadata sent empty
    if not isinstance(names, list) or not names or len(names) > _MAX_NAMES or not all(
            isinstance(n, str) and n for n in names):
        raise _Refusal(422, "update_info.names must be a non-empty list of parameter names",
                       "BadRequestError")
    dtypes = dtypes if isinstance(dtypes, list) else [""] * len(names)
    shapes = shapes if isinstance(shapes, list) else [[]] * len(names)
    if len(dtypes) != len(names) or len(shapes) != len(names):
        raise _Refusal(422, "update_info.names, dtype_names and shapes differ in length",
                       "BadRequestError")
    if len(set(names)) != len(names):
        raise _Refusal(422, "update_info.names repeats a parameter", "BadRequestError")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n, d, s in zip(names, dtypes, shapes, strict=True):
        if not isinstance(d, str) or not isinstance(s, list) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s):
            raise _Refusal(422, f"update_info: bad dtype or shape for {n!r}", "BadRequestError")
        out[n] = (d, tuple(s))
    return out
