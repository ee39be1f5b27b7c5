#!/usr/bin/env python3
"""What a gateway's restart costs after 10^3, 10^5 and 10^6 served requests (#47, symptom 9).

Not a test: it measures and writes ``results/journal-scale.json`` and prints a table.

For each count N a journal is written the way a gateway writes one: a real
``LifecycleController`` over a file ``Journal`` (``open_controller``),
bootstrapped, one update published, then N requests admitted and completed
(two records each, as the data plane writes them), and the journal closed (a
clean stop; ``--crash`` leaves it as a process killed -9 would, without the
close). The restart is then measured in a fresh process: ``open_controller``
on that journal (what ``serve --journal`` does first), its wall time and the
process's peak RSS (``VmHWM``, the interpreter and its imports included:
``baseline_rss_mib`` is the same process before opening anything).

Keys per count: ``restart_s``, ``restart_peak_rss_mib``,
``journal_bytes_per_request`` (the file's bytes over N), ``journal_bytes``,
(``restart_s`` and ``restart_peak_rss_mib`` are medians over ``--repeat`` runs),
``snapshot_bytes``, ``write_s``.

    PYTHONPATH=src .venv/bin/python benchmarks/journal_scale.py \\
        [--counts 1000 100000 1000000] [--repeat 3] [--out results/journal-scale.json]
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

# The peak is VmHWM (/proc/self/status): ru_maxrss survives exec on Linux, so a child
# would report its parent's peak (the writer of a 10^6-request journal).
_RESTART = """
import json, sys, time
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
rss0 = hwm()
from rolloutcore.control.journal import open_controller
t0 = time.perf_counter()
c, j = open_controller(sys.argv[1], keep=256)
dt = time.perf_counter() - t0
state = c.state.value
j.close()
print(json.dumps({"restart_s": dt, "peak_rss_kib": hwm(), "baseline_kib": rss0, "state": state,
    "active": len(c.active)}))
"""


def write_journal(path: Path, n: int, *, crash: bool) -> float:
    from rolloutcore.control.journal import open_controller
    from rolloutcore.core.evidence import BootstrapEvidence
    from rolloutcore.testing.fake import FakeWeights

    c, j = open_controller(path, keep=256)
    w0 = FakeWeights.from_seed(0)
    c.bootstrap(BootstrapEvidence(engine_epoch="bench", healthy=True), w0.identity())
    t0 = time.perf_counter()
    for i in range(n):
        rid = f"req-{i}"
        c.admit(rid)
        c.complete(rid)
    j.sync()
    dt = time.perf_counter() - t0
    if not crash:
        j.close()
    return dt


def restart(path: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, "-c", _RESTART, str(path)], env=env, check=True,
                         capture_output=True, text=True, timeout=3600).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[1000, 100_000, 1_000_000])
    ap.add_argument("--repeat", type=int, default=3, help="restarts measured per count")
    ap.add_argument("--crash", action="store_true",
                    help="leave each journal unclosed (as after kill -9)")
    ap.add_argument("--out", type=Path, default=REPO / "results" / "journal-scale.json")
    args = ap.parse_args()
    rows: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rc-journal-scale-") as d:
        for n in args.counts:
            path = Path(d) / f"journal-{n}.jsonl"
            write_s = write_journal(path, n, crash=args.crash)
            runs = [restart(path) for _ in range(args.repeat)]
            size = path.stat().st_size
            snap = Path(f"{path}.snapshot")
            rows[str(n)] = {
                "requests": n,
                "restart_s": statistics.median(r["restart_s"] for r in runs),
                "restart_s_runs": [round(r["restart_s"], 4) for r in runs],
                "restart_peak_rss_mib": statistics.median(r["peak_rss_kib"] for r in runs) / 1024,
                "restart_peak_rss_mib_runs": [round(r["peak_rss_kib"] / 1024, 1) for r in runs],
                "baseline_rss_mib": max(r["baseline_kib"] for r in runs) / 1024,
                "journal_bytes": size,
                "journal_bytes_per_request": size / n,
                "snapshot_bytes": snap.stat().st_size if snap.exists() else 0,
                "write_s": write_s,
                "state_after_restart": runs[0]["state"],
            }
            print(f"  {n:>9} requests: restart {rows[str(n)]['restart_s']:.3f} s", flush=True)
    lo, hi = rows[str(min(args.counts))], rows[str(max(args.counts))]
    result = {
        "benchmark": "journal_scale",
        "what": "open_controller on a gateway's journal after N requests (fresh process)",
        "crash": args.crash,
        "counts": rows,
        "restart_ratio_max_over_min": hi["restart_s"] / lo["restart_s"],
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "command": " ".join([sys.executable, *sys.argv]),
        "finished_unix": time.time(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'requests':>10} {'restart s':>10} {'peak RSS MiB':>13} {'B/request':>10} "
          f"{'journal MB':>11} {'snapshot kB':>12}")
    for r in rows.values():
        print(f"{r['requests']:>10} {r['restart_s']:>10.3f} {r['restart_peak_rss_mib']:>13.1f} "
              f"{r['journal_bytes_per_request']:>10.1f} {r['journal_bytes'] / 1e6:>11.1f} "
              f"{r['snapshot_bytes'] / 1e3:>12.1f}")
    print(f"restart at {hi['requests']} / at {lo['requests']}: "
          f"{result['restart_ratio_max_over_min']:.2f}x -> {args.out}")


if __name__ == "__main__":
    main()
