"""A real vLLM (CPU build) decoding with an EAGLE-1 head: the head and its target as one version.

The engine serves the tiny target and drafts with a head made offline
(``make_eagle_head``: vLLM's ``EagleLlamaForCausalLM``, ``fc`` and one decoder
layer, the target's embedding and output projection borrowed). A head's
checkpoint names are not its parameters' names (its loader moves them under
``model.``); the receiver places them as that loader will, so a head round is
checked before the reload opens: a name the loader would fail on (which,
with the reload open, killed the engine core) and a name landing on what
the head borrows from the target are refused, and the engine serves on.

One engine start serves the CI cases, in order: the update (a random head on A
replaced by a "repeat" head on B, whose drafts the target accepts wherever
it repeats a token), the refusals, then a head round that puts the old head
on the wire (caught by the workers' checksums; it taints the engine). The
slow lane adds a tensor-parallel engine (2 ranks), each rank's share of the
head checked.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from drafttools_engine import FaultyDraftTransport, assert_one_version, drafted_session, prov
from safetensors.torch import load_file

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.vocab import State
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.errors import TransferError, UpdateFailed, UpdateRefused
from rolloutcore.session import DraftedSession, DraftSpec
from rolloutcore.testing.models import make_eagle_head
from rolloutcore.transports.drafted import policy_digest
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

RUN = "eagle-engine-test"
Heads = dict[str, Path]


@pytest.fixture(scope="module")
def heads(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Heads:
    root = tmp_path_factory.mktemp("eagle-heads")
    return {"random_A": make_eagle_head(root / "random_A", 5, target=tiny_models.A),
            "repeat_B": make_eagle_head(root / "repeat_B", 6, target=tiny_models.B,
                                        kind="repeat"),
            "repeat_B2": make_eagle_head(root / "repeat_B2", 7, target=tiny_models.B,
                                         kind="repeat")}


@pytest.fixture(scope="module")
def eagle(engine_factory: EngineFactory, tiny_models: TinyModels, heads: Heads,
          tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[DraftedSession, FaultyDraftTransport, ManagedEngine]]:
    a = tiny_models.A
    spec = DraftSpec(heads["random_A"], method="eagle")
    eng = engine_factory(a, extra_args=spec.engine_args())
    ds, tr = drafted_session(eng, tmp_path_factory.mktemp("eagle-journal") / "j.jsonl",
                             min_acceptance=None)
    try:
        ds.bootstrap(a, heads["random_A"])
        yield ds, tr, eng
    finally:
        ds.close()
        engine_factory.stop(eng)


def _greedy(eng: ManagedEngine) -> list[int]:
    r = httpx.post(f"{eng.base_url}/inference/v1/generate", timeout=120, json={
        "model": eng.model_name, "token_ids": list(range(10, 40)),
        "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return list(r.json()["choices"][0]["token_ids"])


def test_an_eagle_head_and_its_target_are_published_as_one_version(
        eagle: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels, heads: Heads) -> None:
    ds, tr, eng = eagle
    b, head = tiny_models.B, heads["repeat_B"]
    r = ds.update(b, prov(1, RUN), draft_weights=head)
    src_b, src_h = WeightSource.from_checkpoint(b), WeightSource.from_checkpoint(head)
    want = policy_digest(src_b.content_digest(), src_h.content_digest(),
                         src_h.manifest().digest)
    assert_one_version(ds, tr, eng, r, want)
    # The random head on A is accepted about never; the repeat head on B wherever B
    # repeats a token (a fifth of its drafts, measured): the drafting follows the head.
    before, after = r.acceptance_before, r.acceptance_after
    assert before is not None and after is not None
    assert before.drafted > 0 and after.drafted > 0
    assert (after.rate or 0.0) >= 0.1 > (before.rate or 0.0), (before, after)


def _head_with(head: Path, **extra: Any) -> dict[str, Any]:
    tensors: dict[str, Any] = dict(load_file(str(head / "model.safetensors")))
    tensors.update(extra)
    return tensors


@pytest.mark.parametrize("case", ["borrowed embedding", "borrowed head", "vllm names"])
def test_a_head_round_its_loader_would_fail_on_is_refused_and_the_engine_serves(
        eagle: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels, heads: Heads, case: str) -> None:
    ds, tr, eng = eagle
    head = heads["repeat_B"]
    target = load_file(str(tiny_models.B / "model.safetensors"))
    if case == "borrowed embedding":
        bad = _head_with(head, **{"embed_tokens.weight": target["model.embed_tokens.weight"]})
        msg = "embed_tokens.weight: lands on model.embed_tokens.weight, which this model shares"
    elif case == "borrowed head":
        bad = _head_with(head, **{"lm_head.weight": target["lm_head.weight"]})
        msg = "lm_head.weight: lands on lm_head.weight, which this model shares"
    else:  # vLLM's own parameter names: the head's loader would prefix them again
        bad = {f"model.{k}": v for k, v in _head_with(head).items()}
        msg = "model.fc.weight: not a parameter of this model"
    label = ds.session.http.weight_info().label
    out = _greedy(eng)
    with pytest.raises(TransferError) as ei:
        tr.send(eng.base_url, "forged", WeightSource.of(bad), timeout_s=60, draft=True)
    assert msg in str(ei.value), str(ei.value)[:800]
    # Refused before the reload opened: same label, same tokens, still serving.
    assert ds.session.http.weight_info().label == label
    assert _greedy(eng) == out
    assert eng.alive()


def test_the_engine_names_its_head_and_a_target_only_update_is_refused(
        eagle: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels) -> None:
    """vLLM's ``/server_info`` names the method; the session's adapter read it at
    bootstrap, so a target-only update is refused even by a transport that would send
    it (``require_draft=False``), before anything is drained."""
    ds, tr, eng = eagle
    assert ds.session.vllm.draft_method == "eagle"
    http = VllmHTTP(eng.base_url)
    try:
        assert VllmAdapter(http).bootstrap().engine_info["speculative_method"] == "eagle"
    finally:
        http.close()
    label = ds.session.http.weight_info().label
    committed = ds.session.controller.committed
    tr.require_draft = False
    try:
        with pytest.raises(UpdateRefused, match="method eagle"):
            ds.session.update(tiny_models.A, prov(9, RUN), probe=False)
    finally:
        tr.require_draft = True
    assert ds.session.controller.state is State.READY
    assert ds.session.controller.committed == committed
    assert ds.session.http.weight_info().label == label and not ds.session.http.is_paused()


def test_a_head_round_that_leaves_the_old_head_is_not_published(
        eagle: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels, heads: Heads) -> None:
    """The pair declares (B, repeat_B2); the head round puts repeat_B, the head already
    there, on the wire. Every token is B's either way; the workers' checksums of what
    the head round wrote differ from the head declared."""
    ds, tr, eng = eagle
    v0 = ds.session.controller.committed
    tr.wire = WeightSource.from_checkpoint(heads["repeat_B"])
    try:
        with pytest.raises(UpdateFailed):
            ds.update(tiny_models.B, prov(2, RUN), draft_weights=heads["repeat_B2"],
                      measure_before=False)
    finally:
        tr.wire = None
    assert ds.session.controller.state is State.TAINTED
    assert ds.session.controller.committed == v0
    chk = tr.validation_check(eng.base_url)
    assert not chk.passed and "draft: rank 0/1" in chk.detail and "differ" in chk.detail


@pytest.mark.slow
def test_a_tensor_parallel_engines_head_is_checked_on_every_rank(
        engine_factory: EngineFactory, tiny_models: TinyModels, heads: Heads,
        tmp_path: Path) -> None:
    a, b = tiny_models.A, tiny_models.B
    eng = engine_factory(a, tensor_parallel_size=2,
                         extra_args=DraftSpec(heads["random_A"], method="eagle").engine_args())
    ds, tr = drafted_session(eng, tmp_path / "j.jsonl", min_acceptance=None)
    try:
        ds.bootstrap(a, heads["random_A"])
        r = ds.update(b, prov(1, RUN), draft_weights=heads["repeat_B"])
        assert ds.session.http.weight_info().label == r.version.label
        chk = tr.validation_check(eng.base_url)
        assert chk.passed and chk.coverage == 1.0, chk
        assert "draft: rank 0/2: 6/6 compared, 0 differ; rank 1/2: 6/6 compared" in chk.detail
        after = r.acceptance_after
        assert after is not None and (after.rate or 0.0) >= 0.1, after
    finally:
        ds.close()
        engine_factory.stop(eng)
