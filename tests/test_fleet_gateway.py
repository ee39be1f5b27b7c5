"""The fleet gateway over simulated engines (fast lane): routing, refusals, status, metrics.

Each replica's upstream is a ``FakeVllm`` on its own loopback port, so the
per-replica data planes (admission, binding, version headers) are the
service's own, reached over real HTTP.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from fleettools import FakeFleet, fake_fleet, fleet_client, served, weights
from helpers.asgi_stream import lifespan
from helpers.gateway_rig import TOKEN
from rolloutcore.core.pool import FleetUpdateBegin, Strategy
from rolloutcore.core.records import Admit
from rolloutcore.errors import BadInput
from rolloutcore.fleet import FleetConfig, FleetCoordinator, Replica
from rolloutcore.fleet.gateway import (
    FLEET_LABEL_HEADER,
    FLEET_VERSION_HEADER,
    REPLICA_HEADER,
    create_fleet_app,
)
from rolloutcore.service import ServiceConfig
from rolloutcore.service.proxy import VERSION_HEADER

pytestmark = pytest.mark.anyio
AUTH = {"authorization": f"Bearer {TOKEN}"}
GEN = "/inference/v1/generate"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def gen_body(**extra: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 5}, **extra}


async def test_answers_carry_the_fleet_version_and_the_engine_version_of_their_binding(
        ) -> None:
    async with fleet_client() as (f, client, fakes):
        replicas = set()
        for _ in range(6):
            r = await client.post(GEN, json=gen_body())
            assert r.status_code == 200, r.text
            spans = r.json()["choices"][0]["weight_versions"]
            assert {s["version"] for s in spans} == {r.headers[VERSION_HEADER]} == {"default"}
            assert r.headers[FLEET_VERSION_HEADER] == "0"
            assert r.headers[FLEET_LABEL_HEADER] == "fleet-0"
            replicas.add(r.headers[REPLICA_HEADER])
        assert replicas == {"r0", "r1", "r2"}   # idle replicas take turns
        r = await client.post(GEN, json=gen_body(rolloutcore_policy="any",
                                                 rolloutcore_group="g1"))
        assert r.status_code == 200
        sent = fakes[r.headers[REPLICA_HEADER]].bodies[-1]
        assert "rolloutcore_policy" not in sent and "rolloutcore_group" not in sent


async def test_a_group_stays_on_one_replica() -> None:
    async with fleet_client() as (f, client, fakes):
        seen = {(await client.post(GEN, json=gen_body(), headers={
            "x-rolloutcore-group": "run/step3/p7"})).headers[REPLICA_HEADER]
            for _ in range(5)}
        assert len(seen) == 1
        body = {"token_ids": [9, 9, 9], "sampling_params": {"max_tokens": 2, "n": 4}}
        seen = {(await client.post(GEN, json=body)).headers[REPLICA_HEADER] for _ in range(4)}
        assert len(seen) == 1


@pytest.mark.parametrize("headers,body,status", [
    ({"x-rolloutcore-policy": "newest"}, {}, 400),
    ({"x-rolloutcore-policy": "pinned:fleet-7"}, {}, 404),
    ({"x-rolloutcore-policy": "min-version:5"}, {}, 409),
    ({"x-rolloutcore-policy": "min-version:x"}, {}, 400),
    ({"x-rolloutcore-group": "not a group"}, {}, 400),
    ({}, {"rolloutcore_policy": 3}, 400),
    ({"x-rolloutcore-policy": "latest"}, {"rolloutcore_policy": "any"}, 400),
])
async def test_bad_routing_input_is_a_clear_4xx_and_nothing_is_routed(
        headers: dict[str, str], body: dict[str, Any], status: int) -> None:
    async with fleet_client() as (f, client, fakes):
        r = await client.post(GEN, json=gen_body(**body), headers=headers)
        assert r.status_code == status, r.text
        assert r.json()["error"]["message"]
        assert all(not fk.bodies for fk in fakes.values())
        assert not [x for j in f.journals.values() for x in j.records
                    if isinstance(x.record, Admit)]
        r = await client.post(GEN, content=b"{not json", headers={
            "content-type": "application/json"})
        assert r.status_code == 400


def _close_admission(f: FakeFleet) -> None:
    """What a synchronous update does between its begin and its decision."""
    f.coord._shell.run(f.coord._table.begin_update, FleetUpdateBegin(
        99, Strategy.SYNCHRONOUS, f.coord.newest.generation + 1, "fleet-99",  # type: ignore
        "0" * 64, ("r0",), 1, None, "fanout"))
    f.coord._shell.run(f.coord._table.close_admission, 99, "synchronous update 99")


def _reopen(f: FakeFleet) -> None:
    f.coord._shell.run(f.coord._table.end_update, 99)


async def test_no_eligible_replica_is_503_with_retry_after_never_another_version() -> None:
    async with fleet_client() as (f, client, fakes):
        _close_admission(f)
        r = await client.post(GEN, json=gen_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert "closed fleet-wide" in r.json()["error"]["message"]
        _reopen(f)
        f.coord.update(weights(1), strategy="rolling", min_serving=2)
        r = await client.post(GEN, json=gen_body(), headers={
            "x-rolloutcore-policy": "pinned:fleet-0"})
        assert r.status_code == 410
        r = await client.post(GEN, json=gen_body(), headers={
            "x-rolloutcore-policy": "max-staleness:0"})
        assert r.status_code == 200 and r.headers[FLEET_VERSION_HEADER] == "1"
        assert r.headers[VERSION_HEADER] == "fleet-1"


async def test_bounded_queue_waits_for_the_fleet_to_reopen() -> None:
    async with fleet_client(queue_max=4, queue_wait_s=5) as (f, client, fakes):
        _close_admission(f)

        async def reopen() -> None:
            import anyio
            await anyio.sleep(0.3)
            _reopen(f)

        import anyio
        async with anyio.create_task_group() as tg:
            tg.start_soon(reopen)
            t0 = time.monotonic()
            r = await client.post(GEN, json=gen_body())
        assert r.status_code == 200 and time.monotonic() - t0 >= 0.25


async def test_status_and_metrics_show_replicas_versions_and_loads() -> None:
    async with fleet_client() as (f, client, fakes):
        f.coord.update(weights(1), strategy="rolling", min_serving=2)
        st = (await client.get("/control/status", headers=AUTH)).json()
        assert st["serving"] == 3 and st["newest"]["label"] == "fleet-1"
        assert st["versions_served"] == {"fleet-1": 3}
        assert {r["name"]: (r["state"], r["fleet_generation"], r["load"])
                for r in st["replicas"]} == {n: ("SERVING", 1, 0) for n in ("r0", "r1", "r2")}
        assert (await client.get("/control/status")).status_code == 401
        text = (await client.get("/metrics")).text
        assert 'rolloutcore_fleet_replica_generation{replica="r1"} 1.0' in text
        assert 'rolloutcore_fleet_version_replicas{label="fleet-1"} 3.0' in text
        assert 'rolloutcore_fleet_replica_state{replica="r0",state="SERVING"} 1.0' in text
        assert (await client.get("/health")).status_code == 200


async def test_an_update_through_the_control_route() -> None:
    async with fleet_client() as (f, client, fakes):
        r = await client.post("/control/fleet/updates", json={"seed": 2}, headers=AUTH)
        assert r.status_code == 202
        url = r.json()["status_url"]
        for _ in range(200):
            got = (await client.get(url, headers=AUTH)).json()
            if got["state"] != "running":
                break
            time.sleep(0.02)
        assert got["state"] == "published", got
        assert got["result"]["published"]["label"] == "fleet-1"
        assert (await client.post("/control/fleet/updates", json={"seed": 2})).status_code == 401


def test_every_replica_needs_a_url() -> None:
    f = fake_fleet(1)
    rep = f.coord.replicas["r0"]
    c = FleetCoordinator([Replica("x", rep.runner, rep.stage)])
    with pytest.raises(Exception, match="no URL"):
        create_fleet_app(c, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                          control_token=TOKEN))


async def test_a_bad_update_body_is_a_400_before_any_job_and_one_update_runs_at_a_time(
        ) -> None:
    f = fake_fleet(2, config=FleetConfig(health_interval_s=0))
    release = threading.Event()

    def check(body: Any) -> None:
        if not isinstance(body.get("seed"), int):
            raise BadInput("'seed' must be an integer")

    def updater(body: Any) -> Any:
        release.wait(30)
        return f.coord.update(weights(int(body["seed"])))

    with served(f):
        app = create_fleet_app(f.coord, ServiceConfig(
            upstream_url="http://127.0.0.1:1", control_token=TOKEN),
            updater=updater, supervise=False, check_update=check)
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://fleet.test",
                                                    timeout=30) as client:
            bad = await client.post("/control/fleet/updates", json={"seed": "two"},
                                    headers=AUTH)
            assert bad.status_code == 400 and "seed" in bad.json()["error"]
            assert app.state.fleet.jobs == {}
            first = await client.post("/control/fleet/updates", json={"seed": 2},
                                      headers=AUTH)
            assert first.status_code == 202
            second = await client.post("/control/fleet/updates", json={"seed": 3},
                                       headers=AUTH)
            assert second.status_code == 409 and "still running" in second.json()["error"]
            release.set()
            url = first.json()["status_url"]
            for _ in range(300):
                got = (await client.get(url, headers=AUTH)).json()
                if got["state"] != "running":
                    break
                time.sleep(0.02)
            assert got["state"] == "published", got
            assert list(app.state.fleet.jobs) == [1]
