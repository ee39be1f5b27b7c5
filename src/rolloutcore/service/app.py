"""The gateway as one Starlette application: data plane, trainer protocol, status, metrics.

``create_app(runner, config)`` wires a bootstrapped ``LifecycleRunner`` (its
controller and engine adapter) to HTTP. It does no I/O of its own at build
time; the upstream HTTP client is opened by the app's lifespan, and closed
there, with any open lease expired so that no update is left half-done.

Routes::

    POST /v1/completions, /v1/chat/completions, /inference/v1/generate   data plane
    GET  /v1/models, /version, /tokenizer_info; POST /tokenize, /detokenize
                                               vLLM's, passed through (read-only)
    POST /control/updates                      begin an update (lease)    control token
    GET  /control/updates/{id}                 lease and result           control token
    POST /control/updates/{id}/transfer        report evidence / failure  control token
    GET  /control/status                       state, versions, history   control token
    GET  /metrics                              Prometheus text            open
    GET  /health                               liveness and state         open

    GET  /openapi.json                         the control API schema     open

Between updates the app watches the engine (``config.health_interval_s``):
``runner.check_serving`` taints it when it dies, restarts or stops
answering, after which the data plane refuses and ``/health`` says so.

The app gives the runner its data plane as the drain policy's straggler
handler (``runner.stragglers``): when an update's drain deadline expires,
the requests still bound are cut and aborted in vLLM (the runner's
``DrainPolicy``; ``docs/service.md``, "Nobody holds an update hostage").
An ``on_finished`` hook with a ``stats()`` method (the trajectory
recorder) is reported in ``/control/status`` and ``/metrics``.

The upstream is always reached over HTTP at ``config.upstream_url``: the fast
tests serve an in-process fake engine on a loopback port, so the client code
that talks to vLLM is the one they exercise.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.lifecycle import State
from rolloutcore.engine.routes import NATIVE_PREFIX, Routes
from rolloutcore.errors import BadInput
from rolloutcore.service.adapter_control import adapter_routes
from rolloutcore.service.admission import AdapterEngine
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.control import (
    LEASE_HEADER,
    BeginBody,
    ReportBody,
    UpdateManager,
    parse_body,
)
from rolloutcore.service.control_body import control_body
from rolloutcore.service.control_openapi import openapi_document
from rolloutcore.service.metrics import CONTENT_TYPE, ServiceMetrics
from rolloutcore.service.native import NativeRoutes
from rolloutcore.service.native_engine import EngineRounds
from rolloutcore.service.native_lora import LORA_ROUTES, NativeLora, refuse_lora
from rolloutcore.service.passthrough import READ_ONLY_ROUTES, ReadOnlyRoutes
from rolloutcore.service.proxy import DATA_ROUTES, DataPlane, FinishedRequest
from rolloutcore.service.wire import Receive, Scope, Send
from rolloutcore.transports import engine_key

if TYPE_CHECKING:
    from rolloutcore.control.adapters import AdapterManager

__all__ = ["Gateway", "create_app"]

_INT63 = 2**63 - 1
log = logging.getLogger("rolloutcore.service")


@dataclass
class Gateway:
    """Everything one app holds; ``app.state.gateway``."""

    runner: LifecycleRunner
    config: ServiceConfig
    metrics: ServiceMetrics
    data: DataPlane
    updates: UpdateManager
    #: The trajectory recorder's counts (``GatewayRecorder.stats``), if one records.
    recorder_stats: Callable[[], dict[str, Any]] | None = None

    @property
    def controller(self) -> LifecycleController:
        return self.runner.controller

    def status(self) -> dict[str, Any]:
        c = self.controller
        snap = c.snapshot()
        open_upd = self.updates.open_update
        return {
            "state": snap["state"],
            # what /health says: "ok", "unavailable" or "failed_closed" (then in every state)
            "health": ("failed_closed" if snap["failed_closed"] is not None else "ok"
                       if snap["state"] not in ("TAINTED", "UNINITIALIZED", "RECOVERING")
                       else "unavailable"),
            "committed": snap["committed"],
            "identity": snap["identity"],
            "active_rollouts": snap["active_rollouts"],
            "queued_requests": self.data.waiting,
            "requests_in_progress": self.data.in_progress,
            "drain_policy": self.runner.drain_policy.value,
            "failed_closed": snap["failed_closed"],
            "update": None if open_upd is None else open_upd.describe(),
            "published": snap["published"],
            "transitions": c.history()[-self.config.history:],
            "engine": {"upstream_url": self.config.upstream_url, "model": self.config.model,
                       "base_url": self.config.advertised_engine_url,
                       # the key itself only in a begin's grant (service.control)
                       "route_guard": bool(engine_key.headers_for(self.config.upstream_url))},
            "recorder": None if self.recorder_stats is None else self.recorder_stats(),
            "verification": self.updates.verification(),
        }


@functools.cache
def _openapi() -> dict[str, Any]:
    """The control API's document: the same for every app (built once, read only)."""
    return openapi_document()


def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(obj, status_code=status, headers=headers)


def create_app(runner: LifecycleRunner, config: ServiceConfig, *,
               on_finished: Callable[[FinishedRequest], None] | None = None,
               adapters: AdapterManager | None = None, public_model: str = "policy",
               native_token: str | None = None) -> Starlette:
    """The gateway app over a runner whose controller is (normally) already bootstrapped.

    ``adapters``: the engine's ``control.adapters.AdapterManager``; requests for
    ``public_model`` are then served by its current adapter version
    (``service.admission.AdapterEngine``). ``native_token``: vLLM's own RL routes
    are answered under ``/rc/<native_token>`` (``service.native``), and with
    ``adapters`` vLLM's LoRA routes there too (``service.native_lora``).
    """
    if not isinstance(runner, LifecycleRunner):
        raise BadInput("runner must be a LifecycleRunner")
    if not isinstance(config, ServiceConfig):
        raise BadInput("config must be a ServiceConfig")
    controller = runner.controller
    if controller.update_mode.value != config.update_mode:
        # A deployment says which mode it runs: a keep or recompute controller behind a
        # strict deployment (or the reverse) is refused, never run as the other.
        raise BadInput(f"the gateway is configured for {config.update_mode!r} updates; a "
                       f"controller in {controller.update_mode.value!r} mode is refused "
                       f"(ServiceConfig.update_mode, serve --update-mode)")
    metrics = ServiceMetrics(controller)
    controller.add_listener(metrics.listener)
    admission: LifecycleController | AdapterEngine = controller
    if adapters is not None:
        if adapters.controller is not controller:
            raise BadInput("adapters must be the manager of this runner's engine")
        admission = AdapterEngine(adapters, config.upstream_url, public_model=public_model)
    data = DataPlane(admission, config, metrics, on_finished=on_finished)
    read_only = ReadOnlyRoutes(config, metrics)
    # The drain policy's stragglers are this data plane's requests (#16).
    runner.stragglers = data.abort_stragglers
    updates = UpdateManager(runner, config, metrics)
    recorder_stats = getattr(on_finished, "stats", None)
    if not callable(recorder_stats):
        recorder_stats = None
    else:
        metrics.watch_recorder(recorder_stats)
    gw = Gateway(runner, config, metrics, data, updates, recorder_stats)
    native = None if native_token is None else NativeRoutes(EngineRounds(runner, config), config,
                                                              native_token)

    def round_open() -> str | None:
        if native is not None and native.round is not None:
            return "a weight round is open"
        st = controller.state
        return None if st is State.READY else f"the base is {st.value}, not READY"

    # vLLM's LoRA routes under the native base URL (service.native_lora), with --lora.
    lora = NativeLora(admission, config, round_open) if isinstance(
        admission, AdapterEngine) and native is not None else None

    def denied(request: Request) -> Response | None:
        auth = check_bearer(request.headers.get("authorization"), config.control_token)
        if auth.ok:
            return None
        return _json(auth.status or 401, {"error": auth.reason},
                     {"www-authenticate": "Bearer"})

    async def json_body(request: Request) -> bytes | Response:
        return await control_body(request, config)

    async def parsed(request: Request, model: type[BaseModel]) -> Any:
        """The body as ``model`` (``parse_body``), or the answer that refuses it; JSON
        nested too deep for the parser is answered 400, not 500."""
        raw = await json_body(request)
        if isinstance(raw, Response):
            return raw
        try:
            code, body = parse_body(model, raw)
        except RecursionError:
            code, body = 400, {"error": "malformed JSON", "detail": "nested too deeply"}
        return _json(code, body) if code else body

    def update_id(request: Request) -> int | Response:
        """The path's update id once the caller is let in: the refusal, or 404 for an id
        no update can have."""
        if (r := denied(request)) is not None:
            return r
        raw = request.path_params["update_id"]
        # ASCII digits only: str.isdigit() also holds for '²' or '①', which int() refuses.
        v = int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 19 else 0
        return v if 0 < v <= _INT63 else _json(404, {"error": "no such update"})

    async def begin(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        body = await parsed(request, BeginBody)
        if isinstance(body, Response):
            return body
        return _json(*await updates.begin(body, disconnected=request.is_disconnected))

    async def report(request: Request) -> Response:
        uid = update_id(request)
        if isinstance(uid, Response):
            return uid
        body = await parsed(request, ReportBody)
        if isinstance(body, Response):
            return body
        return _json(*await updates.report(uid, body, request.headers.get(LEASE_HEADER)))

    async def get_update(request: Request) -> Response:
        uid = update_id(request)
        if isinstance(uid, Response):
            return uid
        return _json(*updates.get(uid, request.headers.get(LEASE_HEADER)))

    async def status(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        return _json(200, gw.status())

    async def metrics_ep(request: Request) -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    async def health(request: Request) -> Response:
        # A controller failed closed (its journal cannot be written) refuses every
        # request in every state until restarted: a liveness check must see that.
        st, closed = controller.state.value, controller.failed_closed
        if closed is not None:
            return _json(503, {"status": "failed_closed", "state": st, "reason": closed})
        ok = st not in ("TAINTED", "UNINITIALIZED", "RECOVERING")
        return _json(200 if ok else 503, {"status": "ok" if ok else "unavailable", "state": st})

    schema = _openapi()

    async def openapi(request: Request) -> Response:
        return _json(200, schema)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return _json(exc.status_code, {"error": exc.detail}, dict(exc.headers or {}))

    async def watch_engine() -> None:
        """Between updates, notice an engine that died, restarted or stopped answering.

        Without this a dead engine would leave the gateway READY, answering
        every request with a 502, and a restarted one (its start checkpoint)
        would be served under the committed version's name.
        """
        while True:
            await asyncio.sleep(config.health_interval_s)
            if controller.state is not State.READY:
                continue
            if controller.sweep_due and not controller.stale_rollouts:
                # The prefix reset a keep-mode update deferred, now that nothing older runs.
                with contextlib.suppress(Exception):
                    await anyio.to_thread.run_sync(runner.sweep)
            try:
                v = await anyio.to_thread.run_sync(functools.partial(
                    runner.check_serving, timeout_s=config.health_timeout_s,
                    failures_to_taint=config.health_failures))
            except Exception as exc:  # the watch must outlive any one check
                log.warning("engine health check failed to run: %r", exc)
                continue
            if v is not None:  # metrics.engine_lost counted it from the controller's record
                log.error("engine tainted while serving: %s", "; ".join(v.problems))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await data.start()
        await read_only.start()
        watch = (asyncio.create_task(watch_engine(), name="rolloutcore-engine-watch")
                 if config.health_interval_s > 0 else None)
        try:
            yield
        finally:
            if watch is not None:
                watch.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watch
            await updates.aclose()
            if native is not None:
                await native.aclose()
            await read_only.aclose()
            await data.aclose()

    routes = [Route(p, data) for p in DATA_ROUTES] + [
        Route("/control/updates", begin, methods=["POST"]),
        Route("/control/updates/{update_id}", get_update, methods=["GET"]),
        Route("/control/updates/{update_id}/transfer", report, methods=["POST"]),
        Route("/control/status", status, methods=["GET"]),
        Route("/metrics", metrics_ep, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
    ]
    if adapters is not None:  # the trainer protocol's adapter routes (service.adapter_control)
        routes += adapter_routes(adapters, denied, json_body)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: http_error})
    app.state.gateway = gw
    app.state.native = native
    # The data routes are dispatched before Starlette's middleware and router:
    # they are the hot path, and DataPlane answers every error itself.
    data_paths = frozenset(DATA_ROUTES)
    starlette_app = app.build_middleware_stack()

    async def fast_path(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] in data_paths:
            await data(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] in READ_ONLY_ROUTES:
            await read_only(scope, receive, send)
        elif native is not None and scope["type"] == "http" and \
                scope["path"].startswith(NATIVE_PREFIX):
            # Under the native base URL the generation routes are the data plane's
            # (a trainer generates from the same base URL it updates through).
            route = native.path_of(scope["path"])
            if route is not None and route in data_paths:
                await data({**scope, "path": route, "raw_path": route.encode()}, receive,
                           send)
            elif route == Routes.MODELS and lora is not None and scope["method"] == "GET":
                await lora.models(native.backend.relay, send)
            elif route is not None and route in LORA_ROUTES:
                if lora is not None:
                    await lora(route, scope, receive, send)
                else:
                    await refuse_lora(send, "this gateway serves no LoRA adapters: start it "
                                      "with serve --lora")
            else:
                await native(scope, receive, send)
        else:
            await starlette_app(scope, receive, send)

    app.middleware_stack = fast_path
    return app
