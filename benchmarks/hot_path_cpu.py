"""The hot path's trainer/controller-side Python, on the CPU, before and after.

What it times. The single-engine verified transition of
``diagnostics/gpu/h200_8b_ipc.py`` (``LifecycleRunner.run_update`` over
``VllmAdapter`` and ``CudaIpcTransport``, the trainer's ``PackedWeights``
adopted, its views staged as a ``WeightSource``, the workers' checksum read
from the trainer's result slot), for a Qwen3-8B-shaped layout: the 399
tensor names, ranks and dtypes of ``diagnostics/gpu/qwen3_shapes.py``, each
dimension divided by ``--scale`` so that the buffer fits anywhere (the
per-transition Python depends on the number of tensors, not their size).

The engine is an in-process stand-in behind ``httpx.MockTransport`` that
answers what vLLM 0.26 answers on the H200 (the routes of
results/gpu/h200-8b-ipc.json, no ``/weight_info``), and writes the
workers' result row at ``/finish_weight_update`` as the worker extension
does. No CUDA, no sockets: what is left is the Python RolloutCore runs per
transition (controller, runner, adapter, transport, httpx's client side).
The stand-in's own time is measured and subtracted.

Two numbers per side, medians over ``--reps`` transitions:

* ``critical_path``: ``run_update`` (drain to publish), the time the engine
  is paused or waiting on us, minus the stand-in engine's time;
* ``staging``: what the harness does before each update while the engine
  still serves (``adapter.stage``, ``precompute_checksum``, the identity).

``before`` runs the same script against ``--before-ref``'s ``src/`` (``git
archive`` into a temporary directory), in a subprocess; ``after`` against this
tree's. Usage::

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/hot_path_cpu.py [--reps 60]

writes results/hot-path-cpu.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "diagnostics" / "gpu"))


def _measure(reps: int, scale: int, warmup: int) -> dict[str, Any]:
    """One side: runs in whatever ``rolloutcore`` is on the path."""
    from ipc_standin import BASE, StandIn, build

    import rolloutcore
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.core.evidence import CacheKind
    from rolloutcore.core.versions import VerificationLevel
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter

    eng: dict[str, Any] = {"s": 0.0, "cpu": 0.0, "calls": 0}

    def on_call(ns: int, cpu_s: float) -> None:
        eng["s"] += ns / 1e9
        eng["cpu"] += cpu_s
        eng["calls"] += 1

    si = build(scale, on_call)
    pk, contents, values, tr, source = si.pk, si.contents, si.values, si.transport, si.source
    names = [e.name for e in pk.entries]
    adapter = VllmAdapter(VllmHTTP(BASE, transport=si.mock, timeout_s=120), tr,
                          engine_epoch="bench-epoch")
    controller = LifecycleController(required_caches=(CacheKind.PREFIX,))
    runner = LifecycleRunner(controller, adapter, si.deadlines)
    identity = si.identity
    adapter.stage(source, provenance=StandIn.provenance(1))
    runner.bootstrap(identity(1))
    crit: list[float] = []
    crit_cpu: list[float] = []
    stage_s: list[float] = []
    eng_s: list[float] = []
    threads: list[int] = []
    import threading
    for i in range(warmup + reps):
        seed = 2 if si.engine["seed"] == 1 else 1
        pk.buffer.copy_(contents[seed])  # the trainer's step (not timed)
        t0 = time.perf_counter()
        adapter.stage(source, provenance=StandIn.provenance(seed))
        tr.precompute_checksum(pk, values=values[seed])  # values: hashing is device work
        ident = identity(seed)
        t1 = time.perf_counter()
        si.engine["seed"] = seed
        e0, c0 = eng["s"], eng["cpu"]
        p0 = time.process_time()
        th0 = threading.active_count()
        started = _thread_starts()
        o = runner.run_update(ident, min_verification=VerificationLevel.ENGINE_CHECKSUM)
        t2 = time.perf_counter()
        p1 = time.process_time()
        if o.published is None or not tr.last_check.get("passed") or \
                tr.last_check.get("via") != "ipc" or not tr.last_zero_copy:
            raise RuntimeError(f"transition {i} not as on the H200: {o.state} "
                               f"{tr.last_check} zero_copy={tr.last_zero_copy}")
        del th0
        if i >= warmup:
            stage_s.append(t1 - t0)
            eng_s.append(eng["s"] - e0)
            crit.append(t2 - t1 - (eng["s"] - e0))
            crit_cpu.append(p1 - p0 - (eng["cpu"] - c0))
            threads.append(_thread_starts() - started)
    adapter.close()
    return {"rolloutcore": str(Path(rolloutcore.__file__).parent), "tensors": len(names),
            "buffer_bytes": int(pk.buffer.numel()), "reps": reps,
            "critical_path_s": statistics.median(crit),
            "critical_path_p10_s": sorted(crit)[len(crit) // 10],
            "critical_path_cpu_s": statistics.median(crit_cpu),
            "staging_s": statistics.median(stage_s),
            "engine_standin_s": statistics.median(eng_s),
            "threads_started_per_transition": statistics.median(threads)}


_STARTS = [0]


def _install_thread_counter() -> None:
    import threading

    orig = threading.Thread.start

    def start(self: threading.Thread) -> None:
        _STARTS[0] += 1
        orig(self)

    threading.Thread.start = start  # type: ignore[method-assign]


def _thread_starts() -> int:
    return _STARTS[0]


def _side(src: Path, reps: int, scale: int, warmup: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    r = subprocess.run([sys.executable, __file__, "--child", "--reps", str(reps), "--scale",
                        str(scale), "--warmup", str(warmup)], env=env, capture_output=True,
                       text=True, check=False)
    if r.returncode:
        raise SystemExit(f"side {src} failed:\n{r.stdout}\n{r.stderr}")
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--scale", type=int, default=64, help="divide every dimension by this")
    ap.add_argument("--before-ref", default="main")
    ap.add_argument("--rounds", type=int, default=3, help="before/after alternations")
    ap.add_argument("--out", default=str(ROOT / "results" / "hot-path-cpu.json"))
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    if a.child:
        _install_thread_counter()
        print(json.dumps(_measure(a.reps, a.scale, a.warmup)))
        return 0
    ref = subprocess.run(["git", "-C", str(ROOT), "rev-parse", a.before_ref], check=True,
                         capture_output=True, text=True).stdout.strip()
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True,
                          capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"],
                                check=True, capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        arch = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True,
                              capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
        before_src, after_src = Path(tmp) / "src", ROOT / "src"
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for _ in range(a.rounds):  # alternate: the machine's load drifts
            runs["before"].append(_side(before_src, a.reps, a.scale, a.warmup))
            runs["after"].append(_side(after_src, a.reps, a.scale, a.warmup))

    def med(side: str, k: str) -> float:
        return statistics.median(r[k] for r in runs[side])

    b, af = med("before", "critical_path_s"), med("after", "critical_path_s")
    bc, ac = med("before", "critical_path_cpu_s"), med("after", "critical_path_cpu_s")
    out = {
        "benchmark": "benchmarks/hot_path_cpu.py",
        "command": "PYTHONPATH=$PWD/src .venv/bin/python benchmarks/hot_path_cpu.py "
                   + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "2 cores shared with other jobs; no GPU"},
        "versions": {"torch": __import__("torch").__version__,
                     "httpx": __import__("httpx").__version__,
                     "before": ref, "after": head + (" + uncommitted src" if dirty else "")},
        "what": "per-transition trainer/controller-side Python of the single-engine verified "
                "transition (run_update, drain to publish) over a stand-in vLLM 0.26 engine "
                "(httpx.MockTransport, its own time subtracted), Qwen3-8B layout (399 "
                "tensors, dims / scale), zero-copy adopted PackedWeights, result slot read",
        "per_transition_python_s_before": b,
        "per_transition_python_s_after": af,
        "ratio": b / af,
        "per_transition_python_cpu_s_before": bc,
        "per_transition_python_cpu_s_after": ac,
        "cpu_ratio": bc / ac,
        "note": "wall: median of per-round medians, on a machine shared with other jobs "
                "(load average above the core count while measured): noisy; cpu: process CPU "
                "time of all threads per transition (the stand-in engine's own CPU time "
                "subtracted), less sensitive to the load",
        "staging_python_s_before": med("before", "staging_s"),
        "staging_python_s_after": med("after", "staging_s"),
        "threads_started_per_transition_before": med("before", "threads_started_per_transition"),
        "threads_started_per_transition_after": med("after", "threads_started_per_transition"),
        "reps": a.reps, "rounds": a.rounds, "scale": a.scale, "runs": runs,
    }
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    rows = [("critical path (run_update) per transition, wall",
             out["per_transition_python_s_before"], out["per_transition_python_s_after"]),
            ("critical path, CPU time (all threads)", bc, ac),
            ("staging (stage + precompute + identity)", out["staging_python_s_before"],
             out["staging_python_s_after"])]
    print(f"{'':45s} {'before ms':>10s} {'after ms':>10s} {'ratio':>7s}")
    for name, x, y in rows:
        print(f"{name:45s} {x * 1e3:10.3f} {y * 1e3:10.3f} {x / y:7.2f}")
    print(f"{'threads started per transition':45s} "
          f"{out['threads_started_per_transition_before']:10.0f} "
          f"{out['threads_started_per_transition_after']:10.0f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
