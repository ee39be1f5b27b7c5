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
from typing import TYPE_CHECKING

from rolloutcore.engine.errors import map_errors, raise_for_status

if TYPE_CHECKING:
    import httpx

__all__ = ["AsyncEngineClient", "EngineClient"]


def _limits(max_connections: int | None, max_keepalive: int | None,
            keepalive_s: float | None) -> httpx.Limits:
    import httpx

    return httpx.Limits(max_connections=max_connections,
                        max_keepalive_connections=max_keepalive,
                        keepalive_expiry=5.0 if keepalive_s is None else keepalive_s)


def _timeout(timeout_s: float, connect_s: float | None) -> httpx.Timeout:
    import httpx

    return httpx.Timeout(timeout_s, connect=timeout_s if connect_s is None else connect_s)


class _Common:
    """What both twins keep: base URL, default deadline, the error-map arguments."""

    base_url: str
    timeout_s: float

    def _what(self, method: str, url: str | httpx.URL, what: str | None) -> str:
        if what is not None:
            return what
        import httpx

        return f"{method} {httpx.URL(str(url)).path}"


class EngineClient(_Common):
    """Sync HTTP client; every failure in the tree. Thread-safe (httpx's pool)."""

    def __init__(self, base_url: str = "", *, timeout_s: float = 30.0,
                 connect_s: float | None = None,
                 transport: httpx.BaseTransport | None = None,
                 headers: Mapping[str, str] | None = None,
                 max_connections: int | None = 100, max_keepalive: int | None = 20,
                 keepalive_s: float | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.http = httpx.Client(base_url=self.base_url, transport=transport,
                                 timeout=_timeout(timeout_s, connect_s),
                                 headers=dict(headers or {}), follow_redirects=False,
                                 limits=_limits(max_connections, max_keepalive, keepalive_s))

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

    def __init__(self, base_url: str = "", *, timeout_s: float = 30.0,
                 connect_s: float | None = None,
                 transport: httpx.AsyncBaseTransport | None = None,
                 headers: Mapping[str, str] | None = None,
                 max_connections: int | None = 100, max_keepalive: int | None = 20,
                 keepalive_s: float | None = None) -> None:
        import httpx

        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.http = httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                      timeout=_timeout(timeout_s, connect_s),
                                      headers=dict(headers or {}), follow_redirects=False,
                                      limits=_limits(max_connections, max_keepalive,
                                                     keepalive_s))

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
