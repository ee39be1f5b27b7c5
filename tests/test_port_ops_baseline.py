"""The weight-operation counters a paused validation records (the health watch's
baseline) are read at the update's first cache reset, overlapping the resets: every
write of the update is in them, and a write after that read is out of band. A reset
outside an update (the keep-mode sweep) starts no read.

The engine is a stand-in answering vLLM 0.32's routes and its ``/metrics`` counters
(``vllm:rl_weight_update_operation_duration_seconds_count``), through httpx's mock
transport; the real engine's counters are ``tests/engine/test_service_verify_engine.py``.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

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

_ROUTES = (Routes.HEALTH, Routes.VERSION, Routes.MODELS, Routes.METRICS, Routes.PAUSE,
           Routes.RESUME, Routes.IS_PAUSED, Routes.WEIGHT_INFO, Routes.RESET_PREFIX)


class _Engine:
    """vLLM 0.32's answers, its update counter written by ``write``."""

    def __init__(self) -> None:
        self.updates = 0
        self.paused = False
        self.paths: list[str] = []

    def write(self) -> None:
        self.updates += 1

    def __call__(self, request: httpx.Request) -> httpx.Response:
        p = request.url.path
        self.paths.append(p)
        if p == Routes.OPENAPI:
            return httpx.Response(200, json={"paths": {r: {} for r in _ROUTES}})
        if p == Routes.METRICS:
            return httpx.Response(200, text=(
                "vllm:rl_weight_update_operation_duration_seconds_count"
                f'{{operation="update"}} {self.updates}\n'))
        if p in (Routes.PAUSE, Routes.RESUME):
            self.paused = p == Routes.PAUSE
            return httpx.Response(200, json={"status": "paused" if self.paused else "resumed"})
        body: Any = {
            Routes.HEALTH: None, Routes.VERSION: {"version": "0.32.0"},
            Routes.MODELS: {"data": [{"id": "policy"}]},
            Routes.IS_PAUSED: {"is_paused": self.paused},
            Routes.WEIGHT_INFO: {"weight_version": "rc-1"},
            Routes.RESET_PREFIX: {"success": True}}.get(p, {"detail": "Not Found"})
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
