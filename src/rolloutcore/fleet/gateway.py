"""The gateway in front of a fleet: the single gateway's data plane, with a router in front.

There is one data plane (``service.proxy.DataPlane``) for the whole fleet:
one parse, one auth, the same deadlines, limits, salting and recording as a
gateway over one engine. What a fleet adds is where an admitted request
goes, ``FleetAdmission`` (a ``service.admission.Admission``)::

    read + check the body (the data plane's own checks)
        -> the request's policy and group (``fleet.routing``), removed from the body
        -> choose among the replicas in the pool AND bind on that replica's
           controller, at the engine version the choice was made for, in one step
           (or 4xx; or 503 + Retry-After; or wait in the bounded queue)
        -> forward to that replica's vLLM, relay, release

Choosing reads published snapshots only (the pool's, each controller's):
no request takes the fleet's lock or a controller's lock to route. The
binding is the controller's, asked for exactly the engine version the router
saw the replica serve its fleet version as; if the engine moved meanwhile
(a rolling update took it), nothing is bound and the request is routed again,
so an answer's fleet headers always name the version that generated it.

Every answer carries, besides the replica's own version headers (which equal
vLLM's ``weight_versions`` spans), the fleet's: ``X-RolloutCore-Fleet-Version``
(generation), ``X-RolloutCore-Fleet-Label``, ``X-RolloutCore-Replica`` and the
policy applied; the ``rolloutcore`` body field and a recorded sample say the
same. A connection a replica's engine refused is reported to the coordinator
(``suspect``): its engine's own signal. A client's answer, however large, is
not one.

Routes::

    POST /v1/completions, /v1/chat/completions, /inference/v1/generate  routed
    GET  /v1/models, /version, /tokenizer_info; POST /tokenize, /detokenize
                                              passed to a serving replica
    GET  /control/status                      replicas, versions, loads   control token
    POST /control/fleet/updates               start an update (checkpoint) control token
    POST/GET /control/adapters                LoRA-adapter versions (adapter_gateway)
    GET  /control/fleet/updates/{id}          its progress and result     control token
    GET  /metrics                             Prometheus text            open
    GET  /health                              200 while a replica serves open
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import ReplicaState
from rolloutcore.core.versions import Binding
from rolloutcore.engine.routes import NATIVE_PREFIX
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    InvalidTransition,
    RolloutCoreError,
    RouteRefused,
    UpdateRefused,
)
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import FleetUpdateFailed, FleetUpdateResult
from rolloutcore.fleet.native import FleetRounds
from rolloutcore.fleet.routing import (
    GROUP_FIELD,
    GROUP_HEADER,
    POLICY_FIELD,
    POLICY_HEADER,
    Policy,
    ReplicaView,
    Router,
    group_key,
    request_policy,
)
from rolloutcore.service.admission import Target
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.control_body import control_json
from rolloutcore.service.metrics import CONTENT_TYPE, ServiceMetrics
from rolloutcore.service.native import NativeRoutes
from rolloutcore.service.native_lora import LORA_ROUTES, refuse_lora
from rolloutcore.service.passthrough import READ_ONLY_ROUTES, ReadOnlyRoutes
from rolloutcore.service.proxy import DATA_ROUTES, DataPlane, FinishedRequest

__all__ = [
    "FLEET_LABEL_HEADER",
    "FLEET_VERSION_HEADER",
    "POLICY_APPLIED_HEADER",
    "REPLICA_HEADER",
    "FleetAdmission",
    "FleetGateway",
    "FleetMetrics",
    "JobState",
    "create_fleet_app",
]

FLEET_VERSION_HEADER = "x-rolloutcore-fleet-version"
FLEET_LABEL_HEADER = "x-rolloutcore-fleet-label"
REPLICA_HEADER = "x-rolloutcore-replica"
POLICY_APPLIED_HEADER = "x-rolloutcore-policy"
Updater = Callable[[Mapping[str, Any]], FleetUpdateResult]


class FleetAdmission:
    """A fleet's ``Admission``: the router in front of the one data plane (module doc)."""

    headers = frozenset({POLICY_HEADER.encode(), GROUP_HEADER.encode()})

    def __init__(self, coordinator: FleetCoordinator, default_policy: Policy) -> None:
        self.coordinator = coordinator
        self.default_policy = default_policy
        self.router = Router()
        self._replicas = coordinator.replicas
        for name, rep in self._replicas.items():
            if rep.url is None:
                raise BadInput(f"replica {name} has no URL to route to")
        # One info dict per (replica, fleet version): the data plane builds each
        # answer's decorations once per such dict.
        self._infos: dict[tuple[str, int], dict[str, Any]] = {}

    def upstreams(self) -> Mapping[str, str]:
        return {n: str(r.url) for n, r in self._replicas.items()}

    def controllers(self) -> Mapping[str, LifecycleController]:
        """Each replica's controller (the data plane carries each one's requests under
        keep or recompute as it does one engine's)."""
        return {n: r.controller for n, r in self._replicas.items()}

    def routing(self, payload: dict[str, Any], headers: Mapping[bytes, bytes]
                ) -> tuple[tuple[Policy, str | None], bool]:
        ph, gh = headers.get(POLICY_HEADER.encode()), headers.get(GROUP_HEADER.encode())
        policy = request_policy(None if ph is None else ph.decode("latin-1"), payload,
                                self.default_policy)
        group = group_key(None if gh is None else gh.decode("latin-1"), payload)
        changed = POLICY_FIELD in payload or GROUP_FIELD in payload
        payload.pop(POLICY_FIELD, None)
        payload.pop(GROUP_FIELD, None)
        return (policy, group), changed

    def try_admit(self, rollout_id: str, routing: tuple[Policy, str | None]
                  ) -> tuple[Binding, Target]:
        """Choose a replica and bind on its controller at the version chosen for.

        A replica whose engine moved since the snapshot (or that refuses for any
        other reason) is left out and the choice made again, once per replica;
        then the request is a retryable 503. ``RouteRefused`` (4xx) when the
        policy can never be served.
        """
        policy, group = routing
        return self._admit(rollout_id, policy, group, None, "no replica",
                           lambda choice, b: self._target(choice, policy))

    def _admit(self, rollout_id: str, policy: Policy, group: str | None,
               left_out: set[str] | None, who: str,
               target: Callable[[ReplicaView, Binding], Target]) -> tuple[Binding, Target]:
        """``try_admit``'s loop; ``left_out`` (never chosen; ``None``: the router's 503 is
        raised as it is); ``target`` may refuse the binding (it is released)."""
        tried = set() if left_out is None else left_out
        last: AdmissionRefused | None = None
        for _ in range(len(self._replicas)):
            try:
                choice = self.router.choose(self.coordinator.view(), policy, group,
                                            exclude=tried)
            except RouteRefused as exc:
                if exc.status != 503 or left_out is None:
                    raise
                break
            ctl = self._replicas[choice.name].controller
            try:
                b = ctl.admit(rollout_id, expect=choice.engine_version)
            except AdmissionRefused as exc:
                tried.add(choice.name)
                last = exc
                continue
            try:
                return b, target(choice, b)
            except AdmissionRefused as exc:
                ctl.complete(rollout_id)
                tried.add(choice.name)
                last = exc
        raise RouteRefused(503, f"{who} could admit it under {policy} now"
                           + (f" (last: {last.reason})" if last is not None else ""),
                           retry_after_s=self.coordinator.config.retry_after_s,
                           kind="ServiceUnavailable")

    def _target(self, choice: ReplicaView, policy: Policy) -> Target:
        gen = choice.generation
        assert gen is not None
        info = self._infos.get((choice.name, gen))
        if info is None:
            ver = self.coordinator.pool.version(gen)
            info = self._infos[(choice.name, gen)] = {
                "fleet_version": gen, "fleet_label": "" if ver is None else ver.label,
                "replica": choice.name}
        headers = ((FLEET_VERSION_HEADER.encode(), str(gen).encode()),
                   (FLEET_LABEL_HEADER.encode(), str(info["fleet_label"]).encode()),
                   (REPLICA_HEADER.encode(), choice.name.encode()),
                   (POLICY_APPLIED_HEADER.encode(), str(policy).encode()))
        return Target(choice.name, self._replicas[choice.name].controller, info, headers)

    def worth_retry(self) -> bool:
        return True  # woken by a change of the pool or of an engine: ask again

    def on_change(self, wake: Callable[[], None]) -> None:
        self.coordinator.on_change(wake)

    def observe(self, target: Target, ok: bool, refused: bool) -> None:
        self.router.observe(target.name, ok)
        if refused:
            self.router.forget(target.name)
            self.coordinator.suspect(target.name)


class FleetMetrics:
    """The fleet's own series, read from the pool's snapshot at scrape time (no drift)."""

    def __init__(self, coordinator: FleetCoordinator, registry: CollectorRegistry) -> None:
        self._c = coordinator
        r = self.registry = registry
        self.replica_state = Gauge("rolloutcore_fleet_replica_state",
                                   "1 for the pool state each replica is in",
                                   ["replica", "state"], registry=r)
        self.replica_generation = Gauge(
            "rolloutcore_fleet_replica_generation",
            "fleet version each replica holds (-1: none)", ["replica"], registry=r)
        self.replica_load = Gauge("rolloutcore_fleet_replica_active_rollouts",
                                  "rollouts admitted on each replica", ["replica"], registry=r)
        self.engine_state = Gauge("rolloutcore_fleet_engine_state",
                                  "1 for the lifecycle state each replica's engine is in",
                                  ["replica", "state"], registry=r)
        self.serving = Gauge("rolloutcore_fleet_replicas_serving",
                             "replicas in the pool", registry=r)
        self.newest = Gauge("rolloutcore_fleet_newest_generation",
                            "newest published fleet version (-1: none)", registry=r)
        self.served = Gauge("rolloutcore_fleet_version_replicas",
                            "replicas serving each published version", ["label"], registry=r)
        self.updates = Counter("rolloutcore_fleet_updates_total",
                               "fleet updates by strategy and outcome",
                               ["strategy", "outcome"], registry=r)

    def refresh(self) -> None:
        st = self._c.status()
        for rep in st["replicas"]:
            for s in ReplicaState:
                self.replica_state.labels(rep["name"], s.value).set(
                    1 if rep["state"] == s.value else 0)
            g = rep["fleet_generation"]
            self.replica_generation.labels(rep["name"]).set(-1 if g is None else g)
            self.replica_load.labels(rep["name"]).set(rep["load"])
            for es in State:
                self.engine_state.labels(rep["name"], es.value).set(
                    1 if rep["engine_state"] == es.value else 0)
        self.serving.set(st["serving"])
        self.newest.set(-1 if st["newest"] is None else st["newest"]["generation"])
        for v in st["published"]:
            self.served.labels(v["label"]).set(st["versions_served"].get(v["label"], 0))


class JobState(enum.StrEnum):
    RUNNING = "running"
    PUBLISHED = "published"
    FAILED = "failed"       # ran, published nothing (``result`` says what each replica did)
    REFUSED = "refused"     # refused before anything changed
    ERROR = "error"         # raised something unexpected (reported, never lost)


#: A control-route update job: running, then exactly one ending.
JOB_TRANSITIONS: Mapping[JobState, frozenset[JobState]] = {
    JobState.RUNNING: frozenset({JobState.PUBLISHED, JobState.FAILED, JobState.REFUSED,
                                 JobState.ERROR}),
}


@dataclasses.dataclass
class _UpdateJob:
    job_id: int
    request: dict[str, Any]
    state: JobState = JobState.RUNNING
    result: dict[str, Any] | None = None
    error: str | None = None
    started: float = dataclasses.field(default_factory=time.time)

    def end(self, state: JobState, *, result: dict[str, Any] | None = None,
            error: str | None = None) -> None:
        if state not in JOB_TRANSITIONS.get(self.state, frozenset()):
            raise InvalidTransition(state.value, self.state.value, "not in JOB_TRANSITIONS")
        self.result, self.error, self.state = result, error, state


class FleetGateway:
    """What the fleet app holds (``app.state.fleet``)."""

    def __init__(self, coordinator: FleetCoordinator, config: ServiceConfig,
                 default_policy: Policy, updater: Updater | None,
                 check_update: Callable[[Mapping[str, Any]], object] | None = None, *,
                 on_finished: Callable[[FinishedRequest], None] | None = None,
                 admission: FleetAdmission | None = None) -> None:
        self.coordinator = coordinator
        self.config = config
        self.default_policy = default_policy
        self.updater = updater
        self.check_update = check_update
        # Another admission: LoRA-adapter versions (fleet.adapter_gateway).
        self.admission = admission or FleetAdmission(coordinator, default_policy)
        self.service_metrics = ServiceMetrics(None)
        self.metrics = FleetMetrics(coordinator, self.service_metrics.registry)
        self.data = DataPlane(self.admission, config, self.service_metrics,
                              on_finished=on_finished)
        self.read_only: dict[str, ReadOnlyRoutes] = {}
        for name, rep in coordinator.replicas.items():
            rep.controller.add_listener(self.service_metrics.listener)
            # The drain policy's stragglers are this data plane's requests.
            rep.runner.stragglers = self.data.abort_stragglers
            self.read_only[name] = ReadOnlyRoutes(
                dataclasses.replace(config, upstream_url=str(rep.url)), self.service_metrics)
        self.jobs: dict[int, _UpdateJob] = {}
        self._job_lock = threading.Lock()
        self.recorder_stats: Callable[[], dict[str, Any]] | None = None
        stats = getattr(on_finished, "stats", None)
        if callable(stats):
            self.recorder_stats = stats
            self.service_metrics.watch_recorder(stats)

    @property
    def router(self) -> Router:
        return self.admission.router

    def status(self) -> dict[str, Any]:
        st = self.coordinator.status()
        st["routing"] = {"default_policy": str(self.default_policy),
                         "queued": self.data.waiting, "queue_max": self.config.queue_max,
                         "requests_in_progress": self.data.in_progress}
        st["recorder"] = None if self.recorder_stats is None else self.recorder_stats()
        return st

    def render_metrics(self) -> bytes:
        self.metrics.refresh()
        return self.service_metrics.render()

    # ------------------------------------------------------------------ control
    def start_update(self, body: Mapping[str, Any]) -> _UpdateJob:
        if self.updater is None:
            raise BadInput("this gateway was started without an update source")
        updater = self.updater
        if self.check_update is not None:
            self.check_update(body)  # BadInput before any job exists
        with self._job_lock:
            busy = next((j for j in self.jobs.values() if j.state is JobState.RUNNING), None)
            if busy is not None:
                raise UpdateRefused(f"fleet update {busy.job_id} is still running; one at a "
                                    "time")
            jid = len(self.jobs) + 1
            job = self.jobs[jid] = _UpdateJob(jid, dict(body))

        def run() -> None:
            try:
                res = updater(body)
            except FleetUpdateFailed as exc:
                job.end(JobState.FAILED, result=exc.result.to_dict(), error=str(exc))
                self.metrics.updates.labels(exc.result.strategy.value, "nothing_published").inc()
            except RolloutCoreError as exc:
                job.end(JobState.REFUSED, error=str(exc))
            except Exception as exc:  # reported to whoever polls, never lost
                job.end(JobState.ERROR, error=f"{type(exc).__name__}: {exc}")
            else:
                job.end(JobState.PUBLISHED, result=res.to_dict())
                self.metrics.updates.labels(res.strategy.value, "published").inc()

        threading.Thread(target=run, name=f"rc-fleet-update-{jid}", daemon=True).start()
        return job

    async def read_only_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        serving = self.coordinator.serving() or list(self.read_only)
        await self.read_only[serving[0]](scope, receive, send)

    async def start(self) -> None:
        await self.data.start()
        for r in self.read_only.values():
            await r.start()

    async def aclose(self) -> None:
        for r in self.read_only.values():
            await r.aclose()
        await self.data.aclose()


def create_fleet_app(coordinator: FleetCoordinator, config: ServiceConfig, *,
                     default_policy: str | Policy = "latest",
                     updater: Updater | None = None, supervise: bool = True,
                     check_update: Callable[[Mapping[str, Any]], object] | None = None,
                     on_finished: Callable[[FinishedRequest], None] | None = None,
                     admission: FleetAdmission | None = None,
                     extra_routes: Callable[..., list[Route]] | None = None,
                     native_token: str | None = None) -> Starlette:
    """The fleet's gateway over a bootstrapped coordinator.

    ``config`` is the single-engine service's (tokens, limits, deadlines,
    upstream timeouts, queue); each replica's URL replaces its
    ``upstream_url``. ``updater`` runs a ``POST /control/fleet/updates`` body
    (a checkpoint, a strategy ...) as a fleet update; without it that route
    answers 400. ``check_update`` checks such a body before anything starts
    (its ``BadInput`` is the route's 400); a second update while one runs is
    409. ``on_finished`` records finished requests (``GatewayRecorder``), each
    with its replica and fleet version. ``admission`` (a ``FleetAdmission``) and
    ``extra_routes(denied, json_body)`` (more control routes): how
    ``fleet.adapter_gateway.create_lora_fleet_app`` adds LoRA-adapter versions.
    ``native_token``: vLLM's own RL routes under ``/rc/<native_token>``, the fleet
    behind them as one vLLM (``fleet.native``).
    """
    if not isinstance(coordinator, FleetCoordinator):
        raise BadInput("coordinator must be a FleetCoordinator")
    if not isinstance(config, ServiceConfig):
        raise BadInput("config must be a ServiceConfig")
    policy = default_policy if isinstance(default_policy, Policy) else Policy.parse(
        default_policy)
    if admission is not None and (not isinstance(admission, FleetAdmission)
                                  or admission.coordinator is not coordinator):
        raise BadInput("admission must be a FleetAdmission of this coordinator")
    gw = FleetGateway(coordinator, config, policy, updater, check_update,
                      on_finished=on_finished, admission=admission)
    native = None if native_token is None else NativeRoutes(
        FleetRounds(coordinator, config), config, native_token)

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
        got = await control_json(request, config)
        if isinstance(got, Response):
            return got
        try:
            job = gw.start_update(got)
        except UpdateRefused as exc:
            return JSONResponse({"error": str(exc)}, status_code=409)
        except BadInput as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        return JSONResponse({"update": job.job_id, "state": job.state.value,
                             "status_url": f"/control/fleet/updates/{job.job_id}"},
                            status_code=202)

    async def get_update(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        raw = request.path_params["job"]
        job = gw.jobs.get(int(raw)) if raw.isdigit() and len(raw) < 10 else None
        if job is None:
            return JSONResponse({"error": "no such update"}, status_code=404)
        return JSONResponse({"update": job.job_id, "state": job.state.value,
                             "result": job.result, "error": job.error, "request": job.request})

    async def metrics(request: Request) -> Response:
        return Response(gw.render_metrics(), media_type=CONTENT_TYPE)

    async def health(request: Request) -> Response:
        n = len(coordinator.serving())
        if (closed := coordinator.failed_closed) is not None:  # refuses all until restarted
            return JSONResponse({"status": "failed_closed", "serving": n, "reason": closed},
                                status_code=503)
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
            if native is not None:
                await native.aclose()
            await gw.aclose()

    routes = [
        Route("/control/status", status, methods=["GET"]),
        Route("/control/fleet/updates", begin, methods=["POST"]),
        Route("/control/fleet/updates/{job}", get_update, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    if extra_routes is not None:
        routes += extra_routes(denied, lambda request: control_json(request, config))
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.fleet = gw
    app.state.native = native
    inner = app.build_middleware_stack()
    data_paths = frozenset(DATA_ROUTES)

    async def fast_path(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in data_paths:
            await gw.data(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in READ_ONLY_ROUTES:
            await gw.read_only_route(scope, receive, send)
        elif native is not None and scope["type"] == "http" and \
                scope["path"].startswith(NATIVE_PREFIX):
            # Under the native base URL the generation routes are the fleet's data plane.
            route = native.path_of(scope["path"])
            if route is not None and route in data_paths:
                await gw.data({**scope, "path": route, "raw_path": route.encode()}, receive,
                              send)
            elif route is not None and route in LORA_ROUTES:
                await refuse_lora(send, "a fleet gateway does not serve vLLM's LoRA routes: "
                                  "publish adapter versions with POST /control/adapters "
                                  "(verified on every replica), or serve one engine")
            else:
                await native(scope, receive, send)
        else:
            await inner(scope, receive, send)

    app.middleware_stack = fast_path
    return app
