"""vLLM's own RL routes through ``rolloutcore serve --native-routes`` on a real CPU vLLM.

The trainer is RolloutCore's gloo sender (the CPU stand-in for vLLM's nccl
and ipc trainer engines), unmodified: it posts vLLM's route sequence
(``/get_world_size``, ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights`` beside the broadcast,
``/finish_weight_update``) to the base URL it is given, here the gateway's
``/rc/<token>``. A -> B is published under the gateway's label (the label
the sender asked for is replaced), generation through the gateway is
labelled by vLLM's own spans with it; TRL AsyncGRPO's sequence (pause keep,
the round, resume) publishes at ``/resume``; then a round that skips a tensor is
refused at finish with a 4xx, TAINTED, nothing published.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, NativeGateway, TinyModels
from rolloutcore.engine.process import vllm_available
from rolloutcore.errors import RolloutCoreError
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "engine-test-token-0123456789abcdef"
NATIVE = "native-engine-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def native(engine_factory: EngineFactory, tiny_models: TinyModels,
           native_gateway: NativeGateway, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Any, TinyModels, Path]]:
    work = tmp_path_factory.mktemp("native")
    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo")
    try:
        with native_gateway(eng, tiny_models.A, work, TOKEN, NATIVE,
                            ["--journal", str(work / "journal.jsonl")]) as url:
            yield url, eng, tiny_models, work / "journal.jsonl"
    finally:
        engine_factory.stop(eng)


def _status(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/control/status", headers=AUTH, timeout=30).json())


def test_an_unmodified_sender_updates_through_the_gateway_by_base_url(
        native: tuple[str, Any, TinyModels, Path]) -> None:
    url, eng, models, journal = native
    base = f"{url}/rc/{NATIVE}"
    before = _status(url)["committed"]
    tr = GlooTransport()
    tr.send(base, "trainer-label", WeightSource.from_checkpoint(models.B), timeout_s=300)
    st = _status(url)
    label = st["committed"]["label"]
    assert st["state"] == "READY" and label != before["label"]
    assert label not in ("default", "trainer-label")
    # the engine itself holds the gateway's label, and the native route says so
    assert httpx.get(f"{eng.base_url}/weight_info", timeout=30).json() == {
        "weight_version": label}
    assert httpx.get(f"{base}/weight_info", timeout=30).json() == {"weight_version": label}
    # the round reset the prefix cache, checked by its body; this text-only model has no
    # encoder or multimodal cache (vLLM's own config says so): their evidence says why,
    # and nothing was sent for them
    resets = {r["data"]["evidence"]["cache"]: r["data"]["evidence"] for r in map(
        json.loads, journal.read_text().splitlines())
        if r["kind"] == "evidence" and r["data"].get("event") == "invalidated"}
    assert resets["prefix"]["http_status"] == 200 and resets["prefix"]["engine_success"]
    assert not resets["prefix"]["absent"]
    for kind in ("encoder", "multimodal"):
        assert resets[kind]["http_status"] is None
        assert "multimodal_config is null" in resets[kind]["absent"]
    # TRL server mode resets the prefix cache after the finish: relayed, vLLM's body
    reset = httpx.post(f"{base}/reset_prefix_cache", timeout=60)
    assert reset.status_code == 200 and reset.json() == {"success": True}, reset.text
    # generation through the gateway: vLLM's own spans name the assigned version
    g = httpx.post(f"{url}/inference/v1/generate", timeout=120, json={
        "model": "policy", "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}})
    assert g.status_code == 200, g.text
    spans = g.json()["choices"][0]["weight_versions"]
    assert spans and {s["version"] for s in spans} == {label}

    # TRL AsyncGRPO's sequence: /pause?mode=keep, the round, /resume publishes
    p = httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=120)
    assert p.status_code == 200 and p.json() == {"status": "paused"}
    assert httpx.get(f"{base}/is_paused", timeout=30).json() == {"is_paused": True}
    tr.send(base, "trainer-label", WeightSource.from_checkpoint(models.A), timeout_s=300)
    assert _status(url)["committed"]["label"] == label  # not before /resume
    r = httpx.post(f"{base}/resume", timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "resumed"}, r.text
    st = _status(url)
    label2 = st["committed"]["label"]
    assert st["state"] == "READY" and label2 not in (label, "default", "trainer-label")
    assert httpx.get(f"{eng.base_url}/weight_info", timeout=30).json() == {
        "weight_version": label2}

    # a round that skips one tensor: refused at finish (4xx), TAINTED, nothing published
    from safetensors.torch import load_file

    state = load_file(str(Path(models.B) / "model.safetensors"))
    state.pop(sorted(state)[0])
    with pytest.raises(RolloutCoreError) as info:
        tr.send(base, "x", WeightSource.from_state_dict(state), timeout_s=300)
    assert "not written" in str(info.value) or "409" in str(info.value)
    after = _status(url)
    assert after["state"] == "TAINTED" and after["committed"] == st["committed"]
    # a replayed finish: 409, no state change
    r = httpx.post(f"{base}/finish_weight_update", json={}, timeout=30)
    assert r.status_code == 409 and _status(url)["state"] == "TAINTED"
