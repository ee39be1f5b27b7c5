"""The update modes (issue 20) against the simulated engine: keep, recompute, the bound.

The fake engine models what decides correctness here: ``pause(keep)``
freezes requests and they continue under the new weights, ``pause(abort)``
ends them with their tokens so far, a prefix cache keyed by salt that
survives a weight change unless reset, and per-token labels. Nothing below
waits on a duration: each update starts once every rollout has produced
tokens (``tokens_in_flight``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from coretools import (
    boot_ev,
    ident,
    preflight_ev,
    reset_ev,
    resume_ev,
    transfer_ev,
    validation_ev,
)
from rolloutcore.control.async_modes import Rollout, RolloutClient, RolloutStatus
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.cache_salt import salt_for, salt_label
from rolloutcore.core.evidence import CacheKind, DrainEvidence, PauseMode, ResumeEvidence
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.core.records import Carry, Complete, Record, UpdateMode
from rolloutcore.core.rules import UPDATE_MODES, InFlight
from rolloutcore.core.versions import EngineIdentity, WeightVersion
from rolloutcore.errors import AdmissionRefused, BadInput, UpdateFailed
from rolloutcore.provenance.audit import (
    PurityIssue,
    audit_file,
    audit_purity,
    read_journal_summary,
)
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.trajectory import (
    SEED_NONE,
    SamplingSpec,
    TrajectoryGroup,
    TrajectorySample,
)
from rolloutcore.testing.fake import (
    FakeAdapter,
    FakeEngine,
    FakeWeights,
    FaultKind,
    reference_tokens,
)

FAST = Deadlines(drain_s=5, pause_s=2, preflight_s=2, transfer_s=2, reset_s=2, validate_s=2,
                 resume_s=2, live_validate_s=10, bootstrap_s=2, fence_s=2, cancel_grace_s=0.5,
                 retry_backoff_s=0.01)
W = [FakeWeights.from_seed(i, step=i) for i in range(5)]
ENGINE = EngineIdentity("fake", "fake-model")
SAMPLING = SamplingSpec(0.0, seed=None, seed_derivation=SEED_NONE)


class Rig:
    def __init__(self, mode: UpdateMode, k: int | None = None, *, salt: bool = True,
                 block_size: int = 16, batch: int | None = None) -> None:
        self.engine = FakeEngine(W[0], token_delay_s=0.002, block_size=block_size)
        self.adapter = FakeAdapter(self.engine)
        self.journal = Journal()
        self.c = LifecycleController(config=ControllerConfig(
            update_mode=mode, max_staleness=k, admission_batch=batch),
            listener=self.journal.listener)
        self.runner = LifecycleRunner(self.c, self.adapter, FAST, record=self.journal.write)
        self.runner.bootstrap(W[0].identity())
        self.client = RolloutClient(self.c, self.engine, salt=salt, unsafe_unsalted=not salt,
                                    admit_wait_s=30, update_wait_s=30)
        self.results: dict[int, Rollout] = {}
        self.threads: list[threading.Thread] = []
        self.next_weights = 1

    def start(self, prompts: list[list[int]], max_tokens: int = 400) -> None:
        def go(i: int, p: list[int]) -> None:
            self.results[i] = self.client.run(p, max_tokens=max_tokens)
        base = len(self.threads)
        for i, p in enumerate(prompts):
            th = threading.Thread(target=go, args=(base + i, p), daemon=True)
            th.start()
            self.threads.append(th)

    def progress(self, n: int, at_least: int) -> None:
        """Wait until ``n`` requests are in flight, each with ``at_least`` more tokens."""
        deadline = time.monotonic() + 30
        start: dict[str, int] = {}
        while time.monotonic() < deadline:
            now = self.engine.tokens_in_flight()
            for rid, t in now.items():
                start.setdefault(rid, t)
            if len(now) >= n and all(t - start[rid] >= at_least for rid, t in now.items()):
                return
            time.sleep(0.005)
        raise AssertionError(f"rollouts did not progress: {self.engine.tokens_in_flight()}")

    def update(self) -> WeightVersion:
        w = W[self.next_weights]
        self.next_weights += 1
        self.adapter.stage(w)
        out = self.runner.run_update(w.identity())
        assert out.published is not None
        return out.published

    def join(self) -> list[Rollout]:
        # What the test did while they ran is done: the rest of each answer comes at once.
        self.engine.token_delay_s = 0.0
        for th in self.threads:
            th.join(60)
            assert not th.is_alive()
        return [self.results[i] for i in sorted(self.results)]

    def records(self, kind: type) -> list[object]:
        return [r.record for r in self.journal.records if isinstance(r.record, kind)]


def prompts(n: int, length: int = 40, base: int = 0) -> list[list[int]]:
    return [[(base + 7 * i + j) % 256 for j in range(length)] for i in range(n)]


def write_and_audit(rollouts: list[Rollout], tmp: Path, j: Journal) -> object:
    path = tmp / "traj.jsonl"
    with TrajectoryRecorder(path) as rec:
        for i, r in enumerate(rollouts):
            s = r.sample(run="run", step=0, group_id=f"run:s0:p{i}", prompt_index=i,
                         group_size=1, sample_index=0, sampling=SAMPLING, engine=ENGINE)
            assert s.schema_version == 3
            rec.append_group(TrajectoryGroup((s,)))
    jpath = tmp / "journal.jsonl"
    jpath.write_text("".join(r.to_json() + "\n" for r in j.records))
    return audit_file(path, jpath)


# --------------------------------------------------------------------------- the rows

def test_each_mode_is_a_row_and_strict_is_todays_drain() -> None:
    assert set(UPDATE_MODES) == set(UpdateMode)
    strict, keep, rec, eng = (UPDATE_MODES[m] for m in UpdateMode)
    assert strict.drains and strict.pause is None and not strict.deferred_resets
    assert keep.pause is PauseMode.KEEP and keep.in_flight is InFlight.KEPT
    assert keep.kv_crosses_versions and keep.needs_salt
    assert keep.deferred_resets == frozenset({CacheKind.PREFIX})
    assert rec.pause is PauseMode.ABORT and rec.in_flight is InFlight.RESUBMITTED
    assert not rec.kv_crosses_versions and not rec.deferred_resets
    # vLLM's keep-with-recompute: frozen, cleared at the pause, recomputed on resume.
    assert eng.pause is PauseMode.KEEP and eng.clear_cache and eng.needs_salt
    assert eng.in_flight is InFlight.RECOMPUTED
    assert not eng.kv_crosses_versions and not eng.deferred_resets
    assert not any(UPDATE_MODES[m].clear_cache for m in UpdateMode
                   if m is not UpdateMode.ENGINE_RECOMPUTE)


@pytest.mark.parametrize("kw", [{"update_mode": "keep"}, {"max_staleness": -1},
                                {"max_staleness": True}, {"admission_batch": 4},
                                {"max_staleness": 1, "admission_batch": 0}])
def test_bad_controller_config_is_refused(kw: dict[str, object]) -> None:
    with pytest.raises(BadInput):
        ControllerConfig(**kw)  # type: ignore[arg-type]


def test_keep_without_the_salt_is_refused_and_bad_input_admits_nothing() -> None:
    rig = Rig(UpdateMode.KEEP)
    with pytest.raises(BadInput, match="needs the version salt"):
        RolloutClient(rig.c, rig.engine, salt=False)
    for bad in ([], [-1], "abc"):
        with pytest.raises(BadInput):
            rig.client.run(bad, max_tokens=4)  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        rig.client.run([1, 2], max_tokens=0)
    assert not rig.c.active and not rig.records(Complete)


def test_the_salt_names_its_version_and_differs_per_version() -> None:
    v1, v2 = WeightVersion(1, "rc-1", "e"), WeightVersion(2, "rc-2", "e")
    s1 = salt_for(v1)
    assert s1 == salt_for(v1) and s1 != salt_for(v2) and s1 != salt_for(v1, "tenant")
    assert salt_for(v1) != salt_for(WeightVersion(1, "rc-1", "e2"))
    assert salt_label(s1) == "rc-1" and salt_label("rcv.x") is None
    assert len(salt_for(WeightVersion(1, "a" * 128, "e"))) <= 128
    assert not set("@/\\\x00") & set(salt_for(v1, "t"))
    with pytest.raises(BadInput):
        salt_for(v1, "a/b")


# --------------------------------------------------------------------------- keep

def test_keep_carries_rollouts_across_two_updates(tmp_path: Path) -> None:
    rig = Rig(UpdateMode.KEEP)
    ps = prompts(3)
    rig.start(ps)
    rig.progress(3, 5)
    v1 = rig.update()
    rig.progress(3, 5)
    v2 = rig.update()
    out = rig.join()
    for r in out:
        assert r.status is RolloutStatus.COMPLETED and r.attributable, r.error
        st = r.stitched
        assert st is not None and len(r.token_ids) == 400
        assert st.versions.generations == (0, 1, 2)
        assert st.versions.source == "engine" and r.derived_agrees is True
        assert [s.label for s in st.versions.spans] == ["default", v1.label, v2.label]
        # The kept request's later tokens attend to KV its earlier ones left: said.
        assert st.versions.spans[-1].kv == ("default", v1.label, v2.label)
        assert len(st.versions.segments) == 1 and r.recomputed_tokens == 0
        assert r.staleness == 2
    carries = rig.records(Carry)
    assert [c.mode for c in carries] == [UpdateMode.KEEP] * 2  # type: ignore[attr-defined]
    assert all(len(c.carried) == 3 and not c.over_bound for c in carries)  # type: ignore
    assert check_journal(rig.journal.records) == []
    report = write_and_audit(out, tmp_path, rig.journal)
    assert report.purity.ok and report.purity.mixed_within_bound == 3  # type: ignore
    # The prefix reset was deferred; it runs once nothing old runs.
    assert rig.c.sweep_due and rig.runner.sweep() is True and not rig.c.sweep_due


def test_kept_tokens_attend_old_kv_and_recomputed_ones_do_not() -> None:
    """What keep mixes, what recompute pays: the same rollout under every mode (the
    engine's own recompute continues the request over KV the new weights computed)."""
    got: dict[UpdateMode, Rollout] = {}
    for mode in (UpdateMode.KEEP, UpdateMode.RECOMPUTE, UpdateMode.ENGINE_RECOMPUTE):
        rig = Rig(mode)
        rig.start(prompts(1, base=3), max_tokens=300)
        rig.progress(1, 20)
        rig.update()
        (got[mode],) = rig.join()
    for mode, r in got.items():
        st = r.stitched
        assert st is not None and r.status is RolloutStatus.COMPLETED
        cut = st.versions.spans[1].start
        prefill = list(r.prompt) + list(st.token_ids[:cut])
        fresh = reference_tokens(W[1].digest, prefill, 300 - cut)
        if mode is UpdateMode.RECOMPUTE:
            assert list(st.token_ids[cut:]) == fresh  # KV recomputed by the new weights
            assert r.recomputed_tokens == len(prefill)
            assert [s.prefill_tokens for s in st.versions.segments] == [40, len(prefill)]
        elif mode is UpdateMode.ENGINE_RECOMPUTE:
            assert list(st.token_ids[cut:]) == fresh  # recomputed inside the engine
            assert len(st.versions.segments) == 1 and r.recomputed_tokens == 0
            assert [sp.kv for sp in st.versions.spans] == [("default",), ("rc-1",)]
        else:
            assert list(st.token_ids[cut:]) != fresh  # attends to the old KV, as recorded
            assert r.recomputed_tokens == 0


def test_salting_is_what_keeps_new_requests_off_old_kv() -> None:
    """Negative control on the fake: unsalted, a request after a keep update reuses KV."""
    for salt in (False, True):
        rig = Rig(UpdateMode.KEEP, salt=salt)
        p = prompts(1, length=48, base=11)[0]  # three 16-token blocks
        rig.start([p], max_tokens=300)
        rig.progress(1, 10)
        rig.update()
        hits = rig.engine.prefix_hits
        r = rig.client.run([*p, 1, 2, 3], max_tokens=16)
        new_hits = rig.engine.prefix_hits - hits
        want = reference_tokens(W[1].digest, [*p, 1, 2, 3], 16)
        if salt:
            assert new_hits == 0 and list(r.token_ids) == want
        else:
            assert new_hits == 48 and list(r.token_ids) != want
        rig.join()


# --------------------------------------------------------------------------- recompute

def test_recompute_resubmits_and_stitches_across_two_updates(tmp_path: Path) -> None:
    rig = Rig(UpdateMode.RECOMPUTE)
    rig.start(prompts(3, base=5))
    rig.progress(3, 5)
    rig.update()
    rig.progress(3, 5)
    rig.update()
    out = rig.join()
    for r in out:
        assert r.status is RolloutStatus.COMPLETED and r.attributable, r.error
        st = r.stitched
        assert st is not None and len(st.token_ids) == 400 and st.finish_reason == "length"
        assert st.logprobs is not None and len(st.logprobs) == 400
        segs = st.versions.segments
        assert len(segs) == 3 and [s.prefill_tokens for s in segs] == [
            40 + s.start for s in segs]
        assert [s.label for s in segs] == ["default", "rc-1", "rc-2"]
        assert all(salt_label(s.cache_salt or "") == s.label for s in segs)
        assert all(s.kv == (s.label,) for s in st.versions.spans)
        assert r.recomputed_tokens == sum(s.prefill_tokens for s in segs[1:])
        assert r.derived_agrees is True
        # nothing lost or duplicated: each segment continues where the last stopped
        for a, b in zip(r.runs, r.runs[1:], strict=False):
            assert b.prefill_tokens == a.prefill_tokens + len(a.token_ids)
    assert check_journal(rig.journal.records) == []
    report = write_and_audit(out, tmp_path, rig.journal)
    assert report.purity.ok and report.purity.mixed_within_bound == 3  # type: ignore
    assert not rig.c.sweep_due  # recompute resets while paused: nothing runs then


# --------------------------------------------------------------------------- the bound

@pytest.mark.parametrize("mode", [UpdateMode.KEEP, UpdateMode.RECOMPUTE])
def test_staleness_k1_three_quick_updates_reports_what_it_ends(
        mode: UpdateMode, tmp_path: Path) -> None:
    rig = Rig(mode, k=1)
    rig.start(prompts(2, base=9), max_tokens=2000)
    rig.progress(2, 5)
    rig.update()           # the two long ones now span 2 versions: within k = 1
    rig.progress(2, 5)
    rig.start(prompts(1, base=77), max_tokens=2000)  # admitted under rc-1
    rig.progress(3, 5)
    rig.update()           # the first two would be 2 old: ended, reported
    rig.progress(1, 5)
    rig.update()           # the third too
    out = rig.join()
    assert [r.status for r in out] == [RolloutStatus.OVER_BOUND] * 3
    assert all(not r.attributable and "max_staleness" in (r.error or "") for r in out)
    over = [rid for c in rig.records(Carry) for rid in c.over_bound]  # type: ignore
    assert sorted(over) == sorted(r.rollout_id for r in out)
    assert all(not c.attributable for c in rig.records(Complete))  # type: ignore
    assert check_journal(rig.journal.records) == []
    # Short ones completed between the updates are within the bound.
    short = [rig.client.run(p, max_tokens=8) for p in prompts(2, base=33)]
    assert all(r.attributable and r.staleness == 0 for r in short)
    report = write_and_audit(short, tmp_path, rig.journal)
    assert report.purity.ok and report.purity.journal.over_bound == set(over)  # type: ignore


def test_admission_capacity_keeps_the_batch_within_the_bound() -> None:
    rig = Rig(UpdateMode.KEEP, k=0, batch=2)
    for i in range(2):
        rig.c.admit(f"r{i}")
    with pytest.raises(AdmissionRefused, match="staleness capacity") as ei:
        rig.c.admit("r2")
    assert ei.value.retry_after_s is not None
    rig.c.complete("r0")
    rig.c.complete("r1")
    with pytest.raises(AdmissionRefused):  # 2 accepted: version 0's batch is done
        rig.c.admit("r3")
    rig.update()
    rig.c.admit("r4")  # (0 + 1 + 1) * 2 - 2 accepted = 2 free again


# --------------------------------------------------------------------------- controller

def test_a_carried_rollout_completing_before_the_publish_is_unattributable() -> None:
    c = LifecycleController(config=ControllerConfig(update_mode=UpdateMode.KEEP))
    c.bootstrap(boot_ev(), ident(0))
    c.admit("early")
    c.admit("late")
    t = c.request_update(ident(1), "trainer")
    v = c.drained(t, DrainEvidence(paused=True, mode=PauseMode.WAIT))
    assert not v.accepted and c.state is State.DRAINING  # strict's pause is not keep's
    assert "paused with 'wait'" in v.problems[0]
    assert c.drained(t, DrainEvidence(paused=True, mode=PauseMode.KEEP,
                                      engine_in_flight=2)).accepted
    assert set(c.active) == {"early", "late"}
    c.complete("early")  # before the mutation: its tokens are the old version's
    c.preflighted(t, preflight_ev(t))
    c.transferred(t, transfer_ev(t))
    assert c.pending_resets == {CacheKind.ENCODER, CacheKind.MULTIMODAL}
    c.invalidated(t, reset_ev(CacheKind.ENCODER))
    c.invalidated(t, reset_ev(CacheKind.MULTIMODAL))
    c.validated(t, validation_ev(t))
    assert c.state is State.RESUMING
    late = c.complete("late")  # the target serves, unpublished
    assert not late.attributable
    assert c.resumed(t, resume_ev()).accepted


def test_restore_of_a_journal_mid_keep_update_taints_and_carried_end_unattributable(
        ) -> None:
    rig = Rig(UpdateMode.KEEP)
    rig.start(prompts(2, base=21), max_tokens=600)
    rig.progress(2, 5)
    t = rig.c.request_update(W[1].identity(), "trainer")
    assert rig.c.drained(t, rig.adapter.drain(PauseMode.KEEP)).accepted
    recs = list(rig.journal.records)
    seen: list[Record] = []
    r2 = LifecycleController.restore(recs, config=ControllerConfig(update_mode=UpdateMode.KEEP),
                                     listener=seen.append)
    # The carried rollouts belonged to the process that wrote the journal: the
    # restore releases each at once, recorded as not attributable.
    assert r2.state is State.TAINTED and not r2.active
    ends = [r for r in seen if isinstance(r, Complete)]
    assert {r.rollout_id for r in ends} == set(rig.c.active)
    assert not any(r.attributable for r in ends)
    # The original abandons its update (nothing mutated): the kept rollouts finish.
    rig.c.fail(t, Step.PREFLIGHT, FailureKind.REFUSED, "test: abandon")
    rig.engine.resume()
    assert rig.c.resumed(t, ResumeEvidence(resumed=True, is_paused_after=False)).accepted
    out = rig.join()
    assert all(r.attributable and len(r.token_ids) == 600 for r in out)


# --------------------------------------------------------------------------- faults

def test_engine_dies_mid_transfer_while_requests_are_kept() -> None:
    rig = Rig(UpdateMode.KEEP)
    rig.start(prompts(2, base=41), max_tokens=3000)
    rig.progress(2, 5)
    rig.adapter.stage(W[1])
    rig.adapter.inject("transfer", FaultKind.DIE)
    with pytest.raises(UpdateFailed) as ei:
        rig.runner.run_update(W[1].identity())
    assert ei.value.classification == "ambiguous" and rig.c.state is State.TAINTED
    out = rig.join()
    for r in out:
        assert r.status is RolloutStatus.FAILED and not r.attributable
        assert r.error and "TAINTED" in r.error
    assert [c.attributable for c in rig.records(Complete)] == [False, False]  # type: ignore
    assert check_journal(rig.journal.records) == []


def _tamper(r: Rollout, f: Callable[[dict[str, object]], None], tmp: Path,
            j: Journal) -> set[PurityIssue]:
    s = r.sample(run="run", step=0, group_id="run:s0:p0", prompt_index=0, group_size=1,
                 sample_index=0, sampling=SAMPLING, engine=ENGINE)
    d = s.to_dict()
    f(d)
    jpath = tmp / "j.jsonl"
    jpath.write_text("".join(x.to_json() + "\n" for x in j.records))
    rep = audit_purity([TrajectorySample.from_dict(d)], read_journal_summary(jpath))
    return {x.issue for x in rep.findings}


@pytest.fixture(scope="module")
def recomputed() -> Iterator[tuple[Rollout, Journal]]:
    rig = Rig(UpdateMode.RECOMPUTE)
    rig.start(prompts(1, base=61), max_tokens=200)
    rig.progress(1, 10)
    rig.update()
    (r,) = rig.join()
    yield r, rig.journal


def test_the_audit_finds_a_tampered_stitch_salt_or_bound(
        recomputed: tuple[Rollout, Journal], tmp_path: Path) -> None:
    r, j = recomputed
    assert _tamper(r, lambda d: None, tmp_path, j) == set()

    def seg(i: int, key: str, value: object) -> Callable[[dict[str, object]], None]:
        def f(d: dict[str, object]) -> None:
            d["completion"]["versions"]["segments"][i][key] = value  # type: ignore[index]
        return f

    assert _tamper(r, seg(1, "prefill_tokens", 41), tmp_path, j) == {PurityIssue.BAD_STITCH}
    assert _tamper(r, seg(1, "cache_salt", salt_for(WeightVersion(0, "default", "x"))),
                   tmp_path, j) == {PurityIssue.SALT_MISMATCH}
    assert _tamper(r, seg(0, "cache_salt", None), tmp_path, j) == {PurityIssue.UNSALTED}

    def bound(d: dict[str, object]) -> None:
        d["completion"]["versions"]["max_staleness"] = 0  # type: ignore[index]
    assert _tamper(r, bound, tmp_path, j) == {PurityIssue.BEYOND_BOUND}

    def kv(d: dict[str, object]) -> None:
        sp = d["completion"]["versions"]["spans"][1]  # type: ignore[index]
        sp["kv"] = ["default", sp["label"]]
    assert _tamper(r, kv, tmp_path, j) == {PurityIssue.KV_CROSS_VERSION}

    def engine(d: dict[str, object]) -> None:
        d["completion"]["weight_versions"][1]["version"] = "default"  # type: ignore[index]
    assert PurityIssue.ENGINE_DISAGREES in _tamper(r, engine, tmp_path, j)
