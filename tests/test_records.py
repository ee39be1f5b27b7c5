"""The typed records: every type round-trips through a journal file; old journals read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from coretools import MANIFEST, ident
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, first_index, read_journal, restore_controller
from rolloutcore.core.adapters import AdapterChange, AdapterEvent, AdapterState
from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    Check,
    DrainEvidence,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    SleepEvidence,
    TransferEvidence,
    ValidationEvidence,
    WakeEvidence,
    WakeTags,
    evidence_from_dict,
    evidence_to_dict,
)
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lease import LeaseChange, LeaseEvent, LeaseState
from rolloutcore.core.pool import (
    FleetAbandon,
    FleetBootstrap,
    FleetClosed,
    FleetPublish,
    FleetRestore,
    FleetUpdateBegin,
    FleetUpdateEnd,
    Outcome,
    ReplicaEvent,
    ReplicaOutcome,
    ReplicaState,
    ReplicaStateChange,
    Strategy,
    WaveBegin,
    WaveEnd,
)
from rolloutcore.core.records import (
    RECORD_TYPES,
    SCHEMA_VERSION,
    Abandon,
    Admit,
    BeginRecovery,
    BeginUpdate,
    Carry,
    Classification,
    Commit,
    Complete,
    Effect,
    Event,
    EvidenceSeen,
    Failure,
    FailureKind,
    Interrupted,
    Note,
    Record,
    Refuse,
    RequestSleep,
    RequestUpdate,
    RequestWake,
    Restore,
    State,
    Step,
    Taint,
    Transition,
    UpdateMode,
    Verdict,
)
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightVersion
from rolloutcore.errors import BadInput, JournalError

DATA = Path(__file__).parent / "data"
V0, V1 = WeightVersion(0, "rc-0", "e0"), WeightVersion(1, "rc-1", "e0")
IDENT = ident(1).verified(VerificationLevel.PROBE, ["label=rc-1", "probe=pass"])

EVIDENCE = [
    BootstrapEvidence(engine_epoch="e0", healthy=True, observed_label="rc-0",
                      label_supported=True, capabilities=frozenset({"pause", "label"}),
                      engine_info={"vllm": "0.32.0", "tp": [1, 2]}, elapsed_s=0.5,
                      unverified=("encoder cache",)),
    HealthEvidence(answering=True, healthy=False, restarted=True, reason="pid changed"),
    DrainEvidence(paused=True, mode=PauseMode.WAIT, engine_in_flight=0),
    PreflightEvidence(source_manifest_digest=MANIFEST.digest,
                      source_provenance=Provenance("ckpt", "run", 3),
                      engine_manifest_digest=None, detail=""),
    TransferEvidence(completed=True, mutation_started=True, backend="gloo", tensors=2,
                     bytes=12, finish_label="rc-1", error=None),
    CacheResetEvidence(cache=CacheKind.ENCODER, http_status=200, engine_success=None),
    ValidationEvidence(observed_label="rc-1", label_supported=True, paused=True,
                       checks=(Check("checksum", True, "ok", coverage=0.25,
                                     level=VerificationLevel.ENGINE_CHECKSUM),
                               Check("probe", False, "diff 3", max_abs_diff=3.0,
                                     tolerance=0.05, level=VerificationLevel.PROBE))),
    ResumeEvidence(resumed=True, is_paused_after=False),
    RecoveryEvidence(engine_epoch="e1", identity=IDENT, healthy=True,
                     validation=ValidationEvidence(observed_label=None,
                                                   label_supported=False)),
    SleepEvidence(level=2, is_sleeping_after=True, paused_after=True,
                  memory_before={"used_bytes": 70 << 30, "source": "worker"},
                  memory_after={"used_bytes": 1 << 30}, reference_params=399),
    WakeEvidence(tags=WakeTags.KV_CACHE, fully_awake=True, paused_after=True, repaused=True,
                 memory_after={"free_bytes": 5}, detail="", elapsed_s=0.03),
]

RU = RequestUpdate(1, "trainer", V1, IDENT, 2, VerificationLevel.MANIFEST)
SAMPLES: list[Record] = [
    Admit("r-1", V0, IDENT.digest),
    Complete("r-1", V0, State.DRAINING, True),
    Refuse("r-2", State.TAINTED, "engine is tainted"),
    RU,
    Transition(State.READY, State.DRAINING, Event.REQUEST_UPDATE, 1.25),
    *[EvidenceSeen(Event.DRAINED, ev, ("a problem",)) for ev in EVIDENCE],
    Verdict(Event.RESUMED, True, State.RESUMING, State.READY, None, (), V1),
    Verdict(Event.FAIL, False, State.UPDATING, State.TAINTED, Classification.AMBIGUOUS,
            ("cut",), None),
    BeginUpdate(1, V1),
    Commit(V1, IDENT),
    Abandon(1, V1),
    Failure(Step.TRANSFER, FailureKind.TIMEOUT, "deadline of 3s expired"),
    Taint(("controller restarted during an update",), V1),
    Taint((), None),
    BeginRecovery("operator"),
    Restore(State.DRAINING, 1, RU),
    Restore(State.READY, 0, None),
    Effect("transfer", 0.125, False, "EffectTimeout('transfer')"),
    Effect("drain", 0.5, True),
    Note("health", {"problems": ["engine not answering"], "consecutive": 2}),
    Carry(1, UpdateMode.KEEP, ("r-3", "r-4"), ("r-5",), 1),
    Carry(2, UpdateMode.RECOMPUTE, (), (), None),
    RequestSleep(1, "trainer", 2, 0),
    RequestWake(2, "trainer", V1, IDENT, 0, VerificationLevel.ENGINE_CHECKSUM, 2, False),
    RequestWake(3, "trainer", V0, IDENT, 0, VerificationLevel.ENGINE_CHECKSUM, 1, True),
    # The fleet pool's records (core.pool): the same schema, typed with its enums.
    FleetBootstrap(0, "fleet-0", IDENT, ("r0", "r1")),
    FleetUpdateBegin(1, Strategy.SYNCHRONOUS, 1, "fleet-1", IDENT.digest, ("r0", "r1"), 2,
                     None, "fanout"),
    FleetUpdateBegin(2, Strategy.ROLLING, 2, "fleet-2", IDENT.digest, ("r1",), None, 1,
                     "per-engine"),
    FleetClosed(1, ("r0", "r1")),
    WaveBegin(2, 1, ("r1",), 1),
    WaveEnd(2, 1, ("r1",), (), 0.5),
    ReplicaOutcome(1, 1, "r0", Outcome.PASSED, "fleet-1", State.READY, "fanout", 0.25),
    ReplicaOutcome(1, 1, "r1", Outcome.AMBIGUOUS, None, State.TAINTED, "fanout", 1.0, "died"),
    FleetPublish(1, 1, "fleet-1", IDENT, ("r0",)),
    FleetAbandon(2, "only 0 of 1 passed"),
    FleetUpdateEnd(2, None),
    FleetUpdateEnd(1, 1),
    FleetRestore(12, 1, 2, 2, "fleet-2", IDENT, True, ("r0", "r1")),
    ReplicaStateChange("r0", ReplicaState.UPDATING, ReplicaState.SERVING, ReplicaEvent.PASSED,
                       1, V1, ""),
    ReplicaStateChange("r1", ReplicaState.SERVING, ReplicaState.FENCED, ReplicaEvent.TAINTED,
                       None, None, "engine tainted"),
    # The engine's owner interrupted (the TRL integration, version 5).
    Interrupted("KeyboardInterrupt", "update", 3, State.TAINTED, V0, 4, State.UPDATING,
                Classification.AMBIGUOUS, 0, "interrupted while the weights were sent"),
    Interrupted("SystemExit", "training", None, State.READY, None),
    # The trainer protocol's leases (core.lease).
    LeaseChange(7, None, LeaseState.OPEN, None, "trainer"),
    LeaseChange(7, LeaseState.OPEN, LeaseState.EXPIRING, LeaseEvent.EXPIRE, "trainer",
                "lease of 1s expired"),
    # LoRA-adapter versions (core.adapters).
    AdapterChange("rcl-1-" + "a" * 16, 1, "a" * 64, "rc-0", "/tmp/rcl-1", None,
                  AdapterState.LOADING, None),
    AdapterChange("rcl-1-" + "a" * 16, 1, "a" * 64, "rc-0", "/tmp/rcl-1",
                  AdapterState.VERIFYING, AdapterState.PUBLISHED, AdapterEvent.VERIFIED,
                  "every check passed", ("listed: yes", "adapter-probe: 0.001")),
]


def test_samples_cover_every_record_type() -> None:
    assert {type(r) for r in SAMPLES} == set(RECORD_TYPES.values())
    assert {type(r.evidence) for r in SAMPLES if isinstance(r, EvidenceSeen)} == {
        type(e) for e in EVIDENCE}


def test_every_record_type_round_trips_through_a_journal_file(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    for r in SAMPLES:
        j.write(r)
    j.close()
    back = read_journal(path)
    assert [b.record for b in back] == SAMPLES
    assert [type(b.record) for b in back] == [type(r) for r in SAMPLES]
    assert [b.to_json() for b in back] == [m.to_json() for m in j.records]
    for line in path.read_text().splitlines():
        assert json.loads(line)["v"] == SCHEMA_VERSION


def test_evidence_round_trips_exactly() -> None:
    for ev in EVIDENCE:
        d = json.loads(json.dumps(evidence_to_dict(ev)))
        assert evidence_from_dict(d) == ev
        assert evidence_to_dict(evidence_from_dict(d)) == d
    with pytest.raises(BadInput, match="unknown evidence type"):
        evidence_from_dict({"type": "Nonsense"})
    with pytest.raises(BadInput, match="DrainEvidence"):
        evidence_from_dict({"type": "DrainEvidence", "paused": True, "mode": "sideways"})


def test_the_journal_refuses_what_is_not_a_record() -> None:
    j = Journal()
    with pytest.raises(JournalError, match="not a journal record"):
        j.write({"kind": "admit"})  # type: ignore[arg-type]
    with pytest.raises(JournalError, match="not a journal record"):
        j.write(Record())


def test_a_newer_schema_is_refused_by_name_and_bad_lines_say_where(tmp_path: Path) -> None:
    path = tmp_path / "j.jsonl"
    j = Journal(path)
    j.write(Note("x"))
    j.close()
    obj = json.loads(path.read_text())
    path.write_text(json.dumps({**obj, "v": 99}) + "\n")
    with pytest.raises(JournalError, match=r"j.jsonl:1: journal schema version 99"):
        read_journal(path)
    path.write_text(json.dumps({**obj, "kind": "admit", "data": {"rollout_id": "r"}}) + "\n")
    with pytest.raises(JournalError, match=r"j.jsonl:1: bad admit record"):
        read_journal(path)
    path.write_text(json.dumps({**obj, "kind": "gossip"}) + "\n")
    with pytest.raises(JournalError, match="unknown record kind 'gossip'"):
        read_journal(path)


@pytest.mark.parametrize(("name", "state"), [("journal-v1-ready.jsonl", "READY"),
                                             ("journal-v1-mid-update.jsonl", "TAINTED")])
def test_a_schema_1_journal_still_restores(tmp_path: Path, name: str, state: str) -> None:
    """Written by the controller before records were typed (no "v", a failed transfer's
    transition labelled with its evidence event, no min_verification)."""
    path = tmp_path / name
    shutil.copyfile(DATA / name, path)
    recs = read_journal(path)
    assert all("v" not in json.loads(line) for line in path.read_text().splitlines())
    assert check_journal(recs) == []
    i = first_index(recs, Transition, event=Event.TRANSFERRED, after=State.TAINTED)
    assert i > 0, "the fixture has a schema-1 failure transition"
    ru = [r.record for r in recs if isinstance(r.record, RequestUpdate)]
    assert ru and all(x.min_verification is VerificationLevel.DECLARED for x in ru)
    c, j = restore_controller(path)
    assert c.state.value == state
    assert c.committed == WeightVersion(3, "rc-3", "e-new")  # rc-2 burnt by the taint
    assert [v.label for v in c.published] == ["rc-0", "rc-1", "rc-3"]
    assert c.active == {}  # the dead process's binding, released unattributable
    if state == "READY":
        assert c.request_update(ident(4), "trainer").target.version.label == "rc-4"
    j.close()
    after = read_journal(path)
    assert isinstance(after[len(recs)].record, Restore)
    assert json.loads(path.read_text().splitlines()[-1])["v"] == SCHEMA_VERSION
    assert check_journal(after) == []


def test_first_index_matches_on_types_and_on_names() -> None:
    j = Journal()
    c = LifecycleController(listener=j.listener)
    from coretools import boot_ev

    c.bootstrap(boot_ev(), ident(0))
    c.admit("a")
    c.admit("b")
    recs = j.records
    assert first_index(recs, Admit, rollout_id="b") == first_index(recs, "admit",
                                                                   rollout_id="b") > 0
    assert first_index(recs, Complete) == -1


@pytest.mark.parametrize("bad", [
    {"update_id": 1, "reason": "x", "extra": 1},          # an unknown key
    {"update_id": 1},                                     # a missing one
    {"update_id": "1", "reason": "x"},                    # another type
    {"update_id": True, "reason": "x"},                   # a bool is not an int
])
def test_typed_records_read_exactly_their_fields(bad: dict[str, object]) -> None:
    from rolloutcore.core.records import decode
    from rolloutcore.errors import JournalError

    with pytest.raises(JournalError):
        decode("fleet_abandon", bad)


def test_typed_records_refuse_a_value_outside_their_enum() -> None:
    from rolloutcore.core.records import decode
    from rolloutcore.errors import JournalError

    good = ReplicaStateChange("r0", ReplicaState.SERVING, ReplicaState.FENCED,
                              ReplicaEvent.TAINTED, None, None, "x").to_data()
    assert good["after"] == "FENCED" and good["event"] == "tainted"
    with pytest.raises(JournalError, match="not a ReplicaState"):
        decode("replica_state", {**good, "after": "SLEEPY"})


def test_fields_dict_writes_each_field_as_json_in_order_then_the_extras() -> None:
    """The one ``to_dict`` of the report classes (``core.records.fields_dict``): the JSON
    each class used to write by hand (enum values, nested ``to_dict``, tuples and
    mappings as lists and dicts, ``None`` kept), in field order, extras last."""
    from rolloutcore.core.records import fields_dict
    from rolloutcore.fleet.model import FleetUpdateResult
    from rolloutcore.provenance.token_versions import Segment, TokenSpan, TokenVersions

    tv = TokenVersions(UpdateMode.KEEP, "engine", (TokenSpan(1, "v1", 0, 3, ("v1",)),),
                       (Segment(0, 3, "v1", None, 5),), None, 1)
    assert tv.to_dict() == {
        "mode": "keep", "source": "engine",
        "spans": [{"generation": 1, "label": "v1", "start": 0, "end": 3, "kv": ["v1"]}],
        "segments": [{"start": 0, "end": 3, "label": "v1", "cache_salt": None,
                      "prefill_tokens": 5}],
        "max_staleness": None, "completed_generation": 1}
    assert type(tv.to_dict()["mode"]) is str
    r = FleetUpdateResult(7, Strategy.ROLLING, "v2", None, {"r0": Outcome.PASSED},
                          {"r0": "ok"}, [("r0",), ("r1", "r2")], "fanout", 0.5, 1.0, "d")
    d = fields_dict(r, extra=1)
    assert d["strategy"] == "rolling" and d["outcomes"] == {"r0": "passed"}
    assert d["waves"] == [["r0"], ["r1", "r2"]] and d["published"] is None
    assert list(d)[-1] == "extra" and d == {**r.to_dict(), "extra": 1}


def test_fields_from_dict_reads_exactly_the_fields_back() -> None:
    """``fields_dict``'s inverse: the same object back; a missing or unknown key is
    ``BadInput`` naming where (and the note, for an unknown one)."""
    from rolloutcore.core.records import fields_from_dict
    from rolloutcore.errors import BadInput
    from rolloutcore.provenance.trajectory import Timestamps

    t = Timestamps(1.0, 2.0, 3.0, 4.0)
    assert fields_from_dict(Timestamps, "timestamps", t.to_dict()) == t
    assert Timestamps.from_dict(t.to_dict()) == t
    with pytest.raises(BadInput, match=r"timestamps: missing keys \['completed_mono'\]"):
        fields_from_dict(Timestamps, "timestamps",
                         {k: v for k, v in t.to_dict().items() if k != "completed_mono"})
    with pytest.raises(BadInput, match=r"timestamps: unknown keys \['x'\] \(schema version"):
        Timestamps.from_dict({**t.to_dict(), "x": 1})
    with pytest.raises(BadInput, match="timestamps: must be a JSON object"):
        Timestamps.from_dict([1.0])
