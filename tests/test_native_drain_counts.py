"""A drain's write-counter baseline is the one its weights were verified at: one
``/metrics`` read a round instead of two, and an expired round still classified right.

``VllmAdapter.drain`` takes the counters the engine had when its weights were last
verified (the bootstrap's, the last paused validation's: ``_ops_verified``) as the
baseline ``writes_since_drain`` compares with, and reads ``/metrics`` beside its pause
only when there is none. What an expired round (or a trainer's ``refused`` report) is
classified as then:

* nothing sent and nothing changed since the weights were verified: no mutation, back
  in service on the verified weights (as with a read beside the pause);
* the round's own writes: ambiguous, TAINTED (as before);
* a write out of band after the last verification, before the pause (which a read beside
  the pause would have taken into its baseline and then missed), or a restarted
  engine's new counters: TAINTED, never "nothing was sent".

The engine is the one fake of vLLM saying it is 0.32 (it counts its weight-update calls
at ``/metrics``); end to end through the gateway's native routes on a real loopback
socket, the runner's ``expire_lease`` classifying the round.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import prometheus_client
import pytest

from helpers.asgi_stream import lifespan
from helpers.gateway_rig import FAST, serve_fake
from helpers.gateway_rig import TOKEN as CONTROL
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.evidence import PauseMode
from rolloutcore.core.lifecycle import State
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.routes import Routes
from rolloutcore.service import ServiceConfig
from rolloutcore.service.app import create_app
from rolloutcore.testing.fake import FakeEngine, FakeWeights
from rolloutcore.testing.fake_vllm import FakeVllm

pytestmark = pytest.mark.anyio

TOKEN = "native-token-0123456789abcdef"
BASE = f"/rc/{TOKEN}"
W0 = FakeWeights.from_seed(0)
W1 = FakeWeights.from_seed(1, step=1)
W2 = FakeWeights.from_seed(2, step=2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _body(w: FakeWeights) -> dict[str, Any]:
    ns = sorted(w.tensors)
    return {"update_info": {"names": ns, "dtype_names": ["bfloat16"] * len(ns),
                            "shapes": [[len(w.tensors[n])] for n in ns],
                            "fake_data": [w.tensors[n].hex() for n in ns]}}


class _Rig:
    def __init__(self, fake: FakeVllm, url: str, adapter: VllmAdapter,
                 controller: LifecycleController, client: httpx.AsyncClient) -> None:
        self.fake, self.url, self.adapter = fake, url, adapter
        self.controller, self.client = controller, client

    def metrics_reads(self) -> int:
        return sum(1 for _, p in self.fake.received if p.rstrip("/") == Routes.METRICS)

    async def post(self, route: str, body: Any = None, **kw: Any) -> httpx.Response:
        return await self.client.post(BASE + route, json=body, **kw)

    async def published_round(self, w: FakeWeights) -> None:
        """TRL server mode's round: start, update, finish (the round closes there)."""
        assert (await self.post("/start_weight_update")).status_code == 200
        assert (await self.post("/update_weights", _body(w))).status_code == 200
        fin = await self.post("/finish_weight_update")
        assert fin.status_code == 200, fin.text
        assert self.controller.state is State.READY

    def out_of_band_write(self) -> None:
        """Somebody else's ``/update_weights``, straight to the engine (counted there)."""
        got = httpx.post(self.url + Routes.UPDATE_WEIGHTS, json={"update_info": {"names": []}},
                         timeout=10)
        assert got.status_code == 200, got.text

    async def expired(self) -> None:
        """Until the open round's deadline has ended it."""
        for _ in range(200):
            if self.native.round is None:
                return
            await anyio.sleep(0.02)
        raise AssertionError("the round was not expired")

    native: Any = None


@asynccontextmanager
async def _rig(lease_s: float = 0.4) -> AsyncIterator[_Rig]:
    eng = FakeEngine(W0, token_delay_s=0.0)
    fake = FakeVllm(eng, model="policy")
    fake.version = "0.32.0"  # it counts its weight-update calls at /metrics
    url = serve_fake(fake)
    ad = VllmAdapter(VllmHTTP(url), None)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    try:
        r = LifecycleRunner(c, ad, FAST, record=j.write)
        r.bootstrap(W0.identity())
        assert ad._counts_ops and ad._ops_verified is not None
        app = create_app(r, ServiceConfig(upstream_url=url, control_token=CONTROL,
                                          lease_s=lease_s, min_verification="declared"),
                         native_token=TOKEN)
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://gw.test",
                                                    timeout=30) as client:
            rig = _Rig(fake, url, ad, c, client)
            rig.native = app.state.native
            yield rig
    finally:
        ad.close()


async def test_a_round_reads_the_counters_once_and_its_drain_takes_the_verified_ones() -> None:
    async with _rig() as r:
        await r.published_round(W1)
        verified = r.adapter._ops_verified
        assert verified is not None
        before = r.metrics_reads()
        assert (await r.post("/pause", params={"mode": "wait"})).status_code == 200
        # the drain read nothing: its baseline is what the last round was verified at
        assert r.metrics_reads() == before
        assert r.adapter._ops_at_drain is verified
        assert (await r.post("/start_weight_update")).status_code == 200
        assert (await r.post("/update_weights", _body(W2))).status_code == 200
        assert (await r.post("/finish_weight_update")).status_code == 200
        assert (await r.post("/resume")).status_code == 200
        assert r.controller.state is State.READY
        assert r.metrics_reads() == before + 1  # the paused validation's read, only
        assert r.adapter._ops_verified is not verified


async def test_an_expired_round_that_sent_nothing_is_no_mutation() -> None:
    async with _rig() as r:
        await r.published_round(W1)
        committed = r.controller.snapshot()["committed"]
        assert (await r.post("/pause", params={"mode": "wait"})).status_code == 200
        await r.expired()
        # the engine counted nothing since the weights were verified: back in service
        assert r.controller.state is State.READY
        assert r.controller.snapshot()["committed"] == committed


async def test_an_expired_round_after_its_own_writes_is_tainted() -> None:
    async with _rig() as r:
        await r.published_round(W1)
        assert (await r.post("/pause", params={"mode": "wait"})).status_code == 200
        assert (await r.post("/start_weight_update")).status_code == 200
        assert (await r.post("/update_weights", _body(W2))).status_code == 200
        await r.expired()
        assert r.controller.state is State.TAINTED


async def test_a_write_out_of_band_before_the_pause_taints_an_expired_round() -> None:
    """A read beside the pause would have taken this write into its baseline and
    returned the engine to service on weights nobody verified."""
    async with _rig() as r:
        await r.published_round(W1)
        committed = r.controller.snapshot()["committed"]
        r.out_of_band_write()
        assert (await r.post("/pause", params={"mode": "wait"})).status_code == 200
        assert r.adapter.writes_since_drain() == ("1 /update_weights call(s)",)
        await r.expired()
        assert r.controller.state is State.TAINTED
        assert r.controller.snapshot()["committed"] == committed


async def test_a_restarted_engines_counters_taint_an_expired_round() -> None:
    """A new process counts from zero: whatever it holds was not verified."""
    async with _rig() as r:
        await r.published_round(W1)
        # the engine's counters start again (a new process behind the same URL)
        r.fake._registry = prometheus_client.CollectorRegistry()
        r.fake._op_seconds = prometheus_client.Histogram(
            "vllm:rl_weight_update_operation_duration_seconds",
            "Duration of weight update operations.", ["operation"], registry=r.fake._registry)
        r.fake._sleep_state = prometheus_client.Gauge(
            "vllm:engine_sleep_state", "Engine sleep state.", ["sleep_state"],
            registry=r.fake._registry)
        assert (await r.post("/pause", params={"mode": "wait"})).status_code == 200
        assert r.adapter.writes_since_drain()
        await r.expired()
        assert r.controller.state is State.TAINTED


async def test_without_a_verified_baseline_the_drain_reads_beside_its_pause() -> None:
    async with _rig() as r:
        await r.published_round(W1)
        r.adapter._ops_verified = None  # the last read failed
        before = r.metrics_reads()
        r.adapter.drain(PauseMode.WAIT)
        assert r.metrics_reads() == before + 1
        assert r.adapter._ops_at_drain is not None
        assert r.adapter.writes_since_drain() == ()
        r.out_of_band_write()  # after the read: counted
        assert r.adapter.writes_since_drain() == ("1 /update_weights call(s)",)
        r.adapter.resume()
