"""vLLM's read-only routes, passed through without admission: ``GET /v1/models`` and friends.

OpenAI-style clients ask them before (or besides) generating. They read no
weights, so they are answered by vLLM as they are, during updates too, with
the data token checked as on the data routes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from types import MappingProxyType

from rolloutcore.engine.client import AsyncEngineClient
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import EffectError, EffectTimeout
from rolloutcore.service.auth import check_bearer
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.service.wire import (
    Receive,
    Scope,
    Send,
    body_or_answer,
    headers_of_interest,
    send_auth_refusal,
    send_error,
)

__all__ = ["READ_ONLY_ROUTES", "ReadOnlyRoutes"]

#: vLLM's read-only routes that OpenAI-style clients ask before (or besides)
#: generating (the OpenAI SDK, TRL and vLLM's own benchmark list ``/v1/models``
#: first), with their one method. They read no weights, so they are passed
#: through without admission or binding, during updates too. The dev and control
#: routes (``/pause``, ``/update_weights``, ``/collective_rpc``, ``/server_info``,
#: ...) are never among them: only the gateway changes the engine.
READ_ONLY_ROUTES: Mapping[str, str] = MappingProxyType({
    Routes.MODELS: "GET", Routes.VERSION: "GET", Routes.TOKENIZER_INFO: "GET",
    Routes.TOKENIZE: "POST", Routes.DETOKENIZE: "POST"})


class ReadOnlyRoutes:
    """ASGI app of ``READ_ONLY_ROUTES``: answered by vLLM, relayed as they are.

    Its own small connection pool (httpx), so the data plane's pool, sized and
    tuned for generation, is not shared with lookups. The data token applies
    as on the data routes.
    """

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self._client: AsyncEngineClient | None = None

    async def start(self) -> None:
        cfg = self.config
        self._client = AsyncEngineClient(
            cfg.upstream_url, timeout_s=cfg.upstream_read_s, connect_s=cfg.upstream_connect_s,
            max_connections=16, max_keepalive=4, keepalive_s=cfg.upstream_keepalive_s)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"]
        status = await self._handle(scope, receive, send, route)
        self.metrics.requests.labels(route, str(status)).inc()

    async def _handle(self, scope: Scope, receive: Receive, send: Send, route: str) -> int:
        cfg = self.config
        method = READ_ONLY_ROUTES[route]
        if scope["method"] != method:
            return await send_error(send, 405, f"use {method}", "MethodNotAllowed",
                                    [(b"allow", method.encode())])
        hdrs = headers_of_interest(scope)
        auth = check_bearer(hdrs.get(b"authorization"), cfg.data_token)
        if not auth.ok:
            return await send_auth_refusal(send, auth)
        body = b""
        if method == "POST":
            try:
                async with asyncio.timeout(cfg.client_body_s):  # rare path: a timer is fine
                    got = await body_or_answer(receive, send, cfg.max_body_bytes,
                                               hdrs.get(b"content-length"))
            except TimeoutError:
                return await send_error(
                    send, 408, f"the request body did not arrive within {cfg.client_body_s:g}s",
                    "RequestTimeout", [(b"connection", b"close")])
            if isinstance(got, int):
                return got
            body = got
        client = self._client
        if client is None:
            raise RuntimeError("read-only routes not started")
        headers = {}
        if b"content-type" in hdrs:
            headers["content-type"] = hdrs[b"content-type"].decode("latin-1")
        qs = scope.get("query_string", b"")
        try:  # the one map (engine.errors); the answer quotes httpx's own exception
            resp = await client.request(
                method, route + ("?" + qs.decode("latin-1") if qs else ""), step="read_only",
                content=body or None, headers=headers, check_status=False,
                mutation_started=False, what=f"{method} {route}")
        except EffectTimeout as exc:
            return await send_error(send, 504, f"vLLM did not answer in time: "
                                    f"{exc.__cause__!r}", "UpstreamTimeout")
        except EffectError as exc:
            return await send_error(send, 502, f"vLLM unreachable: {exc.__cause__!r}",
                                    "UpstreamError")
        out = [(b"content-type", resp.headers.get("content-type", "application/json")
                .encode("latin-1")), (b"content-length", str(len(resp.content)).encode())]
        await send({"type": "http.response.start", "status": resp.status_code,
                    "headers": out})
        await send({"type": "http.response.body", "body": resp.content, "more_body": False})
        return int(resp.status_code)
