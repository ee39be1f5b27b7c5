"""The drain deadline's policy and the runner's classification of the unexpected (#16).

Liveness: nobody holds an update hostage. A rollout still bound when the
drain deadline expires is, by default, aborted (released unattributable, its
request cut by whoever serves it, the engine drained with ``abort``) and the
update goes on; by configuration the update is refused instead. Whatever
goes wrong inside an update that nobody classified (a journal that failed, an
invalid transition, a bug in an adapter) ends the update through the failure
policy: never a raw exception with the update left half-way, refusing every
later begin.

Runs against the in-process fake engine (its pause modes are real: ``abort``
ends in-flight generations, ``wait`` lets them finish).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, DrainPolicy, LifecycleRunner
from rolloutcore.core.evidence import PauseMode, TransferEvidence, UpdateTarget
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.records import Complete, Note, Record
from rolloutcore.core.versions import Binding
from rolloutcore.errors import BadInput, InvalidTransition, UpdateFailed
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

DL = Deadlines(drain_s=0.2, abort_s=1.0, pause_s=2, preflight_s=1, transfer_s=1, reset_s=1,
               validate_s=1, resume_s=1, live_validate_s=2, bootstrap_s=2, fence_s=1,
               cancel_grace_s=0.2, retry_backoff_s=0.01)
W0, W1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)


class Parts:
    def __init__(self, adapter_cls: type[FakeAdapter] = FakeAdapter,
                 listener: Any = None, token_delay_s: float = 0.0005) -> None:
        self.engine = FakeEngine(W0, token_delay_s=token_delay_s)
        self.adapter = adapter_cls(self.engine)
        self.adapter.stage(W0)
        self.journal = Journal()
        self.c = LifecycleController(listener=self.journal.listener)
        if listener is not None:
            self.c.add_listener(listener)
        self.runner = LifecycleRunner(self.c, self.adapter, DL, record=self.journal.write)
        self.runner.bootstrap(W0.identity())
        self.adapter.stage(W1)

    def records(self, t: type[Record]) -> list[Any]:
        return [r.record for r in self.journal.records if isinstance(r.record, t)]


# ------------------------------------------------------------------ drain policy


def test_default_policy_aborts_a_straggler_unattributable_and_publishes() -> None:
    p = Parts()
    assert p.runner.drain_policy is DrainPolicy.ABORT
    b = p.c.admit("never-finishes")
    out = p.runner.run_update(W1.identity())
    assert out.published is not None and p.c.committed == out.published
    assert p.c.state is State.READY and p.c.active == {}
    # The controller's own record: released in DRAINING, attributable to nothing.
    (done,) = [r for r in p.records(Complete) if r.rollout_id == "never-finishes"]
    assert done.state is State.DRAINING and done.attributable is False
    assert done.version == b.version != out.published
    notes = [n for n in p.records(Note) if n.what == "stragglers_aborted"]
    assert notes and notes[0].fields["rollouts"] == ["never-finishes"]
    # The rollout's own release learns it, once; nothing new is recorded.
    n = len(p.journal.records)
    late = p.c.complete("never-finishes")
    assert late.attributable is False and late.aborted and "drain deadline" in late.aborted
    assert late.binding.version == b.version
    assert len(p.journal.records) == n
    with pytest.raises(BadInput):
        p.c.complete("never-finishes")
    assert check_journal(p.journal.records) == []
    assert {x.phase for x in out.phases} >= {"drain", "abort", "pause"}


def test_refuse_policy_keeps_the_old_version_and_the_straggler() -> None:
    p = Parts()
    p.runner.drain_policy = DrainPolicy.REFUSE
    p.c.admit("slow")
    with pytest.raises(UpdateFailed) as ei:
        p.runner.run_update(W1.identity())
    assert ei.value.phase == "drain" and ei.value.classification == "no_mutation"
    assert "drain policy: refuse" in ei.value.reason
    assert p.c.state is State.READY and set(p.c.active) == {"slow"}
    assert p.c.complete("slow").attributable is True


def test_the_straggler_handler_is_told_and_the_engine_drains_with_abort() -> None:
    """A generation in flight in the engine is aborted before anything mutates."""
    p = Parts(token_delay_s=0.01)
    seen: list[tuple[tuple[Binding, ...], str]] = []
    p.runner.stragglers = lambda bindings, reason: seen.append((bindings, reason)) or {"ok": 1}
    modes: list[PauseMode] = []
    drain = p.adapter.drain
    p.adapter.drain = lambda mode: (modes.append(mode), drain(mode))[1]  # type: ignore[method-assign]
    b = p.c.admit("gen")
    got: dict[str, Any] = {}
    th = threading.Thread(target=lambda: got.setdefault(
        "g", p.engine.generate([1, 2, 3], 100_000, request_id="gen")))
    th.start()
    while not p.engine.in_flight:
        time.sleep(0.001)
    out = p.runner.run_update(W1.identity())
    th.join(10)
    assert out.published is not None
    assert [bs for bs, _ in seen] == [(b,)] and "drain deadline" in seen[0][1]
    assert modes == [PauseMode.ABORT]
    g = got["g"]
    assert g.finish_reason == "abort" and set(g.token_labels) == {"default"}
    note = next(n for n in p.records(Note) if n.what == "stragglers_aborted")
    assert note.fields["result"] == {"ok": 1}


@pytest.mark.parametrize("how", ["raises", "hangs"])
def test_a_failing_straggler_handler_does_not_stop_the_update(how: str) -> None:
    p = Parts()
    release = threading.Event()

    def handler(bindings: tuple[Binding, ...], reason: str) -> None:
        if how == "raises":
            raise RuntimeError("the data plane is gone")
        release.wait(30)

    p.runner.stragglers = handler
    # The hung handler waits out its deadline: a short one (it does nothing meanwhile).
    p.runner.deadlines = d = dataclasses.replace(DL, abort_s=0.2) if how == "hangs" else DL
    p.c.admit("s")
    t0 = time.monotonic()
    out = p.runner.run_update(W1.identity())
    release.set()
    assert out.published is not None and p.c.active == {}
    assert time.monotonic() - t0 < d.drain_s + d.abort_s + d.cancel_grace_s + 5
    assert any(n.what == "abort_failed" for n in p.records(Note))


def test_abort_rollouts_is_the_owners_and_only_while_draining() -> None:
    p = Parts()
    p.c.admit("x")
    t = p.c.request_update(W1.identity(), "trainer")
    other = type(t)(t.update_id + 1, t.target, t.min_verification)
    with pytest.raises(Exception, match="does not own"):
        p.c.abort_rollouts(other, ["x"], "why")
    with pytest.raises(BadInput):
        p.c.abort_rollouts(t, "x", "why")
    with pytest.raises(BadInput):
        p.c.abort_rollouts(t, ["x"], "")
    assert set(p.c.active) == {"x"}
    assert [c.binding.rollout_id for c in p.c.abort_rollouts(t, ["x", "unknown"], "why")] \
        == ["x"]
    assert p.c.abort_rollouts(t, ["x"], "why") == []  # already released
    p.runner._drain_mode = PauseMode.WAIT
    from rolloutcore.core.evidence import DrainEvidence
    p.engine.pause(PauseMode.WAIT)
    p.c.drained(t, DrainEvidence(True, PauseMode.WAIT, 0))
    with pytest.raises(InvalidTransition):
        p.c.abort_rollouts(t, ["x"], "why")


# ------------------------------------------------------------------ the unexpected


class BuggyTransfer(FakeAdapter):
    """A transport bug: the transfer mutates, then hands back no evidence at all."""

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        super().transfer(target)
        return None  # type: ignore[return-value]


class BuggyDrain(FakeAdapter):
    def drain(self, mode: PauseMode) -> Any:
        super().drain(mode)
        return {"paused": True}  # not DrainEvidence


def test_an_adapter_bug_after_the_mutation_taints_and_fences() -> None:
    p = Parts(BuggyTransfer)
    with pytest.raises(UpdateFailed) as ei:
        p.runner.run_update(W1.identity())
    e = ei.value
    assert e.classification == "ambiguous" and e.state == "TAINTED" and e.phase == "transfer"
    assert "unexpected" in e.reason
    assert p.c.state is State.TAINTED and p.c.current_ticket is None
    assert p.engine.paused  # fenced
    assert any(n.what == "unexpected_error" for n in p.records(Note))
    assert check_journal(p.journal.records) == []


def test_an_adapter_bug_before_the_mutation_returns_to_ready_and_the_next_update_runs() -> None:
    p = Parts(BuggyDrain)
    with pytest.raises(UpdateFailed) as ei:
        p.runner.run_update(W1.identity())
    assert ei.value.classification == "no_mutation" and p.c.state is State.READY
    assert p.c.current_ticket is None and not p.engine.paused
    p.adapter.drain = FakeAdapter.drain.__get__(p.adapter)  # type: ignore[method-assign]
    assert p.runner.run_update(W1.identity()).published is not None


def test_an_invalid_transition_inside_an_update_is_classified() -> None:
    p = Parts()

    def boom(*a: Any, **k: Any) -> Any:
        raise InvalidTransition("preflighted", "QUIESCED", "injected")

    p.c.preflighted = boom  # type: ignore[method-assign]
    with pytest.raises(UpdateFailed) as ei:
        p.runner.run_update(W1.identity())
    assert ei.value.phase == "preflight" and ei.value.classification == "no_mutation"
    assert p.c.state is State.READY and p.c.current_ticket is None


@pytest.mark.parametrize("at", ["request_update", "begin_update", "transition", "commit"])
def test_a_journal_that_fails_mid_update_ends_it_tainted(at: str) -> None:
    """The listener (the journal) fails on one record: the update never stays open."""
    armed = threading.Event()

    def failing(rec: Record) -> None:
        if armed.is_set() and at == rec.KIND:
            raise OSError(28, "No space left on device")

    p = Parts(listener=failing)
    armed.set()
    with pytest.raises(UpdateFailed) as ei:
        p.runner.run_update(W1.identity())
    assert p.c.failed_closed and "No space left" in p.c.failed_closed
    assert p.c.state is State.TAINTED and p.c.current_ticket is None
    assert ei.value.classification == "ambiguous" and ei.value.state == "TAINTED"
    assert p.engine.paused  # fenced: whatever it serves is not on record
    # A later begin is refused with the reason, not as "an update is in progress".
    with pytest.raises(Exception, match="failed closed"):
        p.runner.open_update(W1.identity())
