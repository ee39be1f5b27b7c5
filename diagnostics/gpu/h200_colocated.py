#!/usr/bin/env python3
"""H200: colocated training and rollout on one GPU, the verified sleep/wake lifecycle (#21).

One run on one H200 (trainer and engine share it), against ONE real ``vllm
serve`` (vLLM 0.26.0 carried to the device, see README.md here) started by
RolloutCore's launcher with ``--enable-sleep-mode --load-format dummy
--skip-tokenizer-init --enforce-eager`` on Qwen3-8B shapes and the
``rc_cuda_ipc`` backend. The trainer holds its own bf16 weights of the same
shapes in one buffer (``PackedWeights``). Stages (each records its own
error and the run goes on):

1. ``warmup``: two plain verified updates (seeds 1, 2); after each, the
   engine's greedy tokens for a fixed prompt are recorded: the probe's
   expectation for that policy, from the hot path that never slept;
2. ``memory``: the device memory serving and asleep (nvidia-smi per process
   and for the device, ``torch.cuda.mem_get_info`` from the trainer, and
   what vLLM's pools report through the rc_cuda_ipc workers);
3. ``colocated_l2``: ``reps_l2`` x the verified colocated transition through
   RolloutCore's runner (``sleep(2)``; the trainer allocates and writes most
   of the freed memory, then frees it; ``wake_update``: wake the weights,
   transfer over CUDA IPC, wake the KV cache, reset the prefix cache,
   validate while paused: the workers' checksum of every written slice plus
   a check over every engine parameter; resume; the greedy-token probe with
   admission still closed; publish), each followed by the bare primitive
   sequence on the same engine and weights (``/sleep``, training,
   ``/wake_up?tags=weights``, start, update, finish, ``/wake_up?tags=kv_cache``,
   ``/reset_prefix_cache``, ``/resume``; no checks); the training time is
   not counted in either;
4. ``ablation_nomem``: the verified transition without the workers' memory
   reads (what the memory report costs);
5. ``colocated_l1``: ``reps_l1`` x sleep level 1 (weights copied to host,
   checksums of every parameter taken first) and the verified wake on the
   same weights (``wake``: every parameter against its checksum from before);
6. ``negative``: an update while asleep is refused without touching the
   engine (no send, the adapter refuses too); a wake after level 2 without
   an update is not published (the checksums of every parameter differ);
   one parameter left unwritten after level 2 is caught. A control that
   taints brings the engine back by hand (a bare update of a known policy)
   and gives it to a fresh controller.

Writes ``colocated.json`` (the keys in ``ARTIFACT_KEYS`` plus the detail,
``machine``, ``versions``, ``command``, ``tree_sha256``) and
``colocated.md`` into ``--out``. ``--plan`` prints and checks the plan (the
engine command, the stages, the time budget, the device calls) without CUDA
or vLLM; ``--selftest`` runs every stage's logic against RolloutCore's fake
engine (it models vLLM's sleep levels) and writes the same artifact: what the
unit test (``tests/test_h200_colocated_unit.py``) checks on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (str(REPO / "src"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from rolloutcore.control.controller import LifecycleController  # noqa: E402
from rolloutcore.control.runner import Deadlines, LifecycleRunner  # noqa: E402
from rolloutcore.core.evidence import (  # noqa: E402
    CacheKind,
    PauseMode,
    ValidationEvidence,
    WakeEvidence,
)
from rolloutcore.core.lifecycle import State  # noqa: E402
from rolloutcore.core.records import EvidenceSeen, Record  # noqa: E402
from rolloutcore.core.versions import VerificationLevel  # noqa: E402
from rolloutcore.errors import EffectError, UpdateFailed, UpdateRefused  # noqa: E402

__all__ = [
    "ARTIFACT_KEYS",
    "ARTIFACT_NAME",
    "GOALS",
    "HarnessConfig",
    "Rig",
    "bare_sequence",
    "build_plan",
    "check_artifact",
    "device_calls",
    "engine_args",
    "main",
    "negative_controls",
    "parse_smi_apps",
    "parse_smi_gpu",
    "results_table",
    "run_colocated_l1",
    "run_colocated_l2",
    "summarize",
    "trainer_alloc_bytes",
    "validate_plan",
]

ARTIFACT_NAME = "colocated.json"
ARTIFACT_KEYS = ("verified_l2_s", "bare_l2_s", "verified_over_bare", "verified_l1_s",
                 "mem_asleep_mib", "mem_serving_mib", "coverage",
                 "update_while_asleep_refused", "wake_without_update_published",
                 "unwritten_param_caught")
#: The issue's goals (reported beside the values; only the controls must hold).
GOALS: Mapping[str, str] = {
    "verified_over_bare": "<= 1.3", "verified_l2_s": "< 0.25", "mem_asleep_mib": "< 2048",
    "coverage": "== 1.0", "update_while_asleep_refused": "true",
    "wake_without_update_published": "false", "unwritten_param_caught": "true"}
#: Must hold for the artifact to be a pass (the rest are measurements against goals).
REQUIRED: Mapping[str, object] = {
    "coverage": 1.0, "update_while_asleep_refused": True,
    "wake_without_update_published": False, "unwritten_param_caught": True}
WORKER_EXTENSION = "rolloutcore.transports.cuda_ipc.engine.CudaIpcWorkerExtension"
BACKEND = "rc_cuda_ipc"
DEVICE_LIMIT_S = 600.0       # the device tool's limit for one command
ENGINE_START_S = 90.0        # Qwen3-8B dummy, eager: 60 s seen; 84 s with CUDA graphs
#: 15 tokens: less than one KV block (16), so the probe never reads a cached prefix.
PROMPT = [(i * 7919 + 13) % 150000 + 100 for i in range(15)]
STAGES = ("warmup", "memory", "colocated_l2", "ablation_nomem", "ablation_probe", "colocated_l1",
          "negative")


# ====================================================================== configuration

@dataclass(frozen=True)
class HarnessConfig:
    """Everything a run depends on; the plan is built from it alone."""

    reps_l2: int = 9
    reps_l1: int = 3
    ablation_reps: int = 5
    gpu_util: float = 0.45
    #: the trainer allocates this fraction of the memory the sleep freed
    trainer_fraction: float = 0.9
    probe_tokens: int = 2
    enforce_eager: bool = True
    skip_param: str = "model.norm.weight"   # left unwritten by the negative control
    budget_s: float = 540.0                 # < 9 minutes, engine start included

    def __post_init__(self) -> None:
        for name in ("reps_l2", "reps_l1", "ablation_reps", "probe_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.reps_l2 < 9:
            raise ValueError("reps_l2 must be >= 9 (the issue asks for a median of at least 9)")
        if self.reps_l1 < 1:
            raise ValueError("reps_l1 must be >= 1")
        if self.probe_tokens > 16:
            raise ValueError("probe_tokens must be <= 16")
        if not 0.1 <= self.gpu_util <= 0.6:
            raise ValueError("gpu_util must be in [0.1, 0.6]: the trainer needs the rest")
        if not 0.0 < self.trainer_fraction < 1.0:
            raise ValueError("trainer_fraction must be in (0, 1)")
        if not 0 < self.budget_s < DEVICE_LIMIT_S:
            raise ValueError(f"budget_s must be in (0, {DEVICE_LIMIT_S:g})")
        if not self.skip_param:
            raise ValueError("skip_param must name a parameter")

    def estimate_s(self) -> dict[str, float]:
        """Seconds each stage should take on the H200 (from VLLM-FACTS.md's measurements)."""
        rep = 0.45 + 0.3 + 0.4     # verified + bare + the trainer's allocation, each
        return {"install": 15.0, "trainer_weights": 5.0, "engine_start": ENGINE_START_S,
                "warmup": 15.0, "memory": 5.0, "colocated_l2": self.reps_l2 * rep,
                "ablation_nomem": self.ablation_reps * 0.8,
                "ablation_probe": 2.0 + 2 * self.ablation_reps * 0.8,
                "colocated_l1": self.reps_l1 * (14.2 + 1.5 + 0.4),
                "negative": 25.0, "finish": 10.0}


def engine_args(cfg: HarnessConfig) -> list[str]:
    """``vllm serve`` flags beyond ManagedEngine's (which adds the backend and dev mode)."""
    out = ["--load-format", "dummy", "--skip-tokenizer-init",
           "--gpu-memory-utilization", str(cfg.gpu_util),
           "--worker-extension-cls", WORKER_EXTENSION, "--enable-sleep-mode"]
    if cfg.enforce_eager:
        out.insert(2, "--enforce-eager")
    return out


def engine_env() -> dict[str, str]:
    return {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1"}


def trainer_alloc_bytes(free_bytes: int, freed_bytes: int | None, fraction: float) -> int:
    """What the trainer takes between sleep and wake: ``fraction`` of what the engine freed,
    never more than ``fraction`` of what is free (its own weights stay resident)."""
    if free_bytes <= 0:
        return 0
    cap = int(free_bytes * fraction)
    if freed_bytes is None or freed_bytes <= 0:
        return cap
    return max(0, min(cap, int(freed_bytes * fraction)))


def bare_sequence(level: int) -> list[tuple[str, str, dict[str, Any] | None]]:
    """The bare colocated sequence, as (phase, route, query): no checks, no controller.

    ``train`` is where the trainer runs (not timed); ``update`` carries the
    update_info body. vLLM 0.32 resumes its scheduler once fully awake and
    0.26 on any wake: the closing ``/resume`` is then a no-op, kept so that
    both end serving.
    """
    if level not in (1, 2):
        raise ValueError("level must be 1 or 2")
    seq: list[tuple[str, str, dict[str, Any] | None]] = [
        ("sleep", "/sleep", {"level": str(level), "mode": "wait"}), ("train", "", None)]
    if level == 2:
        seq += [("wake_weights", "/wake_up", {"tags": "weights"}),
                ("start", "/start_weight_update", None), ("update", "/update_weights", None),
                ("finish", "/finish_weight_update", None),
                ("wake_kv_cache", "/wake_up", {"tags": "kv_cache"})]
    else:
        seq += [("wake", "/wake_up", None)]
    return [*seq, ("reset", "/reset_prefix_cache", None), ("resume", "/resume", None)]


# ====================================================================== the plan

def device_calls(n_pieces: int = 7) -> list[dict[str, Any]]:
    """The device tool calls, in order, each within ~30 s of the previous one.

    Pieces come from ``prepare_carry.sh`` (<= 52 MB each); every call carries
    one, so piece + working tree stay under 64 MiB. The last runs the harness.
    """
    if n_pieces < 1:
        raise ValueError("n_pieces must be >= 1")
    calls: list[dict[str, Any]] = []
    for i in range(n_pieces - 1):
        p = f".carry/piece-{i:02d}"
        carry = [p, ".carry/MANIFEST"] if i == 0 else [p]
        calls.append({"kind": "nvidia-h200", "carry": carry, "timeout_s": 120,
                      "command": f"mkdir -p /tmp/rc-carry && cp {' '.join(carry)} "
                                 f"/tmp/rc-carry/ && " + ("nvidia-smi -L" if i == 0
                                                          else "ls /tmp/rc-carry")})
    last = f".carry/piece-{n_pieces - 1:02d}"
    calls.append({
        "kind": "nvidia-h200", "carry": [last], "timeout_s": 600,
        "command": (f"set -o pipefail; mkdir -p /tmp/rc-carry && cp {last} /tmp/rc-carry/ && "
                    "bash diagnostics/gpu/install_on_device.sh && "
                    "export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1 && "
                    "timeout 560 python3 diagnostics/gpu/h200_colocated.py --out $OUT "
                    "2>&1 | tee $OUT/run.log")})
    return calls


def build_plan(cfg: HarnessConfig, *, engine_command: list[str] | None = None,
               n_pieces: int = 7, tree_bytes: int | None = None,
               piece_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What a run will do, as data: the engine, the stages, their budget, the calls."""
    est = cfg.estimate_s()
    stages = [
        {"name": "warmup", "measures": [], "steps": [
            "2 plain verified updates (seeds 1, 2): probe tokens recorded per policy"]},
        {"name": "memory", "measures": ["mem_serving_mib", "mem_asleep_mib"], "steps": [
            "nvidia-smi per process and device, torch.cuda.mem_get_info, vLLM pools: "
            "serving, asleep at level 2, after the wake"]},
        {"name": "colocated_l2", "measures": ["verified_l2_s", "bare_l2_s",
                                              "verified_over_bare", "coverage"],
         "steps": [f"{cfg.reps_l2} x (verified: sleep(2), trainer allocates "
                   f"{cfg.trainer_fraction:.0%} of the freed memory, wake_update; "
                   "bare: the same sequence as bare HTTP calls)"]},
        {"name": "ablation_nomem", "measures": [], "steps": [
            f"{cfg.ablation_reps} x the verified transition without the memory reads"]},
        {"name": "ablation_probe", "measures": [], "steps": [
            "the probe's time on a serving engine (1 and probe_tokens tokens, 5 each)",
            f"{cfg.ablation_reps} x the verified transition with a one-token probe",
            f"{cfg.ablation_reps} x the verified transition without the live probe"]},
        {"name": "colocated_l1", "measures": ["verified_l1_s"], "steps": [
            f"{cfg.reps_l1} x (sleep(1) with checksums of every parameter, wake: verified "
            "against them)"]},
        {"name": "negative", "measures": ["update_while_asleep_refused",
                                          "wake_without_update_published",
                                          "unwritten_param_caught"], "steps": [
            "update while asleep (runner and adapter refuse, no send)",
            "wake after level 2 without an update (reference taken: checksums differ)",
            f"level-2 update leaving {cfg.skip_param} unwritten"]},
    ]
    calls = device_calls(n_pieces)
    if tree_bytes is not None:
        for c in calls:
            c["bytes"] = tree_bytes + sum((piece_bytes or {}).get(p, 0) for p in c["carry"])
    return {"config": dataclasses.asdict(cfg), "engine": {
                "command": engine_command, "args": engine_args(cfg), "env": engine_env(),
                "backend": BACKEND, "starts": 1},
            "stages": stages, "estimate_s": est, "estimate_total_s": sum(est.values()),
            "artifact": {"name": ARTIFACT_NAME, "keys": list(ARTIFACT_KEYS),
                         "goals": dict(GOALS)},
            "device_calls": calls}


def validate_plan(plan: Mapping[str, Any]) -> list[str]:
    """Problems with a plan (empty: fine), found before the device is spent."""
    out: list[str] = []
    cfg = plan.get("config", {})
    eng = plan.get("engine", {})
    args = list(eng.get("args") or [])
    cmd = eng.get("command")
    for flag in ("--enable-sleep-mode", "--load-format", "--worker-extension-cls"):
        if flag not in args or (cmd is not None and flag not in cmd):
            out.append(f"the engine is not started with {flag}")
    if cmd is not None:
        if "--weight-transfer-config" not in cmd or BACKEND not in " ".join(cmd):
            out.append(f"the engine command does not select the {BACKEND} backend")
        if WORKER_EXTENSION not in cmd:
            out.append("the engine command lacks the rc_cuda_ipc worker extension")
    if eng.get("starts") != 1:
        out.append("the run must start the engine exactly once")
    if int(cfg.get("reps_l2", 0)) < 9:
        out.append("the level-2 median needs at least 9 repetitions")
    total = float(plan.get("estimate_total_s", 0.0))
    if total >= float(cfg.get("budget_s", DEVICE_LIMIT_S)):
        out.append(f"the estimate of {total:.0f}s does not fit the budget of "
                   f"{cfg.get('budget_s')}s (one device call, engine start included)")
    measured = {m for st in plan.get("stages", []) for m in st.get("measures", [])}
    missing = [k for k in ARTIFACT_KEYS if k not in measured]
    if missing:
        out.append(f"artifact keys no stage measures: {missing}")
    calls = plan.get("device_calls", [])
    runs = [c for c in calls if "h200_colocated.py" in c.get("command", "")]
    if len(runs) != 1:
        out.append("exactly one device call must run the harness")
    for i, c in enumerate(calls):
        if len(c.get("command", "")) > 2000:
            out.append(f"device call {i + 1}: command longer than 2000 characters")
        if len(c.get("carry", [])) > 8:
            out.append(f"device call {i + 1}: more than 8 carry paths")
        if c.get("bytes", 0) > 64 * 1024 * 1024:
            out.append(f"device call {i + 1}: {c['bytes']} bytes exceed 64 MiB")
        if int(c.get("timeout_s", 0)) > DEVICE_LIMIT_S:
            out.append(f"device call {i + 1}: timeout over {DEVICE_LIMIT_S:g}s")
    return out


# ====================================================================== what a run records

def _med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def parse_smi_gpu(text: str) -> tuple[int, int] | None:
    """``nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader,nounits``."""
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return int(parts[0]), int(parts[1])
    return None


def parse_smi_apps(text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits``."""
    out: dict[int, int] = {}
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = out.get(int(parts[0]), 0) + int(parts[1])
    return out


def _evidence(records: Sequence[Record], kind: type) -> list[Any]:
    return [r.evidence for r in records
            if isinstance(r, EvidenceSeen) and isinstance(r.evidence, kind)]


def _whole_check(records: Sequence[Record]) -> dict[str, Any]:
    """The paused validation's check over every engine parameter (the last one seen)."""
    vals = [v for v in _evidence(records, ValidationEvidence) if v.paused is not False]
    for v in reversed(vals):
        for c in v.checks:
            if c.coverage is not None and c.name in ("engine_parameters", "engine-parameters"):
                return {"name": c.name, "passed": c.passed, "coverage": c.coverage,
                        "detail": c.detail}
    return {"name": None, "passed": False, "coverage": None, "detail": "no such check"}


def summarize(R: Mapping[str, Any]) -> dict[str, Any]:
    """The artifact's keys from the stages' results (None where a stage did not run)."""
    l2 = R.get("colocated_l2", {})
    ver = [r["total_s"] for r in l2.get("verified", []) if r.get("published")]
    bare = [r["total_s"] for r in l2.get("bare", [])]
    cov = [r["coverage"] for r in l2.get("verified", []) if r.get("coverage") is not None]
    l1 = [r["total_s"] for r in R.get("colocated_l1", {}).get("verified", [])
          if r.get("served")]
    mem = R.get("memory", {})
    neg = R.get("negative", {})
    v2, b2 = _med(ver), _med(bare)
    return {
        "verified_l2_s": v2, "bare_l2_s": b2,
        "verified_over_bare": v2 / b2 if v2 and b2 else None,
        "verified_l1_s": _med(l1),
        "mem_asleep_mib": mem.get("engine_asleep_mib"),
        "mem_serving_mib": mem.get("engine_serving_mib"),
        "coverage": min(cov) if cov and len(cov) == len(l2.get("verified", [])) else None,
        "update_while_asleep_refused": neg.get("update_while_asleep", {}).get("refused"),
        "wake_without_update_published": neg.get("wake_without_update", {}).get("published"),
        "unwritten_param_caught": neg.get("unwritten_param", {}).get("caught"),
    }


def check_artifact(a: Mapping[str, Any]) -> list[str]:
    """What makes the artifact fail: a control that does not hold, a key not measured."""
    out = [f"{k} was not measured" for k in ARTIFACT_KEYS if a.get(k) is None]
    for k, want in REQUIRED.items():
        if a.get(k) is not None and a.get(k) != want:
            out.append(f"{k} is {a.get(k)!r}, must be {want!r}")
    return out


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def results_table(a: Mapping[str, Any]) -> str:
    rows = [("verified_l2_s (sleep 2 -> wake weights -> transfer -> wake KV -> reset -> "
             "validate -> resume, median)", _f(a.get("verified_l2_s"), ".4f") + " s"),
            ("bare_l2_s (the same calls, no checks)", _f(a.get("bare_l2_s"), ".4f") + " s"),
            ("verified / bare", _f(a.get("verified_over_bare"), ".3f")),
            ("verified_l1_s (sleep 1 -> wake, verified unchanged)",
             _f(a.get("verified_l1_s"), ".3f") + " s"),
            ("mem_serving_mib (engine, serving)", _f(a.get("mem_serving_mib"), ".0f")),
            ("mem_asleep_mib (engine, asleep at level 2)", _f(a.get("mem_asleep_mib"), ".0f")),
            ("coverage (parameters verified after level 2)", _f(a.get("coverage"), ".4f")),
            ("update_while_asleep_refused", str(a.get("update_while_asleep_refused"))),
            ("wake_without_update_published", str(a.get("wake_without_update_published"))),
            ("unwritten_param_caught", str(a.get("unwritten_param_caught")))]
    keys = ["verified_l2_s", "bare_l2_s", "verified_over_bare", "verified_l1_s",
            "mem_serving_mib", "mem_asleep_mib", "coverage", "update_while_asleep_refused",
            "wake_without_update_published", "unwritten_param_caught"]
    lines = ["| measure | value | goal |", "| --- | --- | --- |"]
    for (what, val), k in zip(rows, keys, strict=True):
        lines.append(f"| {what} | {val} | {GOALS.get(k, '')} |")
    for k in ("verified_phase_medians_s", "bare_phase_medians_s"):
        ph = a.get(k)
        if ph:
            lines.append("\n" + k + ": " + ", ".join(f"{n} {v:.4f}" for n, v in ph.items()
                                                     if v is not None))
    abl = [(k, a.get(f"verified_l2_{k}_s"), a.get(f"verified_l2_{k}_over_bare"))
           for k, what in (("probe1", "one-token probe"), ("noprobe", "no live probe"))]
    if any(v is not None for _, v, _ in abl):
        lines.append("\n| verified level 2, probe ablation | median s | / bare |")
        lines.append("| --- | --- | --- |")
        lines.append(f"| as configured (the headline) | {_f(a.get('verified_l2_s'), '.4f')} | "
                     f"{_f(a.get('verified_over_bare'), '.3f')} |")
        for k, v, r in abl:
            what = "one-token probe" if k == "probe1" else "no live probe (engine-checksum)"
            lines.append(f"| {what} | {_f(v, '.4f')} | {_f(r, '.3f')} |")
    if a.get("probe_on_serving_engine_s"):
        lines.append("\nprobe on a serving engine (tokens: median s): " + ", ".join(
            f"{n}: {v:.4f}" for n, v in a["probe_on_serving_engine_s"].items()))
    if a.get("problems"):
        lines.append("\nproblems: " + "; ".join(a["problems"]))
    return "\n".join(lines) + "\n"


# ====================================================================== the stages

class Rig(Protocol):
    """What the stages need of a machine: the H200 one, or the fake engine's."""

    controller: LifecycleController
    runner: LifecycleRunner
    records: list[Record]

    def stage(self, seed: int, *, probe: bool = True, skip: str | None = None) -> Any:
        """Fill the trainer's weights with policy ``seed`` and stage them; the identity."""
        ...

    def train(self, freed_bytes: int | None) -> dict[str, Any]:
        """Between sleep and wake: allocate and write most of the freed memory, free it."""
        ...

    def bare_l2(self, seed: int) -> dict[str, float]:
        """The bare sequence with policy ``seed``; phase -> seconds, ``total`` without training."""
        ...

    def memory(self) -> dict[str, Any]:
        """The device memory now: engine, trainer, device; what vLLM reports."""
        ...

    def send_count(self) -> int:
        """How many transfers reached the engine so far."""
        ...

    def bring_back(self, seed: int) -> None:
        """After a taint: a bare update of policy ``seed``, then a fresh controller on it."""
        ...

    def log(self, msg: str) -> None:
        ...


def _rep_record(rig: Rig, n0: int) -> list[Record]:
    return rig.records[n0:]


def run_colocated_l2(rig: Rig, reps: int, *, bare: bool = True) -> dict[str, Any]:
    """``reps`` x (bare sequence, verified level-2 transition), interleaved.

    The bare sequence leaves the engine on a policy the controller did not
    publish; the verified transition that follows discards it (level 2) and
    writes every parameter, so the stage ends on the committed policy.
    """
    out: dict[str, Any] = {"verified": [], "bare": []}
    seed = 1
    for i in range(reps):
        if bare:
            seed = 2 if seed == 1 else 1
            b = rig.bare_l2(seed)
            out["bare"].append({"rep": i, "seed": seed, "total_s": b["total"], "phases": b})
            rig.log(f"bare L2 rep {i}: {b['total']:.4f}s")
        seed = 2 if seed == 1 else 1
        n0 = len(rig.records)
        level = (VerificationLevel.PROBE if getattr(rig, "use_probe", True)
                 else VerificationLevel.ENGINE_CHECKSUM)
        try:
            s = rig.runner.sleep(2)
            trained = rig.train(s.freed_bytes)
            ident = rig.stage(seed)
            o = rig.runner.wake_update(ident, min_verification=level)
        except UpdateFailed as exc:  # recorded; the engine goes to a fresh controller
            whole = _whole_check(_rep_record(rig, n0))
            out["verified"].append({"rep": i, "seed": seed, "published": None,
                                    "error": str(exc), "coverage": whole["coverage"],
                                    "whole_check": whole, "total_s": None})
            rig.log(f"verified L2 rep {i} FAILED: {exc}")
            rig.bring_back(seed)
            continue
        recs = _rep_record(rig, n0)
        whole = _whole_check(recs)
        wakes = _evidence(recs, WakeEvidence)
        out["verified"].append({
            "rep": i, "seed": seed, "published": None if o.published is None
            else o.published.label, "total_s": s.total_s + o.total_s, "sleep_s": s.total_s,
            "wake_update_s": o.total_s, "breakdown": o.breakdown(),
            "coverage": whole["coverage"], "whole_check": whole,
            "freed_bytes": s.freed_bytes, "trainer": trained,
            "sleep_evidence": None if s.evidence is None else {
                "is_sleeping_after": s.evidence.is_sleeping_after,
                "paused_after": s.evidence.paused_after,
                "memory_before": dict(s.evidence.memory_before),
                "memory_after": dict(s.evidence.memory_after)},
            "wakes": [{"tags": w.tags.value, "fully_awake": w.fully_awake,
                       "repaused": w.repaused, "paused_after": w.paused_after,
                       "elapsed_s": w.elapsed_s} for w in wakes]})
        rig.log(f"verified L2 rep {i}: {s.total_s + o.total_s:.4f}s coverage "
                f"{whole['coverage']} published {o.published}")
    ph: dict[str, list[float]] = {}
    for r in out["verified"]:
        for k, v in r["breakdown"].items():
            ph.setdefault(k, []).append(v)
    out["verified_phase_medians_s"] = {k: _med(v) for k, v in ph.items()}
    bp: dict[str, list[float]] = {}
    for r in out["bare"]:
        for k, v in r["phases"].items():
            bp.setdefault(k, []).append(v)
    out["bare_phase_medians_s"] = {k: _med(v) for k, v in bp.items()}
    return out


def run_probe_ablations(rig: Rig, cfg: HarnessConfig) -> dict[str, Any]:
    """What the live probe costs: its time on a serving engine, then the verified level-2
    transition with a one-token probe and with none (engine-checksum level only).

    Each variant is ``ablation_reps`` verified transitions, no bare sequence
    (the bare one is the same calls whatever the probe). A rig without a
    token probe (the fake engine's) runs only the probe-less variant.
    """
    out: dict[str, Any] = {}
    probe = getattr(rig, "probe", None)
    http = getattr(rig, "http", None)
    if not cfg.ablation_reps:
        return out
    if probe is not None and http is not None:
        warm: dict[str, list[float]] = {}
        for n in sorted({1, cfg.probe_tokens} - {0}):
            ts = []
            for _ in range(5):
                t = time.monotonic()
                probe.tokens(http, n)
                ts.append(time.monotonic() - t)
            warm[str(n)] = ts
        out["probe_on_serving_engine_s"] = {n: _med(v) for n, v in warm.items()}
        if cfg.probe_tokens > 1 and getattr(rig, "use_probe", False):
            keep = probe.n
            probe.n = 1
            try:
                out["probe1"] = run_colocated_l2(rig, cfg.ablation_reps, bare=False)
            finally:
                probe.n = keep
    keep_use = getattr(rig, "use_probe", True)
    rig.use_probe = False  # type: ignore[attr-defined]
    try:
        out["noprobe"] = run_colocated_l2(rig, cfg.ablation_reps, bare=False)
    finally:
        rig.use_probe = keep_use  # type: ignore[attr-defined]
    return out


def run_colocated_l1(rig: Rig, reps: int) -> dict[str, Any]:
    """``reps`` x (sleep level 1 with checksums of every parameter, verified wake)."""
    out: dict[str, Any] = {"verified": []}
    for i in range(reps):
        n0 = len(rig.records)
        before = rig.controller.committed
        try:
            s = rig.runner.sleep(1, reference=True)
            trained = rig.train(s.freed_bytes)
            o = rig.runner.wake()
        except UpdateFailed as exc:  # recorded; the engine goes to a fresh controller
            whole = _whole_check(_rep_record(rig, n0))
            out["verified"].append({"rep": i, "served": False, "error": str(exc),
                                    "coverage": whole["coverage"], "whole_check": whole})
            rig.log(f"verified L1 rep {i} FAILED: {exc}")
            rig.bring_back(1)
            continue
        whole = _whole_check(_rep_record(rig, n0))
        served = o.state is State.READY and rig.controller.committed == before
        out["verified"].append({
            "rep": i, "served": served, "same_version": served and o.published is None,
            "total_s": s.total_s + o.total_s,
            "sleep_s": s.total_s, "wake_s": o.total_s, "breakdown": o.breakdown(),
            "coverage": whole["coverage"], "whole_check": whole, "trainer": trained,
            "reference_params": None if s.evidence is None else s.evidence.reference_params})
        rig.log(f"verified L1 rep {i}: sleep {s.total_s:.3f}s wake {o.total_s:.4f}s "
                f"coverage {whole['coverage']}")
    return out


def _update_while_asleep(rig: Rig, r: dict[str, Any]) -> None:
    """Refused by the table, and by the adapter before a send; then woken properly."""
    rig.runner.sleep(2)
    n_rec, n_send = len(rig.records), rig.send_count()
    ident = rig.stage(1)
    try:
        rig.runner.run_update(ident)
        r["runner"] = "not refused"
    except UpdateRefused as exc:
        r["runner"] = f"UpdateRefused: {exc}"
    target = rig.controller.wake_target("trainer", ident)
    try:
        rig.runner.adapter.transfer(target)
        r["adapter"] = "not refused"
    except EffectError as exc:
        r["adapter"] = f"{type(exc).__name__}(mutation_started={exc.mutation_started}): {exc}"
        r["adapter_mutation_started"] = exc.mutation_started
    r.update(state=rig.controller.state.value, new_records=len(rig.records) - n_rec,
             sends=rig.send_count() - n_send)
    r["refused"] = (r["runner"].startswith("UpdateRefused") and
                    r["adapter"].startswith("TransferError") and
                    r.get("adapter_mutation_started") is False and r["sends"] == 0 and
                    r["new_records"] == 0 and rig.controller.state is State.SLEEPING)
    o = rig.runner.wake_update(ident)  # the proper wake, so the run goes on
    r["then_woken_by_update"] = None if o.published is None else o.published.label


def _wake_without_update(rig: Rig, r: dict[str, Any]) -> None:
    """After level 2, a wake on the same weights (checksums taken before the sleep)."""
    before = rig.controller.published
    s = rig.runner.sleep(2, reference=True)
    rig.train(s.freed_bytes)  # as a trainer would: the freed memory is written over
    n0 = len(rig.records)
    try:
        o = rig.runner.wake()
        r["outcome"] = f"published {o.published}"
    except UpdateFailed as exc:
        r["outcome"] = f"UpdateFailed: {exc}"
    r["whole_check"] = _whole_check(_rep_record(rig, n0))
    r["state"] = rig.controller.state.value
    r["published"] = rig.controller.published != before


def _unwritten_param(rig: Rig, r: dict[str, Any], skip: str) -> None:
    """A level-2 update that leaves one parameter unwritten."""
    before = rig.controller.published
    s = rig.runner.sleep(2)
    rig.train(s.freed_bytes)
    ident = rig.stage(1, skip=skip)
    n0 = len(rig.records)
    try:
        o = rig.runner.wake_update(ident)
        r["outcome"] = f"published {o.published}"
    except UpdateFailed as exc:
        r["outcome"] = f"UpdateFailed: {exc}"
    r["whole_check"] = _whole_check(_rep_record(rig, n0))
    r["state"] = rig.controller.state.value
    r["caught"] = (rig.controller.published == before and
                   rig.controller.state is State.TAINTED and
                   r["whole_check"]["passed"] is False)


def negative_controls(rig: Rig, cfg: HarnessConfig) -> dict[str, Any]:
    """The three controls, each recorded on its own (an error in one is its result).

    A control that leaves the engine tainted (or broken) hands it, by hand, to a
    fresh controller before the next (``Rig.bring_back``).
    """
    out: dict[str, Any] = {"update_while_asleep": {"refused": False},
                           "wake_without_update": {"published": None},
                           "unwritten_param": {"caught": None, "skipped": cfg.skip_param}}
    controls: list[tuple[str, Callable[[dict[str, Any]], None], int]] = [
        ("update_while_asleep", lambda r: _update_while_asleep(rig, r), 1),
        ("wake_without_update", lambda r: _wake_without_update(rig, r), 2),
        ("unwritten_param", lambda r: _unwritten_param(rig, r, cfg.skip_param), 1)]
    for name, run, seed in controls:
        r = out[name]
        try:
            run(r)
        except Exception as exc:
            r["error"] = f"{type(exc).__name__}: {exc}"
        rig.log(f"negative {name}: {r}")
        if rig.controller.state is not State.READY:
            try:
                rig.bring_back(seed)
            except Exception as exc:
                r["bring_back_error"] = f"{type(exc).__name__}: {exc}"
    return out


def run_stages(rig: Rig, cfg: HarnessConfig, R: dict[str, Any],
               stage: Callable[[str], contextlib.AbstractContextManager[None]]) -> None:
    """Every stage after the engine start, each under ``stage`` (which records errors)."""
    with stage("memory"):
        m: dict[str, Any] = {"serving": rig.memory()}
        s = rig.runner.sleep(2)
        m["asleep"] = rig.memory()
        m["sleep_evidence"] = None if s.evidence is None else {
            "before": dict(s.evidence.memory_before), "after": dict(s.evidence.memory_after),
            "freed_bytes": s.freed_bytes}
        m["trainer"] = rig.train(s.freed_bytes)
        rig.runner.wake_update(rig.stage(1))
        m["awake_again"] = rig.memory()
        m["engine_serving_mib"] = m["serving"].get("engine_mib")
        m["engine_asleep_mib"] = m["asleep"].get("engine_mib")
        m["engine_mib_source"] = m["asleep"].get("engine_mib_source")
        R["memory"] = m
    with stage("colocated_l2"):
        R["colocated_l2"] = run_colocated_l2(rig, cfg.reps_l2)
    with stage("ablation_nomem"):
        adapter = rig.runner.adapter
        if hasattr(adapter, "report_memory") and cfg.ablation_reps:
            adapter.report_memory = False
            try:
                R["ablation_nomem"] = run_colocated_l2(rig, cfg.ablation_reps, bare=False)
            finally:
                adapter.report_memory = True
    with stage("ablation_probe"):
        R["ablation_probe"] = run_probe_ablations(rig, cfg)
    with stage("colocated_l1"):
        R["colocated_l1"] = run_colocated_l1(rig, cfg.reps_l1)
    with stage("negative"):
        R["negative"] = negative_controls(rig, cfg)


# ====================================================================== the fake engine's rig

class FakeRig:
    """The stages' machine on RolloutCore's fake engine: ``--selftest`` and the unit test."""

    def __init__(self) -> None:
        from rolloutcore.control.journal import Journal
        from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights

        self._W = FakeWeights
        self.engine = FakeEngine(FakeWeights.from_seed(1), token_delay_s=0.0)
        self.adapter = FakeAdapter(self.engine)
        self.journal = Journal()
        self.records: list[Record] = []
        self._sends = 0
        inner = self.adapter.transfer

        def counted(target: Any) -> Any:
            ev = inner(target)
            self._sends += 1
            return ev

        self.adapter.transfer = counted  # type: ignore[method-assign]
        self._fresh_controller(1)

    def _fresh_controller(self, seed: int) -> None:
        self.controller = LifecycleController(listener=self.records.append)
        self.runner = LifecycleRunner(self.controller, self.adapter, Deadlines(
            drain_s=5, pause_s=5, transfer_s=5, reset_s=5, validate_s=5, resume_s=5,
            live_validate_s=5, fence_s=2, cancel_grace_s=1, retry_backoff_s=0.01, sleep_s=5,
            wake_s=5))
        w = self._W.from_seed(seed)
        self.adapter.stage(w)
        self.runner.bootstrap(w.identity())

    def stage(self, seed: int, *, probe: bool = True, skip: str | None = None) -> Any:
        w = self._W.from_seed(seed)
        self.adapter.skip_params = set() if skip is None else {"layers.3.weight"}
        self.adapter.stage(w)
        return w.identity()

    def train(self, freed_bytes: int | None) -> dict[str, Any]:
        mem = self.engine.memory()
        n = trainer_alloc_bytes(mem["free_bytes"], freed_bytes, 0.9)
        return {"bytes": n, "s": 0.0, "free_before": mem["free_bytes"], "fake": True}

    def bare_l2(self, seed: int) -> dict[str, float]:
        t0 = time.monotonic()
        e, w = self.engine, self._W.from_seed(seed)
        e.sleep(2)
        e.wake("weights")
        e.start_update()
        for n, b in w.tensors.items():
            e.load(n, b)
        e.finish_update("bare")
        e.wake("kv_cache")
        e.reset_prefix_cache()
        e.resume()
        self._sends += 1
        return {"total": time.monotonic() - t0}

    def memory(self) -> dict[str, Any]:
        m = self.engine.memory()
        return {"engine_mib": m["used_bytes"] >> 20, "engine_mib_source": "fake engine",
                "vllm": m}

    def send_count(self) -> int:
        return self._sends

    def bring_back(self, seed: int) -> None:
        e, w = self.engine, self._W.from_seed(seed)
        self.adapter.forget_sleep()
        self.adapter.skip_params = set()
        if e.dead:  # a control broke the engine: a new process on a known policy
            e.restart(w)
            self._fresh_controller(seed)
            return
        if e.asleep:
            e.wake("all")
        e.pause(PauseMode.WAIT)
        e.start_update()
        for n, b in w.tensors.items():
            e.load(n, b)
        e.finish_update("back")
        e.reset_prefix_cache()
        e.resume()
        self.adapter.forget_sleep()
        self.adapter.skip_params = set()
        self._fresh_controller(seed)

    def log(self, msg: str) -> None:
        pass


# ====================================================================== the H200's rig

def load_ipc_harness() -> Any:
    """The one-GPU hot-update harness (Qwen3-8B config, specs, fill, Http, versions)."""
    name = "h200_8b_ipc"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "h200_8b_ipc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class TokenProbe:
    """The probe: greedy tokens of a fixed prompt, against those of the same policy
    recorded after a plain verified update (the engine had not slept then)."""

    def __init__(self, prompt: Sequence[int], n: int) -> None:
        self.prompt, self.n = list(prompt), n
        self.expected: dict[int, list[int]] = {}

    def tokens(self, http: Any, n: int | None = None) -> list[int]:
        g = http.generate(self.prompt, max_tokens=self.n if n is None else n, logprobs=False,
                          ignore_eos=True, sampling_extra={"detokenize": False})
        return list(g.token_ids)

    def run(self, http: Any, target: Any) -> Any:
        from rolloutcore.core.evidence import Check

        seed = target.identity.provenance.step
        full = self.expected.get(seed)
        # Greedy decoding: the first n tokens of a longer recorded continuation are
        # the continuation of n tokens.
        want = None if full is None or len(full) < self.n else full[:self.n]
        got = self.tokens(http)
        return Check("greedy-probe", want is not None and got == want,
                     detail=f"{self.n} greedy tokens of a {len(self.prompt)}-token prompt vs "
                     f"those after a plain verified update of policy {seed}: {got} / {want}",
                     level=VerificationLevel.PROBE)


class H200Rig:
    """Trainer weights, one engine, RolloutCore's runner over VllmAdapter + rc_cuda_ipc."""

    def __init__(self, cfg: HarnessConfig, R: dict[str, Any], out: Path) -> None:
        import torch

        from rolloutcore.engine.process import ManagedEngine
        from rolloutcore.transports.cuda_ipc import CudaIpcTransport, PackedWeights

        self.cfg, self.R, self.torch = cfg, R, torch
        self.h4 = load_ipc_harness()
        self.records: list[Record] = []
        specs = self.h4.qwen3_specs(self.h4.QWEN3_8B)
        self.packed = PackedWeights([(n, s, torch.bfloat16) for n, s in specs],
                                    device="cuda:0")
        self.transport = CudaIpcTransport(mode="fast")
        self.transport.adopt(self.packed)
        self._sends = 0
        inner = self.transport.send

        def counted(*a: Any, **k: Any) -> Any:
            self._sends += 1
            return inner(*a, **k)

        self.transport.send = counted  # type: ignore[method-assign]
        self.model_dir = Path(tempfile.mkdtemp(prefix="rc-qwen3-8b-"))
        (self.model_dir / "config.json").write_text(json.dumps(self.h4.QWEN3_8B, indent=1))
        self.logs = out / "engine-logs"
        self.engine = ManagedEngine(self.model_dir, backend=BACKEND, scale_out=False,
                                    max_model_len=4096, extra_args=engine_args(cfg),
                                    env=engine_env(), log_dir=self.logs,
                                    startup_timeout_s=300, stop_grace_s=10)
        self.probe = TokenProbe(PROMPT, cfg.probe_tokens)
        self.use_probe = False  # decided by the warm-up
        self.http: Any = None
        self.bare: Any = None
        self._last_freed: int | None = None

    # -- set-up ---------------------------------------------------------------
    def start(self) -> None:
        self.engine.start()  # its command names the port it picked
        self.R["commands"].append(" ".join(self.engine.command()))
        self.R["cold_start_s"] = self.engine.last_start_s
        self.bare = self.h4.Http(self.engine.base_url)
        self.transport.connect(self.engine.base_url, timeout_s=120)
        self._fresh_controller(1, first=True)

    def _fresh_controller(self, seed: int, *, first: bool = False) -> None:
        from rolloutcore.engine.http import VllmHTTP
        from rolloutcore.engine.port import VllmAdapter

        if self.http is not None:
            self.http.close()
        self.http = VllmHTTP(self.engine.base_url, timeout_s=120)
        self.adapter = VllmAdapter(self.http, self.transport, engine_epoch=self.engine.epoch)
        self.controller = LifecycleController(required_caches=(CacheKind.PREFIX,),
                                              listener=self.records.append)
        self.runner = LifecycleRunner(self.controller, self.adapter, Deadlines(
            pause_s=60, transfer_s=120, validate_s=60, resume_s=30, reset_s=30,
            preflight_s=30, live_validate_s=60, drain_s=120, sleep_s=120, wake_s=60))
        ident = self.stage(seed, probe=False)
        if not first:
            self.bare.post("/pause", params={"mode": "wait", "clear_cache": "false"})
            self._bare_update()
            self.bare.post("/reset_prefix_cache")
            self.bare.post("/resume")
        self.runner.bootstrap(ident)

    def warmup(self) -> dict[str, Any]:
        """Plain verified updates of policies 1 and 2; the probe's tokens for each.

        Each policy is installed twice: the probe is used only if its tokens came
        out the same both times (greedy tokens of random weights could sit on a
        near tie); otherwise the run verifies by checksums alone, and says so.
        """
        out: dict[str, Any] = {"runs": []}
        same = True
        for seed in (2, 1, 2, 1):
            o = self.runner.run_update(self.stage(seed, probe=False),
                                       min_verification=VerificationLevel.ENGINE_CHECKSUM)
            toks = self.probe.tokens(self.http)
            prev = self.probe.expected.setdefault(seed, toks)
            same = same and prev == toks
            out["runs"].append({"seed": seed, "published": str(o.published),
                                "total_s": o.total_s, "tokens": toks})
        self.use_probe = same and self.cfg.probe_tokens > 0
        out["probe_used"] = self.use_probe
        return out

    # -- the Rig ----------------------------------------------------------------
    def identity(self, seed: int, skip: str | None = None) -> Any:
        from rolloutcore.core.versions import ParameterManifest, WeightIdentity

        man = ParameterManifest.from_items((e.name, e.shape, e.dtype)
                                           for e in self.packed.entries if e.name != skip)
        return WeightIdentity.declare(man, self._prov(seed))

    def _prov(self, seed: int) -> Any:
        from rolloutcore.core.versions import Provenance

        return Provenance(f"synthetic-qwen3-8b-seed{seed}", "h200-colocated", seed)

    def stage(self, seed: int, *, probe: bool = True, skip: str | None = None) -> Any:
        from rolloutcore.transports.source import WeightSource

        self.h4.fill(self.packed, seed)
        items = {n: t for n, t in self.packed.items() if n != skip}
        src = WeightSource.from_state_dict(items, description="trainer PackedWeights views")
        self.adapter.stage(src, provenance=self._prov(seed),
                           probes=self.probe if probe and self.use_probe else None)
        if skip is None:
            self.transport.precompute_checksum(self.packed)
        return self.identity(seed, skip)

    def train(self, freed_bytes: int | None) -> dict[str, Any]:
        torch = self.torch
        t = time.monotonic()
        if freed_bytes is None:
            freed_bytes = self._last_freed  # the bare sequence does not measure it
        self._last_freed = freed_bytes
        free, total = torch.cuda.mem_get_info()
        n = trainer_alloc_bytes(free, freed_bytes, self.cfg.trainer_fraction)
        big = torch.empty(n, dtype=torch.uint8, device="cuda:0")
        big.fill_(7)  # written, not just reserved
        ok = bool((big[-4096:] == 7).all())
        torch.cuda.synchronize()
        in_use = total - torch.cuda.mem_get_info()[0]
        del big
        torch.cuda.empty_cache()  # handed back, so that the engine can wake
        return {"bytes": n, "free_before": free, "device_in_use_during": in_use,
                "written": ok, "s": time.monotonic() - t}

    def _bare_update(self) -> dict[str, float]:
        ph: dict[str, float] = {}
        body = self.h4.encode_update(self.transport._message(self.packed), by_reference=False)
        _, ph["start"] = self.bare.post("/start_weight_update")
        _, ph["update"] = self.bare.post("/update_weights", {"update_info": body})
        _, ph["finish"] = self.bare.post("/finish_weight_update")
        self._sends += 1
        return ph

    def bare_l2(self, seed: int) -> dict[str, float]:
        self.h4.fill(self.packed, seed)
        body = self.h4.encode_update(self.transport._message(self.packed), by_reference=True)
        ph: dict[str, float] = {}
        for phase, route, params in bare_sequence(2):
            if phase == "train":
                self.train(None)
                continue
            payload = {"update_info": body} if phase == "update" else None
            _, ph[phase] = self.bare.post(route, payload, params=params)
        self._sends += 1
        ph["total"] = sum(ph.values())
        return ph

    def memory(self) -> dict[str, Any]:
        torch = self.torch
        out: dict[str, Any] = {}
        free, total = torch.cuda.mem_get_info()
        out["device_free_mib"], out["device_total_mib"] = free >> 20, total >> 20
        out["trainer_reserved_mib"] = torch.cuda.memory_reserved() >> 20
        with contextlib.suppress(Exception):
            out["smi_gpu"] = parse_smi_gpu(subprocess.run(
                ["nvidia-smi", "--query-gpu=memory.used,memory.total",
                 "--format=csv,noheader,nounits"], capture_output=True, text=True,
                timeout=20).stdout)
        apps: dict[int, int] = {}
        with contextlib.suppress(Exception):
            apps = parse_smi_apps(subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory",
                 "--format=csv,noheader,nounits"], capture_output=True, text=True,
                timeout=20).stdout)
        out["smi_apps_mib"] = {str(k): v for k, v in apps.items()}
        me = os.getpid()
        engine = {p: v for p, v in apps.items() if p != me}
        if engine:
            out["engine_mib"] = sum(engine.values())
            out["engine_mib_source"] = "nvidia-smi compute apps other than the trainer"
        else:
            used = (total - free) >> 20
            out["engine_mib"] = max(0, used - out["trainer_reserved_mib"] - 600)
            out["engine_mib_source"] = ("device used minus the trainer's reserved memory and "
                                        "~600 MiB of its CUDA context (nvidia-smi shows no "
                                        "processes in this container)")
        with contextlib.suppress(Exception):
            out["vllm"] = self.transport.engine_memory(self.engine.base_url)
        return out

    def send_count(self) -> int:
        return self._sends

    def bring_back(self, seed: int) -> None:
        with contextlib.suppress(Exception):
            if self.bare.get("/is_sleeping").get("is_sleeping"):
                self.bare.post("/wake_up")
        self.transport._staging = None
        self.torch.cuda.empty_cache()
        self._fresh_controller(seed)

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.stop()
        import shutil

        shutil.rmtree(self.model_dir, ignore_errors=True)


# ====================================================================== main

T0 = time.monotonic()


def stage_recorder(R: dict[str, Any], out: Path, log: Callable[[str], None],
                   save: Callable[[], object] | None = None) -> Callable[[str], Any]:
    """``stage(name)``: a context that records the stage's time or its error in ``R``
    (the run goes on) and then saves what was measured so far (``save``, else
    ``colocated.partial.json``), so a run cut short keeps it.
    ``diagnostics/gpu/h200_native_routes.py`` uses it too."""

    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:
        t = time.monotonic()
        log(f"== {name}")
        try:
            yield
            R["stages"][name] = {"ok": True, "s": round(time.monotonic() - t, 3)}
        except Exception as exc:
            R["stages"][name] = {"ok": False, "s": round(time.monotonic() - t, 3)}
            R["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            log(f"!! {name} failed: {type(exc).__name__}: {exc}")
        finally:
            with contextlib.suppress(Exception):  # survives a run cut short
                if save is not None:
                    save()
                else:
                    (out / "colocated.partial.json").write_text(
                        json.dumps(R, indent=1, default=str))
    return stage


def finish(R: dict[str, Any], out: Path) -> int:
    a = summarize(R)
    for k in ("verified_phase_medians_s", "bare_phase_medians_s"):
        a[k] = R.get("colocated_l2", {}).get(k)
    abl = R.get("ablation_nomem", {}).get("verified", [])
    a["verified_l2_nomem_s"] = _med([r["total_s"] for r in abl if r.get("published")])
    ap = R.get("ablation_probe", {})
    b2 = a.get("bare_l2_s")
    for k in ("probe1", "noprobe"):
        v = _med([r["total_s"] for r in ap.get(k, {}).get("verified", []) if r.get("published")])
        a[f"verified_l2_{k}_s"] = v
        a[f"verified_l2_{k}_over_bare"] = v / b2 if v and b2 else None
    a["probe_on_serving_engine_s"] = ap.get("probe_on_serving_engine_s")
    a["problems"] = check_artifact(a)
    R["wall_s"] = time.monotonic() - T0
    doc = {**a, "goals": dict(GOALS), "machine": R.get("machine"),
           "versions": R.get("versions"), "command": R.get("commands", [""])[0],
           "tree_sha256": (R.get("versions") or {}).get("tree_sha256"), "detail": R}
    (out / ARTIFACT_NAME).write_text(json.dumps(doc, indent=1, default=str))
    (out / "colocated.md").write_text(results_table(a))
    print(results_table(a), flush=True)
    for k, v in R["errors"].items():
        print(f"ERROR in {k}: {v.splitlines()[0]}", flush=True)
    ok = not a["problems"] and not R["errors"]
    print("COLOCATED OK" if ok else "COLOCATED HAS PROBLEMS", flush=True)
    return 0 if ok else 1


def _tree_bytes() -> int | None:
    try:
        r = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
                            "--exclude-standard"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    total = 0
    for name in r.stdout.split(b"\0"):
        if name:
            with contextlib.suppress(OSError):
                total += (REPO / name.decode()).stat().st_size
    return total


def plan_main(cfg: HarnessConfig) -> int:
    """Print the plan with the real engine command (``ManagedEngine.command``) and check it."""
    from rolloutcore.engine.process import ManagedEngine

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
        cmd = ManagedEngine(d, backend=BACKEND, port=8000, scale_out=False,
                            max_model_len=4096, extra_args=engine_args(cfg),
                            env=engine_env()).command()
    pieces = sorted((REPO / ".carry").glob("piece-*"))
    sizes = {f".carry/{p.name}": p.stat().st_size for p in pieces}
    if (REPO / ".carry/MANIFEST").exists():
        sizes[".carry/MANIFEST"] = (REPO / ".carry/MANIFEST").stat().st_size
    plan = build_plan(cfg, engine_command=cmd, n_pieces=len(pieces) or 7,
                      tree_bytes=_tree_bytes(), piece_bytes=sizes)
    plan["problems"] = validate_plan(plan)
    print(json.dumps(plan, indent=1))
    print("PLAN OK" if not plan["problems"] else
          f"PLAN HAS {len(plan['problems'])} PROBLEM(S)", flush=True)
    return 0 if not plan["problems"] else 1


def selftest_main(cfg: HarnessConfig, out: Path) -> int:
    """Every stage's logic on the fake engine: the artifact as the H200 run writes it."""
    R: dict[str, Any] = {"stages": {}, "errors": {}, "commands": ["selftest"],
                         "machine": "fake engine (CPU)", "versions": {"selftest": True}}
    rig = FakeRig()
    run_stages(rig, cfg, R, stage_recorder(R, out, lambda m: None))
    return finish(R, out)


def versions(h4: Any) -> dict[str, Any]:
    v: dict[str, Any] = h4.versions()
    import hashlib

    h = hashlib.sha256()
    for f in sorted([*(REPO / "src" / "rolloutcore").rglob("*.py"), Path(__file__),
                     HERE / "h200_8b_ipc.py"]):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    v["tree_sha256"] = h.hexdigest()
    return v


def gpu_main(cfg: HarnessConfig, out: Path) -> int:
    R: dict[str, Any] = {"stages": {}, "errors": {}, "commands": [
        " ".join([sys.executable, *sys.argv])], "config": dataclasses.asdict(cfg)}
    rig: H200Rig | None = None

    def log(m: str) -> None:
        print(f"[{time.monotonic() - T0:7.1f}s] {m}", flush=True)

    stage = stage_recorder(R, out, log)
    try:
        with stage("trainer_weights"):
            rig = H200Rig(cfg, R, out)
            R["versions"] = versions(rig.h4)
            import torch

            R["machine"] = (f"{torch.cuda.get_device_name(0)}, {platform.node()}, "
                            f"{os.cpu_count()} CPUs")
            R["model"] = {"tensors": len(rig.packed.entries), "bytes": rig.packed.nbytes}
            log(json.dumps(R["versions"]))
        if rig is None:
            return finish(R, out)
        with stage("engine_start"):
            rig.start()
            log(f"engine healthy in {rig.engine.last_start_s:.1f}s")
        if not rig.engine.alive() or "engine_start" in R["errors"]:
            return finish(R, out)
        with stage("warmup"):
            R["warmup"] = rig.warmup()
        run_stages(rig, cfg, R, stage)
    finally:
        if rig is not None:
            logs = sorted(rig.logs.glob("*.log")) if rig.logs.is_dir() else []
            for i, f in enumerate(logs[-2:]):
                with contextlib.suppress(OSError):
                    (out / f"vllm-{i + 1}.log").write_bytes(f.read_bytes()[-2_000_000:])
            rig.close()
    return finish(R, out)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                    help="print and check the plan; needs neither CUDA nor vLLM")
    ap.add_argument("--selftest", action="store_true",
                    help="run every stage's logic against the fake engine (CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--reps-l2", type=int, default=9)
    ap.add_argument("--reps-l1", type=int, default=3)
    ap.add_argument("--ablation-reps", type=int, default=5)
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--probe-tokens", type=int, default=2)
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="start the engine without --enforce-eager (about 25 s slower)")
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        cfg = HarnessConfig(reps_l2=args.reps_l2, reps_l1=args.reps_l1,
                            ablation_reps=args.ablation_reps, gpu_util=args.gpu_util,
                            probe_tokens=args.probe_tokens,
                            enforce_eager=not args.cuda_graphs)
    except ValueError as exc:
        print(f"bad configuration: {exc}", file=sys.stderr)
        return 2
    if args.plan:
        return plan_main(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.selftest:
        return selftest_main(cfg, out)
    return gpu_main(cfg, out)


if __name__ == "__main__":
    sys.exit(main())
