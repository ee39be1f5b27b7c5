"""The gloo weight transport against real vLLM servers (CPU, tiny Llama).

The hot cycle: a server started on A receives B through vLLM's own
weight-transfer path (``rolloutcore_gloo``, registered by our plugin entry
point) and afterwards computes exactly what a server cold-started on B
computes: same greedy token ids, same logprobs, bit for bit, in the same
process. Then liveness: a send against a frozen engine returns promptly when
aborted from another thread (or at its deadline), and against a killed one
fails by itself, classified.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.gloo import GlooUpdateInfo
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

_rng = random.Random(7)
PROMPTS: list[list[int]] = [
    list(range(10, 40)),
    [1],
    [_rng.randrange(256) for _ in range(300)],  # longer than one 128-token KV block
]
Outputs = list[tuple[list[int], list[float], list[dict[str, Any]]]]


def generate(eng: ManagedEngine, prompts: list[list[int]] = PROMPTS,
             max_tokens: int = 16) -> Outputs:
    """Greedy token ids, their logprobs and the engine's version spans, per prompt."""
    out: Outputs = []
    for ids in prompts:
        r = httpx.post(f"{eng.base_url}/inference/v1/generate", timeout=120, json={
            "model": eng.model_name, "token_ids": ids,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True}})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]],
                    c["weight_versions"]))
    return out


def weight_label(eng: ManagedEngine) -> str:
    r = httpx.get(f"{eng.base_url}/weight_info", timeout=30)
    r.raise_for_status()
    return str(r.json()["weight_version"])


def post(eng: ManagedEngine, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{eng.base_url}{path}", json=body, timeout=60)


def hot_update(eng: ManagedEngine, tr: GlooTransport, src: WeightSource, label: str) -> Any:
    """The engine-side protocol around a send: pause(wait), send, reset prefix cache, resume."""
    assert post(eng, "/pause?mode=wait&clear_cache=false").status_code == 200
    try:
        ev = tr.send(eng.base_url, label, src, timeout_s=120)
        reset = post(eng, "/reset_prefix_cache")
        assert reset.status_code == 200 and reset.json().get("success") is True, reset.text
    finally:
        post(eng, "/resume")
    return ev


@pytest.fixture(scope="module")
def engines(engine_factory: EngineFactory, tiny_models: TinyModels
            ) -> Iterator[tuple[ManagedEngine, Outputs]]:
    """The hot server on A, and what a server cold-started on B computes.

    Both start at once; the cold one is stopped as soon as it has answered.
    """
    hot, cold = engine_factory.together(
        (tiny_models.A, {}),                # default backend: rolloutcore_gloo
        (tiny_models.B, {"backend": None}))
    try:
        try:
            reference = generate(cold)
        finally:
            engine_factory.stop(cold)
        yield hot, reference
    finally:
        engine_factory.stop(hot)


@pytest.fixture(scope="module")
def reference_b(engines: tuple[ManagedEngine, Outputs]) -> Outputs:
    return engines[1]


@pytest.fixture(scope="module")
def hot(engines: tuple[ManagedEngine, Outputs]) -> ManagedEngine:
    return engines[0]


@pytest.fixture()
def transport() -> Iterator[GlooTransport]:
    tr = GlooTransport(op_timeout_s=30)
    try:
        yield tr
    finally:
        tr.close()


def test_hot_cycle_equals_cold_start_bit_for_bit(
        hot: ManagedEngine, reference_b: Outputs, tiny_models: TinyModels,
        transport: GlooTransport) -> None:
    before = generate(hot)
    assert weight_label(hot) == "default"
    pid, epoch = hot.pid, hot.epoch
    src = WeightSource.from_checkpoint(tiny_models.B)

    transport.connect(hot.base_url, timeout_s=120)
    assert transport.connected_to == hot.base_url
    ev = hot_update(hot, transport, src, "rc-1")

    assert ev.completed and ev.mutation_started and ev.problems(None) == []
    assert ev.backend == "rolloutcore_gloo" and ev.finish_label == "rc-1"
    assert ev.tensors == len(src) == 21 and ev.bytes == src.nbytes
    assert weight_label(hot) == "rc-1"
    assert hot.alive() and hot.pid == pid and hot.epoch == epoch  # no restart
    after = generate(hot)
    assert [o[0] for o in before] != [o[0] for o in reference_b]  # A and B really differ
    for (ids, lps, spans), (ref_ids, ref_lps, _) in zip(after, reference_b, strict=True):
        assert ids == ref_ids
        assert lps == ref_lps  # exact float equality
        assert spans == [{"version": "rc-1", "start": 0, "end": len(ids)}]
    print(f"\nhot transfer of {ev.bytes} bytes in {ev.elapsed_s:.3f}s; "
          f"this engine's cold start took {hot.last_start_s:.1f}s")


def test_round_trip_back_to_a_restores_a_exactly(
        hot: ManagedEngine, tiny_models: TinyModels, transport: GlooTransport) -> None:
    """Send A, then B_neg, then A again: A's outputs come back bit for bit."""
    ev = hot_update(hot, transport, WeightSource.from_checkpoint(tiny_models.A), "rc-a")
    assert ev.finish_label == "rc-a" and weight_label(hot) == "rc-a"
    a_out = generate(hot)
    hot_update(hot, transport, WeightSource.from_checkpoint(tiny_models.B_neg), "rc-neg")
    neg_out = generate(hot)
    assert [o[0] for o in neg_out] != [o[0] for o in a_out]
    hot_update(hot, transport, WeightSource.from_checkpoint(tiny_models.A), "rc-a2")
    again = generate(hot)
    assert [o[:2] for o in again] == [o[:2] for o in a_out]


def test_preflight_refusal_touches_nothing(
        hot: ManagedEngine, tiny_models: TinyModels, transport: GlooTransport) -> None:
    label = weight_label(hot)
    src = WeightSource.from_checkpoint(tiny_models.B)
    with pytest.raises(TransferError, match="preflight") as ei:
        transport.send(hot.base_url, "rc-x", src, timeout_s=30,
                       expected_manifest_digest="0" * 64)
    assert ei.value.mutation_started is False
    with pytest.raises(BadInput):
        transport.send(hot.base_url, "has space", src, timeout_s=30)
    with pytest.raises(BadInput):
        transport.send(hot.base_url, "rc-x", src, timeout_s=0)
    assert weight_label(hot) == label


def test_engine_refuses_malformed_metadata_then_a_full_update_recovers(
        hot: ManagedEngine, tiny_models: TinyModels, reference_b: Outputs,
        transport: GlooTransport) -> None:
    """The engine half validates the update body before receiving a byte."""
    src = WeightSource.from_checkpoint(tiny_models.B)
    transport.connect(hot.base_url, timeout_s=120)
    info = GlooUpdateInfo.of(src)
    body = {"names": info.names, "dtype_names": info.dtype_names, "shapes": info.shapes,
            "manifest_digest": "f" * 64}
    assert post(hot, "/pause?mode=wait&clear_cache=false").status_code == 200
    try:
        assert post(hot, "/start_weight_update").status_code == 200
        r = post(hot, "/update_weights", {"update_info": body})
        assert r.status_code >= 400
        bad_dtype = dict(body, manifest_digest=None, dtype_names=["complex128"] * len(info.names))
        assert post(hot, "/start_weight_update").status_code == 200
        assert post(hot, "/update_weights", {"update_info": bad_dtype}).status_code >= 400
    finally:
        post(hot, "/resume")
    # The group was never used by those rounds: the same connection still works.
    hot_update(hot, transport, src, "rc-2")
    assert weight_label(hot) == "rc-2"
    assert [o[:2] for o in generate(hot)] == [o[:2] for o in reference_b]


def _send_in_thread(tr: GlooTransport, eng: ManagedEngine, src: WeightSource,
                    timeout_s: float) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            box["result"] = tr.send(eng.base_url, "rc-9", src, timeout_s=timeout_s)
        except BaseException as exc:
            box["error"] = exc
        box["t"] = time.monotonic()
        box["elapsed"] = box["t"] - t0

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, box


@pytest.mark.slow  # a hung engine and a killed one (1 min): the slow lane
def test_abort_unblocks_a_send_to_a_hung_engine_and_a_killed_one_fails_fast(
        engine_factory: EngineFactory, tiny_models: TinyModels) -> None:
    victim = engine_factory(tiny_models.A)
    src = WeightSource.from_checkpoint(tiny_models.B)
    tr = GlooTransport(op_timeout_s=30)
    try:
        tr.connect(victim.base_url, timeout_s=120)
        victim.signal_group(signal.SIGSTOP)  # hung: accepts connections, answers nothing

        # 1. No abort: the deadline bounds the send.
        th, box = _send_in_thread(tr, victim, src, timeout_s=2.0)
        th.join(15)
        assert not th.is_alive()
        assert isinstance(box.get("error"), TransferError), box
        assert "deadline" in str(box["error"]) and box["elapsed"] < 6

        # 2. A long deadline, aborted from another thread after 1 s.
        th, box = _send_in_thread(tr, victim, src, timeout_s=300.0)
        time.sleep(1.0)
        t_abort = time.monotonic()
        tr.abort()
        th.join(15)
        assert not th.is_alive()
        err = box.get("error")
        assert isinstance(err, TransferError), box
        assert "aborted" in str(err)
        # /start_weight_update may have reached the engine: not provably untouched.
        assert err.mutation_started is True
        assert box["t"] - t_abort < 3.0
        assert tr.connected_to is None  # the group was torn down

        # 3. Killed engine: the send fails by itself, before any mutation.
        os.killpg(victim.pid, signal.SIGKILL)
        th, box = _send_in_thread(tr, victim, src, timeout_s=60.0)
        th.join(15)
        assert not th.is_alive()
        err = box.get("error")
        assert isinstance(err, TransferError), box
        assert err.mutation_started is False and box["elapsed"] < 5
    finally:
        tr.close()
        engine_factory.stop(victim)


def test_plugin_registers_idempotently_and_refuses_a_conflict() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from rolloutcore.transports import registry, vllm_plugin
    from rolloutcore.transports.cuda_ipc import engine as cuda_ipc_engine

    vllm_plugin.register()
    vllm_plugin.register()  # every vLLM process may call it more than once
    cuda_ipc_engine.register()  # the older entry point: the same registration
    cls = WeightTransferEngineFactory._registry["rolloutcore_gloo"]()
    assert cls.__name__ == "GlooWeightTransferEngine"
    assert cls.__module__ == "rolloutcore.transports.gloo"
    ipc = WeightTransferEngineFactory._registry["rc_cuda_ipc"]()
    assert ipc is cuda_ipc_engine.CudaIpcWeightTransferEngine
    # A process that lost its record of installing (a re-imported registry) finds
    # its own loaders in vLLM's factory: a no-op.
    registry._installed.clear()
    vllm_plugin.register()
    # A RolloutCore backend under a name vLLM's own engine holds: refused, naming both.
    rogue = registry.BackendRegistry("weight transfer engine")
    rogue.register("nccl", "rolloutcore.transports.gloo", "GlooWeightTransferEngine")
    with pytest.raises(registry.BackendConflict, match="already registered"):
        registry.install_into_vllm(registry=rogue)
    assert WeightTransferEngineFactory._registry["nccl"]().__name__ == "NCCLWeightTransferEngine"
