#!/usr/bin/env python3
"""Update modes side by side: none, strict, keep, recompute, on one engine (issue 20).

A closed-loop rollout workload with a long-tail length distribution
(lognormal around a median, capped; the longest 10-20x the median), one
``RolloutClient`` rollout per client at a time, ``ignore_eos``, and an
update every ``--period-s`` seconds (alternately B and A through the
engine's weight-transfer path) for each mode, in interleaved rounds on the
same engine so that the machine's load hits every mode alike:

* ``none``: no updates (the throughput every mode is compared with);
* ``strict``: drain (admission closed until the longest rollout in flight
  is done), pause(wait), transfer, resets, validation, resume, publish;
* ``keep``: pause(keep), the same transition, resume: rollouts continue
  under the new version (per-token versions recorded);
* ``recompute``: pause(abort), the transition, resume; each aborted rollout
  is resubmitted as prompt + output so far under the new version.

Measured per mode: useful tokens per second (tokens of rollouts completed
*attributable* within the window: the stitched output, never the
recomputed prefill), ``retained`` (over ``none``), the stall of each update
(admission closed: request to publish; median and max), the transition
itself (the update's time in engine and transport calls), the engine time
lost per update (``(1 - retained) * period``: what the goal compares with
the transition), recomputed tokens, the staleness histogram of completed
rollouts (published versions between a rollout's oldest token and its
completion) and its maximum. Then the cache control: a rollout kept across
a keep-mode update, then a request sharing its first two KV blocks, once
without the version salt and once with it; ``cross_version_prefix_hits_*``
are that request's prefix-cache hits (``/metrics`` delta).

CPU (this machine: tiny Llama, gloo transport, paced engine, see
``--step-sleep-s``)::

    PYTHONPATH=src python benchmarks/async_modes.py --out results/async-modes.json

The H200 harness (``diagnostics/gpu/h200_async.py``) drives the same
phases (``run_phase``, ``cache_control``, ``summarize``) on vLLM 0.26 with
8B shapes and ``rc_cuda_ipc``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from rolloutcore.control.async_modes import Rollout, RolloutClient, RolloutStatus  # noqa: E402
from rolloutcore.control.controller import LifecycleController  # noqa: E402
from rolloutcore.control.journal import Journal  # noqa: E402
from rolloutcore.control.runner import LifecycleRunner, UpdateOutcome  # noqa: E402
from rolloutcore.core.records import UpdateMode  # noqa: E402

__all__ = ["MODES", "Harness", "Workload", "cache_control", "format_table", "run_phase",
           "summarize"]

MODES = ("none", "strict", "keep", "recompute")


@dataclass(frozen=True)
class Workload:
    """The rollouts: lognormal lengths around ``median_tokens``, capped at ``cap_tokens``."""

    concurrency: int = 16
    median_tokens: int = 24
    sigma: float = 1.0
    cap_tokens: int = 400
    prompt_tokens: int = 32
    vocab: int = 256
    temperature: float = 0.0

    def length(self, rng: random.Random) -> int:
        return max(1, min(self.cap_tokens,
                          round(self.median_tokens * math.exp(self.sigma * rng.gauss(0, 1)))))

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(1, self.vocab) for _ in range(self.prompt_tokens)]


@dataclass
class Harness:
    """What the phases need from an engine set-up (CPU here, the H200 harness there).

    ``controller(mode, k)`` makes a bootstrapped controller and runner in
    ``mode`` on the engine's current weights; ``update(runner)`` stages the
    next weights and runs one update; ``source`` streams generations.
    """

    controller: Callable[[UpdateMode, int | None], tuple[LifecycleController, LifecycleRunner]]
    update: Callable[[LifecycleRunner], UpdateOutcome]
    source: Any
    metrics: Callable[[], float] | None = None   # prefix-cache hits so far (for the control)
    log: Callable[[str], None] = print
    #: Ends every request in flight (pause(abort) + resume), so a phase ends at once.
    abort_all: Callable[[], None] | None = None
    #: Extra sampling_params for every request (``{"detokenize": False}`` without a tokenizer).
    sampling_extra: dict[str, Any] | None = None


@dataclass
class _Phase:
    mode: str
    window: tuple[float, float] = (0.0, 0.0)
    done: list[Rollout] = field(default_factory=list)
    updates: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_phase(h: Harness, mode: str, *, workload: Workload, duration_s: float,
              warmup_s: float, period_s: float, max_staleness: int | None = None,
              seed: int = 0) -> dict[str, Any]:
    """One mode for ``warmup_s + duration_s`` seconds; rollouts completing in the window count."""
    um = UpdateMode.STRICT if mode == "none" else UpdateMode(mode)
    c, runner = h.controller(um, max_staleness)
    client = RolloutClient(c, h.source, admit_wait_s=600, update_wait_s=600,
                           read_timeout_s=600, sampling_extra=h.sampling_extra)
    ph = _Phase(mode)
    stop = threading.Event()
    t0 = time.monotonic()
    ph.window = (t0 + warmup_s, t0 + warmup_s + duration_s)

    def client_loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while not stop.is_set():
            r = client.run(workload.prompt(rng), max_tokens=workload.length(rng),
                           temperature=workload.temperature, ignore_eos=True)
            with ph.lock:
                ph.done.append(r)

    def updater() -> None:
        k = 1
        while True:
            at = ph.window[0] + k * period_s
            if at >= ph.window[1]:
                return
            if stop.wait(max(0.0, at - time.monotonic())):
                return
            t_start = time.monotonic()
            rec: dict[str, Any] = {"at": round(t_start - ph.window[0], 3), "t_start": t_start}
            try:
                out = h.update(runner)
                rec.update(ok=True, total_s=out.total_s, transition_s=out.effect_s,
                           drain_s=out.phase_s("drain"), phases=out.breakdown(),
                           t_end=time.monotonic())
            except Exception as exc:  # recorded; the phase goes on
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}",
                           total_s=getattr(getattr(exc, "outcome", None), "total_s", None))
                h.log(f"   update failed: {rec['error']}")
            ph.updates.append(rec)
            k += 1

    clients = [threading.Thread(target=client_loop, args=(i,), daemon=True)
               for i in range(workload.concurrency)]
    upd = threading.Thread(target=updater, daemon=True)
    for th in clients:
        th.start()
    if mode != "none":
        upd.start()
    time.sleep(max(0.0, ph.window[1] - time.monotonic()))
    stop.set()
    if mode != "none":
        upd.join(900)  # an update under way finishes first
    if h.abort_all is not None:
        h.abort_all()  # what is still running ended now: outside the window anyway
    for th in clients:
        th.join(900)
    sweep = runner.sweep() if mode == "keep" else None
    return _raw(ph, c, sweep, duration_s)


BIN_S = 0.1
SETTLE_S = 1.0


def token_series(rollouts: Sequence[Rollout], a: float, b: float,
                 bin_s: float = BIN_S) -> list[int]:
    """Output tokens streamed per ``bin_s`` over ``[a, b)``, from every rollout's chunks."""
    n = max(1, int((b - a) / bin_s))
    out = [0] * n
    for r in rollouts:
        for _, _, _, chunks in r.raw:
            for ch in chunks:
                i = int((ch.read_at - a) / bin_s)
                if 0 <= i < n:
                    out[i] += len(ch.token_ids)
    return out


def engine_time_lost(series: Sequence[int], a: float, updates: Sequence[dict[str, Any]],
                     bin_s: float = BIN_S, settle_s: float = SETTLE_S) -> list[float]:
    """Per update: the tokens it cost, in seconds of the phase's own steady rate.

    Each update affects ``[start, end + settle_s]`` (admission reopens at
    the end; the clients need a moment to fill the engine again); the
    baseline is the median rate of the bins no update touches. Measured
    inside one phase, so a change of the machine's load between phases
    does not enter it.
    """
    spans = [(u["t_start"], u["t_end"] + settle_s) for u in updates if u.get("t_end")]
    def hit(i: int) -> bool:
        t0, t1 = a + i * bin_s, a + (i + 1) * bin_s
        return any(t0 < e and t1 > s for s, e in spans)
    free = [x for i, x in enumerate(series) if not hit(i)]
    if not free or not spans:
        return []
    base = statistics.median(free)
    if base <= 0:
        return []
    out = []
    for s, e in spans:
        lost = sum(base - x for i, x in enumerate(series)
                   if a + i * bin_s < e and a + (i + 1) * bin_s > s)
        out.append(max(0.0, lost * bin_s / base))
    return out


def _raw(ph: _Phase, c: LifecycleController, sweep: bool | None,
         duration_s: float) -> dict[str, Any]:
    a, b = ph.window
    inside = [r for r in ph.done if a <= r.completed_mono <= b]
    ok = [r for r in inside if r.status is RolloutStatus.COMPLETED and r.attributable]
    hist = Counter(r.staleness or 0 for r in ok)
    return {
        "mode": ph.mode, "window_s": duration_s, "tokens": sum(len(r.token_ids) for r in ok),
        "rollouts": len(ok), "lengths": [len(r.token_ids) for r in ok],
        "unattributable": sum(r.status is RolloutStatus.COMPLETED and not r.attributable
                              for r in inside),
        "over_bound": sum(r.status is RolloutStatus.OVER_BOUND for r in inside),
        "failed": sum(r.status is RolloutStatus.FAILED for r in inside),
        "errors": sorted({r.error or "" for r in inside if r.status is RolloutStatus.FAILED})[:5],
        "recomputed_tokens": sum(r.recomputed_tokens for r in inside),
        "derived_disagrees": sum(r.derived_agrees is False for r in ok),
        "staleness": {str(k): v for k, v in sorted(hist.items())},
        "updates": ph.updates, "sweep": sweep, "state_after": c.state.value,
        "lost_s": engine_time_lost(token_series(ph.done, a, b), a, ph.updates),
    }


def cache_control(h: Harness, *, prompt_tokens: int, kept_tokens: int,
                  seed: int = 1) -> dict[str, Any]:
    """Prefix-cache hits of a request after a keep update, sharing a kept rollout's blocks.

    The kept rollout's prompt is ``prompt_tokens`` long (at least two KV
    blocks); the request after the update repeats it plus a short tail. Its
    hits can only be blocks the kept rollout computed under the old version.
    """
    assert h.metrics is not None
    out: dict[str, Any] = {}
    rng = random.Random(seed)
    for salted in (False, True):
        c, runner = h.controller(UpdateMode.KEEP, None)
        client = RolloutClient(c, h.source, salt=salted, unsafe_unsalted=not salted,
                               update_wait_s=600, read_timeout_s=600,
                               sampling_extra=h.sampling_extra)
        p = [rng.randrange(1, 200) for _ in range(prompt_tokens)]
        box: dict[str, Rollout] = {}

        def kept(client: RolloutClient = client, p: list[int] = p,
                 box: dict[str, Rollout] = box) -> None:
            box["k"] = client.run(p, max_tokens=kept_tokens, ignore_eos=True)

        th = threading.Thread(target=kept, daemon=True)
        th.start()
        deadline = time.monotonic() + 120
        while th.is_alive() and not any(v >= 2 for v in client.in_flight().values()):
            if time.monotonic() > deadline:
                raise RuntimeError("the kept rollout never started")
            time.sleep(0.005)
        # Kept across the update, or (on a fast engine) already done: its blocks are the
        # old version's either way, and a keep update does not reset the prefix cache.
        kept_across = th.is_alive()
        h.update(runner)
        before = h.metrics()
        r = client.run([*p, 3, 5, 7], max_tokens=8, ignore_eos=True)
        hits = h.metrics() - before
        th.join(600)
        out["salted" if salted else "unsalted"] = {
            "hits": hits, "kept_status": box["k"].status.value if "k" in box else None,
            "kept_across_the_update": kept_across, "request_status": r.status.value,
            "kept_error": box["k"].error if "k" in box else None}
    return out


def summarize(raw: Sequence[dict[str, Any]], *, period_s: float,
              concurrency: int, modes: Sequence[str] = MODES) -> dict[str, Any]:
    """Per mode: the keys results/async-modes.json promises, from every round's phases."""
    by: dict[str, list[dict[str, Any]]] = {}
    for p in raw:
        by.setdefault(p["mode"], []).append(p)
    out: dict[str, Any] = {}
    for mode in modes:
        ps = by.get(mode, [])
        if not ps:
            continue
        window = sum(p["window_s"] for p in ps)
        tokens = sum(p["tokens"] for p in ps)
        ups = [u for p in ps for u in p["updates"]]
        stalls = [u["total_s"] for u in ups if u.get("ok")]
        trans = [u["transition_s"] for u in ups if u.get("ok")]
        hist: Counter[str] = Counter()
        for p in ps:
            hist.update(p["staleness"])
        lens = [n for p in ps for n in p["lengths"]]
        lost = [x for p in ps for x in p.get("lost_s", ())]
        out[mode] = {
            "tokens_per_s": tokens / window if window else 0.0,
            "retained": None,
            "stall_median_s": statistics.median(stalls) if stalls else 0.0,
            "stall_max_s": max(stalls) if stalls else 0.0,
            "transition_median_s": statistics.median(trans) if trans else 0.0,
            "recomputed_tokens": sum(p["recomputed_tokens"] for p in ps),
            "max_staleness_seen": max((int(k) for k in hist), default=0),
            "staleness_histogram": dict(sorted(hist.items())),
            "updates": len(ups), "updates_failed": sum(not u.get("ok") for u in ups),
            "rollouts": sum(p["rollouts"] for p in ps),
            "unattributable": sum(p["unattributable"] for p in ps),
            "over_bound": sum(p["over_bound"] for p in ps),
            "failed": sum(p["failed"] for p in ps),
            "derived_disagrees": sum(p["derived_disagrees"] for p in ps),
            "window_s": window, "tokens": tokens,
            "length_median": statistics.median(lens) if lens else None,
            "length_max": max(lens) if lens else None,
            "per_phase_tokens_per_s": [p["tokens"] / p["window_s"] for p in ps],
        }
        if mode != "none":
            m = out[mode]
            m["lost_s_per_update"] = statistics.median(lost) if lost else None
            m["lost_s_per_update_max"] = max(lost) if lost else None
            tr = m["stall_median_s"]
            m["lost_within_2x_transition"] = (None if not lost or not tr
                                              else m["lost_s_per_update"] <= 2 * tr)
    base = out.get("none", {}).get("tokens_per_s")
    for m in out.values():
        if base:
            m["retained"] = m["tokens_per_s"] / base
    out["update_period_s"] = period_s
    out["concurrency"] = concurrency
    return out


def format_table(s: dict[str, Any]) -> str:
    rows = [("mode", "tok/s", "retained", "stall med s", "stall max s", "transition s",
             "lost s/update", "recomputed", "max stale")]
    for mode in MODES:
        m = s.get(mode)
        if not m:
            continue
        rows.append((mode, f"{m['tokens_per_s']:.0f}",
                     "-" if m["retained"] is None else f"{m['retained']:.3f}",
                     f"{m['stall_median_s']:.3f}", f"{m['stall_max_s']:.3f}",
                     f"{m['transition_median_s']:.3f}",
                     "-" if m.get("lost_s_per_update") is None
                     else f"{m['lost_s_per_update']:.3f}",
                     str(m["recomputed_tokens"]), str(m["max_staleness_seen"])))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    if "cross_version_prefix_hits_salted" in s:
        lines.append(f"cross-version prefix hits: unsalted "
                     f"{s['cross_version_prefix_hits_unsalted']:g}, salted "
                     f"{s['cross_version_prefix_hits_salted']:g}")
    return "\n".join(lines)


def plan_rounds(modes: Sequence[str], rounds: int) -> list[str]:
    """Interleaved order, rotated each round, so load drifts hit every mode alike."""
    out: list[str] = []
    for r in range(rounds):
        k = r % len(modes)
        out += list(modes[k:]) + list(modes[:k])
    return out


# --------------------------------------------------------------------------- CPU harness

@dataclass
class CpuEngine:
    """One paced CPU vLLM on checkpoint A (B beside it), with the in-process harness.

    ``async_modes_service.py`` runs its gateway phases on the same engine and
    the same transport, so the two paths are measured side by side.
    """

    engine: Any
    checkpoints: dict[str, Path]
    ids: dict[str, Any]
    state: dict[str, str]
    http: Any
    transport: Any
    adapter: Any
    streams: Any
    harness: Harness

    def close(self) -> None:
        self.adapter.close()
        self.streams.close()
        self.engine.stop()


def cpu_engine(args: argparse.Namespace) -> CpuEngine:
    """Start the engine (``--workdir``, ``--step-sleep-s``) and build the harness."""
    from rolloutcore.control.runner import Deadlines
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.session import identity_of
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource

    work = Path(args.workdir or f"/tmp/rc-async-bench-{os.getpid()}")
    ck = {n: work / n for n in ("A", "B")}
    if not (ck["A"] / "config.json").exists():
        make_checkpoint(ck["A"], 1)
        make_checkpoint(ck["B"], 2)
    extra = ["--enforce-eager", "--enable-prompt-tokens-details"]
    env: dict[str, str] = {}
    if args.step_sleep_s > 0:
        here = str(REPO / "tests" / "engine")
        env = {"PYTHONPATH": os.pathsep.join([here, str(REPO / "src"),
                                              os.environ.get("PYTHONPATH", "")]),
               "ROLLOUTCORE_TEST_STEP_SLEEP_S": str(args.step_sleep_s)}
        extra += ["--logits-processors", "slowstep:SlowStep"]
    eng = ManagedEngine(ck["A"], extra_args=extra, env=env, log_dir=work / "logs",
                        startup_timeout_s=900)
    print(f"starting vLLM ({' '.join(extra)}) ...", flush=True)
    eng.start()
    print(f"engine healthy in {eng.last_start_s:.1f}s", flush=True)
    ids = {n: identity_of(WeightSource.from_checkpoint(p), Provenance(str(p)))
           for n, p in ck.items()}
    state = {"serving": "A"}
    http = VllmHTTP(eng.base_url, timeout_s=120)
    transport = GlooTransport(op_timeout_s=60)
    adapter = VllmAdapter(http, transport, engine_epoch=eng.epoch)
    dl = Deadlines(drain_s=300, pause_s=120, transfer_s=120, reset_s=30, validate_s=60,
                   resume_s=30)

    def controller(mode: UpdateMode, k: int | None) -> tuple[LifecycleController,
                                                             LifecycleRunner]:
        from rolloutcore.core.lifecycle_state import ControllerConfig

        j = Journal(keep=64)
        c = LifecycleController(config=ControllerConfig(update_mode=mode, max_staleness=k),
                                listener=j.listener)
        r = LifecycleRunner(c, adapter, dl, record=j.write)
        r.bootstrap(ids[state["serving"]])
        return c, r

    def update(runner: LifecycleRunner) -> UpdateOutcome:
        nxt = "B" if state["serving"] == "A" else "A"
        adapter.stage(WeightSource.from_checkpoint(ck[nxt]))
        out = runner.run_update(ids[nxt])
        state["serving"] = nxt
        return out

    def hits() -> float:
        from rolloutcore.engine.wire import PREFIX_HITS

        return http.metrics().get(PREFIX_HITS) or 0.0

    def abort_all() -> None:
        from rolloutcore.core.evidence import PauseMode

        http.pause(PauseMode.ABORT)
        http.resume()

    # The rollouts' streams on a client of their own: a step's watchdog shuts down
    # every connection of the adapter's client (VllmHTTP.cancel_inflight).
    streams = VllmHTTP(eng.base_url, timeout_s=120)
    h = Harness(controller, update, streams, hits, lambda m: print(m, flush=True), abort_all)
    return CpuEngine(eng, ck, ids, state, http, transport, adapter, streams, h)


def machine_and_versions() -> dict[str, Any]:
    import vllm

    return {"machine": {"host": platform.node(), "cpus": os.cpu_count(),
                        "load_avg_at_end": os.getloadavg(),
                        "python": platform.python_version()},
            "versions": {"vllm": vllm.__version__, "engine": "vLLM CPU, tiny Llama (2 layers, "
                         "hidden 128, vocab 259), gloo transport (rolloutcore_gloo)"}}


def _cpu(args: argparse.Namespace) -> int:
    t_run = time.monotonic()
    ce = cpu_engine(args)
    h = ce.harness
    workload = Workload(args.concurrency, args.median_tokens, args.sigma, args.cap_tokens,
                        args.prompt_tokens)
    raw: list[dict[str, Any]] = []
    try:
        for i, mode in enumerate(plan_rounds(MODES, args.rounds)):
            print(f"[{time.monotonic() - t_run:6.1f}s] phase {i + 1}: {mode}", flush=True)
            p = run_phase(h, mode, workload=workload, duration_s=args.phase_s,
                          warmup_s=args.warmup_s, period_s=args.period_s,
                          max_staleness=args.max_staleness, seed=i)
            print(f"   {p['tokens'] / p['window_s']:.0f} tok/s, {p['rollouts']} rollouts, "
                  f"{len(p['updates'])} updates, recomputed {p['recomputed_tokens']}, "
                  f"failed {p['failed']}", flush=True)
            raw.append(p)
        print(f"[{time.monotonic() - t_run:6.1f}s] cache control", flush=True)
        cache = cache_control(h, prompt_tokens=300, kept_tokens=200)
    finally:
        ce.close()
    s = summarize(raw, period_s=args.period_s, concurrency=args.concurrency)
    s["cross_version_prefix_hits_salted"] = cache["salted"]["hits"]
    s["cross_version_prefix_hits_unsalted"] = cache["unsalted"]["hits"]
    s["cache_control"] = cache
    s.update(machine_and_versions())
    s["workload"] = {**asdict(workload), "phase_s": args.phase_s, "warmup_s": args.warmup_s,
                     "rounds": args.rounds, "max_staleness": args.max_staleness,
                     "step_sleep_s": args.step_sleep_s}
    s["command"] = " ".join([sys.executable, *sys.argv])
    s["wall_s"] = round(time.monotonic() - t_run, 1)
    s["phases"] = raw
    print(format_table(s), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(s, indent=1, sort_keys=True, default=str) + "\n")
    print(f"wrote {out}")
    return 0


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The engine and workload options (shared with ``async_modes_service.py``)."""
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--median-tokens", type=int, default=24)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap-tokens", type=int, default=400)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--period-s", type=float, default=5.0)
    ap.add_argument("--phase-s", type=float, default=12.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--step-sleep-s", type=float, default=0.002,
                    help="pace the CPU engine (tests/engine/slowstep.py) so that its API "
                         "server keeps up on a 2-core machine; 0: unpaced")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/async-modes.json")
    add_workload_args(ap)
    args = ap.parse_args(argv)
    return _cpu(args)


if __name__ == "__main__":
    sys.exit(main())
