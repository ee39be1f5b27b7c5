"""A gateway over the FakeEngine, in process, for the service's fast tests.

``rig()`` builds: FakeEngine + FakeAdapter -> controller + runner (bootstrapped,
journal in memory) -> the gateway app, whose upstream is a ``FakeVllm`` over
the same engine served by uvicorn on a loopback port (``serve_fake``; so the gateway's own
HTTP client, connection pool and error mapping are what the tests run); and an
``httpx.AsyncClient`` to the gateway (httpx's ``ASGITransport`` by default,
the streaming one with ``streaming=True``). ``remote_transfer`` is what a
trainer in another process does through vLLM's weight-transfer path, done
on the fake engine: start, load every tensor, finish with the target label.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from helpers.asgi_stream import StreamingASGITransport, lifespan
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.app import Gateway
from rolloutcore.service.control import LEASE_HEADER
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights, fake_probe
from rolloutcore.testing.fake_vllm import FakeVllm

TOKEN = "control-token-0123456789abcdef"
DATA_TOKEN = "data-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}

#: What ``rig()`` runs on, in words (the ``engines`` of the fault-matrix rows its tests write).
RIG_ENGINES = ("FakeEngine + FakeAdapter under the real controller and runner; the real gateway "
               "app (control API, data plane) in process, its upstream a FakeVllm over the same "
               "engine on loopback HTTP (uvicorn)")

FAST = Deadlines(drain_s=5, pause_s=5, preflight_s=2, transfer_s=2, reset_s=1, validate_s=2,
                 resume_s=1, live_validate_s=5, bootstrap_s=2, fence_s=1, cancel_grace_s=1,
                 retry_backoff_s=0.01)


@dataclass
class Rig:
    engine: FakeEngine
    adapter: FakeAdapter
    controller: LifecycleController
    runner: LifecycleRunner
    journal: Journal
    fake: FakeVllm
    app: Any
    gateway: Gateway
    client: httpx.AsyncClient
    #: Where the fake vLLM listens (loopback).
    upstream_url: str

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [r.data for r in self.journal.records if r.kind == kind]


def make_parts(token_delay_s: float = 0.0005, event_delay_s: float = 0.0,
               deadlines: Deadlines = FAST, controller_config: ControllerConfig | None = None,
               live: bool = False, rejects_while_paused: bool = False,
               ) -> tuple[FakeEngine, FakeAdapter, LifecycleController, LifecycleRunner,
                          Journal, FakeVllm]:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=token_delay_s, rejects_while_paused=rejects_while_paused)
    ad = FakeAdapter(eng)
    ad.stage(w0)
    j = Journal()
    c = LifecycleController(listener=j.listener, config=controller_config or ControllerConfig())
    r = LifecycleRunner(c, ad, deadlines, record=j.write)
    r.bootstrap(w0.identity())
    return eng, ad, c, r, j, FakeVllm(eng, model="policy", event_delay_s=event_delay_s,
                                      live=live)  # served as RolloutCore launches vLLM


class _Switch:
    """ASGI app that hands each request to the current test's fake vLLM.

    One loopback server serves every test's fake engine: starting and
    stopping uvicorn costs about 0.2 s, which hypothesis would pay per example.
    A request already dispatched stays with the app it was given to.
    """

    def __init__(self) -> None:
        self.app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


_shared: tuple[str, _Switch] | None = None


def serve_fake(fake: FakeVllm, *, guard_key: str | None = None) -> str:
    """The URL at which ``fake`` answers from now on (a real loopback HTTP server);
    ``guard_key``: behind the route guard a launched engine runs, with that key
    (``transports.engine_key.RouteGuard``), which this process then holds."""
    global _shared
    if _shared is None:
        switch = _Switch()
        cm = uvicorn_thread(switch, lifespan="off")
        url = cm.__enter__()
        atexit.register(cm.__exit__, None, None, None)
        _shared = (url, switch)
    app: Any = fake
    if guard_key is not None:
        from rolloutcore.transports import engine_key

        old = os.environ.get(engine_key.ENV)
        os.environ[engine_key.ENV] = guard_key
        try:
            app = engine_key.RouteGuard(app)
        finally:
            if old is None:
                os.environ.pop(engine_key.ENV)
            else:
                os.environ[engine_key.ENV] = old
        engine_key.register(_shared[0], guard_key)
    _shared[1].app = app
    return _shared[0]


@contextlib.asynccontextmanager
async def rig(*, streaming: bool = False, token_delay_s: float = 0.0005,
              event_delay_s: float = 0.0, on_finished: Any = None,
              controller_config: ControllerConfig | None = None, live: bool = False,
              rejects_while_paused: bool = False, native_token: str | None = None,
              **cfg: Any) -> AsyncIterator[Rig]:
    """The rig; ``controller_config`` with an asynchronous ``update_mode`` configures the
    gateway for it too (``ServiceConfig.update_mode``); ``rejects_while_paused``: the
    engine answers as vLLM 0.33+ does while paused (503 ``engine_paused``)."""
    eng, ad, c, r, j, fake = make_parts(token_delay_s, event_delay_s,
                                        controller_config=controller_config, live=live,
                                        rejects_while_paused=rejects_while_paused)
    if controller_config is not None:
        cfg.setdefault("update_mode", controller_config.update_mode.value)
    up = serve_fake(fake)
    config = ServiceConfig(upstream_url=up, control_token=TOKEN, **cfg)
    app = create_app(r, config, on_finished=on_finished, native_token=native_token)
    transport: httpx.AsyncBaseTransport = (StreamingASGITransport(app) if streaming
                                           else httpx.ASGITransport(app))
    async with lifespan(app), httpx.AsyncClient(transport=transport,
                                                base_url="http://gateway.test",
                                                timeout=30) as client:
        yield Rig(eng, ad, c, r, j, fake, app, app.state.gateway, client, up)


def remote_transfer(adapter: FakeAdapter, weights: FakeWeights, label: str) -> TransferEvidence:
    """The trainer's transfer through the engine's weight-transfer path (fake engine)."""
    e = adapter.engine
    t0 = time.monotonic()
    e.start_update()
    n = nbytes = 0
    for name, data in sorted(weights.tensors.items()):
        e.load(name, data)
        n += 1
        nbytes += len(data)
    e.finish_update(label)
    return TransferEvidence(completed=True, mutation_started=True, backend="fake", tensors=n,
                            bytes=nbytes, finish_label=label, elapsed_s=time.monotonic() - t0)


def transfer_body(ev: TransferEvidence) -> dict[str, Any]:
    return {"transfer": {"completed": ev.completed, "mutation_started": ev.mutation_started,
                         "backend": ev.backend, "tensors": ev.tensors, "bytes": ev.bytes,
                         "finish_label": ev.finish_label, "elapsed_s": ev.elapsed_s}}


def expectations(w: FakeWeights) -> dict[str, Any]:
    """What a trainer computes from ``w`` and sends with its begin: the policy probe and,
    as the fake engine's reference checksum, the weights' digest."""
    return {"probe": fake_probe(w).to_wire(), "engine_checksums": {"fake-digest": w.digest}}


def begin_body(w: Any, owner: str = "trainer", *, expect: bool | dict[str, Any] = True,
               **extra: Any) -> dict[str, Any]:
    """A begin for ``w`` with the expectations a trainer computes (``expect=False``: none;
    a dict: those)."""
    ident = w.identity()
    body = {"identity": {"manifest_digest": ident.manifest_digest,
                         "provenance": ident.provenance.to_dict(),
                         "content_digest": ident.content_digest},
            "owner": owner, **extra}
    if isinstance(expect, dict):
        body["expect"] = expect
    elif expect:
        body.setdefault("expect", expectations(w))
    return body


def lease(grant: dict[str, Any]) -> dict[str, str]:
    """Headers of a call that the update's trainer makes (token + the lease's secret)."""
    return {**AUTH, LEASE_HEADER: grant["lease"]["secret"]}


def sse_events(text: str) -> list[Any]:
    """The data payloads of an SSE body ('[DONE]' kept as the string)."""
    out: list[Any] = []
    for ev in text.split("\n\n"):
        ev = ev.strip()
        if not ev.startswith("data:"):
            continue
        payload = ev[5:].strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


class QuickServer(uvicorn.Server):
    """uvicorn's server, woken at once by ``stop`` rather than at its next 0.1 s tick, and
    shut down as soon as its connections and tasks are done: uvicorn's own shutdown sleeps
    0.1 s after asking the connections to close, then polls every 0.1 s: 0.1-0.3 s of the
    teardown of every test that serves over a socket."""

    POLL_S = 0.005

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 1) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)
            should_exit = await self.on_tick(counter)

    async def shutdown(self, sockets: list[Any] | None = None) -> None:
        """``uvicorn.Server.shutdown`` (0.55), its steps in its order, polled every
        ``POLL_S``: stop accepting, ask every connection to close, wait (at most
        ``timeout_graceful_shutdown``) for the connections to close and then for the
        running tasks to end, cancelling what is left, then the lifespan's shutdown."""
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                for pending in (self.server_state.connections, self.server_state.tasks):
                    while pending and not self.force_exit:
                        await asyncio.sleep(self.POLL_S)
                for server in self.servers:
                    await server.wait_closed()
        except TimeoutError:
            for t in self.server_state.tasks:
                t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    def stop(self) -> None:
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                loop.call_soon_threadsafe(wake.set)


def _start(app: Any, host: str, lifespan: str) -> tuple[QuickServer, threading.Thread, Any, str]:
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = QuickServer(uvicorn.Config(app, log_level="warning", lifespan=lifespan,
                                    timeout_graceful_shutdown=5))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            server.stop()
            sock.close()
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    return server, th, sock, f"http://{host}:{port}"


@contextlib.contextmanager
def uvicorn_threads(apps: list[Any], host: str = "127.0.0.1",
                    lifespan: str = "on") -> Iterator[list[str]]:
    """Serve each of ``apps`` on a free loopback port from a thread of its own (real
    sockets, real disconnects); at exit all are told to stop, then awaited together."""
    started: list[tuple[QuickServer, threading.Thread, Any, str]] = []
    try:
        for app in apps:
            started.append(_start(app, host, lifespan))
        yield [url for *_, url in started]
    finally:
        for server, *_ in started:
            server.stop()
        for _, th, sock, _ in started:
            th.join(15)
            sock.close()


@contextlib.contextmanager
def uvicorn_thread(app: Any, host: str = "127.0.0.1", lifespan: str = "on") -> Iterator[str]:
    """Serve ``app`` on a free loopback port from a thread (real sockets, real disconnects)."""
    with uvicorn_threads([app], host, lifespan) as (url,):
        yield url
