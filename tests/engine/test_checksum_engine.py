"""Engine-checksum verification on real vLLM servers (CPU, tiny Llama).

The engine under RolloutCore control starts on A; its checksums, read before
anything touches it, are a cold-loaded reference of A. The reference of B is
taken the same way: ``reference_checksums`` starts a second server cold on B
(no transfer backend: nothing can hot-update it), reads ``/weight_checker``,
stops it and caches the result under B's content digest and the engine
layout, so asking again starts nothing. A real hot update of the controlled
engine to B then

* matches B's cold-loaded reference on every hashable parameter (the CPU
  backend hashes its repacked fused linear layers as zero bytes: counted as
  unverifiable, never as matches; coverage printed), and the committed
  identity says ``engine-checksum``;
* mismatches A's reference on exactly the parameters whose cold references
  of A and B differ (the RMSNorm weights are ones in both random checkpoints
  and rightly match);
* and an update whose result does not match its reference is not published.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.verify import (
    ChecksumCache,
    engine_layout,
    reference_checksums,
    take_reference,
    verify_engine,
)
from rolloutcore.errors import UpdateFailed
from rolloutcore.session import EngineSession
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import EMPTY_SHA256, ReferenceChecksums, verify

pytestmark = [
    pytest.mark.engine,
    # The slow lane since #30: every CI update's gloo transfer checks each rank's
    # writes as loaded (rank_checksums); the cold-loaded reference is this module's.
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass
class Rig:
    session: EngineSession
    cold_a: ReferenceChecksums
    cache: ChecksumCache
    layout: dict[str, Any]


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    eng = engine_factory(tiny_models.A)  # rolloutcore_gloo weight transfer
    root = tmp_path_factory.mktemp("checksums")
    s = EngineSession(VllmHTTP(eng.base_url, timeout_s=120.0), GlooTransport(op_timeout_s=60),
                      engine=eng, journal_path=root / "journal.jsonl")
    try:
        # Nothing has touched this engine yet: what it holds is vLLM's cold load of A.
        cold_a = take_reference(
            s.http, WeightSource.from_checkpoint(tiny_models.A).content_digest(),
            origin="cold-load", source=str(tiny_models.A))
        s.bootstrap(tiny_models.A, Provenance(str(tiny_models.A), "checksum-test", 0))
        yield Rig(s, cold_a, ChecksumCache(root / "cache"), engine_layout(s.http))
    finally:
        try:
            s.close()
        finally:
            engine_factory.stop(eng)


@pytest.fixture(scope="module")
def cold_b(rig: Rig, engine_factory: EngineFactory, tiny_models: TinyModels
           ) -> ReferenceChecksums:
    started: list[ManagedEngine] = []

    def launch(d: Path) -> ManagedEngine:
        eng = engine_factory(d, backend=None)  # no transfer backend: a pure cold load
        started.append(eng)
        return eng

    ref = reference_checksums(tiny_models.B, cache=rig.cache, layout=rig.layout, launch=launch)
    assert len(started) == 1 and not started[0].alive()  # started, read, stopped
    return ref


@pytest.mark.slow  # a cold start of B to read its reference (2.5 min): the slow lane
def test_cold_reference_is_taken_like_the_engine_and_cached(
        rig: Rig, cold_b: ReferenceChecksums, tiny_models: TinyModels) -> None:
    assert cold_b.origin == "cold-load" and dict(cold_b.layout) == rig.layout
    assert cold_b.content_digest == WeightSource.from_checkpoint(tiny_models.B).content_digest()
    assert all(k.startswith("dp0:pp0:pcp0:tp0:") for k in cold_b.checksums)
    assert cold_b.checksums.keys() == rig.cold_a.checksums.keys()
    # The CPU backend repacks the fused linear layers (hash of zero bytes: unverifiable) on
    # hosts whose GEMM path packs them (oneDNN / AVX-512); elsewhere it keeps and hashes them.
    fused = {k for k in cold_b.checksums if any(f in k for f in FUSED)}
    assert cold_b.unverifiable in (fused, frozenset())
    assert cold_b.unverifiable == {k for k, d in cold_b.checksums.items() if d == EMPTY_SHA256}

    def no_launch(_: Path) -> Any:
        raise AssertionError("the cached reference must be reused")

    again = reference_checksums(tiny_models.B, cache=rig.cache, layout=rig.layout,
                                launch=no_launch)
    assert again == cold_b
    assert rig.cache.get(cold_b.content_digest, rig.layout) == cold_b
    # Two cold loads of different checkpoints differ where their bytes differ.
    differ = verify(dict(cold_b.checksums), rig.cold_a)
    assert differ.mismatched and not differ.passed


def test_hot_update_matches_the_cold_loaded_reference(
        rig: Rig, cold_b: ReferenceChecksums, tiny_models: TinyModels,
        capsys: pytest.CaptureFixture[str]) -> None:
    s = rig.session
    res = s.update(tiny_models.B, Provenance(str(tiny_models.B), "checksum-test", 1),
                   reference_checksums=cold_b.checksums, probe=False)
    assert res.identity.verification is VerificationLevel.ENGINE_CHECKSUM
    assert any(e.startswith("engine_checksum=pass coverage=") for e in res.identity.evidence)

    report = verify_engine(s.http, cold_b)
    assert report.passed and report.keyed_by == "raw" and not report.layout_mismatch
    assert set(report.matched) == set(cold_b.checksums) - cold_b.unverifiable
    assert set(report.unverifiable) == cold_b.unverifiable
    assert not report.missing_in_engine and not report.missing_in_reference
    assert 0 < report.coverage <= 1
    assert (report.coverage < 1) == bool(cold_b.unverifiable)
    check = report.to_check()
    assert check.passed and check.level is VerificationLevel.ENGINE_CHECKSUM

    wrong = verify_engine(s.http, rig.cold_a)
    differs = {k for k, d in cold_b.checksums.items()
               if d != EMPTY_SHA256 and rig.cold_a.checksums[k] != d}
    assert differs and not wrong.passed
    assert set(wrong.mismatched) == differs
    assert {k.rsplit(":", 1)[1] for k in differs} >= {"model.embed_tokens.weight",
                                                      "lm_head.weight"}
    with capsys.disabled():
        print(f"\nafter hot update A -> B ({res.version.label}), vs B's cold-loaded "
              f"reference: {report.detail()}\n  engine parameters {report.engine_params}, "
              f"hashable {report.hashable}, compared {report.compared}, coverage "
              f"{report.coverage:.3f}; identity evidence {list(res.identity.evidence)}\n"
              f"vs A's cold-loaded reference: {wrong.detail()}")


def test_an_update_that_does_not_match_its_reference_is_not_published(
        rig: Rig, cold_b: ReferenceChecksums, tiny_models: TinyModels) -> None:
    """Last in the module: it leaves the controller TAINTED."""
    s = rig.session
    before = s.controller.committed
    assert before is not None
    with pytest.raises(UpdateFailed):
        # A's weights go out, but the reference says the result must be B.
        s.update(tiny_models.A, Provenance(str(tiny_models.B), "checksum-test", 2),
                 reference_checksums=cold_b.checksums, probe=False)
    assert s.controller.committed == before
    assert s.controller.state is State.TAINTED
