"""The service path verifies like the in-process path, and its leases and takeovers hold (fast).

Issue 17: the begin carries what only the trainer can compute (the policy
probe from the tensors it sends, reference checksums); the gateway checks it
at the edge, before anything drains, and compares it with the engine itself
while admission is closed; a floor refuses begins that ask for less. Issue 16
(correctness): leases belong to their trainer (a secret, random ids, a
duration on this side's clock), a lease that ends with nothing sent does not
taint, out-of-band weight writes are noticed, a takeover verifies what it
declares, and the smaller items (torn journal tail, token file, engine env).

The fake engine stands in for vLLM here; ``tests/engine/test_service_verify_engine.py``
runs the same cases against a real one.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from helpers.gateway_rig import (
    AUTH,
    TOKEN,
    begin_body,
    expectations,
    lease,
    make_parts,
    remote_transfer,
    rig,
    serve_fake,
    transfer_body,
    uvicorn_thread,
)
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.control.runner import LifecycleRunner, TakeoverRefused
from rolloutcore.core.lease import LeaseState
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.errors import BadInput
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.client import RolloutCoreClient
from rolloutcore.service.serve import write_token_file
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights, fake_probe
from rolloutcore.verification.probe import PolicyProbe

pytestmark = pytest.mark.anyio

GEN = "/inference/v1/generate"
W1 = FakeWeights.from_seed(1, step=1)
W2 = FakeWeights.from_seed(2, step=2)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def snapshot(r: Any) -> tuple[Any, ...]:
    return (r.controller.snapshot(), len(r.journal.records), len(r.fake.bodies),
            r.gateway.updates.open_update, r.engine.paused, r.engine.weights_digest)


async def begin(r: Any, body: dict[str, Any]) -> httpx.Response:
    return await r.client.post("/control/updates", json=body, headers=AUTH)


# ---------------------------------------------------------------------- verification (#17)

async def test_a_mis_sent_tensor_through_the_service_path_is_refused_by_the_probe() -> None:
    """The trainer's probe of what it meant to send; one tensor never arrives: TAINTED,
    nothing published, and the next admission is refused."""
    async with rig() as r:
        g = (await begin(r, begin_body(W1, expect={"probe": fake_probe(W1).to_wire()}))).json()
        e = r.engine
        e.start_update()
        names = sorted(W1.tensors)
        for name in names[1:]:  # the first tensor is mis-sent: it never arrives
            e.load(name, W1.tensors[name])
        e.finish_update(g["target"]["label"])
        ev = {"completed": True, "mutation_started": True, "backend": "fake",
              "tensors": len(names), "bytes": 256, "finish_label": g["target"]["label"]}
        d = await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                json={"transfer": ev}, headers=lease(g))
        res = d.json()["result"]
        assert res["status"] == "failed" and res["state"] == "TAINTED", res
        assert "policy-probe" in res["reason"]
        assert [v.label for v in r.controller.published] == ["default"]
        refused = await r.client.post(GEN, json={"token_ids": [1], "sampling_params": {}})
        assert refused.status_code == 503
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["state"] == "TAINTED" and st["committed"]["label"] == "default"


async def test_the_level_and_its_evidence_are_in_the_answer_status_metrics_and_journal() -> None:
    async with rig() as r:
        g = (await begin(r, begin_body(W1))).json()
        assert g["min_verification"] == "probe"  # the floor, asked for nothing
        ev = remote_transfer(r.adapter, W1, g["target"]["label"])
        d = (await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                 json=transfer_body(ev), headers=lease(g))).json()
        v = d["result"]["verification"]
        assert v["level"] == "probe" and v["required"] == "probe"
        assert any(e.startswith("policy-probe=pass") for e in v["evidence"])
        assert any(e.startswith("engine-checksum=pass") for e in v["evidence"])
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert st["verification"]["floor"] == "probe"
        assert st["verification"]["committed"] == "probe"
        assert st["verification"]["evidence"] == v["evidence"]
        text = (await r.client.get("/metrics")).text
        assert "rolloutcore_verification_floor_level 3.0" in text
        assert "rolloutcore_committed_verification_level 3.0" in text
        assert 'rolloutcore_published_total{verification="probe"} 1.0' in text
        commit = [x for x in r.journal.records if x.kind == "commit"][-1]
        assert commit.data["identity"]["verification"] == "probe"
        assert commit.data["identity"]["evidence"] == v["evidence"]
        # every binding under the new version carries the verified identity
        b = r.controller.admit("after")
        assert b.identity.verification is VerificationLevel.PROBE
        r.controller.complete("after")


@pytest.mark.parametrize("asked", ["declared", "manifest", "engine-checksum"])
async def test_a_begin_below_the_floor_is_422_and_changes_nothing(asked: str) -> None:
    async with rig() as r:
        before = snapshot(r)
        resp = await begin(r, begin_body(W1, min_verification=asked))
        assert resp.status_code == 422, resp.text
        body = resp.json()
        assert body["floor"] == "probe" and body["requested"] == asked
        assert "below this gateway's floor" in body["error"]
        assert snapshot(r) == before


async def test_a_lower_floor_is_the_operators_choice_and_a_begin_may_ask_for_more() -> None:
    async with rig(min_verification="manifest") as r:
        g = (await begin(r, begin_body(W1, expect=False))).json()
        assert g["min_verification"] == "manifest"
        ev = remote_transfer(r.adapter, W1, g["target"]["label"])
        d = (await r.client.post(f"/control/updates/{g['update_id']}/transfer",
                                 json=transfer_body(ev), headers=lease(g))).json()
        assert d["result"]["verification"]["level"] == "manifest"  # a label, nothing more
        below = await begin(r, begin_body(W2, expect=False, min_verification="declared"))
        assert below.status_code == 422
        no_probe = await begin(r, begin_body(W2, expect=False, min_verification="probe"))
        assert no_probe.status_code == 422 and "needs the policy probe" in no_probe.text


def _probe_case(**over: Any) -> dict[str, Any]:
    case = fake_probe(W1).to_wire()["cases"][0]
    return {**case, **over}


MALFORMED: list[tuple[str, Any]] = [
    ("token id out of the vocabulary", {"cases": [_probe_case(prompt=[1, 2, 300])]}),
    ("negative token id", {"cases": [_probe_case(continuation=[-1] * 8)]}),
    ("logprob above zero", {"cases": [_probe_case(logprobs=[0.5] * 8)]}),
    ("one logprob short", {"cases": [_probe_case(logprobs=[-1.0] * 7)]}),
    ("no cases", {"cases": []}),
    ("too many cases", {"cases": [_probe_case()] * 33}),
    ("a tolerance that passes anything", {"tolerance": 3.0}),
    ("a zero tolerance", {"tolerance": 0}),
    ("a sequence past the context", {"cases": [_probe_case(prompt=[1] * 600)]}),
    ("a string token", {"cases": [_probe_case(prompt=["1"])]}),
    ("an unknown field", {"extra": 1}),
]


@pytest.mark.parametrize(("what", "over"), MALFORMED, ids=[m[0] for m in MALFORMED])
async def test_malformed_probe_expectations_are_refused_before_anything_drains(
        what: str, over: dict[str, Any]) -> None:
    async with rig(vocab_size=256, max_model_len=512) as r:
        probe = {**fake_probe(W1).to_wire(), **over}
        before = snapshot(r)
        resp = await begin(r, begin_body(W1, expect={"probe": probe}))
        assert resp.status_code == 422, (what, resp.text)
        assert snapshot(r) == before  # nothing drained, paused or recorded


async def test_non_finite_logprobs_are_refused_at_the_edge() -> None:
    async with rig() as r:
        body = begin_body(W1)
        raw = json.dumps(body).replace(
            json.dumps(body["expect"]["probe"]["cases"][0]["logprobs"][0]), "NaN", 1)
        before = snapshot(r)
        resp = await r.client.post("/control/updates", content=raw.encode(),
                                   headers={**AUTH, "content-type": "application/json"})
        assert resp.status_code == 422
        assert snapshot(r) == before


def test_probe_wire_round_trip_and_its_checks() -> None:
    p = fake_probe(W1)
    back = PolicyProbe.from_wire(p.to_wire(), vocab_size=256)
    assert back.cases == p.cases and back.tolerance == p.tolerance
    for bad, match in [({**p.to_wire(), "tolerance": math.inf}, "tolerance"),
                       ({"cases": p.to_wire()["cases"]}, "exactly"),
                       ("x", "object")]:
        with pytest.raises(BadInput, match=match):
            PolicyProbe.from_wire(bad)
    with pytest.raises(BadInput, match=r"\[0, 10\)"):
        PolicyProbe.from_wire(p.to_wire(), vocab_size=10)


# ---------------------------------------------------------------------- leases (#16)

async def test_only_the_trainer_that_began_an_update_can_report_it() -> None:
    async with rig() as r:
        g = (await begin(r, begin_body(W1))).json()
        url = f"/control/updates/{g['update_id']}/transfer"
        ev = transfer_body(remote_transfer(r.adapter, W1, g["target"]["label"]))
        before = snapshot(r)
        for headers in (AUTH, {**AUTH, "x-rolloutcore-lease": "guessed-" + "x" * 30},
                        {**AUTH, "x-rolloutcore-lease": g["lease"]["secret"][:-1]}):
            resp = await r.client.post(url, json=ev, headers=headers)
            assert resp.status_code == 403 and "lease" in resp.json()["error"]
            got = await r.client.get(f"/control/updates/{g['update_id']}", headers=headers)
            assert got.status_code == 403
        assert snapshot(r) == before
        st = (await r.client.get("/control/status", headers=AUTH)).json()
        assert "secret" not in json.dumps(st)  # the status shows the update, not its secret
        ok = await r.client.post(url, json=ev, headers=lease(g))
        assert ok.json()["status"] == "published"


async def test_update_ids_from_before_a_restart_name_nothing_after_it() -> None:
    """Lease replay after a restart: the old gateway's id and secret, the new gateway."""
    async with rig() as old:
        g = (await begin(old, begin_body(W1))).json()
    async with rig() as new:
        g2 = (await begin(new, begin_body(W1))).json()
        assert g2["update_id"] != g["update_id"]
        replay = await new.client.post(
            f"/control/updates/{g['update_id']}/transfer", headers=lease(g),
            json=transfer_body(remote_transfer(new.adapter, W1, g["target"]["label"])))
        assert replay.status_code == 404
        assert new.controller.state is State.UPDATING  # the new update is untouched
        assert [v.label for v in new.controller.published] == ["default"]


async def test_the_same_begin_again_gets_the_same_grant() -> None:
    async with rig() as r:
        body = begin_body(W1, begin_key="k" * 24)
        first = (await begin(r, body)).json()
        again = await begin(r, body)
        assert again.status_code == 200
        assert again.json()["update_id"] == first["update_id"]
        assert again.json()["lease"]["secret"] == first["lease"]["secret"]
        other = await begin(r, {**body, "begin_key": "z" * 24})
        assert other.status_code == 409


def _served(**cfg: Any) -> tuple[Any, Any, Any]:
    eng, ad, c, r, j, fake = make_parts()
    fake.event_delay_s = 0.01
    app = create_app(r, ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN,
                                      **cfg))
    return app, ad, fake


def test_a_begin_whose_answer_is_lost_does_not_taint_the_engine() -> None:
    """The trainer gave up while the begin drained (its answer went nowhere): the gateway
    classifies at once, from the engine's own counters: nothing was sent."""
    app, ad, fake = _served()
    gw = app.state.gateway
    with uvicorn_thread(app) as url, httpx.Client(timeout=30) as hc:
        with hc.stream("POST", f"{url}{GEN}", json={"token_ids": [1, 2], "stream": True,
                                                    "sampling_params": {"max_tokens": 60}}) \
                as s:
            chunks = s.iter_bytes()
            next(chunks)
            with pytest.raises(httpx.TimeoutException):
                httpx.post(f"{url}/control/updates", json=begin_body(W1), headers=AUTH,
                           timeout=0.2)
            for _ in chunks:
                pass
        deadline = time.monotonic() + 10
        while (gw.updates.open_update is not None or gw.controller.state is not State.READY) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gw.controller.state is State.READY and not ad.engine.paused
        (upd,) = gw.updates._updates.values()
        assert upd.state is LeaseState.EXPIRED
        assert upd.result is not None and upd.result["classification"] == "no_mutation"
        assert "could not be delivered" in upd.result["reason"]
        assert [v.label for v in gw.controller.published] == ["default"]


class _FakeTransport:
    backend = "fake"

    def __init__(self, ad: FakeAdapter) -> None:
        self.ad = ad
        self.connects: list[float] = []

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        self.connects.append(time.monotonic())

    def send(self, base_url: str, label: str, source: Any, *, timeout_s: float) -> Any:
        return remote_transfer(self.ad, source, label)

    def close(self) -> None:
        pass


def test_a_skewed_trainer_clock_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease is a duration on the trainer's monotonic clock: a wall clock an hour off
    (either way) neither expires it early nor stretches it."""
    import rolloutcore.service.client as client_mod

    app, ad, _ = _served()
    with uvicorn_thread(app) as url:
        real = time.time
        for skew in (3600.0, -3600.0):
            monkeypatch.setattr(client_mod.time, "time",
                                lambda skew=skew, real=real: real() + skew)
            w = FakeWeights.from_seed(5 + int(skew > 0), step=3)
            with RolloutCoreClient(url, TOKEN, transport=_FakeTransport(ad)) as rc:
                res = rc.update(w, w.provenance, owner="skewed")
            assert res.status == "published" and res.verification == "probe"
            monkeypatch.setattr(client_mod.time, "time", real)


def test_the_client_connects_its_transport_before_the_begin() -> None:
    """The handshake changes no weights: outside the engine's pause."""
    app, ad, _ = _served()
    tr = _FakeTransport(ad)
    paused_at_connect: list[bool] = []
    orig = tr.connect

    def connect(base_url: str, *, timeout_s: float) -> None:
        paused_at_connect.append(ad.engine.paused)
        orig(base_url, timeout_s=timeout_s)

    tr.connect = connect  # type: ignore[method-assign]
    with uvicorn_thread(app) as url, RolloutCoreClient(url, TOKEN, transport=tr) as rc:
        rc.update(W1, W1.provenance)
        rc.update(W2, W2.provenance)
    assert paused_at_connect == [False]


# ---------------------------------------------------------------------- out-of-band writes

def _runner(eng: FakeEngine | None = None) -> tuple[FakeAdapter, LifecycleController,
                                                    LifecycleRunner, Journal]:
    w0 = FakeWeights.from_seed(0)
    eng = eng or FakeEngine(w0, token_delay_s=0)
    ad = FakeAdapter(eng)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    return ad, c, LifecycleRunner(c, ad, record=j.write), j


@pytest.mark.parametrize("how", ["label", "weights"])
def test_an_out_of_band_weight_write_is_noticed_and_taints(how: str) -> None:
    ad, c, r, j = _runner()
    ad.stage(FakeWeights.from_seed(0))
    r.bootstrap(FakeWeights.from_seed(0).identity())
    assert r.check_serving() is None
    e = ad.engine
    if how == "label":
        e.label = "someone-else"  # POST /update_weight_version from another process
    else:  # /start_weight_update ... /finish_weight_update keeping the label
        e.start_update()
        e.load("layers.0.weight", W1.tensors["layers.0.weight"])
        e.finish_update(e.label)
    v = r.check_serving()
    assert v is not None and c.state is State.TAINTED  # at once, not after two misses
    assert "outside any update" in " ".join(v.problems)
    assert e.paused  # fenced
    assert any(x.kind == "taint" for x in j.records)


def test_a_published_update_is_not_an_out_of_band_write() -> None:
    ad, c, r, j = _runner()
    ad.stage(FakeWeights.from_seed(0))
    r.bootstrap(FakeWeights.from_seed(0).identity())
    ad.stage(W1)
    r.run_update(W1.identity())
    assert r.check_serving() is None and c.state is State.READY


# ---------------------------------------------------------------------- takeover

def test_a_takeover_verifies_what_it_declares() -> None:
    w0 = FakeWeights.from_seed(0)
    ad, c, r, j = _runner()
    v = r.take_over(w0.identity(), probes=fake_probe(w0),
                    reference_checksums={"fake-digest": w0.digest},
                    min_verification=VerificationLevel.PROBE)
    assert v is not None and v.accepted and c.state is State.READY
    assert c.identity is not None and c.identity.verification is VerificationLevel.PROBE


def test_a_takeover_of_an_engine_holding_other_weights_publishes_nothing() -> None:
    ad, c, r, j = _runner(FakeEngine(W1, token_delay_s=0))  # it serves W1 ...
    w0 = FakeWeights.from_seed(0)
    with pytest.raises(TakeoverRefused) as ei:  # ... declared to hold w0
        r.take_over(w0.identity(), probes=fake_probe(w0),
                    min_verification=VerificationLevel.PROBE)
    assert ei.value.classification == "no_mutation"
    assert c.state is State.UNINITIALIZED and c.published == ()


def test_a_takeover_of_a_paused_engine_is_refused() -> None:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=0)
    from rolloutcore.core.evidence import PauseMode

    eng.pause(PauseMode.ABORT)  # left paused by a gateway that died mid-update
    ad, c, r, j = _runner(eng)
    with pytest.raises(TakeoverRefused, match="paused"):
        r.take_over(w0.identity(), probes=fake_probe(w0),
                    min_verification=VerificationLevel.PROBE)
    assert c.state is State.UNINITIALIZED and c.published == ()


def test_a_takeover_below_the_floor_is_refused() -> None:
    w0 = FakeWeights.from_seed(0)
    ad, c, r, j = _runner()
    with pytest.raises(TakeoverRefused, match="required"):
        r.take_over(w0.identity(), min_verification=VerificationLevel.PROBE)
    assert c.published == ()


def test_a_restored_version_must_still_be_what_the_engine_serves() -> None:
    """A restart over an engine that was updated behind the journal's back: tainted."""
    w0 = FakeWeights.from_seed(0)
    ad, c, r, j = _runner()
    r.take_over(w0.identity(), probes=fake_probe(w0))
    ad.engine.label = "rc-7"  # what an updated engine reports
    restored = LifecycleController.restore(j.records)
    r2 = LifecycleRunner(restored, FakeAdapter(ad.engine))
    with pytest.raises(TakeoverRefused, match="label") as ei:
        r2.take_over(w0.identity(), probes=fake_probe(w0))
    assert ei.value.classification == "ambiguous" and restored.state is State.TAINTED
    assert restored.published == c.published


def test_a_restored_in_flight_update_is_only_recovered_onto_a_replacement() -> None:
    from rolloutcore.testing.fake import FakeRecoverer

    w0 = FakeWeights.from_seed(0)
    ad, c, r, j = _runner()
    r.take_over(w0.identity(), probes=fake_probe(w0))
    ad.stage(W1)
    r.open_update(W1.identity())  # the gateway dies here, the engine paused
    restored = LifecycleController.restore(j.records)
    assert restored.state is State.TAINTED
    ad.engine.resume()
    ad2 = FakeAdapter(ad.engine)
    r2 = LifecycleRunner(restored, ad2)
    with pytest.raises(TakeoverRefused, match="same process"):
        r2.take_over(w0.identity(), probes=fake_probe(w0),
                     recoverer=lambda prev: FakeRecoverer(ad2, w0))
    ad.engine.restart(w0)  # the operator restarts it from the checkpoint
    v = r2.take_over(w0.identity(), probes=fake_probe(w0),
                     recoverer=lambda prev: FakeRecoverer(ad2, w0))
    assert v is not None and v.accepted and restored.state is State.READY
    assert restored.committed is not None and restored.committed.generation >= 2


# ---------------------------------------------------------------------- smaller items

def test_a_torn_journal_tail_is_repaired_when_the_journal_is_opened(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    c.bootstrap(*_boot())
    j.close()
    n = len(read_journal(path))
    with open(path, "ab") as fh:
        fh.write(b'{"v": 2, "seq": 99, "kind": "adm')  # the crash cut this write
    j2 = Journal(path)  # today's gateway restart: not fatal
    assert j2.repaired_bytes > 0
    c2 = LifecycleController.restore(read_journal(path), listener=j2.listener)
    j2.close()
    recs = read_journal(path)
    assert len(recs) > n and recs[n].seq == n + 1 and c2.state is State.READY


def _boot() -> tuple[Any, Any]:
    from coretools import boot_ev, ident

    return boot_ev(), ident(0)


def test_the_token_file_is_never_written_through_a_link_and_is_0600(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("keep me\n")
    link = tmp_path / "token"
    link.symlink_to(target)
    with pytest.raises(BadInput, match="link"):
        write_token_file(link, "s" * 32)
    assert target.read_text() == "keep me\n"
    existing = tmp_path / "existing"
    existing.write_text("old\n")
    os.chmod(existing, 0o644)
    write_token_file(existing, "t" * 32)
    assert stat.S_IMODE(existing.stat().st_mode) == 0o600
    assert existing.read_text() == "t" * 32 + "\n"


def test_a_launched_engine_does_not_inherit_the_gateways_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rolloutcore.engine.process import ManagedEngine

    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setenv("ROLLOUTCORE_TOKEN", "control-secret-0123456789")
    monkeypatch.setenv("ROLLOUTCORE_DATA_TOKEN", "data-secret-0123456789")
    monkeypatch.setenv("ROLLOUTCORE_OTHER", "kept")
    env = ManagedEngine(tmp_path).environment()
    assert "ROLLOUTCORE_TOKEN" not in env and "ROLLOUTCORE_DATA_TOKEN" not in env
    assert env["ROLLOUTCORE_OTHER"] == "kept" and env["VLLM_SERVER_DEV_MODE"] == "1"


async def test_expectations_helper_matches_what_the_client_sends() -> None:
    """The rig's begin body is what ``RolloutCoreClient.begin`` puts on the wire."""
    assert expectations(W1)["probe"] == fake_probe(W1).to_wire()
    assert Provenance("fake-seed-1", "fake-run", 1) == W1.provenance
    with anyio.fail_after(5):
        async with rig() as r:
            resp = await begin(r, begin_body(W1))
            assert resp.status_code == 201
