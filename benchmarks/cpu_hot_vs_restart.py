"""Hot policy transition vs stop-and-restart, on the real CPU vLLM, in one run.

Measures, on one engine process:
  * the full RolloutCore transition A -> B (drain, pause, preflight, transfer,
    cache resets, paused validation, resume, live policy probe, publish),
    repeated, with its phase breakdown and the time spent outside engine and
    transport calls (controller overhead);
  * the restart baseline: stop the engine and start it on B to /health;
  * the transfer throughput against a same-machine memory copy of the same bytes.

Writes results/cpu-hot-vs-restart.json and prints a table. Not a test.

    .venv/bin/python benchmarks/cpu_hot_vs_restart.py [--reps 5] [--out PATH]
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


def memcpy_gbps(nbytes: int, reps: int = 7) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "cpu-hot-vs-restart.json"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")

    import torch
    import vllm

    from rolloutcore.core.versions import Provenance
    from rolloutcore.session import EngineSession
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.source import WeightSource

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-bench-"))
    a, b = work / "A", work / "B"
    for d, seed in ((a, 1), (b, 2)):
        if not (d / "config.json").exists():
            make_checkpoint(d, seed)
    session = EngineSession.launch(a)
    runs: list[dict[str, Any]] = []
    try:
        session.bootstrap(a, Provenance("A", "bench", 0))
        prepared = {
            "B": session.prepare(b, Provenance("B", "bench", 1)),
            "A": session.prepare(a, Provenance("A", "bench", 2)),
        }
        for i in range(args.reps):
            name = "B" if i % 2 == 0 else "A"
            res = session.apply(prepared[name])
            out = res.outcome
            tev = [v for v in out.verdicts if v.event.value == "transferred"]
            runs.append({"to": name, "version": res.version.label, "hot_s": out.total_s,
                         "controller_overhead_s": out.controller_overhead_s,
                         "phases_s": out.breakdown(), "accepted_transfer": bool(tev)})
        nbytes = WeightSource.from_checkpoint(b).nbytes
        # Restart baseline: the same process replaced by one started on B.
        eng = session.engine
        t0 = time.monotonic()
        eng.restart(b)
        restart_s = time.monotonic() - t0
    finally:
        session.close()

    hot = statistics.median(r["hot_s"] for r in runs)
    over = statistics.median(r["controller_overhead_s"] / r["hot_s"] for r in runs)
    transfer_s = statistics.median(r["phases_s"]["transfer"] for r in runs)
    phases = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in runs)
              for k in runs[0]["phases_s"]}
    mc = memcpy_gbps(nbytes)
    result = {
        "hot_s": hot,
        "restart_s": restart_s,
        "ratio": restart_s / hot,
        "controller_overhead_fraction": over,
        "transfer_gbps": nbytes / transfer_s / 1e9,
        "memcpy_gbps": mc,
        "transfer_bytes": nbytes,
        "phases_median_s": phases,
        "runs": runs,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "vllm": vllm.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": "hot_s is the median full verified transition (incl. live policy probe); "
                 "restart_s is stop + start on B to /health of the same engine. "
                 "Tiny model (2 layers, hidden 128): the transfer is dominated by per-call "
                 "overhead, not bandwidth.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'metric':<32}{'value':>14}")
    for k in ("hot_s", "restart_s", "ratio", "controller_overhead_fraction", "transfer_gbps",
              "memcpy_gbps"):
        print(f"{k:<32}{result[k]:>14.4f}")
    print("phase medians (ms): " + ", ".join(f"{k}={v * 1000:.1f}" for k, v in phases.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
