"""RolloutCoreClient against a real uvicorn gateway (loopback) over the FakeEngine.

Includes the trainer that dies between begin and report: a real subprocess,
SIGKILLed; the lease expires, the engine is tainted, nothing is published.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from helpers.gateway_rig import TOKEN, make_parts, remote_transfer, serve_fake, uvicorn_thread
from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, TransferError, UpdateFailed, UpdateRefused
from rolloutcore.service import ServiceConfig, create_app
from rolloutcore.service.app import Gateway
from rolloutcore.service.client import RolloutCoreClient, UpdateGrant, identity_of
from rolloutcore.testing.fake import FakeAdapter, FakeWeights, reference_tokens

W1 = FakeWeights.from_seed(1, step=1)
P1 = Provenance("fake-seed-1", "fake-run", 1)


class FakeTransport:
    """A WeightTransport into the FakeEngine (connect once, send per update)."""

    backend = "fake"

    def __init__(self, adapter: FakeAdapter) -> None:
        self.adapter = adapter
        self.connects: list[str] = []
        self.sent: list[str] = []

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        assert timeout_s > 0
        self.connects.append(base_url)

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float) -> TransferEvidence:
        assert timeout_s > 0
        self.sent.append(target_label)
        return remote_transfer(self.adapter, source, target_label)

    def close(self) -> None:
        pass


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, Gateway, FakeAdapter]]:
    cfg: dict[str, Any] = getattr(request, "param", {})
    eng, ad, c, r, j, fake = make_parts()
    app = create_app(r, ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN,
                                      engine_url="http://engine.test:8000", **cfg))
    with uvicorn_thread(app) as url:
        yield url, app.state.gateway, ad


def test_update_in_one_call_publishes_and_serves_the_new_policy(
        served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served
    ad.stage(W1)
    tr = FakeTransport(ad)
    with RolloutCoreClient(url, TOKEN, transport=tr) as rc:
        res = rc.update(W1, P1, owner="trainer-0", min_verification="probe")
        assert res.status == "published" and res.published is not None
        # The client's own clock: two round trips and the send, inside the whole call.
        cs = res.client_s
        assert set(cs) == {"begin", "transfer", "report", "total"}
        assert 0 < cs["begin"] + cs["transfer"] + cs["report"] <= cs["total"]
        assert res.published.label == "rc-1" and res.state == "READY"
        assert res.identity is not None and res.identity["verification"] == "probe"
        assert tr.connects == ["http://engine.test:8000"] and tr.sent == ["rc-1"]
        assert rc.status()["committed"]["label"] == "rc-1"
        w2 = FakeWeights.from_seed(2, step=2)
        ad.stage(w2)
        res2 = rc.update(w2, Provenance("fake-seed-2", "fake-run", 2), label="step-2")
        assert res2.published is not None and res2.published.label == "step-2"
        assert tr.connects == ["http://engine.test:8000"]  # connected once
    r = httpx.post(f"{url}/inference/v1/generate",
                   json={"token_ids": [4, 5], "sampling_params": {"max_tokens": 5}})
    assert r.headers["x-rolloutcore-version"] == "step-2"
    assert r.json()["choices"][0]["token_ids"] == reference_tokens(w2.digest, [4, 5], 5)
    assert gw.controller.identity is not None
    assert gw.controller.identity.same_weights(identity_of(w2, Provenance("fake-seed-2",
                                                                            "fake-run", 2)))


def test_transfer_refused_before_anything_moved_returns_to_service(
        served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served

    def refuse(grant: UpdateGrant, source: Any) -> TransferEvidence:
        raise TransferError("transfer", "preflight: manifest differs", mutation_started=False)

    with RolloutCoreClient(url, TOKEN) as rc, pytest.raises(UpdateFailed) as ei:
        rc.update(W1, P1, transfer=refuse)
    assert ei.value.classification == "no_mutation" and ei.value.state == "READY"
    assert gw.controller.state is State.READY and not ad.engine.paused


def test_transfer_that_breaks_midway_taints(served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served

    def broken(grant: UpdateGrant, source: Any) -> TransferEvidence:
        ad.engine.start_update()
        raise RuntimeError("gloo: connection reset by peer")

    with RolloutCoreClient(url, TOKEN) as rc, pytest.raises(UpdateFailed) as ei:
        rc.update(W1, P1, transfer=broken)
    assert ei.value.classification == "ambiguous" and ei.value.state == "TAINTED"
    assert isinstance(ei.value.__cause__, RuntimeError)
    assert [v.label for v in gw.controller.published] == ["default"]


@pytest.mark.parametrize("served", [{"transport": {"backend": "rolloutcore_gloo"}}],
                         indirect=True)
def test_transport_backend_mismatch_is_refused_up_front(
        served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served
    with RolloutCoreClient(url, TOKEN, transport=FakeTransport(ad)) as rc, \
            pytest.raises(UpdateFailed) as ei:
        rc.update(W1, P1)
    assert ei.value.classification == "no_mutation"
    assert gw.controller.state is State.READY


def test_wrong_token_and_one_writer(served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served
    with RolloutCoreClient(url, "not-the-token") as bad, pytest.raises(BadInput):
        bad.status()
    with RolloutCoreClient(url, TOKEN) as rc:
        g = rc.begin(identity_of(W1, P1), owner="a", probe=W1.policy_probe())
        with pytest.raises(UpdateRefused):
            rc.begin(identity_of(W1, P1), owner="b", probe=W1.policy_probe())
        res = rc.report_failure(g, "refused", "changed my mind")
        assert res.status == "failed" and res.classification == "no_mutation"
    with pytest.raises(BadInput):
        RolloutCoreClient(url, TOKEN, timeout_s=0)


@pytest.mark.parametrize("served", [{"lease_s": 0.3}], indirect=True)
def test_a_report_after_the_lease_expired_is_told_so(
        served: tuple[str, Gateway, FakeAdapter]) -> None:
    url, gw, ad = served
    with RolloutCoreClient(url, TOKEN) as rc:
        g = rc.begin(identity_of(W1, P1), owner="slow", probe=W1.policy_probe())
        ad.engine.start_update()  # it began sending, and overran its lease
        deadline = time.monotonic() + 10
        while gw.updates.open_update is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gw.updates.open_update is None  # expired
        ad.engine.finish_update("late")
        ev = remote_transfer(ad, W1, g.target.label)
        res = rc.report(g, ev)
        assert res.status == "expired" and res.classification == "ambiguous"
        with pytest.raises(UpdateFailed):
            res.raise_for_failure()
    assert gw.controller.state is State.TAINTED
    assert [v.label for v in gw.controller.published] == ["default"]


@pytest.mark.parametrize("served", [{"lease_s": 0.3}], indirect=True)
def test_trainer_killed_between_begin_and_report(
        served: tuple[str, Gateway, FakeAdapter]) -> None:
    """A real trainer process begins, then is SIGKILLed before it sent anything: the lease
    expires, nothing is published, and (#16) the engine, which counted no write, goes back
    to service on the old version instead of being tainted."""
    url, gw, ad = served
    ident = identity_of(W1, P1)
    script = textwrap.dedent(f"""
        import sys, time
        from rolloutcore.service.client import RolloutCoreClient
        from rolloutcore.core.versions import Provenance, WeightIdentity
        from rolloutcore.testing.fake import FakeWeights
        ident = WeightIdentity({ident.manifest_digest!r}, Provenance("fake-seed-1", "fake-run", 1),
                               {ident.content_digest!r})
        rc = RolloutCoreClient({url!r}, {TOKEN!r})
        g = rc.begin(ident, owner="doomed-trainer",
                     probe=FakeWeights.from_seed(1, step=1).policy_probe())
        print("BEGUN", g.update_id, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("BEGUN"), (line, proc.stderr.read() if proc.stderr else "")
        uid = int(line.split()[1])
        # open (or, on a very slow machine, already expired): never published
        assert gw.controller.state in (State.UPDATING, State.READY)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    deadline = time.monotonic() + 10
    while gw.updates.open_update is not None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert gw.controller.state is State.READY
    with RolloutCoreClient(url, TOKEN) as rc, pytest.raises(BadInput, match="403"):
        rc.get_update(uid)  # the lease's secret died with its trainer
    info = gw.updates.get(uid, gw.updates._updates[uid].secret)[1]
    assert info["status"] == "expired" and info["result"]["classification"] == "no_mutation"
    assert [v.label for v in gw.controller.published] == ["default"]
    r = httpx.post(f"{url}/inference/v1/generate", json={"token_ids": [1],
                                                         "sampling_params": {}})
    assert r.status_code == 200 and r.headers["x-rolloutcore-version"] == "default"


def test_client_disconnect_over_real_sockets_releases_the_binding() -> None:
    """uvicorn's own disconnect signalling (not the in-process transport's)."""
    eng, ad, c, r, j, fake = make_parts()
    fake.event_delay_s = 0.05
    app = create_app(r, ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN))
    with uvicorn_thread(app) as url, httpx.Client(timeout=10) as hc:
        with hc.stream("POST", f"{url}/inference/v1/generate",
                       json={"token_ids": [1, 2], "stream": True,
                             "sampling_params": {"max_tokens": 50}}) as s:
            chunks = s.iter_bytes()  # kept referenced: dropping it closes the connection
            first = next(chunks)
            assert b'"rolloutcore"' in first and len(c.active) == 1
        deadline = time.monotonic() + 10
        while (c.active or fake.streams_closed_early == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.active == {} and fake.streams_closed_early == 1
        text = hc.get(f"{url}/metrics").text
        assert 'rolloutcore_stream_endings_total{ending="client_disconnect"} 1.0' in text


def test_a_launched_engines_route_key_goes_to_the_granted_trainer_only() -> None:
    """Issue 29: the gateway that launched the engine holds its route key
    (``transports.engine_key``); status says the routes are guarded without showing
    it, a begin's grant carries a key lent for the lease (#47), and the client registers
    it for the engine URL it was granted (here another name than the gateway's
    upstream), so that its transport's weight writes carry it; a trainer without it
    does not preconnect."""
    from rolloutcore.transports import engine_key

    eng, ad, c, r, j, fake = make_parts()
    key = engine_key.new_key()
    # Behind the guard, its key registered: what ManagedEngine(guard_routes=True) does.
    up = serve_fake(fake, guard_key=key)
    granted_url = "http://engine-key.test:8000"
    try:
        app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN,
                                          engine_url=granted_url))
        with uvicorn_thread(app) as url:
            auth = {"authorization": f"Bearer {TOKEN}"}
            st = httpx.get(f"{url}/control/status", headers=auth, timeout=10).json()
            assert st["engine"]["route_guard"] is True and key not in str(st)
            ad.stage(W1)
            tr = FakeTransport(ad)
            with RolloutCoreClient(url, TOKEN, transport=tr) as rc:
                assert engine_key.headers_for(granted_url) == {}
                res = rc.update(W1, P1, owner="trainer-0")
                assert res.status == "published"
                lent = engine_key.headers_for(granted_url)[engine_key.HEADER]
                assert lent != key  # a key lent for the lease, never the launcher's
                assert tr.connects == [granted_url]  # inside the lease, with the key
                done = httpx.get(f"{url}/control/updates/{res.update_id}", headers=auth,
                                 timeout=10).json()
                assert key not in str(done)  # shown once, in the grant
    finally:
        engine_key.forget(up)
        engine_key.forget(granted_url)


@pytest.mark.parametrize("bad", ["short", 7, "k" * 40 + "\nX: y"])
def test_a_grant_with_a_malformed_route_key_is_refused(bad: Any) -> None:
    from rolloutcore.core.versions import WeightVersion
    from rolloutcore.errors import RolloutCoreError

    def grant(key: Any) -> dict[str, Any]:
        return {"update_id": 1, "target": WeightVersion(1, "rc-1", "e0").to_dict(),
                "identity_digest": "x", "lease": {"seconds": 5, "deadline_unix": 0,
                                                   "expires_in_s": 5},
                "engine": {"base_url": "http://e:1", "route_key": key}}

    assert UpdateGrant.from_json(grant(None)).route_key is None
    good = "k" * 43
    assert UpdateGrant.from_json(grant(good)).route_key == good
    with pytest.raises(RolloutCoreError, match="malformed"):
        UpdateGrant.from_json(grant(bad))
