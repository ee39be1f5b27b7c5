"""Tied input/output embeddings: a hot update equals a cold start, bit for bit.

A tied model's ``lm_head.weight`` is ``model.embed_tokens.weight``; its
checkpoint names only the embedding. On vLLM's CPU backend the output
projection multiplies by a copy of that matrix made at load time whenever the
host has a packed GEMM path for the dtype (``derived``'s docstring lists
them), and vLLM's layerwise reload never rebuilds it for the tied head. The
float32 case takes the oneDNN path on any x86 host whose vLLM build has it
(this AMD AVX2 host included: without the fix the hot engine keeps serving
A's output projection); bfloat16 takes it on AVX-512 / AMX hosts and plain
``F.linear`` elsewhere. Either way the hot engine must compute what an engine
cold-started on B computes: greedy ids and logprobs equal as floats.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.testing.models import make_pair
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

_rng = random.Random(11)
PROMPTS: list[list[int]] = [list(range(10, 40)), [1],
                            [_rng.randrange(256) for _ in range(200)]]
Outputs = list[tuple[list[int], list[float]]]


def generate(eng: ManagedEngine) -> Outputs:
    out: Outputs = []
    for ids in PROMPTS:
        r = httpx.post(f"{eng.base_url}/inference/v1/generate", timeout=120, json={
            "model": eng.model_name, "token_ids": ids,
            "sampling_params": {"max_tokens": 12, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True}})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]]))
    return out


def post(eng: ManagedEngine, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{eng.base_url}{path}", json=body, timeout=60)


@pytest.fixture(scope="module")
def tied(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pair(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


# float32 is where the tied-embedding defect shows on this host. Both in the slow lane
# since #30 (float32: 4-6 min of CI's 45): benchmarks/probe_tolerance.py updates a tied
# Qwen3 hot and compares it with a cold start, tests/test_tied_checkpoint.py is the CI
# lane's tied case.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tied_model_hot_update_equals_cold_start(
        engine_factory: EngineFactory, tied: tuple[Path, Path], dtype: str) -> None:
    a, b = tied
    src = WeightSource.from_checkpoint(b)
    assert "lm_head.weight" not in src.manifest().names()  # saved tied, as HF does
    cold = engine_factory(b, backend=None, dtype=dtype)
    try:
        reference = generate(cold)
    finally:
        engine_factory.stop(cold)

    hot = engine_factory(a, dtype=dtype)
    tr = GlooTransport(op_timeout_s=60)
    try:
        before = generate(hot)
        assert [o[0] for o in before] != [o[0] for o in reference]  # A and B really differ
        assert post(hot, "/pause?mode=wait&clear_cache=false").status_code == 200
        try:
            ev = tr.send(hot.base_url, "rc-1", src, timeout_s=120)
            assert post(hot, "/reset_prefix_cache").status_code == 200
        finally:
            post(hot, "/resume")
        assert ev.completed and ev.tensors == len(src)
        assert httpx.get(f"{hot.base_url}/weight_info", timeout=30).json()[
            "weight_version"] == "rc-1"
        after = generate(hot)
        for (ids, lps), (ref_ids, ref_lps) in zip(after, reference, strict=True):
            assert ids == ref_ids
            assert lps == ref_lps  # exact float equality
    finally:
        tr.close()
        engine_factory.stop(hot)
