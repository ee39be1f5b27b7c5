"""A real vLLM (CPU build) decoding with a draft model: one transaction for both.

The engine serves the tiny target and decodes speculatively with a draft that
is a copy of it (``--speculative-config`` method ``draft_model``): while both
hold the same policy every draft token is accepted; a draft left on another
policy is accepted about never, while every output token is still the
target's. One engine start serves the CI cases (module fixture, in order:
the drafted update, the refusals, then the stale draft, which taints it);
the mid-way failure restarts it (slow lane).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from drafttools_engine import FaultyDraftTransport, assert_one_version, drafted_session, prov

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.versions import Provenance
from rolloutcore.core.vocab import State
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.errors import TransferError, UpdateFailed, UpdateRefused
from rolloutcore.session import DraftedSession, DraftSpec
from rolloutcore.transports.drafted import policy_digest
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

MIN_ACCEPTANCE = 0.5


def _prov(step: int) -> Provenance:
    return prov(step)


def _session(eng: ManagedEngine, journal: Path) -> tuple[DraftedSession, FaultyDraftTransport]:
    return drafted_session(eng, journal, min_acceptance=MIN_ACCEPTANCE)


@pytest.fixture(scope="module")
def drafted(engine_factory: EngineFactory, tiny_models: TinyModels,
            tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[DraftedSession, FaultyDraftTransport, ManagedEngine]]:
    a = tiny_models.A
    eng = engine_factory(a, extra_args=DraftSpec(a).engine_args())
    ds, tr = _session(eng, tmp_path_factory.mktemp("draft-journal") / "j.jsonl")
    try:
        ds.bootstrap(a, a)
        yield ds, tr, eng
    finally:
        ds.close()
        engine_factory.stop(eng)


def _snapshot(ds: DraftedSession) -> dict[str, Any]:
    h = ds.session.http
    return {"state": ds.session.controller.state, "committed": ds.session.controller.committed,
            "identity": ds.session.controller.identity, "label": h.weight_info().label,
            "ops": dict(h.weight_ops().done), "paused": h.is_paused()}


def test_drafted_update_publishes_one_version_for_both(
        drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels) -> None:
    ds, tr, eng = drafted
    b = tiny_models.B
    r = ds.update(b, _prov(1), draft_weights=b)
    src_b = WeightSource.from_checkpoint(b)
    want = policy_digest(src_b.content_digest(), src_b.content_digest(),
                         src_b.manifest().digest)
    assert r.identity.content_digest == want == r.digests["content_digest"]
    assert r.digests["draft_content_digest"] == src_b.content_digest()
    assert_one_version(ds, tr, eng, r, want)
    # Acceptance before (A with its copy) and after (B with its copy): both near 1.
    assert r.acceptance_before is not None and r.acceptance_after is not None
    assert r.acceptance_before.drafted > 0 and r.acceptance_after.drafted > 0
    assert (r.acceptance_after.rate or 0.0) >= 0.9, r.acceptance_after
    assert r.phases["draft_transfer_s"] > 0 and r.phases["target_transfer_s"] > 0


def test_target_only_update_refused_before_anything_changes(
        drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels) -> None:
    ds, tr, eng = drafted
    before = _snapshot(ds)
    assert before["state"] is State.READY
    with pytest.raises(UpdateRefused, match="no draft weights"):
        ds.update(tiny_models.A, _prov(2))
    # The plain session on the same engine refuses too, before draining.
    with pytest.raises(UpdateRefused, match="no draft weights"):
        ds.session.update(tiny_models.A, _prov(2), probe=False)
    # And the transport itself, asked directly, sends nothing.
    with pytest.raises(TransferError, match="no draft weights") as ei:
        tr.send(eng.base_url, "x", WeightSource.from_checkpoint(tiny_models.A), timeout_s=30)
    assert ei.value.mutation_started is False
    assert _snapshot(ds) == before


def test_old_draft_sent_with_a_new_target_is_not_published(
        drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels) -> None:
    """The trainer moves the target to A and sends B, the old draft, as the draft: every
    checksum matches what it declared, every token is A's, and yet the draft is left on
    the old policy. The acceptance window of the live validation catches it."""
    ds, tr, eng = drafted
    before = _snapshot(ds)
    with pytest.raises(UpdateFailed) as ei:
        ds.update(tiny_models.A, _prov(3), draft_weights=tiny_models.B)
    assert ei.value.classification != "no_mutation"
    assert ds.session.controller.state is State.TAINTED
    assert ds.session.controller.committed == before["committed"]  # nothing published
    assert tr.validation_check(eng.base_url).passed  # the checksums could not see it
    last = ds.acceptance.last
    assert last is not None and last.drafted > 0 and (last.rate or 0.0) < MIN_ACCEPTANCE


@contextlib.contextmanager
def _fresh(drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
           a: Path, journal: Path) -> Iterator[tuple[DraftedSession, FaultyDraftTransport]]:
    """The module's engine restarted on A with draft A (a tainted engine is replaced),
    under a new session that leaves the engine to the module fixture."""
    ds0, _, eng = drafted
    ds0.session.transport.close()
    eng.restart()
    ds, tr = _session(eng, journal)
    try:
        ds.bootstrap(a, a)
        yield ds, tr
    finally:
        tr.wire, tr.break_after = None, None
        t = threading.Thread(target=tr.close, daemon=True)
        t.start()
        t.join(10)
        ds.session.http.close()
        ds.session.journal.close()


@pytest.mark.slow
def test_draft_round_leaving_old_weights_is_caught(
        drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels, tmp_path: Path) -> None:
    """The pair declares (B, B); the draft round puts A (the old draft) on the wire."""
    with _fresh(drafted, tiny_models.A, tmp_path / "j.jsonl") as (ds, tr):
        v0 = ds.session.controller.committed
        tr.wire = WeightSource.from_checkpoint(tiny_models.A)
        with pytest.raises(UpdateFailed):
            ds.update(tiny_models.B, _prov(4), draft_weights=tiny_models.B,
                      measure_before=False)
        assert ds.session.controller.state is State.TAINTED
        assert ds.session.controller.committed == v0
        chk = tr.validation_check(ds.session.http.base_url)
        assert not chk.passed and "draft: rank 0/1" in chk.detail and "differ" in chk.detail
        # What the engine now does, seen by an operator who resumes it: the draft is
        # still A's while the target is B's, so almost nothing is accepted.
        ds.session.http.resume()
        acc = ds.check_draft()
        assert not acc.passed, acc


@pytest.mark.slow
def test_draft_round_failing_midway_publishes_nothing(
        drafted: tuple[DraftedSession, FaultyDraftTransport, ManagedEngine],
        tiny_models: TinyModels, tmp_path: Path) -> None:
    with _fresh(drafted, tiny_models.A, tmp_path / "j.jsonl") as (ds, tr):
        v0 = ds.session.controller.committed
        assert v0 is not None
        tr.break_after = 5
        with pytest.raises(UpdateFailed):
            ds.update(tiny_models.B, _prov(5), draft_weights=tiny_models.B,
                      measure_before=False)
        assert ds.session.controller.state is State.TAINTED
        assert ds.session.controller.committed == v0
        assert ds.session.http.weight_info().label == v0.label  # the label never moved
