"""The engine's two HTTP clients: ``EngineClient`` and its async twin ``AsyncEngineClient``.

httpx's ``BaseTransport`` / ``AsyncBaseTransport`` pair is the model: one
method set, two twins, and one exception map (``engine.errors.map_errors``)
around every call *and* every stream's reads. These two are the only places
in ``src/`` that construct an httpx client (``tests/test_layering.py``);
everything else that talks HTTP (``VllmHTTP``, the weight-sync client, the
TRL engines, the launcher's probes, the gateway's read-only routes, the
adapter store's and the gateway's client) holds one of them.

``transport``: an ``httpx.BaseTransport`` (sync) or ``httpx.AsyncBaseTransport``
(async), e.g. an ``httpx.MockTransport``, so a test (and the public testing
kit's fake) plugs in at this seam. Without one, httpx's own pool is used.

What a call raises: ``rolloutcore.errors``'s tree, from ``engine.errors``
(a timeout ``EffectTimeout``, no connection ``EngineUnreachable``, a broken
one or a 5xx ``EngineUnavailable``, a 4xx ``EngineRefused`` /
``RequestRejected``); ``check_status=False`` returns any answer as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, TypedDict, Unpack

from rolloutcore.engine.errors import map_errors, raise_for_status, tls_context

if TYPE_CHECKING:
    import httpx

__all__ = ["AsyncEngineClient", "ClientOptions", "EngineClient"]


class ClientOptions(TypedDict, total=False):
    """Both twins' options beside the base URL and transport (defaults in ``_configure``):
    each call's deadline, the connect phase's, headers sent on every call, the pool."""

    timeout_s: float
    connect_s: float | None
    headers: Mapping[str, str] | None
    max_connections: int | None
    max_keepalive: int | None
    keepalive_s: float | None


class _Common:
    """What both twins keep: base URL, default deadline, the error-map arguments."""

    base_url: str
    timeout_s: float

    def _configure(self, base_url: str, options: ClientOptions
                   ) -> tuple[httpx.Timeout, httpx.Limits, dict[str, str]]:
        """Keep the base URL and deadline; the httpx client's timeout, limits, headers."""
        import httpx

        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(options.get("timeout_s", 30.0))
        connect_s = options.get("connect_s")
        keepalive_s = options.get("keepalive_s")
        return (httpx.Timeout(self.timeout_s,
                              connect=self.timeout_s if connect_s is None else connect_s),
                httpx.Limits(max_connections=options.get("max_connections", 100),
                             max_keepalive_connections=options.get("max_keepalive", 20),
                             keepalive_expiry=5.0 if keepalive_s is None else keepalive_s),
                dict(options.get("headers") or {}))

    def _what(self, method: str, url: str | httpx.URL, what: str | None) -> str:
        if what is not None:
            return what
        import httpx

        return f"{method} {httpx.URL(str(url)).path}"


class EngineClient(_Common):
    """Sync HTTP client; every failure in the tree. Thread-safe (httpx's pool)."""

    def __init__(self, base_url: str = "", *, transport: httpx.BaseTransport | None = None,
                 **options: Unpack[ClientOptions]) -> None:
        import httpx

        timeout, limits, headers = self._configure(base_url, options)
        self.http = httpx.Client(base_url=self.base_url, transport=transport, timeout=timeout,
                                 headers=headers, follow_redirects=False, limits=limits,
                                 verify=tls_context())

    def request(self, method: str, url: str | httpx.URL, *, step: str,
                timeout_s: float | None = None, json_body: object = None,
                content: bytes | None = None,
                params: Mapping[str, str | int | float | bool | None] | None = None,
                headers: Mapping[str, str] | None = None, check_status: bool = True,
                offered: bool = True, mutation_started: bool = True,
                cancelled: Callable[[], bool] | None = None, what: str | None = None,
                extensions: Mapping[str, object] | None = None) -> httpx.Response:
        """One request; its failure in the tree; a 2xx unless ``check_status=False``."""
        t = self.timeout_s if timeout_s is None else timeout_s
        w = self._what(method, url, what)
        with map_errors(step, w, timeout_s=t, cancelled=cancelled,
                        mutation_started=mutation_started):
            resp = self.http.request(method, url, json=json_body, content=content,
                                     params=params, headers=headers, timeout=t,
                                     extensions=dict(extensions or {}))
        if check_status:
            raise_for_status(resp, step, w, offered=offered, mutation_started=mutation_started)
        return resp

    @contextlib.contextmanager
    def stream(self, method: str, url: str | httpx.URL, *, step: str,
               timeout: float | httpx.Timeout | None = None, json_body: object = None,
               headers: Mapping[str, str] | None = None,
               mutation_started: bool = True, what: str | None = None,
               extensions: Mapping[str, object] | None = None) -> Iterator[httpx.Response]:
        """A streamed answer; its opening and every read under the one map."""
        t = self.timeout_s if timeout is None else timeout
        w = self._what(method, url, what)
        ts = t if isinstance(t, (int, float)) else self.timeout_s
        with map_errors(step, w, timeout_s=ts, mutation_started=mutation_started), \
                self.http.stream(method, url, json=json_body, headers=headers, timeout=t,
                                 extensions=dict(extensions or {})) as resp:
            yield resp

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncEngineClient(_Common):
    """``EngineClient``'s async twin: the same method set, awaited."""

    def __init__(self, base_url: str = "", *,
                 transport: httpx.AsyncBaseTransport | None = None,
                 **options: Unpack[ClientOptions]) -> None:
        import httpx

        timeout, limits, headers = self._configure(base_url, options)
        self.http = httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                      timeout=timeout, headers=headers,
                                      follow_redirects=False, limits=limits,
                                      verify=tls_context())

    async def request(self, method: str, url: str | httpx.URL, *, step: str,
                      timeout_s: float | None = None, json_body: object = None,
                      content: bytes | None = None,
                      params: Mapping[str, str | int | float | bool | None] | None = None,
                      headers: Mapping[str, str] | None = None, check_status: bool = True,
                      offered: bool = True, mutation_started: bool = True,
                      cancelled: Callable[[], bool] | None = None, what: str | None = None,
                      extensions: Mapping[str, object] | None = None) -> httpx.Response:
        """One request; its failure in the tree; a 2xx unless ``check_status=False``."""
        t = self.timeout_s if timeout_s is None else timeout_s
        w = self._what(method, url, what)
        with map_errors(step, w, timeout_s=t, cancelled=cancelled,
                        mutation_started=mutation_started):
            resp = await self.http.request(method, url, json=json_body, content=content,
                                           params=params, headers=headers, timeout=t,
                                           extensions=dict(extensions or {}))
        if check_status:
            raise_for_status(resp, step, w, offered=offered, mutation_started=mutation_started)
        return resp

    @contextlib.asynccontextmanager
    async def stream(self, method: str, url: str | httpx.URL, *, step: str,
                     timeout: float | httpx.Timeout | None = None, json_body: object = None,
                     headers: Mapping[str, str] | None = None,
                     mutation_started: bool = True, what: str | None = None,
                     extensions: Mapping[str, object] | None = None
                     ) -> AsyncIterator[httpx.Response]:
        """A streamed answer; its opening and every read under the one map."""
        t = self.timeout_s if timeout is None else timeout
        w = self._what(method, url, what)
        ts = t if isinstance(t, (int, float)) else self.timeout_s
        with map_errors(step, w, timeout_s=ts, mutation_started=mutation_started):
            async with self.http.stream(method, url, json=json_body, headers=headers,
                                        timeout=t, extensions=dict(extensions or {})) as resp:
                yield resp

    async def aclose(self) -> None:
        await self.http.aclose()

    close = aclose

    async def __aenter__(self) -> AsyncEngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
