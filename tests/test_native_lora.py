"""vLLM's LoRA routes on the gateway (service.native_lora), over the one fake of vLLM.

The gateway is the real one (``create_app`` with the real ``AdapterManager``);
the adapters are loaded, listed and probed on the one fake with
``testing.peft_scorer`` (the tiny model through PEFT), so a load publishes only when the engine
computes what the adapter's reference does. Generation goes to the fake vLLM
data plane, which echoes the model it was sent: the adapter version the
gateway bound. An unmodified client's bodies and answers are vLLM's; hostile
input is a 4xx in vLLM's error shape that changes nothing, never a 5xx.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.asgi_stream import lifespan
from helpers.gateway_rig import TOKEN, make_parts, serve_fake
from helpers.needs import installed
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.adapters import AdapterConfig, AdapterState
from rolloutcore.engine.routes import Routes
from rolloutcore.service import ServiceConfig, create_app

installed("peft")
pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("one_torch_thread")]

NATIVE = "native-lora-token-0123456789ab"
BASE = f"/rc/{NATIVE}"
LOAD, UNLOAD = BASE + "/v1/load_lora_adapter", BASE + "/v1/unload_lora_adapter"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from rolloutcore.testing.models import make_adapter, make_checkpoint

    root = tmp_path_factory.mktemp("lora")
    out = {"base": make_checkpoint(root / "base", 0)}
    for seed in (1, 2, 3):
        make_adapter(out["base"], seed, rank=4).save_pretrained(root / f"a{seed}")
        out[f"a{seed}"] = root / f"a{seed}"
    return out


@dataclass
class LoraRig:
    client: httpx.AsyncClient
    manager: AdapterManager
    engine: Any
    app: Any
    journal: Any

    @property
    def admission(self) -> Any:
        return self.app.state.gateway.data.admission

    def state(self) -> tuple[Any, ...]:
        """Everything a refused call must leave as it was."""
        v = self.manager.view
        names = self.admission.names
        return (v.current, dict(v.states), dict(v.bound), dict(self.engine.loras),
                names.current, dict(names.loaded),
                # the adapter machine's records (a finished request's land after its answer)
                sum(1 for x in self.journal.records if x.kind == "adapter"))


@contextlib.asynccontextmanager
async def lora_rig(files: dict[str, Path], tmp_path: Path, *, max_staleness: int = 1
                   ) -> AsyncIterator[LoraRig]:
    from rolloutcore.testing.peft_scorer import peft_vllm

    _, _, c, r, j, fake = make_parts()
    engine, lora_client = peft_vllm(files["base"])
    m = AdapterManager(lora_client, c, base_model=files["base"], store=tmp_path / "store",
                       config=AdapterConfig(max_loaded=4, max_staleness=max_staleness),
                       listener=j.listener, max_rank=8)
    fake.loras = engine.loras  # the served fake lists the adapters the LoRA fake loaded
    config = ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN,
                           min_verification="declared")
    app = create_app(r, config, adapters=m, native_token=NATIVE)
    try:
        async with lifespan(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://gateway.test",
                timeout=120) as client:
            yield LoraRig(client, m, engine, app, j)
    finally:
        m.close()


async def load(r: LoraRig, name: str, path: Path | str, **kw: Any) -> httpx.Response:
    return await r.client.post(LOAD, json={"lora_name": name, "lora_path": str(path), **kw})


async def unload(r: LoraRig, name: str) -> httpx.Response:
    return await r.client.post(UNLOAD, json={"lora_name": name})


async def generate(r: LoraRig, model: str) -> httpx.Response:
    return await r.client.post(BASE + "/v1/completions",
                               json={"model": model, "prompt": "hello", "max_tokens": 2})


def vllm_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    """The answer is vLLM's ErrorResponse with ``status``; its ``error`` object."""
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return dict(err)


async def test_a_load_publishes_a_verified_version_and_the_name_routes_to_it(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path) as r:
        resp = await load(r, "my-lora", files["a1"])
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'my-lora' added successfully."
        v = r.manager.current
        assert v is not None and resp.headers["x-rolloutcore-adapter"] == v.name
        assert r.manager.view.states[v.name] is AdapterState.PUBLISHED
        assert v.name in r.engine.loras and r.engine.loras[v.name] == v.path
        # journaled through the adapter machinery, the client's name and path with it
        recs = [x.data for x in r.journal.records if x.kind == "adapter"]
        pub = [x for x in recs if x["after"] == "published"]
        assert [x["name"] for x in pub] == [v.name]
        assert any("vllm-lora:my-lora" in e and str(files["a1"]) in e
                   for e in pub[0]["evidence"])
        assert {c for x in pub for c in x["evidence"] if c.startswith("adapter-probe")}
        # generation for the client's name is bound to the version and labelled with it
        g = await generate(r, "my-lora")
        assert g.status_code == 200, g.text
        assert g.json()["model"] == v.name
        assert g.json()["rolloutcore"]["adapter"] == v.name
        assert g.headers["x-rolloutcore-adapter"] == v.name
        # vLLM lists an adapter by the name it was loaded as: so does the gateway
        cards = (await r.client.get(BASE + "/v1/models")).json()["data"]
        mine = [m for m in cards if m["id"] == "my-lora"]
        assert len(mine) == 1 and mine[0]["root"] == str(files["a1"])
        assert mine[0]["parent"] in {m["id"] for m in cards if m.get("parent") is None}


async def test_in_place_reload_supersedes_and_an_unload_waits_for_bound_requests(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path) as r:
        assert (await load(r, "pol", files["a1"])).status_code == 200
        first = r.manager.current
        assert first is not None
        before = r.state()
        # vLLM's rule: a loaded name is reloaded only in place
        err = vllm_error(await load(r, "pol", files["a2"]), 400)
        assert err["type"] == "InvalidUserInput" and "load_inplace" in err["message"]
        assert r.state() == before
        # a request bound to the first version, still running
        _, target = r.admission.try_admit("long", "client-name")
        assert target.model == first.name
        assert (await load(r, "pol", files["a2"], load_inplace=True)).status_code == 200
        second = r.manager.current
        assert second is not None and second.name != first.name
        assert r.manager.view.states[first.name] is AdapterState.STANDBY
        assert (await generate(r, "pol")).json()["model"] == second.name
        # the unload withdraws the current one: no request gets it any more ...
        resp = await unload(r, "pol")
        assert resp.status_code == 200
        assert resp.text == "Success: LoRA adapter 'pol' removed successfully."
        assert r.manager.current is None
        assert second.name not in r.engine.loras       # nothing bound: unloaded now
        assert r.manager.view.states[second.name] is AdapterState.RETIRED
        assert vllm_error(await unload(r, "pol"), 404)["type"] == "NotFoundError"
        cards = (await r.client.get(BASE + "/v1/models")).json()["data"]
        assert "pol" not in {m["id"] for m in cards}
        # ... and the first version, superseded, stays while its request runs
        assert first.name in r.engine.loras
        g = await generate(r, "pol")   # the name is gone: the base's request, vLLM's 404
        assert g.json().get("model") != second.name
        target.on_release("long")      # type: ignore[misc]
        assert r.manager.wait_swept(60)
        assert r.manager.view.states[first.name] is AdapterState.RETIRED
        assert first.name not in r.engine.loras
        events = [(x["name"], x["event"]) for x in (y.data for y in r.journal.records
                                                    if y.kind == "adapter")]
        assert (second.name, "withdrawn") in events


async def test_a_load_under_another_name_supersedes_and_the_old_name_is_refused(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path, max_staleness=1) as r:
        assert (await load(r, "step-1", files["a1"])).status_code == 200
        one = r.manager.current
        assert (await load(r, "step-2", files["a2"])).status_code == 200
        two = r.manager.current
        assert one is not None and two is not None
        old = await generate(r, "step-1")   # never answered by another version
        assert old.status_code == 400 and "superseded" in old.text
        assert (await generate(r, "step-2")).json()["model"] == two.name
        # max_staleness keeps one superseded version loaded; the client's unload retires it
        assert r.manager.view.states[one.name] is AdapterState.STANDBY
        assert (await unload(r, "step-1")).status_code == 200
        assert r.manager.view.states[one.name] is AdapterState.RETIRED
        assert r.manager.current == two and r.admission.names.current == "step-2"


async def test_a_load_that_fails_verification_changes_nothing_the_client_sees(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path) as r:
        assert (await load(r, "pol", files["a1"])).status_code == 200
        first = r.manager.current
        r.engine.base_under_name = 1     # listed, but the base computes under its name
        err = vllm_error(await load(r, "pol", files["a2"], load_inplace=True), 409)
        assert "adapter-probe" in err["message"] and "keeps serving" in err["message"]
        assert r.manager.current == first
        assert (await generate(r, "pol")).json()["model"] == first.name  # type: ignore[union-attr]
        r.engine.fail(Routes.LOAD_LORA, 400)  # the engine refuses the load (a 4xx)
        vllm_error(await load(r, "other", files["a3"]), 409)
        assert r.admission.names.loaded == {"pol": [first.name]}  # type: ignore[union-attr]
        before = r.state()
        r.engine.down = True             # the engine does not answer: a 4xx, not a 5xx
        err = vllm_error(await load(r, "other", files["a3"]), 409)
        assert "does not answer" in err["message"]
        assert r.state() == before


async def test_hostile_input_is_a_4xx_in_vllms_shape_and_changes_nothing(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path) as r:
        assert (await load(r, "pol", files["a1"])).status_code == 200
        before = r.state()
        c = r.client
        not_adapter = tmp_path / "not-an-adapter"
        not_adapter.mkdir()
        cases: list[tuple[Any, int, str]] = [
            (c.post(LOAD, content=b"{not json", headers={"content-type": "application/json"}),
             400, "JSON"),
            (c.post(LOAD, content=b"[1, 2]", headers={"content-type": "application/json"}),
             400, "object"),
            (c.post(LOAD, content=b'{"lora_name": "x", "lora_path": "/y"}',
                    headers={"content-type": "text/plain"}), 400, "application/json"),
            (c.post(LOAD, json={"lora_path": str(files["a2"])}), 400, "lora_name"),
            (c.post(LOAD, json={"lora_name": 7, "lora_path": str(files["a2"])}), 400,
             "valid string"),
            (c.post(LOAD, json={"lora_name": "", "lora_path": str(files["a2"])}), 400,
             "Both 'lora_name' and 'lora_path'"),
            (c.post(LOAD, json={"lora_name": "x", "lora_path": str(files["a2"]),
                                "load_inplace": "yes"}), 400, "boolean"),
            (c.post(LOAD, json={"lora_name": "policy", "lora_path": str(files["a2"])}), 400,
             "conflicts with a served base model"),
            (c.post(LOAD, json={"lora_name": r.manager.current.name,  # type: ignore[union-attr]
                                "lora_path": str(files["a2"])}), 400, "conflicts"),
            (c.post(LOAD, json={"lora_name": "x", "lora_path": str(tmp_path / "nope")}), 404,
             "No adapter found"),
            (c.post(LOAD, json={"lora_name": "x", "lora_path": str(not_adapter)}), 400,
             "not loaded"),
            (c.post(LOAD, json={"lora_name": "x\n", "lora_path": str(files["a2"])}), 400,
             "printable"),
            (c.post(UNLOAD, json={"lora_name": "never-loaded"}), 404, "cannot be found"),
            (c.post(UNLOAD, json={}), 400, "lora_name"),
            (c.post(UNLOAD, json={"lora_name": "pol", "lora_int_id": "1"}), 400, "integer"),
            (c.get(LOAD), 405, "Method"),
            (c.post("/rc/wrong-token-0123456789abc/v1/load_lora_adapter",
                    json={"lora_name": "x", "lora_path": str(files["a2"])}), 404, "Not Found"),
            (c.post("/v1/load_lora_adapter",
                    json={"lora_name": "x", "lora_path": str(files["a2"])}), 404, ""),
        ]
        for call, status, needle in cases:
            resp = await call
            assert resp.status_code == status, (needle, resp.status_code, resp.text)
            assert needle in resp.text, (needle, resp.text)
            assert r.state() == before, needle


async def test_a_load_or_unload_while_a_weight_round_is_open_is_refused(
        files: dict[str, Path], tmp_path: Path) -> None:
    async with lora_rig(files, tmp_path) as r:
        assert (await load(r, "pol", files["a1"])).status_code == 200
        assert (await r.client.post(BASE + "/pause", params={"mode": "wait"})
                ).status_code == 200
        assert r.app.state.native.round is not None
        before = r.state()
        err = vllm_error(await load(r, "pol", files["a2"], load_inplace=True), 409)
        assert "weight round is open" in err["message"]
        assert "weight round is open" in vllm_error(await unload(r, "pol"), 409)["message"]
        assert r.state() == before
        assert (await r.client.post(BASE + "/resume")).status_code == 200
        assert r.app.state.native.round is None
        assert (await unload(r, "pol")).status_code == 200


async def test_without_lora_the_routes_are_refused_with_the_reason() -> None:
    from helpers.gateway_rig import rig

    async with rig(native_token=NATIVE) as r:
        resp = await r.client.post(LOAD, json={"lora_name": "x", "lora_path": "/y"})
        err = vllm_error(resp, 404)
        assert "serve --lora" in err["message"]


async def test_a_fleet_refuses_the_lora_routes_with_the_reason() -> None:
    from fleettools import fake_fleet
    from rolloutcore.fleet import FleetConfig
    from rolloutcore.fleet.gateway import create_fleet_app

    f = fake_fleet(2, config=FleetConfig(health_interval_s=0))
    try:
        app = create_fleet_app(f.coord, ServiceConfig(
            upstream_url="http://127.0.0.1:1", control_token=TOKEN,
            min_verification="declared"), supervise=False, native_token=NATIVE)
        async with lifespan(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url="http://fleet.test") as client:
            for route in (LOAD, UNLOAD):
                resp = await client.post(route, json={"lora_name": "x", "lora_path": "/y"})
                err = vllm_error(resp, 404)
                assert "fleet gateway does not serve" in err["message"]
                assert json.loads(resp.text)["error"]["type"] == "NotFoundError"
    finally:
        f.coord.close()
