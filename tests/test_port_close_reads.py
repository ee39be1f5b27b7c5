"""An update's close, fewer round trips in a row: the caches after the first in the
runner's order are reset beside it, each call answered with its own cache's evidence;
the weight-operation counters a paused validation records (the health watch's baseline)
are read from the first reset on, overlapping the resets: every write of the update is
in them, and a write after that read is out of band. A reset outside an update (the
keep-mode sweep) starts neither.

The engine is a stand-in answering vLLM 0.32's routes and its ``/metrics`` counters
(``vllm:rl_weight_update_operation_duration_seconds_count``), through httpx's mock
transport; the real engine's counters are ``tests/engine/test_service_verify_engine.py``.
"""

from __future__ import annotations

import json
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

_ROUTES = (Routes.HEALTH, Routes.VERSION, Routes.MODELS, Routes.METRICS, Routes.PAUSE,
           Routes.RESUME, Routes.IS_PAUSED, Routes.WEIGHT_INFO, Routes.RESET_PREFIX,
           Routes.RESET_ENCODER, Routes.RESET_MM)


class _Engine:
    """vLLM 0.32's answers, its update counter written by ``write``."""

    def __init__(self) -> None:
        self.updates = 0
        self.paused = False
        self.label = "rc-1"
        self.paths: list[str] = []
        self.down = False  # every request refused (the engine lost)
        #: the success flag each reset route answers (vLLM's prefix reset says; the
        #: others answer an empty 200, as vLLM 0.32's do)
        self.reset_ok: dict[str, bool | None] = {Routes.RESET_PREFIX: True,
                                                 Routes.RESET_ENCODER: None,
                                                 Routes.RESET_MM: None}

    def write(self) -> None:
        self.updates += 1

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        p = request.url.path
        self.paths.append(p)
        if p == Routes.OPENAPI:
            return httpx.Response(200, json={"paths": {r: {} for r in _ROUTES}})
        if p == Routes.METRICS:
            return httpx.Response(200, text=(
                "vllm:rl_weight_update_operation_duration_seconds_count"
                f'{{operation="update"}} {self.updates}\n'))
        if p in self.reset_ok:
            ok = self.reset_ok[p]
            return httpx.Response(200, content=b"" if ok is None else
                                  json.dumps({"success": ok}).encode())
        if p in (Routes.PAUSE, Routes.RESUME):
            self.paused = p == Routes.PAUSE
            return httpx.Response(200, json={"status": "paused" if self.paused else "resumed"})
        body: Any = {
            Routes.HEALTH: None, Routes.VERSION: {"version": "0.32.0"},
            Routes.MODELS: {"data": [{"id": "policy"}]},
            Routes.IS_PAUSED: {"is_paused": self.paused},
            Routes.WEIGHT_INFO: {"weight_version": self.label}}.get(p, {"detail": "Not Found"})
        return httpx.Response(200 if p in _ROUTES else 404, content=json.dumps(body))


def _target() -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, "rc-1", "e0"),
                        WeightIdentity.declare(m, Provenance("c")), "test")


def _adapter(eng: _Engine) -> VllmAdapter:
    a = VllmAdapter(VllmHTTP("http://e.test", transport=httpx.MockTransport(eng)),
                    engine_epoch="e0")
    a.bootstrap()
    return a


def test_a_write_after_the_first_reset_is_out_of_band() -> None:
    eng = _Engine()
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    eng.write()                      # the update's own write
    a.reset_cache(CacheKind.PREFIX)  # the counters are read from here on
    assert a._ops_closing is not None
    a._ops_closing.result(timeout=10)
    eng.write()                      # somebody else's, while still paused
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    a.resume()
    assert eng.paths.count(Routes.METRICS) == 3  # bootstrap, drain, the reset's read
    # The update's write is the baseline; the one after the reset's read is not.
    assert a.observe_health().writes == ("1 /update_weights call(s)",)


def test_the_validation_reads_the_label_itself_after_the_resets() -> None:
    """The paused validation reads the engine's label in its own step, after the resets
    (not beside them): the label the finish set is what it records, and an engine lost
    between the resets and the validation fails the validation's observation (an
    ``EffectError``: retried as incomplete, then escalated) instead of passing on reads
    taken before it was lost (tests/engine/test_faults_engine.py kills a real engine
    there)."""
    eng = _Engine()
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    eng.write()
    a.reset_cache(CacheKind.PREFIX)
    before = eng.paths.count(Routes.WEIGHT_INFO)
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.observed_label == "rc-1" and ev.problems(_target()) == []
    assert eng.paths.count(Routes.WEIGHT_INFO) == before + 1
    a.resume()
    a.drain(PauseMode.WAIT)
    eng.write()
    a.reset_cache(CacheKind.PREFIX)
    eng.down = True
    with pytest.raises(EffectError):
        a.validate(_target(), live=False)


def test_the_updates_own_writes_are_the_baseline_and_a_sweep_reads_nothing() -> None:
    eng = _Engine()
    a = _adapter(eng)
    a.reset_cache(CacheKind.PREFIX)  # a sweep: no update drained, no read started
    assert a._ops_closing is None
    a.drain(PauseMode.WAIT)
    eng.write()
    ev = a.validate(_target(), live=False)  # no reset due: the validation reads them
    assert ev is not None and ev.paused is True
    a.resume()
    assert a.observe_health().writes == ()
    a.reset_cache(CacheKind.PREFIX)  # after the resume: a sweep again
    assert a._ops_closing is None


def test_the_later_resets_go_beside_the_first_and_each_answers_for_its_own_cache() -> None:
    eng = _Engine()
    eng.reset_ok[Routes.RESET_MM] = False  # a later reset's failure is still its own
    a = _adapter(eng)
    a.drain(PauseMode.WAIT)
    eng.write()
    first = a.reset_cache(CacheKind.PREFIX)
    assert first.cache is CacheKind.PREFIX and first.engine_success is True
    assert a._resets_ahead is not None
    for f in list(a._resets_ahead.values()):
        f.result(timeout=10)
    # All three were sent before the runner asked for the second.
    assert {Routes.RESET_ENCODER, Routes.RESET_MM} <= set(eng.paths)
    enc = a.reset_cache(CacheKind.ENCODER)
    mm = a.reset_cache(CacheKind.MULTIMODAL)
    assert (enc.cache, mm.cache) == (CacheKind.ENCODER, CacheKind.MULTIMODAL)
    assert mm.engine_success is False
    # A retry of a reset (an incomplete observation) is a call of its own.
    again = a.reset_cache(CacheKind.MULTIMODAL)
    assert again.engine_success is False
    assert [p for p in eng.paths if p.startswith("/reset")].count(Routes.RESET_MM) == 2
    assert all(eng.paths.count(r) == 1 for r in (Routes.RESET_PREFIX, Routes.RESET_ENCODER))
    a.resume()
    # After the resume (a sweep): one reset, one call.
    n = len(eng.paths)
    a.reset_cache(CacheKind.PREFIX)
    assert eng.paths[n:] == [Routes.RESET_PREFIX]


def test_a_first_reset_later_in_the_order_resets_nothing_before_it() -> None:
    """Keep mode defers the prefix reset: the update's first reset is the encoder's, and
    the prefix cache is not reset ahead of the sweep."""
    eng = _Engine()
    a = _adapter(eng)
    a.drain(PauseMode.KEEP)
    a.reset_cache(CacheKind.ENCODER)
    assert a._resets_ahead is not None
    for f in list(a._resets_ahead.values()):
        f.result(timeout=10)
    assert Routes.RESET_PREFIX not in eng.paths and Routes.RESET_MM in eng.paths


class _Registry:
    """vLLM's ``/metrics`` as its API server renders it with ``prometheus_client``: the whole
    registry at ``/metrics``; at ``/metrics/`` (vLLM mounts ``make_asgi_app`` there) only the
    samples ``name[]`` names, as ``make_asgi_app`` restricts them
    (``registry.restricted_registry``). ``mount=False``: an engine without that mount."""

    def __init__(self, *, mount: bool = True) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.mount = mount
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
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        from prometheus_client import generate_latest

        p = request.url.path
        self.paths.append(p)
        if p == Routes.OPENAPI:
            return httpx.Response(200, json={"paths": {Routes.METRICS: {}}})
        if p == Routes.METRICS:
            return httpx.Response(200, content=generate_latest(self.registry))
        if p == Routes.METRICS + "/" and self.mount:
            names = request.url.params.get_list("name[]")
            reg: Any = self.registry.restricted_registry(names) if names else self.registry
            return httpx.Response(200, content=generate_latest(reg))
        return httpx.Response(404, json={"detail": "Not Found"})


def test_the_counters_read_from_the_restricted_metrics_are_the_whole_pages() -> None:
    """``weight_ops`` asks vLLM for its three families only (``/metrics/?name[]=...``):
    the same counters, in-flight calls and sleep state as a parse of the whole page, for
    a fraction of its size; an engine without that mount is read whole, the same."""
    reg = _Registry()
    for op, n in (("start", 2), ("update", 3), ("finish", 1), ("init", 1)):
        for _ in range(n):
            reg.ops.labels(operation=op).observe(0.01)
    reg.flight.labels(operation="update").set(1)
    http = VllmHTTP("http://e.test", transport=httpx.MockTransport(reg))
    got = http.weight_ops()
    assert reg.paths == [Routes.METRICS + "/"]   # one restricted read, no whole page
    assert dict(got.done) == {"start": 2.0, "update": 3.0, "finish": 1.0, "init": 1.0}
    assert dict(got.in_flight) == {"update": 1.0} and got.awake is True
    # the same as the whole page's parse, and a fraction of its bytes
    whole_reg = _Registry(mount=False)
    whole_reg.registry = reg.registry
    whole = VllmHTTP("http://e.test", transport=httpx.MockTransport(whole_reg))
    assert whole.weight_ops() == got
    assert whole_reg.paths == [Routes.METRICS + "/", Routes.METRICS]  # 404, then whole
    assert whole.weight_ops() == got and whole_reg.paths[-1] == Routes.METRICS
    assert whole_reg.paths.count(Routes.METRICS + "/") == 1   # not asked again
    from prometheus_client import generate_latest

    small = generate_latest(reg.registry.restricted_registry([
        "vllm:rl_weight_update_operation_duration_seconds_count",
        "vllm:rl_weight_update_operations_in_flight", "vllm:engine_sleep_state"]))
    assert len(small) * 4 < len(generate_latest(reg.registry))
    # a write after the first read is seen by the restricted read as by the whole one
    reg.ops.labels(operation="update").observe(0.01)
    assert http.weight_ops().writes_since(got) == ("1 /update_weights call(s)",
                                                   "a /update_weights call in flight")
