"""A key lent for one lease (#47): the guard honours it until it is taken back, replaced
or its seconds run out, and only the launcher's own key lends or takes back.

The guard is driven as vLLM drives it (an ASGI middleware around an app, requests
through httpx's ``ASGITransport``); the gateway lending and taking back the key of a
real launched vLLM is ``tests/engine/test_gateway_openai_sdk.py``.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from rolloutcore.engine import lent_key
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import HEADER, LENT_KEY, RouteGuard

OWN = engine_key.new_key()


class _Engine:
    """The engine behind the guard: counts what reached it."""

    def __init__(self) -> None:
        self.served: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.served.append(scope["path"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def rig(monkeypatch: pytest.MonkeyPatch) -> tuple[RouteGuard, _Engine]:
    monkeypatch.setenv(engine_key.ENV, OWN)
    eng = _Engine()
    return RouteGuard(eng), eng


def _call(app: Any, method: str, path: str, key: str | None = None,
          body: Any = None) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as c:
            return await c.request(method, path, headers={HEADER: key} if key else None,
                                   content=None if body is None else json.dumps(body))
    return asyncio.run(go())


def _lend(app: Any, key: str, seconds: float, by: str = OWN) -> httpx.Response:
    return _call(app, "PUT", LENT_KEY, by, {"key": key, "seconds": seconds})


def test_a_lent_key_opens_the_routes_until_it_is_taken_back(
        rig: tuple[RouteGuard, _Engine]) -> None:
    guard, eng = rig
    lent = engine_key.new_key()
    assert _call(guard, "POST", "/update_weights", lent).status_code == 403
    assert _lend(guard, lent, 600).status_code == 200
    assert _call(guard, "POST", "/update_weights", lent).status_code == 200
    assert eng.served == ["/update_weights"]
    assert _call(guard, "DELETE", LENT_KEY, OWN).json() == {"lent": False}
    for path in ("/update_weights", "/pause", "/collective_rpc", engine_key.FAST_PAUSE):
        assert _call(guard, "POST", path, lent).status_code == 403, path
    assert eng.served == ["/update_weights"]  # nothing after the lease reached the engine
    assert _call(guard, "POST", "/pause", OWN).status_code == 200  # the launcher's stays


def test_a_lent_key_ends_at_its_seconds_on_the_engines_clock(
        rig: tuple[RouteGuard, _Engine]) -> None:
    guard, eng = rig
    lent = engine_key.new_key()
    assert _lend(guard, lent, 0.05).status_code == 200
    time.sleep(0.2)  # past the lease's end: no call of the gateway needed to end it
    assert _call(guard, "POST", "/update_weights", lent).status_code == 403
    assert eng.served == []


def test_a_new_lease_replaces_the_last_ones_key(rig: tuple[RouteGuard, _Engine]) -> None:
    guard, eng = rig
    first, second = engine_key.new_key(), engine_key.new_key()
    assert _lend(guard, first, 600).status_code == 200
    assert _lend(guard, second, 600).status_code == 200
    assert _call(guard, "POST", "/pause", first).status_code == 403
    assert _call(guard, "POST", "/pause", second).status_code == 200


def test_only_the_launchers_key_lends_or_takes_back(rig: tuple[RouteGuard, _Engine]) -> None:
    guard, eng = rig
    lent, other = engine_key.new_key(), engine_key.new_key()
    assert _lend(guard, lent, 600).status_code == 200
    # The key's holder cannot lend itself another (longer) key, nor take it back for
    # another trainer; a caller without a key neither.
    for by in (lent, None, other):
        assert _call(guard, "PUT", LENT_KEY, by, {"key": other, "seconds": 9}
                     ).status_code == 403
        assert _call(guard, "DELETE", LENT_KEY, by).status_code == 403
    assert _call(guard, "POST", "/pause", lent).status_code == 200
    assert _call(guard, "POST", "/pause", other).status_code == 403
    assert eng.served == ["/pause"]


@pytest.mark.parametrize("body", [
    None, [], "x", {"key": "short", "seconds": 5}, {"key": OWN, "seconds": 5},
    {"key": "k" * 43, "seconds": 0}, {"key": "k" * 43, "seconds": -1},
    {"key": "k" * 43, "seconds": 86401}, {"key": "k" * 43, "seconds": True},
    {"key": "k" * 43, "seconds": "5"}, {"key": "k" * 43}, {"key": "k" * 43, "seconds": 5,
                                                           "more": 1},
    {"key": "k" * 40 + " " + "kk", "seconds": 5},
])
def test_a_bad_lend_is_a_400_and_changes_nothing(rig: tuple[RouteGuard, _Engine],
                                                 body: Any) -> None:
    guard, eng = rig
    lent = engine_key.new_key()
    assert _lend(guard, lent, 600).status_code == 200
    r = _call(guard, "PUT", LENT_KEY, OWN, body)
    assert r.status_code == 400, r.text
    assert _call(guard, "POST", "/pause", lent).status_code == 200  # still the one lent
    assert _call(guard, "POST", "/pause", "k" * 43).status_code == 403
    assert _call(guard, "GET", LENT_KEY, OWN).status_code == 405


def test_a_lent_key_never_replaces_the_launchers_in_this_process() -> None:
    url = "http://127.0.0.1:18499"
    own, lent, later = engine_key.new_key(), engine_key.new_key(), engine_key.new_key()
    try:
        engine_key.register(url, lent, lent=True)
        assert engine_key.headers_for(url) == {HEADER: lent}
        engine_key.register(url, later, lent=True)  # the next lease's
        assert engine_key.headers_for(url) == {HEADER: later}
        engine_key.register(url, own)
        assert engine_key.headers_for(url) == {HEADER: own}
        engine_key.forget(url, own)
        assert engine_key.headers_for(url) == {HEADER: later}
        with pytest.raises(ValueError):
            lent_key.lend(url, 0)
        assert lent_key.lend(url, 5) is None  # no key of its own: nothing to lend
        lent_key.revoke(url)                  # nor to take back
    finally:
        engine_key.forget(url)
    assert engine_key.headers_for(url) == {}


# ------------------------------------------------------------------ the lender's connection

def test_a_lender_lends_and_takes_back_over_one_connection_and_classifies_a_dead_engine(
        rig: tuple[RouteGuard, _Engine]) -> None:
    """``Lender``: the lends and take-backs of successive leases go over one kept-alive
    connection, and each does what ``lend``/``revoke`` do (the lent key opens the routes,
    the take-back closes them); once the engine is gone a take-back is ``EngineUnreachable``
    (nothing delivered), and after ``close`` a call still goes out, on a new connection."""
    from helpers.gateway_rig import uvicorn_thread
    from rolloutcore.errors import EngineUnreachable

    guard, eng = rig
    peers: list[Any] = []

    async def recorded(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            peers.append(tuple(scope["client"]))
        await guard(scope, receive, send)

    with pytest.raises(ValueError):
        lent_key.Lender("http://127.0.0.1:1", timeout_s=0)
    with uvicorn_thread(recorded, lifespan="off") as url:
        engine_key.register(url, OWN)
        lender = lent_key.Lender(url, timeout_s=10)
        try:
            for beside in (True, False):  # on the lend thread (the begin's), then inline
                key = lender.start_lend(30).result() if beside else lender.lend(30)
                assert key is not None
                assert httpx.post(url + "/pause", headers={HEADER: key}, timeout=10
                                  ).status_code == 200
                lender.revoke()
                assert httpx.post(url + "/pause", headers={HEADER: key}, timeout=10
                                  ).status_code == 403
            # The lender's four calls (0, 2, 4, 6) came on one connection; each probe
            # between them on one of its own.
            assert len(peers) == 8 and len({peers[i] for i in (0, 2, 4, 6)}) == 1, peers
            lender.close()
            assert lender.closed and lender._thread is None  # its lend thread ended
            assert lender.start_lend(30).result() is not None  # closed: inline, on a
            assert not any(t.name.startswith("rc-lend") for t in threading.enumerate())
            assert peers[-1] != peers[0]                        # connection of its own
            lender.revoke()
            assert lender.lend(30) is not None
            assert peers[-1] != peers[0]
            lender.revoke()
            lender.close()  # idempotent
            pooled = lent_key.Lender(url)
            assert pooled.lend(30) is not None
        except BaseException:
            engine_key.forget(url)
            raise
    try:
        with pytest.raises(EngineUnreachable):
            pooled.revoke()  # the engine is gone: its idle connection is not reused
    finally:
        pooled.close()
        engine_key.forget(url)
    assert lent_key.Lender(url).lend(30) is None  # no key of it held: nothing to lend


# ------------------------------------------------------------------ the gateway lends

def _gateway_parts(guarded: bool) -> tuple[str, Any, Any, str, Any]:
    from helpers.gateway_rig import make_parts, serve_fake

    eng, ad, c, r, j, fake = make_parts()
    key = engine_key.new_key()
    if guarded:
        up = serve_fake(fake, guard_key=key)
    else:  # a key is held, but the engine answers no lending route (an older guard)
        up = serve_fake(fake)
        engine_key.register(up, key)
    return up, ad, r, key, fake


def test_the_key_lent_to_a_trainer_ends_with_its_lease() -> None:
    """A trainer granted an update gets a key of its own, not the launcher's; once its
    report is taken (published), and once a lease runs out without one, that key is
    refused by the engine's guard and nothing reaches the engine; the gateway's own
    calls go on."""
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.core.versions import Provenance
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.client import RolloutCoreClient, identity_of, probe_for
    from rolloutcore.testing.fake import FakeWeights
    from test_service_client import FakeTransport

    up, ad, r, key, fake = _gateway_parts(guarded=True)
    auth = {"authorization": f"Bearer {TOKEN}"}
    w1, w2 = FakeWeights.from_seed(1, step=1), FakeWeights.from_seed(2, step=2)
    try:
        app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN))
        with uvicorn_thread(app) as url, RolloutCoreClient(
                url, TOKEN, transport=FakeTransport(ad)) as rc:
            ad.stage(w1)
            res = rc.update(w1, Provenance("w1", "run", 1), owner="trainer-0")
            assert res.status == "published"
            # This process launched the engine too: its own key goes with its calls,
            # and the grant's lent key is kept apart.
            assert engine_key.headers_for(up) == {HEADER: key}
            lent_key = engine_key._LENT[engine_key.origin(up)]
            assert lent_key != key
            before = httpx.get(f"{url}/control/status", headers=auth, timeout=10).json()
            reached = len(fake.received)
            for path in ("/pause", "/update_weight_version", "/collective_rpc"):
                assert httpx.post(up + path, headers={HEADER: lent_key}, json={},
                                  timeout=10).status_code == 403, path
            assert not {p for _, p in fake.received[reached:]} & {
                "/pause", "/update_weight_version", "/collective_rpc"}  # none reached vLLM
            after = httpx.get(f"{url}/control/status", headers=auth, timeout=10).json()
            assert after["state"] == "READY" and after["committed"] == before["committed"]
            # A lease that runs out without a report: its key ends with it too.
            ad.stage(w2)
            g = rc.begin(identity_of(w2, Provenance("w2", "run", 2)), owner="trainer-0",
                         lease_s=0.5, probe=probe_for(w2))
            assert g.route_key is not None and g.route_key != lent_key
            assert httpx.post(up + "/update_weight_version", headers={HEADER: g.route_key},
                              json={}, timeout=10).status_code != 403  # open in the lease
            done = rc.wait(g, 30)
            assert done.final and done.status == "expired", done
            reached = len(fake.received)
            assert httpx.post(up + "/pause", headers={HEADER: g.route_key}, json={},
                              timeout=10).status_code == 403
            assert ("POST", "/pause") not in fake.received[reached:] and not fake.engine.paused
            lender = app.state.gateway.updates.lender
            assert not lender.closed
        assert lender.closed  # the gateway's shutdown closed its kept-alive connection
    finally:
        engine_key.forget(up)


def test_a_key_the_engine_does_not_lend_refuses_the_begin_and_changes_nothing() -> None:
    """An engine that does not take the lent key (here: one without the lending route):
    the begin is refused (503, no_mutation: nothing was sent) and the engine resumed."""
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.core.versions import Provenance
    from rolloutcore.errors import UpdateFailed
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.client import RolloutCoreClient, identity_of, probe_for
    from rolloutcore.testing.fake import FakeWeights

    up, ad, r, key, fake = _gateway_parts(guarded=False)
    auth = {"authorization": f"Bearer {TOKEN}"}
    w1 = FakeWeights.from_seed(1, step=1)
    try:
        app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN))
        with uvicorn_thread(app) as url, RolloutCoreClient(url, TOKEN) as rc:
            before = httpx.get(f"{url}/control/status", headers=auth, timeout=10).json()
            ad.stage(w1)
            with pytest.raises(UpdateFailed, match="did not lend a route key") as ei:
                rc.begin(identity_of(w1, Provenance("w1", "run", 1)), owner="trainer-0",
                         probe=probe_for(w1))
            assert ei.value.classification == "no_mutation"
            after = httpx.get(f"{url}/control/status", headers=auth, timeout=10).json()
            assert after["state"] == "READY" and after["committed"] == before["committed"]
            assert not fake.engine.paused
    finally:
        engine_key.forget(up)


def _record_lends(app: Any) -> list[str | None]:
    """Every key the gateway's lender lends from now on, in order (the call still goes
    to the engine)."""
    lender = app.state.gateway.updates.lender
    lent: list[str | None] = []
    real_lend = lender.lend

    def lend(seconds: float) -> str | None:
        lent.append(real_lend(seconds))
        return lent[-1]

    lender.lend = lend
    return lent


def test_a_begin_that_opens_no_update_takes_back_the_key_lent_beside_its_drain() -> None:
    """The lend runs beside the drain: when the drain fails (no update opened, nothing
    sent) the key lent meanwhile is taken back, and the engine refuses it."""
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.core.versions import Provenance
    from rolloutcore.errors import UpdateFailed
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.client import RolloutCoreClient, identity_of, probe_for
    from rolloutcore.testing.fake import FakeWeights
    from rolloutcore.testing.fake_engine import FaultKind

    up, ad, r, key, fake = _gateway_parts(guarded=True)
    w1 = FakeWeights.from_seed(1, step=1)
    try:
        app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN))
        with uvicorn_thread(app) as url, RolloutCoreClient(url, TOKEN) as rc:
            lent = _record_lends(app)
            ad.stage(w1)
            ad.inject("drain", FaultKind.RAISE)
            with pytest.raises(UpdateFailed) as ei:
                rc.begin(identity_of(w1, Provenance("w1", "run", 1)), owner="trainer-0",
                         probe=probe_for(w1))
            assert ei.value.classification == "no_mutation"
            assert len(lent) == 1 and lent[0] is not None  # lent beside the drain...
            assert httpx.post(up + "/update_weight_version", headers={HEADER: lent[0]},
                              json={}, timeout=10).status_code == 403  # ...and taken back
            # The next begin opens and is lent a key of its own.
            g = rc.begin(identity_of(w1, Provenance("w1", "run", 1)), owner="trainer-0",
                         probe=probe_for(w1))
            assert g.route_key is not None and g.route_key == lent[-1] != lent[0]
    finally:
        engine_key.forget(up)


def test_a_slow_drain_lends_the_key_again_so_it_ends_with_the_lease() -> None:
    """The key lent beside a drain that took longer than the slack (here 0.2 s, against
    50 ms) is lent again once the update is open: the grant shows the second, the engine
    honours it and no longer the first (replaced, never shown)."""
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.core.versions import Provenance
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.client import RolloutCoreClient, identity_of, probe_for
    from rolloutcore.testing.fake import FakeWeights

    up, ad, r, key, fake = _gateway_parts(guarded=True)
    w1 = FakeWeights.from_seed(1, step=1)
    real_drain = ad.drain

    def slow_drain(*a: Any, **k: Any) -> Any:
        time.sleep(0.2)  # the engine's pause waits for requests in flight
        return real_drain(*a, **k)

    ad.drain = slow_drain
    try:
        app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN))
        with uvicorn_thread(app) as url, RolloutCoreClient(url, TOKEN) as rc:
            lent = _record_lends(app)
            ad.stage(w1)
            g = rc.begin(identity_of(w1, Provenance("w1", "run", 1)), owner="trainer-0",
                         probe=probe_for(w1))
            assert len(lent) == 2 and None not in lent and g.route_key == lent[1]
            assert httpx.post(up + "/update_weight_version", headers={HEADER: lent[0]},
                              json={}, timeout=10).status_code == 403
            assert httpx.post(up + "/update_weight_version", headers={HEADER: lent[1]},
                              json={}, timeout=10).status_code != 403
    finally:
        engine_key.forget(up)
