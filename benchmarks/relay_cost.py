#!/usr/bin/env python3
"""The gateway's CPU per relayed SSE event: strict vs the carried relay (keep, recompute).

Not a test: it measures and writes ``results/relay-cost.json`` and prints a table.

What it measures. Streams of ``/inference/v1/generate`` (one token per event)
relayed by the real gateway, with no weight update at all, in each update
mode: ``strict`` (``service.proxy``: the first event is parsed to splice the
version field in, then bytes pass through) and the asynchronous ``keep`` and
``recompute`` (``service.carried.CarriedRelay``: every event is parsed,
turned into a ``GenerationChunk`` with its read instant, and at the end the
tokens' versions are derived and stitched into a last event). Per mode:

* ``events_per_s``: token events delivered to the clients per second (the
  stream's own extra events, the version field's and ``[DONE]``, not counted);
* ``gateway_cpu_us_per_event``: the gateway process's CPU time (user + system,
  from /proc) over the window, per token event; ``gateway_core_share`` is the
  same CPU over the window's wall time (1.0: one core busy);
* ``one_core_cap_events_per_s``: 1e6 / ``gateway_cpu_us_per_event``, the rate
  at which the gateway alone would fill one core (its GIL);
* ``extra_us_per_event_vs_strict``, and ``core_share_at_2400_events_per_s``
  (``--reference-rate``): the share of one core the mode's relay needs at
  that rate;

and ``direct_events_per_s``, the same clients straight to the upstream. The
top-level figures are the ``burst`` regime's, ``paced`` has the same keys,
``regimes`` every round (upstream and client CPU per event too).

Setup, three kinds of process on loopback, so that no one's CPU mixes into
another's: a fake vLLM (this script with ``--child upstream``: a tiny
Starlette app streaming ``N`` events in the shape ``tests/helpers/fake_vllm``
gives vLLM 0.32's token route, ``weight_versions`` on the last event, one
send per event, no engine behind it); one gateway per mode (``--child
gateway``: ``create_app`` over a bootstrapped controller in that mode whose
adapter is ``rolloutcore.testing.fake``'s ``FakeAdapter``, served by uvicorn
as ``rolloutcore serve`` serves it: uvloop, the httptools protocol of
``service.server``, no access log; the engine watch off, so only the data
plane runs); and the clients, here: ``--concurrency`` asyncio connections
(a raw HTTP/1.1 client that only counts events, so its own cost stays
small), each running streams back to back for ``--duration-s``. The
gateway cannot be ``python -m rolloutcore serve``: serve takes over a real
vLLM (its version, routes, label and policy probe are checked first).

Two regimes, the same clients and gateways:

* ``burst`` (the headline numbers): the upstream writes its events as fast
  as it can, so several of them usually reach the gateway in one read;
* ``paced``: the upstream sleeps ``--paced-gap-us`` between the events of a
  stream (as vLLM does between decode steps), so most reads hold one event,
  the regime of a GPU engine with many streams.

Rounds alternate the arms (direct, strict, keep, recompute) so drift in the
machine's load hits them alike; medians are reported. Then, unless
``--no-profile``, each gateway runs one more window per regime under cProfile
(its event-loop thread, started and stopped by signals around the window
only) and the top functions by own time are recorded, per token event.

    .venv/bin/python benchmarks/relay_cost.py [--concurrency 16] [--tokens 200] \\
        [--duration-s 3] [--rounds 2] [--out results/relay-cost.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import pstats
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

GEN = "/inference/v1/generate"
TOKEN = "relay-cost-bench-token-0123456789"
MODES = ("strict", "keep", "recompute")
ARMS = ("direct", *MODES)
#: The fake upstream's own request field: microseconds to sleep between events.
GAP_FIELD = "bench_event_gap_us"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


# --------------------------------------------------------------------------- children

def upstream_child(port: int) -> None:
    """A fake vLLM token route: ``max_tokens`` events of one token each, then ``[DONE]``."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def generate(request: Request) -> Response:
        body = await request.json()
        sp = body.get("sampling_params") or {}
        n = int(sp.get("max_tokens") or 16)
        gap = float(body.get(GAP_FIELD) or 0) / 1e6
        rid = request.headers.get("x-request-id") or str(body.get("request_id") or "r-bench")
        last = (body.get("token_ids") or [0])[-1]

        def event(i: int) -> bytes:
            fin = i == n - 1
            ev = {"request_id": rid, "choices": [{
                "index": 0, "token_ids": [(last + 1 + i) % 256],
                "finish_reason": "length" if fin else None,
                "weight_versions": ([{"version": "default", "start": 0, "end": n}]
                                    if fin else None)}]}
            return f"data: {json.dumps(ev)}\n\n".encode()

        async def stream() -> Any:
            for i in range(n):
                yield event(i)
                if gap:
                    await asyncio.sleep(gap)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    app = Starlette(routes=[Route(GEN, generate, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                lifespan="off")


def gateway_child(mode: str, upstream: str, port: int, profile: str | None) -> None:
    """The real gateway in ``mode`` over the fake upstream, served as ``serve`` serves it."""
    import gc

    import uvicorn

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.core.lifecycle import UpdateMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.server import http_protocol
    from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

    w = FakeWeights.from_seed(0)
    ctl = LifecycleController(config=ControllerConfig(update_mode=UpdateMode(mode)))
    runner = LifecycleRunner(ctl, FakeAdapter(FakeEngine(w)))
    runner.bootstrap(w.identity())
    cfg = ServiceConfig(upstream_url=upstream, control_token=TOKEN, update_mode=mode,
                        health_interval_s=0)
    app = create_app(runner, cfg)
    gc.collect()
    gc.freeze()  # as run_until_signalled does

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    if profile:
        # The profile covers exactly the parent's window: SIGUSR1 starts it, SIGUSR2
        # stops it and writes it (both run on the main thread, the event loop's).
        import cProfile

        profs: list[cProfile.Profile] = []

        def begin(signum: int, frame: object) -> None:
            profs.append(cProfile.Profile())
            profs[-1].enable()

        def end(signum: int, frame: object) -> None:
            prof = profs.pop()
            prof.disable()
            prof.dump_stats(profile + ".part")
            os.replace(profile + ".part", profile)

        signal.signal(signal.SIGUSR1, begin)
        signal.signal(signal.SIGUSR2, end)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                proxy_headers=False, timeout_graceful_shutdown=2,
                http=http_protocol(cfg.client_header_s, cfg.client_send_s))


# --------------------------------------------------------------------------- processes

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Child:
    """One child process of this script, listening on its own loopback port."""

    def __init__(self, *args: str) -> None:
        self.port = _free_port()
        cmd = [sys.executable, str(Path(__file__).resolve()), *args, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        return _cpu_s(self.proc.pid)

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"child {self.proc.args} exited {self.proc.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"child {self.proc.args} did not listen in {timeout_s}s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# --------------------------------------------------------------------------- the clients

def _request(port: int, tokens: int, gap_us: int) -> bytes:
    body: dict[str, Any] = {"token_ids": PROMPT, "stream": True,
                            "sampling_params": {"max_tokens": tokens}}
    if gap_us:
        body[GAP_FIELD] = gap_us
    raw = json.dumps(body, separators=(",", ":")).encode()
    return (f"POST {GEN} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(raw)}\r\n\r\n"
            ).encode() + raw


async def _one_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      req: bytes) -> tuple[int, bool]:
    """One streamed answer on a kept-alive connection: (data events, whole and clean)."""
    writer.write(req)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" not in head.lower():
        raise RuntimeError(f"unexpected answer head: {head[:300]!r}")
    events = errors = 0
    done = False
    ctail = etail = b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise ConnectionError("the server closed the stream")
        buf = ctail + data            # a 4-byte tail holds no whole "data:": none counted twice
        events += buf.count(b"data:")
        errors += buf.count(b'"error"')
        done = done or b"[DONE]" in buf
        ctail = buf[-4:]
        end = etail + data
        if end.endswith(b"\r\n0\r\n\r\n"):  # the chunked encoding's last chunk
            break
        etail = end[-16:]
    return events, status == 200 and done and errors == 0


async def _drive(port: int, concurrency: int, tokens: int, gap_us: int,
                 duration_s: float) -> dict[str, Any]:
    req = _request(port, tokens, gap_us)
    counts = {"requests": 0, "bad": 0, "wire_events": 0}
    deadline = time.monotonic() + duration_s

    async def worker() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
        try:
            while time.monotonic() < deadline:
                n, ok = await _one_stream(reader, writer, req)
                counts["requests"] += 1
                counts["wire_events"] += n
                counts["bad"] += 0 if ok else 1
        finally:
            writer.close()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return counts


def measure(target: Child, gateway: Child | None, upstream: Child, concurrency: int,
            tokens: int, gap_us: int, duration_s: float, warmup_s: float,
            profiled: bool = False) -> dict[str, Any]:
    """One window of ``concurrency`` clients against ``target`` (a gateway or the upstream).

    ``profiled``: the gateway's profiler is started and stopped around the window.
    """
    asyncio.run(_drive(target.port, concurrency, tokens, gap_us, warmup_s))
    if profiled and gateway is not None:
        os.kill(gateway.pid, signal.SIGUSR1)
        time.sleep(0.05)
    g0 = gateway.cpu_s() if gateway is not None else 0.0
    u0 = upstream.cpu_s()
    c0 = time.process_time()
    t0 = time.monotonic()
    counts = asyncio.run(_drive(target.port, concurrency, tokens, gap_us, duration_s))
    wall = time.monotonic() - t0
    if profiled and gateway is not None:
        os.kill(gateway.pid, signal.SIGUSR2)
    c1 = time.process_time()
    u1 = upstream.cpu_s()
    g1 = gateway.cpu_s() if gateway is not None else 0.0
    ev = counts["requests"] * tokens
    out: dict[str, Any] = {
        "wall_s": round(wall, 3), **counts, "token_events": ev,
        "events_per_s": round(ev / wall, 1),
        "wire_events_per_request": round(counts["wire_events"] / max(1, counts["requests"]), 2),
        "upstream_cpu_us_per_event": round((u1 - u0) / ev * 1e6, 2),
        "client_cpu_us_per_event": round((c1 - c0) / ev * 1e6, 2),
    }
    if gateway is not None:
        out["gateway_cpu_s"] = round(g1 - g0, 3)
        out["gateway_cpu_us_per_event"] = round((g1 - g0) / ev * 1e6, 2)
        out["gateway_core_share"] = round((g1 - g0) / wall, 3)
    return out


def _median(rows: list[dict[str, Any]], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 2)


def summarize(rows: list[dict[str, Any]], gateway: bool) -> dict[str, Any]:
    keys = ["events_per_s", "upstream_cpu_us_per_event", "client_cpu_us_per_event",
            "wire_events_per_request"]
    if gateway:
        keys += ["gateway_cpu_us_per_event", "gateway_core_share"]
    out = {k: _median(rows, k) for k in keys}
    if gateway:
        out["one_core_cap_events_per_s"] = round(1e6 / out["gateway_cpu_us_per_event"])
    out["bad_requests"] = sum(r["bad"] for r in rows)
    out["rounds"] = rows
    return out


# --------------------------------------------------------------------------- profile

def _where(func: tuple[str, int, str]) -> str:
    path, line, name = func
    for base in (str(ROOT / "src") + "/", str(ROOT) + "/", sys.prefix + "/"):
        if path.startswith(base):
            path = path[len(base):]
            break
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return f"{path}:{line}({name})" if line else name


def profile_summary(path: str, events: int, top: int) -> dict[str, Any]:
    st = pstats.Stats(path)
    raw: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    rows = sorted(raw.items(), key=lambda kv: kv[1][2], reverse=True)
    by_own = [{"function": _where(f), "calls_per_event": round(v[1] / events, 3),
               "own_us_per_event": round(v[2] / events * 1e6, 2),
               "own_share": round(v[2] / total, 4),
               "cum_us_per_event": round(v[3] / events * 1e6, 2)}
              for f, v in rows[:top]]
    watch = ("_read_stream", "chunk_of", "_finish", "_attribute", "segment_run", "stitch",
             "version_at", "events_raw", "_encode", "feed", "_relay_stream", "relay",
             "_relay", "iter_any", "loads", "post")
    cum = sorted(({"function": _where(f), "calls_per_event": round(v[1] / events, 3),
                   "cum_us_per_event": round(v[3] / events * 1e6, 2),
                   "own_us_per_event": round(v[2] / events * 1e6, 2)}
                  for f, v in raw.items() if f[2] in watch and (
                      "rolloutcore" in f[0] or f[0] in ("~", "") or "json" in f[0])),
                 key=lambda r: -r["cum_us_per_event"])
    return {"token_events": events, "profiled_own_s": round(total, 3),
            "profiled_us_per_event": round(total / events * 1e6, 2),
            "top_by_own_time": by_own, "selected_cumulative": cum[:20]}


# --------------------------------------------------------------------------- main

def _machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {"platform": platform.platform(), "cpu": cpu, "cores": os.cpu_count(),
            "loadavg_at_start": list(os.getloadavg())}


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for d in ("uvicorn", "uvloop", "httptools", "starlette"):
        with contextlib.suppress(PackageNotFoundError):
            out[d] = version(d)
    return out


def _table(res: dict[str, Any]) -> str:
    lines = []
    for regime, r in res["regimes"].items():
        lines.append(f"\n{regime} (C={res['settings']['concurrency']}, "
                     f"{res['settings']['tokens']} tokens/stream, one token per event"
                     + (f", {res['settings']['paced_gap_us']} us between events)"
                        if regime == "paced" else ")"))
        lines.append(f"  {'arm':<10}{'events/s':>10}{'gw us/ev':>10}{'gw cores':>10}"
                     f"{'1-core cap':>12}{'up us/ev':>10}{'cli us/ev':>10}")
        for arm in ARMS:
            a = r[arm]
            gw = arm != "direct"
            lines.append(
                f"  {arm:<10}{a['events_per_s']:>10.0f}"
                f"{(a['gateway_cpu_us_per_event'] if gw else float('nan')):>10.1f}"
                f"{(a['gateway_core_share'] if gw else float('nan')):>10.2f}"
                f"{(a['one_core_cap_events_per_s'] if gw else 0):>12}"
                f"{a['upstream_cpu_us_per_event']:>10.1f}{a['client_cpu_us_per_event']:>10.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--child", choices=("upstream", "gateway"), help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="strict", help=argparse.SUPPRESS)
    ap.add_argument("--upstream", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--profile-to", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=200, help="events (tokens) per stream")
    ap.add_argument("--duration-s", type=float, default=3.0, help="per arm and round")
    ap.add_argument("--warmup-s", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--paced-gap-us", type=int, default=1000,
                    help="the paced regime's sleep between a stream's events (0: no paced)")
    ap.add_argument("--reference-rate", type=int, default=2400,
                    help="events/s at which each mode's share of one core is reported")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-s", type=float, default=2.0)
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "results" / "relay-cost.json"))
    args = ap.parse_args(argv)

    if args.child == "upstream":
        upstream_child(args.port)
        return 0
    if args.child == "gateway":
        gateway_child(args.mode, args.upstream, args.port, args.profile_to)
        return 0

    try:
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    command = shlex.join([sys.executable, *sys.argv])
    machine = _machine()
    tmp = tempfile.mkdtemp(prefix="relay-cost-")
    up = Child("--child", "upstream")
    up.wait_ready()
    gws = {m: Child("--child", "gateway", "--mode", m, "--upstream", up.url,
                    "--profile-to", os.path.join(tmp, f"{m}.prof")) for m in MODES}
    regimes = {"burst": 0} | ({"paced": args.paced_gap_us} if args.paced_gap_us else {})
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        r: {a: [] for a in ARMS} for r in regimes}
    profile: dict[str, Any] = {}
    try:
        for g in gws.values():
            g.wait_ready()
        for rnd in range(args.rounds):
            for regime, gap in regimes.items():
                order = ARMS[rnd % len(ARMS):] + ARMS[:rnd % len(ARMS)]
                for arm in order:
                    gw = gws.get(arm)
                    row = measure(gw or up, gw, up, args.concurrency, args.tokens, gap,
                                  args.duration_s, args.warmup_s)
                    row["round"] = rnd
                    results[regime][arm].append(row)
                    print(f"[relay-cost] round {rnd} {regime:<6} {arm:<10} "
                          f"{row['events_per_s']:>9.0f} ev/s  gateway "
                          f"{row.get('gateway_cpu_us_per_event', float('nan')):.1f} us/ev",
                          file=sys.stderr, flush=True)
        for regime, gap in ({} if args.no_profile else regimes).items():
            profile[regime] = {}
            for m, g in gws.items():
                path = os.path.join(tmp, f"{m}.prof")
                row = measure(g, g, up, args.concurrency, args.tokens, gap, args.profile_s,
                              args.warmup_s, profiled=True)
                deadline = time.monotonic() + 30
                while not os.path.exists(path) and time.monotonic() < deadline:
                    time.sleep(0.05)
                summary = profile_summary(path, row["token_events"], args.profile_top)
                os.unlink(path)
                summary["events_per_s_under_profiler"] = row["events_per_s"]
                summary["gateway_cpu_us_per_event_under_profiler"] = row[
                    "gateway_cpu_us_per_event"]
                profile[regime][m] = summary
    finally:
        for g in gws.values():
            g.stop()
        up.stop()
        for f in Path(tmp).glob("*"):
            f.unlink()
        os.rmdir(tmp)

    def arm_summary(regime: str) -> dict[str, Any]:
        return {a: summarize(results[regime][a], a != "direct") for a in ARMS}

    reg = {r: arm_summary(r) for r in regimes}
    rate = args.reference_rate
    for r in reg.values():
        base = r["strict"]["gateway_cpu_us_per_event"]
        for m in MODES:
            us = r[m]["gateway_cpu_us_per_event"]
            r[m]["extra_us_per_event_vs_strict"] = round(us - base, 2)
            r[m][f"core_share_at_{rate}_events_per_s"] = round(us * rate / 1e6, 4)

    def headline(r: dict[str, Any]) -> dict[str, Any]:
        keys = ("events_per_s", "gateway_cpu_us_per_event", "gateway_core_share",
                "one_core_cap_events_per_s", "extra_us_per_event_vs_strict",
                f"core_share_at_{rate}_events_per_s")
        return {**{m: {k: r[m][k] for k in keys} for m in MODES},
                "direct_events_per_s": r["direct"]["events_per_s"]}

    head = reg["burst"]
    out: dict[str, Any] = {
        "benchmark": "relay_cost",
        "machine": machine,
        "python": sys.version.split()[0],
        "packages": _versions(),
        "command": command,
        "settings": {"concurrency": args.concurrency, "tokens": args.tokens,
                     "duration_s": args.duration_s, "warmup_s": args.warmup_s,
                     "rounds": args.rounds, "paced_gap_us": args.paced_gap_us,
                     "headline_regime": "burst", "health_interval_s": 0,
                     "updates": 0, "reference_rate_events_per_s": rate},
        **headline(head),
        **({"paced": headline(reg["paced"])} if "paced" in reg else {}),
        "regimes": reg,
        "profile": profile,
        "profile_note": ("cProfile over the gateway's event-loop thread for one window of "
                         "--profile-s per regime and mode (after the timed rounds, warmed "
                         "up first), divided by the window's token events; cProfile inflates "
                         "every call, the small ones most: read the shares and the ratios "
                         "between modes. cProfile labels dict.get on these events "
                         "'ConvertingDict.get' (a logging.config subclass): it is dict.get"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(_table(out))
    print(f"\nwritten {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
