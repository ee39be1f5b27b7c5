"""What one engine's native rounds must prove on a real CPU vLLM, beside the route test.

1. After A -> B through ``/rc/<token>`` (the unmodified gloo sender, by base URL),
   greedy ids and logprobs through the gateway and from the engine equal those of a
   cold engine started on B (started beside the first one, and stopped as soon as it
   has answered, before anything is sent).
2. vLLM's own trainer-side control plane, unmodified: ``WeightTransferTrainerFactory``
   with the ``rolloutcore_gloo`` trainer engine registered through its public
   ``register_engine`` (``transports.vllm_trainer``), ``HTTPVLLMWeightSyncClient``
   with the gateway's base URL: B published under the gateway's label, vLLM's
   spans name it, greedy equal to the cold engine (after a round to A that
   changed them).
3. A trainer killed mid-broadcast (a second process, SIGKILLed while
   ``/update_weights`` runs: it stops after half the tensors so the kill lands inside
   the broadcast) ends the round TAINTED within a bounded time, with a 4xx/504 and
   nothing published; the gateway leaves the engine paused; the engine itself is not
   wedged: a fresh round sent to it directly installs B again, and once resumed it
   computes B bit-exact with the cold engine (an operator's in-place recovery).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleettools_engine import greedy

from enginetools import EngineFactory, NativeGateway, TinyModels
from rolloutcore.engine.process import vllm_available
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "proofs-test-token-0123456789abcdef"
NATIVE = "proofs-native-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}

#: The trainer that is killed: the unmodified sender, except that its broadcast stops
#: (sleeps) after half the tensors and says so in a file, so the kill lands mid-broadcast.
HALF_SENDER = r"""
import pathlib, sys, time
from rolloutcore.transports.gloo import GlooTransport, _as_cpu
from rolloutcore.transports.source import WeightSource
base, ckpt, flag = sys.argv[1:4]
def half(self, conn, source):
    items = list(source.named_tensors())
    for i, (name, t) in enumerate(items):
        if i == len(items) // 2:
            pathlib.Path(flag).write_text(str(i))
            time.sleep(3600)
        conn.group.broadcast(_as_cpu(t), 0).wait()
GlooTransport._broadcast = half
GlooTransport(op_timeout_s=60).send(base, "x", WeightSource.from_checkpoint(ckpt),
                                    timeout_s=600)
"""


@pytest.fixture(scope="module")
def proofs(engine_factory: EngineFactory, tiny_models: TinyModels,
           native_gateway: NativeGateway, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, Any, Any]]:
    """The gateway (with native routes) in front of an engine on A, and what an engine
    cold-started on B computes. The two engines start at once; the cold one is stopped
    as soon as it has answered, before the gateway starts."""
    work = tmp_path_factory.mktemp("proofs")
    eng, cold = engine_factory.together((tiny_models.A, {"backend": "rolloutcore_gloo"}),
                                        (tiny_models.B, {"backend": None}))
    try:
        try:
            reference = greedy(cold.base_url)
        finally:
            engine_factory.stop(cold)
        with native_gateway(eng, tiny_models.A, work, TOKEN, NATIVE,
                            ["--lease-s", "120"]) as url:
            yield url, eng, reference
    finally:
        engine_factory.stop(eng)


@pytest.fixture(scope="module")
def ref_b(proofs: tuple[str, Any, Any]) -> Any:
    return proofs[2]


@pytest.fixture(scope="module")
def gateway(proofs: tuple[str, Any, Any]) -> tuple[str, Any]:
    return proofs[0], proofs[1]


def _status(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/control/status", headers=AUTH, timeout=30).json())


def test_a_to_b_through_the_gateway_equals_a_cold_engine_on_b(
        gateway: tuple[str, Any], tiny_models: TinyModels, ref_b: Any) -> None:
    url, eng = gateway
    tr = GlooTransport()
    try:
        tr.send(f"{url}/rc/{NATIVE}", "t", WeightSource.from_checkpoint(tiny_models.B),
                timeout_s=300)
    finally:
        tr.close()
    assert _status(url)["state"] == "READY"
    assert greedy(eng.base_url) == ref_b
    assert greedy(url) == ref_b       # through the gateway's data plane


def test_vllms_own_trainer_control_plane_unmodified_through_the_gateway(
        gateway: tuple[str, Any], tiny_models: TinyModels, ref_b: Any) -> None:
    """vLLM's ``WeightTransferTrainerFactory`` with the ``rolloutcore_gloo`` trainer
    engine registered through its public ``register_engine``, and vLLM's
    ``HTTPVLLMWeightSyncClient(base_url=<the gateway>)`` driving the round."""
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from rolloutcore.transports import vllm_trainer

    class StateSource(WeightSource):
        def __init__(self, sd: dict[str, torch.Tensor]) -> None:
            self.sd = sd

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.sd.items()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            return iter(self.sd.items())

    url, eng = gateway
    base = f"{url}/rc/{NATIVE}"
    before = _status(url)["committed"]
    vllm_trainer.register()
    ws = httpx.get(f"{base}/get_world_size", timeout=30).json()["world_size"]
    src = StateSource(load_file(str(Path(tiny_models.A) / "model.safetensors")))
    engine = WeightTransferTrainerFactory.trainer_init(
        vllm_trainer.trainer_init_info(world_size=1 + ws),
        client=HTTPVLLMWeightSyncClient(base_url=base), source=src)
    try:
        engine.send_weights()            # B -> A: the weights change
        label_a = _status(url)["committed"]["label"]
        assert label_a != before["label"] and greedy(url) != ref_b
        src.sd = load_file(str(Path(tiny_models.B) / "model.safetensors"))
        engine.send_weights()            # A -> B, the same trainer engine's second round
    finally:
        engine.shutdown()
    st = _status(url)
    label = st["committed"]["label"]
    assert st["state"] == "READY" and label not in (label_a, "default"), st
    assert httpx.get(f"{eng.base_url}/weight_info", timeout=30).json() == {
        "weight_version": label}
    assert greedy(url) == ref_b
    g = httpx.post(f"{url}/inference/v1/generate", timeout=120, json={
        "model": "policy", "token_ids": [5, 6, 7],
        "sampling_params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}})
    assert {s["version"] for s in g.json()["choices"][0]["weight_versions"]} == {label}


def test_a_trainer_killed_mid_broadcast_taints_in_bounded_time(
        gateway: tuple[str, Any], tiny_models: TinyModels, ref_b: Any,
        tmp_path: Path) -> None:
    url, eng = gateway
    before = _status(url)["committed"]
    flag, out = tmp_path / "half", tmp_path / "sender.log"
    with open(out, "wb") as lf:
        proc = subprocess.Popen(
            [sys.executable, "-c", HALF_SENDER, f"{url}/rc/{NATIVE}", str(tiny_models.A),
             str(flag)], env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            stdout=lf, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not flag.exists():
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert _status(url)["state"] == "UPDATING"
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    while _status(url)["state"] != "TAINTED":
        assert time.monotonic() - t_kill < 150, _status(url)
        time.sleep(0.2)
    tainted_s = time.monotonic() - t_kill
    st = _status(url)
    assert st["committed"] == before, st
    print(f"TAINTED {tainted_s:.1f}s after the trainer was killed")
    # the gateway left the TAINTED engine paused (it serves nothing) ...
    assert httpx.get(f"{eng.base_url}/is_paused", timeout=30).json() == {"is_paused": True}
    # ... and the engine is not wedged: it answers, a fresh round sent to it directly
    # installs B again, and once resumed it computes B bit-exact with the cold engine
    assert httpx.get(f"{eng.base_url}/health", timeout=30).status_code == 200
    tr = GlooTransport()
    try:
        tr.send(eng.base_url, "recovered", WeightSource.from_checkpoint(tiny_models.B),
                timeout_s=300)
    finally:
        tr.close()
    assert httpx.post(f"{eng.base_url}/resume", timeout=60).status_code == 200
    assert greedy(eng.base_url) == ref_b
