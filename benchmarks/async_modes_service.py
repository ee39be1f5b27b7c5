#!/usr/bin/env python3
"""The update modes through the gateway, beside the same modes in process (issue 29).

One paced CPU vLLM (``async_modes.cpu_engine``), one gloo transport. Each
round runs every mode (none, strict, keep, recompute, engine_recompute) twice, interleaved and
rotated so the machine's load drifts hit them alike:

* ``inprocess``: ``async_modes.run_phase``, ``RolloutClient`` threads and
  ``runner.run_update`` in this process (what ``results/async-modes.json``
  measures);
* ``service``: a gateway in a process of its own (this script with
  ``--gateway-child``: ``create_app`` over a controller in the mode, served
  by uvicorn) in front of the same engine; the same long-tail workload as
  closed-loop streaming clients of ``/inference/v1/generate`` (httpx,
  asyncio), and one update per ``--period-s`` through the trainer protocol
  (``RolloutCoreClient.update`` with the same gloo transport).

Per mode and path: useful tokens per second (tokens of answers the gateway
labelled attributable, received inside the window), ``retained`` over the
same path's ``none``, the stall of each update (begin to published, as the
trainer sees it), recomputed tokens, the staleness histogram, and for the
service answers whether the per-token versions in the body field equal
vLLM's own ``weight_versions`` spans in the stream (``spans_disagree``) and
whether the read instants' derivation agreed with them
(``derived_disagrees``). Then the cache control through the gateway: a
request kept across a keep-mode update, then a request sharing its first
two KV blocks, once through an unsalted gateway (``unsafe_unsalted``: the
negative control) and once through a salted one; their prefix-cache hits
are ``cross_version_prefix_hits_unsalted`` and ``..._salted``.

CPU::

    PYTHONPATH=src python benchmarks/async_modes_service.py \\
        --out results/async-modes-service.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

import async_modes as am  # noqa: E402

TOKEN = "async-service-bench-token-0123456789"
#: The in-process benchmark's modes and vLLM's own keep-with-recompute.
MODES = (*am.MODES, "engine_recompute")
AUTH = {"authorization": f"Bearer {TOKEN}"}
GEN = "/inference/v1/generate"


# --------------------------------------------------------------------------- the gateway

def gateway_child(spec: dict[str, Any]) -> None:
    """The gateway process: a controller in ``spec['mode']`` over the running engine."""
    import uvicorn

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import Deadlines, LifecycleRunner
    from rolloutcore.core.evidence import CacheKind
    from rolloutcore.core.lifecycle import UpdateMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.server import http_protocol
    from rolloutcore.session import identity_of
    from rolloutcore.transports.source import WeightSource

    mode = UpdateMode(spec["mode"])
    if spec.get("identity") is not None:
        ident = WeightIdentity.from_dict(spec["identity"])
    else:
        ck = Path(spec["checkpoint"])
        ident = identity_of(WeightSource.from_checkpoint(ck), Provenance(str(ck)))
    http = VllmHTTP(spec["engine"], timeout_s=120)
    adapter = VllmAdapter(http, None, engine_epoch=spec["epoch"])
    journal = Journal(spec["journal"])
    caches = tuple(CacheKind(x) for x in spec.get("required_caches") or [k.value for k in
                                                                          CacheKind])
    c = LifecycleController(config=ControllerConfig(update_mode=mode,
                                                    max_staleness=spec["k"]),
                            required_caches=caches, listener=journal.listener)
    dl = Deadlines(drain_s=300, pause_s=120, transfer_s=120, reset_s=30, validate_s=60,
                   resume_s=30)
    runner = LifecycleRunner(c, adapter, dl, record=journal.write)
    runner.bootstrap(ident)
    salted = bool(spec.get("salted", True))
    cfg = ServiceConfig(upstream_url=spec["engine"], control_token=TOKEN,
                        update_mode=mode.value, queue_max=1024, queue_wait_s=600,
                        min_verification=VerificationLevel.parse(
                            spec.get("min_verification", "declared")),
                        transport=spec.get("transport") or {},
                        salt_prefix_cache=salted, unsafe_unsalted=not salted,
                        health_interval_s=1.0)
    app = create_app(runner, cfg)
    uvicorn.run(app, host="127.0.0.1", port=spec["port"], log_level="warning",
                access_log=False, http=http_protocol(10.0, 30.0))


class Gateway:
    """A gateway child over the engine, in one mode, for one phase.

    ``start``: the engine's current weights, a checkpoint directory or a
    ``WeightIdentity`` (the H200 harness's synthetic one); ``min_verification``
    and ``transport``: the deployment's floor and what a begin's grant says of
    the trainer's transport.
    """

    def __init__(self, engine_url: str, epoch: str | None, start: Any, mode: str,
                 k: int | None, work: Path, *, salted: bool = True,
                 min_verification: str = "declared",
                 transport: dict[str, Any] | None = None,
                 required_caches: Sequence[str] | None = None) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.journal = work / f"gw-{mode}-{port}.jsonl"
        ident = start.to_dict() if hasattr(start, "to_dict") else None
        spec = {"mode": "strict" if mode == "none" else mode, "k": k,
                "checkpoint": None if ident is not None else str(start),
                "identity": ident, "engine": engine_url, "epoch": epoch, "port": port,
                "journal": str(self.journal), "salted": salted,
                "min_verification": min_verification, "transport": transport or {},
                "required_caches": None if required_caches is None else list(required_caches)}
        self.log = open(work / f"gw-{mode}-{port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--gateway-child", json.dumps(spec)],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)})
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited: {Path(self.log.name).read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("gateway did not start")
            time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@dataclass
class ServiceHarness:
    """What the service phases need from an engine set-up (CPU here, the H200 harness).

    ``start_gateway(mode, k, salted)`` a ``Gateway`` over the engine on its
    current weights; ``update(rc)`` one update through the trainer protocol
    (the trainer's next policy; ``UpdateResult``); ``client(url)`` the
    trainer's ``RolloutCoreClient``; ``metrics`` prefix-cache hits so far.
    """

    start_gateway: Callable[..., Gateway]
    update: Callable[[Any], Any]
    client: Callable[[str], Any]
    sampling_extra: dict[str, Any] | None = None
    metrics: Callable[[], float] | None = None
    #: The served model's name, sent with every request (``None``: vLLM's default).
    model: str | None = None


def cpu_service(ce: am.CpuEngine, work: Path) -> ServiceHarness:
    """The service harness over ``async_modes.cpu_engine``'s engine and transport."""
    from rolloutcore.core.versions import Provenance
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.transports.source import WeightSource

    def start(mode: str, k: int | None, salted: bool = True) -> Gateway:
        return Gateway(ce.engine.base_url, ce.engine.epoch,
                       ce.checkpoints[ce.state["serving"]], mode, k, work, salted=salted)

    def update(rc: Any) -> Any:
        nxt = "B" if ce.state["serving"] == "A" else "A"
        res = rc.update(WeightSource.from_checkpoint(ce.checkpoints[nxt]),
                        Provenance(str(ce.checkpoints[nxt])), probe=False)
        ce.state["serving"] = nxt
        return res

    return ServiceHarness(start, update, lambda url: RolloutCoreClient(
        url, TOKEN, transport=ce.transport), None, ce.harness.metrics)


# --------------------------------------------------------------------------- service phase

def _events(lines: list[str]) -> list[Any]:
    out: list[Any] = []
    for ln in lines:
        if ln.startswith("data:"):
            d = ln[5:].strip()
            out.append(d if d == "[DONE]" else json.loads(d))
    return out


async def _one(client: Any, url: str, prompt: list[int], n: int,
               started: threading.Event | None = None,
               sampling_extra: dict[str, Any] | None = None,
               model: str | None = None) -> dict[str, Any]:
    """One streamed rollout through the gateway: its tokens as read, its last word."""
    body: dict[str, Any] = {
        "token_ids": prompt, "stream": True,
        "sampling_params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                            **(sampling_extra or {})}}
    if model is not None:
        body["model"] = model
    reads: list[tuple[float, int]] = []
    evs: list[Any] = []
    t0 = time.monotonic()
    async with client.stream("POST", f"{url}{GEN}", json=body, timeout=600) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return {"status": resp.status_code, "reads": [], "t0": t0,
                    "end": time.monotonic(), "info": {}, "tokens": 0}
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            ev = _events([line])[0]
            evs.append(ev)
            if isinstance(ev, dict):
                k = sum(len(c.get("token_ids") or ()) for c in ev.get("choices") or ())
                if k:
                    reads.append((time.monotonic(), k))
                    if started is not None and len(reads) >= 2:
                        started.set()
    info = next((e["rolloutcore"] for e in reversed(evs) if isinstance(e, dict)
                 and "rolloutcore" in e and "token_versions" in e["rolloutcore"]), {})
    if not info:
        info = next((e["rolloutcore"] for e in reversed(evs) if isinstance(e, dict)
                     and "rolloutcore" in e), {})
    spans = next((c["weight_versions"] for e in evs if isinstance(e, dict)
                  for c in e.get("choices") or () if c.get("weight_versions")), None)
    tv = info.get("token_versions")
    agree = None
    if tv is not None and spans is not None:
        agree = [(s["version"], s["start"], s["end"]) for s in spans] == [
            (s["label"], s["start"], s["end"]) for s in tv["spans"]]
    err = any(isinstance(e, dict) and "error" in e for e in evs)
    return {"status": 200, "reads": reads, "t0": t0, "end": time.monotonic(),
            "tokens": sum(k for _, k in reads), "info": info, "spans_agree": agree,
            "error": err, "recomputed": (sum(s["prefill_tokens"] for s in tv["segments"][1:])
                                         if tv else 0)}


def service_phase(sh: ServiceHarness, mode: str, *, workload: am.Workload, duration_s: float,
                  warmup_s: float, period_s: float, max_staleness: int | None,
                  seed: int) -> dict[str, Any]:
    """One mode through a gateway: the same keys as ``async_modes._raw``, plus the spans'."""
    import httpx

    gw = sh.start_gateway(mode, max_staleness)
    done: list[dict[str, Any]] = []
    updates: list[dict[str, Any]] = []
    stop = threading.Event()
    t0 = time.monotonic()
    window = (t0 + warmup_s, t0 + warmup_s + duration_s)
    rc = sh.client(gw.url)

    def updater() -> None:
        k = 1
        while True:
            at = window[0] + k * period_s
            if at >= window[1] or stop.wait(max(0.0, at - time.monotonic())):
                return
            rec: dict[str, Any] = {"at": round(time.monotonic() - window[0], 3),
                                   "t_start": time.monotonic()}
            try:
                res = sh.update(rc)
                tot = (res.client_s or {}).get("total", time.monotonic() - rec["t_start"])
                rec.update(ok=True, total_s=tot, transition_s=tot, t_end=time.monotonic(),
                           version=None if res.published is None else res.published.label,
                           verification=res.verification)
            except Exception as exc:  # recorded; the phase goes on
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}")
                print(f"   update failed: {rec['error']}", flush=True)
            updates.append(rec)
            k += 1

    async def clients() -> None:
        async with httpx.AsyncClient(limits=httpx.Limits(max_connections=256)) as client:
            async def loop(i: int) -> None:
                rng = random.Random(seed * 1000 + i)
                while time.monotonic() < window[1]:
                    r = await _one(client, gw.url, workload.prompt(rng), workload.length(rng),
                                   sampling_extra=sh.sampling_extra, model=sh.model)
                    done.append(r)
            await asyncio.gather(*(loop(i) for i in range(workload.concurrency)))

    upd = threading.Thread(target=updater, daemon=True)
    try:
        if mode != "none":
            upd.start()
        asyncio.run(clients())
    finally:
        stop.set()
        if mode != "none":
            upd.join(900)
        rc.close()
        gw.close()
    a, b = window
    inside = [r for r in done if a <= r["end"] <= b]
    ok = [r for r in inside if r["status"] == 200 and not r["error"]
          and r["info"].get("attributable", True) is not False]
    hist = Counter(int(r["info"].get("staleness") or 0) for r in ok)
    n_bins = max(1, int((b - a) / am.BIN_S))
    series = [0] * n_bins
    for r in done:
        for t, k in r["reads"]:
            i = int((t - a) / am.BIN_S)
            if 0 <= i < n_bins:
                series[i] += k
    return {
        "mode": mode, "window_s": duration_s, "tokens": sum(r["tokens"] for r in ok),
        "rollouts": len(ok), "lengths": [r["tokens"] for r in ok],
        "unattributable": sum(r["status"] == 200 and r["info"].get("attributable") is False
                              for r in inside),
        "over_bound": sum("max_staleness" in str(r["info"].get("unattributable", ""))
                          for r in inside),
        "failed": sum(r["status"] != 200 or r["error"] for r in inside),
        "errors": [], "recomputed_tokens": sum(r["recomputed"] for r in inside),
        "derived_disagrees": sum(r["info"].get("derived_agrees") is False for r in ok),
        "spans_disagree": sum(r["spans_agree"] is False for r in ok),
        "spans_checked": sum(r["spans_agree"] is not None for r in ok),
        "staleness": {str(k): v for k, v in sorted(hist.items())},
        "updates": updates, "sweep": None, "state_after": None,
        "lost_s": am.engine_time_lost(series, a, updates),
    }


def cache_control(sh: ServiceHarness, *, prompt_tokens: int = 300,
                  kept_tokens: int = 200) -> dict[str, Any]:
    """Prefix hits of a request after a keep update through the gateway, unsalted/salted."""
    import httpx

    assert sh.metrics is not None
    rng = random.Random(1)
    out: dict[str, Any] = {}
    for salted in (False, True):
        gw = sh.start_gateway("keep", None, salted)
        rc = sh.client(gw.url)
        p = [rng.randrange(1, 200) for _ in range(prompt_tokens)]
        box: dict[str, Any] = {}
        started = threading.Event()

        def kept(p: list[int] = p, box: dict[str, Any] = box, url: str = gw.url,
                 started: threading.Event = started) -> None:
            async def go() -> None:
                async with httpx.AsyncClient() as c:
                    box["k"] = await _one(c, url, p, kept_tokens, started,
                                          sh.sampling_extra, sh.model)
            asyncio.run(go())

        th = threading.Thread(target=kept, daemon=True)
        th.start()
        if not started.wait(120):
            raise RuntimeError("the kept request never started")
        kept_across = th.is_alive()
        sh.update(rc)
        before = sh.metrics()
        body: dict[str, Any] = {"token_ids": [*p, 3, 5, 7], "sampling_params": {
            "max_tokens": 8, "ignore_eos": True, **(sh.sampling_extra or {})}}
        if sh.model is not None:
            body["model"] = sh.model
        r = httpx.post(f"{gw.url}{GEN}", json=body, timeout=120)
        hits = sh.metrics() - before
        th.join(600)
        k = box.get("k", {})
        out["salted" if salted else "unsalted"] = {
            "hits": hits, "kept_across_the_update": kept_across, "request_status": r.status_code,
            "kept_tokens": k.get("tokens"),
            "kept_versions": [s["label"] for s in
                              (k.get("info", {}).get("token_versions") or {}).get("spans", [])]}
        rc.close()
        gw.close()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/async-modes-service.json")
    ap.add_argument("--gateway-child", default=None, help=argparse.SUPPRESS)
    am.add_workload_args(ap)
    ap.add_argument("--warm-s", type=float, default=8.0,
                    help="an unmeasured first phase per path (the engine's warm-up)")
    ap.set_defaults(rounds=3)
    args = ap.parse_args(argv)
    if args.gateway_child:
        gateway_child(json.loads(args.gateway_child))
        return 0
    t_run = time.monotonic()
    ce = am.cpu_engine(args)
    work = Path(args.workdir or f"/tmp/rc-async-bench-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    workload = am.Workload(args.concurrency, args.median_tokens, args.sigma, args.cap_tokens,
                           args.prompt_tokens)
    raw: dict[str, list[dict[str, Any]]] = {"inprocess": [], "service": []}
    sh = cpu_service(ce, work)
    # Each mode on both paths back to back, which path first alternating.
    plan = [(m, path) for j, m in enumerate(am.plan_rounds(MODES, args.rounds))
            for path in (("inprocess", "service") if j % 2 == 0 else ("service", "inprocess"))]
    try:
        # A first phase on a new engine runs its compilations and warm-ups: not measured.
        print(f"[{time.monotonic() - t_run:6.1f}s] warm-up ({args.warm_s:g}s per path)",
              flush=True)
        for path in ("inprocess", "service"):
            kw0 = {"workload": workload, "duration_s": args.warm_s, "warmup_s": 0.0,
                   "period_s": args.warm_s, "max_staleness": None, "seed": 999}
            if path == "inprocess":
                am.run_phase(ce.harness, "none", **kw0)
            else:
                service_phase(sh, "none", **kw0)
        for i, (mode, path) in enumerate(plan):
            print(f"[{time.monotonic() - t_run:6.1f}s] phase {i + 1}/{len(plan)}: {mode} "
                  f"{path}", flush=True)
            kw = {"workload": workload, "duration_s": args.phase_s, "warmup_s": args.warmup_s,
                  "period_s": args.period_s, "max_staleness": args.max_staleness, "seed": i}
            p = (am.run_phase(ce.harness, mode, **kw) if path == "inprocess"
                 else service_phase(sh, mode, **kw))
            if ce.harness.abort_all is not None:
                ce.harness.abort_all()
            print(f"   {p['tokens'] / p['window_s']:.0f} tok/s, {p['rollouts']} rollouts, "
                  f"{len(p['updates'])} updates, recomputed {p['recomputed_tokens']}, "
                  f"failed {p['failed']}, unattributable {p['unattributable']}", flush=True)
            raw[path].append(p)
        print(f"[{time.monotonic() - t_run:6.1f}s] cache control through the gateway",
              flush=True)
        cache = cache_control(sh)
    finally:
        ce.close()
    summ = {path: am.summarize(ps, period_s=args.period_s, concurrency=args.concurrency,
                               modes=MODES)
            for path, ps in raw.items()}
    s: dict[str, Any] = {}
    for mode in MODES:
        s[mode] = {path: summ[path].get(mode) for path in raw}
        svc, inp = s[mode]["service"], s[mode]["inprocess"]
        if svc and inp and inp["tokens_per_s"]:
            s[mode]["service_over_inprocess_tokens"] = svc["tokens_per_s"] / inp["tokens_per_s"]
        if svc:
            ps = [p for p in raw["service"] if p["mode"] == mode]
            svc["spans_disagree"] = sum(p["spans_disagree"] for p in ps)
            svc["spans_checked"] = sum(p["spans_checked"] for p in ps)
    s["cross_version_prefix_hits_salted"] = cache["salted"]["hits"]
    s["cross_version_prefix_hits_unsalted"] = cache["unsalted"]["hits"]
    s["cache_control"] = cache
    s.update(am.machine_and_versions())
    s["workload"] = {**asdict(workload), "phase_s": args.phase_s, "warmup_s": args.warmup_s,
                     "rounds": args.rounds, "max_staleness": args.max_staleness,
                     "step_sleep_s": args.step_sleep_s, "update_period_s": args.period_s,
                     "verification": "declared floor on both paths (the trainer sends no "
                                     "probe; the same gloo transport)"}
    s["command"] = " ".join([sys.executable, *sys.argv])
    s["wall_s"] = round(time.monotonic() - t_run, 1)
    s["phases"] = raw
    rows = [("mode", "path", "tok/s", "retained", "stall med s", "recomputed",
             "unattributable", "spans !=")]
    for mode in MODES:
        for path in ("inprocess", "service"):
            m = s[mode][path]
            if not m:
                continue
            rows.append((mode, path, f"{m['tokens_per_s']:.0f}",
                         "-" if m["retained"] is None else f"{m['retained']:.3f}",
                         f"{m['stall_median_s']:.3f}", str(m["recomputed_tokens"]),
                         str(m["unattributable"]), str(m.get("spans_disagree", "-"))))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("\n".join("  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows))
    print(f"cross-version prefix hits through the gateway: unsalted "
          f"{s['cross_version_prefix_hits_unsalted']:g}, salted "
          f"{s['cross_version_prefix_hits_salted']:g}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(s, indent=1, sort_keys=True, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
