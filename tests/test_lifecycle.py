"""The transition table, walked pair by pair, and the failure policy, row by row."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from coretools import (
    boot_ev,
    drain_ev,
    drive_to,
    ident,
    preflight_ev,
    recovery_ev,
    request_wake_update,
    reset_ev,
    resume_ev,
    sleep_ev,
    transfer_ev,
    validation_ev,
    wake_ev,
    whole,
)
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.core.evidence import (
    CacheKind,
    Check,
    DrainEvidence,
    PauseMode,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import Classification, Event, FailureKind, State, Step
from rolloutcore.core.lifecycle_state import ControllerConfig, SleepTicket, UpdateTicket
from rolloutcore.core.records import Refuse, Restore, Taint, Transition
from rolloutcore.core.rules import (
    ABORT_STEPS,
    ESCALATION,
    FAIL_STEPS,
    FAILURE_POLICY,
    FAILURE_TARGETS,
    OUTCOMES,
    STEP_STATE,
    TRANSITIONS,
    Lookup,
    targets,
)
from rolloutcore.core.versions import VerificationLevel, WeightVersion
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    InvalidTransition,
    JournalError,
    UpdateRefused,
)

_STEP_OF_STATE = {v: k for k, v in STEP_STATE.items()}
# Colocated states whose step runs elsewhere first (STEP_STATE keeps the first).
_STEP_OF_STATE.update({State.WAKING: Step.TRANSFER, State.WARMING: Step.WAKE})


def _dummy_ticket() -> UpdateTicket:
    t = UpdateTarget(WeightVersion(5, "rc-5", "e0"), ident(5), "intruder")
    return UpdateTicket(999, t, VerificationLevel.DECLARED)


def _woke(c: LifecycleController, t: Any) -> Any:
    """A wake call: in SLEEPING the wake's owner asks first (a colocated update)."""
    if not isinstance(t, UpdateTicket):
        t = request_wake_update(c) if c.state is State.SLEEPING else _dummy_ticket()
    from rolloutcore.core.evidence import WakeTags
    return c.woke(t, wake_ev(WakeTags.WEIGHTS if c.state is State.SLEEPING
                             else WakeTags.KV_CACHE))


def _fire(c: LifecycleController, t: Any, event: Event, state: State) -> Any:
    tk = t if isinstance(t, UpdateTicket) else _dummy_ticket()
    sl = c.current_sleep or SleepTicket(9, "intruder", 2)
    calls: dict[Event, Callable[[], Any]] = {
        Event.BOOTSTRAP: lambda: c.bootstrap(boot_ev(), ident(0)),
        Event.ADMIT: lambda: c.admit("r-matrix"),
        Event.COMPLETE: lambda: c.complete("no-such-rollout"),
        Event.REQUEST_UPDATE: lambda: c.request_update(ident(2, "other"), "trainer-2"),
        Event.DRAINED: lambda: c.drained(tk, drain_ev()),
        Event.PREFLIGHTED: lambda: c.preflighted(tk, preflight_ev(tk)),
        Event.TRANSFERRED: lambda: c.transferred(tk, transfer_ev(tk)),
        Event.INVALIDATED: lambda: c.invalidated(tk, reset_ev(CacheKind.PREFIX)),
        Event.VALIDATED: lambda: c.validated(tk, validation_ev(tk)),
        Event.RESUMED: lambda: c.resumed(tk, resume_ev()),
        Event.FAIL: lambda: c.fail(t, _STEP_OF_STATE.get(state, Step.RESUME),
                                   FailureKind.ERROR, "boom"),
        Event.BEGIN_RECOVERY: lambda: c.begin_recovery("operator"),
        Event.RECOVERED: lambda: c.recovered(recovery_ev(c)),
        Event.REQUEST_SLEEP: lambda: c.request_sleep("trainer-2", 2),
        Event.SLEPT: lambda: c.slept(sl, sleep_ev()),
        Event.REQUEST_WAKE: lambda: request_wake_update(c) if c.current_sleep is not None
        else c.request_wake(sl, "trainer"),
        Event.WOKE: lambda: _woke(c, t),
    }
    return calls[event]()


#: Where each legal pair leads with good evidence (FAIL uses FailureKind.ERROR).
EXPECTED = {
    (State.UNINITIALIZED, Event.BOOTSTRAP): State.READY,
    (State.UNINITIALIZED, Event.FAIL): State.UNINITIALIZED,
    (State.READY, Event.ADMIT): State.READY,
    (State.READY, Event.REQUEST_UPDATE): State.DRAINING,
    (State.READY, Event.FAIL): State.TAINTED,                     # engine lost serving
    (State.DRAINING, Event.DRAINED): State.QUIESCED,
    (State.DRAINING, Event.FAIL): State.RESUMING,
    (State.QUIESCED, Event.PREFLIGHTED): State.UPDATING,
    (State.QUIESCED, Event.FAIL): State.RESUMING,
    (State.UPDATING, Event.TRANSFERRED): State.INVALIDATING,
    (State.UPDATING, Event.FAIL): State.TAINTED,
    (State.INVALIDATING, Event.INVALIDATED): State.INVALIDATING,  # one of three caches
    (State.INVALIDATING, Event.FAIL): State.INVALIDATING,         # incomplete: retry
    (State.VALIDATING, Event.VALIDATED): State.RESUMING,
    (State.VALIDATING, Event.FAIL): State.VALIDATING,             # incomplete: retry
    (State.RESUMING, Event.RESUMED): State.READY,
    (State.RESUMING, Event.FAIL): State.TAINTED,
    (State.TAINTED, Event.BEGIN_RECOVERY): State.RECOVERING,
    (State.RECOVERING, Event.RECOVERED): State.READY,
    (State.RECOVERING, Event.FAIL): State.TAINTED,
    (State.READY, Event.REQUEST_SLEEP): State.DOZING,
    (State.DOZING, Event.SLEPT): State.SLEEPING,
    (State.DOZING, Event.FAIL): State.TAINTED,                  # /sleep errored: unknown
    (State.SLEEPING, Event.REQUEST_WAKE): State.SLEEPING,       # a colocated update opens
    (State.SLEEPING, Event.WOKE): State.WAKING,
    (State.SLEEPING, Event.FAIL): State.TAINTED,
    (State.WAKING, Event.TRANSFERRED): State.WARMING,
    (State.WAKING, Event.FAIL): State.TAINTED,
    (State.WARMING, Event.WOKE): State.INVALIDATING,
    (State.WARMING, Event.FAIL): State.TAINTED,
}

_ALL_CACHES = sorted(k.value for k in CacheKind)


def _expected_whole(state: State, event: Event, before: dict[str, Any]) -> dict[str, Any]:
    """The whole state after a legal (state, event) fired by ``_fire``: ``before`` plus
    exactly what the pair changes."""
    after = dict(before)
    to = EXPECTED[(state, event)]
    after["state"] = to.value
    if to is not state:
        after["transitions"] = before["transitions"] + 1
    upd = dict(before["update"]) if before["update"] else None

    def published(v: dict[str, Any], identity: dict[str, Any]) -> None:
        after.update(committed=v, identity=identity, published=[*before["published"], v],
                     update=None, ticket=None, pending_resets=_ALL_CACHES)

    wake_update = {"update_id": 1, "target": WeightVersion(1, "rc-1", "e0").to_dict(),
                   "owner": "trainer", "aborting": False, "mutation_started": False}
    if event is Event.REQUEST_SLEEP:
        after["sleep"] = {"sleep_id": 1, "owner": "trainer-2", "level": 2}
    elif (state, event) in ((State.SLEEPING, Event.REQUEST_WAKE),
                            (State.SLEEPING, Event.WOKE)):
        after.update(update=wake_update, ticket=1, next_label="rc-2")  # rc-1 burnt
    elif (state, event) == (State.WAKING, Event.TRANSFERRED):
        assert upd is not None
        after["update"] = {**upd, "mutation_started": True}
    if (state, event) == (State.UNINITIALIZED, Event.BOOTSTRAP):
        published(WeightVersion(0, "rc-0", "e0").to_dict(), ident(0).to_dict())
        after["next_label"] = "rc-1"
    elif event is Event.ADMIT:
        after["active"] = {"r-matrix": before["committed"]}
        after["active_rollouts"] = 1
    elif event is Event.REQUEST_UPDATE:
        after["update"] = {"update_id": 1, "target": WeightVersion(1, "rc-1", "e0").to_dict(),
                           "owner": "trainer-2", "aborting": False, "mutation_started": False}
        after["ticket"] = 1
    elif (state, event) in ((State.DRAINING, Event.FAIL), (State.QUIESCED, Event.FAIL)):
        assert upd is not None
        after["update"] = {**upd, "aborting": True}
    elif event is Event.PREFLIGHTED:
        after["next_label"] = "rc-2"  # rc-1 may reach the engine from here: burnt
    elif event is Event.TRANSFERRED:
        assert upd is not None
        after["update"] = {**upd, "mutation_started": True}
    elif event is Event.INVALIDATED:
        after["pending_resets"] = [k for k in before["pending_resets"] if k != "prefix"]
    elif event is Event.RESUMED:
        ident1 = ident(1, "next").verified(VerificationLevel.MANIFEST, ["label=rc-1"])
        published(WeightVersion(1, "rc-1", "e0").to_dict(), ident1.to_dict())
        after["next_label"] = "rc-2"
    elif event is Event.RECOVERED:
        label = before["next_label"]
        rid = ident(99, "recovery").verified(VerificationLevel.MANIFEST, [f"label={label}"])
        published(WeightVersion(int(label[3:]), label, "e-new").to_dict(), rid.to_dict())
        after["next_label"] = f"rc-{int(label[3:]) + 1}"
    if to is State.TAINTED:
        after.update(update=None, ticket=None, pending_resets=_ALL_CACHES, sleep=None)
    return after


def test_expected_covers_every_legal_pair_but_complete() -> None:
    legal = {k for k in TRANSITIONS if k[1] is not Event.COMPLETE}
    assert set(EXPECTED) == legal
    for k, v in EXPECTED.items():
        assert v in targets(*k)


def test_every_table_entry_names_one_target_or_one_outcome_table() -> None:
    for (s, e), rule in TRANSITIONS.items():
        assert isinstance(rule, (State, Lookup)), (s, e)
        if isinstance(rule, Lookup):
            assert rule in OUTCOMES
    # Every class a reported failure can take, in every state it can be reported in,
    # escalated or overridden, leads somewhere: the failure lookup has no hole.
    for steps in (FAIL_STEPS, ABORT_STEPS):
        for (s, _), row in steps.items():
            assert TRANSITIONS[(s, Event.FAIL)] is Lookup.FAILURE
            for k in FailureKind:
                cls = FAILURE_POLICY[(row, k)]
                classes = {cls, ESCALATION.get(row, cls)}
                if Classification.NO_MUTATION in classes and s is not State.UNINITIALIZED:
                    classes.add(Classification.AMBIGUOUS)  # a mutation was seen
                for c in classes:
                    assert (s, c) in FAILURE_TARGETS, (s, row, k, c)
    assert set(STEP_STATE) == set(Step) - {Step.RESTART}


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_every_state_event_pair(state: State, event: Event) -> None:
    """h11's test_state, one step further: every pair, and the whole state after it."""
    j = Journal()
    c, t = drive_to(state, j)
    before = whole(c)
    n = len(j.records)
    if (state, event) not in TRANSITIONS:
        with pytest.raises((InvalidTransition, AdmissionRefused, UpdateRefused)):
            _fire(c, t, event, state)
        assert whole(c) == before, "an illegal event changed the controller"
        # ...and recorded nothing but the refusal of an admission.
        assert [type(r.record) for r in j.records[n:]] == ([Refuse] if event is Event.ADMIT
                                                           else [])
        return
    if event is Event.COMPLETE:
        with pytest.raises(BadInput):
            _fire(c, t, event, state)
        assert whole(c) == before
        assert len(j.records) == n
        return
    _fire(c, t, event, state)
    assert c.state is EXPECTED[(state, event)]
    assert whole(c) == _expected_whole(state, event, before)
    assert check_journal(j.records) == []
    if c.state is not state:
        tr = [r.record for r in j.records[n:] if isinstance(r.record, Transition)]
        assert [(x.before, x.after) for x in tr] == [(state, c.state)]


@pytest.mark.parametrize("state", list(State))
def test_restore_replays_every_state(state: State) -> None:
    """The journal of any state replays to it; mid-update or mid-recovery it taints."""
    j = Journal()
    c, _ = drive_to(state, j)
    before = whole(c)
    j2 = Journal()
    r = LifecycleController.restore(j.records, listener=j2.listener)
    got = whole(r)
    mid = (state, Step.RESTART) in FAIL_STEPS
    want_state = State.TAINTED if mid else state
    assert got["state"] == want_state.value
    for k in ("committed", "identity", "published", "active", "next_label"):
        assert got[k] == before[k], k
    if mid:
        assert got["update"] is None and got["ticket"] is None
        assert [type(x.record) for x in j2.records] == [Restore, Transition, Taint]
        assert r.history()[-1]["event"] == "fail"
    else:
        assert got["update"] == before["update"]
        assert [type(x.record) for x in j2.records] == [Restore]
    assert check_journal([*j.records, *j2.records]) == [] or state is State.UNINITIALIZED


def test_restore_refuses_a_journal_the_tables_do_not_allow() -> None:
    j = Journal()
    drive_to(State.READY, j)
    recs = [r.record for r in j.records]
    bogus = Transition(State.READY, State.UPDATING, Event.PREFLIGHTED, 0.0)
    with pytest.raises(JournalError, match="not a transition of its tables"):
        LifecycleController.restore([*recs, bogus])
    with pytest.raises(JournalError, match="without the request_update"):
        LifecycleController.restore([*recs, Transition(State.READY, State.DRAINING,
                                                       Event.REQUEST_UPDATE, 0.0)])


def test_stale_ticket_is_refused_and_changes_nothing() -> None:
    c, t = drive_to(State.DRAINING)
    before = c.snapshot()
    with pytest.raises(UpdateRefused):
        c.drained(_dummy_ticket(), drain_ev())
    assert c.snapshot() == before


def test_single_writer() -> None:
    c, _ = drive_to(State.READY)
    t1 = c.request_update(ident(1), "trainer-a")
    with pytest.raises(UpdateRefused, match="trainer-a"):
        c.request_update(ident(2), "trainer-b")
    assert c.current_ticket == t1


def test_admission_refused_says_why_and_when() -> None:
    c, _ = drive_to(State.DRAINING)
    with pytest.raises(AdmissionRefused) as ei:
        c.admit("r1")
    assert ei.value.retry_after_s and ei.value.retry_after_s > 0
    assert "update" in ei.value.reason
    c2, _ = drive_to(State.TAINTED)
    with pytest.raises(AdmissionRefused) as ei2:
        c2.admit("r1")
    assert ei2.value.retry_after_s is None


def test_bad_input_changes_nothing() -> None:
    c, _ = drive_to(State.READY)
    before = c.snapshot()
    for bad in ["", "x" * 300, 5]:
        with pytest.raises(BadInput):
            c.admit(bad)  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        c.request_update("not an identity", "o")  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        c.request_update(ident(1), "")
    c.admit("dup")
    with pytest.raises(BadInput):
        c.admit("dup")
    c.complete("dup")
    assert c.snapshot() == before


def test_happy_path_publishes_with_binding_and_verification() -> None:
    j = Journal()
    c, t = drive_to(State.RESUMING, j)
    assert t is not None
    v = c.resumed(t, resume_ev())
    assert v.accepted and v.published == t.target.version
    assert c.committed == WeightVersion(1, "rc-1", "e0")
    assert c.identity is not None
    assert c.identity.verification is VerificationLevel.MANIFEST  # label observed
    b = c.admit("r")
    assert b.version.label == "rc-1"


def test_drain_waits_for_bound_rollouts() -> None:
    c, _ = drive_to(State.READY)
    c.admit("old")
    t = c.request_update(ident(1), "trainer")
    v = c.drained(t, drain_ev())
    assert v.classification is Classification.INCOMPLETE and c.state is State.DRAINING
    done = c.complete("old")
    assert done.attributable and done.binding.version.label == "rc-0"
    assert c.drained(t, drain_ev()).accepted and c.state is State.QUIESCED


def test_keep_mode_cannot_drain_strict() -> None:
    c, t = drive_to(State.DRAINING)
    assert t is not None
    v = c.drained(t, DrainEvidence(paused=True, mode=PauseMode.KEEP, engine_in_flight=0))
    assert not v.accepted and c.state is State.DRAINING


def test_reset_body_false_is_a_failure_even_with_http_200() -> None:
    c, t = drive_to(State.INVALIDATING)
    assert t is not None
    v = c.invalidated(t, reset_ev(CacheKind.PREFIX, ok=False))
    assert not v.accepted and v.classification is Classification.INCOMPLETE
    assert CacheKind.PREFIX in c.pending_resets


def test_validation_label_mismatch_taints() -> None:
    c, t = drive_to(State.VALIDATING)
    assert t is not None
    v = c.validated(t, validation_ev(t, label="rc-0"))
    assert v.tainted and c.committed is not None and c.committed.label == "rc-0"
    with pytest.raises(AdmissionRefused):
        c.admit("r")


def test_validation_without_any_evidence_taints() -> None:
    c, t = drive_to(State.VALIDATING)
    assert t is not None
    v = c.validated(t, ValidationEvidence(observed_label=None, label_supported=False,
                                          paused=True))
    assert v.tainted


def test_validation_must_be_paused() -> None:
    c, t = drive_to(State.VALIDATING)
    assert t is not None
    v = c.validated(t, ValidationEvidence(observed_label=t.target.version.label,
                                          label_supported=True, paused=False))
    assert v.tainted


def test_live_probe_failure_taints_and_min_verification_is_enforced() -> None:
    c, t = drive_to(State.RESUMING)
    assert t is not None
    live = ValidationEvidence(observed_label=t.target.version.label, label_supported=True,
                              paused=False, checks=(Check("policy-probe", False, "diff 3.0",
                                                          level=VerificationLevel.PROBE),))
    assert c.resumed(t, resume_ev(), live).tainted
    c2, _ = drive_to(State.READY)
    t2 = c2.request_update(ident(1), "tr", min_verification=VerificationLevel.PROBE)
    c2.drained(t2, drain_ev())
    c2.preflighted(t2, preflight_ev(t2))
    c2.transferred(t2, transfer_ev(t2))
    for k in CacheKind:
        c2.invalidated(t2, reset_ev(k))
    c2.validated(t2, validation_ev(t2))
    v = c2.resumed(t2, resume_ev(), None)
    assert v.tainted and "requires probe" in v.problems[0]


def test_probe_reaches_probe_level() -> None:
    c, t = drive_to(State.RESUMING)
    assert t is not None
    live = ValidationEvidence(observed_label=t.target.version.label, label_supported=True,
                              paused=False, checks=(Check("policy-probe", True, "ok",
                                                          max_abs_diff=0.01, tolerance=0.05,
                                                          level=VerificationLevel.PROBE),))
    v = c.resumed(t, resume_ev(), live)
    assert v.accepted and c.identity is not None
    assert c.identity.verification is VerificationLevel.PROBE
    assert any("policy-probe=pass" in e for e in c.identity.evidence)


def test_transfer_refused_before_mutation_returns_to_ready() -> None:
    c, t = drive_to(State.UPDATING)
    assert t is not None
    v = c.fail(t, Step.TRANSFER, FailureKind.REFUSED, "start_weight_update refused")
    assert v.classification is Classification.NO_MUTATION and c.state is State.RESUMING
    v2 = c.resumed(t, resume_ev())
    assert v2.accepted and v2.published is None and c.state is State.READY
    assert c.committed is not None and c.committed.label == "rc-0"
    # rc-1 reached begin_update, so it may have reached the engine: never reused
    t2 = c.request_update(ident(1), "trainer")
    assert t2.target.version.label == "rc-2"


def test_label_abandoned_before_mutation_is_reused() -> None:
    c, t = drive_to(State.QUIESCED)
    assert t is not None
    c.fail(t, Step.PREFLIGHT, FailureKind.BAD_EVIDENCE, "manifest differs")
    c.resumed(t, resume_ev())
    assert c.request_update(ident(1), "trainer").target.version.label == "rc-1"


def test_transfer_bad_evidence_taints_even_if_it_claims_no_mutation() -> None:
    c, t = drive_to(State.UPDATING)
    assert t is not None
    ev = TransferEvidence(completed=False, mutation_started=False, backend="x", error="half")
    assert c.transferred(t, ev).tainted


def test_recovery_publishes_new_generation_on_new_epoch() -> None:
    c, _ = drive_to(State.RECOVERING)
    v = c.recovered(recovery_ev(c, "e-new"))
    assert v.accepted and c.state is State.READY
    assert c.committed is not None and c.committed.engine_epoch == "e-new"
    assert c.committed.generation == 2  # rc-1 was never published, but is burnt


def test_recovery_on_same_epoch_is_refused() -> None:
    c, _ = drive_to(State.RECOVERING)
    v = c.recovered(recovery_ev(c, "e0"))
    assert v.tainted


def test_engine_lost_while_serving_taints_and_only_recovery_returns() -> None:
    from rolloutcore.core.invariants import check_journal

    j = Journal()
    c, _ = drive_to(State.READY, j)
    b = c.admit("r-inflight")
    published = c.published
    # Wrong step, or a ticket: refused, nothing changes.
    before = c.snapshot()
    with pytest.raises(InvalidTransition):
        c.fail(None, Step.TRANSFER, FailureKind.DIED, "x")
    with pytest.raises(BadInput):
        c.fail(_dummy_ticket(), Step.SERVE, FailureKind.DIED, "x")
    assert c.snapshot() == before
    v = c.fail(None, Step.SERVE, FailureKind.DIED, "engine pid 4242 exited")
    assert v.tainted and v.classification is Classification.AMBIGUOUS
    assert "engine pid 4242 exited" in v.problems
    assert c.state is State.TAINTED and c.published == published
    with pytest.raises(AdmissionRefused):
        c.admit("r-after")
    # The rollout bound before the loss completes, but is not attributable.
    done = c.complete("r-inflight")
    assert done.binding == b and done.attributable is False
    # A serving failure is not an update failure: it is refused once tainted.
    with pytest.raises(InvalidTransition):
        c.fail(None, Step.SERVE, FailureKind.DIED, "again")
    # The journal replays to TAINTED, with no invariant broken.
    assert LifecycleController.restore(j.records).state \
        is State.TAINTED
    c.begin_recovery("operator")
    rv = c.recovered(recovery_ev(c, "e-replacement"))
    assert rv.accepted and c.state is State.READY
    assert c.committed is not None and c.committed.engine_epoch == "e-replacement"
    assert check_journal(j.records) == []


@pytest.mark.parametrize("kind", list(FailureKind))
@pytest.mark.parametrize(("state", "step"), list(FAIL_STEPS))
def test_failure_policy_row(state: State, step: Step, kind: FailureKind) -> None:
    """Every step in every state it can be reported in, for every kind: one lookup each."""
    row = FAIL_STEPS[(state, step)]
    cls = FAILURE_POLICY[(row, kind)]
    c, t = drive_to(state)
    published_before = c.published
    v = c.fail(t, step, kind, f"{step.value} {kind.value}")
    assert v.classification is cls
    assert c.state is FAILURE_TARGETS[(state, cls)]
    if state is State.UNINITIALIZED:
        assert c.state is State.UNINITIALIZED
    elif cls is Classification.NO_MUTATION:
        # A sleep refused up front serves on; a woken engine has no old version left.
        assert c.state is {State.DOZING: State.READY,
                           State.WAKING: State.TAINTED}.get(state, State.RESUMING)
    elif cls is Classification.INCOMPLETE:
        assert c.state is state
    else:
        assert c.state is State.TAINTED
        with pytest.raises(AdmissionRefused):
            c.admit("x")
    assert c.published == published_before, "a failure published something"


@pytest.mark.parametrize("step", sorted(ESCALATION, key=str))
def test_incomplete_escalates_after_retries(step: Step) -> None:
    c, t = drive_to(STEP_STATE[step])
    cfg = ControllerConfig()
    kind = next(k for k in FailureKind if FAILURE_POLICY[(step, k)] is Classification.INCOMPLETE)
    for _ in range(cfg.max_incomplete):
        assert c.fail(t, step, kind, "again").classification is Classification.INCOMPLETE
    v = c.fail(t, step, kind, "last")
    assert v.classification is ESCALATION[step]
    expected = State.RESUMING if ESCALATION[step] is Classification.NO_MUTATION else \
        State.TAINTED
    assert c.state is expected


def test_failure_in_abort_path_taints() -> None:
    c, t = drive_to(State.QUIESCED)
    assert t is not None
    c.fail(t, Step.PREFLIGHT, FailureKind.ERROR, "x")
    assert c.state is State.RESUMING
    with pytest.raises(InvalidTransition):
        c.fail(t, Step.PREFLIGHT, FailureKind.ERROR, "again")
    assert c.fail(t, Step.RESUME, FailureKind.ERROR, "resume failed").tainted


def test_concurrent_admissions_and_update_keep_invariants() -> None:
    """Many threads admit/complete while another drives updates; no rollout straddles."""
    from rolloutcore.core.invariants import check_journal

    j = Journal()
    c, _ = drive_to(State.READY, j)
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            rid = f"w{n}-{i}"
            try:
                b = c.admit(rid)
            except AdmissionRefused:
                continue
            try:
                assert c.committed == b.version or c.state is not State.READY
            except AssertionError as e:  # pragma: no cover
                errors.append(e)
            c.complete(rid)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for th in threads:
        th.start()
    try:
        for step in range(1, 6):
            t = c.request_update(ident(step), "trainer")
            assert c.wait_idle(5.0)
            assert c.drained(t, drain_ev()).accepted
            c.preflighted(t, preflight_ev(t))
            c.transferred(t, transfer_ev(t))
            for k in CacheKind:
                c.invalidated(t, reset_ev(k))
            c.validated(t, validation_ev(t))
            assert c.resumed(t, resume_ev()).accepted
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors
    assert [v.label for v in c.published] == ["rc-0", "rc-1", "rc-2", "rc-3", "rc-4", "rc-5"]
    assert check_journal(j.records) == []
    assert sum(r.kind == "admit" for r in j.records) > 0


def test_wait_idle_reads_the_injected_clock() -> None:
    """The drain deadline is on the controller's clock, not the wall's."""
    now = [0.0]
    c = LifecycleController(clock=lambda: now[0])
    c.bootstrap(boot_ev(), ident(0))
    c.admit("r")
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(c.wait_idle(3600.0)))
    waiter.start()
    now[0] = 3600.5  # an hour passes on the controller's clock
    waiter.join(30)
    assert not waiter.is_alive() and got == [False]
    c.complete("r")
    assert c.wait_idle(3600.0) is True
