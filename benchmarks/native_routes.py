"""The same unmodified sender, on the engine directly and through the gateway's native routes.

Setup: one vLLM (CPU, generated tiny checkpoints A and B, the gloo
weight-transfer backend) and one ``rolloutcore serve --native-routes``
gateway in its own process (engine watch off: the direct rounds are writes
the gateway does not make, and it would rightly taint on them). The sender
is ``GlooTransport.send`` (vLLM's route sequence: start, update beside the
broadcast, finish) followed by ``/reset_prefix_cache``, as TRL server mode
does; its base URL is the engine's, or the gateway's ``/rc/<token>``.
``--updates`` direct rounds first, then as many through the gateway (each
path connects once), alternating A and B.

Written to ``results/native-routes.json``: per-round wall times, the
medians, ``native_over_direct`` (gateway median / direct median: what the
round costs on top: drain, pause, checks, resume, publish), the level a
gateway round reached (``verification``), ``labels_assigned`` (gateway
rounds published under the gateway's label, not the sender's), and
``mislabeled_answers`` (answers after a gateway round whose vLLM spans name
another version than the one the gateway published).

    PYTHONPATH=src .venv/bin/python benchmarks/native_routes.py --updates 5
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

import httpx

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-control-token-0123456789abcdef"
NATIVE = "bench-native-token-0123456789abcdef"


def _gateway(upstream: str, checkpoint: Path, work: Path) -> tuple[subprocess.Popen[bytes], str]:
    from rolloutcore.engine.process import free_port

    port = free_port()
    (work / "token").write_text(TOKEN + "\n")
    log = work / "gateway.log"
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", upstream,
           "--checkpoint", str(checkpoint), "--port", str(port), "--token-file",
           str(work / "token"), "--health-interval-s", "0", "--native-routes",
           "--min-verification", "declared", "--journal", str(work / "journal.jsonl")]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                     "ROLLOUTCORE_NATIVE_TOKEN": NATIVE})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the gateway did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource

    work = Path(tempfile.mkdtemp(prefix="rc-native-routes-"))
    ckpt = {"A": make_checkpoint(work / "A", 1), "B": make_checkpoint(work / "B", 2)}
    src = {k: WeightSource.from_checkpoint(p) for k, p in ckpt.items()}
    engine = ManagedEngine(ckpt["A"], backend="rolloutcore_gloo", log_dir=work / "logs",
                           startup_timeout_s=900)
    engine.start()
    gw_proc = None
    try:
        gw_proc, gw = _gateway(engine.base_url, ckpt["A"], work)
        auth = {"authorization": f"Bearer {TOKEN}"}
        rows: list[dict[str, Any]] = []
        mislabeled = assigned = 0
        levels: set[str] = set()
        holds = "A"
        for path, base in (("direct", engine.base_url), ("native", f"{gw}/rc/{NATIVE}")):
            tr = GlooTransport()
            for i in range(args.warmup + args.updates):
                nxt = "B" if holds == "A" else "A"
                t0 = time.monotonic()
                tr.send(base, f"sender-{i}", src[nxt], timeout_s=300)
                reset = httpx.post(f"{base}/reset_prefix_cache", timeout=60)
                wall = time.monotonic() - t0
                assert reset.status_code == 200, reset.text
                holds = nxt
                row: dict[str, Any] = {"path": path, "round": i, "target": nxt, "wall_s": wall,
                                       "warmup": i < args.warmup}
                if path == "native":
                    st = httpx.get(f"{gw}/control/status", headers=auth, timeout=30).json()
                    label = st["committed"]["label"]
                    assigned += label != f"sender-{i}" and st["state"] == "READY"
                    notes = [json.loads(line) for line in
                             (work / "journal.jsonl").read_text().splitlines()
                             if '"native_round"' in line]
                    levels.update(n["data"]["level"] for n in notes if "data" in n)
                    g = httpx.post(f"{gw}/inference/v1/generate", timeout=120, json={
                        "model": "policy", "token_ids": [5, 6, 7, 8],
                        "sampling_params": {"max_tokens": 8, "temperature": 0.0,
                                            "ignore_eos": True}}).json()
                    spans = g["choices"][0].get("weight_versions") or []
                    mislabeled += any(s["version"] != label for s in spans) or not spans
                    row["label"] = label
                rows.append(row)
                print(f"[bench] {path:6s} {i:2d} -> {nxt}: {wall:.3f} s", file=sys.stderr)
            tr.close()
        med = {p: statistics.median(r["wall_s"] for r in rows if r["path"] == p
                                    and not r["warmup"]) for p in ("direct", "native")}
        return {"benchmark": "native_routes", "machine": platform.platform(),
                "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
                "updates": args.updates, "warmup": args.warmup,
                "direct_median_s": med["direct"], "native_median_s": med["native"],
                "native_over_direct": med["native"] / med["direct"],
                "verification": sorted(levels), "labels_assigned": assigned,
                "mislabeled_answers": mislabeled, "rounds": rows,
                "command": "PYTHONPATH=src .venv/bin/python benchmarks/native_routes.py "
                           f"--updates {args.updates} --warmup {args.warmup}"}
    finally:
        if gw_proc is not None:
            gw_proc.terminate()
            gw_proc.wait(30)
        engine.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "results" / "native-routes.json"))
    args = p.parse_args()
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "rounds"}, indent=2))


if __name__ == "__main__":
    main()
