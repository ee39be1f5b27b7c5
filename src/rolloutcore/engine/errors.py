"""HTTP to vLLM: the one place where a failed request becomes the exception tree.

Every client of a vLLM server meets the same failures: the adapter's
``VllmHTTP`` and its streams, the transports' calls to the weight-transfer
routes, the CUDA-IPC trainer, the TRL engines, the recoverer's label write,
the launcher's probes, the gateway's read-only passthrough and its own
data-path client (``engine.upstream``, hand-written for speed). The
deadline expires, the connection is refused or reset, the answer is not
HTTP, the server answers 5xx or 4xx. Each becomes the most specific class of
``rolloutcore.errors`` here, and nowhere else, with ``raise ... from exc``
(httpx's ``_transports/default.py`` ``map_exceptions`` is the model: one
context manager, most specific exception first). No other module catches
``httpx.HTTPError`` for itself (``tests/test_layering.py``).

Sync and async alike: ``map_errors`` is a plain context manager, so it wraps
``client.request(...)`` and ``await client.request(...)`` the same way, and
a stream's reads (``for``/``async for`` over its lines) as well as its
opening.

* ``map_errors``: a context manager around one request made with httpx;
* ``transport_error``: the same mapping for a client that meets the
  exception elsewhere (the gateway's, inside its protocol callbacks);
* ``status_error``: the same for a status code that is not a success.

What each class lets a caller conclude:

* ``EffectTimeout``: the deadline expired; the request may have arrived;
* ``EngineUnreachable``: no connection was made; nothing was delivered;
* ``EngineUnavailable``: the connection broke, the answer was not HTTP, or
  the server answered 5xx; the request may have been acted on;
* ``EngineRefused``: a 4xx; the engine refused before acting
  (``RequestRejected`` when it found the request itself malformed).

``is_refusal`` is what the weight transports ask of a failed call: only a
refusal proves the engine did nothing with it. Whether the engine's
*weights* changed is not known here (``mutation_started`` stays ``True``
unless the caller, the step that sent the request, passes ``False``: see
``rolloutcore.errors``).

httpx is imported only where a request is made: the engine half of the
gloo transport imports this package inside vLLM's workers.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

from rolloutcore.errors import (
    EffectError,
    EffectTimeout,
    EngineRefused,
    EngineUnavailable,
    EngineUnreachable,
    RequestRejected,
)

if TYPE_CHECKING:
    import ssl

    import httpx

__all__ = [
    "BODY_SNIPPET",
    "is_refusal",
    "map_errors",
    "raise_for_status",
    "request",
    "route_url",
    "snippet",
    "status_error",
    "tls_context",
    "transport_error",
]

#: How much of an answer's body an error message quotes.
BODY_SNIPPET = 300


def snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= BODY_SNIPPET else text[:BODY_SNIPPET] + "..."


def transport_error(exc: BaseException, step: str, what: str, *, timeout_s: float,
                    connecting: bool = False, mutation_started: bool = True) -> EffectError:
    """The tree's error for a request that failed below HTTP (no status to read).

    ``what`` names the request (``"POST /pause"``); ``connecting`` says the
    failure happened while the connection was being made (httpx says so
    itself with ``ConnectError``). ``mutation_started=False``: the caller knows
    the request moves no weights (see ``rolloutcore.errors``).
    """
    httpx_mod = sys.modules.get("httpx")  # an httpx error implies httpx is imported
    if isinstance(exc, TimeoutError) or (
            httpx_mod is not None and isinstance(exc, httpx_mod.TimeoutException)):
        return EffectTimeout(step, timeout_s, detail=what, mutation_started=mutation_started)
    reason = f"{what}: {type(exc).__name__}: {exc}"
    if connecting or (httpx_mod is not None and isinstance(exc, httpx_mod.ConnectError)):
        return EngineUnreachable(step, reason, mutation_started=mutation_started)
    return EngineUnavailable(step, reason, mutation_started=mutation_started)


@contextlib.contextmanager
def map_errors(step: str, what: str, *, timeout_s: float,
               cancelled: Callable[[], bool] | None = None,
               mutation_started: bool = True) -> Iterator[None]:
    """Translate what an httpx request raises into the tree.

    ``cancelled`` tells a connection shut down on purpose (a watchdog
    unblocking a stuck call from another thread, by shutting its socket or
    closing its client: httpx then raises ``RuntimeError``) from one the
    engine broke: the former is the step's timeout, however soon it came.
    """
    import httpx

    t0 = time.monotonic()
    try:
        yield
    except (httpx.RequestError, OSError, RuntimeError) as exc:
        if cancelled is not None and not isinstance(exc, (httpx.TimeoutException, TimeoutError)) \
                and cancelled():
            raise EffectTimeout(step, time.monotonic() - t0, mutation_started=mutation_started,
                                detail=f"{what}: cancelled by its watchdog") from exc
        if isinstance(exc, RuntimeError):
            raise  # not a failed request: a bug, left as it is
        raise transport_error(exc, step, what, timeout_s=timeout_s,
                              mutation_started=mutation_started) from exc


def status_error(step: str, what: str, status: int, body: str, *,
                 offered: bool = True, mutation_started: bool = True) -> EffectError | None:
    """The tree's error for an answer with status ``status``; ``None`` for a 2xx.

    ``offered=False``: the engine's ``/openapi.json`` does not list the
    route, so a 404 or 405 means "not offered", not "bad request". A 403 is
    always "not offered": vLLM refuses its dev and scale-out routes so when
    they are switched off.
    """
    if 200 <= status < 300:
        return None
    text = snippet(body)
    m = mutation_started
    if status >= 500:
        return EngineUnavailable(step, f"{what} answered HTTP {status}: {text}", status=status,
                                 mutation_started=m)
    if status == 403 or (status in (404, 405) and not offered):
        return EngineRefused(step, f"{what} not offered by this engine (HTTP {status}): {text}",
                             status=status, mutation_started=m)
    if status >= 400:
        return RequestRejected(step, f"{what} refused with HTTP {status}: {text}",
                               status=status, mutation_started=m)
    return EngineUnavailable(step, f"{what} answered HTTP {status}, not a success: {text}",
                             status=status, mutation_started=m)


def raise_for_status(resp: httpx.Response, step: str, what: str, *,
                     offered: bool = True, mutation_started: bool = True) -> httpx.Response:
    """``resp`` itself when it is a 2xx; else ``status_error``'s error."""
    err = status_error(step, what, resp.status_code, resp.text, offered=offered,
                       mutation_started=mutation_started)
    if err is not None:
        raise err
    return resp


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One verifying TLS context for every HTTP client this process builds.

    httpx builds a new one per client otherwise, loading the CA bundle each time: about
    30 ms per client (and per ``httpx.request``), which a lent route key's lend and
    take-back, or a transport's call, paid on an update's critical path. An engine on
    plain HTTP never uses it; one context serves any number of connections."""
    import httpx

    return httpx.create_ssl_context()


def request(method: str, url: str | httpx.URL, *, step: str, timeout_s: float,
            json_body: Any = None, content: bytes | IO[bytes] | None = None,
            client: httpx.Client | None = None,
            mutation_started: bool = True, cancelled: Callable[[], bool] | None = None,
            what: str | None = None) -> httpx.Response:
    """One request, its failures in the tree; returns a 2xx answer.

    For the callers that make one call now and then (the transports, the
    recoverer) and for ``engine.weight_sync``'s pool (``client``, and
    ``cancelled`` when a watchdog may close it); ``VllmHTTP`` keeps a pool and
    uses the same mapping. ``content``: a raw body (bytes or a file) instead of
    ``json_body``; ``what`` names the request in errors (default: method and path).
    """
    import httpx

    from rolloutcore.transports.engine_key import headers_for

    text = str(url)
    what = f"{method} {urlsplit(text).path}" if what is None else what
    headers = headers_for(text)  # a launched engine's route key (transports.engine_key)
    with map_errors(step, what, timeout_s=timeout_s, cancelled=cancelled,
                    mutation_started=mutation_started):
        if client is None:
            resp = httpx.request(method, url, json=json_body, content=content,
                                 timeout=timeout_s, headers=headers, verify=tls_context())
        else:
            resp = client.request(method, url, json=json_body, content=content,
                                  timeout=timeout_s, headers=headers)
    return raise_for_status(resp, step, what, mutation_started=mutation_started)


def is_refusal(exc: BaseException) -> bool:
    """The engine said no before acting (4xx), or the request never reached it."""
    return isinstance(exc, (EngineRefused, EngineUnreachable))


def route_url(cache: dict[str, Any], base_url: str, path: str) -> Any:
    """``base_url + path`` as an ``httpx.URL``, parsed once per route and kept in ``cache``.

    A client calls the same few routes on every update; httpx would parse the
    URL (and merge it with a base URL) on every call. A path that is not a
    plain absolute route (no leading ``/``, or a query or fragment in it) is
    returned as given, for httpx to merge as before.
    """
    url = cache.get(path)
    if url is None:
        if not path.startswith("/") or "?" in path or "#" in path:
            return path
        import httpx

        url = cache[path] = httpx.URL(base_url.rstrip("/") + path)
    return url
