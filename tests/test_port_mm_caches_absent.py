"""An engine whose own config says it has no encoder and no multimodal cache (a model that
takes no multimodal input: vLLM's ``model_config.multimodal_config`` is null) is sent the
prefix reset only; the other two caches' evidence says why they are absent, and the
controller accepts that for them and for nothing else. An engine that does not say so
(the key missing, a multimodal config, an encoder-cache connector) is sent every reset.

The engine is the one fake of vLLM as ``test_port_close_reads`` has it (saying 0.32,
through httpx's mock transport), its ``/server_info`` overridden with each config; the
real engine is ``tests/engine/test_native_routes_engine.py`` (a text-only model: one reset
a round).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from rolloutcore.core.evidence import (
    CacheKind,
    CacheResetEvidence,
    PauseMode,
    evidence_from_dict,
    evidence_to_dict,
)
from rolloutcore.engine.routes import Routes
from rolloutcore.testing import FakeVllm
from test_port_close_reads import _adapter, _engine, _paths, _target, _write

_MISSING = object()


def _described(vllm_config: dict[str, Any]) -> FakeVllm:
    """The one fake (``test_port_close_reads``'s, saying 0.32) whose ``/server_info``
    gives ``vllm_config`` (``describe`` changes it later)."""
    fake = _engine()
    describe(fake, vllm_config)
    return fake


def describe(fake: FakeVllm, vllm_config: dict[str, Any]) -> None:
    fake.override(Routes.SERVER_INFO, lambda request: httpx.Response(
        200, content=json.dumps({"vllm_config": vllm_config})))


def _config(mm: Any = None, **more: Any) -> dict[str, Any]:
    mc: dict[str, Any] = {"enable_sleep_mode": False}
    if mm is not _MISSING:
        mc["multimodal_config"] = mm
    return {"model_config": mc, "instance_id": "i-1", **more}


def _close(eng: FakeVllm) -> list[CacheResetEvidence]:
    """An update's close as the runner drives it: drain, a write, each cache's reset."""
    a = _adapter(eng)
    assert a.bootstrap().engine_info["mm_caches_absent"] == a._mm_absent
    a.drain(PauseMode.WAIT)
    _write(eng)
    out = [a.reset_cache(k) for k in (CacheKind.PREFIX, CacheKind.ENCODER,
                                      CacheKind.MULTIMODAL)]
    a.validate(_target(), live=False)
    a.resume()
    return out


def test_a_text_only_engine_is_sent_the_prefix_reset_only() -> None:
    eng = _described(_config(None))
    prefix, enc, mm = _close(eng)
    resets = [p for p in _paths(eng) if p.startswith("/reset")]
    assert resets == [Routes.RESET_PREFIX]
    assert prefix.engine_success is True and not prefix.absent
    for ev in (enc, mm):
        assert ev.http_status is None and ev.engine_success is None
        assert "multimodal_config is null" in ev.absent
        assert ev.problems(None) == []  # the controller's check: accepted as absent
    # the validation's counters were still read, from the first reset on
    assert Routes.METRICS in _paths(eng)


@pytest.mark.parametrize("config", [
    _config({"limit_per_prompt": {"image": 1}}),       # a multimodal model
    _config(_MISSING),                                   # the engine does not say
    _config(None, ec_transfer_config={"ec_connector": "x"}),  # an encoder-cache connector
], ids=["multimodal", "not-said", "ec-connector"])
def test_an_engine_that_may_hold_them_is_sent_every_reset(config: dict[str, Any]) -> None:
    eng = _described(config)
    evs = _close(eng)
    assert sorted(p for p in _paths(eng) if p.startswith("/reset")) == sorted(
        [Routes.RESET_PREFIX, Routes.RESET_ENCODER, Routes.RESET_MM])
    assert all(ev.http_status == 200 and not ev.absent for ev in evs)


def test_an_engine_replaced_by_a_multimodal_one_is_reset_again_after_its_bootstrap() -> None:
    eng = _described(_config(None))
    a = _adapter(eng)
    assert a._absent(CacheKind.ENCODER)
    describe(eng, _config({"limit_per_prompt": {"image": 1}}))
    a.bootstrap()
    assert a._absent(CacheKind.ENCODER) == "" and a._absent(CacheKind.MULTIMODAL) == ""


def test_absent_is_accepted_only_for_a_cache_that_was_not_reset_and_never_the_prefix() -> None:
    why = "the model takes no multimodal input"
    assert CacheResetEvidence(CacheKind.ENCODER, None, None, absent=why).problems(None) == []
    # the prefix cache always exists: "absent" is no evidence for it
    assert CacheResetEvidence(CacheKind.PREFIX, None, None, absent=why).problems(None)
    # a reset that was answered is judged by its answer, not excused by "absent"
    assert CacheResetEvidence(CacheKind.MULTIMODAL, 200, False, absent=why).problems(None)
    # without a reason, a reset that was not sent is a failure, as before
    assert CacheResetEvidence(CacheKind.ENCODER, None, None).problems(None)
    # the journal keeps the reason: a restore decodes the same evidence
    ev = CacheResetEvidence(CacheKind.MULTIMODAL, None, None, absent=why)
    assert evidence_from_dict(evidence_to_dict(ev)) == ev
