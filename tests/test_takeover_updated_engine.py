"""A takeover never claims a checkpoint for an engine that was updated (#47, symptom 2).

A gateway restarted without its journal (``serve --upstream E --checkpoint A``)
over an engine updated to A1 (label ``rc-1``) went READY at ``probe`` and
credited every answer to A: A1 and A differ on the probe by far less than the
engine's own noise, so no probe can tell them apart, and the label that says
"updated" was adopted without question. Now a new controller refuses an engine
whose label (``rc-N``, N >= 1) or own weight-write count says it was written
since it started. Over the fake engine (its label is what vLLM's says).
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


def _updated_engine() -> FakeEngine:
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
    return eng


@pytest.mark.parametrize("declared", [W0, W1], ids=["start-checkpoint", "the-truth"])
def test_a_new_controller_refuses_an_engine_whose_label_says_it_was_updated(
        declared: FakeWeights) -> None:
    eng = _updated_engine()
    c = LifecycleController()
    r = LifecycleRunner(c, FakeAdapter(eng))
    with pytest.raises(TakeoverRefused, match="'rc-1': it was updated") as ei:
        r.take_over(declared.identity())      # declared, no probe: what was accepted
    assert ei.value.classification == "no_mutation"
    assert c.published == () and c.committed is None and c.state is not State.READY
    name = "A1" if declared is W1 else "A"
    MATRIX.row("takeover_updated_engine", "a gateway without its journal takes over an engine "
               f"updated to A1 (label rc-1), declaring {name}",
               "refused (no_mutation): its label says it was updated, no journal says to what; "
               "nothing published", "not READY (nothing served)", published_unvalidated=0,
               records_lost=0, part=f"declared {name}")


def test_a_fresh_engine_is_still_taken_over() -> None:
    c = LifecycleController()
    r = LifecycleRunner(c, FakeAdapter(FakeEngine(W0, token_delay_s=0)))
    v = r.take_over(W0.identity(), probes=fake_probe(W0))
    assert v is not None and v.accepted and c.state is State.READY
