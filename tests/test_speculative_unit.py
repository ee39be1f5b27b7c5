"""An engine whose draft holds weights takes no target-only update, at any entry point.

An engine started with ``--speculative-config`` names its method in
``/server_info``. Where the draft has weights (draft model, EAGLE, MTP...), a
target-only update leaves it on the old policy: no output token shows it,
acceptance falls to about 0. Each entry point refuses one before anything
changes: the in-process session (before the drain), the adapter's preflight
(the fleet's replicas and any runner), the gateway's begin (before the drain),
the fleet's update. A pair of target and draft goes through a drafted
transport only. The real engine's ``/server_info`` is read in
``tests/engine/test_eagle_engine.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fleettools import fake_fleet, weights
from helpers.gateway_rig import AUTH, begin_body, rig
from helpers.vllm_fake import answer, vllm
from rolloutcore.core.evidence import UpdateTarget
from rolloutcore.core.lifecycle import State
from rolloutcore.core.speculative import (
    WEIGHTLESS_METHODS,
    engine_draft,
    engine_draft_of,
    engine_draft_refusal,
)
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.errors import BadInput, UpdateRefused
from rolloutcore.session import EngineSession
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.transports.drafted import DraftedGlooTransport, DraftedSource, refusal
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

DEAD = "http://127.0.0.1:9"  # discard port: nothing answers
EAGLE = {"speculative_config": {"method": "eagle", "model": "/heads/E",
                                "num_speculative_tokens": 3}}


def _src(seed: int, n: int = 3) -> WeightSource:
    g = torch.Generator().manual_seed(seed)
    return WeightSource.from_state_dict({f"w{i}": torch.randn(4, 2, generator=g)
                                         for i in range(n)})


# --------------------------------------------------------------------------- parsing

@pytest.mark.parametrize(("cfg", "want"), [
    (None, None), ("text", None), ({}, None), ({"speculative_config": None}, None),
    ({"speculative_config": {}}, None),
    *[({"speculative_config": {"method": m}}, None) for m in sorted(WEIGHTLESS_METHODS)],
    (EAGLE, "eagle"),
    ({"speculative_config": {"method": "draft_model", "model": "/d"}}, "draft_model"),
    ({"speculative_config": {"method": "eagle3"}}, "eagle3"),
    ({"speculative_config": {"method": "deepseek_mtp"}}, "deepseek_mtp"),
    # Present but unreadable: taken as a draft (the safe side).
    ({"speculative_config": {"model": "/d"}}, "unknown"),
    ({"speculative_config": {"method": 7}}, "unknown"),
    ({"speculative_config": "SpeculativeConfig(method='eagle')"}, "unknown"),
])
def test_which_engine_configs_name_a_draft_with_weights(cfg: Any, want: str | None) -> None:
    assert engine_draft(cfg) == want


def test_an_adapter_names_its_draft_only_as_a_non_empty_string() -> None:
    class A:
        draft_method: Any = None

    a = A()
    for bad in (None, "", 3, b"eagle"):
        a.draft_method = bad
        assert engine_draft_of(a) is None
    a.draft_method = "eagle"
    assert engine_draft_of(a) == "eagle"
    assert engine_draft_of(object()) is None
    assert "method eagle" in engine_draft_refusal("eagle")
    assert "trainer protocol" in engine_draft_refusal("eagle", remote=True)


def test_refusal_follows_the_engines_draft_whatever_the_transport() -> None:
    plain = _src(1)
    pair = DraftedSource(_src(1), _src(2, n=2))
    for tr in (GlooTransport(), DraftedGlooTransport(require_draft=False), object()):
        why = refusal(tr, plain, "eagle")
        assert why is not None and "method eagle" in why
        assert refusal(tr, plain, None) is None
    assert refusal(DraftedGlooTransport(), pair, "eagle") is None
    assert refusal(DraftedGlooTransport(require_draft=False), pair, "eagle") is None
    # A pair through a transport that would send the target's tensors only.
    for tr in (GlooTransport(), object()):
        why = refusal(tr, pair, None)
        assert why is not None and "DraftedGlooTransport" in why


# --------------------------------------------------------------------------- adapter

def drafted_engine(vllm_config: dict[str, Any]) -> FakeVllm:
    """The one fake of vLLM serving the routes ``VllmAdapter.bootstrap`` reads, as 0.32,
    from an engine decoding with a draft (its ``/server_info`` carries ``vllm_config``)."""
    return vllm(version="0.32.0", only=(Routes.HEALTH, Routes.VERSION, Routes.SERVER_INFO,
                                        Routes.MODELS), overrides={
        Routes.SERVER_INFO: answer(200, {"vllm_config": {
            "instance_id": "i-1", "model_config": {}, **vllm_config}})})


def _target() -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, "rc-1", "e0"), WeightIdentity.declare(m, Provenance("c")),
                        "test")


@pytest.mark.parametrize(("cfg", "method"), [(EAGLE, "eagle"), ({}, None)])
def test_the_adapter_reads_the_draft_and_its_preflight_refuses_a_target_only_source(
        cfg: dict[str, Any], method: str | None) -> None:
    e = drafted_engine(cfg)
    a = VllmAdapter(VllmHTTP("http://engine.test", transport=e.transport()))
    ev = a.bootstrap()
    assert a.draft_method == method and ev.engine_info["speculative_method"] == method
    t = _target()
    a.stage(_src(1))
    problems = a.preflight(t).problems(t)
    assert any("method eagle" in p for p in problems) == (method is not None), problems
    a.stage(DraftedSource(_src(1), _src(2, n=2)))
    assert not any("decodes speculatively" in p for p in a.preflight(t).problems(t))
    assert [p for m, p in e.received if m == "POST"] == []  # read, never written


# --------------------------------------------------------------------------- session

@pytest.fixture
def dead_session(tmp_path: Path) -> Iterator[EngineSession]:
    s = EngineSession(VllmHTTP(DEAD, timeout_s=2.0), GlooTransport(), engine_epoch="e1",
                      journal_path=tmp_path / "j.jsonl")
    try:
        yield s
    finally:
        s.http.close()
        s.journal.close()


def test_a_session_refuses_a_target_only_update_of_a_drafted_engine_before_any_io(
        dead_session: EngineSession) -> None:
    s = dead_session
    s.vllm.draft_method = "eagle"   # as its bootstrap read it from the engine
    state = s.controller.state
    with pytest.raises(UpdateRefused, match="method eagle"):
        s.update(_src(1), Provenance("ckpt", "run", 1), probe=False)
    # A pair through this plain transport would send the target only: refused too.
    s.vllm.draft_method = None
    with pytest.raises(UpdateRefused, match="DraftedGlooTransport"):
        s.update(DraftedSource(_src(1), _src(2, n=2)), Provenance("ckpt", "run", 1),
                 probe=False)
    assert s.controller.state is state and s.controller.committed is None
    assert s.transport.connected_to is None


# --------------------------------------------------------------------------- gateway

@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_gateway_refuses_a_begin_for_a_drafted_engine_before_the_drain(
        anyio_backend: str) -> None:
    async with rig() as r:
        r.engine.draft = "eagle"
        r.adapter.bootstrap()   # the adapter reads the engine's draft
        before = (r.controller.snapshot(), len(r.journal.records), r.engine.weight_ops)
        w = FakeWeights.from_seed(1, step=1)
        resp = await r.client.post("/control/updates", json=begin_body(w), headers=AUTH)
        assert resp.status_code == 409, resp.text
        assert "method eagle" in resp.json()["error"]
        assert "trainer protocol" in resp.json()["error"]
        assert (r.controller.snapshot(), len(r.journal.records), r.engine.weight_ops) == before
        assert not r.engine.paused and r.controller.state is State.READY
        assert r.gateway.updates.open_update is None
        # The engine serves on.
        gen = await r.client.post("/inference/v1/generate", json={
            "model": "policy", "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 2, "temperature": 0}})
        assert gen.status_code == 200, gen.text


# --------------------------------------------------------------------------- fleet

def test_a_fleet_with_a_drafted_replica_refuses_its_update_before_anything_changes() -> None:
    def draft_one(adapters: dict[str, FakeAdapter]) -> None:
        adapters["r1"].engine.draft = "draft_model"

    f = fake_fleet(2, before_bootstrap=draft_one)
    try:
        before = {n: (a.engine.weight_ops, a.engine.paused, a.engine.label)
                  for n, a in f.adapters.items()}
        records = len(f.coord.journal.records)
        with pytest.raises(UpdateRefused, match=r"replica r1: .*method draft_model"):
            f.coord.update(weights(1))
        assert {n: (a.engine.weight_ops, a.engine.paused, a.engine.label)
                for n, a in f.adapters.items()} == before
        assert len(f.coord.journal.records) == records
        assert f.coord.serving() == ["r0", "r1"]
    finally:
        f.coord.close()


def test_a_fake_engine_takes_a_draft_name_or_none() -> None:
    w = FakeWeights.from_seed(0)
    for bad in ("", 3, b"x"):
        with pytest.raises(BadInput):
            FakeEngine(w, draft=bad)  # type: ignore[arg-type]
    assert FakeEngine(w).draft is None and FakeEngine(w, draft="eagle").draft == "eagle"
