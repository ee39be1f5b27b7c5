#!/usr/bin/env python3
"""H200: the update modes side by side on vLLM 0.26, Qwen3-8B shapes, ``rc_cuda_ipc`` (issue 20).

One device call (under 9 minutes with the engine start): the engine is
started as ``h200_8b_ipc.py`` starts it (``--load-format dummy
--skip-tokenizer-init``, ``rc_cuda_ipc``, its worker extension), but with
CUDA graphs (no ``--enforce-eager``), since the modes are compared on
decode throughput. The trainer holds its Qwen3-8B-shaped bf16 weights in one
``PackedWeights`` buffer on the same GPU; each update refills it with the
next seed's values (while the engine serves) and runs RolloutCore's whole
transition (``LifecycleRunner`` + ``VllmAdapter``: pause in the mode's way,
the transfer, the prefix reset where the mode does it, the workers'
checksum of what was installed, resume, publish). Then, as on the CPU
(``benchmarks/async_modes.py``, whose ``run_phase``, ``cache_control`` and
``summarize`` run here unchanged), 64 closed-loop clients with lognormal
lengths (median 128, cap 2048, ``ignore_eos``) and an update every 5 s, for
``none``, ``strict``, ``keep`` and ``recompute``, then the cache control.
Then the service path (#29): the same workload through a gateway process
(``benchmarks/async_modes_service.py``'s ``Gateway`` and ``service_phase``)
over the same engine, each update through the trainer protocol with the same
CUDA IPC transport, for ``none``, ``keep`` and ``recompute``: the keys
``service_none``, ``service_keep``, ``service_recompute`` (``retained``
over ``service_none``).

vLLM 0.26 has no ``weight_version`` and no per-token ``weight_versions``:
per-token versions are derived from the stream and the update's resume
instant (``control.async_modes``; ``source: stream`` in the records), and
its stream of an aborted request just ends (no finish event), which the
recompute path reads as the abort it is.

Writes ``$OUT/async-modes.json`` (the keys of ``results/async-modes.json``)
and ``run.log`` lines on stdout. ``--plan`` prints what would run and the
time it needs against the call's budget, without a GPU: it is what the
CPU tests run. The lead runs it (the carry of vLLM 0.26 is in
``README.md`` here), e.g.::

    python3 diagnostics/gpu/h200_async.py --out $OUT
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import async_modes as bench  # noqa: E402  (benchmarks/async_modes.py)
import async_modes_service as svc  # noqa: E402  (benchmarks/async_modes_service.py)

BUDGET_S = 540.0          # one device call: 10 minutes at most; this stays under 9
ENGINE_START_S = 85.0     # measured: 84 s with torch.compile and CUDA graphs (VLLM-FACTS)
SETUP_S = 25.0            # trainer buffer fill, connect, the first (mapping) update
END_S = 15.0              # abort + resume per phase, stop
GATEWAY_START_S = 8.0     # a gateway process per service phase (imports, bootstrap)
#: The service-path phases (#29): the same workload through a gateway process and the
#: trainer protocol. vLLM 0.26's keep ignores clear_cache, so no engine_recompute here.
SERVICE_MODES = ("none", "keep", "recompute")


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What runs, and how long it needs, computed the same way the run paces itself."""
    order = bench.plan_rounds(bench.MODES, args.rounds)
    phase_s = args.warmup_s + args.phase_s + 2.0
    cache_s = 40.0 if args.cache_control else 0.0
    service = list(SERVICE_MODES) if args.service else []
    total = (ENGINE_START_S + SETUP_S + len(order) * phase_s + cache_s + END_S
             + len(service) * (args.warmup_s + args.service_phase_s + 2.0 + GATEWAY_START_S))
    return {"phases": order, "service_phases": service,
            "service_phase_s": args.service_phase_s, "phase_s": args.phase_s,
            "warmup_s": args.warmup_s,
            "updates_per_phase": int(args.phase_s // args.period_s),
            "period_s": args.period_s, "concurrency": args.concurrency,
            "lengths": {"median": args.median_tokens, "sigma": args.sigma,
                        "cap": args.cap_tokens, "prompt": args.prompt_tokens},
            "estimated_s": round(total, 1), "budget_s": BUDGET_S,
            "fits": total <= BUDGET_S}


def _versions() -> dict[str, Any]:
    import torch

    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda}
    try:
        import vllm

        v["vllm"] = vllm.__version__
    except Exception as exc:  # recorded, not fatal here
        v["vllm"] = f"import failed: {exc}"
    with contextlib.suppress(Exception):
        v["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    import hashlib

    h = hashlib.sha256()
    for f in sorted([*(REPO / "src" / "rolloutcore").rglob("*.py"), Path(__file__),
                     REPO / "benchmarks" / "async_modes.py"]):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    v["tree_sha256"] = h.hexdigest()
    return v


def run(args: argparse.Namespace) -> int:
    import torch
    from qwen3_shapes import QWEN3_8B, qwen3_specs

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import Deadlines, LifecycleRunner, UpdateOutcome
    from rolloutcore.core.evidence import CacheKind, PauseMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.core.records import UpdateMode
    from rolloutcore.core.versions import (
        ParameterManifest,
        Provenance,
        VerificationLevel,
        WeightIdentity,
    )
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.wire import PREFIX_HITS
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.transports.cuda_ipc import (
        BACKEND,
        WORKER_EXTENSION,
        CudaIpcTransport,
        PackedWeights,
    )
    from rolloutcore.transports.source import WeightSource

    t_run = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_run:7.1f}s] {msg}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    R: dict[str, Any] = {"plan": plan(args), "versions": _versions(), "errors": {},
                         "command": " ".join([sys.executable, *sys.argv])}
    log(json.dumps(R["plan"]))

    def save(name: str = "async-modes.partial.json") -> None:
        with contextlib.suppress(Exception):
            (out_dir / name).write_text(json.dumps(R, indent=1, sort_keys=True, default=str))

    model_dir = Path("/tmp/rc-qwen3-8b")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_8B, indent=1))
    specs = qwen3_specs(QWEN3_8B)
    packed = PackedWeights([(n, s, torch.bfloat16) for n, s in specs], device="cuda:0")
    transport = CudaIpcTransport(mode="fast")
    transport.adopt(packed)

    g = torch.Generator(device=packed.device).manual_seed(1)
    with torch.no_grad():
        for name, t in packed.items():
            (t.normal_(1.0, 0.05, generator=g) if "norm" in name
             else t.normal_(0.0, 0.02, generator=g))
    torch.cuda.synchronize()

    def flip() -> None:
        """The next policy: every weight negated (one pass over the buffer, ~10 ms), so
        that each update really changes all 16 GB while costing the GPU little."""
        with torch.no_grad():  # the buffer is bytes; every tensor in it is bf16
            packed.buffer.view(torch.bfloat16).neg_()
        torch.cuda.synchronize()

    extra = ["--load-format", "dummy", "--skip-tokenizer-init",
             "--gpu-memory-utilization", str(args.gpu_util),
             "--worker-extension-cls", WORKER_EXTENSION]
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"}
    engine = ManagedEngine(model_dir, backend=BACKEND, scale_out=False, max_model_len=4096,
                           extra_args=extra, env=env, log_dir=Path("/tmp/rc-engine-logs"),
                           startup_timeout_s=420, stop_grace_s=10)
    engine.start()
    R["cold_start_s"] = engine.last_start_s
    R["engine_command"] = " ".join(engine.command())
    log(f"engine healthy in {engine.last_start_s:.1f}s")
    http = VllmHTTP(engine.base_url, timeout_s=120)
    # The rollouts' streams on a client of their own (a step's watchdog shuts down every
    # connection of the adapter's client).
    streams = VllmHTTP(engine.base_url, timeout_s=120)
    try:
        transport.connect(engine.base_url, timeout_s=120)
        adapter = VllmAdapter(http, transport, engine_epoch=engine.epoch)
        source = WeightSource.from_state_dict(dict(packed.items()),
                                              description="trainer PackedWeights views")
        man = ParameterManifest.from_items((e.name, e.shape, e.dtype) for e in packed.entries)
        state = {"seed": 1}

        def identity(seed: int) -> WeightIdentity:
            sign = "" if seed == 1 else "-negated"
            return WeightIdentity.declare(man, Provenance(f"synthetic-qwen3-8b-seed1{sign}",
                                                          "h200-async", seed))

        dl = Deadlines(drain_s=300, pause_s=120, transfer_s=120, reset_s=30, validate_s=60,
                       resume_s=30)

        def controller(mode: UpdateMode, k: int | None) -> tuple[LifecycleController,
                                                                 LifecycleRunner]:
            j = Journal(keep=64)
            c = LifecycleController(config=ControllerConfig(update_mode=mode, max_staleness=k),
                                    required_caches=(CacheKind.PREFIX,), listener=j.listener)
            r = LifecycleRunner(c, adapter, dl, record=j.write)
            adapter.stage(source, provenance=identity(state["seed"]).provenance)
            r.bootstrap(identity(state["seed"]))
            return c, r

        def update(runner: LifecycleRunner) -> UpdateOutcome:
            nxt = 2 if state["seed"] == 1 else 1
            flip()  # the trainer's next policy, made while the engine serves
            adapter.stage(source, provenance=identity(nxt).provenance)
            transport.precompute_checksum(packed)
            o = runner.run_update(identity(nxt),
                                  min_verification=VerificationLevel.ENGINE_CHECKSUM)
            state["seed"] = nxt
            return o

        def hits() -> float:
            return http.metrics().get(PREFIX_HITS) or 0.0

        def service_update(rc: Any) -> Any:
            """One update through the trainer protocol: the trainer's next policy, sent
            by the same CUDA IPC transport, verified at engine-checksum as in process."""
            nxt = 2 if state["seed"] == 1 else 1
            flip()
            transport.precompute_checksum(packed)
            res = rc.update(source, identity(nxt).provenance, identity=identity(nxt),
                            probe=False, min_verification="engine-checksum",
                            owner="h200-async-service")
            state["seed"] = nxt
            return res

        def abort_all() -> None:
            http.pause(PauseMode.ABORT)
            http.resume()

        h = bench.Harness(controller, update, streams, hits, log, abort_all,
                          {"detokenize": False})
        _, r0 = controller(UpdateMode.STRICT, None)
        t = time.monotonic()
        update(r0)  # the first transfer maps the IPC handle and builds the slice plan
        R["first_update_s"] = round(time.monotonic() - t, 3)
        work = bench.Workload(args.concurrency, args.median_tokens, args.sigma,
                              args.cap_tokens, args.prompt_tokens, vocab=150000)
        raw: list[dict[str, Any]] = []
        for i, mode in enumerate(R["plan"]["phases"]):
            log(f"phase {i + 1}: {mode}")
            try:
                p = bench.run_phase(h, mode, workload=work, duration_s=args.phase_s,
                                    warmup_s=args.warmup_s, period_s=args.period_s,
                                    max_staleness=args.max_staleness, seed=i)
            except Exception as exc:
                R["errors"][f"phase:{mode}"] = f"{type(exc).__name__}: {exc}"
                log(f"!! phase {mode} failed: {exc}")
                continue
            raw.append(p)
            log(f"   {p['tokens'] / p['window_s']:.0f} tok/s, {len(p['updates'])} updates, "
                f"recomputed {p['recomputed_tokens']}, failed {p['failed']}")
            R["raw_so_far"] = raw
            save()
        summary = bench.summarize(raw, period_s=args.period_s, concurrency=args.concurrency)
        R.update(summary)
        if args.cache_control:
            try:
                cache = bench.cache_control(h, prompt_tokens=320, kept_tokens=512)
                R["cross_version_prefix_hits_salted"] = cache["salted"]["hits"]
                R["cross_version_prefix_hits_unsalted"] = cache["unsalted"]["hits"]
                R["cache_control"] = cache
            except Exception as exc:
                R["errors"]["cache_control"] = f"{type(exc).__name__}: {exc}"
        if args.service:
            service_phases(R, args, log, svc.ServiceHarness(
                start_gateway=lambda mode, k, salted=True: svc.Gateway(
                    engine.base_url, engine.epoch, identity(state["seed"]), mode, k,
                    out_dir, salted=salted, min_verification="engine-checksum",
                    transport={"backend": BACKEND}, required_caches=("prefix",)),
                update=lambda rc: service_update(rc),
                client=lambda url: RolloutCoreClient(url, svc.TOKEN, transport=transport,
                                                     connected_to=engine.base_url,
                                                     begin_timeout_s=300,
                                                     report_timeout_s=300),
                sampling_extra={"detokenize": False}, metrics=hits,
                model=http.model()), work)
        R["goals"] = {
            "keep_retains_0.88": (R.get("keep") or {}).get("retained", 0) >= 0.88,
            "recompute_retains_0.85": (R.get("recompute") or {}).get("retained", 0) >= 0.85,
            "salted_hits_0": R.get("cross_version_prefix_hits_salted") == 0}
        R["phases"] = raw
        R.pop("raw_so_far", None)
        R["device"] = torch.cuda.get_device_name(0)
        R["machine"] = {"host": platform.node(), "cpus": os.cpu_count()}
        R["wall_s"] = round(time.monotonic() - t_run, 1)
        print(bench.format_table(R), flush=True)
    except Exception as exc:
        R["errors"]["run"] = f"{type(exc).__name__}: {exc}"
        log(f"!! {exc}")
    finally:
        http.close()
        streams.close()
        with contextlib.suppress(Exception):
            transport.close()
        engine.stop()
        (out_dir / "async-modes.json").write_text(
            json.dumps(R, indent=1, sort_keys=True, default=str) + "\n")
        log(f"wrote {out_dir / 'async-modes.json'}")
    return 0 if not R["errors"] else 1


def service_phases(R: dict[str, Any], args: argparse.Namespace, log: Any,
                   sh: Any, work: Any) -> None:
    """The service path's phases: ``service_none`` (its own baseline), ``service_keep``
    and ``service_recompute``, each with ``retained`` over ``service_none``."""
    raw: list[dict[str, Any]] = []
    for i, mode in enumerate(SERVICE_MODES):
        log(f"service phase {i + 1}: {mode}")
        try:
            p = svc.service_phase(sh, mode, workload=work, duration_s=args.service_phase_s,
                                  warmup_s=args.warmup_s, period_s=args.period_s,
                                  max_staleness=args.max_staleness, seed=100 + i)
        except Exception as exc:
            R["errors"][f"service:{mode}"] = f"{type(exc).__name__}: {exc}"
            log(f"!! service phase {mode} failed: {exc}")
            continue
        raw.append(p)
        log(f"   {p['tokens'] / p['window_s']:.0f} tok/s, {len(p['updates'])} updates, "
            f"recomputed {p['recomputed_tokens']}, failed {p['failed']}, "
            f"unattributable {p['unattributable']}")
    s = bench.summarize(raw, period_s=args.period_s, concurrency=args.concurrency,
                        modes=SERVICE_MODES)
    for mode in SERVICE_MODES:
        if mode in s:
            R[f"service_{mode}"] = s[mode]
    R["service_phases"] = raw
    base = (R.get("none") or {}).get("tokens_per_s")
    if base and "none" in s:
        R["service_none_over_inprocess_none"] = s["none"]["tokens_per_s"] / base


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--plan", action="store_true",
                    help="print the plan and its time against the budget; run nothing")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--median-tokens", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap-tokens", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--period-s", type=float, default=5.0)
    ap.add_argument("--phase-s", type=float, default=50.0)
    ap.add_argument("--service-phase-s", type=float, default=30.0,
                    help="each service-path phase (none, keep, recompute)")
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--no-cache-control", dest="cache_control", action="store_false")
    ap.add_argument("--no-service", dest="service", action="store_false",
                    help="skip the service-path phases (a gateway process, #29)")
    args = ap.parse_args(argv)
    for name in ("concurrency", "median_tokens", "cap_tokens", "prompt_tokens", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("period_s", "phase_s", "service_phase_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if args.median_tokens > args.cap_tokens or args.prompt_tokens + args.cap_tokens > 4096:
        ap.error("median <= cap, and prompt + cap <= max_model_len (4096)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    p = plan(args)
    if args.plan:
        print(json.dumps(p, indent=1))
        return 0 if p["fits"] else 2
    if not p["fits"]:
        print(f"the plan needs ~{p['estimated_s']}s, over the {BUDGET_S:g}s of one call: "
              "shorten --phase-s or --rounds", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
