"""engine.close_state: a paused validation's label, paused state and weight-operation
counters in one round trip through a launched engine's route guard (issue 46).

The guard's route is driven as vLLM drives its middleware (an ASGI app, httpx's
``ASGITransport``), over an engine client and a Prometheus registry that stand in for
vLLM's; the adapter's side runs against the one fake of vLLM (``FakeVllm``, 0.32), in
front of which ``_Guarded`` answers the route from the fake's own state and counters, as
the guard does from vLLM's. The real engine's answer, compared with the three separate
reads, is ``tests/engine/test_close_state_engine.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import prometheus_client
import pytest

from rolloutcore.core.evidence import CacheKind, PauseMode
from rolloutcore.engine.close_state import CLOSE_STATE, MARK_HEADER, OPS_SAMPLES
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.write_counts import read_state, state_supported
from rolloutcore.errors import EffectError
from rolloutcore.testing import FakeVllm
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import HEADER, RouteGuard
from test_port_close_reads import _engine, _paths, _target, _write

KEY = engine_key.new_key()
BASE = "http://e.test"

# ----------------------------------------------------------------- the guard's route


class _Client:
    """``app.state.engine_client`` as vLLM's API server holds it (what ``/weight_info``
    and ``/is_paused`` await)."""

    def __init__(self) -> None:
        self.version: str | None = "rc-3"
        self.paused = False

    async def get_weight_version(self) -> str | None:
        return self.version

    async def is_paused(self) -> bool:
        return self.paused


async def _served(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM's registry (``get_prometheus_registry``), with its weight-operation families."""
    import vllm.v1.metrics.prometheus as prom

    reg = prometheus_client.CollectorRegistry()
    ops = prometheus_client.Histogram("vllm:rl_weight_update_operation_duration_seconds",
                                      "ops", ["operation"], registry=reg)
    prometheus_client.Gauge("vllm:rl_weight_update_operations_in_flight", "in flight",
                            ["operation"], registry=reg)
    for i in range(5):
        prometheus_client.Counter(f"vllm:other_{i}", "other", registry=reg).inc()
    monkeypatch.setattr(prom, "get_prometheus_registry", lambda: reg)
    monkeypatch.setenv(engine_key.ENV, KEY)
    yield ops


def _app(client: object) -> Any:
    import types

    app = types.SimpleNamespace(state=types.SimpleNamespace(engine_client=client))
    guard = RouteGuard(_served)

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        scope["app"] = app
        await guard(scope, receive, send)
    return asgi


def _call(app: Any, method: str, path: str, headers: dict[str, str] | None = None
          ) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://engine") as c:
            return await c.request(method, path, headers=headers)
    return asyncio.run(go())


def _ops(text: str) -> dict[str, float]:
    return dict(VllmHTTP.parse_ops(text, "t").done)


def test_the_guard_answers_all_three_from_vllms_own_sources_behind_the_key(
        registry: Any) -> None:
    client = _Client()
    app = _app(client)
    registry.labels(operation="update").observe(0.01)
    assert _call(app, "GET", CLOSE_STATE).status_code == 403
    r = _call(app, "GET", CLOSE_STATE, {HEADER: KEY})
    assert r.status_code == 200
    body = r.json()
    assert (body["weight_version"], body["is_paused"], body["marked"]) == ("rc-3", False, False)
    # what /metrics/?name[]=... renders of the same registry, and only that
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    want = prometheus_client.generate_latest(
        get_prometheus_registry().restricted_registry(list(OPS_SAMPLES))).decode()
    assert body["metrics"] == want and "vllm:other_" not in want
    assert _ops(body["metrics"]) == {"update": 1.0}
    client.paused, client.version = True, None
    body = _call(app, "GET", CLOSE_STATE, {HEADER: KEY}).json()
    assert body["is_paused"] is True and body["weight_version"] is None
    assert _call(app, "POST", CLOSE_STATE, {HEADER: KEY}).status_code == 405


def test_the_counters_are_those_at_the_marked_reset_and_a_mark_answers_once(
        registry: Any) -> None:
    client = _Client()
    app = _app(client)
    registry.labels(operation="update").observe(0.01)
    # a mark without the key reaches nothing and is not remembered
    assert _call(app, "POST", "/reset_prefix_cache", {MARK_HEADER: "m" * 22}).status_code == 403
    assert _call(app, "POST", "/reset_prefix_cache",
                 {HEADER: KEY, MARK_HEADER: "m" * 22}).status_code == 200
    registry.labels(operation="update").observe(0.01)   # a write after the reset
    client.version = "rc-4"
    body = _call(app, "GET", CLOSE_STATE + "?mark=" + "m" * 22, {HEADER: KEY}).json()
    assert body["marked"] is True and _ops(body["metrics"]) == {"update": 1.0}
    assert body["weight_version"] == "rc-4"   # the label as it is now
    again = _call(app, "GET", CLOSE_STATE + "?mark=" + "m" * 22, {HEADER: KEY}).json()
    assert again["marked"] is False and _ops(again["metrics"]) == {"update": 2.0}
    never = _call(app, "GET", CLOSE_STATE + "?mark=" + "x" * 22, {HEADER: KEY}).json()
    assert never["marked"] is False and _ops(never["metrics"]) == {"update": 2.0}


def test_a_vllm_without_the_reads_is_a_404(registry: Any) -> None:
    r = _call(_app(object()), "GET", CLOSE_STATE, {HEADER: KEY})
    assert r.status_code == 404


# ----------------------------------------------------------------- the adapter's side


class _Guarded:
    """The guard's route in front of a ``FakeVllm``: answered from the fake's label,
    paused state and ``/metrics/`` counters, which it renders when a marked reset arrives."""

    def __init__(self, fake: FakeVllm, *, answers: bool = True) -> None:
        self.fake = fake
        self.marks: dict[str, str] = {}
        fake.before = self._before
        fake.override(CLOSE_STATE, self._state if answers else
                      (lambda r: httpx.Response(404, json={"error": "no"})))

    def _text(self) -> str:
        reg = self.fake._registry.restricted_registry(list(OPS_SAMPLES))
        return prometheus_client.generate_latest(reg).decode()

    def _before(self, request: httpx.Request) -> None:
        mark = request.headers.get(MARK_HEADER)
        if mark is not None and request.headers.get(HEADER) == KEY:
            self.marks[mark] = self._text()

    def _state(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get(HEADER) != KEY:
            return httpx.Response(403)
        at = self.marks.pop(request.url.params.get("mark", ""), None)
        e = self.fake.engine
        return httpx.Response(200, json={"weight_version": e.label, "is_paused": e.paused,
                                         "metrics": at or self._text(),
                                         "marked": at is not None})


@pytest.fixture
def keyed() -> Iterator[None]:
    engine_key.register(BASE, KEY)
    try:
        yield
    finally:
        engine_key.forget(BASE, KEY)


def _adapter(fake: FakeVllm) -> VllmAdapter:
    a = VllmAdapter(VllmHTTP(BASE, transport=fake.transport()), engine_epoch="e0")
    a.bootstrap()
    return a


def _drained_after_a_write() -> tuple[FakeVllm, VllmAdapter]:
    """A guarded engine's adapter, bootstrapped and drained, the round's weights written."""
    fake = _engine()
    _Guarded(fake)
    a = _adapter(fake)
    a.drain(PauseMode.WAIT)
    _write(fake)
    return fake, a


def _after(fake: FakeVllm, n: int) -> list[str]:
    return _paths(fake)[n:]


@pytest.mark.usefixtures("keyed")
def test_a_guarded_close_reads_label_paused_and_counters_in_one_call() -> None:
    fake = _engine()
    _Guarded(fake)
    a = _adapter(fake)
    assert a._state_route is True
    a.drain(PauseMode.WAIT)
    _write(fake)
    n = len(_paths(fake))
    a.reset_cache(CacheKind.PREFIX)
    assert isinstance(a._ops_closing, str)  # a mark, no read
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True and ev.observed_label == "rc-1"
    assert ev.problems(_target()) == []
    close = _after(fake, n)
    assert close.count(CLOSE_STATE) == 1
    for gone in (Routes.IS_PAUSED, Routes.WEIGHT_INFO, Routes.METRICS, Routes.METRICS + "/"):
        assert gone not in close, close
    a.resume()
    assert a.observe_health().writes == ()


@pytest.mark.usefixtures("keyed")
def test_a_write_after_the_first_reset_is_out_of_band_through_the_guard_too() -> None:
    """The same ordering as ``test_port_close_reads``: the counters are the first reset's,
    the label is read after the resets."""
    fake, a = _drained_after_a_write()
    a.reset_cache(CacheKind.PREFIX)
    _write(fake)                     # somebody else's, while still paused
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    a.resume()
    assert a.observe_health().writes == ("1 /update_weights call(s)",)


@pytest.mark.usefixtures("keyed")
def test_no_reset_in_the_round_reads_the_counters_at_the_validation() -> None:
    fake, a = _drained_after_a_write()
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    a.resume()
    assert a.observe_health().writes == ()


@pytest.mark.usefixtures("keyed")
def test_an_engine_lost_before_the_guarded_read_fails_the_validation() -> None:
    fake, a = _drained_after_a_write()
    a.reset_cache(CacheKind.PREFIX)
    fake.down = True
    with pytest.raises(EffectError):
        a.validate(_target(), live=False)


@pytest.mark.usefixtures("keyed")
def test_a_guard_without_the_route_and_an_unkeyed_engine_read_separately() -> None:
    for fake, keyed in ((_engine(), True), (_engine(), False)):
        _Guarded(fake, answers=keyed is False)
        if not keyed:
            engine_key.forget(BASE, KEY)
        a = _adapter(fake)
        assert a._state_route is False
        a.drain(PauseMode.WAIT)
        _write(fake)
        a.reset_cache(CacheKind.PREFIX)
        ev = a.validate(_target(), live=False)
        assert ev is not None and ev.paused is True
        a.resume()
        paths = _paths(fake)
        assert Routes.WEIGHT_INFO in paths and Routes.IS_PAUSED in paths
        if not keyed:
            assert CLOSE_STATE not in paths  # never asked without the key
        engine_key.register(BASE, KEY)


def test_a_partial_answer_is_not_the_three_reads() -> None:
    fake = _engine()
    fake.override(CLOSE_STATE, lambda r: httpx.Response(200, json={"weight_version": "x"}))
    http = VllmHTTP(BASE, transport=fake.transport())
    assert state_supported(http) is False
    with pytest.raises(EffectError):
        read_state(http, None)


def test_a_retried_marked_reset_keeps_the_counters_of_the_first(registry: Any) -> None:
    app = _app(_Client())
    registry.labels(operation="update").observe(0.01)
    mark = {HEADER: KEY, MARK_HEADER: "r" * 22}
    assert _call(app, "POST", "/reset_prefix_cache", mark).status_code == 200
    registry.labels(operation="update").observe(0.01)
    assert _call(app, "POST", "/reset_prefix_cache", mark).status_code == 200  # a retry
    body = _call(app, "GET", CLOSE_STATE + "?mark=" + "r" * 22, {HEADER: KEY}).json()
    assert body["marked"] is True and _ops(body["metrics"]) == {"update": 1.0}


@pytest.mark.usefixtures("keyed")
def test_a_retried_reset_carries_the_mark_again_and_a_reset_not_sent_reads_separately(
        ) -> None:
    fake = _engine()
    guard = _Guarded(fake)
    a = _adapter(fake)
    a.drain(PauseMode.WAIT)
    _write(fake)
    fake.down = True                                     # the first try never arrives
    with pytest.raises(EffectError):
        a.reset_cache(CacheKind.PREFIX)
    fake.down = False
    assert guard.marks == {}
    a.reset_cache(CacheKind.PREFIX)                      # the retry: the same mark
    assert list(guard.marks) == [a._ops_closing]
    _write(fake)
    a.validate(_target(), live=False)
    a.resume()
    assert a.observe_health().writes == ("1 /update_weights call(s)",)
    # a first reset of a cache the engine does not have sends nothing: the separate read
    a.drain(PauseMode.KEEP)
    n = len(_paths(fake))
    assert a._read_counts_at_reset(sends=False) is None
    assert a._ops_closing is not None and not isinstance(a._ops_closing, str)
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    assert any(p.startswith(Routes.METRICS) for p in _after(fake, n))
    assert CLOSE_STATE in _after(fake, n)
    a.resume()
    assert a.observe_health().writes == ()
