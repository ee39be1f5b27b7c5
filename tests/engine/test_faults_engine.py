"""Fault injection against a real vLLM (CPU, tiny Llama): classify, in time, safely, recover.

One engine serves the whole module; each case builds a fresh controller,
journal, adapter and trajectory file on it, records rollouts before the
fault (and during it, where one is in flight), injects one fault for real,
and asserts:

(a) the classification the controller reached (and the state it ended in);
(b) how long that took after the fault, against the bound the deadlines on
    that path give (each case states its bound): classified before the bound
    plus 1 s;
(c) nothing published that was not validated: ``check_journal`` and the
    controller's published versions (the failed target is never among them);
(d) no rollout lost or recorded under a wrong version: every rollout that
    completed attributable is in the trajectory file, and ``audit_purity``
    (binding vs the engine's own per-token spans vs the journal) finds
    nothing;
(e) recovery to READY on a replacement process (new epoch) verified by label,
    policy probe and cold-load checksums, with rollouts recorded under the
    recovered version afterwards.

The faults: SIGKILL of the engine's process group while DRAINING (a long
rollout in flight), mid-transfer (the trainer paused after k of n tensors,
the engine killed, the trainer released), at the start of INVALIDATING,
VALIDATING and RESUMING; SIGKILL of a trainer *process* mid-transfer
(classified by the lease); HTTP 500, a held answer, a cut connection and
``success: false`` through ``FaultProxy``; SIGKILL of a controller process
mid-update, restarted from its journal.

Each case appends one row to the fault matrix; with
``ROLLOUTCORE_FAULT_MATRIX=path`` the module writes it as JSON at the end
(``results/fault-matrix.json``; ``docs/fault-matrix.md`` shows it).

This file is also the entry point of the trainer and controller processes
that the process-kill cases start (``python test_faults_engine.py trainer|controller ...``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels, kill_engine, merge_rows
from helpers import fault_matrix
from helpers.fault_matrix import lifecycle_table
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, read_journal, restore_controller
from rolloutcore.control.runner import Deadlines, LifecycleRunner, UpdateOutcome
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
    evidence_to_dict,
)
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.recovery import ManagedRecoverer, OperatorRecoverer, set_weight_version
from rolloutcore.engine.verify import take_reference
from rolloutcore.errors import RolloutCoreError, TransferError, UpdateFailed
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.session import identity_of
from rolloutcore.testing.faultproxy import Fault, FaultProxy
from rolloutcore.transports.gloo import GlooTransport, _as_cpu
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import ReferenceChecksums
from rolloutcore.verification.probe import PolicyProbe

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
OP_TIMEOUT_S = 15.0        # gloo collectives, trainer and engine ends
LEASE_S = 10.0             # a remote trainer's transfer lease
RESTORE_BOUND_S = 10.0     # a restarted controller must know where it stands by then
MARGIN_S = 1.0
DL = Deadlines(drain_s=60, pause_s=8, preflight_s=30, transfer_s=30, reset_s=8, validate_s=30,
               resume_s=8, live_validate_s=90, bootstrap_s=60, recover_s=600, fence_s=10,
               cancel_grace_s=3, retry_backoff_s=0.2)
RETRIES = ControllerConfig().max_incomplete


def _load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("rolloutcore_bench_soak",
                                                  ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


soak = _load_soak()


def ident(name: str, path: Path) -> WeightIdentity:
    return identity_of(WeightSource.from_checkpoint(path),
                       Provenance(name, "faults", 0 if name == "A" else 1))


# --------------------------------------------------------------------------- fault tools


class GatedGloo(GlooTransport):
    """The trainer end, stopped after ``pause_after`` tensors of a send: a real mid-transfer.

    The gate is in the broadcast loop itself, so when it holds, the engine has
    accepted ``/start_weight_update`` and ``/update_weights`` and received
    ``pause_after`` of the tensors.
    """

    def __init__(self, *, pause_after: int | None = None, hold_s: float = 120.0,
                 on_reached: Callable[[int], None] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.pause_after = pause_after
        self.hold_s = hold_s
        self.on_reached = on_reached
        self.reached = threading.Event()
        self.release = threading.Event()

    def _broadcast(self, conn: Any, source: WeightSource) -> int:
        n = 0
        for _name, t in source.named_tensors():
            if self._abort.is_set():
                raise TransferError("transfer", "aborted", mutation_started=True)
            if n == self.pause_after and not self.reached.is_set():
                self.reached.set()
                if self.on_reached is not None:
                    self.on_reached(n)
                self.release.wait(self.hold_s)
            conn.group.broadcast(_as_cpu(t), 0).wait()
            n += 1
        return n


class Hooked:
    """A LifecycleAdapter that runs ``hook`` once, at the start of one effect."""

    def __init__(self, inner: VllmAdapter, effect: str, hook: Callable[[], None]) -> None:
        self.inner, self.effect, self.hook = inner, effect, hook
        self.fired_at: float | None = None

    def _maybe(self, name: str) -> None:
        if name == self.effect and self.fired_at is None:
            self.fired_at = time.monotonic()
            self.hook()

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        return self.inner.caches

    def bootstrap(self) -> BootstrapEvidence:
        return self.inner.bootstrap()

    def drain(self, mode: PauseMode) -> DrainEvidence:
        self._maybe("drain")
        return self.inner.drain(mode)

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        return self.inner.preflight(target)

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        self._maybe("transfer")
        return self.inner.transfer(target)

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        self._maybe("reset_cache")
        return self.inner.reset_cache(cache)

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        self._maybe("validate_live" if live else "validate")
        return self.inner.validate(target, live=live)

    def resume(self) -> ResumeEvidence:
        self._maybe("resume")
        return self.inner.resume()

    def fence(self) -> None:
        self.inner.fence()

    def cancel(self, step: Step) -> None:
        self.inner.cancel(step)

    def close(self) -> None:
        self.inner.close()


class Lines:
    """A subprocess's stdout lines, readable with a timeout."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[str | None] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout

        def pump() -> None:
            for line in out:
                self.q.put(line.rstrip("\n"))
            self.q.put(None)

        threading.Thread(target=pump, daemon=True).start()

    def wait_for(self, prefix: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.q.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            if line.startswith(prefix):
                return line
        return None


def spawn(role: str, *args: object) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.Popen([sys.executable, __file__, role, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def stop_proc(p: subprocess.Popen[str]) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    p.wait(30)
    for f in (p.stdin, p.stdout):
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


# --------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    engine: ManagedEngine
    models: TinyModels
    proxy: FaultProxy
    ids: dict[str, WeightIdentity]
    probes: dict[str, PolicyProbe]
    ref_a: ReferenceChecksums
    serving: str = "A"
    rows: list[dict[str, Any]] = field(default_factory=list)

    def path(self, name: str) -> Path:
        return self.models.A if name == "A" else self.models.B

    def other(self) -> str:
        return "B" if self.serving == "A" else "A"

    def recoverer(self, **kw: Any) -> ManagedRecoverer:
        """Back to A, the checkpoint with a cold-load reference, on a new process."""
        return ManagedRecoverer(self.engine, self.models.A, identity=self.ids["A"],
                                reference=self.ref_a, probe=self.probes["A"],
                                on_replaced=lambda e: self.proxy.set_upstream(e.base_url), **kw)


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[Rig]:
    t_run = time.time()
    load = os.getloadavg()
    # Eager mode: the same engine, without torch.compile at start-up, so that each of
    # the module's ten replacement processes starts in about half the time.
    eng = engine_factory(tiny_models.A, extra_args=["--enforce-eager"])
    proxy = FaultProxy(eng.base_url).start()
    try:
        with VllmHTTP(eng.base_url, timeout_s=60) as h:
            assert h.label() == "default"  # a cold load of A: its checksums are A's reference
            ref_a = take_reference(
                h, WeightSource.from_checkpoint(tiny_models.A).content_digest(),
                origin="cold-load", source=str(tiny_models.A))
        r = Rig(eng, tiny_models, proxy,
                {"A": ident("A", tiny_models.A), "B": ident("B", tiny_models.B)},
                {"A": PolicyProbe.from_checkpoint(str(tiny_models.A)),
                 "B": PolicyProbe.from_checkpoint(str(tiny_models.B))}, ref_a)
        yield r
    finally:
        proxy.stop()
        engine_factory.stop(eng)
    rows = r.rows
    print("\nfault matrix\n" + lifecycle_table(rows))
    out = os.environ.get("ROLLOUTCORE_FAULT_MATRIX")
    if out and rows:
        run = {"machine": {**soak.machine(), "loadavg_at_start": load},
               "versions": soak.versions(),
               "command": "ROLLOUTCORE_FAULT_MATRIX=" + out + " "
               + shlex.join([sys.executable, "-m", "pytest", *sys.argv[1:]]),
               "started_unix": t_run, "deadlines": dict(DL.__dict__),
               "op_timeout_s": OP_TIMEOUT_S, "lease_s": LEASE_S}
        # Merged by case: tests/engine/test_service_verify_engine.py writes rows too.
        merge_rows(Path(out), [{**row, "run": run} for row in rows])


# --------------------------------------------------------------------------- one case


def relabel(rig: Rig, name: str) -> None:
    """Give the engine a label no controller used before this case takes it over.

    The engine carries the label the previous case's recovery gave it (say
    ``rc-2``), and a new controller would publish its own recovery as
    ``rc-2`` again (on another epoch): the engine's per-token spans could not
    tell the two apart. The weights are known (the previous case verified
    them), so a case-unique label for them is a true statement. See the
    report: ``LifecycleController.recovered`` does not avoid published labels.
    """
    set_weight_version(rig.engine.base_url, f"{name.replace('_', '-')}-v0", timeout_s=30)


class Case:
    """Controller + journal + adapter + rollouts + records for one fault, and its row."""

    def __init__(self, rig: Rig, name: str, tmp: Path, fault: str, *, via_proxy: bool = False,
                 transport: GlooTransport | bool = True,
                 deadlines: Deadlines = DL) -> None:
        self.rig, self.name, self.tmp = rig, name, tmp
        self.via_proxy = via_proxy
        self.base = rig.proxy.base_url if via_proxy else rig.engine.base_url
        self.journal_path, self.traj_path = tmp / "journal.jsonl", tmp / "trajectories.jsonl"
        self.journal = Journal(self.journal_path)
        self.c = LifecycleController(listener=self.journal.listener)
        tr: GlooTransport | None
        if transport is True:
            tr = GlooTransport(op_timeout_s=OP_TIMEOUT_S)
        elif transport is False:
            tr = None
        else:
            tr = transport
        self.transport = tr
        self.adapter = self.new_adapter(tr)
        self.runner = LifecycleRunner(self.c, self.adapter, deadlines, record=self.journal.write)
        relabel(rig, name)
        self.runner.bootstrap(rig.ids[rig.serving])
        assert self.c.committed is not None
        self.v0 = self.c.committed
        self.http = VllmHTTP(self.base, timeout_s=120)
        self.recorder = TrajectoryRecorder(self.traj_path)
        self.book = soak.RolloutBook(self.c, self.http, self.recorder,
                                     soak.engine_identity(self.http), run=name.replace("_", "-"))
        self.row: dict[str, Any] = {"case": name, "fault": fault}
        self.target: str | None = None
        self.extra_ok = 0  # attributable rollouts recorded by another process
        self.updates = 0
        _OPEN.append(self)

    def new_adapter(self, tr: GlooTransport | None) -> VllmAdapter:
        return VllmAdapter(VllmHTTP(self.base, timeout_s=60), tr,
                           engine_epoch=self.rig.engine.epoch, drain_timeout_s=60,
                           transfer_timeout_s=DL.transfer_s, connect_timeout_s=60)

    # -- rollouts -----------------------------------------------------------
    def rollouts(self, n: int = 3, max_tokens: int = 24) -> list[str]:
        outs: list[str] = []
        lock = threading.Lock()

        def one() -> None:
            o = self.book.rollout(max_tokens=max_tokens)
            with lock:
                outs.append(o)

        ths = [threading.Thread(target=one) for _ in range(n)]
        for t in ths:
            t.start()
        for t in ths:
            t.join(180)
        return outs

    def long_rollout(self, turns: int = 200) -> tuple[threading.Thread, list[str]]:
        """A multi-turn rollout (an agent's episode): one binding, many generations.

        It runs until a turn fails or ``turns`` are done, so it is in flight
        for as long as the test needs, on any machine. Its last turn is
        recorded if it completes; every turn's spans must name its binding.
        """
        out: list[str] = []
        admitted = threading.Event()
        rid = f"{self.name}-long"

        def run() -> None:
            b = self.c.admit(rid)
            admitted.set()
            labels: set[str] = set()
            try:
                for t in range(turns):
                    g = self.http.generate([(7 * t + i) % 250 + 1 for i in range(40)],
                                           max_tokens=64, temperature=0.0, timeout_s=120)
                    labels |= g.versions()
            except RolloutCoreError:
                self.c.complete(rid)
                out.append("failed")
                return
            done = self.c.complete(rid)
            out.append("ok" if done.attributable and labels == {b.version.label}
                       else "unattributable")

        th = threading.Thread(target=run, daemon=True)
        th.start()
        assert admitted.wait(30)
        return th, out

    # -- updates ------------------------------------------------------------
    def stage(self, target: str) -> WeightIdentity:
        self.target = target
        a = self.adapter.inner if isinstance(self.adapter, Hooked) else self.adapter
        a.stage(WeightSource.from_checkpoint(self.rig.path(target)),
                provenance=self.rig.ids[target].provenance,
                reference_checksums=dict(self.rig.ref_a.checksums) if target == "A" else None,
                probes=self.rig.probes[target])
        return self.rig.ids[target]

    def label(self) -> str:
        """A label no controller of this engine used: the engine may already serve 'rc-N'."""
        self.updates += 1
        return f"{self.name.replace('_', '-')}-{self.updates}"

    def update(self, target: str) -> UpdateOutcome | UpdateFailed:
        identity = self.stage(target)
        try:
            return self.runner.run_update(identity, label=self.label(),
                                          min_verification=VerificationLevel.PROBE)
        except UpdateFailed as exc:
            return exc

    def update_in_thread(self, target: str) -> tuple[threading.Thread,
                                                     list[UpdateOutcome | UpdateFailed]]:
        res: list[UpdateOutcome | UpdateFailed] = []
        th = threading.Thread(target=lambda: res.append(self.update(target)), daemon=True)
        th.start()
        return th, res

    def wait_state(self, state: State, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.c.state is not state:
            assert time.monotonic() < deadline, f"never reached {state}, in {self.c.state}"
            time.sleep(0.005)

    # -- what happened -------------------------------------------------------
    def classify(self, t_fault: float, bound_s: float, bound: str, *,
                 records: list[Any] | None = None) -> None:
        """(a), (b): the decisions after the fault, from the journal's own clock."""
        recs = records if records is not None else self.journal.records
        verdicts = [r for r in recs if r.kind == "verdict" and r.t_mono >= t_fault
                    and r.data.get("classification")]
        classes = [str(r.data["classification"]) for r in verdicts]
        decisions = [r for r in verdicts if r.data["classification"] != "incomplete"]
        decided = decisions[-1] if decisions else verdicts[-1]
        finals = [r for r in recs if r.kind == "transition" and r.t_mono >= t_fault
                  and r.data["to"] in ("READY", "TAINTED")]
        self.row.update({
            "classification": str(decided.data["classification"]),
            "classifications": classes,
            "state_after_fault": self.c.state.value,
            "seconds_to_classify": round(decided.t_mono - t_fault, 4),
            "seconds_to_final_state": (round(finals[0].t_mono - t_fault, 4) if finals
                                       else None),
            "deadline_s": bound_s, "bound": bound,
            "within_deadline": decided.t_mono - t_fault <= bound_s + MARGIN_S,
        })

    def recover(self, recoverer: Any, *, how: str = "restart") -> None:
        """(e): TAINTED -> READY on a replacement process; rollouts under the new version."""
        assert self.c.state is State.TAINTED
        old = self.c.committed
        self.adapter.close()  # its transport belongs to the old incarnation
        t0 = time.monotonic()
        v = self.runner.recover(recoverer, owner="test")
        dt = time.monotonic() - t0
        assert v.accepted and self.c.state is State.READY
        new = self.c.committed
        assert new is not None and old is not None
        assert new.engine_epoch != old.engine_epoch and new.generation > old.generation
        assert self.c.identity is not None
        assert self.c.identity.verification >= VerificationLevel.PROBE
        self.adapter = self.new_adapter(GlooTransport(op_timeout_s=OP_TIMEOUT_S))
        self.runner.adapter = self.adapter
        self.rig.serving = "A"
        outs = self.rollouts(3)
        assert outs.count("ok") == 3, outs
        assert self.book.bound_labels[new.label] >= 3
        with VllmHTTP(self.rig.engine.base_url, timeout_s=30) as h:
            assert h.label() == new.label
        timings = getattr(recoverer, "last", None)
        self.row.update({"recovered": True, "recovery": how, "recovery_s": round(dt, 2),
                         "recovery_detail": timings.to_dict() if timings else None,
                         "published_after_recovery": new.to_dict()})

    def close(self) -> None:
        """Idempotent: also run by the fixture when a case fails half-way."""
        with contextlib.suppress(Exception):
            self.adapter.close()
        self.http.close()
        self.recorder.close()
        self.journal.close()

    def finish(self) -> dict[str, Any]:
        """(c), (d) from the files; the row goes into the matrix before anything is asserted."""
        self.close()
        chk = soak.check_records(self.journal_path, self.traj_path, self.book)
        unvalidated = [v for v in chk.journal_violations
                       if v.startswith(("commit_after_validation", "fail_closed"))]
        # Every target of an update that ended in a taint or an abandon: never published.
        failed, pending = [], None
        recs = read_journal(self.journal_path)
        for r in recs:
            if r.kind == "request_update":
                pending = r.data["target"]
            elif r.kind in ("taint", "abandon") and pending is not None:
                failed.append(pending)
                pending = None
            elif r.kind == "commit":
                pending = None
        commits = [r.data["version"] for r in recs if r.kind == "commit"]
        bad_publish = any(t in commits for t in failed)
        self.row["failed_targets"] = failed
        lost = chk.records_lost + self.extra_ok
        self.row.update({
            "published": chk.published,
            "published_unvalidated": len(unvalidated) + int(bad_publish),
            "journal_violations": chk.journal_violations,
            "records": chk.samples, "records_lost": lost,
            "misattributed": len(chk.purity_findings),
            "purity_findings": chk.purity_findings,
            "samples_without_spans": chk.samples_without_spans,
            "duplicate_labels": chk.duplicate_labels,
            "rollouts": dict(self.book.counts),
        })
        self.row.setdefault("recovered", self.c.state is State.READY)
        self.row.setdefault("recovery", "not needed" if self.c.state is State.READY else None)
        self.rig.rows.append(self.row)
        assert chk.journal_violations == [], chk.journal_violations
        assert not bad_publish
        assert chk.purity_findings == [], chk.purity_findings
        assert chk.samples_without_spans == 0
        assert lost == 0 and chk.samples > 0
        assert chk.duplicate_labels == [], chk.published
        assert self.row["within_deadline"], self.row
        assert self.row["recovered"] is True and self.c.state is State.READY
        return self.row


_OPEN: list[Case] = []


@pytest.fixture()
def case_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    while _OPEN:
        _OPEN.pop().close()


# --------------------------------------------------------------------------- engine kills


@pytest.mark.slow  # a kill and a restart; mid-transfer below is the CI lane's kill case
def test_engine_killed_while_draining_a_long_rollout(rig: Rig, case_dir: Path) -> None:
    k = Case(rig, "engine_sigkill_draining", case_dir, "SIGKILL engine group while DRAINING "
             "(a multi-turn rollout in flight)")
    assert k.rollouts(3).count("ok") == 3
    th, out = k.long_rollout()
    time.sleep(0.5)
    upd, res = k.update_in_thread(rig.other())
    k.wait_state(State.DRAINING)
    time.sleep(0.5)
    assert th.is_alive(), "the long rollout must still be generating"
    assert len(k.c.active) == 1  # the update waits for it: admission closed, nothing mutated
    t_fault = kill_engine(rig.engine)
    upd.join(DL.drain_s + DL.pause_s + DL.resume_s + 30)
    th.join(60)
    assert out == ["failed"]  # it died with the engine: nothing to record
    (err,) = res
    assert isinstance(err, UpdateFailed) and err.phase == "drain"
    assert err.classification == "no_mutation"  # the drain mutated nothing...
    assert k.c.state is State.TAINTED  # ...but the engine is gone: resuming it failed
    k.classify(t_fault, DL.drain_s + DL.pause_s + DL.resume_s,
               "drain_s (local rollouts) + pause_s + resume_s (back to the old version)")
    assert k.row["classifications"] == ["no_mutation", "ambiguous"]
    k.recover(rig.recoverer())
    k.finish()


def test_engine_killed_mid_transfer(rig: Rig, case_dir: Path) -> None:
    tr = GatedGloo(op_timeout_s=OP_TIMEOUT_S, pause_after=9)
    k = Case(rig, "engine_sigkill_mid_transfer", case_dir,
             "SIGKILL engine group after 9 of 21 tensors were broadcast", transport=tr)
    assert k.rollouts(3).count("ok") == 3
    upd, res = k.update_in_thread(rig.other())
    assert tr.reached.wait(120), "the transfer never reached the gate"
    assert k.c.state is State.UPDATING
    assert any(r.kind == "begin_update" for r in k.journal.records)
    t_fault = kill_engine(rig.engine)
    tr.release.set()
    upd.join(DL.transfer_s + DL.fence_s + 30)
    (err,) = res
    assert isinstance(err, UpdateFailed) and err.phase == "transfer"
    assert err.classification == "ambiguous" and k.c.state is State.TAINTED
    k.classify(t_fault, DL.transfer_s, "transfer_s (watchdog on the transfer)")
    k.recover(rig.recoverer())
    k.finish()


@pytest.mark.parametrize(("effect", "state", "bound"), [
    # Slow lane: the same retry-then-taint path as the VALIDATING case, one more restart.
    pytest.param("reset_cache", State.INVALIDATING,
                 (RETRIES + 1) * (DL.reset_s + DL.retry_backoff_s), marks=pytest.mark.slow),
    ("validate", State.VALIDATING, (RETRIES + 1) * (DL.validate_s + DL.retry_backoff_s)),
])
def test_engine_killed_at_the_start_of_a_retryable_step(
        rig: Rig, case_dir: Path, effect: str, state: State, bound: float) -> None:
    k = Case(rig, f"engine_sigkill_{state.value.lower()}", case_dir,
             f"SIGKILL engine group at the start of {effect} ({state.value})")
    hooked = Hooked(k.adapter, effect, lambda: setattr(hooked, "t_kill",
                                                       kill_engine(rig.engine)))
    k.adapter = hooked  # type: ignore[assignment]
    k.runner.adapter = hooked
    assert k.rollouts(3).count("ok") == 3
    out = k.update(rig.other())
    assert isinstance(out, UpdateFailed) and k.c.state is State.TAINTED
    assert out.classification == "ambiguous"
    t_fault = hooked.t_kill  # type: ignore[attr-defined]
    k.classify(t_fault, bound, f"({RETRIES} retries + 1) x (step deadline + backoff): an "
               "incomplete observation is retried, then escalates")
    # The step failed, was retried as incomplete, and escalated to ambiguous.
    assert k.row["classifications"] == ["incomplete"] * RETRIES + ["ambiguous"]
    k.adapter = hooked.inner
    k.recover(rig.recoverer())
    k.finish()


@pytest.mark.slow  # a restart and an operator recovery (~1 min); the slow lane
def test_engine_killed_at_the_start_of_resuming_operator_recovery(
        rig: Rig, case_dir: Path) -> None:
    """The engine is treated as one we did not launch: an operator replaces it."""
    k = Case(rig, "engine_sigkill_resuming", case_dir,
             "SIGKILL engine group at the start of resume (RESUMING); operator recovery")
    with VllmHTTP(rig.engine.base_url, timeout_s=30) as h:
        prev_epoch = f"vllm-{h.server_info()['vllm_config']['instance_id']}"
    hooked = Hooked(k.adapter, "resume", lambda: setattr(hooked, "t_kill",
                                                         kill_engine(rig.engine)))
    k.adapter = hooked  # type: ignore[assignment]
    k.runner.adapter = hooked
    assert k.rollouts(3).count("ok") == 3
    out = k.update(rig.other())
    assert isinstance(out, UpdateFailed) and out.phase == "resume"
    assert out.classification == "ambiguous" and k.c.state is State.TAINTED
    k.classify(hooked.t_kill, DL.resume_s, "resume_s")  # type: ignore[attr-defined]
    k.adapter = hooked.inner
    signal_file = case_dir / "engine-replaced"

    def operator() -> None:
        time.sleep(1.0)
        rig.engine.restart(rig.models.A)  # the person restarts it on the known checkpoint
        rig.proxy.set_upstream(rig.engine.base_url)
        signal_file.write_text("replaced\n")

    th = threading.Thread(target=operator, daemon=True)
    th.start()
    rec = OperatorRecoverer(rig.engine.base_url, rig.models.A, signal=signal_file, wait_s=600,
                            previous_epoch=prev_epoch, identity=rig.ids["A"],
                            reference=rig.ref_a, probe=rig.probes["A"])
    k.recover(rec, how="operator signal")
    th.join(5)
    assert not signal_file.exists()
    k.finish()


# --------------------------------------------------------------------------- trainer process


def test_trainer_process_killed_mid_transfer(rig: Rig, case_dir: Path) -> None:
    """A remote trainer dies mid-broadcast: the lease classifies; the engine side returns."""
    k = Case(rig, "trainer_sigkill_mid_transfer", case_dir,
             "SIGKILL the trainer process after 9 of 21 tensors (remote trainer, lease)",
             transport=False)
    assert k.rollouts(3).count("ok") == 3
    target = rig.other()
    p = spawn("trainer", rig.engine.base_url, rig.path(target), 9, OP_TIMEOUT_S)
    try:
        lines = Lines(p)
        assert lines.wait_for("CONNECTED", 180), "the trainer process did not connect"
        k.stage(target)
        out = k.runner.open_update(rig.ids[target], label=k.label(),
                                   min_verification=VerificationLevel.PROBE)
        t_grant = time.monotonic()
        assert k.c.state is State.UPDATING
        assert p.stdin is not None
        p.stdin.write(f"GO {out.ticket.target.version.label}\n")
        p.stdin.flush()
        assert lines.wait_for("MID-TRANSFER", 60), "the trainer never reached the gate"
        t_fault = time.monotonic()
        os.killpg(p.pid, signal.SIGKILL)
        # The engine's side of the collective must give up by itself (op timeout).
        engine_side: dict[str, Any] = {}

        def probe_engine() -> None:
            try:
                r = httpx.post(f"{rig.engine.base_url}/weight_checker",
                               json={"action": "checksum"}, timeout=OP_TIMEOUT_S + 15)
                engine_side["status"] = r.status_code
            except httpx.HTTPError as exc:
                engine_side["error"] = repr(exc)
            engine_side["s"] = time.monotonic() - t_fault

        watcher = threading.Thread(target=probe_engine, daemon=True)
        watcher.start()
        # The lease: the controller cannot see a remote trainer die; only its report or
        # the lease deadline decide.
        report = lines.wait_for("TRANSFERRED", max(0.0, t_grant + LEASE_S - time.monotonic()))
        assert report is None
        # Its stdout closing is not a signal a remote controller gets: the lease runs out.
        time.sleep(max(0.0, t_grant + LEASE_S - time.monotonic()))
        with pytest.raises(UpdateFailed) as ei:
            k.runner.report_transfer_failure(out, FailureKind.TIMEOUT,
                                             f"lease of {LEASE_S:g}s expired without a report")
        assert ei.value.classification == "ambiguous" and k.c.state is State.TAINTED
        k.classify(t_fault, LEASE_S, "the transfer lease (from the grant; the kill came later)")
        watcher.join(OP_TIMEOUT_S + 20)
        assert "s" in engine_side and "error" not in engine_side, engine_side
        assert engine_side["s"] <= OP_TIMEOUT_S + 5
        k.row["engine_side_returned_s"] = round(engine_side["s"], 3)
    finally:
        stop_proc(p)
    k.recover(rig.recoverer())
    k.finish()


# --------------------------------------------------------------------------- engine answers


#: Cases that restart the engine and repeat a classification another case covers
#: (ambiguous after a mutation started): the slow lane.
SLOW_PROXY = frozenset({"proxy_close_finish_weight_update", "proxy_500_update_weights"})

PROXY_CASES = [
    ("proxy_500_pause", "/pause", Fault.http_status(500), 1, "no_mutation", False),
    ("proxy_timeout_pause", "/pause", Fault.delay(3600), 1, "no_mutation", False),
    ("proxy_close_pause", "/pause", Fault.close(), 1, "no_mutation", False),
    ("proxy_success_false_once_reset", "/reset_prefix_cache", Fault.engine_failure(), 1,
     "incomplete", False),
    ("proxy_500_update_weights", "/update_weights", Fault.http_status(500), 1, "ambiguous",
     True),
    ("proxy_close_finish_weight_update", "/finish_weight_update", Fault.close(upstream=True),
     1, "ambiguous", True),
    ("proxy_success_false_reset", "/reset_prefix_cache", Fault.engine_failure(), None,
     "ambiguous", True),
]


@pytest.mark.parametrize(("name", "route", "fault", "times", "expect", "restart"),
                         [pytest.param(*c, id=c[0], marks=[pytest.mark.slow] * (c[0] in SLOW_PROXY))
                          for c in PROXY_CASES])
def test_engine_answers_through_the_fault_proxy(
        rig: Rig, case_dir: Path, name: str, route: str, fault: Fault, times: int | None,
        expect: str, restart: bool) -> None:
    k = Case(rig, name, case_dir, f"{fault.describe()} on {route}"
             + ("" if times is None else f" ({times}x)"), via_proxy=True)
    assert k.rollouts(3).count("ok") == 3
    rig.proxy.reset()
    rig.proxy.inject(route, fault, times=times)
    target = rig.other()
    out = k.update(target)
    hits = rig.proxy.hits
    rig.proxy.reset()
    assert hits, "the fault was never applied"
    t_fault = hits[0].t_mono
    bounds = {"/pause": (DL.pause_s, "pause_s"),
              "/update_weights": (DL.transfer_s, "transfer_s"),
              "/finish_weight_update": (DL.transfer_s, "transfer_s")}
    if route == "/reset_prefix_cache":
        bound = (RETRIES + 1) * (DL.reset_s + DL.retry_backoff_s) if times is None else \
            DL.reset_s + DL.retry_backoff_s
        bounds[route] = (bound, "(retries + 1) x (reset_s + backoff)")
    k.classify(t_fault, *bounds[route])
    assert k.row["classification"] == expect, k.row
    if expect == "no_mutation":
        assert isinstance(out, UpdateFailed) and k.c.state is State.READY
        assert k.c.committed == k.v0  # back to service on the old version, nothing published
        assert k.rollouts(3).count("ok") == 3
    elif expect == "incomplete":
        # Retried once, then the engine's own success: published, validated.
        assert isinstance(out, UpdateOutcome) and out.published is not None
        assert k.c.state is State.READY and k.row["classifications"] == ["incomplete"]
        rig.serving = target
        assert k.rollouts(3).count("ok") == 3
        assert k.book.bound_labels[out.published.label] == 3
    else:
        assert isinstance(out, UpdateFailed) and k.c.state is State.TAINTED
        if times is None:
            assert k.row["classifications"] == ["incomplete"] * RETRIES + ["ambiguous"]
    if restart:
        k.recover(rig.recoverer())
    k.finish()


# --------------------------------------------------------------------------- controller process


def test_controller_process_killed_mid_update_and_restarted(rig: Rig, case_dir: Path) -> None:
    """The controller (with its trainer end) dies mid-transfer; a new one starts from the journal.

    Recovery fails first (its deadline is too short: the watchdog classifies
    that as a failed recovery, still TAINTED), then succeeds.
    """
    journal_path = case_dir / "journal.jsonl"
    traj_path = case_dir / "trajectories.jsonl"
    target = rig.other()
    relabel(rig, "controller_sigkill_mid_update")
    p = spawn("controller", rig.engine.base_url, rig.engine.epoch, journal_path, traj_path,
              rig.serving, rig.path(rig.serving), target, rig.path(target), 9, OP_TIMEOUT_S)
    try:
        lines = Lines(p)
        ok_line = lines.wait_for("ROLLOUTS-OK", 300)
        assert ok_line, "the controller process never ran its rollouts"
        assert lines.wait_for("MID-TRANSFER", 180), "the controller never reached the transfer"
        t_kill = time.monotonic()
        os.killpg(p.pid, signal.SIGKILL)
    finally:
        stop_proc(p)
    recs = read_journal(journal_path)
    assert recs[-1].kind != "taint" and any(r.kind == "begin_update" for r in recs)
    # The restart: the new controller reads the journal and knows it cannot trust the engine.
    t_restart = time.monotonic()
    c, journal = restore_controller(journal_path)
    restored_s = time.monotonic() - t_restart
    assert c.state is State.TAINTED
    assert c.committed is not None and [v.label for v in c.published] == [c.committed.label]
    assert c.active == {}
    v0 = c.committed
    records = read_journal(journal_path)
    row: dict[str, Any] = {
        "case": "controller_sigkill_mid_update",
        "fault": "SIGKILL the controller process (trainer end inside) after 9 of 21 tensors; "
                 "restarted from its journal",
        "classification": "ambiguous", "classifications": ["ambiguous"],
        "state_after_fault": c.state.value,
        "seconds_to_classify": round(restored_s, 4),
        "seconds_from_kill_to_restored": round(time.monotonic() - t_kill, 3),
        "deadline_s": RESTORE_BOUND_S,
        "bound": "time for a restarted controller to restore from its journal",
        "within_deadline": restored_s <= RESTORE_BOUND_S + MARGIN_S,
        "seconds_to_final_state": round(restored_s, 4),
    }
    assert [r.kind for r in records[-3:]] == ["restore", "transition", "taint"]

    class Restored(Case):
        def __init__(self) -> None:  # the same case tools, around the restored controller
            self.rig, self.name, self.tmp = rig, row["case"], case_dir
            self.via_proxy, self.base = False, rig.engine.base_url
            self.journal_path, self.traj_path = journal_path, traj_path
            self.journal, self.c, self.v0 = journal, c, v0
            self.transport = GlooTransport(op_timeout_s=OP_TIMEOUT_S)
            self.adapter = self.new_adapter(self.transport)
            self.runner = LifecycleRunner(c, self.adapter, DL, record=journal.write)
            self.http = VllmHTTP(self.base, timeout_s=120)
            self.recorder = TrajectoryRecorder(traj_path)  # recovers the dead writer's file
            self.book = soak.RolloutBook(c, self.http, self.recorder,
                                         soak.engine_identity(self.http), run="controller-2")
            self.row, self.target = row, target
            self.extra_ok = int(ok_line.split()[1])
            self.updates = 0
            _OPEN.append(self)

    k = Restored()
    # Recovery can fail too: a deadline too short for a restart is classified, still TAINTED.
    short = LifecycleRunner(c, k.adapter, Deadlines(recover_s=2, cancel_grace_s=1),
                            record=journal.write)
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed) as ei:
        short.recover(rig.recoverer(), owner="test")
    row["failed_recovery_classified_s"] = round(time.monotonic() - t0, 3)
    assert ei.value.phase == "recover" and c.state is State.TAINTED
    assert row["failed_recovery_classified_s"] <= 2 + 1 + MARGIN_S
    _wait_recover_threads()
    k.recover(rig.recoverer())
    assert k.book.counts["ok"] >= 3
    k.finish()


def _wait_recover_threads(timeout_s: float = 60) -> None:
    """A cancelled recovery's worker unwinds by itself; wait for it before the next one."""
    deadline = time.monotonic() + timeout_s
    while any(t.name == "rolloutcore-recover" and t.is_alive() for t in threading.enumerate()):
        assert time.monotonic() < deadline, "a cancelled recovery did not unwind"
        time.sleep(0.1)


# --------------------------------------------------------------------------- subprocesses


def _trainer_main(base_url: str, ckpt: str, pause_after: str, op_timeout: str) -> None:
    tr = GatedGloo(op_timeout_s=float(op_timeout), pause_after=int(pause_after), hold_s=600,
                   on_reached=lambda n: print(f"MID-TRANSFER {n}", flush=True))
    tr.connect(base_url, timeout_s=180)
    print("CONNECTED", flush=True)
    go = sys.stdin.readline().split()
    ev = tr.send(base_url, go[1], WeightSource.from_checkpoint(ckpt), timeout_s=600)
    print("TRANSFERRED " + json.dumps(evidence_to_dict(ev)), flush=True)


def _controller_main(base_url: str, epoch: str, journal_path: str, traj_path: str,
                     serving: str, serving_ckpt: str, target: str, target_ckpt: str,
                     pause_after: str, op_timeout: str) -> None:
    tr = GatedGloo(op_timeout_s=float(op_timeout), pause_after=int(pause_after), hold_s=600,
                   on_reached=lambda n: print(f"MID-TRANSFER {n}", flush=True))
    journal = Journal(journal_path, fsync=True)
    c = LifecycleController(listener=journal.listener)
    adapter = VllmAdapter(VllmHTTP(base_url, timeout_s=60), tr, engine_epoch=epoch,
                          transfer_timeout_s=DL.transfer_s, connect_timeout_s=120)
    runner = LifecycleRunner(c, adapter, Deadlines(transfer_s=3600), record=journal.write)
    runner.bootstrap(ident(serving, Path(serving_ckpt)))
    http = VllmHTTP(base_url, timeout_s=120)
    book = soak.RolloutBook(c, http, TrajectoryRecorder(traj_path),
                            soak.engine_identity(http), run="controller-1")
    for _ in range(3):
        book.rollout(max_tokens=16)
    print(f"ROLLOUTS-OK {book.counts['ok']}", flush=True)
    adapter.stage(WeightSource.from_checkpoint(target_ckpt),
                  provenance=ident(target, Path(target_ckpt)).provenance)
    runner.run_update(ident(target, Path(target_ckpt)), label="controller-1-update")


if __name__ == "__main__":
    role, *argv = sys.argv[1:]
    if role == "trainer":
        _trainer_main(*argv)
    elif role == "controller":
        _controller_main(*argv)
    elif role == "table":  # the markdown tables of a written matrix (docs/fault-matrix.md)
        print(fault_matrix.tables_command(argv))
    else:
        raise SystemExit(f"unknown role {role!r}")
