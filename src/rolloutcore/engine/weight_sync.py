"""A weight-sync client of one vLLM engine, in vLLM's own four-method shape.

vLLM's ``distributed/weight_transfer/clients.py`` names the protocol every
trainer engine drives: ``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update`` (plus
``shutdown_weight_transfer_engine``); its ``HTTPVLLMWeightSyncClient`` posts
them to the RL routes. ``WeightSyncClient`` is that protocol (structural:
vLLM's own clients satisfy it), and ``HttpWeightSync`` is RolloutCore's HTTP
twin of it: the routes come from the table (``engine.routes``), the engine's
route key goes with every call (``transports.engine_key``), and every failure
leaves through the one map (``engine.errors``) with the caller's
``mutation_started``. The transports take one instead of posting routes
themselves.

Beyond vLLM's four methods it carries what a transport asks the same engine
around a round: the route list (``routes``), the world size and a worker
extension's ``collective_rpc``. Each call takes its own deadline
(``timeout_s``, default the client's) and ``step`` (default the route's name).

Connections: without ``pooled=True`` every call opens its own (what the
transports' calls always did); with it, one small pool serves every call
and ``abort()`` closes it from another thread, so a stuck call returns at
once as its step's timeout ("cancelled by its watchdog").
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rolloutcore.engine.errors import request, route_url
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput

if TYPE_CHECKING:
    import httpx

__all__ = ["HttpWeightSync", "WeightSyncClient"]


@runtime_checkable
class WeightSyncClient(Protocol):
    """vLLM's weight-sync client protocol: init, start, update, finish (vLLM's names)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any: ...

    def start_weight_update(self) -> Any: ...

    def update_weights(self, update_info: Any) -> Any: ...

    def finish_weight_update(self, weight_version: str | None = None) -> Any: ...


class HttpWeightSync:
    """The weight-transfer routes of the engine at ``base_url``. Thread-safe.

    Each method returns the engine's JSON answer (``{}`` for an empty one,
    ``{"text": ...}`` for one that is not JSON). ``mutation_started`` defaults
    to what the call can do to the weights: nothing before ``update_weights``.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 300.0, pooled: bool = False,
                 keepalive_connections: int = 4) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise BadInput(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._pooled = pooled
        self._keepalive = keepalive_connections
        self._client: httpx.Client | None = None
        self._lock = threading.Lock()
        self._urls: dict[str, Any] = {}

    # -- vLLM's four (and its shutdown) ------------------------------------------

    def init_weight_transfer_engine(self, init_info: Mapping[str, Any], *,
                                    timeout_s: float | None = None, step: str | None = None,
                                    mutation_started: bool = False) -> Any:
        return self.call("POST", Routes.INIT_TRANSFER, {"init_info": dict(init_info)},
                         timeout_s=timeout_s, step=step, mutation_started=mutation_started)

    def start_weight_update(self, *, draft: bool = False, timeout_s: float | None = None,
                            step: str | None = None, mutation_started: bool = False) -> Any:
        """Open an update (of the speculative draft's weights with ``draft=True``)."""
        route = Routes.START_DRAFT_UPDATE if draft else Routes.START_UPDATE
        return self.call("POST", route, None, timeout_s=timeout_s, step=step,
                         mutation_started=mutation_started)

    def update_weights(self, update_info: Mapping[str, Any], *, timeout_s: float | None = None,
                       step: str | None = None, mutation_started: bool = True) -> Any:
        return self.call("POST", Routes.UPDATE_WEIGHTS, {"update_info": dict(update_info)},
                         timeout_s=timeout_s, step=step, mutation_started=mutation_started)

    def finish_weight_update(self, weight_version: str | None = None, *,
                             timeout_s: float | None = None, step: str | None = None,
                             mutation_started: bool = True) -> Any:
        """Close the update; ``weight_version`` labels it (no body without one, as vLLM's)."""
        body = None if weight_version is None else {"weight_version": weight_version}
        return self.call("POST", Routes.FINISH_UPDATE, body, timeout_s=timeout_s, step=step,
                         mutation_started=mutation_started)

    def shutdown_weight_transfer_engine(self, *, timeout_s: float | None = None,
                                        step: str | None = None) -> Any:
        return self.call("POST", Routes.SHUTDOWN_TRANSFER, None, timeout_s=timeout_s,
                         step=step, mutation_started=False)

    # -- what a transport asks around a round ---------------------------------

    def routes(self, *, timeout_s: float | None = None, step: str | None = None
               ) -> frozenset[str]:
        """The engine's route paths (``/openapi.json``)."""
        r = self.call("GET", Routes.OPENAPI, None, timeout_s=timeout_s, step=step,
                      mutation_started=False)
        paths = r.get("paths") if isinstance(r, Mapping) else None
        return frozenset(str(p) for p in paths) if isinstance(paths, Mapping) else frozenset()

    def get_world_size(self, *, timeout_s: float | None = None, step: str | None = None) -> Any:
        return self.call("GET", Routes.GET_WORLD_SIZE, None, timeout_s=timeout_s, step=step,
                         mutation_started=False)

    def collective_rpc(self, method: str, args: list[Any], *, timeout_s: float | None = None,
                       step: str | None = None, mutation_started: bool = False) -> Any:
        """A worker-extension method on every worker (``timeout`` is passed on to vLLM)."""
        t = self.timeout_s if timeout_s is None else timeout_s
        return self.call("POST", Routes.COLLECTIVE_RPC,
                         {"method": method, "args": list(args), "timeout": t},
                         timeout_s=t, step=step, mutation_started=mutation_started)

    # -- plumbing -------------------------------------------------------------

    def call(self, method: str, route: str, body: Mapping[str, Any] | None, *,
             timeout_s: float | None = None, step: str | None = None,
             mutation_started: bool = True) -> Any:
        """One call to ``route``; its failure in the tree; the JSON answer."""
        client = self._http()
        s = route.lstrip("/") if step is None else step
        # abort() (another thread) closes the pool under a stuck call: cancelled.
        r = request(method, route_url(self._urls, self.base_url, route), step=s,
                    timeout_s=self.timeout_s if timeout_s is None else timeout_s,
                    json_body=body, client=client, mutation_started=mutation_started,
                    cancelled=lambda: self._pooled and self._client is not client)
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:
            return {"text": r.text[:300]}

    def _http(self) -> httpx.Client | None:
        if not self._pooled:
            return None
        with self._lock:
            if self._client is None:
                from rolloutcore.engine.client import EngineClient

                self._client = EngineClient(max_keepalive=self._keepalive).http
            return self._client

    def abort(self) -> None:
        """From another thread: make a stuck call return (closes the pool; a new one opens)."""
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            c.close()

    close = abort
