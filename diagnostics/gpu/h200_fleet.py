#!/usr/bin/env python3
"""H200: a fleet of two vLLM engines on one GPU, one CUDA IPC fan-out (issue 31).

One device call (under 9 minutes): the trainer holds its Qwen3-8B-shaped
bf16 weights (16 GB) in ONE ``PackedWeights`` buffer on the GPU and writes
them once as a checkpoint; two engines on the one H200, each with
``--gpu-memory-utilization`` about 0.3, start from it as ``h200_async.py``
starts one (``--skip-tokenizer-init``, ``rc_cuda_ipc`` and its worker
extension, CUDA graphs), and both engines' workers map the trainer's one
buffer; the fleet coordinator (``fleet.placement.vllm_replica`` per engine,
each with its own ``CudaIpcTransport`` adopting that buffer) and the fleet
gateway in front (``fleet.gateway.create_fleet_app``, uvicorn). Then:

1. ``sync``: transitions with no load, each series ``--reps`` + 1 rounds
   (round 0 maps the handle; medians over the rest): one engine alone (a
   one-replica fleet); the two engines as two one-replica fleets updated at
   once (``independent_parallel``); the fleet, synchronous, one fan-out
   (``transports.cuda_ipc.fanout.CudaIpcFanout``: one staging, one trainer
   checksum, both engines' sessions at once, each engine's workers' checksum
   compared); the fleet, synchronous, two sequential per-engine sends.
   Every update changes all 16 GB (the buffer negated in place) and is
   verified at ``engine-checksum`` (the workers' block checksum of what each
   engine wrote against the trainer's of what it sent).
2. ``rolling``: 64 closed-loop streaming clients through the fleet gateway,
   lognormal lengths (median 128, cap 2048, ``ignore_eos``); a steady window,
   then ``--rolls`` rolling updates (one engine per wave, ``min_serving`` 1):
   tokens per second inside each wave over the steady rate, failed requests.
3. ``async``: the same clients for ``--phase-s`` per mode (``none``, then
   ``keep`` and ``recompute``: every replica's controller in that mode), one
   synchronous fan-out update every ``--period-s``; ``retained`` = useful
   tokens per second over ``none``'s.
4. ``death``: one engine SIGKILLed under load: time to its fencing, answers
   it gave after its death (must be 0), its restart by its recoverer and its
   verified rejoin on the fleet's current version (the retained weights,
   checked at engine-checksum), with the time each took; a cold start for
   the ratio.

Writes ``$OUT/fleet.json`` (keys ``fanout_over_single``,
``fanout_over_independent_parallel``, ``rolling_retained_min``,
``rolling_failed_any``, ``fence_after_death_s``, ``rejoin_after_death_s``,
``served_by_dead_replica``, ``keep_retained``, ``recompute_retained``, with
``machine``, ``versions``, ``command``, every round under ``detail``),
``$OUT/fleet.png`` (the versions each replica served, and tokens per second,
through the run), and ``run.log`` lines on stdout; each stage records its own
error and the run goes on.

``--plan`` prints the plan and its time against the call's budget (no GPU,
no vLLM: the fast lane's test runs it). ``--cpu-selftest`` runs every stage
on this machine instead: two CPU vLLM engines on the tiny checkpoints, a
``GlooTransport`` per replica and ``GlooFanout``, short phases, so that the
harness's own code has run before it spends device time::

    python3 diagnostics/gpu/h200_fleet.py --plan
    PYTHONPATH=src python3 diagnostics/gpu/h200_fleet.py --cpu-selftest --out /tmp/fleet-cpu
    python3 diagnostics/gpu/h200_fleet.py --out $OUT          # on the H200 (README.md here)

``--ray`` places the two engines as Ray actors in one placement group
(``fleet.placement.place_ray``, a bundle ``{"CPU": 1, "GPU": 0.5}`` each, the
same engine arguments), the stages then run on the ``RayEngine`` handles and
``fleet.json`` records ``placement: "ray"`` with the version, the bundles and
each engine's node; ``--plan --ray`` lists the device calls (ray carried by
``prepare_carry.sh`` with ``RAY=1``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import random
import re
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BUDGET_S = 540.0          # one device call: 10 minutes at most; this stays under 9
ENGINE_START_S = 66.0     # one engine, eager, from a 16 GB checkpoint in the page cache
SETUP_S = 60.0            # buffer fill, checkpoint write (16 GB), connect, first updates
UPDATE_S = 0.6            # one verified transition, generous (53.8 ms measured alone)
GATEWAY_S = 6.0           # a coordinator's takeover of both engines and the gateway
END_S = 20.0              # stop both engines, the plot, the JSON
TOKEN = "h200-fleet-token-0123456789abcdef"
# --ray: the engines as Ray actors (fleet.placement.place_ray), ray carried as its own
# pieces (prepare_carry.sh with RAY=1: ray 2.60.0, 79.3 MB, and four small wheels).
RAY_VERSION = "2.60.0"
RAY_PIECES = 2            # .carry/ray-piece-00, -01 (52 MB pieces); the last travels with
#                           the last vLLM piece (9 + 28 MB): one device call more in all
RAY_INSTALL_S = 20.0      # joining, checking and installing them, in the harness's call
RAY_START_S = 15.0        # a local Ray cluster, the placement group, two actors
RAY_DEADLINE_S = 530.0    # --deadline-s under --ray: the call also installs ray first
MODES = ("none", "keep", "recompute")


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """What runs, and how long it needs, computed the same way the run paces itself."""
    rounds = args.reps + 1
    start_s = ENGINE_START_S if args.eager else ENGINE_START_S + 30.0  # graphs: 84 s
    sync_s = 4 * rounds * UPDATE_S * 2 + GATEWAY_S * 3
    rolling_s = GATEWAY_S + args.warmup_s + args.steady_s + args.rolls * (2 * UPDATE_S + 2.0)
    async_s = args.async_rounds * (len(MODES) + 1) * (GATEWAY_S + args.warmup_s + args.phase_s
                                                      + 3.0)
    # the recoverer reads the checkpoint once (its content digest), then restarts it
    death_s = (args.warmup_s + 20.0 + start_s + 10.0) if args.death else 0.0
    if args.only:   # the stages not asked for take no time
        sync_s, rolling_s, async_s, death_s = (
            t if name in args.only else 0.0 for name, t in (
                ("sync", sync_s), ("rolling", rolling_s), ("async", async_s),
                ("death", death_s)))
    ray_s = RAY_INSTALL_S + RAY_START_S if args.ray else 0.0
    total = 2 * start_s + SETUP_S + sync_s + rolling_s + async_s + death_s + END_S + ray_s
    return {"engines": 2, "gpu_util": args.gpu_util, "reps": args.reps, "rolls": args.rolls,
            "series": ["single", "independent_parallel", "fanout", "sequential"],
            "async_modes": list(MODES), "async_rounds": args.async_rounds,
            "async_order": [f"{r}:{m}" for r, m in async_order(args.async_rounds)],
            "only": args.only or ["sync", "rolling", "async", "death"],
            "phase_s": args.phase_s, "period_s": args.period_s,
            "updates_per_phase": int(args.phase_s // args.period_s),
            "steady_s": args.steady_s, "warmup_s": args.warmup_s,
            "concurrency": args.concurrency, "death": args.death,
            "lengths": {"median": args.median_tokens, "sigma": args.sigma,
                        "cap": args.cap_tokens, "prompt": args.prompt_tokens},
            "eager": args.eager,
            "stages_s": {"engines": 2 * start_s, "setup": SETUP_S, "sync": round(sync_s, 1),
                         "rolling": round(rolling_s, 1), "async": round(async_s, 1),
                         "death": round(death_s, 1), "end": END_S,
                         **({"ray": ray_s} if args.ray else {})},
            "placement": "ray" if args.ray else "processes",
            **({"ray": ray_plan(args)} if args.ray else {}),
            "estimated_s": round(total, 1), "budget_s": BUDGET_S, "fits": total <= BUDGET_S}


def ray_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What ``--ray`` does beyond the plain run, and the device calls it takes."""
    pieces = [f".carry/ray-piece-{i:02d}" for i in range(RAY_PIECES)]
    run = ("set -o pipefail; mkdir -p /tmp/rc-carry && cp .carry/piece-06 " + pieces[-1]
           + " /tmp/rc-carry/ "
           "&& bash diagnostics/gpu/install_on_device.sh && export PYTHONPATH=/tmp/site:$PWD/src "
           "PYTHONUNBUFFERED=1 && timeout 545 python3 diagnostics/gpu/h200_fleet.py --ray "
           "--out $OUT 2>&1 | tee $OUT/run.log")
    calls = [{"carry": [".carry/piece-00", ".carry/MANIFEST"],
              "command": "mkdir -p /tmp/rc-carry && cp .carry/piece-00 .carry/MANIFEST "
                         "/tmp/rc-carry/ && nvidia-smi -L"}]
    calls += [{"carry": [f".carry/piece-{i:02d}"],
               "command": f"mkdir -p /tmp/rc-carry && cp .carry/piece-{i:02d} /tmp/rc-carry/ "
                          "&& ls /tmp/rc-carry"} for i in range(1, 6)]
    calls += [{"carry": [p, ".carry/ray-MANIFEST"] if i == 0 else [p],
               "command": f"mkdir -p /tmp/rc-carry && cp {p} "
                          + (".carry/ray-MANIFEST " if i == 0 else "")
                          + "/tmp/rc-carry/ && ls /tmp/rc-carry"}
              for i, p in enumerate(pieces[:-1])]
    calls.append({"carry": [".carry/piece-06", pieces[-1]], "timeout_s": 600, "command": run})
    return {"version": RAY_VERSION, "what": (
                "a local Ray cluster on the device (place_ray: ray.init on loopback, 2 CPUs, "
                "1 GPU); one placement group (PACK), one bundle per engine; each engine a "
                "Ray actor (EngineActor) running the same ManagedEngine as the plain run "
                "(rc_cuda_ipc, its worker extension, --gpu-memory-utilization, env), started "
                "one after the other; the stages run on the RayEngine handles; the death "
                "stage's SIGKILL and restart go through RayEngine.signal_group / restart"),
            "gpus_per_engine": 0.5, "cpus_per_engine": 1.0, "strategy": "PACK",
            "bundles": [{"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}],
            "carry": {"pieces": pieces, "manifest": ".carry/ray-MANIFEST",
                      "extra_calls": len(calls) - 7, "device_calls": len(calls),
                      "made_by": "RAY=1 bash diagnostics/gpu/prepare_carry.sh"},
            "install_s": RAY_INSTALL_S, "start_s": RAY_START_S, "deadline_s": args.deadline_s,
            "calls": calls}


# --------------------------------------------------------------------------- the two rigs

@dataclass
class Rig:
    """What the stages need from a machine: engines, transports, the next weights."""

    engines: list[Any]
    make_transport: Callable[[], Any]
    make_fanout: Callable[[dict[str, Any]], Any]
    next_weights: Callable[[], Any]        # the trainer's next policy (FleetWeights)
    current: Callable[[], Any]             # the FleetWeights the engines hold now
    before_update: Callable[[Any], float]  # coordinator -> trainer checksum seconds
    recoverer: Callable[[Any], Any]        # engine -> its Recoverer (the death stage)
    controller_kw: dict[str, Any]
    vocab: int
    sampling_extra: dict[str, Any]
    model: str | None
    cold_start_s: float
    close: Callable[[], None]
    kind: str
    notes: list[str] = field(default_factory=list)
    #: the takeover's level when a coordinator is made over running engines (None:
    #: the weights' own)
    bootstrap_level: Any = None
    #: what fleet.json records of the placement ("placement", and under --ray "ray")
    record: dict[str, Any] = field(default_factory=dict)


def ray_record(placement: Any) -> dict[str, Any]:
    """The Ray placement as fleet.json records it: version, bundles, each engine's node."""
    import ray

    table = ray.util.placement_group_table(placement.placement_group)
    return {"placement": "ray", "ray": {
        "version": ray.__version__, "bundles": placement.bundles,
        "placement_group": {k: table.get(k) for k in ("placement_group_id", "state",
                                                         "strategy", "bundles",
                                                         "bundles_to_node_id")},
        "node_ids": [e.node_id for e in placement.engines],
        "cluster_resources": ray.cluster_resources()}}


def ray_close(placement: Any, record: dict[str, Any]) -> None:
    """Each engine as its actor has it at the end (a restart: new epoch, same actor), then
    the placement's shutdown (engines, actors, placement group, the local cluster)."""
    with contextlib.suppress(Exception):
        record["ray"]["engines_at_end"] = [{"node_id": e.node_id, "epoch": e.epoch,
                                            "base_url": e.base_url, "alive": e.alive()}
                                           for e in placement.engines]
    placement.shutdown()


def trainer_checkpoint(packed_weights: Any, model_dir: Path = Path("/tmp/rc-qwen3-8b-ckpt")
                       ) -> tuple[Any, Path, float]:
    """The trainer's first policy: Qwen3-8B shapes in one bf16 ``PackedWeights`` on the GPU,
    deterministic random values (seed 1), written as a checkpoint to ``model_dir``: what
    the engines start from and what a killed engine is restarted from (a real recovery
    loads real files). Returns the buffer, the directory and the seconds of the write.
    ``diagnostics/gpu/h200_lora.py`` starts its engine from it too."""
    import torch
    from qwen3_shapes import QWEN3_8B, qwen3_specs
    from safetensors.torch import save_file

    packed = packed_weights([(n, s, torch.bfloat16) for n, s in qwen3_specs(QWEN3_8B)],
                            device="cuda:0")
    g = torch.Generator(device=packed.device).manual_seed(1)
    with torch.no_grad():
        for name, t in packed.items():
            (t.normal_(1.0, 0.05, generator=g) if "norm" in name
             else t.normal_(0.0, 0.02, generator=g))
    torch.cuda.synchronize()
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(QWEN3_8B, indent=1))
    t = time.monotonic()
    save_file({n: x.to("cpu") for n, x in packed.items()}, str(model_dir / "model.safetensors"))
    return packed, model_dir, time.monotonic() - t


def gpu_rig(args: argparse.Namespace, log: Callable[[str], None]) -> Rig:
    import torch

    from rolloutcore.core.evidence import CacheKind
    from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.recovery import ManagedRecoverer
    from rolloutcore.fleet.model import FleetWeights
    from rolloutcore.session import PreparedUpdate
    from rolloutcore.transports.cuda_ipc import (
        BACKEND,
        WORKER_EXTENSION,
        CudaIpcTransport,
        PackedWeights,
    )
    from rolloutcore.transports.cuda_ipc.fanout import CudaIpcFanout
    from rolloutcore.transports.source import WeightSource

    packed, model_dir, write_s = trainer_checkpoint(PackedWeights)
    log(f"checkpoint of the trainer's buffer written in {write_s:.1f}s")
    extra = ["--skip-tokenizer-init", "--gpu-memory-utilization", str(args.gpu_util),
             "--worker-extension-cls", WORKER_EXTENSION,
             *(["--enforce-eager"] if args.eager else [])]
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"}
    engine_kw: dict[str, Any] = {"backend": BACKEND, "scale_out": False, "max_model_len": 4096,
                                 "extra_args": extra, "env": env, "stop_grace_s": 10}
    t = time.monotonic()
    placement = None
    if args.ray:
        from rolloutcore.fleet.placement import place_ray

        # One placement group, a bundle {"CPU": 1, "GPU": 0.5} per engine on this GPU; each
        # actor runs the ManagedEngine below (its log file is named by its epoch), one
        # after the other as below. place_ray stops what started if one fails.
        placement = place_ray(2, model_dir, gpus_per_engine=0.5, sequential=True,
                              startup_timeout_s=420, host="127.0.0.1",
                              log_dir=Path("/tmp/rc-engine-logs/ray"), **engine_kw)
        engines: list[Any] = list(placement.engines)
    else:
        engines = [ManagedEngine(model_dir, log_dir=Path(f"/tmp/rc-engine-logs/e{i}"),
                                 startup_timeout_s=420, **engine_kw) for i in range(2)]
    try:
        # One after the other: vLLM sizes its KV cache from what the GPU's memory did
        # while it profiled, so another engine loading at the same time takes it all
        # ("No available memory for the cache blocks", seen on the H200 on 2026-12-03).
        for e in engines if placement is None else ():
            e.start()
        record = ray_record(placement) if placement is not None else {"placement": "processes"}
    except BaseException:
        for e in engines:
            e.stop()
        if placement is not None:
            placement.shutdown()
        raise
    cold = max(e.last_start_s or 0.0 for e in engines)
    log(f"two engines healthy in {time.monotonic() - t:.1f}s, one after the other "
        f"(the slower {cold:.1f}s)")
    # vLLM 0.26 has no version labels and no /weight_checker: a replacement process is
    # verified by its workers' hash of every parameter against a cold engine's on the
    # same checkpoint (read here, before any update; without it the first H200 run's
    # recoveries had "no evidence at all" and were refused).
    ref_tr = CudaIpcTransport(mode="fast")
    try:
        reference = ref_tr.recovery_checksums(engines[1].base_url)
        agree = ref_tr.recovery_checksums(engines[0].base_url) == reference
    finally:
        ref_tr.close()
    log(f"cold engines' parameter checksums: {len(reference)} parameters, the two engines "
        + ("agree" if agree else "DIFFER"))
    source = WeightSource.from_state_dict(dict(packed.items()),
                                          description="trainer PackedWeights views")
    man = source.manifest()
    ckpt_prov = Provenance(str(model_dir), "h200-fleet", 1)
    first = WeightIdentity.declare(man, ckpt_prov)
    negated = WeightIdentity.declare(man, Provenance(str(model_dir) + " negated",
                                                     "h200-fleet", 2))
    state = {"seed": 1}
    transports: list[Any] = []

    def weights(seed: int) -> Any:
        ident = first if seed % 2 else negated
        return FleetWeights(ident, PreparedUpdate(source, ident.provenance, ident, None, None),
                            source, VerificationLevel.ENGINE_CHECKSUM)

    def next_weights() -> Any:
        with torch.no_grad():  # every weight negated: all 16 GB change, ~10 ms of GPU
            packed.buffer.view(torch.bfloat16).neg_()
        torch.cuda.synchronize()
        state["seed"] += 1
        return weights(state["seed"])

    def make_transport() -> Any:
        tr = CudaIpcTransport(mode="fast")
        tr.adopt(packed)
        transports.append(tr)
        return tr

    def before_update(coord: Any) -> float:
        fan = coord.fanout
        if isinstance(fan, CudaIpcFanout):
            return fan.precompute(packed)
        t0 = time.monotonic()
        vals = packed.checksum()
        for r in coord.replicas.values():
            r.runner.adapter.transport.precompute_checksum(packed, values=vals)
        return time.monotonic() - t0

    def recoverer(engine: Any) -> Any:
        # Its content digest reads the 16 GB once; no probe (an 8B forward on the CPU).
        return ManagedRecoverer(engine, model_dir, identity=first, probe=False,
                                start_timeout_s=420, reference=reference,
                                read_checksums=reader.recovery_checksums)

    reader = CudaIpcTransport(mode="fast")
    transports.append(reader)

    def close() -> None:
        for tr in transports:
            with contextlib.suppress(Exception):
                tr.close()
        if placement is not None:
            ray_close(placement, record)   # stops the engines, then Ray
            return
        for e in engines:
            e.stop()

    return Rig(engines, make_transport, lambda m: CudaIpcFanout(m), next_weights,
               lambda: weights(state["seed"]), before_update, recoverer,
               {"required_caches": (CacheKind.PREFIX,)}, 150000, {"detokenize": False},
               engines[0].model_name, cold, close, "h200",
               [f"the engines start from a checkpoint of the trainer's first buffer "
                f"(written in {write_s:.1f}s); a coordinator made over running engines takes "
                "them over at 'declared' (no probe of an 8B model on the CPU); every update "
                "is checked at engine-checksum on each engine"],
               VerificationLevel.DECLARED, record)


def cpu_rig(args: argparse.Namespace, log: Callable[[str], None]) -> Rig:
    from rolloutcore.engine.recovery import ManagedRecoverer
    from rolloutcore.fleet.placement import launch_local, prepare_checkpoint
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.fanout import GlooFanout
    from rolloutcore.transports.gloo import GlooTransport

    work = Path(args.out) / "cpu"
    a = make_checkpoint(work / "A", 1)
    b = make_checkpoint(work / "B", 2)
    wa, wb = prepare_checkpoint(a), prepare_checkpoint(b)
    t = time.monotonic()
    placement = None
    if args.ray:  # two CPU engines as Ray actors, one bundle {"CPU": 1} each
        from rolloutcore.fleet.placement import place_ray

        placement = place_ray(2, a, cpus_per_engine=1.0, log_dir=work / "logs",
                              startup_timeout_s=900)
        engines: list[Any] = list(placement.engines)
    else:
        engines = launch_local(2, a, log_dir=work / "logs", progress=False)
    cold = max(e.last_start_s or 0.0 for e in engines)
    log(f"two CPU engines healthy in {time.monotonic() - t:.1f}s")
    state = {"k": 0}

    def next_weights() -> Any:
        state["k"] += 1
        return wb if state["k"] % 2 else wa

    def recoverer(engine: Any) -> Any:
        return ManagedRecoverer(engine, a, identity=wa.identity, probe=True)

    def close() -> None:
        if placement is not None:
            ray_close(placement, record)   # stops the engines, then Ray
            return
        for e in engines:
            e.stop()

    record: dict[str, Any] = {"placement": "processes"}
    try:
        if placement is not None:
            record = ray_record(placement)
    except BaseException:
        close()
        raise
    return Rig(engines, lambda: GlooTransport(op_timeout_s=60),
               lambda m: GlooFanout(op_timeout_s=60), next_weights,
               lambda: wb if state["k"] % 2 else wa, lambda coord: 0.0, recoverer,
               {}, 250, {}, None, cold, close, "cpu",
               ["CPU self-test of the harness: tiny model, gloo transports; not a GPU number"],
               record=record)


# --------------------------------------------------------------------------- fleets

def make_fleet(rig: Rig, names: list[str], engines: list[Any], *, mode: str = "strict",
               max_staleness: int | None = None, journal_dir: Path | None = None,
               heal: bool = True, recover: bool = False, holds: Any = None) -> Any:
    """A bootstrapped coordinator over ``engines`` on the weights they hold now
    (``holds``: those FleetWeights; default the trainer's current ones)."""
    from rolloutcore.control.runner import Deadlines
    from rolloutcore.core.lifecycle import UpdateMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.fleet import FleetConfig, FleetCoordinator
    from rolloutcore.fleet.placement import vllm_replica

    w = holds if holds is not None else rig.current()
    if rig.bootstrap_level is not None:
        w = dataclasses.replace(w, min_verification=rig.bootstrap_level)
    cfg = ControllerConfig(update_mode=UpdateMode(mode), max_staleness=max_staleness)
    dl = Deadlines(drain_s=300, pause_s=120, transfer_s=120, reset_s=30, validate_s=60,
                   resume_s=30)
    reps = [vllm_replica(n, e.base_url, engine=e, transport=rig.make_transport(),
                         identity=w.identity, deadlines=dl,
                         journal_path=None if journal_dir is None
                         else journal_dir / f"{n}.journal.jsonl", journal_keep=4000,
                         controller_kw={**rig.controller_kw, "config": cfg},
                         recoverer=rig.recoverer(e) if recover else None)
            for n, e in zip(names, engines, strict=True)]
    fan = None
    if len(reps) > 1:
        fan = rig.make_fanout({r.url: r.runner.adapter.transport for r in reps})
    coord = FleetCoordinator(reps, config=FleetConfig(health_interval_s=0.5, heal=heal),
                             fanout=fan, journal_path=None if journal_dir is None
                             else str(journal_dir / "fleet.jsonl"), journal_keep=4000)
    try:
        coord.bootstrap(w.identity, weights=w)
        out = [r for r in coord.status()["replicas"] if not r["in_pool"]]
        if out:
            raise RuntimeError("takeover left replicas out of the pool: " + "; ".join(
                f"{r['name']}: {r['state']} ({r['reason']})" for r in out))
    except BaseException:
        coord.close()
        raise
    return coord


def update(rig: Rig, coord: Any, **kw: Any) -> Any:
    w = rig.next_weights()
    checksum_s = rig.before_update(coord)
    res = coord.update(w, **kw)
    res.trainer_checksum_s = checksum_s  # type: ignore[attr-defined]
    return res


def series(name: str, fn: Callable[[int], Any], n: int, log: Callable[[str], None]
           ) -> dict[str, Any]:
    secs: list[float] = []
    transfer: list[float] = []
    for i in range(n):
        t0 = time.monotonic()
        r = fn(i)
        secs.append(time.monotonic() - t0)
        transfer.append(float(getattr(r, "transfer_s", 0.0) or 0.0)
                        if not isinstance(r, list) else
                        max(float(getattr(x, "transfer_s", 0.0) or 0.0) for x in r))
        log(f"   {name}: round {i + 1}/{n} {secs[-1] * 1e3:.1f} ms")
    rest = secs[1:] or secs
    return {"seconds": secs, "transfer_s": transfer, "median_s": statistics.median(rest),
            "transfer_median_s": statistics.median(transfer[1:] or transfer)}


def at_once(calls: list[Callable[[], Any]]) -> list[Any]:
    out: list[Any] = [None] * len(calls)
    errs: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = calls[i]()
        except BaseException as exc:  # re-raised below
            errs.append(exc)

    ths = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    if errs:
        raise errs[0]
    return out


# --------------------------------------------------------------------------- clients

class Load:
    """Closed-loop streaming clients through a gateway URL.

    By default the clients run in a process of their own (``spawn``), as a
    deployment's clients run on other machines: in this process they would
    share one interpreter lock with the gateway, the coordinator and the
    trainer, so the gateway's own cost per event could not be told apart from
    the clients' (``--clients-in-process`` keeps the old way, for comparison).
    Either way ``done`` holds every finished request once ``stop`` returns;
    ``cpu`` records the CPU seconds of this process and of the clients over
    the load's life (a process near one core is bound by its interpreter lock).
    """

    def __init__(self, url: str, rig: Rig, args: argparse.Namespace, seed: int) -> None:
        self.spec = {"url": url, "seed": seed, "model": rig.model,
                     "sampling_extra": dict(rig.sampling_extra), "vocab": rig.vocab,
                     "work": (args.concurrency, args.median_tokens, args.sigma,
                              args.cap_tokens, args.prompt_tokens)}
        self.in_process = bool(getattr(args, "clients_in_process", False))
        self.done: list[dict[str, Any]] = []
        self.cpu: dict[str, float] = {}
        self._t0 = self._c0 = 0.0
        if self.in_process:
            self._stop: Any = threading.Event()
            self._th: Any = threading.Thread(
                target=lambda: asyncio.run(_clients(self.spec, self._stop, self.done)),
                daemon=True)
        else:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self._stop = ctx.Event()
            self._q: Any = ctx.Queue()
            self._th = ctx.Process(target=_clients_process, args=(self.spec, self._stop,
                                                                   self._q), daemon=True)

    def start(self) -> Load:
        self._t0, self._c0 = time.monotonic(), time.process_time()
        self._th.start()
        return self

    def stop(self, wait_s: float = 900.0) -> None:
        self._stop.set()
        child_cpu = None
        if not self.in_process:
            import queue

            try:
                done, child_cpu = self._q.get(timeout=wait_s)
                self.done.extend(done)
            except queue.Empty:
                pass
        self._th.join(wait_s)
        wall = max(1e-9, time.monotonic() - self._t0)
        self.cpu = {"wall_s": round(wall, 2),
                    "this_process_cores": round((time.process_time() - self._c0) / wall, 3),
                    "clients_process_cores": (round(child_cpu / wall, 3)
                                              if child_cpu is not None else None),
                    "clients_in_process": self.in_process}

    def tokens_per_s(self, a: float, b: float, *, useful: bool = False) -> float:
        n = sum(k for r in self.done if not (useful and (r["error"] or r["unattributable"]))
                for t, k in r["reads"] if a <= t < b)
        return n / max(1e-9, b - a)

    def failed(self, a: float, b: float) -> int:
        return sum(1 for r in self.done if r["error"] and a <= r["t0"] <= b)

    def failures(self, a: float, b: float, top: int = 5) -> list[tuple[str, int]]:
        """The most common reasons of the failed requests begun in [a, b]."""
        import collections

        c = collections.Counter(_shape(r.get("why") or "?") for r in self.done
                                if r["error"] and a <= r["t0"] <= b)
        return c.most_common(top)


def _clients_process(spec: dict[str, Any], stop: Any, q: Any) -> None:
    """The clients' process: run them until ``stop``, then send back what they saw."""
    done: list[dict[str, Any]] = []
    c0 = time.process_time()
    asyncio.run(_clients(spec, stop, done))
    q.put((done, time.process_time() - c0))


async def _clients(spec: dict[str, Any], stop: Any, done: list[dict[str, Any]]) -> None:
    import async_modes as am
    import httpx

    work = am.Workload(*spec["work"], vocab=spec["vocab"])
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512)) as client:
        async def loop(i: int) -> None:
            rng = random.Random(spec["seed"] * 1000 + i)
            while not stop.is_set():
                r = await _one(client, spec, work.prompt(rng), work.length(rng))
                done.append(r)
                if r["status"] != 200:
                    await asyncio.sleep(0.05)
        await asyncio.gather(*(loop(i) for i in range(work.concurrency)))


async def _one(client: Any, spec: dict[str, Any], prompt: list[int], n: int
               ) -> dict[str, Any]:
    body: dict[str, Any] = {"token_ids": prompt, "stream": True, "sampling_params": {
        "max_tokens": n, "temperature": 0.0, "ignore_eos": True, **spec["sampling_extra"]}}
    if spec["model"] is not None:
        body["model"] = spec["model"]
    reads: list[tuple[float, int]] = []
    t0 = time.monotonic()
    info: dict[str, Any] = {}
    err = False
    why = ""   # the first thing that went wrong, for the failure summary
    replica = version = ""
    try:
        async with client.stream("POST", f"{spec['url']}/inference/v1/generate", json=body,
                                 timeout=600) as resp:
            replica = resp.headers.get("x-rolloutcore-replica", "")
            version = resp.headers.get("x-rolloutcore-version", "")
            if resp.status_code != 200:
                body_text = (await resp.aread()).decode("utf-8", "replace")
                return {"status": resp.status_code, "reads": [], "t0": t0,
                        "end": time.monotonic(), "tokens": 0, "replica": replica,
                        "version": version, "error": True,
                        "why": f"HTTP {resp.status_code}: {body_text[:300]}",
                        "unattributable": False}
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                d = line[5:].strip()
                if d == "[DONE]":
                    continue
                ev = json.loads(d)
                if isinstance(ev, dict):
                    if "error" in ev:
                        err = True
                        why = why or f"error event: {json.dumps(ev['error'])[:300]}"
                    if "rolloutcore" in ev:
                        info = ev["rolloutcore"]
                    k = sum(len(c.get("token_ids") or ()) for c in ev.get("choices") or ())
                    if k:
                        reads.append((time.monotonic(), k))
    except Exception as exc:  # a cut stream (a killed engine): a failed request
        err = True
        why = why or f"{type(exc).__name__}: {exc}"[:300]
    tokens = sum(k for _, k in reads)
    if not err and tokens < n:
        why = f"short answer: {tokens} of {n} tokens"
    return {"status": 200, "why": why, "reads": reads, "t0": t0, "end": time.monotonic(),
            "tokens": tokens, "replica": replica, "version": version,
            "error": err or tokens < n, "info": {k: info.get(k) for k in (
                "version", "replica", "fleet_version", "attributable", "staleness")
                if k in info}, "unattributable": info.get("attributable") is False}


def _shape(why: str) -> str:
    """A failure reason without its numbers and ids (so alike ones count together)."""
    return re.sub(r"[0-9a-f]{8,}|\d+", "#", why)[:200]


# --------------------------------------------------------------------------- stages

def stage_sync(rig: Rig, R: dict[str, Any], args: argparse.Namespace,
               log: Callable[[str], None]) -> None:
    n = args.reps + 1
    e0, e1 = rig.engines
    start = rig.current()
    solo = make_fleet(rig, ["solo"], [e0])
    try:
        single = series("one engine", lambda i: update(rig, solo, transfer="per-engine"), n, log)
    finally:
        solo.close()
    # e1 still holds what both held at the start: bring it to the trainer's current weights.
    catch_up = make_fleet(rig, ["catch-up"], [e1], holds=start)
    try:
        rig.before_update(catch_up)
        catch_up.update(rig.current(), transfer="per-engine")
    finally:
        catch_up.close()
    solos = [make_fleet(rig, [f"p{j}"], [e]) for j, e in enumerate(rig.engines)]
    try:
        # Both fleets on the same weights: the buffer moves once per round for both.
        def both(i: int) -> list[Any]:
            w = rig.next_weights()
            for c in solos:
                rig.before_update(c)
            return at_once([lambda c=c: c.update(w, transfer="per-engine") for c in solos])
        par = series("two one-engine updates at once", both, n, log)
    finally:
        for c in solos:
            c.close()
    coord = make_fleet(rig, ["e0", "e1"], rig.engines)
    try:
        fan = series("fleet, one fan-out", lambda i: update(rig, coord, transfer="fanout"),
                     n, log)
        seq = series("fleet, two sequential sends",
                     lambda i: update(rig, coord, transfer="per-engine"), n, log)
        fan_res = update(rig, coord, transfer="fanout")
        R["fanout_result"] = fan_res.to_dict()
    finally:
        coord.close()
    R["detail"]["sync"] = {"single": single, "independent_parallel": par, "fanout": fan,
                           "sequential": seq}
    R.update({
        "single_engine_s": single["median_s"], "sync_fanout_s": fan["median_s"],
        "sync_sequential_s": seq["median_s"], "independent_parallel_s": par["median_s"],
        "fanout_over_single": fan["median_s"] / single["median_s"],
        "fanout_over_independent_parallel": fan["median_s"] / par["median_s"],
        "sequential_over_single": seq["median_s"] / single["median_s"]})


def _waves(coord: Any, since: float) -> list[tuple[int, float, float]]:
    from rolloutcore.core.pool import WaveBegin, WaveEnd

    rec = coord.journal.records
    b = {r.record.wave: r.t_mono for r in rec if isinstance(r.record, WaveBegin)
         and r.t_mono >= since}
    e = {r.record.wave: r.t_mono for r in rec if isinstance(r.record, WaveEnd)
         and r.t_mono >= since}
    return [(w, b[w], e[w]) for w in sorted(b) if w in e]


def _gateway(coord: Any) -> Any:
    from helpers.gateway_rig import uvicorn_thread
    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.service import ServiceConfig

    app = create_fleet_app(coord, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                                control_token=TOKEN, queue_max=1024,
                                                queue_wait_s=600))
    return uvicorn_thread(app)


def stage_rolling(rig: Rig, R: dict[str, Any], args: argparse.Namespace, timeline: Any,
                  log: Callable[[str], None]) -> None:
    coord = make_fleet(rig, ["e0", "e1"], rig.engines)
    try:
        with _gateway(coord) as url:
            load = Load(url, rig, args, seed=1).start()
            timeline.watch(coord, load)
            time.sleep(args.warmup_s)
            ts = time.monotonic()
            time.sleep(args.steady_s)
            te = t_roll = time.monotonic()
            rolls, spans = [], []
            for ri in range(args.rolls):
                t_r = time.monotonic()
                res = update(rig, coord, strategy="rolling", wave_size=1, min_serving=1)
                time.sleep(1.0)
                spans.append(_waves(coord, t_r))
                rolls.append({"seconds": res.seconds, "waves": [],
                              "published": res.published.label if res.published else None})
                log(f"   rolling {ri + 1}/{args.rolls}: {res.seconds * 1e3:.0f} ms")
            t_end = time.monotonic()
            load.stop()
    finally:
        timeline.unwatch()
        coord.close()
    # Read only now: a request's reads reach `load.done` when it ends, so a rate read
    # while long requests still ran would miss their tokens (the first H200 run read
    # the steady rate that way: 1638 tok/s, then waves "at 1.45-1.93 of steady").
    steady = load.tokens_per_s(ts, te)
    for roll, waves in zip(rolls, spans, strict=True):
        roll["waves"] = [{"wave": w, "seconds": b - a, "tokens_per_s": load.tokens_per_s(a, b),
                          "retained": load.tokens_per_s(a, b) / steady if steady else None}
                         for w, a, b in waves]
        log("   waves at " + ", ".join(f"{w['retained']:.2f}" for w in roll["waves"]
                                      if w["retained"] is not None) + " of steady")
    vals = [w["retained"] for r in rolls for w in r["waves"] if w["retained"] is not None]
    R["detail"]["rolling"] = {"steady_tokens_per_s": steady, "rolls": rolls, "cpu": load.cpu}
    R.update({"rolling_retained_min": min(vals) if vals else None,
              "rolling_retained_median": statistics.median(vals) if vals else None,
              "rolling_failed_any": load.failed(t_roll, t_end),
              "rolling_failures": load.failures(t_roll, t_end),
              "steady_tokens_per_s": steady})


def _async_phase(rig: Rig, args: argparse.Namespace, timeline: Any, mode: str, seed: int
                 ) -> dict[str, Any]:
    """One mode's phase: a fresh fleet in that mode, the clients (workload ``seed``), an
    update every ``period_s`` (none for ``none``)."""
    coord = make_fleet(rig, ["e0", "e1"], rig.engines,
                       mode="strict" if mode == "none" else mode,
                       max_staleness=args.max_staleness)
    try:
        with _gateway(coord) as url:
            load = Load(url, rig, args, seed=seed).start()
            timeline.watch(coord, load)
            time.sleep(args.warmup_s)
            a = time.monotonic()
            b = a + args.phase_s
            ups: list[dict[str, Any]] = []
            k = 1
            while mode != "none":
                at = a + k * args.period_s
                if at >= b:
                    break
                time.sleep(max(0.0, at - time.monotonic()))
                t = time.monotonic()
                try:
                    res = update(rig, coord, transfer="fanout")
                    ups.append({"at": round(t - a, 3), "seconds": res.seconds,
                                "label": res.published.label if res.published else None})
                except Exception as exc:  # recorded; the phase goes on
                    ups.append({"at": round(t - a, 3), "error": f"{type(exc).__name__}: "
                                f"{str(exc)[:300]}"})
                k += 1
            time.sleep(max(0.0, b - time.monotonic()))
            load.stop()
    finally:
        timeline.unwatch()
        coord.close()
    return {"tokens_per_s": load.tokens_per_s(a, b, useful=True),
            "all_tokens_per_s": load.tokens_per_s(a, b),
            "failed": load.failed(a, b), "failures": load.failures(a, b),
            "updates": ups, "seed": seed,
            "unattributable": sum(1 for r in load.done if r["unattributable"]),
            "answers": len(load.done), "cpu": load.cpu}


#: The no-update phase runs twice per round, first and last (``none`` and ``none_after``):
#: a round whose two agree within ``STEADY_TOL`` reached a steady state, and only such a
#: round's ratios are read (issue 49: a 50 s phase that had not, read 1.12 "retained").
STEADY_TOL = 0.05


def async_order(rounds: int) -> list[tuple[int, str]]:
    """(round, mode) in run order: every round brackets the update modes by two no-update
    phases on the same workload; the update modes' order alternates between rounds."""
    out: list[tuple[int, str]] = []
    for r in range(rounds):
        mid = list(MODES[1:]) if r % 2 == 0 else list(reversed(MODES[1:]))
        out += [(r, "none"), *((r, m) for m in mid), (r, "none_after")]
    return out


def steady_retention(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each round's ratios over the mean of its two no-update phases, read only where the
    two agree within ``STEADY_TOL``; the median over those rounds per mode."""
    out: dict[str, Any] = {"steady_rounds": [], "unsteady_rounds": []}
    for i, ph in enumerate(rounds):
        a, b = ph["none"]["tokens_per_s"], ph["none_after"]["tokens_per_s"]
        spread = abs(a - b) / max(a, b) if max(a, b) > 0 else None
        ph["none_spread"] = spread
        if spread is None or spread > STEADY_TOL:
            out["unsteady_rounds"].append(i)
            continue
        out["steady_rounds"].append(i)
        base = (a + b) / 2
        for mode in MODES[1:]:
            ph[mode]["retained"] = ph[mode]["tokens_per_s"] / base
    for mode in MODES[1:]:
        got = [rounds[i][mode]["retained"] for i in out["steady_rounds"]]
        out[mode] = {"retained": statistics.median(got) if got else None,
                     "retained_per_round": got}
    return out


def stage_async(rig: Rig, R: dict[str, Any], args: argparse.Namespace, timeline: Any,
                log: Callable[[str], None]) -> None:
    rounds: list[dict[str, Any]] = [{} for _ in range(args.async_rounds)]
    for r, mode in async_order(args.async_rounds):
        ph = rounds[r][mode] = _async_phase(rig, args, timeline, mode.removesuffix("_after"),
                                            seed=10 + r)
        log(f"   round {r} {mode}: {ph['tokens_per_s']:.0f} useful tok/s, "
            f"{len(ph['updates'])} updates, failed {ph['failed']}, cores {ph['cpu']}"
            + "".join(f"\n      {k} x {why}" for why, k in ph["failures"]))
    steady = steady_retention(rounds)
    out: dict[str, Any] = {mode: dict(rounds[0][mode]) for mode in MODES}
    for mode in MODES[1:]:
        out[mode].update(steady[mode])
    out.update(rounds=rounds, steady_rounds=steady["steady_rounds"],
               unsteady_rounds=steady["unsteady_rounds"], steady_tolerance=STEADY_TOL)
    R["detail"]["async"] = out
    R.update({"keep_retained": out["keep"]["retained"],
              "recompute_retained": out["recompute"]["retained"]})


def stage_death(rig: Rig, R: dict[str, Any], args: argparse.Namespace, timeline: Any,
                log: Callable[[str], None]) -> None:
    from rolloutcore.core.pool import ReplicaStateChange

    coord = make_fleet(rig, ["e0", "e1"], rig.engines, recover=True)
    coord.start_supervisor()
    try:
        update(rig, coord, transfer="fanout")   # the fleet's current version: the buffer's
        with _gateway(coord) as url:
            load = Load(url, rig, args, seed=20).start()
            timeline.watch(coord, load)
            time.sleep(args.warmup_s)
            victim, name = rig.engines[1], "e1"
            tk = time.monotonic()
            victim.signal_group(signal.SIGKILL)
            fenced = coord.wait_for(lambda: coord.state_of(name).value != "SERVING", 120,
                                    0.005)
            back = coord.wait_for(lambda: coord.state_of(name).value == "SERVING",
                                  args.rejoin_wait_s, 0.1)
            time.sleep(2.0)
            load.stop()
    finally:
        timeline.unwatch()
        coord.close()
    recs = [r for r in coord.journal.records if isinstance(r.record, ReplicaStateChange)
            and r.record.replica == name and r.t_mono >= tk]
    t_f = next((r.t_mono for r in recs if r.record.after == "FENCED"), None)
    t_b = next((r.t_mono for r in recs if r.record.event == "rejoined"), None)
    served = sum(1 for r in load.done if r["replica"] == name and not r["error"]
                 and tk < r["t0"] < (t_b or float("inf")))
    R["detail"]["death"] = {
        "trail": [(r.record.after, r.record.event, round(r.t_mono - tk, 3), r.record.reason)
                  for r in recs],
        "failed_during": load.failed(tk, t_b or time.monotonic()),
        "fenced_seen": fenced, "rejoined_seen": back,
        # what the restarted process said, when it did not come back
        "victim_log_tail": None if back else _log_tail(victim)}
    for after, event, at, why in R["detail"]["death"]["trail"]:
        log(f"   {name} {after} ({event}) at +{at:.1f}s" + (f": {why[:400]}" if why else ""))
    R.update({"fence_after_death_s": (t_f - tk) if t_f is not None else None,
              "rejoin_after_death_s": (t_b - tk) if t_b is not None else None,
              "served_by_dead_replica": served,
              "rejoin_over_cold_start": ((t_b - tk) / rig.cold_start_s
                                         if t_b is not None and rig.cold_start_s else None)})


def _log_tail(engine: Any, lines: int = 60) -> str | None:
    try:
        return str(engine.log_tail(lines))
    except Exception as exc:  # a handle without logs
        return f"no log: {type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------- the picture

class Timeline:
    """Versions each replica serves and tokens per second, sampled through the run."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.samples: list[tuple[float, dict[str, str | None]]] = []
        self.loads: list[Any] = []
        self.stages: list[tuple[str, float]] = []
        self._coord: Any = None
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    def stage(self, name: str) -> None:
        self.stages.append((name, time.monotonic() - self.t0))

    def watch(self, coord: Any, load: Any) -> None:
        self._coord = coord
        self.loads.append(load)

    def unwatch(self) -> None:
        self._coord = None

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            c = self._coord
            if c is None:
                continue
            with contextlib.suppress(Exception):
                v = c.view()
                snap = {e.name: (str(e.generation) if e.in_pool and e.generation is not None
                                 else None) for e in v.replicas}
                self.samples.append((time.monotonic() - self.t0, snap))

    def close(self) -> None:
        self._stop.set()
        self._th.join(5)

    def plot(self, path: Path) -> str | None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except Exception as exc:
            return f"no plot: {exc}"
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 6), sharex=True,
                                       gridspec_kw={"height_ratios": [1, 2]})
        names = sorted({n for _, s in self.samples for n in s})
        # One band per replica, one colour per version (a stage's coordinator numbers
        # its versions from 0, so a version is (stage, generation)); a gap: out of the pool.
        keys: dict[tuple[int, str], int] = {}
        cmap = plt.get_cmap("tab10")
        for k, n in enumerate(names):
            seg_start, cur = None, None
            for t, snap in [*self.samples, (float("inf"), {})]:
                stage = sum(1 for _, ts in self.stages if ts <= t)
                v = None if snap.get(n) is None else (stage, str(snap[n]))
                if v != cur:
                    if cur is not None and seg_start is not None:
                        c = keys.setdefault(cur, len(keys))  # type: ignore[arg-type]
                        end = t if t != float("inf") else self.samples[-1][0]
                        ax1.hlines(k, seg_start, end, color=cmap(c % 10), lw=10)
                        if end - seg_start > 3:
                            ax1.text(seg_start, k + 0.3, f"v{cur[1]}", fontsize=7)
                    seg_start, cur = t, v
        ax1.set_yticks(range(len(names)), names)
        ax1.set_ylim(-0.7, len(names) - 0.2)
        ax1.set_ylabel("version served\n(gap: out of the pool)")
        bins: dict[int, int] = {}
        for load in self.loads:
            for r in load.done:
                for t, k in r["reads"]:
                    b = int((t - self.t0) / 0.5)
                    bins[b] = bins.get(b, 0) + k
        if bins:
            xs = sorted(bins)
            ax2.plot([x * 0.5 for x in xs], [bins[x] / 0.5 for x in xs], lw=1)
        ax2.set_ylabel("tokens / s (all clients)")
        ax2.set_xlabel("seconds since the run started")
        for name, t in self.stages:
            for ax in (ax1, ax2):
                ax.axvline(t, color="grey", lw=0.5, ls="--")
            ax2.text(t, ax2.get_ylim()[1], f" {name}", fontsize=7, va="top")
        fig.suptitle("fleet of two engines: versions per replica and throughput")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return None


# --------------------------------------------------------------------------- the run

def _versions() -> dict[str, Any]:
    import hashlib

    v: dict[str, Any] = {"python": platform.python_version()}
    for mod in ("torch", "vllm"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as exc:  # recorded, not fatal here
            v[mod] = f"import failed: {exc}"
    h = hashlib.sha256()
    for f in sorted([*(REPO / "src" / "rolloutcore").rglob("*.py"), Path(__file__)]):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    v["tree_sha256"] = h.hexdigest()
    return v


def run(args: argparse.Namespace) -> int:
    t_run = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_run:7.1f}s] {msg}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    R: dict[str, Any] = {"plan": plan(args), "versions": _versions(), "errors": {},
                         "detail": {}, "command": " ".join([sys.executable, *sys.argv]),
                         "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    log(json.dumps(R["plan"]))
    timeline = Timeline()
    rig: Rig | None = None
    try:
        rig = (cpu_rig if args.cpu_selftest else gpu_rig)(args, log)
        R["kind"], R["notes"], R["cold_start_s"] = rig.kind, rig.notes, rig.cold_start_s
        R.update(rig.record)
        R["engine_command"] = " ".join(rig.engines[0].command())
        stages: list[tuple[str, Callable[[], None]]] = [
            ("sync", lambda: stage_sync(rig, R, args, log)),  # type: ignore[arg-type]
            ("rolling", lambda: stage_rolling(rig, R, args, timeline, log)),  # type: ignore[arg-type]
            ("async", lambda: stage_async(rig, R, args, timeline, log))]  # type: ignore[arg-type]
        if args.death:
            stages.append(("death", lambda: stage_death(rig, R, args, timeline, log)))  # type: ignore[arg-type]
        for name, fn in stages:
            if args.only and name not in args.only:
                continue
            left = args.deadline_s - (time.monotonic() - t_run)
            if name == "death" and left < 150 and not args.cpu_selftest:
                R["errors"][name] = (f"skipped: {left:.0f} s left of the call's "
                                     f"{args.deadline_s:g} s, a restart and rejoin need ~150")
                log(f"!! {R['errors'][name]}")
                continue
            args.rejoin_wait_s = max(30.0, min(args.rejoin_wait_s, left - 40.0)) \
                if not args.cpu_selftest else args.rejoin_wait_s
            log(f"stage {name}")
            timeline.stage(name)
            try:
                fn()
            except Exception as exc:
                import traceback

                R["errors"][name] = f"{type(exc).__name__}: {exc}"
                log(f"!! stage {name} failed: {exc}\n{traceback.format_exc()[-3000:]}")
            with contextlib.suppress(Exception):
                (out_dir / "fleet.partial.json").write_text(
                    json.dumps(R, indent=1, sort_keys=True, default=str))
    except Exception as exc:
        R["errors"]["run"] = f"{type(exc).__name__}: {exc}"
        log(f"!! {exc}")
    finally:
        timeline.close()
        if rig is not None:
            if R["errors"]:
                with contextlib.suppress(Exception):
                    R["engine_log_tails"] = [e.log_tail(80) for e in rig.engines]
            with contextlib.suppress(Exception):
                rig.close()
        note = timeline.plot(out_dir / "fleet.png")
        if note:
            R["errors"]["plot"] = note
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                R["device"] = torch.cuda.get_device_name(0)
        R["machine"] = {"host": platform.node(), "cpus": os.cpu_count(),
                        "platform": platform.platform()}
        R["wall_s"] = round(time.monotonic() - t_run, 1)
        R["goals"] = goals(R)
        (out_dir / "fleet.json").write_text(json.dumps(R, indent=1, sort_keys=True,
                                                       default=str) + "\n")
        print(table(R), flush=True)
        log(f"wrote {out_dir / 'fleet.json'}")
    return 0 if not R["errors"] else 1


def goals(R: dict[str, Any]) -> dict[str, Any]:
    def le(k: str, v: float) -> bool | None:
        return None if R.get(k) is None else R[k] <= v

    def ge(k: str, v: float) -> bool | None:
        return None if R.get(k) is None else R[k] >= v

    return {"fanout_over_single<=1.3": le("fanout_over_single", 1.3),
            "rolling_retained_min>=0.45": ge("rolling_retained_min", 0.45),
            "rolling_failed_any==0": None if R.get("rolling_failed_any") is None
            else R["rolling_failed_any"] == 0,
            "served_by_dead_replica==0": None if R.get("served_by_dead_replica") is None
            else R["served_by_dead_replica"] == 0,
            "rejoin<=2x_cold_start": le("rejoin_over_cold_start", 2.0),
            "keep_retained>=0.95": ge("keep_retained", 0.95),
            "recompute_retained>=0.90": ge("recompute_retained", 0.90)}


def table(R: dict[str, Any]) -> str:
    def f(k: str, fmt: str = "{:.3f}") -> str:
        v = R.get(k)
        return "n/a" if v is None else fmt.format(v)

    rows = [("one engine alone (s)", f("single_engine_s", "{:.4f}")),
            ("two one-engine updates at once (s)", f("independent_parallel_s", "{:.4f}")),
            ("fleet, one fan-out (s)", f("sync_fanout_s", "{:.4f}")),
            ("fleet, two sequential (s)", f("sync_sequential_s", "{:.4f}")),
            ("fanout_over_single (goal <= 1.3)", f("fanout_over_single")),
            ("fanout_over_independent_parallel", f("fanout_over_independent_parallel")),
            ("rolling_retained_min (goal >= 0.45)", f("rolling_retained_min")),
            ("rolling_failed_any (goal 0)", f("rolling_failed_any", "{}")),
            ("keep_retained (goal >= 0.95)", f("keep_retained")),
            ("recompute_retained (goal >= 0.90)", f("recompute_retained")),
            ("fence_after_death_s", f("fence_after_death_s")),
            ("rejoin_after_death_s (cold start)", f("rejoin_after_death_s", "{:.1f}")
             + f" ({f('cold_start_s', '{:.1f}')})"),
            ("served_by_dead_replica (goal 0)", f("served_by_dead_replica", "{}"))]
    w = max(len(r[0]) for r in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines += [f"ERROR in {k}: {v[:300]}" for k, v in R.get("errors", {}).items()]
    lines.append("FLEET OK" if not R.get("errors") else "FLEET HAS PROBLEMS")
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--plan", action="store_true",
                    help="print the plan and its time against the budget; run nothing")
    ap.add_argument("--cpu-selftest", action="store_true",
                    help="every stage on two CPU engines (tiny model, gloo), short phases")
    ap.add_argument("--only", nargs="*", choices=("sync", "rolling", "async", "death"))
    ap.add_argument("--gpu-util", type=float, default=0.3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rolls", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--median-tokens", type=int, default=128)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--cap-tokens", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--steady-s", type=float, default=10.0)
    ap.add_argument("--phase-s", type=float, default=20.0)
    ap.add_argument("--period-s", type=float, default=5.0)
    ap.add_argument("--async-rounds", type=int, default=1,
                    help="rounds of the async stage: every mode once per round on the same "
                         "workload, the order rotated; retained = the median over rounds")
    ap.add_argument("--max-staleness", type=int, default=None)
    ap.add_argument("--rejoin-wait-s", type=float, default=200.0)
    ap.add_argument("--deadline-s", type=float, default=560.0,
                    help="the run's own end (the device call is killed at 600 s): the death "
                         "stage is skipped, and the rejoin wait cut, to end before it")
    ap.add_argument("--no-death", dest="death", action="store_false")
    ap.add_argument("--clients-in-process", action="store_true",
                    help="run the clients in this process (beside the gateway, sharing its "
                         "interpreter lock) instead of a process of their own")
    ap.add_argument("--cuda-graphs", dest="eager", action="store_false",
                    help="start the engines with CUDA graphs (84 s each instead of ~55 s)")
    ap.add_argument("--ray", action="store_true",
                    help="place the two engines as Ray actors, one placement group "
                         "(fleet.placement.place_ray; ray carried by prepare_carry.sh RAY=1)")
    args = ap.parse_args(argv)
    if args.ray and args.deadline_s == ap.get_default("deadline_s"):
        args.deadline_s = RAY_DEADLINE_S   # the call installs ray before the harness starts
    if args.cpu_selftest:  # what two CPU engines on two cores can serve
        for k, v in {"concurrency": 4, "median_tokens": 8, "cap_tokens": 32,
                     "prompt_tokens": 8, "reps": 2, "rolls": 1, "phase_s": 12.0,
                     "period_s": 4.0, "steady_s": 4.0, "warmup_s": 2.0,
                     "rejoin_wait_s": 400.0}.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
    for name in ("reps", "rolls", "concurrency", "median_tokens", "cap_tokens",
                 "prompt_tokens", "async_rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("phase_s", "period_s", "steady_s", "rejoin_wait_s"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name.replace('_', '-')} must be > 0")
    if not 0 < args.gpu_util <= 0.45:
        ap.error("--gpu-util must be in (0, 0.45]: two engines and the trainer share the GPU")
    if args.median_tokens > args.cap_tokens or args.prompt_tokens + args.cap_tokens > 4096:
        ap.error("median <= cap, and prompt + cap <= max_model_len (4096)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    p = plan(args)
    if args.plan:
        print(json.dumps(p, indent=1))
        return 0 if p["fits"] else 2
    if not p["fits"] and not args.cpu_selftest:
        print(f"the plan needs ~{p['estimated_s']}s, over the {BUDGET_S:g}s of one call: "
              "shorten --phase-s or --reps", file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
