"""vLLM's own RL routes on a fleet gateway (fleet.native), over fake engines (fast lane).

Two (or three) FakeEngines, each behind its own FakeVllm on loopback HTTP, under the
real coordinator and the real fleet gateway; the trainer speaks vLLM's contract to
``/rc/<token>`` as to one vLLM: the world size is the sum, the init is split with
per-engine rank offsets, the round fans out, and one fleet version is published when
every replica (or the quorum) verified; a replica that fails is named and nothing is
published below the quorum.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from fleettools import FAST, fake_fleet, served
from helpers.asgi_stream import lifespan
from helpers.gateway_rig import TOKEN
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import ReplicaState
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.fleet import FleetConfig
from rolloutcore.fleet.gateway import create_fleet_app
from rolloutcore.service import ServiceConfig
from rolloutcore.testing.fake import FakeWeights
from rolloutcore.testing.fake_engine import FaultKind

pytestmark = pytest.mark.anyio

NATIVE = "fleet-native-token-0123456789abcdef"
BASE = f"/rc/{NATIVE}"
W1 = FakeWeights.from_seed(1, step=1)
W2 = FakeWeights.from_seed(2, step=2)
INIT = {"init_info": {"master_address": "127.0.0.1", "master_port": 29555,
                      "rank_offset": 1, "world_size": 3, "timeout_s": 30.0}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def native_fleet(n: int = 2, *, quorum: int | None = None, lease_s: float = 30.0,
                       floor: VerificationLevel = VerificationLevel.DECLARED
                       ) -> AsyncIterator[tuple[Any, Any, Any]]:
    f = fake_fleet(n, config=FleetConfig(health_interval_s=0, quorum=quorum))
    with served(f) as fakes:
        app = create_fleet_app(f.coord, ServiceConfig(
            upstream_url="http://127.0.0.1:1", control_token=TOKEN, min_verification=floor,
            lease_s=lease_s), supervise=False, native_token=NATIVE)
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://fleet.test",
                                                    timeout=30) as client:
            try:
                yield f, client, fakes
            finally:
                f.coord.close()


def update_body(w: FakeWeights) -> dict[str, Any]:
    ns = sorted(w.tensors)
    return {"update_info": {"names": ns, "dtype_names": ["bfloat16"] * len(ns),
                            "shapes": [[len(w.tensors[n])] for n in ns],
                            "fake_data": [w.tensors[n].hex() for n in ns]}}


async def post(client: Any, route: str, body: Any = None) -> Any:
    return await client.post(BASE + route, json=body)


def inits(fake: Any) -> list[dict[str, Any]]:
    """The bodies of ``/init_weight_transfer_engine`` the fake replica was sent."""
    return [b for b in fake.bodies if "init_info" in b]


def notes(f: Any, name: str) -> list[dict[str, Any]]:
    return [dict(r.data) for r in f.journals[name].records
            if r.kind == "note" and r.data.get("what") == "native_round"]


async def test_a_fleet_behind_one_url_publishes_one_fleet_version() -> None:
    async with native_fleet(2) as (f, client, fakes):
        before = f.coord.newest
        ws = await client.get(BASE + "/get_world_size")
        assert ws.status_code == 200 and ws.json() == {"world_size": 2}
        init = await post(client, "/init_weight_transfer_engine", INIT)
        assert init.status_code == 200, init.text
        # split: one trainer rank, then r0's rank, then r1's
        assert [inits(fk)[-1]["init_info"]["rank_offset"] for fk in fakes.values()] == [1, 2]
        assert {inits(fk)[-1]["init_info"]["world_size"] for fk in fakes.values()} == {3}
        assert (await post(client, "/start_weight_update")).status_code == 200
        assert f.coord.pool.closed is not None   # fleet-wide admission closed
        assert (await client.get(BASE + "/is_paused")).json() == {"is_paused": True}
        assert (await post(client, "/update_weights", update_body(W1))).status_code == 200
        fin = await post(client, "/finish_weight_update", {"weight_version": "mine"})
        assert fin.status_code == 200, fin.text
        newest = f.coord.newest
        assert newest is not None and before is not None
        assert newest.generation == before.generation + 1
        assert sorted(f.coord.serving()) == ["r0", "r1"]
        for name in ("r0", "r1"):
            e = f.engine(name)
            assert e.weights_digest == W1.digest
            assert e.label == f.coord.replicas[name].controller.committed.label
            assert e.label not in ("mine", "default")
            ns = notes(f, name)
            assert len(ns) == 1 and ns[0]["fleet_label"] == newest.label
            assert ns[0]["level"] == "native-unreferenced"
        assert (await client.get(BASE + "/weight_info")).json() == {
            "weight_version": newest.label}
        assert (await client.get(BASE + "/is_paused")).json() == {"is_paused": False}
        g = await client.post(BASE + "/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}})
        assert g.status_code == 200, g.text
        assert newest.label in g.headers["x-rolloutcore-version"]
        reset = await post(client, "/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json() == {"success": True}
        # AsyncGRPO's sequence on the fleet: pause keep ... resume publishes
        assert (await post(client, "/pause?mode=keep")).status_code == 200
        assert (await post(client, "/start_weight_update",
                           {"is_checkpoint_format": True})).status_code == 200
        assert (await post(client, "/update_weights", update_body(W2))).status_code == 200
        assert (await post(client, "/finish_weight_update")).status_code == 200
        assert f.coord.newest == newest      # not before /resume
        assert (await post(client, "/resume")).status_code == 200
        assert f.coord.newest is not None and f.coord.newest.generation == \
            newest.generation + 1
        assert {f.engine(n).weights_digest for n in ("r0", "r1")} == {W2.digest}


async def test_a_replica_that_fails_publishes_nothing_and_is_named() -> None:
    async with native_fleet(2) as (f, client, _):
        before = f.coord.newest
        assert (await post(client, "/start_weight_update")).status_code == 200
        f.engine("r1").kill()
        resp = await post(client, "/update_weights", update_body(W1))
        assert resp.status_code == 409, resp.text
        assert "replica r1" in resp.json()["error"]["message"]
        assert f.coord.newest == before and f.coord.pool.update is None
        assert f.coord.state_of("r1") is not ReplicaState.SERVING
        st = f.coord.status()
        assert st["admission_closed"] is None
        # the replica's own journal names the failure
        taints = [r.data for r in f.journals["r1"].records if r.kind == "taint"]
        assert taints and "replica r1" in " ".join(taints[-1]["problems"])


async def test_one_replica_failing_its_validation_under_a_quorum() -> None:
    async with native_fleet(2) as (f, client, _):
        before = f.coord.newest
        f.adapters["r1"].inject("reset_prefix", FaultKind.LIE, times=10)
        assert (await post(client, "/start_weight_update")).status_code == 200
        assert (await post(client, "/update_weights", update_body(W1))).status_code == 200
        fin = await post(client, "/finish_weight_update")
        assert fin.status_code == 409 and "r1" in fin.json()["error"]["message"]
        assert f.coord.newest == before          # every replica must verify: nothing
    async with native_fleet(2, quorum=1) as (f, client, _):
        before = f.coord.newest
        f.adapters["r1"].inject("reset_prefix", FaultKind.LIE, times=10)
        assert (await post(client, "/start_weight_update")).status_code == 200
        assert (await post(client, "/update_weights", update_body(W1))).status_code == 200
        fin = await post(client, "/finish_weight_update")
        assert fin.status_code == 200, fin.text
        newest = f.coord.newest
        assert newest is not None and before is not None and newest != before
        assert f.coord.serving() == ["r0"]
        assert f.coord.state_of("r1") is not ReplicaState.SERVING


async def test_refusals_change_nothing() -> None:
    async with native_fleet(2) as (f, client, fakes):
        s0 = (f.coord.status(), [inits(fk) for fk in fakes.values()])
        # an init that cannot be split across engines
        for body in ({"init_info": {}}, {"init_info": {"rank_offset": 1, "world_size": 2}},
                     {"init_info": {"rank_offset": True, "world_size": 3}}):
            r = await post(client, "/init_weight_transfer_engine", body)
            assert r.status_code == 422, (body, r.text)
        assert (await post(client, "/finish_weight_update")).status_code == 409
        assert (await post(client, "/update_weights", {"update_info": {}})).status_code == 409
        assert (f.coord.status(), [inits(fk) for fk in fakes.values()]) == s0
    async with native_fleet(2, floor=VerificationLevel.PROBE) as (f, client, _):
        s0 = f.coord.status()
        r = await post(client, "/start_weight_update")
        assert r.status_code == 422 and "declared" in r.text
        assert f.coord.status() == s0


async def test_a_round_of_a_group_a_replica_cannot_join_is_refused() -> None:
    async with native_fleet(2) as (f, client, _):
        assert (await post(client, "/init_weight_transfer_engine", INIT)).status_code == 200
        before = f.coord.newest
        f.adapters["r1"].inject("drain", FaultKind.RAISE)
        r = await post(client, "/start_weight_update")
        assert r.status_code == 409 and "r1" in r.json()["error"]["message"], r.text
        assert "initialise again" in r.json()["error"]["message"]
        assert f.coord.newest == before and f.coord.pool.update is None
        assert f.coord.replicas["r0"].controller.state is State.READY
        assert "r0" in f.coord.serving()


async def test_a_round_never_finished_is_expired() -> None:
    async with native_fleet(2, lease_s=0.5) as (f, client, _):
        before = f.coord.newest
        assert (await post(client, "/start_weight_update")).status_code == 200
        import anyio

        with anyio.fail_after(20):
            while f.coord.pool.update is not None:
                await anyio.sleep(0.05)
        assert f.coord.newest == before
        # nothing was written: every replica back on the old version
        assert sorted(f.coord.serving()) == ["r0", "r1"]
        assert (await post(client, "/finish_weight_update")).status_code == 409



async def test_a_round_that_skips_a_tensor_is_refused_on_the_fleet_and_publishes_nothing(
        ) -> None:
    """After a full round, a round whose update leaves out one tensor of the last
    round's manifest is refused at finish (the single engine's check, inherited), the
    replicas are out of service and no fleet version is published."""
    async with native_fleet(2) as (f, client, _):
        for route, body in (("/start_weight_update", None), ("/update_weights",
                                                                update_body(W1)),
                            ("/finish_weight_update", None), ("/resume", None)):
            assert (await post(client, route, body)).status_code == 200
        before = f.coord.newest
        assert before is not None
        body = update_body(W2)
        info = body["update_info"]
        for k in ("names", "dtype_names", "shapes", "fake_data"):
            info[k] = info[k][1:]
        assert (await post(client, "/start_weight_update")).status_code == 200
        assert (await post(client, "/update_weights", body)).status_code == 200
        fin = await post(client, "/finish_weight_update")
        assert fin.status_code == 409 and "not written" in fin.text, fin.text
        assert f.coord.newest == before and f.coord.pool.update is None
        assert all(f.coord.state_of(n) is not ReplicaState.SERVING for n in ("r0", "r1"))


async def test_a_fleet_of_vllms_without_a_label_publishes_on_the_gateways_manifest_check(
        ) -> None:
    """vLLM 0.26 (no ``/weight_info``, no ``/weight_checker``) on every replica, each
    behind ``VllmAdapter``: a native round's paused validation has no label and no
    reference on any replica. The gateway's own check of the round (every name written
    once: the single engine's ``add_round_check``) is each replica's evidence, at the
    declared level, and the fleet version publishes (without it: "no evidence at all"
    on every replica, nothing published); a second round makes the check again.

    A takeover on 0.26 needs a check of its own (the fleet's transport gives one), so
    the replicas are taken over on the fake's full contract; then each engine answers
    0.26's and its replica's adapter is a new one read from it, as a replica's
    ``on_recovered`` makes it for a new incarnation (``fleet.placement``)."""
    from helpers.gateway_rig import _Switch, uvicorn_threads
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.engine.routes import Routes
    from rolloutcore.fleet import FleetCoordinator, Replica
    from rolloutcore.testing.fake import FakeEngine
    from rolloutcore.testing.fake_vllm import FakeVllm

    w0 = FakeWeights.from_seed(0)
    engines = [FakeEngine(w0, token_delay_s=0.0) for _ in range(2)]
    switches = [_Switch() for _ in engines]
    for sw, e in zip(switches, engines, strict=True):
        sw.app = FakeVllm(e, model="policy")
    adapters: list[VllmAdapter] = []
    with uvicorn_threads(switches, lifespan="off") as urls:
        reps, journals = [], {}
        for i, url in enumerate(urls):
            adapters.append(VllmAdapter(VllmHTTP(url), None))
            j = journals[f"r{i}"] = Journal()
            runner = LifecycleRunner(LifecycleController(listener=j.listener), adapters[-1],
                                     FAST, record=j.write)
            reps.append(Replica(f"r{i}", runner, lambda _p: None, url=url, fanout_url=url,
                                journal=j))
        coord = FleetCoordinator(reps, config=FleetConfig(health_interval_s=0))
        app = create_fleet_app(coord, ServiceConfig(
            upstream_url="http://127.0.0.1:1", control_token=TOKEN,
            min_verification=VerificationLevel.DECLARED), supervise=False,
            native_token=NATIVE)
        try:
            coord.bootstrap(w0.identity())
            assert sorted(coord.serving()) == ["r0", "r1"]
            for sw, e, rep, url in zip(switches, engines, reps, urls, strict=True):
                sw.app = FakeVllm(e, model="policy", without=(
                    Routes.WEIGHT_INFO, Routes.UPDATE_WEIGHT_VERSION, Routes.WEIGHT_CHECKER))
                adapters.append(VllmAdapter(VllmHTTP(url), None))
                adapters[-1].bootstrap()
                rep.runner.adapter = adapters[-1]
            async with lifespan(app), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app), base_url="http://fleet.test",
                    timeout=30) as client:
                for n, w in enumerate((W1, W2), 1):
                    before = coord.newest
                    assert (await post(client, "/start_weight_update")).status_code == 200
                    assert (await post(client, "/update_weights",
                                       update_body(w))).status_code == 200
                    fin = await post(client, "/finish_weight_update")
                    assert fin.status_code == 200, fin.text
                    newest = coord.newest
                    assert newest is not None and before is not None
                    assert newest.generation == before.generation + 1
                    assert sorted(coord.serving()) == ["r0", "r1"]
                    assert {e.weights_digest for e in engines} == {w.digest}
                    for name, j in journals.items():
                        vals = [rec.data["evidence"] for rec in j.records
                                if rec.kind == "evidence"
                                and rec.data.get("event") == "validated"]
                        mine = [ch for ch in vals[-1].get("checks") or ()
                                if ch.get("name") == "native_manifest"]
                        # this round's paused validation has it, made for this round
                        assert len(mine) == 1 and mine[0]["passed"], (name, vals[-1])
                        assert sum(ch.get("name") == "native_manifest" for v in vals
                                   for ch in v.get("checks") or ()) == n
        finally:
            coord.close()
            for ad in adapters:
                ad.close()
