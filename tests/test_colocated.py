"""Colocated training on one GPU (issue 21): the sleep/wake lifecycle over the fake engine.

The fake engine models vLLM's sleep levels (level 2 forgets the weights: a wake
brings back memory of garbage), its scheduler (paused until everything is
awake, or resumed on any wake like older vLLM), the crash of a weight write
into asleep memory, and the memory each condition holds. What is checked:
the table (nothing admitted, transferred or reset while asleep; a wake serves
only after a paused validation of every parameter), the colocated update and
the restore, and the faults: an update while asleep refused without touching
the engine, a wake after level 2 without an update not published, one
parameter left unwritten caught, the engine dying while asleep, a wake that
fails or lies.
"""

from __future__ import annotations

from typing import Any

import pytest

from coretools import (
    boot_ev,
    full_check,
    ident,
    request_wake_update,
    reset_ev,
    sleep_ev,
    transfer_ev,
    wake_ev,
    wake_validation_ev,
)
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.evidence import (
    CacheKind,
    Check,
    PauseMode,
    PreflightEvidence,
    ValidationEvidence,
    WakeTags,
)
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State, Step
from rolloutcore.core.records import (
    Abandon,
    Commit,
    EvidenceSeen,
    RequestSleep,
    RequestWake,
    Taint,
    Transition,
)
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    EffectError,
    InvalidTransition,
    TransferError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.testing.fake import (
    FakeAdapter,
    FakeEngine,
    FakeRecoverer,
    FakeWeights,
    FaultKind,
    reference_tokens,
)

A, B, C = FakeWeights.from_seed(1), FakeWeights.from_seed(2, step=1), FakeWeights.from_seed(3)
PROMPT = list(range(40))
FAST = Deadlines(drain_s=2, pause_s=5, transfer_s=5, reset_s=5, validate_s=5, resume_s=5,
                 live_validate_s=5, fence_s=2, cancel_grace_s=1, retry_backoff_s=0.01,
                 sleep_s=5, wake_s=5)


def rig(**engine_kw: Any) -> tuple[LifecycleRunner, FakeAdapter, FakeEngine, Journal]:
    eng = FakeEngine(A, token_delay_s=0.0, **engine_kw)
    a = FakeAdapter(eng)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, a, FAST, record=j.write)
    a.stage(A)
    r.bootstrap(A.identity())
    return r, a, eng, j


def states(j: Journal) -> list[str]:
    return [r.record.after.value for r in j.records if isinstance(r.record, Transition)]


# ---------------------------------------------------------------- the colocated update

def test_level2_colocated_update_publishes_every_parameter_verified() -> None:
    r, a, eng, j = rig()
    c = r.controller
    s = r.sleep(2)
    assert c.state is State.SLEEPING and eng.asleep == {"weights", "kv_cache"}
    total, w, kv, _ = FakeEngine.MEMORY
    assert s.freed_bytes == w + kv
    assert s.evidence is not None and s.evidence.memory_after["free_bytes"] == total - (1 << 30)
    with pytest.raises(AdmissionRefused, match="asleep") as ex:
        c.admit("r-while-training")
    assert ex.value.retry_after_s is not None
    a.stage(B)
    out = r.wake_update(B.identity())
    assert out.published is not None and out.published.label == "rc-1"
    assert c.state is State.READY and c.identity is not None
    assert c.identity.verification >= VerificationLevel.ENGINE_CHECKSUM
    assert eng.weights_digest == B.digest and not eng.asleep and not eng.paused
    assert eng.generate(PROMPT, 8).tokens == reference_tokens(B.digest, PROMPT, 8)
    assert states(j)[1:] == ["DOZING", "SLEEPING", "WAKING", "WARMING", "INVALIDATING",
                             "VALIDATING", "RESUMING", "READY"]
    assert check_journal(j.records) == []
    recs = [x.record for x in j.records]
    assert any(isinstance(x, RequestSleep) and x.level == 2 for x in recs)
    wake = [x for x in recs if isinstance(x, RequestWake)]
    assert len(wake) == 1 and not wake[0].restore and wake[0].min_verification >= \
        VerificationLevel.ENGINE_CHECKSUM
    val = [x.evidence for x in recs if isinstance(x, EvidenceSeen)
           and isinstance(x.evidence, ValidationEvidence) and x.evidence.paused]
    assert val[-1].checks[0].coverage == 1.0 and val[-1].checks[0].passed
    assert c.current_sleep is None and a.asleep is None


def test_a_training_loop_sleeps_and_wakes_with_a_new_policy_every_step() -> None:
    r, a, eng, j = rig()
    for step in range(1, 4):
        r.sleep(2)
        policy = FakeWeights.from_seed(10 + step, step=step)  # "trained" in the freed memory
        a.stage(policy)
        out = r.wake_update(policy.identity())
        assert out.published is not None and out.published.generation == step
        assert eng.generate(PROMPT, 4).tokens == reference_tokens(policy.digest, PROMPT, 4)
    assert [v.label for v in r.controller.published] == ["default", "rc-1", "rc-2", "rc-3"]
    assert check_journal(j.records) == []


def test_level1_wake_on_the_same_weights_is_verified_and_serves_them_again() -> None:
    r, a, eng, j = rig()
    c = r.controller
    before = c.committed
    s = r.sleep(1)
    assert s.evidence is not None and s.evidence.reference_params == len(A.tensors)
    out = r.wake()
    assert out.published is None and c.committed == before and c.state is State.READY
    assert eng.weights_digest == A.digest
    assert [v.label for v in c.published] == ["default"]  # served again, nothing new
    assert any(isinstance(x.record, Abandon) for x in j.records)
    assert eng.generate(PROMPT, 4).tokens == reference_tokens(A.digest, PROMPT, 4)
    assert states(j)[-5:] == ["SLEEPING", "INVALIDATING", "VALIDATING", "RESUMING", "READY"]
    assert check_journal(j.records) == []


def test_an_older_vllm_that_resumes_on_a_partial_wake_is_paused_again() -> None:
    r, a, eng, j = rig(wake_resumes="always")
    r.sleep(2)
    a.stage(B)
    out = r.wake_update(B.identity())
    assert out.published is not None and eng.weights_digest == B.digest
    woke = [x.record.evidence for x in j.records if isinstance(x.record, EvidenceSeen)
            and x.record.event.value == "woke"]
    assert [(w.tags, w.repaused, w.paused_after) for w in woke] == [
        (WakeTags.WEIGHTS, True, True), (WakeTags.KV_CACHE, True, True)]
    assert all(w.unverified == () for w in woke)  # the fake's adapter says nothing more


# ---------------------------------------------------------------- negative controls

def test_an_update_while_asleep_is_refused_without_touching_the_engine() -> None:
    r, a, eng, j = rig()
    r.sleep(2)
    n = len(j.records)
    a.stage(B)
    with pytest.raises(UpdateRefused, match="asleep"):
        r.run_update(B.identity())
    assert len(j.records) == n, "the refusal recorded or changed something"
    assert r.controller.state is State.SLEEPING and not eng.dead
    assert eng.asleep == {"weights", "kv_cache"}
    # The adapter refuses too, before any engine call: the real one would crash (#57853).
    target = r.controller.wake_target("trainer", B.identity())
    with pytest.raises(TransferError, match="asleep") as ex:
        a.transfer(target)
    assert ex.value.mutation_started is False
    for call in (lambda: a.drain(PauseMode.WAIT), lambda: a.reset_cache(CacheKind.PREFIX)):
        with pytest.raises(EffectError, match="asleep") as ex2:
            call()
        assert ex2.value.mutation_started is False
    assert a.refusals == ["transfer", "drain", "invalidate"]
    assert not eng.dead and eng.weights_digest != B.digest
    # A weight write that got through would have killed the engine, as vLLM's does.
    with pytest.raises(Exception, match="asleep"):
        eng.start_update()
    assert eng.dead


def test_a_wake_after_level2_without_an_update_is_not_published() -> None:
    r, a, eng, j = rig()
    c = r.controller
    r.sleep(2, reference=True)
    with pytest.raises(UpdateFailed) as ex:
        r.wake()
    assert ex.value.state == "TAINTED" and c.state is State.TAINTED
    assert [v.label for v in c.published] == ["default"]
    assert eng.weights_digest != A.digest  # level 2 forgot them: the memory holds garbage
    val = [x.record.evidence for x in j.records if isinstance(x.record, EvidenceSeen)
           and isinstance(x.record.evidence, ValidationEvidence)]
    chk = val[-1].checks[0]
    assert not chk.passed and chk.coverage == 0.0
    assert any(isinstance(x.record, Taint) for x in j.records)
    assert check_journal(j.records) == []
    # Without the checksums taken before the sleep nothing could even be compared.
    r2, _, _, j2 = rig()
    r2.sleep(2)
    with pytest.raises(UpdateFailed):
        r2.wake()
    last = [x.record.evidence for x in j2.records if isinstance(x.record, EvidenceSeen)
            and isinstance(x.record.evidence, ValidationEvidence)][-1]
    assert "no digests" in last.checks[0].detail


def test_one_parameter_left_unwritten_after_level2_is_caught() -> None:
    r, a, eng, j = rig()
    c = r.controller
    r.sleep(2)
    a.stage(B)
    a.skip_params = {"layers.2.weight"}
    with pytest.raises(UpdateFailed) as ex:
        r.wake_update(B.identity())
    assert ex.value.state == "TAINTED" and ex.value.phase == "validate"
    assert [v.label for v in c.published] == ["default"]
    val = [x.record.evidence for x in j.records if isinstance(x.record, EvidenceSeen)
           and isinstance(x.record.evidence, ValidationEvidence)][-1]
    assert val.checks[0].coverage == 0.75 and "3 of 4" in val.checks[0].detail
    assert check_journal(j.records) == []


def test_the_engine_dying_while_asleep_taints_and_recovery_brings_it_back() -> None:
    r, a, eng, j = rig()
    c = r.controller
    r.sleep(2)
    eng.kill()
    a.stage(B)
    with pytest.raises(UpdateFailed) as ex:
        r.wake_update(B.identity())
    assert ex.value.phase == "wake" and c.state is State.TAINTED
    v = r.recover(FakeRecoverer(a, B))
    assert v.accepted and c.state is State.READY and c.committed is not None
    assert c.committed.engine_epoch != "e0" and a.asleep is None
    a.stage(C)
    assert r.run_update(C.identity()).published is not None
    assert check_journal(j.records) == []


@pytest.mark.parametrize("fault", ["wake_weights", "wake_kv_cache"])
@pytest.mark.parametrize("kind", [FaultKind.RAISE, FaultKind.LIE])
def test_a_wake_that_fails_or_lies_taints(fault: str, kind: FaultKind) -> None:
    r, a, eng, j = rig()
    r.sleep(2)
    a.stage(B)
    a.inject(fault, kind)
    with pytest.raises(UpdateFailed) as ex:
        r.wake_update(B.identity())
    assert ex.value.state == "TAINTED" and ex.value.phase == "wake"
    assert [v.label for v in r.controller.published] == ["default"]
    assert check_journal(j.records) == []


def test_a_hanging_wake_is_cancelled_at_its_deadline_and_taints() -> None:
    r, a, eng, j = rig()
    r.deadlines = Deadlines(**{**FAST.__dict__, "wake_s": 0.2})
    r.sleep(2)
    a.stage(B)
    a.inject("wake_weights", FaultKind.HANG)
    with pytest.raises(UpdateFailed, match="deadline"):
        r.wake_update(B.identity())
    assert r.controller.state is State.TAINTED


# ---------------------------------------------------------------- the sleep itself

def test_an_engine_without_sleep_mode_is_refused_before_any_call_and_serves_on() -> None:
    r, a, eng, j = rig(sleep_mode=False)
    c = r.controller
    with pytest.raises(UpdateFailed) as ex:
        r.sleep(2)
    assert ex.value.classification == "no_mutation" and ex.value.state == "READY"
    assert a.refusals == ["sleep"] and not eng.asleep and not eng.paused
    assert c.state is State.READY and c.current_sleep is None
    c.complete(c.admit("r-after").rollout_id)
    assert check_journal(j.records) == []


def test_a_sleep_that_errors_leaves_memory_unknown_and_taints() -> None:
    r, a, eng, j = rig()
    a.inject("sleep", FaultKind.RAISE)
    with pytest.raises(UpdateFailed) as ex:
        r.sleep(2)
    assert ex.value.classification == "ambiguous" and r.controller.state is State.TAINTED
    r2, a2, _, _ = rig()
    a2.inject("sleep", FaultKind.LIE)  # the engine says it is not asleep
    with pytest.raises(UpdateFailed, match="does not report sleeping"):
        r2.sleep(2)
    assert r2.controller.state is State.TAINTED


def test_rollouts_still_bound_refuse_the_sleep_and_nothing_is_touched() -> None:
    r, a, eng, j = rig()
    r.deadlines = Deadlines(**{**FAST.__dict__, "drain_s": 0.2})
    b = r.controller.admit("r-long")
    with pytest.raises(UpdateFailed, match="still bound") as ex:
        r.sleep(2)
    assert ex.value.state == "READY" and not eng.asleep and not eng.paused
    assert r.controller.complete(b.rollout_id).attributable
    assert r.sleep(2).state is State.SLEEPING


def test_a_wake_whose_preflight_fails_is_refused_and_the_engine_still_sleeps() -> None:
    r, a, eng, j = rig()
    r.sleep(2)
    a.stage(B)
    with pytest.raises(UpdateRefused, match="still sleeps"):
        r.wake_update(C.identity())  # C's provenance is not the staged source's
    assert r.controller.state is State.SLEEPING and eng.asleep == {"weights", "kv_cache"}
    assert r.controller.current_ticket is None
    assert r.wake_update(B.identity()).published is not None


def test_the_runner_refuses_an_adapter_that_cannot_sleep() -> None:
    class NoSleep(FakeAdapter):
        sleep = None  # type: ignore[assignment]

    eng = FakeEngine(A, token_delay_s=0.0)
    c = LifecycleController()
    r = LifecycleRunner(c, NoSleep(eng), FAST)
    r.adapter.stage(A)  # type: ignore[attr-defined]
    r.bootstrap(A.identity())
    with pytest.raises(UpdateRefused, match="Sleeper"):
        r.sleep(2)
    assert c.state is State.READY
    with pytest.raises(BadInput):
        LifecycleRunner(c, FakeAdapter(eng), FAST).sleep(3)
    with pytest.raises(UpdateRefused, match="nothing to wake"):
        LifecycleRunner(c, FakeAdapter(eng), FAST).wake()


# ---------------------------------------------------------------- the table, directly

def _sleeping() -> tuple[LifecycleController, Any, Journal]:
    j = Journal()
    c = LifecycleController(listener=j.listener)
    c.bootstrap(boot_ev(), ident(0))
    sl = c.request_sleep("trainer", 2)
    c.slept(sl, sleep_ev())
    return c, sl, j


def test_nothing_is_transferred_reset_or_admitted_while_asleep() -> None:
    c, sl, j = _sleeping()
    n = len(j.records)
    with pytest.raises(UpdateRefused, match="asleep"):
        c.request_update(ident(5), "other")
    t = request_wake_update(c)
    with pytest.raises(InvalidTransition):
        c.transferred(t, transfer_ev(t))
    with pytest.raises(InvalidTransition):
        c.invalidated(t, reset_ev())
    with pytest.raises(AdmissionRefused):
        c.admit("r")
    with pytest.raises(UpdateRefused, match="in progress"):
        c.request_update(ident(5), "other")
    with pytest.raises(UpdateRefused):
        c.request_sleep("again")
    c.woke(t, wake_ev(WakeTags.WEIGHTS))
    assert c.state is State.WAKING
    with pytest.raises(InvalidTransition):  # the KV cache is still asleep
        c.invalidated(t, reset_ev())
    with pytest.raises(AdmissionRefused):
        c.admit("r")
    assert j.records[n:] and c.state is State.WAKING


@pytest.mark.parametrize(("when", "tags"), [
    ("asleep", WakeTags.KV_CACHE),     # the KV cache before the weights
    ("asleep", WakeTags.ALL),          # an update that wakes everything before its transfer
    ("woken", WakeTags.KV_CACHE),      # the KV cache before the update wrote the weights
    ("woken", WakeTags.WEIGHTS),       # the weights twice
])
def test_a_wake_out_of_order_is_refused_and_changes_nothing(when: str, tags: WakeTags) -> None:
    c, sl, j = _sleeping()
    t = request_wake_update(c)
    if when == "woken":
        c.woke(t, wake_ev(WakeTags.WEIGHTS))
    before, n = c.snapshot(), len(j.records)
    with pytest.raises(InvalidTransition, match="woke"):
        c.woke(t, wake_ev(tags))
    assert c.snapshot() == before and len(j.records) == n


def test_a_restore_wakes_everything_at_once() -> None:
    c, sl, _ = _sleeping()
    t = c.request_wake(sl, "trainer")
    assert t.target.version == c.committed and t.min_verification >= \
        VerificationLevel.ENGINE_CHECKSUM
    with pytest.raises(InvalidTransition):
        c.woke(t, wake_ev(WakeTags.WEIGHTS))
    assert c.woke(t, wake_ev(WakeTags.ALL)).accepted and c.state is State.INVALIDATING


@pytest.mark.parametrize("check", [
    None,                                      # a label alone
    full_check(coverage=0.99),                 # one parameter not covered
    full_check(passed=False),
    Check("engine-parameters", True, coverage=1.0, level=VerificationLevel.MANIFEST),
])
def test_a_woken_engine_serves_only_after_every_parameter_was_verified(
        check: Check | None) -> None:
    c, sl, j = _sleeping()
    t = request_wake_update(c)
    c.woke(t, wake_ev(WakeTags.WEIGHTS))
    c.transferred(t, transfer_ev(t))
    c.woke(t, wake_ev(WakeTags.KV_CACHE))
    for k in CacheKind:
        c.invalidated(t, reset_ev(k))
    ev = ValidationEvidence(observed_label=t.target.version.label, label_supported=True,
                            paused=True, checks=() if check is None else (check,))
    v = c.validated(t, ev)
    assert v.tainted and not v.accepted
    assert any("every engine parameter" in p for p in v.problems)
    assert [x.label for x in c.published] == ["rc-0"]


def test_the_full_path_with_good_evidence_publishes() -> None:
    c, sl, j = _sleeping()
    t = request_wake_update(c)
    c.woke(t, wake_ev(WakeTags.WEIGHTS))
    c.transferred(t, transfer_ev(t))
    c.woke(t, wake_ev(WakeTags.KV_CACHE))
    for k in CacheKind:
        c.invalidated(t, reset_ev(k))
    assert c.validated(t, wake_validation_ev(t)).accepted
    from coretools import resume_ev
    v = c.resumed(t, resume_ev())
    assert v.published == t.target.version and c.state is State.READY
    assert c.current_sleep is None and check_journal(j.records) == []
    assert any(isinstance(r.record, Commit) for r in j.records)


def test_request_wake_checks_its_arguments_and_the_preflight() -> None:
    c, sl, j = _sleeping()
    with pytest.raises(BadInput, match="SleepTicket"):
        c.request_wake(None, "trainer")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="PreflightEvidence"):
        c.request_wake(sl, "trainer", ident(1))
    with pytest.raises(BadInput, match="restore"):
        c.request_wake(sl, "trainer", preflight=PreflightEvidence("0" * 64))
    with pytest.raises(UpdateRefused, match="not the sleep"):
        c.request_wake(type(sl)(7, "x", 2), "trainer")
    n = len(j.records)
    with pytest.raises(UpdateRefused, match="still sleeps"):
        c.request_wake(sl, "trainer", ident(1), preflight=PreflightEvidence("0" * 64))
    assert c.current_ticket is None and c.state is State.SLEEPING
    # the refused preflight is on the record (evidence and its problems), nothing else
    assert [type(r.record) for r in j.records[n:]] == [EvidenceSeen]
    with pytest.raises(BadInput):
        c.request_sleep("", 2)
    with pytest.raises(BadInput):
        c.request_sleep("x", 0)


@pytest.mark.parametrize("state", [State.DOZING, State.SLEEPING, State.WAKING,
                                   State.WARMING])
def test_only_the_owner_can_fail_a_sleep_or_its_wake(state: State) -> None:
    from coretools import drive_to
    c, t = drive_to(state)
    step = {State.DOZING: Step.SLEEP, State.SLEEPING: Step.WAKE, State.WAKING: Step.TRANSFER,
            State.WARMING: Step.WAKE}[state]
    from rolloutcore.core.lifecycle import FailureKind
    with pytest.raises(UpdateRefused):
        c.fail(None, step, FailureKind.ERROR, "not yours")
    assert c.state is state
    assert c.fail(t, step, FailureKind.ERROR, "yours").tainted


def test_a_controller_restarted_while_the_engine_sleeps_taints() -> None:
    c, sl, j = _sleeping()
    r = LifecycleController.restore(j.records)
    assert r.state is State.TAINTED and r.current_sleep is None
    t = request_wake_update(c)
    r2 = LifecycleController.restore(j.records)
    assert r2.state is State.TAINTED and r2.current_ticket is None
    assert t.update_id == 1
