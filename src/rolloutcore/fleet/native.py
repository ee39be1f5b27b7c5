"""vLLM's RL routes on a fleet gateway: N engines behind one URL, one fleet version a round.

``serve --engines N --native-routes`` answers the same routes as one
engine's gateway (``service.native``: the same round, the same order rules,
the same errors) over the fleet coordinator instead of one runner:

* ``/get_world_size`` is the sum of the ready replicas' world sizes;
* ``/init_weight_transfer_engine`` is split: replica ``i`` gets the trainer's
  ``init_info`` with ``rank_offset`` moved past the ranks of the replicas
  before it (every other field as sent), all posted at once (the group's
  rendezvous needs every rank); the replicas it spans are the trainer's
  group;
* a round is ONE synchronous fleet update (``FleetCoordinator.update`` with
  this round as its fan-out, ``NativeFanout``): admission closes fleet-wide,
  every replica of the group opens its own update (drain, pause), the
  trainer's start/update/finish are forwarded to every replica at once (the
  finish with each replica's own label), then each replica's transfer is
  reported and closed through its own runner (reset, validate, resume) and
  the coordinator publishes one fleet version when every replica (or
  ``--quorum``) verified: the coordinator's own decision and publish path;
* a replica that fails is named in the answer and in the journals (each
  replica's and the pool's), and nothing is published below the quorum.

What cannot be offered this way is refused: a rolling update (it needs a
round per engine, and a trainer speaking vLLM's contract sends one); a round
when a replica of the trainer's group cannot take part (the group's
broadcast needs all of its ranks: the trainer initialises again, and
``/get_world_size`` then counts only the ready replicas); an
``init_info`` without ``rank_offset`` across several engines. The fleet's
own weights are not retained from a native round (the trainer sent them): a
fenced replica rejoins with the next round.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.lifecycle import FailureKind
from rolloutcore.core.pool import Strategy
from rolloutcore.core.records import Note
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.client import AsyncEngineClient
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import FleetUpdateFailed, FleetUpdateResult, FleetWeights, Replica
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.native import NATIVE_LEVEL, Failed, Manifest, NativeRefusal
from rolloutcore.service.native_engine import (
    forward_step,
    native_identity,
    record_round,
    relay_call,
)
from rolloutcore.transports.fanout import FanoutResult

__all__ = ["FleetRounds", "NativeFanout"]


class NativeFanout:
    """The coordinator's fan-out for one round the trainer drives through the routes.

    ``send_all`` runs in the coordinator's update (after every replica opened):
    it hands the targets (engine URL, its label) to the routes (``opened``) and
    waits until they ``hand`` back each replica's result, or ``abort``.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.opened: asyncio.Future[list[tuple[str, str]]] = loop.create_future()
        self._results: dict[str, FanoutResult] | None = None
        self._done = threading.Event()

    def send_all(self, targets: Sequence[tuple[str, str]], source: object, *,
                 timeout_s: float) -> dict[str, FanoutResult]:
        got = [(str(u), str(lb)) for u, lb in targets]

        def tell() -> None:
            if not self.opened.done():
                self.opened.set_result(got)

        self._loop.call_soon_threadsafe(tell)
        self._done.wait(timeout_s)
        results = self._results or {}
        return {u: results.get(u) or FanoutResult(u, lb, error=TransferError(
            "transfer", "the trainer's round did not end in time", mutation_started=True))
            for u, lb in got}

    def hand(self, results: Mapping[str, FanoutResult]) -> None:
        if self._results is None:
            self._results = dict(results)
        self._done.set()

    def invalidate(self) -> None:
        pass   # the trainer owns the group

    def abort(self) -> None:
        self.hand({})


@dataclass
class _FleetRound:
    fan: NativeFanout
    update: asyncio.Future[FleetUpdateResult | BaseException]
    targets: dict[str, tuple[Replica, str]]   # fan-out URL -> (replica, its engine label)
    label: str


class FleetRounds:
    """``RoundBackend`` of a fleet gateway (``service.native.NativeRoutes`` over it)."""

    def __init__(self, coordinator: FleetCoordinator, config: ServiceConfig) -> None:
        if not isinstance(coordinator, FleetCoordinator):
            raise BadInput("coordinator must be a FleetCoordinator")
        self.coord = coordinator
        self.config = config
        self.floor = config.floor
        self._clients: dict[str, AsyncEngineClient] = {}
        #: The replicas the trainer's last init spans, in rank order (None: not initialised).
        self.group: tuple[str, ...] | None = None

    # ------------------------------------------------------------ reading
    def health(self) -> str | None:
        if (closed := self.coord.failed_closed) is not None:
            return f"the fleet failed closed ({closed})"
        return None if self.coord.serving() else "no replica is serving"

    def paused(self) -> bool:
        return self.coord.pool.closed is not None

    def weight_version(self) -> str | None:
        newest = self.coord.newest
        return None if newest is None else newest.label

    def _client(self, url: str) -> AsyncEngineClient:
        c = self._clients.get(url)
        if c is None:
            cfg = self.config
            c = self._clients[url] = AsyncEngineClient(
                url, timeout_s=cfg.upstream_read_s, connect_s=cfg.upstream_connect_s)
        return c

    async def _each(self, names: Sequence[str], method: str, route: str,
                    query: Mapping[str, str], bodies: Sequence[Any], timeout_s: float
                    ) -> list[tuple[int, Any]]:
        """One call per replica, all at once; a replica that cannot answer is a 409/504
        naming it."""
        async def one(name: str, body: Any) -> tuple[int, Any]:
            url = str(self.coord.replicas[name].url)
            try:
                return await relay_call(self._client(url), url, method, route, query, body,
                                        timeout_s)
            except NativeRefusal as r:
                raise NativeRefusal(r.status, f"replica {name}: {r.message}", r.kind) from r

        return list(await asyncio.gather(*(one(n, b) for n, b in zip(names, bodies,
                                                                     strict=True))))

    async def relay(self, method: str, route: str, query: Mapping[str, str],
                    body: Any) -> tuple[int, Any]:
        names = self.coord.ready() or self.coord.serving() or list(self.group or ())
        if not names:
            raise NativeRefusal(409, "no replica is ready", "Unavailable")
        if route == Routes.GET_WORLD_SIZE:
            return 200, {"world_size": sum(await self._sizes(names))}
        if route == Routes.RESET_PREFIX:   # every replica's cache; success when all succeed
            got = await self._each(names, method, route, query, [body] * len(names),
                                   self.config.upstream_read_s)
            bad = [(n, s, a) for n, (s, a) in zip(names, got, strict=True)
                   if s >= 400 or not (isinstance(a, dict) and a.get("success") is True)]
            if any(s >= 400 for _, s, _ in bad):
                name, s, a = next(x for x in bad if x[1] >= 400)
                return (409 if s >= 500 else s), {"replica": name, "answer": a}
            return 200, {"success": not bad}
        status, answer = (await self._each(names[:1], method, route, query, [body],
                                           self.config.upstream_read_s))[0]
        return (409 if status >= 500 else status), answer

    async def _sizes(self, names: Sequence[str]) -> list[int]:
        got = await self._each(names, "GET", Routes.GET_WORLD_SIZE, {}, [None] * len(names),
                               self.config.upstream_read_s)
        sizes = []
        for n, (s, a) in zip(names, got, strict=True):
            ws = a.get("world_size") if isinstance(a, dict) else None
            if s != 200 or isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
                raise NativeRefusal(409, f"replica {n} answered /get_world_size with {s}: "
                                    f"{str(a)[:200]}")
            sizes.append(ws)
        return sizes

    async def init(self, body: dict[str, Any]) -> tuple[int, Any]:
        if self.coord.pool.update is not None:
            raise NativeRefusal(409, "a fleet update is running: initialise the weight "
                                "transfer engine when it has ended")
        names = self.coord.ready()
        if not names:
            raise NativeRefusal(409, "no replica is ready", "Unavailable")
        sizes = await self._sizes(names)
        info = body.get("init_info")
        bodies: list[Any] = [body]
        if len(names) > 1:
            off = info.get("rank_offset") if isinstance(info, dict) else None
            ws = info.get("world_size") if isinstance(info, dict) else None
            if not isinstance(info, dict) or isinstance(off, bool) or not isinstance(off, int) \
                    or off < 0 or isinstance(ws, bool) or not isinstance(ws, int):
                raise NativeRefusal(422, f"{len(names)} engines behind this URL: the init is "
                                    "split by init_info.rank_offset and world_size, which "
                                    "this one lacks (a backend without ranks cannot span "
                                    "several engines behind one URL)", "BadRequestError")
            if ws < off + sum(sizes):
                raise NativeRefusal(422, f"init_info.world_size {ws} cannot hold rank_offset "
                                    f"{off} + the fleet's {sum(sizes)} ranks "
                                    "(/get_world_size)", "BadRequestError")
            bodies = [{**body, "init_info": {**info, "rank_offset": off + sum(sizes[:i])}}
                      for i in range(len(names))]
        self.group = None
        # The trainer's group replaces the fleet's own on these engines.
        await anyio.to_thread.run_sync(self._forget_groups, names)
        got = await self._each(names, "POST", Routes.INIT_TRANSFER, {}, bodies,
                               self.config.lease_s)
        bad = [f"replica {n}: {s} {str(a)[:200]}" for n, (s, a) in zip(names, got, strict=True)
               if s >= 400]
        if bad:
            raise NativeRefusal(409, "the init failed on " + "; ".join(bad))
        self.group = tuple(names)
        return 200, got[0][1]

    def _forget_groups(self, names: Sequence[str]) -> None:
        if self.coord.fanout is not None:
            self.coord.fanout.invalidate()
        for n in names:
            cb = self.coord.replicas[n].on_fanout
            if cb is not None:
                with contextlib.suppress(Exception):
                    cb()

    # ------------------------------------------------------------ the round
    async def open(self, seq: int) -> tuple[_FleetRound, str]:
        coord = self.coord
        if (closed := coord.failed_closed) is not None:
            raise NativeRefusal(409, f"the fleet failed closed ({closed})")
        newest = coord.newest
        ident = native_identity(seq, None if newest is None else newest.to_dict())
        weights = FleetWeights(ident, None, None, VerificationLevel.DECLARED)
        loop = asyncio.get_running_loop()
        fan = NativeFanout(loop)

        def run() -> FleetUpdateResult | BaseException:
            try:
                return coord.update(weights, strategy=Strategy.SYNCHRONOUS, owner="native",
                                    fanout=fan)
            except Exception as exc:  # handed to the routes: a 409 naming it, never a 500
                return exc

        update = loop.run_in_executor(None, run)
        waits: list[asyncio.Future[Any]] = [fan.opened, update]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if not fan.opened.done():
            fan.opened.cancel()
            got = update.result()
            raise NativeRefusal(409, f"the round could not open: {_why(got)}")
        by_url = {str(r.fanout_url): r for r in coord.replicas.values() if r.fanout_url}
        targets = {u: (by_url[u], lb) for u, lb in fan.opened.result()}
        upd = coord.pool.update or {}
        rnd = _FleetRound(fan, update, targets, str(upd.get("label") or "?"))
        names = {r.name for r, _ in targets.values()}
        if self.group is not None and names != set(self.group):
            missing = sorted(set(self.group) - names)
            res = await self.fail(rnd, FailureKind.REFUSED, (
                f"replicas {missing} of the trainer's transfer group could not take part "
                "(its broadcast needs every rank): initialise again (/get_world_size counts "
                "the ready replicas)"))
            raise NativeRefusal(409, f"the round could not open: {res.get('reason')}")
        return rnd, rnd.label

    async def send(self, handle: _FleetRound, route: str,
                   body: dict[str, Any] | bytes | None) -> Failed | None:
        async def one(rep: Replica, label: str) -> Failed | None:
            b = {"weight_version": label} if route == Routes.FINISH_UPDATE else body
            url = str(rep.url)
            return await forward_step(self._client(url), url, route, b, self.config.lease_s,
                                      who=f"replica {rep.name}: ")

        got = [f for f in await asyncio.gather(*(one(r, lb) for r, lb in
                                                 handle.targets.values())) if f is not None]
        if not got:
            return None
        statuses = {f.status for f in got}
        return Failed(statuses.pop() if len(statuses) == 1 else 409,
                      "; ".join(f.reason for f in got), timeout=any(f.timeout for f in got))

    async def close(self, handle: _FleetRound, written: Manifest, note: dict[str, Any]
                    ) -> dict[str, Any]:
        def record() -> None:
            # Each replica's validation gets the round's check as one engine's does.
            for rep, label in handle.targets.values():
                t = rep.controller.current_ticket
                record_round(rep.runner, written, Note("native_round", {
                    **note, "label": label, "fleet_label": handle.label,
                    "update_id": None if t is None else t.update_id}))

        await anyio.to_thread.run_sync(record)
        results = {u: FanoutResult(u, lb, evidence=TransferEvidence(
            completed=bool(written), mutation_started=True, backend="native",
            tensors=len(written), finish_label=lb,
            error=None if written else "no tensor was written"))
            for u, (_, lb) in handle.targets.items()}
        return await self._end(handle, results, len(written))

    async def fail(self, handle: _FleetRound, kind: FailureKind, reason: str
                   ) -> dict[str, Any]:
        wrote = kind is not FailureKind.REFUSED
        results = {u: FanoutResult(u, lb, error=TransferError(
            "transfer", reason, mutation_started=wrote), sent=wrote)
            for u, (_, lb) in handle.targets.items()}
        return await self._end(handle, results, 0)

    async def expire(self, handle: _FleetRound, reason: str, writes: int
                     ) -> dict[str, Any]:
        # Every write went through a forwarded /update_weights (the routes hold the round's
        # lock while one runs): none forwarded, nothing written.
        with anyio.CancelScope(shield=True):
            res = await self.fail(handle, FailureKind.ERROR if writes else
                                  FailureKind.REFUSED, reason)
        return {**res, "status": "expired"}

    async def _end(self, handle: _FleetRound, results: Mapping[str, FanoutResult],
                   tensors: int) -> dict[str, Any]:
        handle.fan.hand(results)
        got = await asyncio.shield(handle.update)
        if isinstance(got, FleetUpdateResult) and got.published is not None:
            return {"status": "published", "label": got.published.label,
                    "verification": NATIVE_LEVEL, "tensors": tensors,
                    "replicas": {n: o.value for n, o in got.outcomes.items()},
                    "reasons": dict(got.reasons)}
        return {"status": "failed", "classification": "fleet", "reason": _why(got)}

    async def aclose(self) -> None:
        clients, self._clients = self._clients, {}
        for c in clients.values():
            await c.aclose()


def _why(got: object) -> str:
    if isinstance(got, FleetUpdateFailed):
        r = got.result
        why = "; ".join(f"{n}: {t[:300]}" for n, t in sorted(r.reasons.items()))
        return f"nothing published: {r.decision}" + (f" ({why})" if why else "")
    return str(got)
