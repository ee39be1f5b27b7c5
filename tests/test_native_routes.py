"""vLLM's own RL routes on the gateway (service.native), over the fake engine (fast lane).

An unmodified trainer's route sequences (TRL server mode, TRL AsyncGRPO,
vLLM's HTTP weight-sync client) drive the gateway by base URL; each round is
one RolloutCore update through the runner: published with the gateway's
label, or refused / TAINTED with nothing published. Hostile input never gets
a 500 and a 4xx changes nothing.
"""

from __future__ import annotations

from typing import Any

import pytest

from helpers.gateway_rig import rig
from rolloutcore.core.lifecycle import State
from rolloutcore.errors import BadInput
from rolloutcore.service.native import NativeRoutes
from rolloutcore.service.native_engine import EngineRounds
from rolloutcore.testing.fake import FakeWeights, reference_tokens

pytestmark = pytest.mark.anyio

TOKEN = "native-token-0123456789abcdef"
BASE = f"/rc/{TOKEN}"
W1 = FakeWeights.from_seed(1, step=1)
W2 = FakeWeights.from_seed(2, step=2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def native_rig(**cfg: Any) -> Any:
    cfg.setdefault("min_verification", "declared")
    return rig(native_token=TOKEN, **cfg)


def update_body(w: FakeWeights, names: list[str] | None = None,
                data: dict[str, bytes] | None = None) -> dict[str, Any]:
    ns = sorted(w.tensors) if names is None else names
    src = w.tensors if data is None else data
    return {"update_info": {"names": ns, "dtype_names": ["bfloat16"] * len(ns),
                            "shapes": [[len(src[n])] for n in ns],
                            "fake_data": [src[n].hex() for n in ns]}}


def state(r: Any) -> tuple[Any, ...]:
    return (r.controller.snapshot(), len(r.journal.records), r.engine.weights_digest,
            r.engine.label, r.app.state.native.round is not None)


async def post(r: Any, route: str, body: Any = None, **kw: Any) -> Any:
    return await r.client.post(BASE + route, json=body, **kw)


async def trl_server_round(r: Any, w: FakeWeights) -> None:
    """TRL 1.16 server mode: no pause, one batched update, finish without a version,
    then the prefix reset."""
    assert (await r.client.get(BASE + "/get_world_size")).json() == {"world_size": 1}
    assert (await post(r, "/init_weight_transfer_engine", {"init_info": {}})).status_code == 200
    assert (await post(r, "/start_weight_update")).status_code == 200
    assert (await post(r, "/update_weights", update_body(w))).status_code == 200
    fin = await post(r, "/finish_weight_update")
    assert fin.status_code == 200, fin.text
    assert fin.json() == {"message": "Weight update finished"}
    # the answer that published says under which label, and at which level: the level
    # a trainer that declared nothing reaches, never one it did not (the body is vLLM's)
    assert fin.headers["x-rolloutcore-verification"] == "native-unreferenced"
    assert fin.headers["x-rolloutcore-version"] == r.controller.snapshot()["committed"]["label"]
    reset = await post(r, "/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json() == {"success": True}


async def test_trl_server_mode_sequence_publishes_under_the_gateways_label() -> None:
    async with native_rig() as r:
        await trl_server_round(r, W1)
        snap = r.controller.snapshot()
        assert snap["state"] == "READY"
        label = snap["committed"]["label"]
        assert label != "default" and r.engine.label == label
        assert r.engine.weights_digest == W1.digest
        notes = [n for n in r.kinds("note") if n.get("what") == "native_round"]
        assert len(notes) == 1 and notes[0]["level"] == "native-unreferenced"
        assert notes[0]["label"] == label and notes[0]["tensors"] == len(W1.tensors)
        assert notes[0]["opened_by"] == "start" and len(notes[0]["sent_manifest_digest"]) == 64
        # the gateway's own time in the round, by step, before the close
        assert set(notes[0]["gateway_s"]) == {"before_open", "open", "start_weight_update",
                                              "update_weights",
                                              "finish_weight_update"}
        assert all(v >= 0 for v in notes[0]["gateway_s"].values())
        info = await r.client.get(BASE + "/weight_info")
        assert info.json() == {"weight_version": label}
        # generation now names the published version and computes W1's policy
        g = await r.client.post("/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}})
        assert g.status_code == 200
        assert g.json()["choices"][0]["token_ids"] == reference_tokens(W1.digest, [5, 6, 7], 4)
        # ... and from the native base URL too (TRL generates where it updates)
        g2 = await r.client.post(BASE + "/inference/v1/generate", json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 4}})
        assert g2.status_code == 200 and g2.json()["choices"][0]["token_ids"] == \
            g.json()["choices"][0]["token_ids"]
        assert g2.headers["x-rolloutcore-version"] == g.headers["x-rolloutcore-version"]
        c = await r.client.post(BASE + "/v1/completions", json={"prompt": "abc",
                                                                 "max_tokens": 3})
        assert c.status_code == 200, c.text
        # a second round (0.33+ sender: unchanged metadata sent empty) publishes again
        assert (await post(r, "/start_weight_update")).status_code == 200
        body = update_body(W2)
        body["update_info"].update(names=[], dtype_names=[], shapes=[])
        assert (await post(r, "/update_weights", body)).status_code == 200
        # the fake's bytes went nowhere (no names): the broadcast of an unchanged round
        # is beside the call in vLLM; here the round still covers the carried manifest
        assert (await post(r, "/finish_weight_update")).status_code == 200
        assert r.controller.snapshot()["committed"]["label"] not in (label, "default")


async def test_async_grpo_sequence_pause_keep_publishes_at_resume() -> None:
    async with native_rig() as r:
        p = await post(r, "/pause?mode=keep")
        assert p.status_code == 200 and p.json() == {"status": "paused"}
        assert (await r.client.get(BASE + "/is_paused")).json() == {"is_paused": True}
        assert r.controller.state is State.UPDATING and r.engine.paused
        assert (await post(r, "/start_weight_update",
                           {"is_checkpoint_format": True})).status_code == 200
        assert (await post(r, "/update_weights", update_body(W1))).status_code == 200
        assert (await post(r, "/finish_weight_update", {"weight_version": "mine"})
                ).status_code == 200
        assert r.controller.snapshot()["committed"]["label"] != r.engine.label  # not yet
        res = await post(r, "/resume")
        assert res.status_code == 200 and res.json() == {"status": "resumed"}
        snap = r.controller.snapshot()
        assert snap["state"] == "READY" and snap["committed"]["label"] == r.engine.label
        assert res.headers["x-rolloutcore-version"] == snap["committed"]["label"]
        assert res.headers["x-rolloutcore-verification"] == "native-unreferenced"
        assert r.engine.label != "mine" and r.engine.weights_digest == W1.digest
        assert (await r.client.get(BASE + "/is_paused")).json() == {"is_paused": False}


async def test_pause_then_resume_with_nothing_sent_ends_with_no_mutation() -> None:
    async with native_rig() as r:
        before = r.controller.snapshot()["committed"]
        assert (await post(r, "/pause?mode=wait")).status_code == 200
        assert (await post(r, "/resume")).status_code == 200
        assert r.controller.state is State.READY
        assert r.controller.snapshot()["committed"] == before


async def test_a_wrong_tensor_taints_and_publishes_nothing() -> None:
    async with native_rig() as r:
        before = r.controller.snapshot()["committed"]
        assert (await post(r, "/start_weight_update")).status_code == 200
        name = sorted(W1.tensors)[0]
        bad = dict(W1.tensors)
        bad[name] = b"x" * (len(bad[name]) + 3)  # mis-shaped: the engine refuses it
        resp = await post(r, "/update_weights", update_body(W1, data=bad))
        assert resp.status_code == 409, resp.text
        assert resp.status_code not in (500, 502, 503)
        assert "error" in resp.json()
        assert r.controller.state is State.TAINTED
        assert r.controller.snapshot()["committed"] == before


async def test_a_wrong_but_well_shaped_tensor_is_published_at_the_unreferenced_level() -> None:
    """No reference declared: values are not checked, and nothing says they were. The
    answer, the round's note and the commit name what was checked, no more."""
    async with native_rig() as r:
        name = sorted(W1.tensors)[0]
        wrong = dict(W1.tensors)
        wrong[name] = bytes(len(wrong[name]))  # right shape, wrong values
        assert (await post(r, "/start_weight_update")).status_code == 200
        assert (await post(r, "/update_weights", update_body(W1, data=wrong))).status_code == 200
        fin = await post(r, "/finish_weight_update")
        assert fin.status_code == 200, fin.text
        assert fin.headers["x-rolloutcore-verification"] == "native-unreferenced"
        assert r.engine.weights_digest != W1.digest        # the wrong values serve
        notes = [n for n in r.kinds("note") if n.get("what") == "native_round"]
        assert notes[-1]["level"] == "native-unreferenced"
        assert notes[-1]["values_checked"] is False
        commit = r.kinds("commit")[-1]
        # no reference was invented: no content digest, no checksum or probe level
        assert commit["identity"]["content_digest"] is None
        # the controller's level for "the engine reports the assigned label" (docs)
        assert commit["identity"]["verification"] == "manifest"
        assert not [c for v in r.kinds("evidence") if v.get("event") == "validated"
                    for c in v["evidence"].get("checks", []) if c.get("passed")]


async def test_a_skipped_tensor_is_refused_against_the_last_rounds_manifest() -> None:
    async with native_rig() as r:
        await trl_server_round(r, W1)
        before = r.controller.snapshot()["committed"]
        assert (await post(r, "/start_weight_update")).status_code == 200
        names = sorted(W2.tensors)[1:]
        assert (await post(r, "/update_weights", update_body(W2, names))).status_code == 200
        fin = await post(r, "/finish_weight_update")
        assert fin.status_code == 409 and "not written" in fin.text
        assert r.controller.state is State.TAINTED
        assert r.controller.snapshot()["committed"] == before


async def test_a_tensor_written_twice_fails_the_round() -> None:
    async with native_rig() as r:
        assert (await post(r, "/start_weight_update")).status_code == 200
        assert (await post(r, "/update_weights", update_body(W1))).status_code == 200
        again = await post(r, "/update_weights", update_body(W1))
        assert again.status_code == 409 and "twice" in again.text
        assert r.controller.state is State.TAINTED


async def test_hostile_input_is_4xx_and_changes_nothing() -> None:
    async with native_rig() as r:
        s0 = state(r)
        for route, body, want in [
            ("/finish_weight_update", None, 409),      # finish with nothing open
            ("/update_weights", {"update_info": {}}, 409),  # update with no start
        ]:
            resp = await post(r, route, body)
            assert resp.status_code == want, (route, resp.text)
            assert state(r) == s0
        assert (await r.client.post(BASE + "/pause?mode=sideways")).status_code == 422
        assert (await r.client.post(BASE + "/start_weight_update", content=b"{nope",
                                    headers={"content-type": "application/json"})
                ).status_code == 400
        assert (await r.client.post(BASE + "/start_weight_update", json=[1])
                ).status_code == 422
        assert (await r.client.get(BASE + "/start_weight_update")).status_code == 405
        assert state(r) == s0
        # a malformed update body inside an open round: 422, the round goes on
        assert (await post(r, "/start_weight_update")).status_code == 200
        s1 = state(r)
        for bad in ({"update_info": "x"}, {"update_info": {"names": [1]}},
                    {"update_info": {"names": ["a", "a"], "dtype_names": ["x", "x"],
                                     "shapes": [[1], [1]]}},
                    {"update_info": {"names": ["a"], "shapes": [[-1]]}}):
            resp = await post(r, "/update_weights", bad)
            assert resp.status_code == 422, resp.text
            assert state(r) == s1
        # a second trainer's start while this round's is open: 409, nothing changes
        assert (await post(r, "/start_weight_update")).status_code == 409
        assert state(r) == s1
        assert (await post(r, "/update_weights", update_body(W1))).status_code == 200
        assert (await post(r, "/finish_weight_update")).status_code == 200
        s2 = state(r)
        # a replayed finish: 409, no state change
        assert (await post(r, "/finish_weight_update")).status_code == 409
        assert state(r) == s2


async def test_the_token_is_the_path_and_nothing_else_drives_the_routes() -> None:
    async with native_rig() as r:
        s0 = state(r)
        for path in ("/rc/wrong-token-0123456789abcdef/pause", "/rc//pause", "/rc/",
                     f"/rc/{TOKEN}x/pause", "/pause", "/start_weight_update"):
            resp = await r.client.post(path)
            assert resp.status_code in (401, 403, 404, 405), (path, resp.status_code)
        assert state(r) == s0
    with pytest.raises(BadInput):
        NativeRoutes(EngineRounds(r.runner, r.gateway.config), r.gateway.config, "short")


async def test_a_round_never_finished_is_expired_by_its_deadline() -> None:
    async with native_rig(lease_s=0.5) as r:
        before = r.controller.snapshot()["committed"]
        assert (await post(r, "/start_weight_update")).status_code == 200
        assert (await post(r, "/update_weights", update_body(W1))).status_code == 200
        for _ in range(100):
            if r.app.state.native.round is None:
                break
            import anyio
            await anyio.sleep(0.05)
        assert r.app.state.native.round is None
        assert r.controller.state is State.TAINTED
        assert r.controller.snapshot()["committed"] == before
        assert (await post(r, "/finish_weight_update")).status_code == 409


async def test_a_floor_above_declared_refuses_a_native_round_before_anything_drains() -> None:
    async with rig(native_token=TOKEN) as r:
        s0 = state(r)
        resp = await post(r, "/pause?mode=wait")
        assert resp.status_code == 422 and "floor" in resp.text
        assert state(r) == s0


async def test_health_models_and_world_size_answer_in_vllms_shapes() -> None:
    async with native_rig() as r:
        h = await r.client.get(BASE + "/health")
        assert h.status_code == 200 and h.content == b""
        assert (await r.client.get(BASE + "/v1/models")).status_code == 200
        assert (await r.client.get(BASE + "/get_world_size")).json() == {"world_size": 1}


async def test_a_reset_answering_success_false_publishes_nothing() -> None:
    from rolloutcore.testing.fake import FaultKind

    async with native_rig() as r:
        before = r.controller.snapshot()["committed"]
        r.adapter.inject("reset_prefix", FaultKind.LIE, times=10)  # 200 {"success": false}
        assert (await post(r, "/start_weight_update")).status_code == 200
        assert (await post(r, "/update_weights", update_body(W1))).status_code == 200
        fin = await post(r, "/finish_weight_update")
        assert fin.status_code == 409, fin.text
        assert r.controller.state is State.TAINTED
        assert r.controller.snapshot()["committed"] == before
        assert r.app.state.native.round is None


async def test_a_reset_that_would_preempt_running_requests_is_refused() -> None:
    async with native_rig() as r:
        s0 = state(r)
        resp = await post(r, "/reset_prefix_cache?reset_running_requests=true")
        assert resp.status_code == 422 and state(r) == s0


def ipc_bodies(w: FakeWeights, chunks: int) -> list[dict[str, Any]]:
    """What vLLM 0.26's ``IPCWeightTransferEngine.trainer_send_weights(..., {"send_mode":
    "http", "url": base})`` posts to ``{base}/update_weights`` (``_do_send``): the names,
    dtypes and shapes, ``packed``, the CUDA IPC handles as a base64 pickle
    (``ipc_handles_pickled``) and, packed, ``tensor_sizes``: one body unpacked, one per
    chunk packed. ``fake_data`` is the fake engine's stand-in for the memory the handles
    share."""
    import base64
    import pickle

    ns = sorted(w.tensors)
    per = -(-len(ns) // chunks)
    out = []
    for i in range(0, len(ns), per):
        part = ns[i:i + per]
        info: dict[str, Any] = {
            "names": part, "dtype_names": ["bfloat16"] * len(part),
            "shapes": [[len(w.tensors[n])] for n in part], "packed": chunks > 1}
        handles: Any = [{"GPU-0": (n, 0, b"\x02" * 64)} for n in part]
        if chunks > 1:
            info["tensor_sizes"] = [len(w.tensors[n]) for n in part]
            handles = {"GPU-0": ("chunk", i, b"\x02" * 64)}
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
        info["fake_data"] = [w.tensors[n].hex() for n in part]
        out.append({"update_info": info})
    return out


@pytest.mark.parametrize("chunks", [1, 3])
async def test_vllms_own_ipc_sender_by_base_url_is_forwarded_as_sent(chunks: int) -> None:
    """vLLM's ``ipc`` backend through the gateway: its bodies carry the pickled handles
    beside the names/dtypes/shapes the round's manifest is made of; they reach vLLM as
    sent (the worker unpickles them), unpacked in one call or packed in several, and the
    round publishes with every name written once."""
    async with native_rig() as r:
        sent = ipc_bodies(W1, chunks)
        assert (await post(r, "/start_weight_update")).status_code == 200
        for body in sent:
            assert (await post(r, "/update_weights", body)).status_code == 200
        fin = await post(r, "/finish_weight_update")
        assert fin.status_code == 200, fin.text
        snap = r.controller.snapshot()
        assert snap["state"] == "READY" and r.engine.weights_digest == W1.digest
        assert fin.headers["x-rolloutcore-version"] == snap["committed"]["label"]
        got = [b for b in r.fake.bodies if "update_info" in b]
        assert got == sent
        note = next(n for n in r.kinds("note") if n.get("what") == "native_round")
        assert note["tensors"] == len(W1.tensors) and note["update_calls"] == len(sent)
        # a chunk sent again (a replayed POST) writes a name twice: the round fails
        assert (await post(r, "/start_weight_update")).status_code == 200
        assert (await post(r, "/update_weights", sent[0])).status_code == 200
        again = await post(r, "/update_weights", sent[0])
        assert again.status_code == 409 and "written twice" in again.text
        assert r.controller.snapshot()["committed"] == snap["committed"]


async def test_a_vllm_without_a_label_publishes_on_the_gateways_own_manifest_check() -> None:
    """vLLM 0.26 (no ``/weight_info``, no ``/weight_checker``) behind ``VllmAdapter``: a
    round's paused validation has no label and no reference to compare; the gateway's
    own check of the round (every name written once) is its evidence, at the declared
    level, and the round publishes (without it: "no evidence at all", seen on the H100
    with vLLM 0.26)."""
    import httpx

    from helpers.asgi_stream import lifespan
    from helpers.gateway_rig import FAST, serve_fake
    from helpers.gateway_rig import TOKEN as CONTROL
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.engine.routes import Routes
    from rolloutcore.service import ServiceConfig
    from rolloutcore.service.app import create_app
    from rolloutcore.testing.fake import FakeEngine
    from rolloutcore.testing.fake_vllm import FakeVllm

    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=0.0)
    up = serve_fake(FakeVllm(eng, model="policy", without=(
        Routes.WEIGHT_INFO, Routes.UPDATE_WEIGHT_VERSION, Routes.WEIGHT_CHECKER)))
    ad = VllmAdapter(VllmHTTP(up), None)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, FAST, record=j.write)
    r.bootstrap(w0.identity())
    app = create_app(r, ServiceConfig(upstream_url=up, control_token=CONTROL,
                                      min_verification="declared"), native_token=TOKEN)
    try:
        async with lifespan(app), httpx.AsyncClient(transport=httpx.ASGITransport(app),
                                                    base_url="http://gw.test",
                                                    timeout=30) as client:
            before = c.snapshot()["committed"]["label"]
            assert (await client.post(BASE + "/start_weight_update")).status_code == 200
            body = ipc_bodies(W1, 1)[0]
            assert (await client.post(BASE + "/update_weights", json=body)).status_code == 200
            fin = await client.post(BASE + "/finish_weight_update")
            assert fin.status_code == 200, fin.text
            snap = c.snapshot()
            assert snap["state"] == "READY" and snap["committed"]["label"] != before
            assert eng.weights_digest == W1.digest
            checks = [ch for rec in j.records if rec.kind == "evidence"
                      for ch in (rec.data.get("evidence") or {}).get("checks") or ()]
            assert any(ch.get("name") == "native_manifest" and ch.get("passed")
                       for ch in checks), checks
            # a second round: the check was consumed by the first one's validation and
            # is made again for this one (nothing carried over)
            assert (await client.post(BASE + "/start_weight_update")).status_code == 200
            assert (await client.post(BASE + "/update_weights",
                                      json=ipc_bodies(W2, 1)[0])).status_code == 200
            assert (await client.post(BASE + "/finish_weight_update")).status_code == 200
            assert c.snapshot()["state"] == "READY" and eng.weights_digest == W2.digest
    finally:
        ad.close()
