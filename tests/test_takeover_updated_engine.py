"""A takeover never claims a checkpoint for an engine that was updated (#47, symptom 2).

A gateway restarted without its journal (``serve --upstream E --checkpoint A``)
over an engine updated to A1 (label ``rc-1``) went READY at ``probe`` and
credited every answer to A: A1 and A differ on the probe by far less than the
engine's own noise, so no probe can tell them apart. Now an engine whose label
(``rc-N``, N >= 1) or own weight-write count says it was written since it
started is adopted without its journal only on content evidence (engine
checksums covering every parameter, compared with the declared checkpoint's),
and its probe never calibrates later updates. Over the fake engine (its label
and its weight digest are what vLLM's label and checksums are to the adapter).
"""

from __future__ import annotations

import pytest

from helpers.fault_matrix import PromiseRows
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.control.takeover import TakeoverRefused
from rolloutcore.core.lifecycle import State
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.testing.fake_engine import fake_probe

MATRIX = PromiseRows("tests/test_takeover_updated_engine.py",
                     engines="FakeEngine under the real controller, runner and takeover")
_fault_matrix = MATRIX.fixture()
W0, W1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)


def _updated_engine() -> tuple[FakeEngine, Journal]:
    """An engine a first gateway took over on W0 and updated to W1 (label rc-1)."""
    eng = FakeEngine(W0, token_delay_s=0)
    ad = FakeAdapter(eng)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, record=j.write)
    r.take_over(W0.identity(), probes=fake_probe(W0))
    ad.stage(W1)
    r.run_update(W1.identity())
    assert c.committed is not None and c.committed.label == "rc-1" == eng.label
    return eng, j


@pytest.mark.parametrize("declared", [W0, W1], ids=["start-checkpoint", "the-truth"])
def test_without_journal_or_content_evidence_an_updated_engine_is_refused(
        declared: FakeWeights) -> None:
    eng, _ = _updated_engine()
    c = LifecycleController()
    r = LifecycleRunner(c, FakeAdapter(eng))
    with pytest.raises(TakeoverRefused, match="'rc-1': it was updated") as ei:
        r.take_over(declared.identity(), probes=fake_probe(declared))
    assert ei.value.classification == "no_mutation"
    assert c.published == () and c.committed is None and c.state is not State.READY
    assert eng.label == "rc-1" and eng.weights_digest == W1.digest   # nothing written
    name = "A1" if declared is W1 else "A"
    MATRIX.row("takeover_updated_engine", "a gateway without its journal takes over an engine "
               f"updated to A1 (label rc-1), declaring {name}, no content evidence",
               "refused (no_mutation): its label says it was updated and nothing compared "
               "its content with the declared checkpoint; nothing published",
               "not READY (nothing served)", published_unvalidated=0, records_lost=0,
               part=f"declared {name}")


def test_content_evidence_decides_an_updated_engines_takeover() -> None:
    eng, _ = _updated_engine()
    # Declared A with A's checksums as the reference: the engine's content differs.
    c = LifecycleController()
    r = LifecycleRunner(c, FakeAdapter(eng))
    with pytest.raises(TakeoverRefused) as ei:
        r.take_over(W0.identity(), probes=fake_probe(W0),
                    reference_checksums={"fake-digest": W0.digest})
    assert ei.value.classification == "no_mutation" and c.committed is None
    # Declared A1 with A1's checksums: the content is the declared checkpoint's.
    c2 = LifecycleController()
    v = LifecycleRunner(c2, FakeAdapter(eng)).take_over(
        W1.identity(), probes=fake_probe(W1), reference_checksums={"fake-digest": W1.digest})
    assert v is not None and v.accepted and c2.state is State.READY
    assert c2.committed is not None and c2.committed.label == "rc-1"
    MATRIX.row("takeover_updated_engine", "the same takeover with content evidence: the "
               "engine's checksums against the declared checkpoint's (A, then A1)",
               "declared A: refused (no_mutation, the content differs); declared A1: READY "
               "on rc-1 (the content matches)", "READY only on the matching content",
               published_unvalidated=0, records_lost=0, part="content evidence")


def test_the_journal_still_confirms_an_updated_engine() -> None:
    eng, j = _updated_engine()
    c = LifecycleController.restore(j.records)
    assert c.state is State.READY and c.committed is not None
    assert LifecycleRunner(c, FakeAdapter(eng)).take_over(
        W1.identity(), probes=fake_probe(W1)) is None
    assert c.state is State.READY


def test_a_fresh_engine_is_still_taken_over() -> None:
    c = LifecycleController()
    r = LifecycleRunner(c, FakeAdapter(FakeEngine(W0, token_delay_s=0)))
    v = r.take_over(W0.identity(), probes=fake_probe(W0))
    assert v is not None and v.accepted and c.state is State.READY
