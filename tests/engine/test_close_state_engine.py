"""The guard's one read of label, paused state and counters (``engine.close_state``) is
what vLLM's three routes answer, on a real launched engine (vLLM 0.32, CPU, tiny Llama).

One guarded engine (gloo backend): ``GET /rolloutcore/state`` against ``/weight_info``,
``/is_paused`` and ``/metrics/``'s counters, unpaused and paused, before and after a weight
write; the counters a marked reset rendered, before a later write; 403 without the key;
and an adapter over it that reads the three in one call at its paused validation. One
vLLM start (~1 min on 2 cores).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.evidence import CacheKind, PauseMode
from rolloutcore.engine import close_state
from rolloutcore.engine.close_state import CLOSE_STATE, ClosingState
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.write_counts import read_state, state_supported
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]


@pytest.fixture(scope="module")
def engine(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[ManagedEngine]:
    eng = engine_factory(tiny_models.A, guard_routes=True)
    try:
        yield eng
    finally:
        engine_factory.stop(eng)


def _same(http: VllmHTTP, mark: str | None = None) -> ClosingState:
    """The guard's answer, checked equal to the three separate reads around it (the
    engine is idle: nothing changes them in between)."""
    wi, paused, ops = http.weight_info(), http.is_paused(), http.weight_ops()
    got = read_state(http, mark)
    assert got.info == wi and got.paused == paused
    if not got.marked:
        assert got.ops == ops
    assert (wi, paused, ops) == (http.weight_info(), http.is_paused(), http.weight_ops())
    return got


def _write(engine: ManagedEngine, label: str, ckpt: object) -> None:
    t = GlooTransport(op_timeout_s=60)
    try:
        t.connect(engine.base_url, timeout_s=120)
        t.send(engine.base_url, label, WeightSource.from_checkpoint(ckpt),  # type: ignore[arg-type]
               timeout_s=120)
    finally:
        t.close()


def test_the_guards_answer_is_the_three_reads(engine: ManagedEngine,
                                              tiny_models: TinyModels) -> None:
    r = httpx.get(engine.base_url + CLOSE_STATE, timeout=30)
    assert r.status_code == 403
    http = VllmHTTP(engine.base_url, timeout_s=60)
    try:
        assert state_supported(http)
        first = _same(http)
        assert first.paused is False
        assert http.pause(PauseMode.WAIT)
        assert _same(http).paused is True
        _write(engine, "rc-close-1", tiny_models.B)
        written = _same(http)
        assert written.paused is True and written.info.label == "rc-close-1"
        assert written.ops.writes_since(first.ops)  # the write is counted
        # a marked reset: its counters, before a later write, and the label now
        mark = close_state.new_mark()
        assert http.reset_cache(CacheKind.PREFIX, mark=mark).engine_success is True
        at_reset = http.weight_ops()
        _write(engine, "rc-close-2", tiny_models.A)
        marked = _same(http, mark)
        assert marked.marked is True and marked.ops == at_reset
        assert marked.info.label == "rc-close-2" and marked.paused is True
        assert http.weight_ops().writes_since(marked.ops)
        assert http.resume()
        assert _same(http).paused is False
    finally:
        if http.is_paused():
            http.resume()
        http.close()


def test_an_adapters_paused_validation_reads_them_in_one_call(engine: ManagedEngine) -> None:
    a = VllmAdapter(VllmHTTP(engine.base_url, timeout_s=60), engine_epoch="e0")
    try:
        boot = a.bootstrap()
        assert a._state_route is True
        a.drain(PauseMode.WAIT)
        a.reset_cache(CacheKind.PREFIX)
        assert isinstance(a._ops_closing, str)
        from rolloutcore.core.evidence import UpdateTarget
        from rolloutcore.core.versions import (
            ParameterManifest,
            Provenance,
            WeightIdentity,
            WeightVersion,
        )

        m = ParameterManifest.from_items([("w", (2,), "float32")])
        label = boot.observed_label or "default"
        target = UpdateTarget(WeightVersion(1, label, "e0"),
                              WeightIdentity.declare(m, Provenance("c")), "test")
        ev = a.validate(target, live=False)
        assert ev is not None and ev.paused is True and ev.observed_label == label
        assert a._ops_verified == a.http.weight_ops()
        a.resume()
        assert a.observe_health().writes == ()
    finally:
        if a.http.is_paused():
            a.http.resume()
        a.close()
