"""The gateway as a drop-in OpenAI endpoint: vLLM's read-only routes pass through.

Clients (the OpenAI SDK, TRL, vLLM's own benchmark) ask ``/v1/models``
before generating; tokenizers are asked through ``/tokenize``. These routes
read no weights, so they pass through without admission, also while an
update holds admission closed, and the dev/control routes never do. Over the
in-process fake vLLM (rolloutcore.testing.fake_vllm); the real SDK against a
real vLLM is tests/engine/test_openai_sdk_engine.py.
"""

from __future__ import annotations

import httpx
import pytest

from helpers.asgi_stream import lifespan
from helpers.gateway_rig import AUTH, DATA_TOKEN, TOKEN, begin_body, lease, rig
from rolloutcore.core.lifecycle import State
from rolloutcore.engine.process import free_port
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.passthrough import READ_ONLY_ROUTES
from rolloutcore.service.proxy import VERSION_HEADER
from rolloutcore.testing.fake import FakeWeights

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_read_only_routes_answer_as_vllm_does() -> None:
    async with rig() as r:
        m = await r.client.get("/v1/models")
        assert m.status_code == 200 and m.json()["data"][0]["id"] == "policy"
        assert VERSION_HEADER not in m.headers  # not a rollout: nothing is bound
        assert (await r.client.get("/version")).json() == {"version": "fake"}
        assert (await r.client.get("/tokenizer_info")).json()["vocab_size"] == 256
        t = await r.client.post("/tokenize", json={"prompt": "hi"})
        assert t.json()["tokens"] == [104, 105]
        d = await r.client.post("/detokenize", json={"tokens": [104, 105]})
        assert d.json() == {"prompt": "hi"}
        assert r.controller.active == {}
        assert not [rec for rec in r.journal.records if rec.kind in ("admit", "refuse")]


async def test_they_pass_during_an_update_when_generation_is_refused() -> None:
    async with rig() as r:
        w1 = FakeWeights.from_seed(1, step=1)
        r.adapter.stage(w1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        assert b.status_code == 201 and r.controller.state is State.UPDATING
        assert (await r.client.get("/v1/models")).status_code == 200
        assert (await r.client.post("/tokenize", json={"prompt": "x"})).status_code == 200
        gen = await r.client.post("/inference/v1/generate",
                                  json={"token_ids": [1], "sampling_params": {}})
        assert gen.status_code == 503
        assert gen.headers["x-should-retry"] == "true" and gen.headers["retry-after"] == "1"


async def test_a_tainted_engine_tells_openai_clients_not_to_retry() -> None:
    async with rig() as r:
        w1 = FakeWeights.from_seed(1, step=1)
        b = await r.client.post("/control/updates", json=begin_body(w1), headers=AUTH)
        await r.client.post(f"/control/updates/{b.json()['update_id']}/transfer",
                            json={"failure": {"kind": "error", "reason": "lost"}},
                            headers=lease(b.json()))
        assert r.controller.state is State.TAINTED
        gen = await r.client.post("/v1/completions", json={"prompt": "x"})
        assert gen.status_code == 503 and gen.headers["x-should-retry"] == "false"


@pytest.mark.parametrize("route", ["/pause", "/resume", "/update_weights", "/collective_rpc",
                                   "/server_info", "/weight_info", "/reset_prefix_cache",
                                   "/start_weight_update", "/sleep"])
async def test_dev_and_control_routes_of_vllm_are_never_passed(route: str) -> None:
    async with rig() as r:
        for send in (r.client.post, r.client.get):
            resp = await send(route)
            assert resp.status_code in (404, 405)
        assert route not in {p for _, p in r.fake.received}
        assert route not in READ_ONLY_ROUTES


async def test_wrong_method_data_token_and_body_limit_apply() -> None:
    async with rig(data_token=DATA_TOKEN, max_body_bytes=64) as r:
        assert (await r.client.get("/v1/models")).status_code == 401
        bad = await r.client.get("/v1/models", headers={"authorization": "Bearer nope"})
        assert bad.status_code == 403
        h = {"authorization": f"Bearer {DATA_TOKEN}"}
        assert (await r.client.get("/v1/models", headers=h)).status_code == 200
        post = await r.client.post("/v1/models", headers=h)
        assert post.status_code == 405 and post.headers["allow"] == "GET"
        get = await r.client.get("/tokenize", headers=h)
        assert get.status_code == 405 and get.headers["allow"] == "POST"
        big = await r.client.post("/tokenize", json={"prompt": "x" * 100}, headers=h)
        assert big.status_code == 413


async def test_vllm_s_own_errors_pass_through_and_an_unreachable_vllm_is_502() -> None:
    async with rig() as r:
        e = await r.client.post("/tokenize", json={"prompt": 3})
        assert e.status_code == 400 and e.json()["error"]["message"]
        app = create_app(r.runner, ServiceConfig(upstream_url=f"http://127.0.0.1:{free_port()}",
                                                 control_token=TOKEN, upstream_connect_s=2.0))
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://gw.test") as c:
            resp = await c.get("/v1/models")
            assert resp.status_code == 502 and "unreachable" in resp.json()["error"]["message"]
