"""The asynchronous update modes against a real vLLM (CPU, tiny Llama): issue 20.

One paced engine (``slowstep``, see ``test_vllm_adapter``) serves the
module; every test builds its own controller, adapter and gloo transport
on it, in the mode under test, and drives real updates (A <-> B) while long
rollouts stream through ``RolloutClient``:

* ``keep`` and ``recompute`` with long rollouts across two updates: every
  token's recorded version equals vLLM's own ``weight_versions`` spans (and
  the stream's derivation agrees with them), the recompute stitch adds up
  (each resubmission prefilled prompt + output so far, nothing lost or
  repeated), and the recomputed part's logprobs re-score within the replay
  tolerance on the version that produced them;
* the cache negative control in keep mode: unsalted, a request after the
  update reuses the kept request's blocks (prefix hits) and its tokens
  differ from a cold engine on the new weights; salted, 0 hits and the
  tokens are the cold engine's;
* the bound: k = 1 and three quick updates: no recorded sample exceeds it,
  and every rollout that would have is reported in the journal;
* faults with requests kept: the trainer dies mid-transfer, the engine is
  killed mid-transfer; classified within the deadline, the kept rollouts
  end with a clear error and unattributable records. The kill comes last:
  it takes the module's engine down.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from enginetools import EngineFactory, TinyModels, kill_engine
from rolloutcore.control.async_modes import Rollout, RolloutClient, RolloutStatus
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.core.records import Carry, Complete, UpdateMode
from rolloutcore.core.versions import EngineIdentity, Provenance, WeightIdentity
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.wire import prefix_cache_delta
from rolloutcore.errors import TransferError, UpdateFailed
from rolloutcore.provenance.audit import audit_file
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.replay import DEFAULT_TOLERANCE, compare_logprobs
from rolloutcore.provenance.trajectory import SEED_NONE, SamplingSpec, TrajectoryGroup
from rolloutcore.session import identity_of
from rolloutcore.transports.gloo import GlooTransport, _as_cpu
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

LONG = 460                 # output tokens of a long rollout (prompt 40, max_model_len 512)
OP_TIMEOUT_S = 15.0
DL = Deadlines(drain_s=60, pause_s=30, preflight_s=30, transfer_s=30, reset_s=10,
               validate_s=30, resume_s=10, live_validate_s=60, bootstrap_s=60, fence_s=30,
               cancel_grace_s=3, retry_backoff_s=0.2)
SAMPLING = SamplingSpec(0.0, max_tokens=LONG, seed=None, seed_derivation=SEED_NONE,
                        extra={"ignore_eos": True})
_rng = random.Random(20)
#: The cache control's prompts: longer than two 128-token KV blocks, one per case.
CACHE_PROMPTS = {salted: [_rng.randrange(256) for _ in range(300)] for salted in (False, True)}
TAIL = [7, 8, 9]


def _prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


class Serving:
    """Which checkpoint the module's engine holds (tests alternate A and B)."""

    def __init__(self, models: TinyModels) -> None:
        self.models = models
        self.name = "A"
        self.ids: dict[str, WeightIdentity] = {
            n: identity_of(WeightSource.from_checkpoint(p), Provenance(str(p)))
            for n, p in (("A", models.A), ("B", models.B))}

    def other(self) -> str:
        return "B" if self.name == "A" else "A"


@pytest.fixture(scope="module")
def started(engine_factory: EngineFactory, tiny_models: TinyModels
            ) -> Iterator[tuple[ManagedEngine, dict[bool, list[int]]]]:
    """The paced engine on A (8 ms of sleep per step: long rollouts outlast two updates),
    and what a server cold-started on B generates for the cache control's requests.

    Both start at once; the cold one is stopped as soon as it has answered.
    """
    import slowstep

    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    eng, cold = engine_factory.together(
        (tiny_models.A, {"extra_args": ("--logits-processors", "slowstep:SlowStep",
                                        "--enforce-eager"),
                         "env": {"PYTHONPATH": path, slowstep.ENV: "0.008"}}),
        (tiny_models.B, {"backend": None, "extra_args": ["--enforce-eager"]}))
    try:
        try:
            with VllmHTTP(cold.base_url, timeout_s=120) as h:
                reference = {k: list(h.generate([*p, *TAIL], max_tokens=16, ignore_eos=True,
                                                logprobs=False).token_ids)
                             for k, p in CACHE_PROMPTS.items()}
        finally:
            engine_factory.stop(cold)
        yield eng, reference
    finally:
        engine_factory.stop(eng)


@pytest.fixture(scope="module")
def cold_b(started: tuple[ManagedEngine, dict[bool, list[int]]]) -> dict[bool, list[int]]:
    return started[1]


@pytest.fixture(scope="module")
def engine(started: tuple[ManagedEngine, dict[bool, list[int]]]) -> ManagedEngine:
    return started[0]


@pytest.fixture(scope="module")
def serving(tiny_models: TinyModels) -> Serving:
    return Serving(tiny_models)


class Rig:
    """A controller in one mode, its runner and a rollout client, on the module's engine."""

    def __init__(self, engine: ManagedEngine, serving: Serving, mode: UpdateMode, *,
                 k: int | None = None, salt: bool = True,
                 transport: GlooTransport | None = None) -> None:
        self.engine, self.serving = engine, serving
        self.http = VllmHTTP(engine.base_url, timeout_s=60)
        self.transport = transport or GlooTransport(op_timeout_s=OP_TIMEOUT_S)
        self.adapter = VllmAdapter(self.http, self.transport, engine_epoch=engine.epoch)
        self.journal = Journal()
        self.c = LifecycleController(config=ControllerConfig(update_mode=mode, max_staleness=k),
                                     listener=self.journal.listener)
        self.runner = LifecycleRunner(self.c, self.adapter, DL, record=self.journal.write)
        self.runner.bootstrap(serving.ids[serving.name])
        # The streams on a client of their own: a step's watchdog shuts down every
        # connection of the adapter's (VllmHTTP.cancel_inflight).
        self.streams = VllmHTTP(engine.base_url, timeout_s=60)
        self.client = RolloutClient(self.c, self.streams, salt=salt, unsafe_unsalted=not salt,
                                    admit_wait_s=120, update_wait_s=120, read_timeout_s=120)
        self.results: dict[str, Rollout] = {}
        self.threads: list[threading.Thread] = []

    def start(self, prompts: list[list[int]], max_tokens: int = LONG) -> list[str]:
        ids = []
        for p in prompts:
            rid = f"r-{len(self.threads)}-{random.getrandbits(32):08x}"
            ids.append(rid)

            def go(p: list[int] = p, rid: str = rid) -> None:
                self.results[rid] = self.client.run(p, max_tokens=max_tokens, ignore_eos=True,
                                                    rollout_id=rid)
            th = threading.Thread(target=go, daemon=True)
            th.start()
            self.threads.append(th)
        return ids

    def progress(self, rids: list[str], at_least: int, timeout_s: float = 120) -> None:
        """Wait until each of ``rids`` has received ``at_least`` more tokens."""
        base = self.client.in_flight()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            now = self.client.in_flight()
            if all(rid in now and now[rid] - base.get(rid, 0) >= at_least for rid in rids):
                return
            time.sleep(0.01)
        raise AssertionError(f"rollouts did not progress: {now} (from {base})")

    def update(self) -> Any:
        name = self.serving.other()
        self.adapter.stage(WeightSource.from_checkpoint(self.serving.models.A if name == "A"
                                                        else self.serving.models.B))
        out = self.runner.run_update(self.serving.ids[name])
        self.serving.name = name
        return out

    def join(self) -> list[Rollout]:
        for th in self.threads:
            th.join(300)
            assert not th.is_alive(), "a rollout never ended"
        return list(self.results.values())

    def record(self, rollouts: list[Rollout], tmp: Path) -> Any:
        eid = EngineIdentity("0.32.0", self.http.model(), {}, self.http.base_url)
        path = tmp / "traj.jsonl"
        with TrajectoryRecorder(path) as rec:
            for i, r in enumerate(rollouts):
                rec.append_group(TrajectoryGroup((r.sample(
                    run="async", step=0, group_id=f"async:s0:p{i}", prompt_index=i,
                    group_size=1, sample_index=0, sampling=SAMPLING, engine=eid),)))
        jpath = tmp / "journal.jsonl"
        jpath.write_text("".join(x.to_json() + "\n" for x in self.journal.records))
        return audit_file(path, jpath)

    def close(self) -> None:
        try:
            if self.engine.alive() and self.http.is_paused(timeout_s=60):
                self.http.resume(timeout_s=60)
        finally:
            self.adapter.close()
            self.streams.close()


@pytest.fixture()
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for r in made:
        with contextlib.suppress(Exception):
            r.close()


def _rescore_tail(http: VllmHTTP, r: Rollout) -> Any:
    """The last segment's logprobs against a teacher-forced score on the serving weights."""
    st = r.stitched
    assert st is not None and st.logprobs is not None
    seg = st.versions.segments[-1]
    scored = http.score([*r.prompt, *st.token_ids])
    n = len(r.prompt)
    return compare_logprobs(st.logprobs[seg.start:seg.end],
                            scored[n + seg.start:n + seg.end], DEFAULT_TOLERANCE)


# --------------------------------------------------------------------------- the modes


@pytest.mark.parametrize("mode", [UpdateMode.KEEP, UpdateMode.RECOMPUTE])
def test_long_rollouts_across_two_updates(engine: ManagedEngine, serving: Serving,
                                          rigs: list[Rig], tmp_path: Path,
                                          mode: UpdateMode) -> None:
    rig = Rig(engine, serving, mode)
    rigs.append(rig)
    rids = rig.start([_prompt(100 + i) for i in range(3)])
    rig.progress(rids, 8)
    v1 = rig.update().published
    rig.progress(rids, 8)
    v2 = rig.update().published
    out = rig.join()
    for r in out:
        assert r.status is RolloutStatus.COMPLETED and r.attributable, r.error
        st = r.stitched
        assert st is not None and len(st.token_ids) == LONG
        v = st.versions
        # Recorded per-token versions are vLLM's own spans, and the stream agrees.
        assert v.source == "engine" and r.derived_agrees is True
        assert [lab for lab, _, _ in st.engine_spans or ()] == [s.label for s in v.spans]
        assert v.generations[-2:] == (v1.generation, v2.generation)
        if mode is UpdateMode.KEEP:
            assert len(v.segments) == 1 and r.recomputed_tokens == 0
            assert v.spans[-1].kv[-1] == v2.label and len(v.spans[-1].kv) == len(v.spans)
        else:
            segs = v.segments
            assert len(segs) == 3 and [s.label for s in segs][1:] == [v1.label, v2.label]
            # Nothing lost or duplicated: each resubmission prefilled prompt + output so far.
            assert [s.prefill_tokens for s in segs] == [40 + s.start for s in segs]
            assert [s.end - s.start for s in segs] == [len(x.token_ids) for x in r.runs]
            assert all(s.kv == (s.label,) for s in v.spans)
            assert r.recomputed_tokens == sum(s.prefill_tokens for s in segs[1:]) > 0
            lane = _rescore_tail(rig.http, r)
            assert lane.positions > 0 and lane.over_tolerance == 0, lane
    assert check_journal(rig.journal.records) == []
    report = rig.record(out, tmp_path)
    assert report.purity.ok, report.purity.format_table()
    assert report.purity.mixed_within_bound == 3
    if mode is UpdateMode.KEEP:
        assert rig.c.sweep_due and rig.runner.sweep() is True


def test_cache_negative_control_in_keep_mode(engine: ManagedEngine, serving: Serving,
                                             rigs: list[Rig], cold_b: dict[bool, list[int]]
                                             ) -> None:
    """Unsalted: stale prefix hits and tokens unlike a cold B; salted: 0 and exactly B's."""
    seen: dict[bool, tuple[float, list[int]]] = {}
    for salted in (False, True):
        if serving.name != "A":  # back to A, strictly (drain, reset): a clean start
            back = Rig(engine, serving, UpdateMode.STRICT)
            rigs.append(back)
            back.update()
        rig = Rig(engine, serving, UpdateMode.KEEP, salt=salted)
        rigs.append(rig)
        p = CACHE_PROMPTS[salted]
        (rid,) = rig.start([p], max_tokens=150)
        rig.progress([rid], 4)
        rig.update()                       # A -> B, the rollout kept across it
        assert serving.name == "B"
        before = rig.http.metrics()
        g = rig.client.run([*p, *TAIL], max_tokens=16, ignore_eos=True)
        hits = prefix_cache_delta(before, rig.http.metrics()).hits
        seen[salted] = (hits, list(g.token_ids))
        (kept,) = rig.join()
        assert kept.status is RolloutStatus.COMPLETED, kept.error
    assert seen[False][0] >= 256 and seen[False][1] != cold_b[False]
    assert seen[True][0] == 0 and seen[True][1] == cold_b[True]


def test_staleness_k1_three_quick_updates(engine: ManagedEngine, serving: Serving,
                                          rigs: list[Rig], tmp_path: Path) -> None:
    rig = Rig(engine, serving, UpdateMode.KEEP, k=1)
    rigs.append(rig)
    first = rig.start([_prompt(200 + i) for i in range(2)])
    rig.progress(first, 8)
    rig.update()
    second = rig.start([_prompt(300)])
    rig.progress(first + second, 4)
    rig.update()                            # the first two would now be 2 versions old
    rig.progress(second, 4)
    rig.update()                            # ...and so would the third
    short = [rig.client.run(_prompt(400 + i), max_tokens=8) for i in range(2)]
    out = rig.join() + short
    over = {rid for c in (j.record for j in rig.journal.records)
            if isinstance(c, Carry) for rid in c.over_bound}
    assert {r.rollout_id for r in out if r.status is RolloutStatus.OVER_BOUND} == over
    assert set(first) | set(second) <= over  # each was carried into a third version
    done = [r for r in out if r.status is RolloutStatus.COMPLETED]
    assert done and all(r.attributable and (r.staleness or 0) <= 1 for r in done)
    assert all(not r.attributable for r in out if r.rollout_id in over)
    completes = {j.record.rollout_id: j.record for j in rig.journal.records
                 if isinstance(j.record, Complete)}
    assert set(completes) == {r.rollout_id for r in out}  # nothing lost
    assert check_journal(rig.journal.records) == []
    report = rig.record(done, tmp_path)
    assert report.purity.ok and report.purity.journal.over_bound == over


# --------------------------------------------------------------------------- faults


class GatedGloo(GlooTransport):
    """The trainer end, held after ``pause_after`` tensors of a send (a real mid-transfer)."""

    def __init__(self, *, pause_after: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.pause_after = pause_after
        self.reached = threading.Event()
        self.release = threading.Event()

    def _broadcast(self, conn: Any, source: WeightSource) -> int:
        n = 0
        for _name, t in source.named_tensors():
            if self._abort.is_set():
                raise TransferError("transfer", "aborted", mutation_started=True)
            if n == self.pause_after and not self.reached.is_set():
                self.reached.set()
                self.release.wait(120)
                if self._abort.is_set():
                    raise TransferError("transfer", "the trainer died", mutation_started=True)
            conn.group.broadcast(_as_cpu(t), 0).wait()
            n += 1
        return n


def _kept_fault(engine: ManagedEngine, serving: Serving, rigs: list[Rig],
                fault: Callable[[Rig, GatedGloo], float], bound_s: float) -> list[Rollout]:
    tr = GatedGloo(pause_after=9, op_timeout_s=OP_TIMEOUT_S)
    rig = Rig(engine, serving, UpdateMode.KEEP, transport=tr)
    rigs.append(rig)
    rids = rig.start([_prompt(500 + i) for i in range(2)])
    rig.progress(rids, 8)
    box: dict[str, BaseException] = {}

    def upd() -> None:
        try:
            rig.update()
        except BaseException as exc:
            box["error"] = exc

    th = threading.Thread(target=upd, daemon=True)
    th.start()
    assert tr.reached.wait(120), "the transfer never reached the gate"
    assert rig.c.state is State.UPDATING and set(rig.c.active) == set(rids)  # kept
    t_fault = fault(rig, tr)
    th.join(bound_s + 30)
    assert not th.is_alive()
    err = box.get("error")
    assert isinstance(err, UpdateFailed) and err.classification == "ambiguous", err
    assert rig.c.state is State.TAINTED
    tainted_at = next(j.t_mono for j in rig.journal.records
                      if j.kind == "transition" and j.data["to"] == "TAINTED")
    assert tainted_at - t_fault <= bound_s + 1.0
    out = rig.join()
    for r in out:
        assert r.status is RolloutStatus.FAILED and not r.attributable
        assert r.error and "TAINTED" in r.error, r.error
    assert sorted(j.record.attributable for j in rig.journal.records  # type: ignore[attr-defined]
                  if isinstance(j.record, Complete)) == [False, False]
    assert check_journal(rig.journal.records) == []
    return out


def test_trainer_dies_mid_transfer_with_kept_requests(
        engine: ManagedEngine, serving: Serving, rigs: list[Rig]) -> None:
    def die(rig: Rig, tr: GatedGloo) -> float:
        t = time.monotonic()
        tr.abort()          # its process group torn down, as a dead trainer's is
        tr.release.set()
        return t

    _kept_fault(engine, serving, rigs, die, DL.transfer_s)
    serving.name = "?"  # partly updated: only a replacement process serves a known policy


@pytest.mark.slow  # it restarts the engine the trainer-death case left tainted (~1 min)
def test_engine_killed_while_requests_are_kept(
        engine: ManagedEngine, serving: Serving, rigs: list[Rig]) -> None:
    def kill(rig: Rig, tr: GatedGloo) -> float:
        t = kill_engine(engine)
        tr.release.set()
        return t

    if serving.name not in ("A", "B"):
        # The trainer-death case left it tainted and partly updated: a new process on A.
        for r in rigs:
            r.close()
        rigs.clear()
        engine.restart(serving.models.A)
        serving.name = "A"
    _kept_fault(engine, serving, rigs, kill, DL.transfer_s)
