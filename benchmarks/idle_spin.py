"""Does the fleet's idle-spin patch pay under load? Latency percentiles, side by side.

vLLM's shared-memory message queues spin for ``busy_loop_s`` (1 s) after each
message; on a host with fewer than two cores per engine the fleet launched
its engines with ``ROLLOUTCORE_VLLM_IDLE_SPIN_S=0.1`` (``transports.vllm_plugin``),
which made fan-out updates faster (``results/fleet.json``). A review then saw
answers of 5-7 s and a 35 s rolling wave with 0.1 and none with vLLM's own
1 s. This measures both settings the same way, one after the other on the
same host, with the fleet gateway in front of ``--engines`` engines:

* steady load: ``--clients`` unpaced clients for ``--steady-s``: answers per
  second, latency p50/p95/p99/max, and answers slower than 2 s and 5 s;
* updates under that load: ``--updates`` synchronous (one fan-out) and as
  many rolling updates: each update's seconds, and the answers' latencies
  while they ran.

Writes ``results/idle-spin.json`` (both settings, their ratios, and
``keep_patch``: the patch stays only if it is no worse on p99 and on stalls
over 5 s while updating faster) and prints a table. Not a test.

    .venv/bin/python benchmarks/idle_spin.py [--engines 2] [--clients 6] [--steady-s 30]
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
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

TOKEN = "idle-spin-benchmark-token-0123456"


def _percentiles(xs: list[float]) -> dict[str, Any]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, round(p * (len(s) - 1)))]

    return {"n": len(s), "p50_s": q(0.50), "p95_s": q(0.95), "p99_s": q(0.99),
            "max_s": s[-1], "over_2s": sum(x > 2.0 for x in s),
            "over_5s": sum(x > 5.0 for x in s)}


def run_one(spin: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from fleet import Clients

    from helpers.gateway_rig import uvicorn_thread
    from rolloutcore.fleet import FleetConfig
    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.fleet.placement import build_fleet, launch_local, prepare_checkpoint
    from rolloutcore.service import ServiceConfig
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.vllm_plugin import IDLE_SPIN_ENV

    a = make_checkpoint(work / "A", 1)
    b = make_checkpoint(work / "B", 2)
    wa, wb = prepare_checkpoint(a), prepare_checkpoint(b)
    t0 = time.monotonic()
    engines = launch_local(args.engines, a, log_dir=work / f"logs-{spin}", progress=True,
                           env={IDLE_SPIN_ENV: spin})
    out: dict[str, Any] = {"idle_spin_s": float(spin), "engine_start_s": time.monotonic() - t0}
    try:
        coord = build_fleet(engines, checkpoint=a, weights=wa,
                            config=FleetConfig(health_interval_s=0.5))
        app = create_fleet_app(coord, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                                    control_token=TOKEN))
        with uvicorn_thread(app) as url:
            cl = Clients(url, args.clients).start()
            time.sleep(3.0)                     # warm up
            ts = time.monotonic()
            time.sleep(args.steady_s)
            te = time.monotonic()
            steady = [d - s for s, d, st, _ in cl.answers if st == 200 and ts <= s and d < te]
            out["steady"] = {**_percentiles(steady), "requests_per_s": len(steady) / (te - ts)}
            updates: list[dict[str, Any]] = []
            toggle = [wb, wa]
            tu = time.monotonic()
            plan = ["synchronous"] * args.updates + ["rolling"] * args.updates
            for k, strategy in enumerate(plan):
                t1 = time.monotonic()
                kw: dict[str, Any] = {"min_serving": args.engines - 1} \
                    if strategy == "rolling" else {}
                res = coord.update(toggle[k % 2], strategy=strategy, **kw)
                updates.append({"strategy": strategy, "seconds": res.seconds,
                                "wall_s": time.monotonic() - t1})
                time.sleep(1.0)
            tv = time.monotonic()
            cl.stop()
            during = [d - s for s, d, st, _ in cl.answers if st == 200 and tu <= s and d <= tv]
            failed = sum(1 for s, _, st, _ in cl.answers if st not in (200, 503)
                         and tu <= s <= tv) + len(cl.errors)
            out["updating"] = {**_percentiles(during), "failed": failed,
                               "refused_503": sum(1 for s, _, st, _ in cl.answers
                                                  if st == 503 and tu <= s <= tv)}
            for strat in ("synchronous", "rolling"):
                secs = [u["seconds"] for u in updates if u["strategy"] == strat]
                out[f"{strat}_update_s"] = {"median": statistics.median(secs),
                                            "max": max(secs), "all": secs}
        coord.close()
    finally:
        for e in engines:
            e.stop()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--steady-s", type=float, default=30.0)
    ap.add_argument("--updates", type=int, default=3, help="of each strategy")
    ap.add_argument("--out", default=str(ROOT / "results" / "idle-spin.json"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    import torch
    import vllm

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-idle-spin-"))
    # vLLM's own 1 s first, then the patch's 0.1 s, on the same host one after the other.
    runs = {"vllm_1s": run_one("1", args, work / "s1"),
            "patch_0.1s": run_one("0.1", args, work / "s01")}
    base, patch = runs["vllm_1s"], runs["patch_0.1s"]

    def ratio(path: tuple[str, str]) -> float | None:
        x, y = patch[path[0]].get(path[1]), base[path[0]].get(path[1])
        return None if not x or not y else x / y

    ratios = {"steady_p99": ratio(("steady", "p99_s")),
              "steady_requests_per_s": ratio(("steady", "requests_per_s")),
              "updating_p99": ratio(("updating", "p99_s")),
              "synchronous_update_s": patch["synchronous_update_s"]["median"]
              / base["synchronous_update_s"]["median"],
              "rolling_update_s": patch["rolling_update_s"]["median"]
              / base["rolling_update_s"]["median"]}
    stalls_patch = patch["steady"]["over_5s"] + patch["updating"]["over_5s"]
    stalls_base = base["steady"]["over_5s"] + base["updating"]["over_5s"]
    keep = (stalls_patch <= stalls_base and (ratios["updating_p99"] or 1) <= 1.0
            and (ratios["steady_p99"] or 1) <= 1.0 and ratios["synchronous_update_s"] < 1.0)
    out = {"runs": runs, "patch_over_vllm": ratios, "stalls_over_5s": {
        "vllm_1s": stalls_base, "patch_0.1s": stalls_patch}, "keep_patch": keep,
        "engines": args.engines, "clients": args.clients,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version()},
        "versions": {"rolloutcore": __import__("rolloutcore").__version__,
                     "vllm": vllm.__version__, "torch": torch.__version__},
        "command": "python benchmarks/idle_spin.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    rows = [("", "vLLM 1 s", "patch 0.1 s")]
    for label, sect, key in (("steady requests/s", "steady", "requests_per_s"),
                             ("steady p50 s", "steady", "p50_s"),
                             ("steady p99 s", "steady", "p99_s"),
                             ("steady max s", "steady", "max_s"),
                             ("steady answers > 5 s", "steady", "over_5s"),
                             ("updating p99 s", "updating", "p99_s"),
                             ("updating max s", "updating", "max_s"),
                             ("updating answers > 5 s", "updating", "over_5s")):
        rows.append((label, f"{base[sect].get(key, 0):.3f}", f"{patch[sect].get(key, 0):.3f}"))
    for strat in ("synchronous", "rolling"):
        rows.append((f"{strat} update median s",
                     f"{base[f'{strat}_update_s']['median']:.2f}",
                     f"{patch[f'{strat}_update_s']['median']:.2f}"))
    w = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w[i]) for i, c in enumerate(r)))
    print(f"keep the patch: {keep}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
