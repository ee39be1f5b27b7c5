"""The gateway in front of a fleet: version-aware routing onto per-replica data planes.

Every replica keeps the single-engine data plane (``service.proxy.DataPlane``:
admission through *its* controller, the binding, the version headers and
body field, the release); this app only decides *which* replica a request
goes to, before anything is admitted:

    read + check the body -> the request's policy and group (``fleet.routing``)
        -> choose among the replicas in the pool (or 4xx / 503 + Retry-After,
           or wait in the bounded queue) -> that replica's data plane

A request refused here reaches no replica: nothing is admitted, nothing is
forwarded. The routing fields (``rolloutcore_policy``, ``rolloutcore_group``)
are removed from the body before it is forwarded. Every answer carries, besides the
replica's own version headers (which equal vLLM's ``weight_versions``
spans), the fleet's: ``X-RolloutCore-Fleet-Version`` (generation),
``X-RolloutCore-Fleet-Label``, ``X-RolloutCore-Replica`` and the policy
applied. A replica its data plane could not reach (502) is reported to the
coordinator at once (``suspect``), which checks and fences it.

Routes::

    POST /v1/completions, /v1/chat/completions, /inference/v1/generate  routed
    GET  /v1/models, /version, /tokenizer_info; POST /tokenize, /detokenize
                                              passed to a serving replica
    GET  /control/status                      replicas, versions, loads   control token
    POST /control/fleet/updates               start an update (checkpoint) control token
    GET  /control/fleet/updates/{id}          its progress and result     control token
    GET  /metrics                             Prometheus text            open
    GET  /health                              200 while a replica serves open
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, MutableMapping
from typing import Any

import anyio
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rolloutcore.errors import BadInput, RolloutCoreError, UpdateRefused
from rolloutcore.fleet.coordinator import FleetCoordinator, FleetUpdateFailed, FleetUpdateResult
from rolloutcore.fleet.routing import (
    GROUP_FIELD,
    GROUP_HEADER,
    POLICY_FIELD,
    POLICY_HEADER,
    Policy,
    Router,
    RouteRefused,
    group_key,
    request_policy,
)
from rolloutcore.fleet.rules import ReplicaState
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.metrics import CONTENT_TYPE, ServiceMetrics
from rolloutcore.service.proxy import (
    DATA_ROUTES,
    READ_ONLY_ROUTES,
    DataPlane,
    ReadOnlyRoutes,
    error_body,
    send_json,
)

__all__ = [
    "FLEET_LABEL_HEADER",
    "FLEET_VERSION_HEADER",
    "POLICY_APPLIED_HEADER",
    "REPLICA_HEADER",
    "FleetGateway",
    "FleetMetrics",
    "create_fleet_app",
]

FLEET_VERSION_HEADER = "x-rolloutcore-fleet-version"
FLEET_LABEL_HEADER = "x-rolloutcore-fleet-label"
REPLICA_HEADER = "x-rolloutcore-replica"
POLICY_APPLIED_HEADER = "x-rolloutcore-policy"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Updater = Callable[[Mapping[str, Any]], FleetUpdateResult]

_WANTED = frozenset({b"authorization", b"content-type", b"content-length",
                     POLICY_HEADER.encode(), GROUP_HEADER.encode()})


class FleetMetrics:
    """The fleet's own series, read from the coordinator at scrape time (no drift)."""

    def __init__(self, coordinator: FleetCoordinator) -> None:
        self._c = coordinator
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.replica_state = Gauge("rolloutcore_fleet_replica_state",
                                   "1 for the pool state each replica is in",
                                   ["replica", "state"], registry=r)
        self.replica_generation = Gauge(
            "rolloutcore_fleet_replica_generation",
            "fleet version each replica holds (-1: none)", ["replica"], registry=r)
        self.replica_load = Gauge("rolloutcore_fleet_replica_active_rollouts",
                                  "rollouts admitted on each replica", ["replica"], registry=r)
        self.serving = Gauge("rolloutcore_fleet_replicas_serving",
                             "replicas in the pool", registry=r)
        self.newest = Gauge("rolloutcore_fleet_newest_generation",
                            "newest published fleet version (-1: none)", registry=r)
        self.served = Gauge("rolloutcore_fleet_version_replicas",
                            "replicas serving each published version", ["label"], registry=r)
        self.routed = Counter("rolloutcore_fleet_routed_total",
                              "requests routed, by replica and policy", ["replica", "policy"],
                              registry=r)
        self.refused = Counter("rolloutcore_fleet_refused_total",
                               "requests refused before any replica, by status", ["status"],
                               registry=r)
        self.updates = Counter("rolloutcore_fleet_updates_total",
                               "fleet updates by strategy and outcome",
                               ["strategy", "outcome"], registry=r)

    def render(self) -> bytes:
        st = self._c.status()
        for rep in st["replicas"]:
            for s in ReplicaState:
                self.replica_state.labels(rep["name"], s.value).set(
                    1 if rep["state"] == s.value else 0)
            g = rep["fleet_generation"]
            self.replica_generation.labels(rep["name"]).set(-1 if g is None else g)
            self.replica_load.labels(rep["name"]).set(rep["load"])
        self.serving.set(st["serving"])
        self.newest.set(-1 if st["newest"] is None else st["newest"]["generation"])
        for v in st["published"]:
            self.served.labels(v["label"]).set(st["versions_served"].get(v["label"], 0))
        return bytes(generate_latest(self.registry))


@dataclasses.dataclass
class _UpdateJob:
    job_id: int
    request: dict[str, Any]
    state: str = "running"
    result: dict[str, Any] | None = None
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)


class FleetGateway:
    """What the fleet app holds (``app.state.fleet``)."""

    def __init__(self, coordinator: FleetCoordinator, config: ServiceConfig,
                 default_policy: Policy, updater: Updater | None,
                 check_update: Callable[[Mapping[str, Any]], object] | None = None) -> None:
        self.coordinator = coordinator
        self.config = config
        self.default_policy = default_policy
        self.updater = updater
        self.check_update = check_update
        self.router = Router()
        self.metrics = FleetMetrics(coordinator)
        self.planes: dict[str, DataPlane] = {}
        self.read_only: dict[str, ReadOnlyRoutes] = {}
        self.waiting = 0
        self.jobs: dict[int, _UpdateJob] = {}
        self._job_lock = threading.Lock()
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        for name, rep in coordinator.replicas.items():
            if rep.url is None:
                raise BadInput(f"replica {name} has no URL to route to")
            cfg = dataclasses.replace(config, upstream_url=rep.url)
            m = ServiceMetrics(rep.controller)
            rep.controller.add_listener(m.listener)
            self.planes[name] = DataPlane(rep.controller, cfg, m)
            self.read_only[name] = ReadOnlyRoutes(cfg, m)
        coordinator.on_change(self._wake_threadsafe)

    def _wake_threadsafe(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        ev, self._changed = self._changed, asyncio.Event()
        if ev is not None:
            ev.set()

    def status(self) -> dict[str, Any]:
        st = self.coordinator.status()
        st["routing"] = {"default_policy": str(self.default_policy), "queued": self.waiting,
                         "queue_max": self.config.queue_max}
        return st

    # ------------------------------------------------------------------ control
    def start_update(self, body: Mapping[str, Any]) -> _UpdateJob:
        if self.updater is None:
            raise BadInput("this gateway was started without an update source")
        updater = self.updater
        if self.check_update is not None:
            self.check_update(body)  # BadInput before any job exists
        with self._job_lock:
            busy = next((j for j in self.jobs.values() if j.state == "running"), None)
            if busy is not None:
                raise UpdateRefused(f"fleet update {busy.job_id} is still running; one at a "
                                    "time")
            jid = len(self.jobs) + 1
            job = self.jobs[jid] = _UpdateJob(jid, dict(body))

        def run() -> None:
            try:
                res = updater(body)
            except FleetUpdateFailed as exc:
                job.state, job.result, job.error = "failed", exc.result.to_dict(), str(exc)
                self.metrics.updates.labels(exc.result.strategy.value, "nothing_published").inc()
            except RolloutCoreError as exc:
                job.state, job.error = "refused", str(exc)
            except Exception as exc:  # reported to whoever polls, never lost
                job.state, job.error = "error", f"{type(exc).__name__}: {exc}"
            else:
                job.state, job.result = "published", res.to_dict()
                self.metrics.updates.labels(res.strategy.value, "published").inc()

        threading.Thread(target=run, name=f"rc-fleet-update-{jid}", daemon=True).start()
        return job

    # ------------------------------------------------------------------ data plane
    async def route(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._route(scope, receive, send)

    async def _refuse(self, send: Send, exc: RouteRefused) -> int:
        headers: list[tuple[bytes, bytes]] = []
        if exc.status == 503:
            headers.append((b"x-should-retry", b"true"))
            if exc.retry_after_s is not None:
                headers.append((b"retry-after",
                                str(max(1, math.ceil(exc.retry_after_s))).encode()))
        self.metrics.refused.labels(str(exc.status)).inc()
        await send_json(send, exc.status, error_body(exc.status, str(exc), exc.kind), headers)
        return exc.status

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> int:
        cfg = self.config
        if scope["method"] != "POST":
            await send_json(send, 405, error_body(405, "use POST", "MethodNotAllowed"),
                            [(b"allow", b"POST")])
            return 405
        hdrs: dict[bytes, bytes] = {}
        for k, v in scope["headers"]:
            if k in _WANTED and k not in hdrs:
                hdrs[k] = bytes(v)
        auth = check_bearer(hdrs.get(b"authorization"), cfg.data_token)
        if not auth.ok:
            assert auth.status is not None
            await send_json(send, auth.status, error_body(auth.status, auth.reason,
                                                          "Unauthorized"),
                            [(b"www-authenticate", b"Bearer")])
            return auth.status
        if hdrs.get(b"content-type", b"").split(b";")[0].strip().lower() != b"application/json":
            await send_json(send, 415, error_body(415, "Content-Type must be application/json",
                                                  "UnsupportedMediaType"))
            return 415
        raw = await self._body(receive, send, hdrs.get(b"content-length"))
        if isinstance(raw, int):
            return raw
        try:
            payload = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            await send_json(send, 400, error_body(400, f"malformed JSON: {exc}", "BadRequest"))
            return 400
        if not isinstance(payload, dict):
            await send_json(send, 400, error_body(400, "the request body must be a JSON object",
                                                  "BadRequest"))
            return 400
        try:
            ph, gh = hdrs.get(POLICY_HEADER.encode()), hdrs.get(GROUP_HEADER.encode())
            policy = request_policy(None if ph is None else ph.decode("latin-1"), payload,
                                    self.default_policy)
            group = group_key(None if gh is None else gh.decode("latin-1"), payload)
        except RouteRefused as exc:
            return await self._refuse(send, exc)
        if POLICY_FIELD in payload or GROUP_FIELD in payload:
            payload.pop(POLICY_FIELD, None)
            payload.pop(GROUP_FIELD, None)
            raw = json.dumps(payload, separators=(",", ":")).encode()
        try:
            choice = await self._choose(policy, group)
        except RouteRefused as exc:
            return await self._refuse(send, exc)
        name = choice.name
        ver = next((v for v in self.coordinator.versions if v.generation == choice.generation),
                   None)
        extra = [(FLEET_VERSION_HEADER.encode(), str(choice.generation).encode()),
                 (FLEET_LABEL_HEADER.encode(), (ver.label if ver else "").encode()),
                 (REPLICA_HEADER.encode(), name.encode()),
                 (POLICY_APPLIED_HEADER.encode(), str(policy).encode())]
        self.metrics.routed.labels(name, policy.kind.value).inc()
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        headers.append((b"content-length", str(len(raw)).encode()))
        inner = dict(scope)
        inner["headers"] = headers
        given = False

        async def replay() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": raw, "more_body": False}
            return await receive()

        seen = {"status": 0}

        async def decorate(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                seen["status"] = int(msg["status"])
                msg = dict(msg)
                msg["headers"] = [*msg.get("headers", []), *extra]
            await send(msg)

        await self.planes[name](inner, replay, decorate)
        if seen["status"] == 502:
            self.coordinator.suspect(name)
            self.router.forget(name)
        return seen["status"]

    async def _choose(self, policy: Policy, group: str | None) -> Any:
        cfg = self.config
        try:
            return self.router.choose(self.coordinator.view(), policy, group)
        except RouteRefused as exc:
            if exc.status != 503 or cfg.queue_max == 0 or self.waiting >= cfg.queue_max:
                raise
        self.waiting += 1
        deadline = time.monotonic() + cfg.queue_wait_s
        try:
            while True:
                changed = self._changed
                assert changed is not None
                left = deadline - time.monotonic()
                with anyio.move_on_after(max(0.0, min(left, 0.5))):
                    await changed.wait()
                try:
                    return self.router.choose(self.coordinator.view(), policy, group)
                except RouteRefused as exc:
                    if exc.status != 503 or time.monotonic() >= deadline:
                        raise
        finally:
            self.waiting -= 1

    async def _body(self, receive: Receive, send: Send, cl: bytes | None) -> bytes | int:
        limit = self.config.max_body_bytes
        if cl is not None:
            try:
                declared = int(cl)
            except ValueError:
                await send_json(send, 400, error_body(400, "Content-Length is not an integer",
                                                      "BadRequest"))
                return 400
            if declared > limit:
                await send_json(send, 413, error_body(413, f"request body exceeds {limit} "
                                                      "bytes", "PayloadTooLarge"))
                return 413
        chunks: list[bytes] = []
        n = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return 499
            b = msg.get("body", b"")
            n += len(b)
            if n > limit:
                await send_json(send, 413, error_body(413, f"request body exceeds {limit} bytes",
                                                      "PayloadTooLarge"))
                return 413
            chunks.append(b)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def read_only_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = self.coordinator.serving() or list(self.read_only)
        await self.read_only[serving[0]](scope, receive, send)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        for p in self.planes.values():
            await p.start()
        for r in self.read_only.values():
            await r.start()

    async def aclose(self) -> None:
        for r in self.read_only.values():
            await r.aclose()
        for p in self.planes.values():
            await p.aclose()


def create_fleet_app(coordinator: FleetCoordinator, config: ServiceConfig, *,
                     default_policy: str | Policy = "latest",
                     updater: Updater | None = None, supervise: bool = True,
                     check_update: Callable[[Mapping[str, Any]], object] | None = None
                     ) -> Starlette:
    """The fleet's gateway over a bootstrapped coordinator.

    ``config`` is the single-engine service's (tokens, limits, upstream
    timeouts, queue); its ``upstream_url`` is replaced by each replica's.
    ``updater`` runs a ``POST /control/fleet/updates`` body (a checkpoint,
    a strategy ...) as a fleet update; without it that route answers 400.
    ``check_update`` checks such a body before anything starts (its
    ``BadInput`` is the route's 400); a second update while one runs is 409.
    """
    if not isinstance(coordinator, FleetCoordinator):
        raise BadInput("coordinator must be a FleetCoordinator")
    if not isinstance(config, ServiceConfig):
        raise BadInput("config must be a ServiceConfig")
    policy = default_policy if isinstance(default_policy, Policy) else Policy.parse(
        default_policy)
    gw = FleetGateway(coordinator, config, policy, updater, check_update)

    def denied(request: Request) -> Response | None:
        auth = check_bearer(request.headers.get("authorization"), config.control_token)
        if auth.ok:
            return None
        return JSONResponse({"error": auth.reason}, status_code=auth.status or 401,
                            headers={"www-authenticate": "Bearer"})

    async def status(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        return JSONResponse(gw.status())

    async def begin(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        if not isinstance(body, dict):
            return JSONResponse({"error": "the body must be a JSON object"}, status_code=400)
        try:
            job = gw.start_update(body)
        except UpdateRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except BadInput as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"update": job.job_id, "state": job.state,
                             "status_url": f"/control/fleet/updates/{job.job_id}"},
                            status_code=202)

    async def get_update(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        raw = request.path_params["job"]
        job = gw.jobs.get(int(raw)) if raw.isdigit() and len(raw) < 10 else None
        if job is None:
            return JSONResponse({"error": "no such update"}, status_code=404)
        return JSONResponse({"update": job.job_id, "state": job.state, "result": job.result,
                             "error": job.error, "request": job.request})

    async def metrics(request: Request) -> Response:
        return Response(gw.metrics.render(), media_type=CONTENT_TYPE)

    async def health(request: Request) -> Response:
        n = len(coordinator.serving())
        return JSONResponse({"status": "ok" if n else "unavailable", "serving": n},
                            status_code=200 if n else 503)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await gw.start()
        if supervise:
            coordinator.start_supervisor()
        try:
            yield
        finally:
            await gw.aclose()

    routes = [
        Route("/control/status", status, methods=["GET"]),
        Route("/control/fleet/updates", begin, methods=["POST"]),
        Route("/control/fleet/updates/{job}", get_update, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.fleet = gw
    inner = app.build_middleware_stack()
    data_paths = frozenset(DATA_ROUTES)

    async def fast_path(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in data_paths:
            await gw.route(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in READ_ONLY_ROUTES:
            await gw.read_only_route(scope, receive, send)
        else:
            await inner(scope, receive, send)

    app.middleware_stack = fast_path
    return app
