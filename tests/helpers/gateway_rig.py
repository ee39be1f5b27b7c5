"""A gateway over the FakeEngine, in process, for the service's fast tests.

``rig()`` builds: FakeEngine + FakeAdapter -> controller + runner (bootstrapped,
journal in memory) -> the gateway app, whose upstream is a ``FakeVllm`` over
the same engine reached through ``StreamingASGITransport``; and an
``httpx.AsyncClient`` to the gateway (httpx's ``ASGITransport`` by default,
the streaming one with ``streaming=True``). ``remote_transfer`` is what a
trainer in another process does through vLLM's weight-transfer path, done
on the fake engine: start, load every tensor, finish with the target label.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from helpers.asgi_stream import StreamingASGITransport, lifespan
from helpers.fake_vllm import FakeVllm
from rolloutcore.adapters.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.evidence import TransferEvidence
from rolloutcore.journal import Journal
from rolloutcore.lifecycle import LifecycleController
from rolloutcore.runner import Deadlines, LifecycleRunner
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.app import Gateway

TOKEN = "control-token-0123456789abcdef"
DATA_TOKEN = "data-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}

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
    upstream: StreamingASGITransport

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [r.data for r in self.journal.records if r.kind == kind]


def make_parts(token_delay_s: float = 0.0005, event_delay_s: float = 0.0,
               deadlines: Deadlines = FAST) -> tuple[FakeEngine, FakeAdapter,
                                                     LifecycleController, LifecycleRunner,
                                                     Journal, FakeVllm]:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=token_delay_s)
    ad = FakeAdapter(eng)
    ad.stage(w0)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, deadlines, record=j.write)
    r.bootstrap(w0.identity())
    return eng, ad, c, r, j, FakeVllm(eng, event_delay_s=event_delay_s)


@contextlib.asynccontextmanager
async def rig(*, streaming: bool = False, token_delay_s: float = 0.0005,
              event_delay_s: float = 0.0, on_finished: Any = None,
              **cfg: Any) -> AsyncIterator[Rig]:
    eng, ad, c, r, j, fake = make_parts(token_delay_s, event_delay_s)
    up = StreamingASGITransport(fake.app)
    config = ServiceConfig(upstream_url="http://vllm.test", control_token=TOKEN, **cfg)
    app = create_app(r, config, upstream_transport=up, on_finished=on_finished)
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


def begin_body(w: Any, owner: str = "trainer", **extra: Any) -> dict[str, Any]:
    ident = w.identity()
    return {"identity": {"manifest_digest": ident.manifest_digest,
                         "provenance": ident.provenance.to_dict(),
                         "content_digest": ident.content_digest},
            "owner": owner, **extra}


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


@contextlib.contextmanager
def uvicorn_thread(app: Any, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve ``app`` on a free loopback port from a thread (real sockets, real disconnects)."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()
