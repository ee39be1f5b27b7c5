"""The trainer protocol (begin, lease, report), status, auth and input validation (fast lane)."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import (
    AUTH,
    RIG_ENGINES,
    TOKEN,
    begin_body,
    lease,
    remote_transfer,
    rig,
    sse_events,
    transfer_body,
)
from rolloutcore.control.journal import first_index
from rolloutcore.control.runner import DrainPolicy
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.service.control_openapi import openapi_document
from rolloutcore.service.proxy import VERSION_HEADER
from rolloutcore.testing.fake import FakeWeights, reference_tokens

pytestmark = pytest.mark.anyio

GEN = "/inference/v1/generate"
W1 = FakeWeights.from_seed(1, step=1)
W2 = FakeWeights.from_seed(2, step=2)
JSON_AUTH = {**AUTH, "content-type": "application/json"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


#: Fault-matrix rows (with ROLLOUTCORE_FAULT_MATRIX set: helpers.fault_matrix).
MATRIX = PromiseRows("tests/test_service_control.py", engines=RIG_ENGINES)
_fault_matrix = MATRIX.fixture()


def snapshot(r: Any) -> tuple[Any, ...]:
    return (r.controller.snapshot(), len(r.journal.records), len(r.fake.bodies),
            r.gateway.updates.open_update)


async def begin(r: Any, w: FakeWeights = W1, **extra: Any) -> dict[str, Any]:
    r.adapter.stage(w)
    resp = await r.client.post("/control/updates", json=begin_body(w, **extra), headers=AUTH)
    assert resp.status_code == 201, resp.text
    return dict(resp.json())


async def test_begin_answers_what_the_transport_needs_and_quiesces() -> None:
    async with rig(transport={"backend": "rolloutcore_gloo"}, model="policy") as r:
        g = await begin(r, label="step-1", lease_s=30)
        assert g["target"]["label"] == "step-1" and g["target"]["generation"] == 1
        assert g["engine"] == {"base_url": r.upstream_url, "model": "policy"}
        assert g["transport"] == {"backend": "rolloutcore_gloo"}
        assert g["lease"]["seconds"] == 30 and 29 < g["lease"]["expires_in_s"] <= 30
        assert g["state"] == "UPDATING" and r.engine.paused
        assert g["identity_digest"] == W1.identity().digest
        got = await r.client.get(f"/control/updates/{g['update_id']}", headers=lease(g))
        assert got.json()["status"] == "open"


async def test_report_publishes_and_the_next_rollout_serves_the_new_policy() -> None:
    async with rig() as r:
        g = await begin(r, min_verification="probe")
        ev = remote_transfer(r.adapter, W1, g["target"]["label"])
        d = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(g))
        body = d.json()
        assert d.status_code == 200 and body["status"] == "published"
        assert body["result"]["published"]["label"] == "rc-1"
        assert body["result"]["identity"]["verification"] == "probe"
        assert body["result"]["state"] == "READY"
        assert {"invalidate", "validate", "resume", "total"} <= set(body["result"]["phases"])
        assert r.controller.committed.label == "rc-1"  # type: ignore[union-attr]
        resp = await r.client.post(GEN, json={"token_ids": [9, 8, 7],
                                              "sampling_params": {"max_tokens": 6}})
        assert resp.json()["choices"][0]["token_ids"] == reference_tokens(W1.digest, [9, 8, 7], 6)
        st_ = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st_["committed"]["label"] == "rc-1" and st_["update"] is None
        assert [t["to"] for t in st_["transitions"]][-7:] == [
            "DRAINING", "QUIESCED", "UPDATING", "INVALIDATING", "VALIDATING", "RESUMING", "READY"]
        assert all(t["duration_s"] >= 0 for t in st_["transitions"])
        text = (await r.client.get("/metrics")).text
        assert 'rolloutcore_updates_total{outcome="published"} 1.0' in text
        assert 'rolloutcore_update_phase_seconds_count{phase="validate"} 1.0' in text


async def test_begin_waits_for_a_stream_in_flight_which_stays_on_the_old_version() -> None:
    async with rig(streaming=True, event_delay_s=0.01) as r:
        async with anyio.create_task_group() as tg:
            out: dict[str, Any] = {}

            async def long_stream() -> None:
                resp = await r.client.post(GEN, json={"token_ids": [3, 3], "stream": True,
                                                      "sampling_params": {"max_tokens": 30}})
                out["events"] = sse_events(resp.text)

            tg.start_soon(long_stream)
            while not r.controller.active:
                await anyio.sleep(0.002)
            g = await begin(r)
            # the begin answered only after the stream was released
            assert r.controller.active == {}
            ev = remote_transfer(r.adapter, W1, g["target"]["label"])
            await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(g))
        evs = out["events"]
        assert evs[-1] == "[DONE]" and len(evs) == 31
        assert evs[-2]["choices"][0]["weight_versions"] == [
            {"version": "default", "start": 0, "end": 30}]
        recs = r.journal.records
        rid = evs[0]["rolloutcore"]["rollout_id"]
        assert 0 <= first_index(recs, "complete", rollout_id=rid) < first_index(
            recs, "begin_update")


async def test_failure_report_refused_returns_to_service_on_the_old_version() -> None:
    async with rig() as r:
        g = await begin(r)
        d = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json={"failure": {"kind": "refused", "reason": "preflight"}},
                                headers=lease(g))
        res = d.json()["result"]
        assert res["status"] == "failed" and res["classification"] == "no_mutation"
        assert r.controller.state is State.READY and r.controller.committed.label == "default"  # type: ignore[union-attr]
        assert not r.engine.paused
        ok = await r.client.post(GEN, json={"token_ids": [1], "sampling_params": {}})
        assert ok.headers["x-rolloutcore-version"] == "default"


@pytest.mark.parametrize("kind", ["error", "timeout", "died"])
async def test_failure_report_after_mutation_may_have_started_taints(kind: str) -> None:
    async with rig() as r:
        g = await begin(r)
        d = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json={"failure": {"kind": kind, "reason": "gloo broke"}},
                                headers=lease(g))
        res = d.json()["result"]
        assert res["classification"] == "ambiguous" and res["state"] == "TAINTED"
        assert r.controller.state is State.TAINTED
        assert [v.label for v in r.controller.published] == ["default"]


async def test_evidence_that_does_not_hold_taints_and_publishes_nothing() -> None:
    async with rig() as r:
        g = await begin(r)
        ev = remote_transfer(r.adapter, W1, "rc-wrong")
        d = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json=transfer_body(ev), headers=lease(g))
        res = d.json()["result"]
        assert res["status"] == "failed" and res["state"] == "TAINTED"
        assert "rc-wrong" in res["reason"]
        assert [v.label for v in r.controller.published] == ["default"]


async def test_lease_expiry_taints_publishes_nothing_and_a_late_report_is_gone() -> None:
    async with rig() as r:
        g = await begin(r, lease_s=0.2)
        # The trainer began sending, then vanished: the engine counted a write.
        r.engine.start_update()
        r.engine.load("layers.0.weight", W1.tensors["layers.0.weight"])
        with anyio.fail_after(10):  # the expiry, its classification and the fence land in turn
            while r.controller.state is not State.TAINTED or not r.engine.paused:
                await anyio.sleep(0.01)
            while True:   # until the lease's ending (``final``), not a step on the way
                info = (await r.client.get(f"/control/updates/{g['update_id']}",
                                           headers=lease(g))).json()
                if info["final"]:
                    break
                await anyio.sleep(0.01)
        assert info["status"] == "expired"
        assert info["result"]["classification"] == "ambiguous"
        assert "lease" in info["result"]["reason"]
        assert "counted" in info["result"]["reason"]
        r.engine.finish_update("late")
        ev = remote_transfer(r.adapter, W1, g["target"]["label"])
        late = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                   json=transfer_body(ev), headers=lease(g))
        assert late.status_code == 410
        assert [v.label for v in r.controller.published] == ["default"]
        assert r.engine.paused  # fenced
        text = (await r.client.get("/metrics")).text
        assert "rolloutcore_leases_expired_total 1.0" in text
        assert 'rolloutcore_updates_total{outcome="lease_expired"} 1.0' in text


async def test_a_lease_that_expires_with_nothing_sent_returns_to_service_untainted() -> None:
    """#16: a begin whose answer was lost (or a trainer that died before sending) must not
    taint an engine to which nothing was sent: the engine's own counters decide."""
    async with rig() as r:
        before = r.engine.weights_digest
        g = await begin(r, lease_s=0.2)
        with anyio.fail_after(5):
            while r.gateway.updates.open_update is not None:
                await anyio.sleep(0.01)
        info = (await r.client.get(f"/control/updates/{g['update_id']}", headers=lease(g))).json()
        assert info["status"] == "expired"
        assert info["result"]["classification"] == "no_mutation", info
        assert "nothing was sent" in info["result"]["reason"]
        assert r.controller.state is State.READY and not r.engine.paused
        assert [v.label for v in r.controller.published] == ["default"]
        assert r.engine.weights_digest == before
        ok = await r.client.post(GEN, json={"token_ids": [1], "sampling_params": {}})
        assert ok.status_code == 200 and ok.headers["x-rolloutcore-version"] == "default"


async def test_one_writer_unknown_ids_and_double_reports() -> None:
    async with rig() as r:
        g = await begin(r)
        again = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
        assert again.status_code == 409
        for bad in ("999", "0", "abc", "99999999999999999999999"):
            nf = await r.client.post(f"/control/updates/{bad}/transfer",
                                     json={"failure": {"kind": "error", "reason": "x"}},
                                     headers=AUTH)
            assert nf.status_code == 404
            assert (await r.client.get(f"/control/updates/{bad}", headers=AUTH)).status_code == 404
        assert r.controller.state is State.UPDATING
        ev = remote_transfer(r.adapter, W1, g["target"]["label"])
        url = f"/control/updates/{g['update_id']}/transfer"
        first = await r.client.post(url, json=transfer_body(ev), headers=lease(g))
        assert first.status_code == 200
        twice = await r.client.post(url, json=transfer_body(ev), headers=lease(g))
        assert twice.status_code == 409 and twice.json()["status"] == "published"


async def test_label_already_published_is_refused_without_state_change() -> None:
    async with rig() as r:
        before = snapshot(r)[0]
        resp = await r.client.post("/control/updates", json=begin_body(W1, label="default"),
                                   headers=AUTH)
        assert resp.status_code == 409
        assert r.controller.snapshot() == before


async def test_begin_that_cannot_drain_in_time_is_503_and_stays_on_the_old_version() -> None:
    """Drain policy REFUSE (the ABORT default: tests/test_gateway_liveness.py)."""
    async with rig(streaming=True, event_delay_s=0.2) as r:
        r.runner.deadlines = r.runner.deadlines.__class__(
            **{**r.runner.deadlines.__dict__, "drain_s": 0.1})
        r.runner.drain_policy = DrainPolicy.REFUSE
        async with anyio.create_task_group() as tg:
            async def slow() -> None:
                await r.client.post(GEN, json={"token_ids": [1], "stream": True,
                                               "sampling_params": {"max_tokens": 4}})
            tg.start_soon(slow)
            while not r.controller.active:
                await anyio.sleep(0.002)
            resp = await r.client.post("/control/updates", json=begin_body(W1), headers=AUTH)
            assert resp.status_code == 503
            assert resp.json()["classification"] == "no_mutation"
            assert r.controller.state is State.READY
            r.fake.event_delay_s = 0  # refused: the slow stream may end at once
        assert r.controller.committed.label == "default"  # type: ignore[union-attr]


# ------------------------------------------------------------------ auth and bad input

CONTROL = [("POST", "/control/updates"), ("GET", "/control/updates/1"),
           ("POST", "/control/updates/1/transfer"), ("GET", "/control/status")]


@pytest.mark.parametrize("method,path", CONTROL)
@pytest.mark.parametrize("auth,status", [
    (None, 401), ("Bearer wrong-token-wrong-token", 403), (f"Basic {TOKEN}", 401),
    ("Bearer", 401), (f"Bearer {TOKEN}x", 403)])
async def test_control_needs_the_token(method: str, path: str, auth: str | None,
                                       status: int) -> None:
    async with rig() as r:
        before = snapshot(r)
        h = {} if auth is None else {"authorization": auth}
        resp = await r.client.request(method, path, json=begin_body(W1), headers=h)
        assert resp.status_code == status
        assert resp.headers["www-authenticate"] == "Bearer"
        assert snapshot(r) == before


def _begin(**over: Any) -> dict[str, Any]:
    b = begin_body(W1)
    b.update(over)
    return b


BAD_BEGIN: list[tuple[Any, int]] = [
    (b"{", 400),
    (b"\xff", 400),
    (b"[]", 422),
    (b"null", 422),
    ({}, 422),
    (_begin(owner=""), 422),
    (_begin(owner=7), 422),
    (_begin(unknown=1), 422),
    (_begin(label="has space"), 422),
    (_begin(lease_s=-1), 422),
    (_begin(lease_s="10"), 422),
    (_begin(min_verification="perfect"), 422),
    ({**_begin(), "identity": {**_begin()["identity"], "manifest_digest": "abc"}}, 422),
    ({**_begin(), "identity": {**_begin()["identity"],
                               "provenance": {"checkpoint": "c", "step": "1"}}}, 422),
    ({**_begin(), "identity": {**_begin()["identity"],
                               "provenance": {"checkpoint": "c", "step": -1}}}, 422),
    ({**_begin(), "identity": {**_begin()["identity"],
                               "provenance": {"checkpoint": "c", "step": True}}}, 422),
]


@pytest.mark.parametrize("body,status", BAD_BEGIN)
async def test_bad_begin_bodies_are_4xx_and_change_nothing(body: Any, status: int) -> None:
    async with rig() as r:
        before = snapshot(r)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        resp = await r.client.post("/control/updates", content=content,
                                   headers={**AUTH, "content-type": "application/json"})
        assert resp.status_code == status, resp.text
        assert snapshot(r) == before


async def test_bad_report_bodies_are_4xx_and_leave_the_lease_open() -> None:
    async with rig() as r:
        g = await begin(r)
        url = f"/control/updates/{g['update_id']}/transfer"
        ev = transfer_body(remote_transfer(r.adapter, W1, "rc-1"))["transfer"]
        bads: list[Any] = [
            {}, {"transfer": ev, "failure": {"kind": "error", "reason": "x"}},
            {"transfer": {**ev, "tensors": -1}}, {"transfer": {**ev, "tensors": "3"}},
            {"transfer": {**ev, "completed": "true"}},
            {"transfer": {**ev, "completed": True, "mutation_started": False}},
            {"transfer": {**ev, "extra": 1}}, {"failure": {"kind": "bad_evidence", "reason": "x"}},
            {"failure": {"kind": "error", "reason": ""}}, {"transfer": {**ev, "elapsed_s": 1e300}},
        ]
        before = snapshot(r)
        for b in bads:
            resp = await r.client.post(url, json=b, headers=lease(g))
            assert resp.status_code == 422, (b, resp.text)
        nan = await r.client.post(url, content=b'{"transfer": {"completed": true, '
                                  b'"mutation_started": true, "backend": "x", "elapsed_s": NaN}}',
                                  headers={**AUTH, "content-type": "application/json"})
        assert nan.status_code == 422
        text = await r.client.post(url, content=b"x", headers={**AUTH,
                                                                "content-type": "text/plain"})
        assert text.status_code == 415
        assert snapshot(r) == before
        ok = await r.client.post(url, json=transfer_body(remote_transfer(r.adapter, W1, "rc-1")),
                                 headers=lease(g))
        assert ok.json()["status"] == "published"


async def test_huge_control_bodies_are_413() -> None:
    async with rig(max_body_bytes=2048) as r:
        before = snapshot(r)
        big = _begin(owner="o" * 100)
        big["pad"] = "x" * 5000
        resp = await r.client.post("/control/updates", json=big, headers=AUTH)
        assert resp.status_code == 413
        assert snapshot(r) == before


async def test_health_openapi_and_unknown_routes() -> None:
    async with rig() as r:
        assert (await r.client.get("/health")).json() == {"status": "ok", "state": "READY"}
        doc = (await r.client.get("/openapi.json")).json()
        assert set(doc["paths"]) == {"/control/updates", "/control/updates/{update_id}",
                                     "/control/updates/{update_id}/transfer", "/control/status"}
        assert "BeginBody" in doc["components"]["schemas"]
        # /v1/models is vLLM's, passed through (test_service_passthrough.py); /pause never.
        for path in ("/control", "/control/updates/1/abort", "/admin", "/pause"):
            resp = await r.client.get(path, headers=AUTH)
            assert resp.status_code == 404 and resp.json()["error"]
        assert (await r.client.delete("/control/status", headers=AUTH)).status_code == 405


# ------------------------------------------------------------------ property-based fuzzing

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                max_size=4),
    max_leaves=12)


def _mutations() -> st.SearchStrategy[dict[str, Any]]:
    """Valid begin bodies with one field replaced by arbitrary JSON."""
    base = _begin()
    keys = ["owner", "label", "lease_s", "min_verification", "source_manifest_digest",
            "identity", "extra"]
    return st.builds(lambda k, v: {**base, k: v}, st.sampled_from(keys), json_values)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(json_values, _mutations()))
def test_fuzz_begin_never_5xx_and_changes_state_only_on_201(body: Any) -> None:
    async def run() -> None:
        async with rig() as r:
            before = snapshot(r)
            resp = await r.client.post("/control/updates", content=json.dumps(body),
                                       headers=JSON_AUTH)
            assert resp.status_code < 500, resp.text
            if resp.status_code == 201:
                assert r.controller.state is State.UPDATING
            else:
                assert resp.status_code in (400, 409, 422)
                assert snapshot(r) == before

    anyio.run(run)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=json_values)
def test_fuzz_report_never_5xx(body: Any) -> None:
    async def run() -> None:
        async with rig() as r:
            g = await begin(r)
            resp = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                       content=json.dumps(body), headers={**JSON_AUTH, **lease(g)})
            assert resp.status_code < 500
            if resp.status_code != 200:
                assert r.controller.state is State.UPDATING
                assert r.gateway.updates.open_update is not None

    anyio.run(run)


def test_openapi_document_is_generated_from_the_validating_models() -> None:
    doc = openapi_document()
    begin_schema = doc["components"]["schemas"]["BeginBody"]
    assert begin_schema["additionalProperties"] is False
    assert set(begin_schema["required"]) == {"identity", "owner"}
    assert doc["paths"]["/control/updates"]["post"]["requestBody"]["content"][
        "application/json"]["schema"] == {"$ref": "#/components/schemas/BeginBody"}


async def test_a_sent_checksum_the_gateway_cannot_use_is_a_422_and_the_lease_stays_open(
        ) -> None:
    """#29: a valid lease, a sent checksum whose names repeat (or whose values are not one
    per name, or that this engine cannot compare) answered 500 and wedged the gateway for
    good (the update stayed ``reporting``, admission closed, vLLM paused)."""
    async with rig() as r:
        g = await begin(r)
        url = f"/control/updates/{g['update_id']}/transfer"
        ev = transfer_body(remote_transfer(r.adapter, W1, "rc-1"))["transfer"]
        statuses: list[int] = []
        for sent in ({"scheme": "rc_cuda_ipc/block", "names": ["a", "a"], "values": [1, 2]},
                     {"scheme": "rc_cuda_ipc/block", "names": ["a", "b"], "values": [1]},
                     {"scheme": "rc_cuda_ipc/block", "names": ["a"], "values": [1]}):
            resp = await r.client.post(url, json={"transfer": {**ev, "sent_checksum": sent}},
                                       headers=lease(g))
            assert resp.status_code == 422, (sent, resp.text)
            statuses.append(resp.status_code)
            info = (await r.client.get(f"/control/updates/{g['update_id']}",
                                       headers=lease(g))).json()
            assert info["status"] == "open" and not info["final"]
        ok = await r.client.post(url, json=transfer_body(remote_transfer(r.adapter, W1, "rc-1")),
                                 headers=lease(g))
        assert ok.status_code == 200 and ok.json()["status"] == "published"
        assert r.controller.state is State.READY
        # Nothing stuck: the next rollout serves rc-1, the next update begins and publishes.
        served = await r.client.post(GEN, json={"token_ids": [9, 8, 7],
                                                "sampling_params": {"max_tokens": 4}})
        assert served.status_code == 200 and not r.engine.paused
        assert {s["version"] for s in served.json()["choices"][0]["weight_versions"]} == {
            served.headers[VERSION_HEADER]} == {"rc-1"}
        g2 = await begin(r, W2)
        again = await r.client.post(
            f"/control/updates/{g2['update_id']}/transfer",
            json=transfer_body(remote_transfer(r.adapter, W2, g2["target"]["label"])),
            headers=lease(g2))
        assert again.status_code == 200 and again.json()["status"] == "published"
        assert r.controller.committed.label == "rc-2"  # type: ignore[union-attr]
        assert check_journal(r.journal.records) == []
        MATRIX.row("report_wedge", "a trainer's transfer report on a valid lease whose sent "
                   "checksum repeats its names, has values not one per name, or is one this "
                   "engine cannot compare (3 reports)",
                   f"{len(statuses)} x {statuses[0]} before the update left its lease (still "
                   "open); the valid report then published rc-1, the next update rc-2",
                   "READY", part="unusable_checksum", statuses=statuses,
                   published=[d["version"]["label"] for d in r.kinds("commit")],
                   published_unvalidated=0, mislabeled_answers=0)


async def test_whatever_a_report_raises_its_update_ends_decided() -> None:
    """An exception nobody classified while a report is handled: the update still ends
    (classified from the engine's own counters), and the next update goes through."""
    async with rig() as r:
        g = await begin(r)
        url = f"/control/updates/{g['update_id']}/transfer"
        body = transfer_body(remote_transfer(r.adapter, W1, "rc-1"))

        def broken(sent: Any) -> None:
            raise RuntimeError("a bug in an adapter's check")

        r.adapter.expect_sent = broken  # type: ignore[method-assign]
        resp = await r.client.post(url, json=body, headers=lease(g))
        assert resp.status_code == 200, resp.text
        info = resp.json()
        assert info["final"] and info["status"] == "failed"
        assert "a bug in an adapter's check" in info["result"]["reason"]
        # The weights were written: ambiguous, TAINTED and fenced; nothing left open.
        assert r.controller.state is State.TAINTED and r.engine.paused
        assert r.gateway.updates.open_update is None
        assert r.controller.committed.label == "default"  # type: ignore[union-attr]
        assert check_journal(r.journal.records) == []
        assert info["result"]["classification"] == "ambiguous"
        MATRIX.row("report_wedge", "an error nobody classified while a report is checked (a "
                   "bug in the adapter's check of the sent checksum)",
                   "200, the update decided: failed, ambiguous; none left open",
                   "TAINTED (fenced, nothing published)", part="report_raises",
                   published_unvalidated=0)
