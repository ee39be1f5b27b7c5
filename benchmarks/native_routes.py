"""The same unmodified sender, on the engine directly and through the gateway's native routes.

Setup: one vLLM (CPU, generated tiny checkpoints A and B, the gloo
weight-transfer backend) and one ``rolloutcore serve --upstream --native-routes``
gateway in its own process (engine watch off: the direct rounds are writes
the gateway does not make, and it would rightly taint on them). The sender
is ``GlooTransport.send`` (vLLM's route sequence: start, update beside the
broadcast, finish) followed by ``/reset_prefix_cache``, as TRL server mode
does; its base URL is the engine's, or the gateway's ``/rc/<token>``.
``--updates`` rounds on each path, interleaved (direct, native; native,
direct; ...: the order swapped every pair, so a drift in the machine's load
lands on both alike), alternating A and B. The engine's workers hold one
sender's group at a time, so a round on the other path than the last
reconnects first (untimed): the second round of each pair starts on a fresh
group, on either path alike (``fresh_group`` in its row).

``--engines``: ``guarded``, the engine launched behind RolloutCore's route
guard and the gateway given its key (``serve.upstream_route_key``), which is
what ``serve --model`` runs: the gateway pauses through the guard's
``FAST_PAUSE``; ``open``, a vLLM with its routes open, as a plain
``--upstream`` has: vLLM's own ``/pause`` with its fixed 20 ms sleep. Each
on its own engine, the first named the headline.

Written to ``results/native-routes.json``, per engine (``by_engine``):
per-round wall times and the machine's 1-minute load at each round's start,
the medians, ``native_over_direct`` (gateway median / direct median: what the
round costs on top: drain, pause, checks, resume, publish),
``round_ratios`` (each interleaved pair's native / direct) and their median
``round_ratio_median``, the level a
gateway round reached (``verification``), ``labels_assigned`` (gateway
rounds published under the gateway's label, not the sender's), and
``mislabeled_answers`` (answers after a gateway round whose vLLM spans name
another version than the one the gateway published).

Each round also has ``calls`` (the sender's start/update/finish and the
reset, as the sender saw them: seconds from the round's start to the call's
answer, and its duration) and, through the gateway, ``phases``: the
gateway's own steps, from its journal (the round's ``native_round`` note
times the open and each call it forwarded; ``t_mono`` is the host's
monotonic clock, the benchmark's too): ``ingress`` (the round's start ->
the controller's ``request_update``: the sender's call on its way, the
gateway's ``before_open``, its lock and body read, then the thread hop),
``open`` (the round opened: drain, pause, preflight),
``vllm_start``/``vllm_update``/``vllm_finish`` (the calls forwarded to
vLLM), ``close`` (the caches reset, validated while paused, resumed,
published) with its effects (``invalidate``,
``validate``, ``resume``, ``validate_live``), and ``answer`` (published ->
the finish's answer back at the sender). What a sender's call costs beyond
the server's time is in both paths alike: every call, the reset too, is made as
vLLM's ``HTTPVLLMWeightSyncClient`` makes it (``requests.post``: a new
connection per call), with the process's one TLS context.
``phase_medians`` are their medians over the measured rounds.

    PYTHONPATH=src .venv/bin/python benchmarks/native_routes.py --updates 5 --engines guarded,open
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


def _gateway(upstream: str, checkpoint: Path, work: Path, route_key: str | None
             ) -> tuple[subprocess.Popen[bytes], str]:
    """``serve --upstream`` on the engine, given its route key when it has one."""
    from rolloutcore.engine.process import free_port

    port = free_port()
    from rolloutcore.transports import engine_key

    (work / "token").write_text(TOKEN + "\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ROLLOUTCORE_NATIVE_TOKEN": NATIVE}
    env.pop(engine_key.ENV, None)
    if route_key is not None:
        env[engine_key.ENV] = route_key
    log = work / "gateway.log"
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", upstream,
           "--checkpoint", str(checkpoint), "--port", str(port), "--token-file",
           str(work / "token"), "--health-interval-s", "0", "--native-routes",
           "--min-verification", "declared", "--journal", str(work / "journal.jsonl")]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    url = f"http://127.0.0.1:{port}"
    wait_for_health(proc, url, log, 300)
    return proc, url


def wait_for_health(proc: subprocess.Popen[bytes], url: str, log: Path,
                    timeout_s: float) -> None:
    """Until the gateway process answers ``/health`` 200; ``RuntimeError`` with its log's
    end when it exits or does not answer in time (then it is killed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the gateway exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the gateway did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def _timed_posts(tr: Any, calls: list[dict[str, Any]]) -> None:
    """Record each of the sender's POSTs (route, start, end) into ``calls``."""
    post = tr.post

    def timed(base_url: str, path: str, body: Any, timeout_s: float) -> Any:
        t = time.monotonic()
        try:
            return post(base_url, path, body, timeout_s)
        finally:
            calls.append({"route": path, "t0": t, "t1": time.monotonic()})

    tr.post = timed


def _journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _phases(recs: list[dict[str, Any]], t0: float, t_end: float,
            finish_answered: float) -> dict[str, float]:
    """The gateway's steps of the round that ran in [t0, t_end], from its journal: the
    round's note (``gateway_s``: the open and each call forwarded to vLLM, timed by the
    gateway) and the records' times (the close: note -> commit, and its effects)."""
    mine = [r for r in recs if t0 <= r["t_mono"] <= t_end]
    note = next((r for r in mine if r["kind"] == "note"
                 and r["data"].get("what") == "native_round"), None)
    commit = next((r for r in mine if r["kind"] == "commit"), None)
    if note is None or commit is None:
        return {}
    noted, committed = float(note["t_mono"]), float(commit["t_mono"])
    out = {(k if k in ("open", "before_open") else f"vllm_{k.split('_')[0]}"): float(v)
           for k, v in note["data"].get("gateway_s", {}).items()}
    opened = next((float(r["t_mono"]) for r in mine if r["kind"] == "request_update"), None)
    if opened is not None:
        out["ingress"] = opened - t0
    out.update(close=committed - noted, answer=finish_answered - committed)
    for r in mine:
        if r["kind"] == "effect" and noted <= r["t_mono"] <= committed:
            step = r["data"]["step"]
            out[step] = out.get(step, 0.0) + float(r["data"]["seconds"])
    return out


def _medians(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per call (its duration at the sender) and per gateway phase: the median."""
    calls = sorted({k for r in rows for k in r["calls"]})
    phases = sorted({k for r in rows for k in r.get("phases", {})})
    out = {"calls": {k: statistics.median(r["calls"][k]["seconds"] for r in rows
                                          if k in r["calls"]) for k in calls}}
    if phases:
        out["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in rows)
                         for k in phases}
    return {f: {k: round(v, 4) for k, v in d.items()} for f, d in out.items()}


def calls_of(posts: list[dict[str, Any]], t0: float) -> dict[str, dict[str, float]]:
    """The sender's calls of a round that started at ``t0``, by route: seconds from the
    start to the call's answer, and its duration."""
    return {c["route"].lstrip("/"): {"answered_at": round(c["t1"] - t0, 4),
                                     "seconds": round(c["t1"] - c["t0"], 4)} for c in posts}


def interleaved(rounds: int) -> list[tuple[int, str]]:
    """(round, path) in the order they run: direct, native; native, direct; ... (the
    order swapped every pair, so a drift in the machine's load lands on both alike)."""
    return [(i, path) for i in range(rounds)
            for path in (("direct", "native") if i % 2 == 0 else ("native", "direct"))]


def after_native_round(gw: str, auth: dict[str, str], journal: Path, sender_label: str | None,
                       *, spans: bool = True, previous: str | None = None,
                       sampling: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a gateway round left, as its clients see it: the label the gateway published
    (``assigned``: the gateway's own, READY, not the sender's nor ``previous``), the
    levels its rounds' journal notes reached, and one greedy answer through the gateway,
    ``mislabeled`` when it is attributed to another version than that label (or did not
    come). The attribution is vLLM's per-token spans (``spans``; an answer without any is
    mislabeled), or, for a vLLM that has none (0.26), the gateway's version header.
    ``sampling``: more sampling parameters (``detokenize: false`` without a tokenizer)."""
    st = httpx.get(f"{gw}/control/status", headers=auth, timeout=30).json()
    label = st["committed"]["label"]
    notes = [json.loads(line) for line in journal.read_text().splitlines()
             if '"native_round"' in line]
    g = httpx.post(f"{gw}/inference/v1/generate", timeout=120, json={
        "model": "policy", "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                            **(sampling or {})}})
    named: list[str] = []
    if g.status_code == 200 and spans:
        named = [s["version"] for s in g.json()["choices"][0].get("weight_versions") or []]
    elif g.status_code == 200 and "x-rolloutcore-version" in g.headers:
        named = [g.headers["x-rolloutcore-version"]]
    return {"label": label, "state": st["state"],
            "assigned": st["state"] == "READY" and label not in (sender_label, previous),
            "levels": sorted({n["data"]["level"] for n in notes if "data" in n}),
            "mislabeled": not named or any(v != label for v in named),
            "attributed_by": "vllm spans" if spans else "gateway header",
            "answer_status": g.status_code}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured (non-warm-up) rounds of both paths: medians, their ratio, each
    interleaved pair's ratio and the phase medians."""
    measured = [r for r in rows if not r["warmup"]]
    paths = ("direct", "native")
    med = {p: statistics.median(r["wall_s"] for r in measured if r["path"] == p)
           for p in paths}
    pairs = [n["wall_s"] / d["wall_s"] for d, n in zip(
        [r for r in measured if r["path"] == "direct"],
        [r for r in measured if r["path"] == "native"], strict=True)]
    return {"direct_median_s": med["direct"], "native_median_s": med["native"],
            "native_over_direct": med["native"] / med["direct"],
            "round_ratios": [round(x, 4) for x in pairs],
            "round_ratio_median": statistics.median(pairs),
            "phase_medians": {p: _medians([r for r in measured if r["path"] == p])
                              for p in paths}}


def _round(path: str, i: int, base: str, tr: Any, posts: list[dict[str, Any]], nxt: str,
           src: Any, warm: bool) -> tuple[dict[str, Any], float, float]:
    """One round of the sender on ``base``: (row, its start, its end). The engine's
    workers hold one sender's group at a time: a round on the other path first
    connects there (``/init_weight_transfer_engine``, relayed by the gateway outside
    any round), before the round's clock starts."""
    from rolloutcore.engine.errors import request

    fresh = tr.connected_to != base
    if fresh:
        tr.connect(base, timeout_s=300)
    posts.clear()
    load = os.getloadavg()[0]
    t0 = time.monotonic()
    tr.send(base, f"sender-{path}-{i}", src, timeout_s=300)
    tr_ = time.monotonic()
    # Sent as the sender's own calls are (``TransportBase.post``): a new connection per
    # call, as vLLM's client's ``requests.post``, with the process's one TLS context (a
    # bare ``httpx.post`` loads the CA bundle on every call: ~30 ms that vLLM's client
    # does not spend, on both paths). The route key when the base is the engine's.
    reset = request("POST", f"{base}/reset_prefix_cache", step="reset_prefix_cache",
                    timeout_s=60)
    t_end = time.monotonic()
    assert reset.status_code == 200, reset.text
    posts.append({"route": "/reset_prefix_cache", "t0": tr_, "t1": t_end})
    row: dict[str, Any] = {"path": path, "round": i, "target": nxt, "wall_s": t_end - t0,
                           "warmup": warm, "load_1m": round(load, 2), "fresh_group": fresh,
                           "calls": calls_of(posts, t0)}
    return row, t0, t_end


def run_engine(args: argparse.Namespace, guarded: bool, work: Path) -> dict[str, Any]:
    """The benchmark on one engine: ``guarded`` (launched behind RolloutCore's route
    guard, the gateway given its key: what ``serve --model`` runs) or not (an
    ``--upstream`` vLLM with its routes open: vLLM's own ``/pause``)."""
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource

    work.mkdir(parents=True)
    ckpt = {"A": make_checkpoint(work / "A", 1), "B": make_checkpoint(work / "B", 2)}
    src = {k: WeightSource.from_checkpoint(p) for k, p in ckpt.items()}
    engine = ManagedEngine(ckpt["A"], backend="rolloutcore_gloo", log_dir=work / "logs",
                           startup_timeout_s=900, guard_routes=guarded)
    engine.start()
    gw_proc = None
    tr = GlooTransport()
    try:
        gw_proc, gw = _gateway(engine.base_url, ckpt["A"], work, engine.route_key)
        auth = {"authorization": f"Bearer {TOKEN}"}
        rows: list[dict[str, Any]] = []
        mislabeled = assigned = 0
        levels: set[str] = set()
        holds = "A"
        bases = {"direct": engine.base_url, "native": f"{gw}/rc/{NATIVE}"}
        posts: list[dict[str, Any]] = []
        _timed_posts(tr, posts)
        load_start = list(os.getloadavg())
        for i, path in interleaved(args.warmup + args.updates):
            nxt = "B" if holds == "A" else "A"
            row, t0, t_end = _round(path, i, bases[path], tr, posts, nxt, src[nxt],
                                    i < args.warmup)
            holds = nxt
            if path == "native":
                fin = next(c["t1"] for c in posts if c["route"] == "/finish_weight_update")
                row["phases"] = {k: round(v, 4) for k, v in _phases(
                    _journal(work / "journal.jsonl"), t0, t_end, fin).items()}
                seen = after_native_round(gw, auth, work / "journal.jsonl",
                                          f"sender-{path}-{i}")
                assigned += seen["assigned"]
                levels.update(seen["levels"])
                mislabeled += seen["mislabeled"]
                row["label"] = seen["label"]
            rows.append(row)
            print(f"[bench] {'guarded' if guarded else 'open':7s} {path:6s} {i:2d} -> "
                  f"{nxt}: {row['wall_s']:.3f} s", file=sys.stderr)
        return {"engine": "guarded" if guarded else "open",
                "load_avg": {"start": load_start, "end": list(os.getloadavg())},
                **summarize(rows),
                "verification": sorted(levels), "labels_assigned": assigned,
                "mislabeled_answers": mislabeled,
                "rounds": rows}
    finally:
        tr.close()
        if gw_proc is not None:
            gw_proc.terminate()
            gw_proc.wait(30)
        engine.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    engines = [e for e in args.engines.split(",") if e]
    if not engines or set(engines) - {"guarded", "open"}:
        raise SystemExit(f"--engines: a list of guarded and open, got {args.engines!r}")
    if args.updates < 1 or args.warmup < 0:
        raise SystemExit("--updates must be at least 1 and --warmup at least 0")
    base = Path(tempfile.mkdtemp(prefix="rc-native-routes-"))
    by = {e: run_engine(args, e == "guarded", base / e) for e in engines}
    head = by[engines[0]]
    return {"benchmark": "native_routes", "machine": platform.platform(),
            "cpus": os.cpu_count(), "load_avg": os.getloadavg(),
            "updates": args.updates, "warmup": args.warmup, "engine": head["engine"],
            **{k: head[k] for k in ("direct_median_s", "native_median_s",
                                    "native_over_direct", "round_ratio_median")},
            "by_engine": by,
            "command": "PYTHONPATH=src .venv/bin/python benchmarks/native_routes.py "
                       f"--updates {args.updates} --warmup {args.warmup} "
                       f"--engines {','.join(engines)}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--updates", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--engines", default="guarded,open",
                   help="guarded (launched behind the route guard, as serve --model runs "
                        "it), open (an --upstream vLLM, its routes open), or both: the "
                        "first is the headline")
    p.add_argument("--out", default=str(ROOT / "results" / "native-routes.json"))
    args = p.parse_args()
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({**res, "by_engine": {e: {k: v for k, v in r.items() if k != "rounds"}
                                           for e, r in res["by_engine"].items()}}, indent=2))


if __name__ == "__main__":
    main()
