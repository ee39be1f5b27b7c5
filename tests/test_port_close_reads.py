"""An update's close, fewer round trips in a row: the caches after the first in the
runner's order are reset beside it, each call answered with its own cache's evidence;
the weight-operation counters a paused validation records (the health watch's baseline)
are read from the first reset on, overlapping the resets: every write of the update is
in them, and a write after that read is out of band. A reset outside an update (the
keep-mode sweep) starts neither.

The engine is the one fake of vLLM (``rolloutcore.testing.FakeVllm``) saying it is 0.32,
which counts its weight-update calls at ``/metrics``
(``vllm:rl_weight_update_operation_duration_seconds_count``), through httpx's mock
transport; the real engine's counters are ``tests/engine/test_service_verify_engine.py``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from rolloutcore.core.evidence import CacheKind, PauseMode, UpdateTarget
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import EffectError
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights


def _engine() -> FakeVllm:
    """The one fake of vLLM, saying it is 0.32 (so its ``/metrics`` counts the weight
    updates), its label ``rc-1``."""
    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0), model="policy")
    fake.version, fake.engine.label = "0.32.0", "rc-1"
    return fake


def _write(fake: FakeVllm) -> None:
    """A weight write the engine counts: an ``/update_weights`` call, sent to the fake."""
    got = fake.handle(httpx.Request("POST", f"http://e.test{Routes.UPDATE_WEIGHTS}",
                                    json={"update_info": {"names": []}}))
    assert got.status_code == 200, got.text


def _paths(fake: FakeVllm) -> list[str]:
    return [p for _, p in fake.received]


def _target() -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, "rc-1", "e0"),
                        WeightIdentity.declare(m, Provenance("c")), "test")


def _adapter(eng: FakeVllm) -> VllmAdapter:
    a = VllmAdapter(VllmHTTP("http://e.test", transport=eng.transport()), engine_epoch="e0")
    a.bootstrap()
    return a


def test_a_write_after_the_first_reset_is_out_of_band() -> None:
    eng = _engine()
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    _write(eng)                      # the update's own write
    a.reset_cache(CacheKind.PREFIX)  # the counters are read from here on
    assert a._ops_closing is not None
    a._ops_closing.result(timeout=10)
    _write(eng)                      # somebody else's, while still paused
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    a.resume()
    # bootstrap, the reset's read: the drain takes the bootstrap's baseline
    # (tests/test_native_drain_counts.py)
    assert _paths(eng).count(Routes.METRICS) == 2
    # The update's write is the baseline; the one after the reset's read is not.
    assert a.observe_health().writes == ("1 /update_weights call(s)",)


def test_the_validation_reads_the_label_itself_after_the_resets() -> None:
    """The paused validation reads the engine's label in its own step, after the resets
    (not beside them): the label the finish set is what it records, and an engine lost
    between the resets and the validation fails the validation's observation (an
    ``EffectError``: retried as incomplete, then escalated) instead of passing on reads
    taken before it was lost (tests/engine/test_faults_engine.py kills a real engine
    there)."""
    eng = _engine()
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    _write(eng)
    a.reset_cache(CacheKind.PREFIX)
    before = _paths(eng).count(Routes.WEIGHT_INFO)
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.observed_label == "rc-1" and ev.problems(_target()) == []
    assert _paths(eng).count(Routes.WEIGHT_INFO) == before + 1
    a.resume()
    a.drain(PauseMode.WAIT)
    _write(eng)
    a.reset_cache(CacheKind.PREFIX)
    eng.down = True
    with pytest.raises(EffectError):
        a.validate(_target(), live=False)


def test_the_updates_own_writes_are_the_baseline_and_a_sweep_reads_nothing() -> None:
    eng = _engine()
    a = _adapter(eng)
    a.reset_cache(CacheKind.PREFIX)  # a sweep: no update drained, no read started
    assert a._ops_closing is None
    a.drain(PauseMode.WAIT)
    _write(eng)
    ev = a.validate(_target(), live=False)  # no reset due: the validation reads them
    assert ev is not None and ev.paused is True
    a.resume()
    assert a.observe_health().writes == ()
    a.reset_cache(CacheKind.PREFIX)  # after the resume: a sweep again
    assert a._ops_closing is None


def test_the_later_resets_go_beside_the_first_and_each_answers_for_its_own_cache() -> None:
    eng = _engine()
    eng.override(Routes.RESET_MM, lambda r: httpx.Response(200, json={"success": False}))
    # (a later reset's failure is still its own)
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    _write(eng)
    first = a.reset_cache(CacheKind.PREFIX)
    assert first.cache is CacheKind.PREFIX and first.engine_success is True
    assert a._resets_ahead is not None
    for f in list(a._resets_ahead.values()):
        f.result(timeout=10)
    # (and the counters' read the first reset started: it lands before the sweep's count)
    assert a._ops_closing is not None
    a._ops_closing.result(timeout=10)
    # All three were sent before the runner asked for the second.
    assert {Routes.RESET_ENCODER, Routes.RESET_MM} <= set(_paths(eng))
    enc = a.reset_cache(CacheKind.ENCODER)
    mm = a.reset_cache(CacheKind.MULTIMODAL)
    assert (enc.cache, mm.cache) == (CacheKind.ENCODER, CacheKind.MULTIMODAL)
    assert mm.engine_success is False
    # A retry of a reset (an incomplete observation) is a call of its own.
    again = a.reset_cache(CacheKind.MULTIMODAL)
    assert again.engine_success is False
    assert [p for p in _paths(eng) if p.startswith("/reset")].count(Routes.RESET_MM) == 2
    assert all(_paths(eng).count(r) == 1 for r in (Routes.RESET_PREFIX, Routes.RESET_ENCODER))
    a.resume()
    # After the resume (a sweep): one reset, one call.
    n = len(_paths(eng))
    a.reset_cache(CacheKind.PREFIX)
    assert _paths(eng)[n:] == [Routes.RESET_PREFIX]


def test_a_first_reset_later_in_the_order_resets_nothing_before_it() -> None:
    """Keep mode defers the prefix reset: the update's first reset is the encoder's, and
    the prefix cache is not reset ahead of the sweep."""
    eng = _engine()
    a = _adapter(eng)
    a.drain(PauseMode.KEEP)
    a.reset_cache(CacheKind.ENCODER)
    assert a._resets_ahead is not None
    for f in list(a._resets_ahead.values()):
        f.result(timeout=10)
    assert Routes.RESET_PREFIX not in _paths(eng) and Routes.RESET_MM in _paths(eng)


class _Registry:
    """vLLM's metrics registry (``prometheus_client``), rendered as its API server renders
    it: the whole registry at ``/metrics``; at ``/metrics/`` (vLLM mounts ``make_asgi_app``
    there) only the samples ``name[]`` names, as ``make_asgi_app`` restricts them
    (``registry.restricted_registry``). ``serve`` has the fake answer both routes with
    them; ``mount=False``: an engine without that mount (the fake's 404)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = CollectorRegistry(auto_describe=True)
        self.ops = Histogram("vllm:rl_weight_update_operation_duration_seconds", "ops",
                             ["operation"], registry=r)
        self.flight = Gauge("vllm:rl_weight_update_operations_in_flight", "in flight",
                            ["operation"], registry=r)
        sleep = Gauge("vllm:engine_sleep_state", "sleep", ["sleep_state"], registry=r)
        sleep.labels(sleep_state="awake").set(1)
        sleep.labels(sleep_state="weights_offloaded").set(0)
        # what else a vLLM registry renders (the bulk of the page)
        for i in range(40):
            Counter(f"vllm:other_{i}", "other", ["engine"], registry=r).labels(engine="0").inc(i)

    def whole(self, request: httpx.Request) -> httpx.Response:
        from prometheus_client import generate_latest

        return httpx.Response(200, content=generate_latest(self.registry))

    def restricted(self, request: httpx.Request) -> httpx.Response:
        from prometheus_client import generate_latest

        names = request.url.params.get_list("name[]")
        reg: Any = self.registry.restricted_registry(names) if names else self.registry
        return httpx.Response(200, content=generate_latest(reg))

    def serve(self, *, mount: bool = True) -> FakeVllm:
        fake = _engine()
        fake.override(Routes.METRICS, self.whole)
        if mount:
            fake.override(Routes.METRICS + "/", self.restricted)
        return fake


def test_the_counters_read_from_the_restricted_metrics_are_the_whole_pages() -> None:
    """``weight_ops`` asks vLLM for its three families only (``/metrics/?name[]=...``):
    the same counters, in-flight calls and sleep state as a parse of the whole page, for
    a fraction of its size; an engine without that mount is read whole, the same."""
    reg = _Registry()
    fake = reg.serve()
    for op, n in (("start", 2), ("update", 3), ("finish", 1), ("init", 1)):
        for _ in range(n):
            reg.ops.labels(operation=op).observe(0.01)
    reg.flight.labels(operation="update").set(1)
    http = VllmHTTP("http://e.test", transport=fake.transport())
    got = http.weight_ops()
    assert _paths(fake) == [Routes.METRICS + "/"]   # one restricted read, no whole page
    assert dict(got.done) == {"start": 2.0, "update": 3.0, "finish": 1.0, "init": 1.0}
    assert dict(got.in_flight) == {"update": 1.0} and got.awake is True
    # the same as the whole page's parse, and a fraction of its bytes
    unmounted = reg.serve(mount=False)
    whole = VllmHTTP("http://e.test", transport=unmounted.transport())
    assert whole.weight_ops() == got
    assert _paths(unmounted) == [Routes.METRICS + "/", Routes.METRICS]  # 404, then whole
    assert whole.weight_ops() == got and _paths(unmounted)[-1] == Routes.METRICS
    assert _paths(unmounted).count(Routes.METRICS + "/") == 1   # not asked again
    from prometheus_client import generate_latest

    small = generate_latest(reg.registry.restricted_registry([
        "vllm:rl_weight_update_operation_duration_seconds_count",
        "vllm:rl_weight_update_operations_in_flight", "vllm:engine_sleep_state"]))
    assert len(small) * 4 < len(generate_latest(reg.registry))
    # a write after the first read is seen by the restricted read as by the whole one
    reg.ops.labels(operation="update").observe(0.01)
    assert http.weight_ops().writes_since(got) == ("1 /update_weights call(s)",
                                                   "a /update_weights call in flight")
