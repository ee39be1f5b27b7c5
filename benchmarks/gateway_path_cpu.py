"""The verified transition in process and through the gateway, on the CPU, phase by phase.

Why. On the H200 (``docs/gpu-results.md``, run 16) the 8B-shaped verified
transition costs 1.107x vLLM's bare calls in process and 1.359x through the
gateway; the gateway's "controller" share is 5.0 ms against 0.7 ms, not
located. This benchmark reproduces the two paths with an engine that costs
(almost) nothing, so what is left is RolloutCore's own time, and splits the
gateway's extra time into where it goes.

The engine. The stand-in of ``benchmarks/hot_path_cpu.py``: vLLM 0.26's
routes (results/gpu/h200-8b-ipc.json) behind ``httpx.MockTransport``,
the workers' result row written at ``/finish_weight_update``, the workers'
checksum answered at ``collective_rpc``; the Qwen3-8B layout (399 tensors,
dims / ``--scale``); the trainer's ``CudaIpcTransport`` over ``PackedWeights``
in host memory, checksums precomputed at staging. Its own time is measured
and subtracted. One engine, shared by both paths, as on the H200.

The two paths, alternated transition by transition (the order alternates too):

* ``inprocess``: ``EngineSession`` (journal on disk) ``runner.run_update``,
  ``min_verification=engine-checksum`` (the transport's early check reads the
  workers' row), as the harness's hot cycle;
* ``gateway``: the real app (``create_app``) served by uvicorn on loopback,
  from a thread of this process (the H200 harness's ``serve_in_thread``;
  httptools protocol with ``serve``'s deadlines), over its own ``VllmAdapter``
  (no transport: the trainer sends) and a journal on disk as ``serve
  --journal`` has it; ``RolloutCoreClient(transport=the same transport,
  connected_to=engine)`` is the trainer: begin, send, report with the sent
  checksum; the gateway compares it with the workers' (``collective_rpc``).

Instrumentation (here, never in ``src``): ``time.perf_counter_ns`` around
the client's round trips and its request building / answer parsing; around
the app (first byte handed to it to the last byte of its answer); its body
read, ``parse_body`` (strict pydantic), answer building (``_json``); every
``anyio.to_thread.run_sync`` split into the hop to the worker thread, the
work, and the hop back to the loop; the runner's ``open_update``,
``report_transfer``, ``close_update``; the effect workers' hops (submit ->
start, end -> the supervisor awake); the journal's ``sync``, batch writes
and fsyncs; the lease machine's shell. ``--profile N`` adds a cProfile of N
gateway transitions (all threads: ``threading.setprofile``) to the JSON.

``--before-ref REF`` (default ``main``) also measures REF's ``src`` (``git
archive`` into a temporary directory, in a subprocess), alternating with this
tree's, so before and after are side by side in one run::

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/gateway_path_cpu.py [--reps 40]

writes results/gateway-path-cpu.json and prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "diagnostics" / "gpu"))
TOKEN = "gateway-path-cpu-0123456789abcdef"


# ---------------------------------------------------------------------- spans

class Spans:
    """Per-transition sums of named spans (ns) and counts; thread-safe enough (GIL)."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.n: dict[str, int] = defaultdict(int)
        self.on = False

    def add(self, name: str, ns: int) -> None:
        if self.on:
            self.ns[name] += ns
            self.n[name] += 1

    def reset(self) -> None:
        self.ns.clear()
        self.n.clear()

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        ms = {k: v / 1e6 for k, v in self.ns.items()}
        n = dict(self.n)
        self.reset()
        return ms, n


S = Spans()
_now = time.perf_counter_ns
#: cProfile per thread context (--profile): one profiler per context, never shared.
PROFILES: dict[str, Any] = {}
PROFILING = [False]


@contextlib.contextmanager
def _profiled(ctx: str) -> Iterator[None]:
    if not PROFILING[0]:
        yield
        return
    import cProfile

    p = PROFILES.setdefault(ctx, cProfile.Profile())
    p.enable()
    try:
        yield
    finally:
        p.disable()


def _wrap(owner: Any, name: str, span: str) -> None:
    """Time ``owner.name`` (a sync function) as ``span``; absent: nothing."""
    fn = getattr(owner, name, None)
    if fn is None:
        return

    def timed(*a: Any, **k: Any) -> Any:
        t = _now()
        try:
            return fn(*a, **k)
        finally:
            S.add(span, _now() - t)

    setattr(owner, name, timed)


def _wrap_async(owner: Any, name: str, span: str) -> None:
    fn = getattr(owner, name, None)
    if fn is None:
        return

    async def timed(*a: Any, **k: Any) -> Any:
        t = _now()
        try:
            return await fn(*a, **k)
        finally:
            S.add(span, _now() - t)

    setattr(owner, name, timed)


def instrument() -> None:
    """Patch the timing wrappers in (this process only)."""
    import anyio.to_thread
    import httpx

    import rolloutcore.service.app as app_mod
    from rolloutcore.control import effects
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.control.shell import Shell
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.service.control import UpdateManager

    _wrap(RolloutCoreClient, "_call", "client.rpc")
    real_json = httpx.Response.json

    def rjson(self: Any, **kw: Any) -> Any:
        t = _now()
        try:
            return real_json(self, **kw)
        finally:
            if self.request.url.path.startswith("/control/"):
                S.add("client.decode", _now() - t)

    httpx.Response.json = rjson  # type: ignore[method-assign]
    real_init = RolloutCoreClient.__init__

    def init(self: Any, *a: Any, **k: Any) -> None:
        real_init(self, *a, **k)
        _wrap(self._http, "build_request", "client.encode")  # this client's only

    RolloutCoreClient.__init__ = init  # type: ignore[method-assign]
    _wrap(RolloutCoreClient, "_sent_checksum_body", "client.sent_checksum")
    _wrap(app_mod, "parse_body", "gw.parse_validate")
    _wrap(app_mod, "_json", "gw.answer_build")
    _wrap_async(app_mod, "control_body", "gw.body_read")
    _wrap_async(UpdateManager, "begin", "gw.begin_handler")
    _wrap_async(UpdateManager, "report", "gw.report_handler")
    for m, span in (("open_update", "runner.open"), ("report_transfer", "runner.report"),
                    ("close_update", "runner.close"), ("run_update", "runner.run_update")):
        _wrap(LifecycleRunner, m, span)
    _wrap(Journal, "sync", "journal.sync")
    real_wp = Journal._write_pending

    def write_pending(self: Any) -> None:
        # Counts: a batch written (one write + one flush, + fsync with --fsync), and by
        # whom: the writer thread (a thread woken on the side) or a sync's caller.
        t, before = _now(), self._written
        try:
            real_wp(self)
        finally:
            if self._written != before:
                who = "writer" if threading.current_thread() is self._writer else "sync"
                S.add(f"journal.batch_by_{who}", _now() - t)

    Journal._write_pending = write_pending  # type: ignore[method-assign]
    import concurrent.futures

    real_submit_pool = concurrent.futures.ThreadPoolExecutor.submit

    def pool_submit(self: Any, fn: Any, /, *a: Any, **k: Any) -> Any:
        S.add("side_pool.submit", 0)  # a hop to the adapter's side threads
        return real_submit_pool(self, fn, *a, **k)

    concurrent.futures.ThreadPoolExecutor.submit = pool_submit  # type: ignore[method-assign]
    from starlette.requests import Request

    import rolloutcore.service.control as control_mod

    for m in ("_grant", "_observe", "_check_begin"):
        _wrap(UpdateManager, m, f"gw.loop.{m}")
    for m in ("describe", "move"):
        _wrap(control_mod._Update, m, f"gw.loop.{m}")
    _wrap(control_mod, "check_rank_declaration", "gw.loop.check_rank_declaration")
    _wrap(control_mod, "worker_shards", "gw.loop.worker_shards")
    _wrap_async(Request, "is_disconnected", "gw.loop.is_disconnected")
    from rolloutcore.engine.port import VllmAdapter

    _wrap(VllmAdapter, "check_sent", "gw.loop.check_sent")
    _wrap(Shell, "run", "shell.run")
    # --guarded: the lend and the take-back, in a worker thread (before: after the drain,
    # before the close), or on the loop (Lender: the lend beside the drain). Timed once
    # each: a Lender's call (which calls the module's function) where there is one.
    import inspect

    from rolloutcore.engine import lent_key

    if hasattr(lent_key, "Lender"):
        for m in ("lend", "revoke"):
            sync = not inspect.iscoroutinefunction(getattr(lent_key.Lender, m))
            (_wrap if sync else _wrap_async)(lent_key.Lender, m, f"gw.lent_key.{m}")
    else:
        _wrap(lent_key, "lend", "gw.lent_key.lend")
        _wrap(lent_key, "revoke", "gw.lent_key.revoke")
    from rolloutcore.service.proxy import DataPlane

    _wrap(DataPlane, "_wake", "gw.loop_woken_by_data_plane")  # on the loop, once woken
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        t = _now()
        real_fsync(fd)
        S.add("journal.fsync", _now() - t)

    os.fsync = fsync  # type: ignore[assignment]

    real_run_sync = anyio.to_thread.run_sync

    async def run_sync(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        marks: dict[str, int] = {}

        def inner() -> Any:
            marks["start"] = _now()
            try:
                with _profiled("gateway: anyio worker thread"):
                    return fn(*args)
            finally:
                marks["end"] = _now()

        t = _now()
        try:
            return await real_run_sync(inner, **kw)
        finally:
            back = _now()
            if "start" in marks:
                S.add("gw.hop_to_thread", marks["start"] - t)
                S.add("gw.in_thread", marks["end"] - marks["start"])
                S.add("gw.hop_back_to_loop", back - marks["end"])

    anyio.to_thread.run_sync = run_sync  # type: ignore[assignment]

    real_submit = effects.EffectWorkers.submit
    ends: dict[int, int] = {}
    tokens: dict[int, object] = {}

    def submit(self: Any, name: str, fn: Callable[[], Any]) -> Any:
        t = _now()
        token = object()

        def inner() -> Any:
            start = _now()
            S.add("effects.hop_in", start - t)
            try:
                with _profiled("effect workers"):
                    return fn()
            finally:
                ends[id(token)] = _now()

        job = real_submit(self, name, inner)
        tokens[id(job)] = token
        return job

    real_wait = effects.Job.wait

    def wait(self: Any, timeout_s: float) -> bool:
        ok = real_wait(self, timeout_s)
        token = tokens.pop(id(self), None)
        end = None if token is None else ends.pop(id(token), None)
        if end is not None:
            S.add("effects.hop_out", _now() - end)
        return ok

    effects.Job.wait = wait  # type: ignore[method-assign]
    effects.EffectWorkers.submit = submit  # type: ignore[method-assign]


class TimedApp:
    """The ASGI app, timed from its call to the last byte of its answer (per request)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t = _now()

        async def timed_send(msg: Any) -> None:
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body"):
                S.add("gw.app", _now() - t)
                S.add(f"gw.app {scope['method']} {_route(scope['path'])}", _now() - t)

        with _profiled("gateway: event loop (app)"):
            await self.app(scope, receive, timed_send)


def _route(path: str) -> str:
    parts = path.split("/")
    return "/".join("{id}" if p.isdigit() else p for p in parts)


@contextlib.contextmanager
def serve_in_thread(app: Any) -> Iterator[str]:
    """``app`` under uvicorn (httptools + ``serve``'s deadlines) on loopback, in a thread."""
    import uvicorn

    from rolloutcore.service.server import http_protocol

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, proxy_headers=False,
        timeout_graceful_shutdown=5, http=http_protocol(10.0, 30.0)))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                          name="gateway-uvicorn")
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()


# ---------------------------------------------------------------------- one side

def _record_of(journal: Any) -> Any:
    """The runner's ``record=`` as ``control.stack.wire`` gives it on that side's tree
    (``journal.defer`` where the journal has it, else ``journal.write``)."""
    return getattr(journal, "defer", journal.write)


_GUARD = """
import socket, uvicorn
from rolloutcore.transports.engine_key import RouteGuard

async def nothing(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 404, "headers": []})
        await send({"type": "http.response.body", "body": b""})

s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
uvicorn.Server(uvicorn.Config(RouteGuard(nothing), log_level="warning", lifespan="off",
                              access_log=False, http="httptools")).run(sockets=[s])
"""


@contextlib.contextmanager
def guarded_engine() -> Iterator[str]:
    """A launched engine's lending half (``--guarded``): ``RouteGuard`` served by uvicorn
    in a process of its own (as vLLM's API server is: its time is not this process's),
    its key held by this process, so the gateway lends a route key at each begin and
    takes it back at each report (``engine.lent_key``), as for an engine it launched.
    Only the lending route is served there; the engine's other routes stay the
    stand-in's (``MockTransport``, which ignores the host)."""
    from rolloutcore.transports import engine_key

    key = engine_key.new_key()
    proc = subprocess.Popen([sys.executable, "-c", _GUARD], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, engine_key.ENV: key})
    try:
        assert proc.stdout is not None
        url = f"http://127.0.0.1:{int(proc.stdout.readline())}"
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the guard did not start") from None
                time.sleep(0.02)
        engine_key.register(url, key)
        try:
            yield url
        finally:
            engine_key.forget(url)
    finally:
        proc.terminate()
        proc.wait(10)


def _measure(reps: int, scale: int, warmup: int, fsync: bool, profile: int,
             guarded: bool = False, pause_ms: float = 0.0) -> dict[str, Any]:
    from ipc_standin import BASE, StandIn, build

    import rolloutcore
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import open_controller, read_journal
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.core.evidence import CacheKind
    from rolloutcore.core.versions import VerificationLevel, WeightIdentity
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service import ServiceConfig, create_app
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.session import EngineSession

    instrument()
    eng: dict[str, Any] = {"ns": 0, "calls": 0}
    lock = threading.Lock()

    def on_call(ns: int, cpu_s: float) -> None:
        with lock:
            eng["ns"] += ns
            eng["calls"] += 1
        S.add("engine.standin", ns)

    si = build(scale, on_call)
    pk, contents, values, tr, source = si.pk, si.contents, si.values, si.transport, si.source
    names = [e.name for e in pk.entries]
    mock, base, deadlines, identity = si.mock, BASE, si.deadlines, si.identity
    stack = contextlib.ExitStack()
    # --guarded: the gateway's upstream is the guard's loopback URL (it lends and takes
    # back there); the trainer's transport and the in-process side stay on the stand-in.
    gw_base = base
    if guarded:
        gw_base = stack.enter_context(guarded_engine())
    handler = mock.handler

    def pause(req: Any) -> Any:
        if req.url.path == "/rolloutcore/pause":
            # A launched engine's guard pauses through its own fast route: the
            # stand-in's ``/pause`` (no 20 ms sleep to leave out here).
            req.url = req.url.copy_with(path="/pause")
        if req.url.path == "/pause" and pause_ms > 0:
            # --pause-ms: the engine's own pause, a wait (no core, no GIL), counted as
            # the stand-in's time as its other calls are.
            t = _now()
            time.sleep(pause_ms / 1e3)
            with lock:
                eng["ns"] += _now() - t
        return handler(req)

    mock.handler = pause
    tmp = Path(tempfile.mkdtemp(prefix="gateway-path-cpu-"))
    # In process: the session, its journal on disk.
    session = EngineSession(VllmHTTP(base, transport=mock, timeout_s=120), tr,
                            engine_epoch="bench-epoch", journal_path=tmp / "inprocess.jsonl",
                            deadlines=deadlines)
    if fsync:
        session.journal._fsync = True
    # Prefix cache only, as the H200 harness's controller (vLLM 0.26 has no other reset).
    session.controller = LifecycleController(listener=session.journal.listener,
                                             required_caches=(CacheKind.PREFIX,))
    session.runner = LifecycleRunner(session.controller, session.vllm, deadlines,
                                     record=_record_of(session.journal))
    session.vllm.stage(source, provenance=StandIn.provenance(1))
    session.runner.bootstrap(identity(1))
    # The gateway: serve --journal's controller and journal, its own adapter (no transport).
    controller, journal = open_controller(tmp / "gateway.jsonl", keep=256,
                                           required_caches=(CacheKind.PREFIX,))
    if fsync:
        journal._fsync = True
    gw_adapter = VllmAdapter(VllmHTTP(gw_base, transport=mock, timeout_s=120), None,
                             engine_epoch="bench-epoch")
    gw_runner = LifecycleRunner(controller, gw_adapter, deadlines, record=_record_of(journal))
    gw_runner.bootstrap(identity(1))
    cfg = ServiceConfig(upstream_url=gw_base, engine_url=base, control_token=TOKEN,
                        transport={"backend": "rc_cuda_ipc"}, health_interval_s=0,
                        min_verification="engine-checksum",
                        reachable_verification=VerificationLevel.ENGINE_CHECKSUM)
    app = create_app(gw_runner, cfg)
    threads0 = [0]
    orig_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        threads0[0] += 1
        orig_start(self)

    threading.Thread.start = counting_start  # type: ignore[method-assign]

    runs: list[dict[str, Any]] = []
    prof_stats: dict[str, str] | None = None
    with stack, serve_in_thread(TimedApp(app)) as url, \
            RolloutCoreClient(url, TOKEN, transport=tr, connected_to=base,
                              begin_timeout_s=300, report_timeout_s=300) as rc:

        def prepare(seed: int) -> WeightIdentity:
            pk.buffer.copy_(contents[seed])       # the trainer's step
            tr.precompute_checksum(pk, values=values[seed])  # at staging, as on the H200
            return identity(seed)

        def one(path: str, i: int, prof: Any = None) -> dict[str, Any]:
            seed = 2 if si.engine["seed"] == 1 else 1
            ident = prepare(seed)
            if path == "inprocess":
                session.vllm.stage(source, provenance=ident.provenance)
            si.engine["seed"] = seed
            e0, c0, th0 = eng["ns"], eng["calls"], threads0[0]
            S.reset()
            S.on = True
            if prof is not None:
                prof.enable()
            t0 = _now()
            cpu0 = time.process_time()
            if path == "inprocess":
                o = session.runner.run_update(
                    ident, min_verification=VerificationLevel.ENGINE_CHECKSUM)
                wall = (_now() - t0) / 1e6
                cpu = (time.process_time() - cpu0) * 1e3
                phases = {k: v * 1e3 for k, v in o.breakdown().items()}
                client_s: dict[str, float] = {}
                level = "engine-checksum" if o.published is not None else None
                ok_ = o.published is not None and tr.last_check.get("passed") and \
                    tr.last_check.get("via") == "ipc"
            else:
                res = rc.update(source, ident.provenance, identity=ident, probe=False,
                                min_verification="engine-checksum", owner="bench")
                wall = (_now() - t0) / 1e6
                cpu = (time.process_time() - cpu0) * 1e3
                phases = {k: v * 1e3 for k, v in res.phases.items()}
                client_s = {k: v * 1e3 for k, v in res.client_s.items()}
                level = res.verification
                ok_ = res.published is not None and level == "engine-checksum"
            if prof is not None:
                prof.disable()
            S.on = False
            spans, counts = S.take()
            if not ok_:
                raise RuntimeError(f"{path} transition {i} not verified: {level}")
            return {"path": path, "i": i, "wall_ms": wall, "cpu_ms": cpu,
                    "engine_standin_ms": (eng["ns"] - e0) / 1e6,
                    "engine_calls": eng["calls"] - c0,
                    "threads_started": threads0[0] - th0, "phases_ms": phases,
                    "client_ms": client_s, "spans_ms": spans, "span_counts": counts,
                    "verification": level}

        for i in range(warmup + reps):
            order = ("inprocess", "gateway") if i % 2 == 0 else ("gateway", "inprocess")
            for path in order:
                r = one(path, i)
                r["warmup"] = i < warmup
                runs.append(r)
        if profile:
            import cProfile
            import io
            import pstats

            PROFILING[0] = True
            main_prof = PROFILES.setdefault("trainer (client) thread", cProfile.Profile())
            for i in range(profile):
                one("gateway", 10_000 + i, main_prof)
            PROFILING[0] = False
            prof_stats = {}
            for ctx, prof in PROFILES.items():
                buf = io.StringIO()
                st = pstats.Stats(prof, stream=buf).sort_stats(os.environ.get("GP_SORT",
                                                                              "tottime"))
                st.print_stats(int(os.environ.get("GP_N", "25")))
                prof_stats[ctx] = buf.getvalue()
    threading.Thread.start = orig_start  # type: ignore[method-assign]
    # Durability: every transition's records are on disk (read back, gap-free).
    session.close()
    journal.close()
    gw_records = read_journal(tmp / "gateway.jsonl")
    in_records = read_journal(tmp / "inprocess.jsonl")
    return {"rolloutcore": str(Path(rolloutcore.__file__).parent), "tensors": len(names),
            "buffer_bytes": int(pk.buffer.numel()), "reps": reps, "warmup": warmup,
            "fsync": fsync, "guarded": guarded, "pause_ms": pause_ms, "runs": runs,
            "profile": prof_stats,
            "journal_records": {"gateway": len(gw_records), "inprocess": len(in_records)}}


# ---------------------------------------------------------------------- summary

#: The gateway's extra time, in the order a transition meets it.
PARTS = (
    ("client: request building (JSON encode) + answer parsing", ("client.encode",
                                                                 "client.decode")),
    ("HTTP on loopback: httpx send/recv + uvicorn/httptools, outside the app", ("http",)),
    ("gateway: body read", ("gw.body_read",)),
    ("gateway: parse + validate (strict pydantic)", ("gw.parse_validate",)),
    ("gateway: handler on the loop (lock, lease machine, checks, describe)", ("gw.loop",)),
    ("gateway: hop to the worker thread (anyio)", ("gw.hop_to_thread",)),
    ("gateway: hop back to the event loop (anyio)", ("gw.hop_back_to_loop",)),
    ("gateway: answer building (JSON encode)", ("gw.answer_build",)),
    ("gateway: app outside the handlers (routing, auth)", ("gw.app_other",)),
)


#: Per-transition counts (medians): round trips, thread hops, journal writes.
COUNTS = (
    ("HTTP round trips to the gateway", "client.rpc"),
    ("engine calls", "engine.standin"),
    ("hops to an anyio worker thread (and back)", "gw.hop_to_thread"),
    ("hops to an effect worker (and back)", "effects.hop_in"),
    ("hops to the adapter's side threads", "side_pool.submit"),
    ("journal syncs (calls)", "journal.sync"),
    ("journal batches written by a sync (write+flush)", "journal.batch_by_sync"),
    ("journal batches written by the writer thread (a wake)", "journal.batch_by_writer"),
    ("fsyncs", "journal.fsync"),
)


def _derive(r: dict[str, Any]) -> dict[str, float]:
    """Per-transition derived spans (ms)."""
    s = dict(r["spans_ms"])
    get = s.get
    d: dict[str, float] = {}
    d["wall"] = r["wall_ms"]
    d["engine_standin"] = r["engine_standin_ms"]
    d["cpu"] = r["cpu_ms"]
    d["rolloutcore"] = r["wall_ms"] - r["engine_standin_ms"]
    ph = r["phases_ms"]
    d["controller_overhead_reported"] = ph.get("controller_overhead", 0.0)
    d["effects"] = sum(ph.get(k, 0.0) for k in ("pause", "preflight", "transfer",
                                                "invalidate", "validate", "resume",
                                                "validate_live"))
    d["effects_hop"] = get("effects.hop_in", 0.0) + get("effects.hop_out", 0.0)
    d["journal_sync"] = get("journal.sync", 0.0)
    d["journal_fsync"] = get("journal.fsync", 0.0)
    d["runner"] = (get("runner.run_update", 0.0) if r["path"] == "inprocess" else
                   get("runner.open", 0.0) + get("runner.close", 0.0) + get("runner.report", 0.0))
    if r["path"] == "gateway":
        rpc = get("client.rpc", 0.0)
        app = get("gw.app", 0.0)
        d["client_rpcs"] = r["span_counts"].get("client.rpc", 0)
        d["http"] = rpc - app - get("client.encode", 0.0) - get("client.decode", 0.0)
        d["client.encode"] = get("client.encode", 0.0)
        d["client.decode"] = get("client.decode", 0.0)
        for k in ("gw.body_read", "gw.parse_validate", "gw.hop_to_thread",
                  "gw.hop_back_to_loop", "gw.answer_build", "shell.run",
                  "gw.lent_key.lend", "gw.lent_key.revoke"):
            d[k] = get(k, 0.0)
        for k in [k for k in s if k.startswith("gw.loop.")]:
            d[k] = get(k, 0.0)
        handlers = get("gw.begin_handler", 0.0) + get("gw.report_handler", 0.0)
        hops = get("gw.hop_to_thread", 0.0) + get("gw.hop_back_to_loop", 0.0)
        d["gw.loop"] = handlers - hops - get("gw.in_thread", 0.0)
        d["gw.app_other"] = app - handlers - get("gw.body_read", 0.0) - \
            get("gw.parse_validate", 0.0) - get("gw.answer_build", 0.0)
        d["gw.in_thread"] = get("gw.in_thread", 0.0)
        # The trainer's work between the begin's answer and the report (not gateway time):
        d["client.transfer"] = r["client_ms"].get("transfer", 0.0)
        d["client.other"] = r["wall_ms"] - rpc - d["client.transfer"]
        d["gateway_extra_total"] = sum(d[k] for _, ks in PARTS for k in ks)
        d["outside_runner_and_transfer"] = r["wall_ms"] - d["runner"] - d["client.transfer"]
    else:
        d["outside_runner_and_transfer"] = r["wall_ms"] - d["runner"]
    d["runner_without_transfer"] = d["runner"] - ph.get("transfer", 0.0) if \
        r["path"] == "inprocess" else d["runner"]
    return d


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path in ("inprocess", "gateway"):
        rs = [_derive(r) for r in runs if r["path"] == path and not r.get("warmup")]
        keys = sorted({k for d in rs for k in d})
        out[path] = {k: statistics.median(d.get(k, 0.0) for d in rs) for k in keys}
        raw = [r for r in runs if r["path"] == path and not r.get("warmup")]
        out[path]["threads_started"] = statistics.median(r["threads_started"] for r in raw)
        out[path]["engine_calls"] = statistics.median(r["engine_calls"] for r in raw)
        out[path]["phases_ms"] = {k: statistics.median(r["phases_ms"].get(k, 0.0) for r in raw)
                                  for k in sorted({k for r in raw for k in r["phases_ms"]})}
        out[path]["span_counts"] = {k: statistics.median(r["span_counts"].get(k, 0)
                                                         for r in raw)
                                    for k in sorted({k for r in raw for k in r["span_counts"]})}
    for path in ("inprocess", "gateway"):
        sc = out[path]["span_counts"]
        out[path]["counts"] = {label: sc.get(k, 0) for label, k in COUNTS}
    # Paired: each gateway transition against the in-process one next to it.
    pairs = []
    ins = [r for r in runs if r["path"] == "inprocess" and not r.get("warmup")]
    gws = [r for r in runs if r["path"] == "gateway" and not r.get("warmup")]
    for a, b in zip(ins, gws, strict=False):
        pairs.append((b["wall_ms"] - b["engine_standin_ms"]) /
                     max(1e-9, a["wall_ms"] - a["engine_standin_ms"]))
    out["service_over_inprocess_rolloutcore_paired_median"] = statistics.median(pairs)
    out["service_over_inprocess_wall"] = out["gateway"]["wall"] / out["inprocess"]["wall"]
    out["service_over_inprocess_cpu"] = out["gateway"]["cpu"] / out["inprocess"]["cpu"]
    out["service_over_inprocess_rolloutcore"] = (out["gateway"]["rolloutcore"]
                                                 / out["inprocess"]["rolloutcore"])
    out["gateway_extra_ms"] = out["gateway"]["rolloutcore"] - out["inprocess"]["rolloutcore"]
    return out


def _side(src: Path, a: argparse.Namespace) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--child", f.name, "--reps", str(a.reps), "--scale",
               str(a.scale), "--warmup", str(a.warmup), "--profile", str(a.profile)]
        if a.fsync:
            cmd.append("--fsync")
        if a.guarded:
            cmd.append("--guarded")
        cmd += ["--pause-ms", str(a.pause_ms)]
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if r.returncode:
            raise SystemExit(f"side {src} failed:\n{r.stdout}\n{r.stderr}")
        return json.loads(Path(f.name).read_text())  # type: ignore[no-any-return]


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=40, help="transitions per path per round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--scale", type=int, default=64, help="divide every dimension by this")
    ap.add_argument("--rounds", type=int, default=3, help="before/after alternations")
    ap.add_argument("--before-ref", default="main", help="'' : this tree only")
    ap.add_argument("--fsync", action="store_true", help="journals fsync every batch")
    ap.add_argument("--guarded", action="store_true",
                    help="a launched engine: the gateway lends a route key and takes it back")
    ap.add_argument("--pause-ms", type=float, default=0.0,
                    help="the stand-in's pause waits this long (the H100's drain+pause: 2.6)")
    ap.add_argument("--profile", type=int, default=0, help="cProfile N gateway transitions")
    ap.add_argument("--raw", action="store_true",
                    help="also write every transition's spans (runs: ~1.5 MB)")
    ap.add_argument("--out", default=str(ROOT / "results" / "gateway-path-cpu.json"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = _measure(a.reps, a.scale, a.warmup, a.fsync, a.profile, a.guarded, a.pause_ms)
        Path(a.child).write_text(json.dumps(res))
        return 0
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "src"))
    sides: dict[str, Path] = {"after": ROOT / "src"}
    runs: dict[str, list[dict[str, Any]]] = {"after": []}
    ref = None
    with tempfile.TemporaryDirectory() as tmp:
        if a.before_ref:
            ref = _git("rev-parse", a.before_ref)
            arch = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True,
                                  capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", tmp], input=arch, check=True)
            sides = {"before": Path(tmp) / "src", **sides}
            runs = {"before": [], **runs}
        for rnd in range(a.rounds):  # alternate: the machine's load drifts
            for name in (list(sides) if rnd % 2 == 0 else list(reversed(sides))):
                runs[name].append(_side(sides[name], a))
                print(f"round {rnd} {name}: done", file=sys.stderr)
    summ: dict[str, Any] = {}
    for name, rs in runs.items():
        per_round = [_summary(r["runs"]) for r in rs]
        allruns = [x for r in rs for x in r["runs"]]
        s = _summary(allruns)
        s["per_round_service_over_inprocess_rolloutcore"] = [
            p["service_over_inprocess_rolloutcore"] for p in per_round]
        s["journal_records_last_round"] = rs[-1]["journal_records"]
        summ[name] = s
    out = {
        "benchmark": "benchmarks/gateway_path_cpu.py",
        "command": "PYTHONPATH=$PWD/src .venv/bin/python benchmarks/gateway_path_cpu.py "
                   + " ".join(sys.argv[1:]),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "load_average_at_end": os.getloadavg(),
                    "note": "2 cores shared with other jobs; no GPU: noisy, medians"},
        "versions": {p: _version(p) for p in ("torch", "httpx", "uvicorn", "starlette",
                                              "anyio", "pydantic", "httptools", "uvloop")}
        | {"before": ref, "after": head + (" + uncommitted src" if dirty else "")},
        "what": __doc__.split("\n\n")[1:4],
        "reps": a.reps, "rounds": a.rounds, "scale": a.scale, "fsync": a.fsync,
        "guarded": a.guarded, "pause_ms": a.pause_ms,
        "summary": summ,
        "profile": {k: rs[-1].get("profile") for k, rs in runs.items() if rs[-1].get("profile")},
    }
    if a.raw:   # every transition's spans: ~1.5 MB for 5 rounds x 30
        out["runs"] = {k: [r["runs"] for r in rs] for k, rs in runs.items()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    _table(summ)
    print(f"wrote {a.out}")
    return 0


def _version(p: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(p)
    except PackageNotFoundError:
        return None


def _table(summ: dict[str, Any]) -> None:
    names = list(summ)
    print(f"{'median ms per transition':58s}" + "".join(f"{n:>11s}" for n in names))

    def row(label: str, f: Callable[[dict[str, Any]], float], fmt: str = "{:11.3f}") -> None:
        print(f"{label:58s}" + "".join(fmt.format(f(summ[n])) for n in names))

    row("in process: wall", lambda s: s["inprocess"]["wall"])
    row("in process: RolloutCore (wall - stand-in engine)",
        lambda s: s["inprocess"]["rolloutcore"])
    row("in process: controller_overhead (reported)",
        lambda s: s["inprocess"]["controller_overhead_reported"])
    row("in process: CPU time of the process (all threads)", lambda s: s["inprocess"]["cpu"])
    row("gateway: wall (client)", lambda s: s["gateway"]["wall"])
    row("gateway: CPU time of the process (all threads)", lambda s: s["gateway"]["cpu"])
    row("gateway: RolloutCore (wall - stand-in engine)", lambda s: s["gateway"]["rolloutcore"])
    row("gateway: controller_overhead (reported)",
        lambda s: s["gateway"]["controller_overhead_reported"])
    row("gateway: RPCs per transition", lambda s: s["gateway"]["client_rpcs"], "{:11.0f}")
    for label, ks in PARTS:
        row("  " + label[:56], lambda s, ks=ks: sum(s["gateway"].get(k, 0.0) for k in ks))
    row("  sum of the parts above", lambda s: s["gateway"]["gateway_extra_total"])
    row("gateway: route key lend (wall; beside the drain where overlapped)",
        lambda s: s["gateway"].get("gw.lent_key.lend", 0.0))
    row("gateway: route key take-back",
        lambda s: s["gateway"].get("gw.lent_key.revoke", 0.0))
    row("gateway: journal sync (in the worker thread)", lambda s: s["gateway"]["journal_sync"])
    row("in process: journal sync", lambda s: s["inprocess"]["journal_sync"])
    row("gateway: event-loop wakes by the data plane (count)",
        lambda s: s["gateway"]["span_counts"].get("gw.loop_woken_by_data_plane", 0), "{:11.0f}")
    row("gateway: effect worker hops", lambda s: s["gateway"]["effects_hop"])
    row("in process: effect worker hops", lambda s: s["inprocess"]["effects_hop"])
    row("in process: runner (run_update - transfer)",
        lambda s: s["inprocess"]["runner_without_transfer"])
    row("gateway: runner (open + report + close)",
        lambda s: s["gateway"]["runner_without_transfer"])
    row("in process: outside the runner", lambda s: s["inprocess"]["outside_runner_and_transfer"])
    row("gateway: outside the runner and the trainer's send",
        lambda s: s["gateway"]["outside_runner_and_transfer"])
    for label, _ in COUNTS:
        for path in ("inprocess", "gateway"):
            row(f"count: {path[:2]} {label}"[:58],
                lambda s, p=path, lb=label: s[p]["counts"][lb], "{:11.1f}")
    row("gateway - in process (RolloutCore)", lambda s: s["gateway_extra_ms"])
    row("service / in process (RolloutCore, medians)",
        lambda s: s["service_over_inprocess_rolloutcore"])
    row("service / in process (RolloutCore, paired median)",
        lambda s: s["service_over_inprocess_rolloutcore_paired_median"])
    row("service / in process (wall)", lambda s: s["service_over_inprocess_wall"])
    row("service / in process (CPU time)", lambda s: s["service_over_inprocess_cpu"])


if __name__ == "__main__":
    raise SystemExit(main())
