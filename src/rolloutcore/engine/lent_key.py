"""Lending a launched engine's route key for one lease, and taking it back (#47).

The engine half is the guard's ``engine_key.LENT_KEY`` route; this is the
launcher's half, called by the gateway when it grants an update (``lend``) and
when the lease ends (``revoke``). Both go out with this process's own key
(``engine_key.headers_for``: a launcher's key wins over a lent one), under a
deadline, their failures in the tree (``engine.errors.request``).

``Lender`` is the gateway's: one engine's lend and take-back on its event loop,
over one kept-alive connection (an update's two calls no longer pay a TCP connect
each, and the lend runs beside the drain), closed with the gateway.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rolloutcore.engine.errors import request
from rolloutcore.errors import BadInput
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import LENT_KEY, MAX_LEND_S

if TYPE_CHECKING:
    from rolloutcore.engine.client import AsyncEngineClient

__all__ = ["KEEPALIVE_S", "Lender", "lend", "revoke"]

#: How long the lender's idle connection is kept: under uvicorn's (and so vLLM's)
#: 5 s keep-alive, so the engine never closes one that is about to be reused.
KEEPALIVE_S = 4.0


def _checked(seconds: float) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 < seconds <= MAX_LEND_S:
        raise BadInput(f"a key is lent for 0 < seconds <= {MAX_LEND_S:g}, not {seconds!r}")
    return float(seconds)


def lend(url: str, seconds: float, *, timeout_s: float = 10.0) -> str | None:
    """Lend a fresh key for ``seconds`` on the engine at ``url`` (it replaces any key
    lent before) and return it; None where this process holds no key of that engine
    (it did not launch it: nothing is guarded). An ``EffectError`` if the engine did
    not take it (then no key is lent)."""
    seconds, key = _checked(seconds), engine_key.new_key()
    if not engine_key.owns(url):
        return None
    request("PUT", url.rstrip("/") + LENT_KEY, step="route key lend", timeout_s=timeout_s,
            json_body={"key": key, "seconds": seconds}, mutation_started=False)
    return key


def revoke(url: str, *, timeout_s: float = 10.0) -> None:
    """Take back the key lent on the engine at ``url`` (nothing where this process
    holds no key of it); an ``EffectError`` if the engine did not answer that it did."""
    if engine_key.owns(url):
        request("DELETE", url.rstrip("/") + LENT_KEY, step="route key revoke",
                timeout_s=timeout_s, mutation_started=False)


class Lender:
    """``lend`` and ``revoke`` for the gateway, on its event loop, over one kept-alive
    connection to the engine at ``url``.

    Awaited on the loop, a lend runs beside the begin's drain (in a worker thread)
    instead of after it, and neither call takes a thread of its own. The client is made
    at the first call to an engine this process holds the key of (nothing is sent to any
    other) and closed by ``aclose``; a call after that (a lease expired during shutdown)
    still goes out, on a connection of its own. Each call keeps its deadline
    (``timeout_s``) and its failures' classes (``engine.errors``): a connection the
    engine dropped is not reused (httpx checks an idle one before it sends), and
    ``KEEPALIVE_S`` ends an idle one before the engine's own keep-alive could.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not timeout_s > 0:
            raise BadInput(f"timeout_s must be a positive number, not {timeout_s!r}")
        self.url = url
        self.timeout_s = float(timeout_s)
        self._client: AsyncEngineClient | None = None
        self.closed = False

    async def _call(self, method: str, step: str, body: object = None) -> None:
        from rolloutcore.engine.client import AsyncEngineClient

        one_off = None
        client = self._client
        if self.closed:
            client = one_off = AsyncEngineClient(self.url, timeout_s=self.timeout_s)
        elif client is None:
            client = self._client = AsyncEngineClient(
                self.url, timeout_s=self.timeout_s, max_keepalive=1, keepalive_s=KEEPALIVE_S)
        try:
            await client.request(method, LENT_KEY, step=step, json_body=body,
                                 headers=engine_key.headers_for(self.url),
                                 mutation_started=False)
        finally:
            if one_off is not None:
                await one_off.aclose()

    async def lend(self, seconds: float) -> str | None:
        """``lend(url, seconds)``, awaited."""
        seconds, key = _checked(seconds), engine_key.new_key()
        if not engine_key.owns(self.url):
            return None
        await self._call("PUT", "route key lend", {"key": key, "seconds": seconds})
        return key

    async def revoke(self) -> None:
        """``revoke(url)``, awaited."""
        if engine_key.owns(self.url):
            await self._call("DELETE", "route key revoke")

    async def aclose(self) -> None:
        """Close the kept-alive connection (idempotent)."""
        self.closed = True
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
