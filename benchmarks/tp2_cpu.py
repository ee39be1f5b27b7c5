"""A verified update into a tensor-parallel (TP=2) CPU vLLM, against its own bare calls.

One run, on this machine (vLLM's CPU build, one worker process per rank,
each bound to its own core by ``tp_thread_binding``):

* **cold TP=2 on B**: an engine started on checkpoint B (its start time is
  the restart baseline) answers greedy prompts: the reference;
* **hot TP=2**: an engine started on A, taken over, updated A -> B -> A ...
  ``--reps`` times through the trainer API (``EngineSession.update``: drain,
  pause, transfer over gloo to both ranks, cache reset, the paused
  validation with every rank's write checksums, resume, live probe,
  publish), with the per-phase split; then, on the same engine and the same
  weights, the **bare vLLM calls** an update needs (pause, start / update /
  finish over the same gloo group, prefix-cache reset, resume) ``--reps``
  times; after the last verified update to B, greedy ids and logprobs
  against the cold engine's;
* **TP=1**: the same verified update on a one-worker engine of the model.

Writes ``results/tp2-cpu.json`` (keys ``bitexact_vs_cold_tp2``,
``coverage_per_rank``, ``verified_over_bare``, ``tp2_over_tp1``, per-phase
medians) and prints a table. Not a test.

    .venv/bin/python benchmarks/tp2_cpu.py [--reps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _say(msg: str) -> None:
    print(f"[tp2-cpu] {msg}", file=sys.stderr, flush=True)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * k) % 250 + 1 for k in range(24 + 8 * i)] for i in range(6)]


def _greedy(http: Any) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in _prompts():
        g = http.generate(ids, max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
        out.append((list(g.token_ids), [float(x) for x in (g.logprobs or [])]))
    return out


def _median_phases(outcomes: list[Any]) -> dict[str, float]:
    keys = {k for o in outcomes for k in o.breakdown()}
    return {k: statistics.median(o.breakdown().get(k, 0.0) for o in outcomes)
            for k in sorted(keys)}


def _verified(session: Any, ckpts: list[Path], reps: int) -> tuple[list[float], list[Any],
                                                                     list[dict[str, Any]]]:
    from rolloutcore.core.versions import Provenance

    times, outcomes, checks = [], [], []
    for i in range(reps):
        ck = ckpts[(i + 1) % 2]
        t0 = time.perf_counter()
        r = session.update(ck, Provenance(ck.name, "tp2-bench", i + 1))
        times.append(time.perf_counter() - t0)
        outcomes.append(r.outcome)
        checks.append({k: v for k, v in session.transport.last_check.items() if k != "ranks"}
                      | {"ranks": [{k: rk[k] for k in ("tp_rank", "compared", "model_params",
                                                        "coverage", "engine_s")}
                                   for rk in session.transport.last_check["ranks"]]})
        _say(f"verified update {i + 1}/{reps} to {ck.name}: {times[-1]:.3f} s "
             f"(coverage per rank {checks[-1]['coverage_per_rank']})")
    return times, outcomes, checks


def _bare(http: Any, tr: Any, ckpts: list[Path], reps: int) -> list[float]:
    from rolloutcore.core.evidence import PauseMode
    from rolloutcore.transports.source import WeightSource

    srcs = [WeightSource.from_checkpoint(c) for c in ckpts]
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        http.pause(PauseMode.WAIT)
        tr.send(http.base_url, f"bare-{i}", srcs[(i + 1) % 2], timeout_s=300)
        http.reset_prefix_cache()
        http.resume()
        times.append(time.perf_counter() - t0)
        _say(f"bare calls {i + 1}/{reps}: {times[-1]:.3f} s")
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "tp2-cpu.json"))
    args = ap.parse_args()
    if args.reps < 2:
        ap.error("--reps must be >= 2")

    import torch
    import vllm

    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine, tp_thread_binding
    from rolloutcore.session import EngineSession
    from rolloutcore.testing.models import make_checkpoint

    root = Path(tempfile.mkdtemp(prefix="tp2-bench-"))
    a, b = make_checkpoint(root / "A", 1), make_checkpoint(root / "B", 2)
    ckpts = [a, b]
    t_all = time.monotonic()

    _say("cold TP=2 engine on B (the reference and the restart baseline)")
    with ManagedEngine(b, backend=None, tensor_parallel_size=2, log_dir=root / "cold",
                       progress=True, startup_timeout_s=900) as cold, \
            VllmHTTP(cold.base_url, timeout_s=120) as h:
        restart_s = cold.last_start_s
        cold_b = _greedy(h)

    _say("hot TP=2 engine on A")
    s = EngineSession.launch(a, tensor_parallel_size=2, progress=True, start_timeout_s=900)
    try:
        s.bootstrap(a, Provenance(a.name, "tp2-bench", 0))
        v_times, v_out, checks = _verified(s, ckpts, args.reps)
        if args.reps % 2 == 0:  # end on B for the comparison with the cold engine
            r = s.update(b, Provenance(b.name, "tp2-bench", args.reps + 1))
            checks.append({"coverage_per_rank": s.transport.last_check["coverage_per_rank"],
                           "passed": s.transport.last_check["passed"]})
            del r
        hot_b = _greedy(s.http)
        bitexact = hot_b == cold_b
        _say(f"hot TP=2 on B == cold TP=2 on B: {bitexact}")
        # The bare calls on the same engine, same group, same weights.
        b_times = _bare(s.http, s.transport, ckpts, args.reps)
        binding = s.engine.environment().get("VLLM_CPU_OMP_THREADS_BIND") if s.engine else None
    finally:
        s.close()

    _say("TP=1 engine on A")
    s1 = EngineSession.launch(a, progress=True, start_timeout_s=900)
    try:
        s1.bootstrap(a, Provenance(a.name, "tp2-bench", 0))
        t1_times, t1_out, _ = _verified(s1, ckpts, args.reps)
    finally:
        s1.close()

    # The first update of an engine pays one-time costs (the group's rendezvous,
    # the reload's first metadata pass): the medians leave it out, it is reported.
    med = statistics.median
    v_med, b_med, t1_med = med(v_times[1:]), med(b_times[1:]), med(t1_times[1:])
    last_cov = checks[-1]["coverage_per_rank"]
    result: dict[str, Any] = {
        "bitexact_vs_cold_tp2": bitexact,
        "coverage_per_rank": last_cov,
        "coverage_per_rank_every_update": [c["coverage_per_rank"] for c in checks],
        "every_rank_check_passed": all(c["passed"] for c in checks),
        "verified_over_bare": v_med / b_med,
        "tp2_over_tp1": v_med / t1_med,
        "tp2_verified_s": v_times, "tp2_verified_median_s": v_med,
        "tp2_first_update_s": v_times[0],
        "tp2_bare_s": b_times, "tp2_bare_median_s": b_med,
        "tp1_verified_s": t1_times, "tp1_verified_median_s": t1_med,
        "tp2_restart_s": restart_s,
        "hot_over_restart": v_med / restart_s if restart_s else None,
        "tp2_phases_median_s": _median_phases(v_out[1:]),
        # Before the transition: the target's identity and the probe's reference forward
        # pass on this host's CPU (EngineSession.prepare), outside the runner's phases.
        "tp2_prepare_median_s": med(t - o.breakdown().get("total", 0.0)
                                    for t, o in zip(v_times[1:], v_out[1:], strict=True)),
        "tp1_prepare_median_s": med(t - o.breakdown().get("total", 0.0)
                                    for t, o in zip(t1_times[1:], t1_out[1:], strict=True)),
        "load_avg_1m_at_end": os.getloadavg()[0],
        "tp2_first_update_phases_s": v_out[0].breakdown(),
        "tp1_phases_median_s": _median_phases(t1_out[1:]),
        "rank_checks": checks,
        "goals": {"verified_over_bare": 1.5, "tp2_over_tp1": 2.0},
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "cpus": len(os.sched_getaffinity(0)), "torch": torch.__version__,
                    "vllm": vllm.__version__, "thread_binding": binding,
                    "binding_rule": tp_thread_binding(2, cpus=os.sched_getaffinity(0)),
                    "idle_spin_s": os.environ.get("ROLLOUTCORE_VLLM_IDLE_SPIN_S")},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "reps": args.reps,
        "wall_s": time.monotonic() - t_all,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"{'':28} {'median s':>9}")
    for k in ("tp2_verified_median_s", "tp2_bare_median_s", "tp1_verified_median_s",
              "tp2_first_update_s", "tp2_restart_s"):
        print(f"{k:28} {result[k]:9.3f}")
    print(f"verified/bare {result['verified_over_bare']:.2f} (goal <= 1.5), "
          f"tp2/tp1 {result['tp2_over_tp1']:.2f} (goal <= 2), bit-exact {bitexact}, "
          f"coverage per rank {last_cov}")
    print(f"wrote {out}")
    return 0 if bitexact and result["every_rank_check_passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
