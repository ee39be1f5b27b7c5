"""The runner against the simulated engine: ordering, cache boundary, faults, deadlines."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import pytest

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, first_index
from rolloutcore.control.port import HealthObserver, LifecycleAdapter, Recoverer
from rolloutcore.control.runner import Deadlines, DrainPolicy, LifecycleRunner
from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    DrainEvidence,
    PauseMode,
    PreflightEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State, Step
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import AdmissionRefused, BadInput, UpdateFailed
from rolloutcore.testing.fake import (
    FakeAdapter,
    FakeEngine,
    FakeRecoverer,
    FakeWeights,
    FaultKind,
    reference_tokens,
)

FAST = Deadlines(drain_s=5, pause_s=0.5, preflight_s=0.5, transfer_s=0.5, reset_s=0.5,
                 validate_s=0.5, resume_s=0.5, live_validate_s=5, bootstrap_s=2, fence_s=0.5,
                 cancel_grace_s=0.5,
                 retry_backoff_s=0.01, read_slack_s=0.1)
#: The deadline a hung effect waits out (it never completes: its own deadline need
#: leave no room for real work; the other steps keep FAST's).
HUNG_S = 0.1
_DEADLINE_OF = {"drain": "pause_s", "transfer": "transfer_s", "reset_prefix": "reset_s",
                "validate": "validate_s", "validate_live": "live_validate_s"}


def make(token_delay_s: float = 0.001) -> tuple[FakeEngine, FakeAdapter, LifecycleController,
                                                LifecycleRunner, Journal]:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=token_delay_s)
    ad = FakeAdapter(eng)
    j = Journal()
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, FAST, record=j.write)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    return eng, ad, c, r, j


def test_hot_update_changes_outputs_to_reference() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    out = r.run_update(w1.identity(), min_verification=VerificationLevel.PROBE)
    assert out.published is not None and out.published.label == "rc-1"
    assert c.identity is not None and c.identity.verification is VerificationLevel.PROBE
    g = eng.generate(list(range(20)), 8)
    assert g.tokens == reference_tokens(w1.digest, list(range(20)), 8)
    assert {p.phase for p in out.phases} >= {"drain", "pause", "preflight", "transfer",
                                             "invalidate", "validate", "resume"}
    assert check_journal(j.records) == []


def test_live_rollout_finishes_before_mutation_and_requests_during_update_are_refused() -> None:
    eng, ad, c, r, j = make(token_delay_s=0.005)
    res: dict[str, object] = {}
    b = c.admit("long")

    def long() -> None:
        res["g"] = eng.generate(list(range(40)), 60, request_id="long")
        c.complete("long")

    th = threading.Thread(target=long)
    th.start()
    time.sleep(0.05)
    refused: list[float | None] = []
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)

    def during() -> None:
        while c.state is State.READY:
            time.sleep(0.001)
        try:
            c.admit("late")
        except AdmissionRefused as e:
            refused.append(e.retry_after_s)

    probe = threading.Thread(target=during)
    probe.start()
    out = r.run_update(w1.identity())
    th.join()
    probe.join()
    g = res["g"]
    assert refused and refused[0] is not None
    assert out.published is not None
    assert {s["version"] for s in g.version_spans} == {b.version.label}  # type: ignore[attr-defined]
    recs = j.records
    assert 0 <= first_index(recs, "complete", rollout_id="long") < first_index(recs,
                                                                              "begin_update")
    assert out.phase_s("drain") > 0.05


def test_stale_prefix_cache_is_reused_without_the_boundary() -> None:
    """Negative control on the fake: skipping the reset serves stale KV and changes tokens."""
    eng, ad, c, r, j = make()
    prompt = list(range(48))
    eng.generate(prompt, 4)
    w1 = FakeWeights.from_seed(1, step=1)
    # Outside RolloutCore: swap weights, no reset.
    eng.pause(PauseMode.WAIT)
    eng.start_update()
    for n, data in w1.tensors.items():
        eng.load(n, data)
    eng.finish_update("rogue")
    eng.resume()
    hits0 = eng.prefix_hits
    stale = eng.generate(prompt, 8)
    assert eng.prefix_hits - hits0 > 0
    assert eng.reset_prefix_cache()
    fresh = eng.generate(prompt, 8)
    assert stale.tokens != fresh.tokens
    assert fresh.tokens == reference_tokens(w1.digest, prompt, 8)


def test_update_through_runner_serves_no_stale_cache() -> None:
    eng, ad, c, r, j = make()
    prompt = list(range(200, 248))  # shares no block with the probe prompts
    eng.generate(prompt, 4)
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    r.run_update(w1.identity())
    hits0 = eng.prefix_hits
    g = eng.generate(prompt, 8)
    # the live probe may have cached its own (fresh) prompts, not this one
    assert eng.prefix_hits == hits0
    assert g.tokens == reference_tokens(w1.digest, prompt, 8)


@pytest.mark.parametrize(("effect", "kind", "cls", "state"), [
    ("drain", FaultKind.RAISE, "no_mutation", State.READY),
    ("drain", FaultKind.HANG, "no_mutation", State.READY),
    ("preflight", FaultKind.LIE, "no_mutation", State.READY),
    ("transfer", FaultKind.RAISE, "ambiguous", State.TAINTED),
    ("transfer", FaultKind.HANG, "ambiguous", State.TAINTED),
    ("transfer", FaultKind.DIE, "ambiguous", State.TAINTED),
    ("transfer", FaultKind.LIE, "ambiguous", State.TAINTED),
    ("reset_prefix", FaultKind.HANG, "ambiguous", State.TAINTED),
    ("validate", FaultKind.LIE, None, State.READY),  # a lying checksum... caught by the probe
    ("validate", FaultKind.HANG, "ambiguous", State.TAINTED),
    ("validate_live", FaultKind.RAISE, "ambiguous", State.TAINTED),
    ("resume", FaultKind.RAISE, "ambiguous", State.TAINTED),
    ("resume", FaultKind.LIE, "ambiguous", State.TAINTED),
])
def test_fault_classification(effect: str, kind: FaultKind, cls: str | None,
                              state: State) -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject(effect, kind)
    if kind is FaultKind.HANG:
        r.deadlines = dataclasses.replace(FAST, **{_DEADLINE_OF[effect]: HUNG_S})
    t0 = time.monotonic()
    if cls is None:
        out = r.run_update(w1.identity(), min_verification=VerificationLevel.PROBE)
        assert out.published is not None  # the lie was harmless: weights are right
    else:
        with pytest.raises(UpdateFailed) as ei:
            r.run_update(w1.identity(), min_verification=VerificationLevel.PROBE)
        assert ei.value.classification == cls
        assert [v.label for v in c.published] == ["default"]
    elapsed = time.monotonic() - t0
    assert c.state is state
    assert elapsed < 15, "a failure must be classified within its deadline"
    assert check_journal(j.records) == []
    if state is State.TAINTED:
        with pytest.raises(AdmissionRefused):
            c.admit("after")


def test_reset_success_false_is_retried_then_taints() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("reset_prefix", FaultKind.LIE, times=10)
    with pytest.raises(UpdateFailed) as ei:
        r.run_update(w1.identity())
    assert ei.value.classification == "ambiguous" and c.state is State.TAINTED
    n = sum(1 for rec in j.records if rec.kind == "verdict"
            and rec.data["event"] == "invalidated" and not rec.data["accepted"])
    assert n == 4  # max_incomplete (3) retries, then escalation


def test_transient_reset_false_recovers() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("reset_prefix", FaultKind.LIE, times=2)
    out = r.run_update(w1.identity())
    assert out.published is not None


def test_skipped_parameter_caught_by_checksum_and_probe() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.skip_params = {"layers.2.weight"}
    with pytest.raises(UpdateFailed):
        r.run_update(w1.identity())
    assert c.state is State.TAINTED and c.committed is not None
    assert c.committed.label == "default"


def test_hang_is_classified_within_deadline() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    ad.inject("transfer", FaultKind.HANG)
    r.deadlines = d = dataclasses.replace(FAST, transfer_s=HUNG_S)
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed) as ei:
        r.run_update(w1.identity())
    dt = time.monotonic() - t0
    assert ei.value.phase == "transfer" and ei.value.classification == "ambiguous"
    assert dt < d.transfer_s + d.cancel_grace_s + d.fence_s + 1.0
    effects = [rec.data for rec in j.records if rec.kind == "effect"]
    assert any(e["step"] == "transfer" and not e["ok"] for e in effects)


def test_drain_timeout_with_a_stuck_rollout_returns_to_ready() -> None:
    """Drain policy REFUSE (the ABORT default: tests/test_drain_policy.py)."""
    eng, ad, c, r, j = make()
    c.admit("stuck")
    r.deadlines = Deadlines(drain_s=0.2, cancel_grace_s=0.1)
    r.drain_policy = DrainPolicy.REFUSE
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    with pytest.raises(UpdateFailed) as ei:
        r.run_update(w1.identity())
    assert ei.value.classification == "no_mutation" and c.state is State.READY
    assert not eng.paused
    c.complete("stuck")


# ------------------------------------------------------- failures while serving


def test_engine_death_while_serving_taints_after_two_checks_and_recovery_returns() -> None:
    from rolloutcore.core.lifecycle import Classification
    from rolloutcore.testing.fake import FakeRecoverer

    eng, ad, c, r, j = make()
    w0 = FakeWeights.from_seed(0)
    assert r.check_serving() is None and c.state is State.READY
    b = c.admit("r-serving")
    published = c.published
    eng.kill()
    # One failed observation is not a death (a slow /health under load).
    assert r.check_serving() is None and c.state is State.READY
    v = r.check_serving()
    assert v is not None and v.tainted and v.classification is Classification.AMBIGUOUS
    assert any("not answering" in p for p in v.problems)
    assert c.state is State.TAINTED and c.published == published
    with pytest.raises(AdmissionRefused):
        c.admit("r-after")
    assert c.complete(b.rollout_id).attributable is False
    assert r.check_serving() is None  # nothing to do outside READY
    r.recover(FakeRecoverer(ad, w0))
    assert c.state is State.READY
    assert r.check_serving() is None and c.state is State.READY  # the new process
    assert check_journal(j.records) == []


def test_engine_restarted_behind_the_controller_taints_at_once_and_is_fenced() -> None:
    eng, ad, c, r, j = make()
    w1 = FakeWeights.from_seed(1, step=1)
    ad.stage(w1)
    assert r.run_update(w1.identity()).published is not None
    # A supervisor restarts the engine on its start checkpoint: it answers and is
    # healthy, but it serves rc-0's weights under the controller's rc-1.
    eng.restart(FakeWeights.from_seed(0))
    v = r.check_serving()
    assert v is not None and v.tainted and c.state is State.TAINTED
    assert any("restarted" in p for p in v.problems)
    assert eng.paused  # fenced: it serves nobody, not even direct clients
    assert check_journal(j.records) == []


def test_a_transient_failure_resets_and_checks_stay_out_of_updates() -> None:
    eng, ad, c, r, _ = make()
    eng.dead = True
    assert r.check_serving() is None
    eng.dead = False  # the same process answers again
    assert r.check_serving() is None
    eng.dead = True
    assert r.check_serving() is None and c.state is State.READY  # counted from one again
    eng.dead = False
    # During an update the update's own effects classify failures: no observation.
    t = c.request_update(FakeWeights.from_seed(2, step=2).identity(), "trainer")
    eng.kill()
    assert r.check_serving() is None and r.check_serving() is None
    assert c.state is State.DRAINING and c.current_ticket == t
    with pytest.raises(BadInput):
        r.check_serving(failures_to_taint=0)
    with pytest.raises(BadInput):
        r.check_serving(timeout_s=0)


def _hang_until_cancelled(ad: FakeAdapter) -> Callable[[], None]:
    """Make ``ad``'s health reads hang until the watchdog cancels them (or the returned
    function is called); a released read raises."""
    reads: list[threading.Event] = []
    cancel = ad.cancel

    def hang(*, timeout_s: float) -> object:
        released = threading.Event()
        reads.append(released)
        released.wait(60)
        raise AssertionError("released")

    def release() -> None:
        for ev in reads:
            ev.set()

    def cancel_and_release(step: Step) -> None:
        cancel(step)
        release()

    ad.observe_health = hang  # type: ignore[method-assign]
    ad.cancel = cancel_and_release  # type: ignore[method-assign]
    return release


def test_a_hanging_health_read_is_a_timeout_and_taints_within_the_deadline() -> None:
    eng, ad, c, r, _ = make()
    release = _hang_until_cancelled(ad)
    t0 = time.monotonic()
    assert r.check_serving(timeout_s=0.05) is None
    v = r.check_serving(timeout_s=0.05)
    release()
    assert v is not None and v.tainted
    assert any("deadline" in p or "timed out" in p or "timeout" in p for p in v.problems)
    # Both checks ended at their deadlines, long before the read would have.
    assert time.monotonic() - t0 < 30


# ------------------------------------------------------- the port


class _CancelRecorder(FakeAdapter):
    """The fake adapter, recording which step the watchdog cancelled."""

    def __init__(self, engine: FakeEngine) -> None:
        super().__init__(engine)
        self.cancelled: list[Step] = []

    def cancel(self, step: Step) -> None:
        self.cancelled.append(step)
        super().cancel(step)


def test_the_watchdog_cancels_the_overrunning_step_by_its_typed_name() -> None:
    w0 = FakeWeights.from_seed(0)
    ad = _CancelRecorder(FakeEngine(w0, token_delay_s=0.001))
    c = LifecycleController()
    r = LifecycleRunner(c, ad, FAST)
    ad.stage(w0)
    r.bootstrap(w0.identity())
    for effect, step in (("transfer", Step.TRANSFER), ("validate_live", Step.VALIDATE)):
        w = FakeWeights.from_seed(len(ad.cancelled) + 1, step=len(ad.cancelled) + 1)
        ad.stage(w)
        ad.inject(effect, FaultKind.HANG)
        r.deadlines = dataclasses.replace(FAST, **{_DEADLINE_OF[effect]: HUNG_S})
        with pytest.raises(UpdateFailed):
            r.run_update(w.identity())
        assert ad.cancelled[-1] is step and all(isinstance(s, Step) for s in ad.cancelled)
        r.recover(FakeRecoverer(ad, w0))
    release = _hang_until_cancelled(ad)
    r.check_serving(timeout_s=0.05)
    release()
    assert ad.cancelled[-1] is Step.SERVE


class _PortOnly:
    """Exactly the port, nothing more: no health observation."""

    def __init__(self, inner: FakeAdapter) -> None:
        self.inner = inner

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        return self.inner.caches

    def bootstrap(self) -> BootstrapEvidence:
        return self.inner.bootstrap()

    def drain(self, mode: PauseMode) -> DrainEvidence:
        return self.inner.drain(mode)

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        return self.inner.preflight(target)

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        return self.inner.transfer(target)

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        return self.inner.reset_cache(cache)

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        return self.inner.validate(target, live=live)

    def resume(self) -> ResumeEvidence:
        return self.inner.resume()

    def fence(self) -> None:
        self.inner.fence()

    def cancel(self, step: Step) -> None:
        self.inner.cancel(step)


def test_health_observation_is_a_capability_the_runner_tests_for() -> None:
    w0 = FakeWeights.from_seed(0)
    eng = FakeEngine(w0, token_delay_s=0.001)
    fake = FakeAdapter(eng)
    port = _PortOnly(fake)
    assert isinstance(port, LifecycleAdapter) and not isinstance(port, HealthObserver)
    assert isinstance(fake, LifecycleAdapter) and isinstance(fake, HealthObserver)
    assert isinstance(FakeRecoverer(fake, w0), Recoverer)
    c = LifecycleController()
    r = LifecycleRunner(c, port, FAST)
    fake.stage(w0)
    r.bootstrap(w0.identity())
    w1 = FakeWeights.from_seed(1, step=1)
    fake.stage(w1)
    assert r.run_update(w1.identity()).published is not None  # the port alone runs updates
    eng.kill()
    # Unwatched: the runner cannot see the death, and says nothing about it.
    assert r.check_serving() is None and r.check_serving() is None
    assert c.state is State.READY
