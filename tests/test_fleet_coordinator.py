"""The fleet coordinator over simulated engines (fast lane).

Each replica is a FakeEngine under its own, unchanged, controller and runner;
the coordinator drives them. Checked: the pool table and the two decisions
(``core.pool``); synchronous updates (one fan-out broadcast, quorum,
nothing published below it, no admission during the transition, every
answer made by the version it was bound to); rolling updates (never fewer
than min_serving serving, two versions during the roll); taint, recovery and
rejoin on the fleet's current version; bad input changes nothing.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from fleettools import FakeFleet, fake_fleet, weights
from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import (
    REPLICA_TRANSITIONS,
    FleetAbandon,
    FleetClosed,
    FleetPublish,
    FleetUpdateBegin,
    FleetUpdateEnd,
    ReplicaEvent,
    ReplicaOutcome,
    ReplicaStateChange,
    Strategy,
    WaveBegin,
    decide_synchronous,
    next_state,
    plan_waves,
)
from rolloutcore.core.records import Admit
from rolloutcore.errors import AdmissionRefused, BadInput, InvalidTransition, UpdateRefused
from rolloutcore.fleet import (
    FleetConfig,
    FleetUpdateFailed,
    Outcome,
    Policy,
    ReplicaState,
    Router,
    RouteRefused,
)
from rolloutcore.testing.fake import FakeWeights

S = ReplicaState


# --------------------------------------------------------------------------- the tables

def test_every_state_but_removed_can_be_removed_and_nothing_else_is_implicit() -> None:
    for s in S:
        if s is not S.REMOVED:
            assert next_state(s, ReplicaEvent.REMOVE) is S.REMOVED
    with pytest.raises(InvalidTransition, match="SERVING"):
        next_state(S.SERVING, ReplicaEvent.PASSED)
    with pytest.raises(InvalidTransition):
        next_state(S.REMOVED, ReplicaEvent.REJOINED)
    # Only a verified rejoin or a passed update puts a replica (back) in the pool.
    into_pool = {k for k, v in REPLICA_TRANSITIONS.items() if v is S.SERVING}
    assert {e for _, e in into_pool} == {ReplicaEvent.BOOTSTRAPPED, ReplicaEvent.PASSED,
                                         ReplicaEvent.KEPT, ReplicaEvent.REJOINED}


def test_synchronous_decision() -> None:
    o = {"a": Outcome.PASSED, "b": Outcome.PASSED, "c": Outcome.AMBIGUOUS,
         "d": Outcome.NO_MUTATION}
    d = decide_synchronous(o, 2)
    assert d.publish and d.serving == ("a", "b") and d.tainted == ("c",) and d.kept == ("d",)
    d = decide_synchronous(o, 3)
    assert not d.publish and d.withheld == ("a", "b") and d.serving == ()
    with pytest.raises(BadInput):
        decide_synchronous(o, 0)


def test_wave_plan_keeps_min_serving_or_refuses() -> None:
    assert plan_waves(["a", "b", "c"], serving=3, min_serving=2) == [("a",), ("b",), ("c",)]
    assert plan_waves(["a", "b", "c", "d"], serving=4, min_serving=2) == [("a", "b"),
                                                                          ("c", "d")]
    with pytest.raises(BadInput, match="below min_serving"):
        plan_waves(["a", "b"], serving=2, min_serving=2)
    with pytest.raises(BadInput, match="below min_serving"):
        plan_waves(["a", "b", "c"], serving=3, min_serving=1, wave_size=3)
    with pytest.raises(BadInput):
        plan_waves(["a", "a"], serving=2, min_serving=0)


# --------------------------------------------------------------------------- synchronous

def _labels(f: FakeFleet) -> dict[str, str]:
    return {n: f.engine(n).label for n in f.adapters}


def test_synchronous_update_broadcasts_once_and_publishes_on_every_replica() -> None:
    f = fake_fleet(3)
    w1 = weights(1)
    res = f.coord.update(w1, strategy="synchronous")
    assert res.published is not None and res.published.generation == 1
    assert res.published.label == "fleet-1" and res.transfer == "fanout"
    assert res.outcomes == dict.fromkeys(("r0", "r1", "r2"), Outcome.PASSED)
    assert f.fanout.rounds == 1 and f.fanout.broadcasts == len(w1.payload.tensors)
    for n in f.adapters:
        assert f.engine(n).weights_digest == w1.payload.digest
        c = f.coord.replicas[n].controller
        assert c.state is State.READY and c.committed is not None
        assert c.committed.label == "fleet-1"   # each engine finished with its own label
        assert f.coord.state_of(n) is S.SERVING and f.coord.generation_of(n) == 1
    kinds = [r.kind for r in f.coord.journal.records]
    assert kinds.index("fleet_update") < kinds.index("fleet_closed") < kinds.index(
        "fleet_publish")
    assert len(f.coord.journal.of(ReplicaOutcome)) == 3
    assert f.coord.view().newest == 1


def test_per_engine_transfer_is_the_fallback() -> None:
    f = fake_fleet(2)
    res = f.coord.update(weights(1), transfer="per-engine")
    assert res.transfer == "per-engine" and f.fanout.rounds == 0
    assert {f.engine(n).weights_digest for n in f.adapters} == {weights(1).payload.digest}


def test_no_request_is_admitted_during_a_synchronous_transition_and_answers_match() -> None:
    """Clients keep sending through the router while the fleet moves to version 1."""
    f = fake_fleet(3, token_delay_s=0.002)
    router = Router()
    stop = threading.Event()
    answers: list[tuple[int, str, list[str]]] = []   # fleet generation, bound label, spans
    refused = {"n": 0}
    errors: list[BaseException] = []

    def client(k: int) -> None:
        while not stop.is_set():
            view = f.coord.view()
            try:
                r = router.choose(view, Policy.parse("any"))
            except RouteRefused as exc:
                assert exc.status == 503
                refused["n"] += 1
                time.sleep(0.002)
                continue
            c = f.coord.replicas[r.name].controller
            rid = f"c{k}-{time.monotonic_ns()}"
            try:
                b = c.admit(rid)
            except AdmissionRefused:
                continue
            try:
                g = f.engine(r.name).generate([1, 2, 3, k], 6)
                answers.append((r.generation or 0, b.version.label, g.token_labels))
            except BaseException as exc:
                errors.append(exc)
            finally:
                c.complete(rid)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    f.coord.update(weights(1))
    time.sleep(0.1)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors and refused["n"] > 0
    assert {lab for _, lab, _ in answers} == {"default", "fleet-1"}
    for gen, label, spans in answers:
        assert set(spans) == {label}       # every token made by the bound version
        assert (gen == 1) == (label == "fleet-1")
    j = f.coord.journal.records
    closed = next(r.t_mono for r in j if isinstance(r.record, FleetClosed))
    published = next(r.t_mono for r in j if isinstance(r.record, FleetPublish))
    for jr in f.journals.values():
        admits = [r.t_mono for r in jr.records if isinstance(r.record, Admit)]
        assert admits and not [t for t in admits if closed <= t <= published]


def test_quorum_publishes_on_the_survivors_and_the_dead_replica_rejoins() -> None:
    f = fake_fleet(3)
    f.fanout.die_during = "http://fake-1.test"
    res = f.coord.update(weights(1), quorum=2)
    assert res.published is not None and res.transfer == "fanout+resend"
    assert res.outcomes["r1"] is Outcome.AMBIGUOUS
    assert res.outcomes["r0"] is res.outcomes["r2"] is Outcome.PASSED
    assert f.coord.state_of("r1") is S.FENCED and "r1" not in f.coord.serving()
    assert f.coord.replicas["r1"].controller.state is State.TAINTED
    for n in ("r0", "r2"):   # the broken broadcast was repaired by a fresh per-engine round
        assert f.engine(n).weights_digest == weights(1).payload.digest
    f.coord.supervise_once()   # recover (new engine on seed 0), then rejoin onto version 1
    assert f.coord.wait_for(lambda: f.coord.state_of("r1") is S.SERVING, 10)
    assert f.coord.generation_of("r1") == 1
    assert f.engine("r1").weights_digest == weights(1).payload.digest
    label = f.coord.replicas["r1"].controller.committed.label  # type: ignore[union-attr]
    assert label == "fleet-1.1"   # its own fresh label: fleet-1 was burnt on it
    events = [(r.replica, r.event) for r in f.coord.journal.of(ReplicaStateChange)
              if r.replica == "r1"]
    assert [e for _, e in events][-5:] == ["tainted", "recover", "recovered", "rejoin",
                                           "rejoined"]


def test_without_quorum_nothing_is_published_and_every_replica_returns_to_the_old_version(
        ) -> None:
    f = fake_fleet(3)
    f.fanout.die_during = "http://fake-2.test"
    with pytest.raises(FleetUpdateFailed, match="nothing published") as ei:
        f.coord.update(weights(1))   # quorum: all three
    assert ei.value.result.published is None
    assert f.coord.newest is not None and f.coord.newest.generation == 0
    assert [r.reason for r in f.coord.journal.of(FleetAbandon)]
    for n in ("r0", "r1"):   # passed on their engines, withheld by the fleet
        assert f.coord.state_of(n) is S.FENCED and f.coord.generation_of(n) is None
    assert f.coord.serving() == []
    f.coord.supervise_once()
    assert f.coord.wait_for(lambda: len(f.coord.serving()) == 3, 10)
    for n in f.adapters:
        assert f.coord.generation_of(n) == 0
        assert f.engine(n).weights_digest == FakeWeights.from_seed(0).digest


def test_quorum_larger_than_the_ready_replicas_is_refused_before_anything_changes() -> None:
    f = fake_fleet(2)
    before = (len(f.coord.journal.records), [f.engine(n).weights_digest for n in f.adapters])
    with pytest.raises(UpdateRefused, match="quorum 3"):
        f.coord.update(weights(1), quorum=3)
    for bad in ({"strategy": "sideways"}, {"label": "rc-4"}, {"label": "bad label"},
                {"transfer": "pigeon"}, {"label": "fleet-0"}):
        with pytest.raises(BadInput):
            f.coord.update(weights(1), **bad)
    with pytest.raises(BadInput):
        f.coord.update("weights")  # type: ignore[arg-type]
    assert before == (len(f.coord.journal.records),
                      [f.engine(n).weights_digest for n in f.adapters])
    assert f.coord.serving() == ["r0", "r1"]


# --------------------------------------------------------------------------- rolling

def test_rolling_update_keeps_min_serving_and_serves_two_versions_during_the_roll() -> None:
    f = fake_fleet(3)
    seen: list[int] = []
    versions_during: list[set[int]] = []
    router = Router()
    latest_answers: list[int] = []

    def watch() -> None:
        v = f.coord.view()
        seen.append(sum(r.in_pool for r in v.replicas))
        versions_during.append({r.generation for r in v.replicas
                                if r.in_pool and r.generation is not None})
        try:
            latest_answers.append(router.choose(v, Policy.parse("latest")).generation or 0)
        except RouteRefused as exc:
            assert exc.status == 503

    f.coord.on_change(watch)
    res = f.coord.update(weights(1), strategy="rolling", min_serving=2)
    assert res.waves == [("r0",), ("r1",), ("r2",)]
    assert res.published is not None and res.published.generation == 1
    assert min(seen) >= 2
    assert {0, 1} in versions_during       # both versions served at once
    assert latest_answers and set(latest_answers) <= {0, 1}
    # once version 1 is published, `latest` only ever lands on it
    first_pub = next(i for i, s in enumerate(versions_during) if 1 in s)
    assert set(latest_answers[first_pub:]) == {1}
    assert [w.serving for w in f.coord.journal.of(WaveBegin)] == [2, 2, 2]
    assert f.coord.serving() == ["r0", "r1", "r2"]
    assert all(f.coord.generation_of(n) == 1 for n in f.adapters)


def test_rolling_refuses_a_min_serving_it_cannot_keep() -> None:
    f = fake_fleet(2)
    n0 = len(f.coord.journal.records)
    with pytest.raises(BadInput, match="below min_serving"):
        f.coord.update(weights(1), strategy="rolling", min_serving=2)
    assert len(f.coord.journal.records) == n0 and f.coord.serving() == ["r0", "r1"]


def test_a_failed_wave_taints_one_replica_and_the_roll_goes_on() -> None:
    f = fake_fleet(3)
    f.adapters["r1"].inject("transfer", "die")  # type: ignore[arg-type]
    res = f.coord.update(weights(1), strategy="rolling", min_serving=1, wave_size=1)
    assert res.outcomes == {"r0": Outcome.PASSED, "r1": Outcome.AMBIGUOUS,
                            "r2": Outcome.PASSED}
    assert f.coord.state_of("r1") is S.FENCED
    f.coord.supervise_once()
    assert f.coord.wait_for(lambda: f.coord.state_of("r1") is S.SERVING, 10)
    assert f.coord.generation_of("r1") == 1


# --------------------------------------------------------------------------- supervision

def test_an_engine_that_dies_while_serving_leaves_the_pool_and_rejoins() -> None:
    f = fake_fleet(3)
    f.coord.update(weights(1))
    f.engine("r2").kill()
    f.coord.suspect("r2")          # the data plane could not reach it
    f.coord.supervise_once()
    assert "r2" not in f.coord.serving() and f.coord.state_of("r2") in (
        S.FENCED, S.RECOVERING, S.REJOINING)
    with pytest.raises(RouteRefused):
        Router().choose(f.coord.view(), Policy.parse("pinned:fleet-0"))  # retired: 410
    assert f.coord.wait_for(lambda: f.coord.state_of("r2") is S.SERVING, 10)
    assert f.coord.generation_of("r2") == 1


def test_a_failed_rebinding_is_retried_before_the_replica_rejoins() -> None:
    """Seen on the CPU under load: the replacement process came up, but reading its
    identity timed out. The replica must not rejoin bound to the dead process; it is
    rebound first (and the engine is not restarted a second time)."""
    f = fake_fleet(3)
    f.coord.update(weights(1))
    rep = f.coord.replicas["r2"]
    assert rep.recoverer is not None
    recoveries: list[int] = []
    real_replace = rep.recoverer.replace_engine

    def counted(target: Any) -> Any:
        recoveries.append(1)
        return real_replace(target)

    rep.recoverer.replace_engine = counted  # type: ignore[method-assign]
    binds: list[str] = []

    def rebind() -> None:
        binds.append("try")
        if len(binds) == 1:
            raise TimeoutError("GET /server_info: deadline of 30s expired")

    rep.on_recovered = rebind
    f.engine("r2").kill()
    f.coord.suspect("r2")
    f.coord.supervise_once()
    assert f.coord.wait_for(lambda: binds and not f.coord._members["r2"].busy, 10)
    assert f.coord.state_of("r2") is S.FENCED and "r2" not in f.coord.serving()
    assert f.coord.generation_of("r2") is None
    f.coord.supervise_once()                      # the next round: rebind, then rejoin
    assert f.coord.wait_for(lambda: f.coord.state_of("r2") is S.SERVING, 10)
    assert binds == ["try", "try"] and len(recoveries) == 1
    assert f.coord.generation_of("r2") == 1
    events = [(r.event, r.after) for r in f.coord.journal.of(ReplicaStateChange)
              if r.replica == "r2"]
    assert events[-6:] == [("recover", "RECOVERING"), ("failed", "FENCED"),
                           ("recover", "RECOVERING"), ("recovered", "FENCED"),
                           ("rejoin", "REJOINING"), ("rejoined", "SERVING")]


def test_fleet_journal_reads_back_typed(tmp_path: Any) -> None:
    f = fake_fleet(2)
    path = tmp_path / "fleet.jsonl"
    j = Journal(path)
    for jr in f.coord.journal.records:
        j.write(jr.record)
    j.close()
    back = read_journal(path)
    assert [r.record for r in back] == [r.record for r in f.coord.journal.records]
    f.coord.update(weights(1))
    kinds = [type(r.record) for r in f.coord.journal.records]
    assert kinds[-2:] == [ReplicaStateChange, FleetUpdateEnd]  # every replica decided, then over
    assert f.coord.journal.of(FleetUpdateEnd)[-1].published == 1
    assert f.coord.journal.of(FleetUpdateBegin)[0].strategy is Strategy.SYNCHRONOUS


def test_coordinator_refuses_bad_construction() -> None:
    from rolloutcore.fleet import FleetCoordinator

    with pytest.raises(BadInput):
        FleetCoordinator([])
    f = fake_fleet(1)
    r = f.coord.replicas["r0"]
    with pytest.raises(BadInput, match="distinct"):
        FleetCoordinator([r, r])
    with pytest.raises(BadInput):
        FleetConfig(transfer="carrier")
    with pytest.raises(BadInput):
        FleetConfig(quorum=0)
