"""Lending a launched engine's route key for one lease, and taking it back (#47).

The engine half is the guard's ``engine_key.LENT_KEY`` route; this is the
launcher's half, called by the gateway when it grants an update (``lend``) and
when the lease ends (``revoke``). Both go out with this process's own key
(``engine_key.headers_for``: a launcher's key wins over a lent one), under a
deadline, their failures in the tree (``engine.errors.request``).

``Lender`` is the gateway's: one engine's lend and take-back over one kept-alive
connection (each update's two calls no longer pay a TCP connect each), the lend
on a thread of its own beside the begin's drain (``start_lend``), closed with the
gateway.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from rolloutcore.engine.errors import request
from rolloutcore.errors import BadInput
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import LENT_KEY, MAX_LEND_S

if TYPE_CHECKING:
    from rolloutcore.engine.client import EngineClient

__all__ = ["KEEPALIVE_S", "Lender", "lend", "revoke"]

#: How long the lender's idle connection is kept: under uvicorn's (and so vLLM's)
#: 5 s keep-alive, so the engine never closes one that is about to be reused.
KEEPALIVE_S = 4.0


def lend(url: str, seconds: float, *, timeout_s: float = 10.0,
         client: EngineClient | None = None) -> str | None:
    """Lend a fresh key for ``seconds`` on the engine at ``url`` (it replaces any key
    lent before) and return it; None where this process holds no key of that engine
    (it did not launch it: nothing is guarded). An ``EffectError`` if the engine did
    not take it (then no key is lent)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 < seconds <= MAX_LEND_S:
        raise BadInput(f"a key is lent for 0 < seconds <= {MAX_LEND_S:g}, not {seconds!r}")
    if not engine_key.owns(url):
        return None
    key = engine_key.new_key()
    request("PUT", url.rstrip("/") + LENT_KEY, step="route key lend", timeout_s=timeout_s,
            json_body={"key": key, "seconds": float(seconds)}, mutation_started=False,
            client=None if client is None else client.http)
    return key


def revoke(url: str, *, timeout_s: float = 10.0, client: EngineClient | None = None) -> None:
    """Take back the key lent on the engine at ``url`` (nothing where this process
    holds no key of it); an ``EffectError`` if the engine did not answer that it did.
    ``client``: a pooled client to send it with (``Lender``'s); else a fresh one."""
    if engine_key.owns(url):
        request("DELETE", url.rstrip("/") + LENT_KEY, step="route key revoke",
                timeout_s=timeout_s, mutation_started=False,
                client=None if client is None else client.http)


class Lender:
    """``lend`` and ``revoke`` for the engine at ``url`` over one kept-alive client.

    The client is made at the first call to an engine this process holds the key of
    (nothing for any other) and closed by ``close``; a call after ``close`` (a lease
    expired during shutdown) still goes out, on a connection of its own, as ``lend``
    and ``revoke`` alone do. Each call keeps its deadline (``timeout_s``) and its
    failures' classes: a connection the engine dropped is not reused (httpx checks an
    idle one before it sends), and ``KEEPALIVE_S`` ends an idle one before the engine's
    own keep-alive could.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise BadInput(f"timeout_s must be a positive number, not {timeout_s!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self._client: EngineClient | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._thread: ThreadPoolExecutor | None = None

    def _pooled(self) -> EngineClient | None:
        if not engine_key.owns(self.url):
            return None
        with self._lock:
            if self._closed:
                return None
            if self._client is None:
                from rolloutcore.engine.client import EngineClient

                self._client = EngineClient(self.url, timeout_s=self.timeout_s,
                                            max_keepalive=1, keepalive_s=KEEPALIVE_S)
            return self._client

    def lend(self, seconds: float) -> str | None:
        """``lend(url, seconds)`` over the pooled connection."""
        return lend(self.url, seconds, timeout_s=self.timeout_s, client=self._pooled())

    def start_lend(self, seconds: float) -> Future[str | None]:
        """``lend(seconds)`` on the lender's own thread, so that the caller's work (the
        begin's drain) runs while the engine answers; its future. Done at once (no
        thread) where this process holds no key of the engine, and after ``close``."""
        done: Future[str | None] = Future()
        with self._lock:
            if engine_key.owns(self.url) and not self._closed:
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="rc-lend")
                return self._thread.submit(self.lend, seconds)
        try:
            done.set_result(self.lend(seconds))
        except Exception as exc:
            done.set_exception(exc)
        return done

    def revoke(self) -> None:
        """``revoke(url)`` over the pooled connection."""
        revoke(self.url, timeout_s=self.timeout_s, client=self._pooled())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """End the lend thread and close the pooled connection (idempotent)."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.shutdown(wait=True)  # a lend in flight ends within its deadline
        if client is not None:
            client.close()
