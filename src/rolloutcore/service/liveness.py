"""Who holds the data plane, and for how long: requests in flight, their deadlines, aborts.

Every data-plane request is a ``Flight`` from its first byte to its last,
kept in one ``Flights`` table. The table is what makes the gateway's
liveness promises hold (#16), without a timer per request (or per send) on
the hot path, which only writes two timestamps:

* one sweeper task looks at every flight a few times a second: a body still
  arriving after ``client_body_s`` is cut (``body_timeout``: the handler
  answers 408), a send to the client pending for ``client_send_s`` is cut
  (``client_slow``: the client stopped reading);
* ``abort(bindings, reason)`` is the drain policy's hand in the data plane:
  the runner calls it (``abort_stragglers``, from its thread) with the
  rollouts still bound when an update's drain deadline expired; each is cut
  (``aborted``) and vLLM is told (``/abort_requests``, with the ids vLLM gave
  the requests; never an empty list, which vLLM's dev route reads as "abort
  everything").

A cut is one ``cancel()`` of the request's handler task, delivered where it
waits and consumed by the handler (``consume_cut``), which then ends the
request clearly (the proxy's ``_after_cut``). The first reason wins: a
flight is cancelled at most once by the table, so a cancellation from
anyone else (server shutdown) is still told apart and propagates.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.core.versions import Binding
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.upstream import UpstreamPool
from rolloutcore.errors import EffectError
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.service.wire import dumps, vllm_request_ids

__all__ = ["ABORT_CALL_S", "Flight", "Flights"]

#: vLLM's /abort_requests answer is awaited this long (the runner's abort_s is 10).
ABORT_CALL_S = 4.0


@dataclass(slots=True, eq=False)
class Flight:
    """One data-plane request in progress, as the sweeper and the abort see it."""

    task: asyncio.Task[Any]
    started: float
    #: body (reading the request) | checking | bound (admitted, relaying) | done
    phase: str = "body"
    rid: str | None = None
    #: The engine (the data plane's upstream name) it was admitted to.
    target: str = ""
    route: str = ""
    payload: dict[str, Any] = field(default_factory=dict)
    #: The proxy's FinishedRequest once bound (``released`` says the binding ended).
    fin: Any = None
    #: ``time.monotonic()`` when the send to the client now pending began; 0: none.
    send_since: float = 0.0
    #: Why the gateway cut it (the first reason wins; one cancel per flight).
    cut: str | None = None
    reason: str = ""
    #: The final send is under way (the binding is already released).
    finishing: bool = False
    #: The answer's headers went out (a stream: its end must be an event).
    started_response: bool = False
    #: The stream's relay (``SseRelay``, or a carried request's ``service.carried``).
    sse: Any = None


class Flights:
    """The table of flights, its sweeper, and the drain policy's abort."""

    def __init__(self, config: ServiceConfig, metrics: ServiceMetrics,
                 upstream: Callable[[str], UpstreamPool | None]) -> None:
        self.config = config
        self.metrics = metrics
        self._upstream = upstream
        self._all: set[Flight] = set()
        self._bound: dict[str, Flight] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._all)

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._sweeper = self._loop.create_task(self._sweep(), name="rolloutcore-sweeper")

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    # ------------------------------------------------------------ the table
    def add(self, task: asyncio.Task[Any]) -> Flight:
        f = Flight(task, time.monotonic())
        self._all.add(f)
        return f

    def claim(self, f: Flight, rid: str) -> bool:
        """Reserve ``rid`` for ``f`` before its admission: one rollout id is bound once,
        whichever engine would take it. False when another request holds it."""
        held = self._bound.get(rid)
        if held is not None and held is not f:
            return False
        f.rid = rid
        self._bound[rid] = f
        return True

    def unclaim(self, f: Flight) -> None:
        if f.rid is not None and self._bound.get(f.rid) is f:
            del self._bound[f.rid]
        f.rid = None

    def bind(self, f: Flight, rid: str) -> None:
        f.phase, f.rid = "bound", rid
        self._bound[rid] = f

    def discard(self, f: Flight) -> None:
        f.phase = "done"
        self._all.discard(f)
        if f.rid is not None and self._bound.get(f.rid) is f:
            del self._bound[f.rid]

    # ------------------------------------------------------------ deadlines
    async def _sweep(self) -> None:
        """Cut requests whose body or whose client's reading overran its deadline."""
        cfg = self.config
        tick = max(0.02, min(0.5, cfg.client_body_s / 4, cfg.client_send_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for f in list(self._all):
                if f.cut is not None or f.phase == "done":
                    continue
                if f.phase == "body" and now - f.started > cfg.client_body_s:
                    self.cut(f, "body_timeout")
                elif f.send_since and now - f.send_since > cfg.client_send_s:
                    self.metrics.slow_clients.inc()
                    self.cut(f, "client_slow")

    def cut(self, f: Flight, why: str, reason: str = "") -> bool:
        """Stop ``f``'s handler where it waits (once; the first reason wins)."""
        if f.cut is not None or f.phase == "done" or f.task.done():
            return False
        f.cut, f.reason = why, reason
        f.task.cancel()
        return True

    @staticmethod
    def consume_cut(f: Flight) -> bool:
        """After a ``CancelledError``: True when it was our cut (consumed), False when
        someone else cancels the task (server shutdown: re-raise)."""
        return f.cut is not None and f.task.uncancel() == 0

    # ------------------------------------------------------------ stragglers
    def abort_stragglers(self, bindings: tuple[Binding, ...], reason: str) -> dict[str, Any]:
        """The runner's ``stragglers`` hook (its thread): cut them and abort them in vLLM."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return {"cut": [], "engine": "the data plane is not running"}
        fut = asyncio.run_coroutine_threadsafe(self.abort(bindings, reason), loop)
        try:
            return fut.result(timeout=60.0)
        except BaseException:
            fut.cancel()
            raise

    async def abort(self, bindings: Iterable[Binding], reason: str) -> dict[str, Any]:
        """Cut these bound requests (a clear end for each client) and abort them in vLLM.

        Each request's upstream connection closes (vLLM aborts a request whose
        client left); ``/abort_requests`` with vLLM's own ids says it once
        more, in case the connection is not noticed at once.
        """
        return await self.abort_ids([b.rollout_id or "" for b in bindings], reason)

    async def abort_ids(self, rollout_ids: Iterable[str], reason: str,
                        kind: str = "aborted") -> dict[str, Any]:
        """``abort`` by rollout id (the staleness bound's, whose bindings the controller
        released already: ``kind`` ``over_bound`` ends their streams with an
        ``OverStalenessBound`` error event)."""
        hit: list[Flight] = []
        for rid in rollout_ids:
            f = self._bound.get(rid)
            if f is None or f.fin is None or f.fin.released:
                continue
            if self.cut(f, kind if kind == "over_bound" else "aborted", reason):
                hit.append(f)
        by_engine: dict[str, list[str]] = {}
        for f in hit:
            by_engine.setdefault(f.target, []).extend(
                vllm_request_ids(f.route, f.rid or "", f.payload))
        engine: Any = None
        for name, ids in by_engine.items():
            if ids:
                got = await self._abort_in_engine(name, ids)
                engine = got if len(by_engine) == 1 else {**(engine or {}), name: got}
        self.metrics.aborted_rollouts.inc(len(hit))
        return {"cut": [f.rid for f in hit],
                "request_ids": [i for ids in by_engine.values() for i in ids],
                "engine": engine}

    async def _abort_in_engine(self, name: str, ids: list[str]) -> dict[str, Any]:
        up = self._upstream(name)
        if up is None:
            return {"error": "upstream client closed"}
        body = dumps({"request_ids": ids})
        out: dict[str, Any] = {}
        # The dev route (awaits the abort) first; the tokens-only route only when
        # the engine has no dev route (404). Bounded well inside the runner's
        # abort_s: an engine too busy to answer is still paused with abort next.
        for path in (Routes.ABORT.encode(), Routes.ABORT_GENERATE.encode()):
            try:
                status, answer = await up.call(path, body, timeout_s=ABORT_CALL_S)
            except EffectError as exc:
                out[path.decode()] = repr(exc)
                break
            out[path.decode()] = {"status": status, "body": answer[:512].decode("latin-1")}
            if status != 404:
                break
        return out
