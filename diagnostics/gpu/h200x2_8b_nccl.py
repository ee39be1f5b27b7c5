#!/usr/bin/env python3
"""Two H200s: NCCL hot transitions of a Qwen3-8B-shaped model, and kills mid-broadcast.

For an ``nvidia-h200-x2`` machine with vLLM 0.26.0 carried there by the
one-GPU kit (``prepare_carry.sh`` / ``install_on_device.sh``, see
``docs/gpu-2x-nccl.md``). Topology: vLLM on one GPU (``CUDA_VISIBLE_DEVICES``
of the server) started with ``--weight-transfer-config '{"backend":"nccl"}'``;
the trainer on the other GPU holding Qwen3-8B-shaped bf16 weights (its own
random values); RolloutCore's NCCL driver (``transports.nccl.NcclTransport``:
target-aware finish, CUDA device-thread guard, identity preflight) under the
runner's deadlines.

Phases (``--phases``, each writes ``<phase>.json``; ``--assemble`` merges them
into ``h200x2-8b-nccl.json``):

``hot``
    RolloutCore transitions over NCCL (validated while paused by the workers'
    parameter checksums) interleaved with the bare primitive sequence (pause,
    start, update + broadcast, finish, reset, resume; no checks) on the same
    engine, communicator and weights; a GPU0 -> GPU1 copy of the same bytes;
    stop + start to health (the restart baseline).
``kill-engine``
    The engine's process group SIGKILLed at about half of the broadcast
    (a byte counter in the trainer's source, or a timer at half the measured
    transfer): when the controller classifies, that the trainer's call
    returns with a typed error, what the driver's abort does to the blocked
    collective (and whether ``ncclCommAbort`` then frees it), that nothing is
    published, and recovery to READY on the other GPU under a new epoch.
``kill-trainer``
    A trainer *process* SIGKILLed at half of its broadcast, the controller
    holding a lease through RolloutCore's ``UpdateManager``: classification
    at the lease, what the engine does, recovery onto the freed GPU.

NVLink multicast stays off everywhere (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``): set in
this process before CUDA starts, and forced into every child environment.

vLLM 0.26.0 (the last release that matches the device image's torch) has
the worker half of the ``nccl`` backend but registers no trainer engine in
``WeightTransferTrainerFactory`` and its HTTP sync client's finish takes no
version. ``make_nccl_transport`` (``rolloutcore.transports.compat.vllm026``)
therefore gives the driver a trainer engine that runs vLLM's own round (as
vLLM 0.32's ``NCCLTrainerWeightTransferEngine`` does) on 0.26's pieces:
``nccl_common.trainer_init`` for the rendezvous and
``NCCLWeightTransferEngine.trainer_send_weights`` for the broadcast. Where
the factory has ``nccl`` (vLLM >= 0.27) the driver's default path is used.
The paused validation's evidence is the workers' block checksum of every
parameter (``rolloutcore.transports.compat.param_checksums``: the worker
extension vLLM loads, and the validator). This module keeps the experiment.

``--plan`` prints and checks the plan (commands, environments, phases,
deadlines, device calls) without CUDA or vLLM. The module's top level
imports the standard library only (``--plan`` needs no rolloutcore on the
path); the names that moved into ``src/`` resolve on first use.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "ARTIFACT_KEYS",
    "ARTIFACT_NAME",
    "MULTICAST_OFF",
    "PHASES",
    "HalfwayTrigger",
    "HarnessConfig",
    "KillRecord",
    "RecordingAdapter",
    "TransitionClock",
    "apply_multicast_off",
    "assemble_artifact",
    "build_plan",
    "check_artifact",
    "child_env",
    "choose_recovery_gpu",
    "compare_checksum_lists",
    "device_calls",
    "drive_remote_update",
    "engine_args",
    "engine_env",
    "engine_param_sources",
    "multicast_violations",
    "nccl_transports",
    "runner_deadlines",
    "summarize_kill",
    "supervised_update",
    "tap_bytes",
    "timer_delay_s",
    "validate_plan",
]

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
T = TypeVar("T")

#: NVLink multicast off in NCCL, PyTorch and NVSHMEM (KINDS.md: a program that
#: uses it can take the host's shared GPUs out of service for a day or more).
MULTICAST_OFF: Mapping[str, str] = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

PHASES = ("hot", "kill-engine", "kill-trainer")
ARTIFACT_NAME = "h200x2-8b-nccl.json"
ARTIFACT_KEYS = ("hot_s", "bare_primitives_s", "restart_s", "ratio", "nccl_gbps",
                 "p2p_copy_gbps", "kill_engine_classify_s", "kill_trainer_classify_s",
                 "published_unvalidated")
WORKER_EXTENSION = "rolloutcore.transports.compat.param_checksums.ParamChecksumExtension"
CHILD_TAG = "RCX2 "  # prefix of the trainer child's protocol lines on stdout
DEFAULT_STATE = "/tmp/rc-x2"
SEND_THREAD = "rolloutcore-nccl-send"  # the driver's side thread (run_side name)


# ====================================================================== env hygiene

def multicast_violations(env: Mapping[str, str]) -> list[str]:
    """Names of the multicast switches that ``env`` does not hold off."""
    return [k for k, v in MULTICAST_OFF.items() if env.get(k) != v]


def apply_multicast_off(environ: MutableMapping[str, str]) -> None:
    """Turn multicast off in ``environ`` (this process's, before CUDA starts)."""
    for k, v in MULTICAST_OFF.items():
        environ[k] = v


def child_env(extra: Mapping[str, str] | None = None,
              base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child process: ``base`` (default ``os.environ``) + ``extra``,
    with multicast forced off. ``extra`` may repeat the off values but never another."""
    env = dict(os.environ if base is None else base)
    for k, v in (extra or {}).items():
        if k in MULTICAST_OFF and str(v) != MULTICAST_OFF[k]:
            raise ValueError(f"{k}={v!r} would turn NVLink multicast on; it must stay "
                             f"{MULTICAST_OFF[k]!r} on this machine")
        env[k] = str(v)
    env.update(MULTICAST_OFF)
    return env


# ====================================================================== configuration

@dataclass(frozen=True)
class HarnessConfig:
    """Everything a run depends on; the plan is built from it alone."""

    engine_gpu: int = 1
    trainer_gpu: int = 0
    reps: int = 5
    warmups: int = 2
    gpu_util: float = 0.45
    max_model_len: int = 4096
    transfer_deadline_s: float = 10.0
    adapter_slack_s: float = 5.0
    kill_fraction: float = 0.5
    kill_mode: str = "bytes"
    recover_gpu: str = "other"
    observe_s: float = 20.0
    startup_timeout_s: float = 420.0
    fence_s: float = 10.0
    cancel_grace_s: float = 5.0
    phases: tuple[str, ...] = PHASES
    nccl_debug: bool = True

    def __post_init__(self) -> None:
        if self.trainer_gpu != 0:
            # The runner runs every effect on a fresh thread, whose current CUDA
            # device is 0; the driver's device guard refuses a send from a thread
            # on another device than the one it was connected on.
            raise ValueError("the in-process trainer must be on cuda:0 (trainer_gpu=0)")
        if self.engine_gpu not in (0, 1) or self.engine_gpu == self.trainer_gpu:
            raise ValueError("engine_gpu must be the other of the two GPUs")
        for name in ("reps", "warmups", "max_model_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "warmups"
                                                                      else 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("transfer_deadline_s", "adapter_slack_s", "observe_s",
                     "startup_timeout_s", "fence_s", "cancel_grace_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
        if not 0.0 < self.gpu_util < 0.9:
            raise ValueError("gpu_util must be in (0, 0.9)")
        if not 0.05 <= self.kill_fraction <= 0.95:
            raise ValueError("kill_fraction must be in [0.05, 0.95]")
        if self.kill_mode not in ("bytes", "timer"):
            raise ValueError("kill_mode must be 'bytes' or 'timer'")
        if self.recover_gpu not in ("other", "same", "0", "1"):
            raise ValueError("recover_gpu must be other, same, 0 or 1")
        bad = [p for p in self.phases if p not in PHASES]
        if not self.phases or bad:
            raise ValueError(f"phases must be among {PHASES}, got {self.phases!r}")

    @property
    def lease_s(self) -> float:
        """The remote trainer's lease: the same bound as an in-process transfer."""
        return self.transfer_deadline_s

    @property
    def adapter_transfer_timeout_s(self) -> float:
        """Longer than the runner's deadline, so that the watchdog (cancel -> abort) fires."""
        return self.transfer_deadline_s + self.adapter_slack_s


def runner_deadlines(cfg: HarnessConfig) -> dict[str, float]:
    """``runner.Deadlines`` keyword arguments for this run."""
    return {"drain_s": 120.0, "pause_s": 60.0, "preflight_s": 30.0,
            "transfer_s": cfg.transfer_deadline_s, "reset_s": 30.0, "validate_s": 60.0,
            "resume_s": 30.0, "live_validate_s": 60.0, "bootstrap_s": 180.0,
            "recover_s": cfg.startup_timeout_s + 180.0, "fence_s": cfg.fence_s,
            "cancel_grace_s": cfg.cancel_grace_s, "retry_backoff_s": 0.2}


def engine_args(cfg: HarnessConfig) -> list[str]:
    """``vllm serve`` flags beyond the launcher's (backend, dtype, model len, port)."""
    return ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
            "--gpu-memory-utilization", str(cfg.gpu_util),
            "--worker-extension-cls", WORKER_EXTENSION]


def engine_env(cfg: HarnessConfig, gpu: int, pythonpath: str,
               state: str = DEFAULT_STATE) -> dict[str, str]:
    """The engine's environment overrides: its GPU, multicast off, our module importable."""
    env = {"CUDA_VISIBLE_DEVICES": str(gpu), "VLLM_USE_FLASHINFER_SAMPLER": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath, **MULTICAST_OFF}
    if cfg.nccl_debug:
        env.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,SHM,NET",
                   NCCL_DEBUG_FILE=f"{state}/nccl-engine.%h.%p.log")
    return env


def trainer_child_env(cfg: HarnessConfig, gpu: int, state: str = DEFAULT_STATE
                      ) -> dict[str, str]:
    extra = {"CUDA_VISIBLE_DEVICES": str(gpu), "PYTHONUNBUFFERED": "1"}
    if cfg.nccl_debug:
        extra.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,SHM,NET",
                     NCCL_DEBUG_FILE=f"{state}/nccl-trainer-child.%h.%p.log")
    return child_env(extra)


# ====================================================================== the plan

def device_calls(n_pieces: int = 7, *, state: str = DEFAULT_STATE) -> list[dict[str, Any]]:
    """The device tool calls, in order, each within ~30 s of the previous one.

    Pieces come from helper-4's ``prepare_carry.sh`` (52 MB each); every call
    carries one piece so that piece + working tree stay under 64 MiB.
    """
    if n_pieces < 1:
        raise ValueError("n_pieces must be >= 1")
    exports = ("export PYTHONPATH=/tmp/site:$PWD/src:$PWD/diagnostics/gpu PYTHONUNBUFFERED=1 "
               + " ".join(f"{k}={v}" for k, v in MULTICAST_OFF.items()))
    run = "python3 diagnostics/gpu/h200x2_8b_nccl.py"
    calls: list[dict[str, Any]] = []
    for i in range(n_pieces - 1):
        p = f".carry/piece-{i:02d}"
        carry = [p, ".carry/MANIFEST"] if i == 0 else [p]
        cmd = (f"mkdir -p /tmp/rc-carry && cp {' '.join(carry)} /tmp/rc-carry/ && "
               + ("nvidia-smi -L && nvidia-smi topo -m" if i == 0 else "ls /tmp/rc-carry"))
        calls.append({"kind": "nvidia-h200-x2", "carry": carry, "timeout_s": 120,
                      "command": cmd})
    last = f".carry/piece-{n_pieces - 1:02d}"
    calls.append({
        "kind": "nvidia-h200-x2", "carry": [last], "timeout_s": 600,
        "command": (f"set -o pipefail; mkdir -p /tmp/rc-carry && cp {last} /tmp/rc-carry/ && "
                    f"bash diagnostics/gpu/install_on_device.sh && {exports} && "
                    f"{run} --phases hot --state {state} --out $OUT 2>&1 | tee $OUT/hot.log")})
    calls.append({
        "kind": "nvidia-h200-x2", "carry": [], "timeout_s": 600,
        "command": (f"set -o pipefail; {exports} && {run} --phases kill-engine,kill-trainer "
                    f"--state {state} --out $OUT --assemble 2>&1 | tee $OUT/kill.log")})
    return calls


def build_plan(cfg: HarnessConfig, *,
               engine_command: Callable[[int], list[str]] | None = None,
               pythonpath: str = "<PYTHONPATH>:diagnostics/gpu",
               n_pieces: int = 7, tree_bytes: int | None = None,
               piece_bytes: Mapping[str, int] | None = None) -> dict[str, Any]:
    """What a run will do, as data: phases, GPUs, processes and their environments,
    deadlines, the kill logic, the artifact keys and the device calls."""
    e, t = cfg.engine_gpu, cfg.trainer_gpu
    d = runner_deadlines(cfg)
    rec_first = choose_recovery_gpu(cfg.recover_gpu, engine_gpu=e, trainer_gpu=t,
                                    trainer_gpu_clean=True)[0]
    child_gpu = e if rec_first == t else t
    rec_second = choose_recovery_gpu(cfg.recover_gpu, engine_gpu=rec_first,
                                     trainer_gpu=child_gpu, trainer_gpu_clean=True)[0]

    def proc(role: str, gpu: int, env: Mapping[str, str], cmd: list[str] | None) -> dict[str, Any]:
        keep = {k: v for k, v in env.items()
                if k in MULTICAST_OFF or k.startswith(("CUDA_", "NCCL_", "VLLM_", "PYTHON"))}
        return {"role": role, "gpu": gpu, "env": keep, "command": cmd}

    def engine(role: str, gpu: int) -> dict[str, Any]:
        cmd = engine_command(gpu) if engine_command is not None else None
        return proc(role, gpu, engine_env(cfg, gpu, pythonpath), cmd)

    harness_env = child_env({}, base={})
    phases = [
        {"name": "hot", "engine_gpu": e, "trainer_gpu": t,
         "processes": [engine("engine", e),
                       proc("trainer (this process, cuda:0)", t, harness_env, None)],
         "steps": ["trainer weights (16.38 GB bf16, 399 tensors) on cuda:0",
                   "engine cold start; reference checksums of its dummy-init parameters",
                   "RolloutCore bootstrap (VllmAdapter + NcclTransport: NCCL rendezvous)",
                   f"{cfg.warmups} bare warm-ups + 1 RolloutCore warm-up transition",
                   f"{cfg.reps} x (RolloutCore transition, bare primitive sequence)",
                   "GPU0 -> GPU1 copy of the same bytes", "stop + start to health"],
         "deadlines": d, "measures": ["hot_s", "bare_primitives_s", "restart_s", "nccl_gbps",
                                      "p2p_copy_gbps", "published_unvalidated"]},
        {"name": "kill-engine", "engine_gpu": e, "trainer_gpu": t,
         "processes": [engine("engine", e), engine("recovered engine", rec_first),
                       proc("trainer (this process, cuda:0)", t, harness_env, None)],
         "steps": ["engine cold start, bootstrap, 2 bare rounds on the driver's "
                   "communicator (warm NCCL, measure T)",
                   f"transition with the engine SIGKILLed at {cfg.kill_fraction:.0%} of the "
                   f"broadcast ({cfg.kill_mode})",
                   f"runner deadline {cfg.transfer_deadline_s:g}s -> cancel -> driver abort",
                   "ncclCommAbort of the trainer's communicator; GPU check; free trainer",
                   f"recovery: new engine on GPU {rec_first}, new epoch, verified"],
         "kill": {"mode": cfg.kill_mode, "fraction": cfg.kill_fraction,
                  "signal": "SIGKILL to the engine's process group"},
         "target": {"classify_within_s": cfg.transfer_deadline_s + 1.0},
         "deadlines": d, "measures": ["kill_engine_classify_s", "published_unvalidated"]},
        {"name": "kill-trainer", "engine_gpu": rec_first, "trainer_gpu": child_gpu,
         "processes": [proc("trainer child", child_gpu, trainer_child_env(cfg, child_gpu),
                            [sys.executable if engine_command else "python3",
                             "diagnostics/gpu/h200x2_8b_nccl.py", "--trainer-child", "<spec>"]),
                       engine("recovered engine", rec_second)],
         "steps": ["trainer child: weights, NCCL rendezvous, waits for GO",
                   f"UpdateManager.begin (lease {cfg.lease_s:g}s), GO",
                   f"child SIGKILLed at {cfg.kill_fraction:.0%} of its broadcast",
                   "lease expiry classifies; engine observed "
                   f"for {cfg.observe_s:g}s", f"recovery onto GPU {rec_second}"],
         "lease_s": cfg.lease_s,
         "target": {"classify_within_s": cfg.lease_s + 1.0},
         "deadlines": d, "measures": ["kill_trainer_classify_s", "published_unvalidated"]},
    ]
    calls = device_calls(n_pieces)
    if tree_bytes is not None:
        for c in calls:
            c["bytes"] = tree_bytes + sum((piece_bytes or {}).get(p, 0) for p in c["carry"])
    return {"config": dataclasses.asdict(cfg),
            "adapter_transfer_timeout_s": cfg.adapter_transfer_timeout_s,
            "phases": [p for p in phases if p["name"] in cfg.phases],
            "artifact": {"name": ARTIFACT_NAME, "keys": list(ARTIFACT_KEYS)},
            "device_calls": calls}


def validate_plan(plan: Mapping[str, Any]) -> list[str]:
    """Problems with a plan (empty: fine). Checked before anything starts."""
    out: list[str] = []
    cfg = plan.get("config", {})
    d_transfer = float(cfg.get("transfer_deadline_s", 0))
    if not plan.get("adapter_transfer_timeout_s", 0) > d_transfer:
        out.append("the adapter's transfer timeout must exceed the runner's deadline "
                   "(else the watchdog cancel path is never exercised)")
    measured: set[str] = set()
    for ph in plan.get("phases", []):
        name = ph.get("name")
        if ph.get("engine_gpu") == ph.get("trainer_gpu"):
            out.append(f"{name}: engine and trainer on the same GPU (NCCL needs two)")
        for p in ph.get("processes", []):
            bad = multicast_violations(p.get("env", {}))
            if bad:
                out.append(f"{name}/{p.get('role')}: multicast not off: {bad}")
            if p.get("gpu") not in (0, 1):
                out.append(f"{name}/{p.get('role')}: GPU {p.get('gpu')!r} not on this host")
            if "engine" in str(p.get("role")) and \
                    p.get("env", {}).get("CUDA_VISIBLE_DEVICES") != str(p.get("gpu")):
                out.append(f"{name}/{p.get('role')}: CUDA_VISIBLE_DEVICES is not its GPU")
        for k, v in ph.get("deadlines", {}).items():
            if not isinstance(v, (int, float)) or not v > 0:
                out.append(f"{name}: deadline {k} must be > 0")
        tgt = ph.get("target", {}).get("classify_within_s")
        if tgt is not None and tgt > d_transfer + 1.0 + 1e-9:
            out.append(f"{name}: classification target {tgt} exceeds transfer deadline + 1 s")
        if name == "kill-trainer" and ph.get("lease_s", 0) > d_transfer:
            out.append("kill-trainer: the lease is longer than the transfer deadline")
        measured.update(ph.get("measures", []))
    names = {ph.get("name") for ph in plan.get("phases", [])}
    if set(PHASES) <= names:
        missing = [k for k in ARTIFACT_KEYS if k not in measured and k != "ratio"]
        if missing:
            out.append(f"artifact keys no phase measures: {missing}")
    for i, c in enumerate(plan.get("device_calls", [])):
        if len(c.get("command", "")) > 2000:
            out.append(f"device call {i + 1}: command longer than 2000 characters")
        if len(c.get("carry", [])) > 8:
            out.append(f"device call {i + 1}: more than 8 carry paths")
        if c.get("bytes", 0) > 64 * 1024 * 1024:
            out.append(f"device call {i + 1}: {c['bytes']} bytes exceed 64 MiB")
        if "python3 diagnostics/gpu/h200x2_8b_nccl.py" in c.get("command", "") and \
                multicast_violations(_exports(c["command"])):
            out.append(f"device call {i + 1}: runs the harness without multicast off")
    return out


def _exports(command: str) -> dict[str, str]:
    return dict(re.findall(r"\b([A-Z_][A-Z0-9_]*)=(\S+)", command))


# ====================================================================== kill timing

class HalfwayTrigger:
    """Fires once, when the bytes handed to the broadcaster reach ``fraction`` of the total."""

    def __init__(self, total_bytes: int, fraction: float = 0.5) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes < 1:
            raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        self.total = total_bytes
        self.fraction = fraction
        self.threshold = max(1, math.ceil(total_bytes * fraction))
        self.seen = 0
        self.fired_at: int | None = None
        self.fired_t: float | None = None

    def observe(self, nbytes: int) -> bool:
        """Count ``nbytes`` more; True exactly once, at the crossing."""
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        self.seen += nbytes
        if self.fired_at is None and self.seen >= self.threshold:
            self.fired_at = self.seen
            self.fired_t = time.monotonic()
            return True
        return False

    @property
    def fraction_at_fire(self) -> float | None:
        return None if self.fired_at is None else self.fired_at / self.total


def tap_bytes(items: Iterable[tuple[str, T]], nbytes: Callable[[T], int],
              trigger: HalfwayTrigger, on_fire: Callable[[], None]) -> Iterator[tuple[str, T]]:
    """Pass ``items`` through; call ``on_fire`` once the consumer has taken half the bytes.

    The check runs when the consumer asks for the next item, so at the firing
    exactly the bytes already handed over have been counted.
    """
    for name, t in items:
        yield name, t
        if trigger.observe(nbytes(t)):
            on_fire()


def timer_delay_s(measured_transfer_s: float, fraction: float) -> float:
    """Delay of a kill timer started with the transfer: ``fraction`` of its measured time."""
    if not measured_transfer_s > 0 or not math.isfinite(measured_transfer_s):
        raise ValueError("measured_transfer_s must be a finite number > 0")
    if not 0.0 < fraction < 1.0:
        raise ValueError("fraction must be in (0, 1)")
    return measured_transfer_s * fraction


# ====================================================================== bookkeeping

class TransitionClock:
    """A controller listener that timestamps every state transition."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self.events: list[tuple[float, str, str]] = []

    def __call__(self, rec: Any) -> None:
        from rolloutcore.core.records import Transition  # lazily: this module is stdlib-only

        if isinstance(rec, Transition):
            with self._lock:
                self.events.append((self._clock(), rec.before.value, rec.after.value))

    def first_to(self, state: str, after: float) -> float | None:
        """When the controller first entered ``state`` at or after ``after``."""
        with self._lock:
            for t, _, to in self.events:
                if to == state and t >= after:
                    return t
        return None


@dataclass
class KillRecord:
    """Times (monotonic seconds) and facts of one kill scenario."""

    scenario: str
    deadline_s: float
    t_update_start: float | None = None
    t_transfer_start: float | None = None   # in-process transfer, or the lease's begin
    t_kill: float | None = None
    t_dead: float | None = None
    t_classified: float | None = None       # controller entered TAINTED
    t_call_returned: float | None = None    # run_update raised / the lease was decided
    t_trainer_returned: float | None = None  # the trainer's transfer call returned
    trainer_error: str | None = None
    trainer_error_typed: bool | None = None
    classification: str | None = None
    failed_phase: str | None = None
    state_after: str | None = None
    kill_fraction_at_fire: float | None = None
    published_before: list[str] = field(default_factory=list)
    published_after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _dt(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else b - a


def summarize_kill(r: KillRecord) -> dict[str, Any]:
    """The scenario's verdicts: classified in time, typed return, nothing published."""
    from_kill = _dt(r.t_kill, r.t_classified)
    from_start = _dt(r.t_transfer_start, r.t_classified)
    target = r.deadline_s + 1.0
    new = [v for v in r.published_after if v not in r.published_before]
    return {
        "scenario": r.scenario,
        "killed": r.t_kill is not None,
        "kill_fraction_at_fire": r.kill_fraction_at_fire,
        "kill_to_dead_s": _dt(r.t_kill, r.t_dead),
        "classified": r.t_classified is not None,
        "classify_from_kill_s": from_kill,
        "classify_from_transfer_start_s": from_start,
        "target_s": target,
        "within_target": (from_kill is not None and from_kill <= target
                          and from_start is not None and from_start <= target),
        "classification": r.classification,
        "failed_phase": r.failed_phase,
        "state_after": r.state_after,
        "trainer_returned": r.t_trainer_returned is not None,
        "trainer_return_after_classify_s": _dt(r.t_classified, r.t_trainer_returned),
        "trainer_return_from_transfer_start_s": _dt(r.t_transfer_start, r.t_trainer_returned),
        "trainer_error": r.trainer_error,
        "trainer_error_typed": r.trainer_error_typed,
        "published_during": new,
        "published_unvalidated": bool(new),
        "call_returned_after_classify_s": _dt(r.t_classified, r.t_call_returned),
        "notes": list(r.notes),
    }


def recover_and_record(controller: Any, rcv: Any, run: Any, gpu: int, why: str,
                       eng: Any) -> dict[str, Any]:
    """Run RolloutCore's recovery onto ``gpu`` and describe what it reached."""
    from rolloutcore.control.runner import LifecycleRunner

    r = LifecycleRunner(controller, RecordingAdapter(None), run.deadlines())
    t = time.monotonic()
    r.recover(rcv)
    return {"gpu": gpu, "why": why, "s": time.monotonic() - t,
            "timings": rcv.timings, "state": controller.state.value,
            "committed": controller.committed and controller.committed.to_dict(),
            "ready": controller.state.value == "READY"
            and controller.committed is not None
            and controller.committed.engine_epoch == rcv.engine.epoch,
            "old_epoch": eng.epoch}


def choose_recovery_gpu(requested: str, *, engine_gpu: int, trainer_gpu: int,
                        trainer_gpu_clean: bool) -> tuple[int, str]:
    """Where the replacement engine goes, and why.

    ``other`` is the trainer's GPU (the dead engine's GPU then hosts the next
    trainer); it is refused when the trainer's GPU may still run a collective
    that never completed (``trainer_gpu_clean`` false), and the dead engine's
    GPU is used instead.
    """
    if requested == "same":
        return engine_gpu, "requested: the dead engine's GPU"
    want = trainer_gpu if requested == "other" else int(requested)
    if want not in (0, 1):
        raise ValueError(f"no GPU {want} on this host")
    if want == trainer_gpu and not trainer_gpu_clean:
        return engine_gpu, (f"GPU {trainer_gpu} may still run the trainer's blocked NCCL "
                            f"kernel: recovering on the dead engine's GPU {engine_gpu}")
    return want, ("the trainer's GPU, freed" if want == trainer_gpu
                  else "requested: the dead engine's GPU")


# ====================================================================== checksum layout
# The layout mapping, the comparison and the validator are product code now
# (``rolloutcore.transports.compat.param_checksums``; the comparison itself is
# ``verification.checksums.compare_lists``): this module keeps thin delegates.


def engine_param_sources(engine_names: Sequence[str],
                         trainer_names: Iterable[str]) -> dict[str, tuple[str, ...]]:
    """For each engine parameter, the trainer tensors whose bytes it holds (``param_checksums``)."""
    from rolloutcore.transports.compat import param_checksums

    return param_checksums.engine_param_sources(engine_names, trainer_names)


def compare_checksum_lists(want_names: Sequence[str], want: Sequence[int | None],
                           got_names: Sequence[str], got: Sequence[int]) -> dict[str, Any]:
    """The trainer's per-parameter checksums against the engine's (``param_checksums``)."""
    from rolloutcore.transports.compat import param_checksums

    return param_checksums.compare_param_checksums(want_names, want, got_names, got)


_VIA = re.compile(r"\bvia\s+((?:P2P|SHM|NET|COLLNET)(?:/[A-Za-z0-9_]+)*)")


def nccl_transports(text: str) -> dict[str, int]:
    """How NCCL connected its channels, counted from ``NCCL_DEBUG=INFO`` lines."""
    return dict(Counter(m.group(1) for m in _VIA.finditer(text)))


# ====================================================================== artifact

def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def assemble_artifact(parts: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The artifact from the phases' results (``hot``, ``kill-engine``, ``kill-trainer``)."""
    hot = parts.get("hot", {})
    ke = parts.get("kill-engine", {})
    kt = parts.get("kill-trainer", {})
    a: dict[str, Any] = {}
    first = next((p for p in (hot, ke, kt) if p), {})
    a["device"] = first.get("device")
    a["versions"] = first.get("versions")
    a["commands"] = [c for p in (hot, ke, kt) for c in p.get("commands", [])]
    a["hot_s"] = _num(hot.get("hot_s"))
    a["bare_primitives_s"] = _num(hot.get("bare_primitives_s"))
    a["restart_s"] = _num(hot.get("restart_s"))
    a["ratio"] = (a["restart_s"] / a["hot_s"]) if a["restart_s"] and a["hot_s"] else None
    a["hot_over_bare"] = (a["hot_s"] / a["bare_primitives_s"]
                          if a["hot_s"] and a["bare_primitives_s"] else None)
    a["nccl_gbps"] = _num(hot.get("nccl_gbps"))
    a["p2p_copy_gbps"] = _num(hot.get("p2p_copy_gbps"))
    a["nccl_fraction_of_p2p"] = (a["nccl_gbps"] / a["p2p_copy_gbps"]
                                 if a["nccl_gbps"] and a["p2p_copy_gbps"] else None)
    ks = ke.get("summary", {})
    ts = kt.get("summary", {})
    a["kill_engine_classify_s"] = _num(ks.get("classify_from_kill_s"))
    a["kill_trainer_classify_s"] = _num(ts.get("classify_from_kill_s"))
    flags = [x.get("published_unvalidated") for x in (hot, ks, ts)]
    known = [f for f in flags if isinstance(f, bool)]
    a["published_unvalidated"] = any(known) if known else None
    a["published_unvalidated_by_phase"] = dict(zip(PHASES, flags, strict=True))
    a["kill_engine_within_target"] = ks.get("within_target")
    a["kill_trainer_within_target"] = ts.get("within_target")
    a["recovered"] = {k: parts.get(k, {}).get("recovery", {}).get("ready")
                      for k in ("kill-engine", "kill-trainer")}
    a["phases"] = {k: dict(v) for k, v in parts.items()}
    a["missing_keys"] = [k for k in ARTIFACT_KEYS if a.get(k) is None]
    a["complete"] = not a["missing_keys"]
    a["summary"] = {k: a.get(k) for k in ARTIFACT_KEYS}
    return a


def check_artifact(a: Mapping[str, Any]) -> list[str]:
    """Problems with an artifact: keys, types, consistency (empty: fine)."""
    out: list[str] = []
    for k in ARTIFACT_KEYS:
        if k not in a:
            out.append(f"key {k} absent")
    for k in ("hot_s", "bare_primitives_s", "restart_s", "ratio", "nccl_gbps",
              "p2p_copy_gbps", "kill_engine_classify_s", "kill_trainer_classify_s"):
        v = a.get(k)
        if v is not None and (_num(v) is None or not v > 0 or not math.isfinite(v)):
            out.append(f"{k} must be a positive finite number or null, got {v!r}")
    pu = a.get("published_unvalidated")
    if pu is not None and not isinstance(pu, bool):
        out.append("published_unvalidated must be a bool or null")
    if a.get("hot_s") and a.get("restart_s") and a.get("ratio") and \
            abs(a["ratio"] - a["restart_s"] / a["hot_s"]) > 1e-6 * a["ratio"]:
        out.append("ratio is not restart_s / hot_s")
    nulls = sorted(k for k in ARTIFACT_KEYS if a.get(k) is None)
    if sorted(a.get("missing_keys", [])) != nulls:
        out.append("missing_keys does not list exactly the null keys")
    for k in ("device", "versions", "commands"):
        if k not in a:
            out.append(f"key {k} absent")
    return out


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def results_table(a: Mapping[str, Any]) -> str:
    rows = [
        "| measure | value | note |", "| --- | --- | --- |",
        f"| hot_s (RolloutCore NCCL transition, median) | {_f(a.get('hot_s'), '.4f')} s | |",
        f"| bare_primitives_s | {_f(a.get('bare_primitives_s'), '.4f')} s | no checks |",
        f"| hot / bare | {_f(a.get('hot_over_bare'), '.3f')} | |",
        f"| restart_s (stop + start to health) | {_f(a.get('restart_s'), '.1f')} s | |",
        f"| ratio restart / hot | {_f(a.get('ratio'), '.0f')} | |",
        f"| nccl_gbps (bytes / update+broadcast) | {_f(a.get('nccl_gbps'), '.1f')} GB/s | |",
        f"| p2p_copy_gbps (GPU0 -> GPU1 copy_) | {_f(a.get('p2p_copy_gbps'), '.1f')} GB/s | |",
        f"| nccl / p2p | {_f(a.get('nccl_fraction_of_p2p'), '.1%')} | |",
        f"| kill_engine_classify_s (kill -> TAINTED) | "
        f"{_f(a.get('kill_engine_classify_s'), '.2f')} s | within target: "
        f"{a.get('kill_engine_within_target')} |",
        f"| kill_trainer_classify_s (kill -> TAINTED) | "
        f"{_f(a.get('kill_trainer_classify_s'), '.2f')} s | within target: "
        f"{a.get('kill_trainer_within_target')} |",
        f"| published_unvalidated | {a.get('published_unvalidated')} | must be False |",
        f"| recovered to READY (new epoch) | {a.get('recovered')} | |",
    ]
    if a.get("missing_keys"):
        rows.append(f"\nMissing: {', '.join(a['missing_keys'])}")
    return "\n".join(rows) + "\n"


# ====================================================================== runner-level pieces
# (pure Python over RolloutCore's runner; the unit tests drive them with the fake engine)

class RecordingAdapter:
    """Delegates the port to ``inner``; records when the transfer call starts and returns.

    ``on_transfer_start`` runs on the transfer's own thread before the call
    (the timer-mode kill is armed there).
    """

    def __init__(self, inner: Any, on_transfer_start: Callable[[], None] | None = None
                 ) -> None:
        self.inner = inner
        self.on_transfer_start = on_transfer_start
        self.t_transfer_start: float | None = None
        self.t_transfer_returned: float | None = None
        self.transfer_error: BaseException | None = None

    @property
    def caches(self) -> tuple[Any, ...]:
        return tuple(self.inner.caches)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def reset(self) -> None:
        self.t_transfer_start = self.t_transfer_returned = None
        self.transfer_error = None

    def transfer(self, target: Any) -> Any:
        self.t_transfer_start = time.monotonic()
        try:
            if self.on_transfer_start is not None:
                self.on_transfer_start()
            return self.inner.transfer(target)
        except BaseException as exc:
            self.transfer_error = exc
            raise
        finally:
            self.t_transfer_returned = time.monotonic()


def supervised_update(runner: Any, clock: TransitionClock, identity: Any, record: KillRecord,
                      adapter: RecordingAdapter, **run_kwargs: Any) -> Any:
    """``runner.run_update`` with the kill scenario's bookkeeping filled into ``record``.

    Returns the outcome when the update published (it should not), else None.
    """
    from rolloutcore.errors import RolloutCoreError, UpdateFailed

    c = runner.controller
    record.published_before = [v.label for v in c.published]
    adapter.reset()
    record.t_update_start = time.monotonic()
    outcome = None
    try:
        outcome = runner.run_update(identity, **run_kwargs)
    except UpdateFailed as exc:
        record.classification = exc.classification
        record.failed_phase = exc.phase
    record.t_call_returned = time.monotonic()
    record.t_transfer_start = adapter.t_transfer_start
    record.t_classified = clock.first_to("TAINTED", record.t_update_start)
    # The transfer's thread is given cancel_grace_s to unwind after the cancel.
    grace = getattr(runner.deadlines, "cancel_grace_s", 5.0)
    end = time.monotonic() + grace
    while adapter.t_transfer_returned is None and time.monotonic() < end:
        time.sleep(0.01)
    record.t_trainer_returned = adapter.t_transfer_returned
    err = adapter.transfer_error
    record.trainer_error = None if err is None else f"{type(err).__name__}: {err}"
    record.trainer_error_typed = None if err is None else isinstance(err, RolloutCoreError)
    record.state_after = c.state.value
    record.published_after = [v.label for v in c.published]
    return outcome


class RemoteTrainer:
    """What ``drive_remote_update`` needs from a trainer in another process."""

    def go(self, label: str) -> None:
        raise NotImplementedError

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        raise NotImplementedError

    def kill(self) -> float:
        """SIGKILL it; returns when it is gone (monotonic time of death)."""
        raise NotImplementedError


async def drive_remote_update(manager: Any, begin: Mapping[str, Any], trainer: RemoteTrainer,
                              clock: TransitionClock, record: KillRecord, *,
                              kill_on_half: bool = True, max_wait_s: float = 600.0,
                              poll_s: float = 0.02) -> dict[str, Any]:
    """One update by a remote trainer under RolloutCore's lease (``UpdateManager``).

    Begin (drain, pause, preflight, lease), tell the trainer to go, relay its
    report, and SIGKILL it when it says it is halfway; then wait until the
    update is decided (report or lease expiry). Fills ``record``.
    """
    from rolloutcore.service.control import BeginBody, ReportBody

    c = manager.runner.controller
    record.published_before = [v.label for v in c.published]
    record.t_update_start = time.monotonic()
    code, g = await manager.begin(BeginBody.model_validate(dict(begin)))
    out: dict[str, Any] = {"begin_status": code, "begin": g}
    if code != 201:
        record.notes.append(f"begin refused: {code} {g}")
        record.state_after = c.state.value
        return out
    uid = int(g["update_id"])
    secret = str(g["lease"]["secret"])  # every later call of the update presents it
    record.t_transfer_start = time.monotonic()  # the lease runs from here
    trainer.go(str(g["target"]["label"]))
    events: list[dict[str, Any]] = []
    end = time.monotonic() + max_wait_s
    while time.monotonic() < end:
        code, d = manager.get(uid, secret)
        if code == 200 and d["status"] not in ("open", "reporting") and d["result"]:
            break
        ev = await asyncio.to_thread(trainer.next_event, poll_s)
        if ev is None:
            continue
        events.append({**ev, "t_rel": time.monotonic() - record.t_transfer_start})
        kind = ev.get("event")
        if kind == "half" and kill_on_half and record.t_kill is None:
            record.t_kill = time.monotonic()
            record.kill_fraction_at_fire = ev.get("fraction")
            record.t_dead = await asyncio.to_thread(trainer.kill)
        elif kind == "report":
            code, _ = await manager.report(uid, ReportBody.model_validate(
                {"transfer": ev["transfer"]}), secret)
            out["report_status"] = code
        elif kind == "error":
            fk = "error" if ev.get("mutation_started", True) else "refused"
            code, _ = await manager.report(uid, ReportBody.model_validate(
                {"failure": {"kind": fk, "reason": str(ev.get("error", "trainer error"))[:3000]}}),
                secret)
            out["report_status"] = code
    code, d = manager.get(uid, secret)
    if code != 200:
        d = {}
    record.t_call_returned = time.monotonic()
    record.t_classified = clock.first_to("TAINTED", record.t_update_start)
    result = d.get("result") or {}
    record.classification = result.get("classification")
    record.failed_phase = result.get("phase")
    record.state_after = c.state.value
    record.published_after = [v.label for v in c.published]
    out.update(status=d.get("status"), result=result, events=events)
    return out


# ====================================================================== GPU machine: vLLM side
# vLLM's workers load the checksum extension from rolloutcore
# (``param_checksums.ParamChecksumExtension``, ``WORKER_EXTENSION``), not from here.


# ====================================================================== GPU machine: trainer side

def load_helper4() -> Any:
    """helper-4's one-GPU harness module (Qwen3-8B config, specs, fill, Http, versions)."""
    name = "h200_8b_ipc"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, HERE / "h200_8b_ipc.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _moved(module: str, name: str) -> Any:
    return getattr(importlib.import_module(module), name)


#: Product code that lived here, now in ``src/`` (vLLM 0.26 stand-ins, the checksum
#: worker extension); resolved on first use (PEP 562) so that the top level stays
#: standard-library only and ``--plan`` needs no rolloutcore import.
_MOVED: Mapping[str, tuple[str, str]] = {
    "NcclChecksumExtension": ("rolloutcore.transports.compat.param_checksums",
                              "ParamChecksumExtension"),
    "TrainerEngineHolder": ("rolloutcore.transports.compat.vllm026", "TrainerEngineHolder"),
    "Nccl026TrainerEngine": ("rolloutcore.transports.compat.vllm026", "Nccl026TrainerEngine"),
    "sync_client_026": ("rolloutcore.transports.compat.vllm026", "sync_client_026"),
    "native_nccl_trainer": ("rolloutcore.transports.compat.vllm026", "native_nccl_trainer"),
}


def __getattr__(name: str) -> Any:
    where = _MOVED.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return _moved(*where)


def nccl026_transport_class() -> Any:
    """``NcclTransport`` whose init info is a plain dict (``compat.vllm026.Nccl026Transport``)."""
    return _moved("rolloutcore.transports.compat.vllm026", "Nccl026Transport")


def make_nccl_transport(*, packed: bool = True, **kwargs: Any) -> tuple[Any, Any]:
    """RolloutCore's NCCL driver with the trainer engine this vLLM needs (``compat.vllm026``)."""
    return _moved("rolloutcore.transports.compat.vllm026", "make_nccl_transport")(
        packed=packed, **kwargs)


def gated_source(source: Any, trigger: HalfwayTrigger, on_fire: Callable[[], None]) -> Any:
    """The same ``WeightSource`` (same manifest, same tensors) with a byte-counting tap."""
    from rolloutcore.transports.source import WeightSource

    entries = [(p.name, tuple(p.shape), p.dtype) for p in source.manifest().params]
    return WeightSource(entries, lambda: tap_bytes(
        source.named_tensors(), lambda t: int(t.numel() * t.element_size()), trigger, on_fire),
        f"{source.description} (kill tap at {trigger.fraction:.0%})")


def run_with_timeout(fn: Callable[[], T], timeout_s: float, name: str) -> tuple[bool, Any]:
    """(finished, result-or-error) of ``fn`` on a daemon thread: GPU calls after a kill
    can block forever (a cudaFree waits for a stuck kernel)."""
    from rolloutcore.transports.base import run_side

    fut = run_side(fn, name)
    try:
        return True, fut.result(timeout=timeout_s)
    except TimeoutError:
        return False, f"still blocked after {timeout_s:g}s"
    except Exception as exc:
        return True, f"{type(exc).__name__}: {exc}"


def send_thread_alive() -> bool:
    return any(t.name == SEND_THREAD and t.is_alive() for t in threading.enumerate())


class Trainer:
    """The trainer's weights (helper-4's ``PackedWeights`` + ``fill``) and their views."""

    def __init__(self, device: str = "cuda:0") -> None:
        import torch

        from rolloutcore.transports.cuda_ipc import PackedWeights
        from rolloutcore.transports.source import WeightSource

        self.h4 = load_helper4()
        self.specs = self.h4.qwen3_specs(self.h4.QWEN3_8B)
        self.packed = PackedWeights([(n, s, torch.bfloat16) for n, s in self.specs],
                                    device=device)
        self.source = WeightSource.from_state_dict(dict(self.packed.items()),
                                                   description="trainer PackedWeights views")
        self.seed = 0

    def fill(self, seed: int) -> None:
        self.h4.fill(self.packed, seed)
        self.seed = seed

    def identity(self, seed: int) -> Any:
        from rolloutcore.core.versions import Provenance, WeightIdentity

        return WeightIdentity.declare(self.source.manifest(), Provenance(
            f"synthetic-qwen3-8b-seed{seed}", "h200x2-harness", seed))

    def provenance(self, seed: int) -> Any:
        from rolloutcore.core.versions import Provenance

        return Provenance(f"synthetic-qwen3-8b-seed{seed}", "h200x2-harness", seed)

    def engine_layout_views(self, names: Sequence[str], nbytes: Sequence[int]) -> tuple[
            list[Any], list[bool]]:
        """Byte views of the trainer's tensors in the engine's parameter order
        (``param_checksums.engine_layout_views``)."""
        from rolloutcore.transports.compat.param_checksums import engine_layout_views

        return engine_layout_views(self.packed, names, nbytes)


def _http_rpc(http: Any) -> Callable[[str, float], tuple[list[Any], float]]:
    """``/collective_rpc`` over helper-4's ``Http`` (its ``post`` returns (body, seconds))."""

    def rpc(method: str, timeout_s: float) -> tuple[list[Any], float]:
        body, dt = http.post("/collective_rpc", {"method": method, "args": [],
                                                 "timeout": timeout_s}, timeout=timeout_s + 10)
        return (body.get("results") if isinstance(body, dict) else body), dt

    return rpc


def nccl_checksum_validator(http: Any, trainer: Trainer | None, *,
                            timeout_s: float = 60.0) -> Any:
    """The paused validation's transport check (``param_checksums.ParamChecksumValidator``)
    over ``http``, staging from ``trainer``'s weights (None: compare only)."""
    from rolloutcore.transports.compat.param_checksums import ParamChecksumValidator

    return ParamChecksumValidator(_http_rpc(http), None if trainer is None
                                  else trainer.engine_layout_views, timeout_s=timeout_s)


def reference_check(http: Any, reference: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """A fresh engine's parameter checksums against the dummy-init reference (seeded,
    so the same on every start of the same shapes)."""
    from rolloutcore.core.evidence import Check
    from rolloutcore.core.versions import VerificationLevel

    v = nccl_checksum_validator(http, None)
    got = v.engine_params()
    cmp = compare_checksum_lists(reference["names"], reference["values"], got["names"],
                                 got["values"])
    cmp["engine_s"] = got.get("elapsed_s")
    chk = Check("dummy_init_param_block_checksum", bool(cmp["passed"]),
                detail=f"vLLM dummy init (seed 1234) of the same shapes, reference taken on a "
                       f"cold start; compared={cmp['compared']} mismatched={cmp['n_mismatched']}",
                coverage=float(cmp["coverage"]), level=VerificationLevel.ENGINE_CHECKSUM)
    return chk, cmp


class DummyCheckpointRecoverer:
    """``port.Recoverer``: a new engine process on a chosen GPU, verified by checksums.

    RolloutCore's ``ManagedRecoverer`` needs a checkpoint on disk and
    ``/update_weight_version``; vLLM 0.26 has no such route, and this run has
    no checkpoint. The known checkpoint here is vLLM's dummy initialisation
    (seeded per parameter), verified against the checksums a cold start gave.
    """

    def __init__(self, old: Any, make_engine: Callable[[int], Any], gpu: int,
                 reference: Mapping[str, Any], identity: Any) -> None:
        self.old, self.make_engine, self.gpu = old, make_engine, gpu
        self.reference, self.identity = reference, identity
        self.engine: Any = None
        self.timings: dict[str, Any] = {}

    def replace_engine(self, target: Any) -> Any:
        from rolloutcore.core.evidence import RecoveryEvidence, ValidationEvidence

        h4 = load_helper4()
        t0 = time.monotonic()
        if self.old is not None:
            with contextlib.suppress(Exception):
                self.timings["old_epoch"] = self.old.epoch
            self.old.stop(grace_s=5.0)
        self.timings["stop_s"] = time.monotonic() - t0
        eng = self.make_engine(self.gpu)
        self.engine = eng
        ts = time.monotonic()
        eng.start()
        self.timings.update(start_s=time.monotonic() - ts, new_epoch=eng.epoch, gpu=self.gpu,
                            base_url=eng.base_url)
        http = h4.Http(eng.base_url)
        chk, cmp = reference_check(http, self.reference)
        self.timings["reference_compare"] = {k: cmp[k] for k in
                                             ("passed", "compared", "n_mismatched", "coverage")}
        paused = bool(http.get("/is_paused").get("is_paused"))
        val = ValidationEvidence(None, False, paused=paused, checks=(chk,), unverified=(
            "vLLM 0.26: no weight_version; the recovered engine carries no label",))
        self.timings["total_s"] = time.monotonic() - t0
        return RecoveryEvidence(engine_epoch=eng.epoch, identity=self.identity, validation=val,
                                healthy=True, unverified=val.unverified)

    def cancel(self) -> None:
        if self.engine is not None and self.engine.alive():
            with contextlib.suppress(Exception):
                self.engine.signal_group(signal.SIGKILL)


# ====================================================================== the run

class Run:
    """One process's run: results, engines, and the shared helpers of the phases."""

    def __init__(self, cfg: HarnessConfig, out: Path, state: Path) -> None:
        self.cfg, self.out, self.state = cfg, out, state
        self.t0 = time.monotonic()
        self.engines: list[Any] = []
        self.model_dir = Path("/tmp/rc-x2-qwen3-8b")
        self.log_dir = state / "engine-logs"

    def log(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)

    @contextlib.contextmanager
    def stage(self, res: dict[str, Any], name: str) -> Iterator[None]:
        t = time.monotonic()
        self.log(f"== {name}")
        try:
            yield
            res.setdefault("stages", {})[name] = {"ok": True, "s": round(time.monotonic() - t, 3)}
        except Exception as exc:
            res.setdefault("stages", {})[name] = {"ok": False, "s": round(time.monotonic() - t, 3)}
            res.setdefault("errors", {})[name] = (f"{type(exc).__name__}: {exc}\n"
                                                  f"{traceback.format_exc()}")
            self.log(f"!! {name} failed: {type(exc).__name__}: {exc}")

    def pythonpath(self) -> str:
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
        for p in (str(REPO / "src"), str(HERE)):
            if p not in parts:
                parts.append(p)
        return ":".join(parts)

    def new_engine(self, gpu: int) -> Any:
        from rolloutcore.engine.process import ManagedEngine

        h4 = load_helper4()
        self.model_dir.mkdir(parents=True, exist_ok=True)
        (self.model_dir / "config.json").write_text(json.dumps(h4.QWEN3_8B, indent=1))
        eng = ManagedEngine(self.model_dir, backend="nccl", scale_out=False,
                            max_model_len=self.cfg.max_model_len,
                            extra_args=engine_args(self.cfg),
                            env=engine_env(self.cfg, gpu, self.pythonpath(), str(self.state)),
                            log_dir=self.log_dir, startup_timeout_s=self.cfg.startup_timeout_s,
                            stop_grace_s=10)
        bad = multicast_violations(eng.environment())
        if bad:
            raise RuntimeError(f"engine environment has multicast on: {bad}")
        self.engines.append(eng)
        return eng

    def start_engine(self, res: dict[str, Any], gpu: int, key: str) -> Any:
        eng = self.new_engine(gpu)
        eng.start()
        res.setdefault("commands", []).append(" ".join(eng.command()))
        res.setdefault("engines", {})[key] = {"gpu": gpu, "epoch": eng.epoch,
                                              "cold_start_s": eng.last_start_s,
                                              "base_url": eng.base_url}
        self.log(f"engine {key} on GPU {gpu} healthy in {eng.last_start_s:.1f}s")
        return eng

    def deadlines(self) -> Any:
        from rolloutcore.control.runner import Deadlines

        return Deadlines(**runner_deadlines(self.cfg))

    def controller(self) -> tuple[Any, TransitionClock]:
        from rolloutcore.control.controller import LifecycleController
        from rolloutcore.core.evidence import CacheKind

        clock = TransitionClock()
        return LifecycleController(required_caches=(CacheKind.PREFIX,), listener=clock), clock

    def dummy_identity(self, trainer_manifest: Any) -> Any:
        from rolloutcore.core.versions import Provenance, WeightIdentity

        return WeightIdentity.declare(trainer_manifest, Provenance(
            "vllm-dummy-init-seed1234-qwen3-8b-shapes", "h200x2-harness", 0))

    def rolloutcore_stack(self, eng: Any, trainer: Trainer, controller: Any,
                          on_transfer_start: Callable[[], None] | None = None) -> dict[str, Any]:
        """VllmAdapter + NcclTransport (+ checksum validation, + transfer recording)."""
        from rolloutcore.control.runner import LifecycleRunner
        from rolloutcore.engine.http import VllmHTTP
        from rolloutcore.engine.port import VllmAdapter

        h4 = load_helper4()
        transport, holder = make_nccl_transport()
        http = h4.Http(eng.base_url)
        validator = nccl_checksum_validator(http, trainer)
        # The adapter's transport-check hook; taken at validation time, as on the
        # first two-GPU run (a262b60, where a wrapper around the adapter did the same).
        transport.validation_check = validator.validation_check
        inner = VllmAdapter(VllmHTTP(eng.base_url, timeout_s=120), transport,
                            engine_epoch=eng.epoch,
                            transfer_timeout_s=self.cfg.adapter_transfer_timeout_s,
                            early_transport_check=False)
        adapter = RecordingAdapter(inner, on_transfer_start)
        runner = LifecycleRunner(controller, adapter, self.deadlines())
        return {"transport": transport, "holder": holder, "http": http,
                "validator": validator, "adapter": adapter, "inner": inner, "runner": runner}

    def transition(self, st: dict[str, Any], trainer: Trainer, seed: int,
                   source: Any = None) -> Any:
        from rolloutcore.core.versions import VerificationLevel

        trainer.fill(seed)
        st["adapter"].stage(source if source is not None else trainer.source,
                            provenance=trainer.provenance(seed))
        st["staging_checksum_s"] = st["validator"].stage()
        return st["runner"].run_update(trainer.identity(seed),
                                       min_verification=VerificationLevel.ENGINE_CHECKSUM)

    def base_result(self) -> dict[str, Any]:
        import torch

        h4 = load_helper4()
        v = h4.versions()
        with contextlib.suppress(Exception):
            v["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
        with contextlib.suppress(Exception):
            v["gpu_topology"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                               text=True, timeout=20).stdout
        return {"device": [torch.cuda.get_device_name(i)
                           for i in range(torch.cuda.device_count())],
                "gpu_count": torch.cuda.device_count(), "versions": v,
                "config": dataclasses.asdict(self.cfg),
                "commands": [" ".join([sys.executable, *sys.argv])],
                "multicast_env": {k: os.environ.get(k) for k in MULTICAST_OFF}}

    def write(self, name: str, res: Mapping[str, Any]) -> None:
        data = json.dumps(res, indent=1, default=str)
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / f"{name}.json").write_text(data)
        (self.out / f"{name}.json").write_text(data)

    def stop_all(self) -> None:
        for e in self.engines:
            with contextlib.suppress(Exception):
                e.stop(grace_s=5.0)


def _med(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def bare_cycle(http: Any, comm: Any, trainer: Trainer) -> dict[str, float]:
    """pause, start, update + broadcast, finish, reset, resume: no checks at all."""
    from rolloutcore.transports.base import run_side

    items = list(trainer.source.named_tensors())
    info = {"names": [n for n, _ in items],
            "dtype_names": [str(t.dtype).rsplit(".", 1)[-1] for _, t in items],
            "shapes": [list(t.shape) for _, t in items], "packed": True}
    ph: dict[str, float] = {}
    t0 = time.monotonic()
    _, ph["pause"] = http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
    _, ph["start"] = http.post("/start_weight_update")
    t = time.monotonic()
    fut = run_side(lambda: http.post("/update_weights", {"update_info": info}, timeout=120.0),
                   "bare-update")
    _moved("rolloutcore.transports.compat.vllm026", "broadcast_026")(iter(items), comm, True)
    fut.result(timeout=120.0)
    ph["update"] = time.monotonic() - t
    _, ph["finish"] = http.post("/finish_weight_update")
    _, ph["reset"] = http.post("/reset_prefix_cache")
    _, ph["resume"] = http.post("/resume")
    ph["total"] = time.monotonic() - t0
    return ph


def p2p_copy(trainer: Trainer, dst_device: str, reps: int = 10) -> dict[str, Any]:
    """A GPU0 -> GPU1 copy of the trainer's buffer (the same bytes the broadcast moves)."""
    import torch

    src = trainer.packed.buffer
    d_src, d_dst = src.device, torch.device(dst_device)
    out: dict[str, Any] = {"bytes": int(src.numel()),
                           "peer_access": torch.cuda.can_device_access_peer(d_src.index,
                                                                            d_dst.index)}
    torch.cuda.synchronize(d_src)
    t = time.monotonic()
    y = src.to(d_dst)
    torch.cuda.synchronize(d_dst)
    out["to_s"] = time.monotonic() - t
    ts = []
    for _ in range(reps + 2):
        torch.cuda.synchronize(d_src)
        torch.cuda.synchronize(d_dst)
        t = time.monotonic()
        y.copy_(src)
        torch.cuda.synchronize(d_dst)
        torch.cuda.synchronize(d_src)
        ts.append(time.monotonic() - t)
    tm = _med(ts[2:])
    assert tm is not None
    out.update(copy_s=tm, copy_s_all=ts, p2p_copy_gbps=out["bytes"] / tm / 1e9,
               to_gbps=out["bytes"] / out["to_s"] / 1e9,
               note="torch copy_ of the trainer's whole buffer into a tensor on the other GPU, "
                    "both devices synchronised around it; median of reps after 2 warm-ups")
    del y
    with torch.cuda.device(d_dst):
        torch.cuda.empty_cache()
    return out


def nccl_logs(state: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in sorted(state.glob("nccl-*.log")):
        with contextlib.suppress(OSError):
            out[f.name] = nccl_transports(f.read_text(errors="replace"))
    return out


# ---------------------------------------------------------------------- phase: hot

def phase_hot(run: Run) -> dict[str, Any]:
    import torch

    cfg = run.cfg
    res = run.base_result()
    res["phase"] = "hot"
    trainer: Trainer | None = None
    eng: Any = None
    st: dict[str, Any] = {}
    with run.stage(res, "trainer_weights"):
        trainer = Trainer("cuda:0")
        trainer.fill(1)
        res["model"] = {"tensors": len(trainer.specs), "bytes": trainer.packed.nbytes}
    # Before the engine starts: on the first two-GPU run (a262b60) the copy came after the
    # benchmark and failed for memory, the engine's process holding 139 GiB of GPU 1
    # (--gpu-memory-utilization 0.45 notwithstanding).
    if trainer is not None:
        with run.stage(res, "p2p_copy"):
            res["p2p"] = p2p_copy(trainer, f"cuda:{cfg.engine_gpu}")
            res["p2p_copy_gbps"] = res["p2p"]["p2p_copy_gbps"]
            run.log(f"p2p copy {res['p2p_copy_gbps']:.1f} GB/s")
    with run.stage(res, "engine_start"):
        eng = run.start_engine(res, cfg.engine_gpu, "hot")
        res["cold_start_s"] = eng.last_start_s
    if trainer is None or eng is None:
        return res
    controller, _clock = run.controller()
    with run.stage(res, "bootstrap"):
        st = run.rolloutcore_stack(eng, trainer, controller)
        ref = st["validator"].learn_layout()
        res["dummy_reference"] = {"names": ref["names"], "values": ref["values"],
                                  "nbytes": ref["nbytes"], "engine_s": ref["elapsed_s"]}
        st["runner"].bootstrap(run.dummy_identity(trainer.source.manifest()))
        res["driver"] = {"transport": "rolloutcore.transports.nccl.NcclTransport",
                         "trainer_engine": st["holder"].kind,
                         "adapter": "VllmAdapter, transport check ParamChecksumValidator",
                         "runner": "LifecycleRunner", "deadlines": runner_deadlines(cfg)}
    if not st:
        return res
    comm = st["holder"].comm()
    http = st["http"]
    with run.stage(res, "warmup"):
        for i in range(cfg.warmups):
            trainer.fill(2 + i % 2)
            res.setdefault("warmup_bare", []).append(bare_cycle(http, comm, trainer))
        cal = st["validator"]
        cal.stage()
        res["checksum_calibration"] = cal.compare()
        o = run.transition(st, trainer, 1)
        res["warmup_transition"] = {"published": o.published and o.published.to_dict(),
                                    "breakdown": o.breakdown()}
    prompt = [(i * 7919 + 13) % 150000 + 100 for i in range(64)]
    with run.stage(res, "benchmark"):
        hot: list[dict[str, Any]] = []
        bare: list[dict[str, float]] = []
        before = None
        with contextlib.suppress(Exception):
            before = http.generate(prompt, 16)
        for r in range(cfg.reps):
            committed = trainer.seed
            if controller.state.value == "READY":
                # A failed transition is recorded and the bare sequence still measured.
                seed = 2 if trainer.seed == 1 else 1
                try:
                    o = run.transition(st, trainer, seed)
                except Exception as exc:
                    res.setdefault("transition_errors", []).append(
                        f"{type(exc).__name__}: {exc}")
                    trainer.fill(committed)
                else:
                    committed = seed
                    ident = controller.identity
                    hot.append({
                        "total_s": o.total_s, "breakdown": o.breakdown(),
                        "published": None if o.published is None else o.published.to_dict(),
                        "verification": None if ident is None else ident.verification.wire,
                        "transport_elapsed_s": o.phase_s("transfer"),
                        "staging_checksum_s": st.get("staging_checksum_s"),
                        "validation": dict(st["validator"].last)})
                    if r == 0:
                        with contextlib.suppress(Exception):
                            res["outputs_changed"] = before != http.generate(prompt, 16)
            trainer.fill(3 if committed != 3 else 4)
            bare.append(bare_cycle(http, comm, trainer))
            trainer.fill(committed)  # put the committed weights back, outside any timing
            bare_cycle(http, comm, trainer)
        res["benchmark"] = {"hot": hot, "bare": bare}
        res["hot_s"] = _med([h["total_s"] for h in hot])
        res["bare_primitives_s"] = _med([b["total"] for b in bare])
        upd = _med([b["update"] for b in bare])
        tr = _med([h["transport_elapsed_s"] for h in hot])
        res["bare_update_s"] = upd
        res["rolloutcore_transfer_s"] = tr
        res["nccl_gbps"] = trainer.packed.nbytes / upd / 1e9 if upd else None
        res["rolloutcore_transfer_gbps"] = trainer.packed.nbytes / tr / 1e9 if tr else None
        res["nccl_note"] = ("bytes of tensor data / the bare /update_weights call, which runs "
                            "concurrently with the trainer's packed broadcast and returns "
                            "when the workers have received and loaded everything")
        phases: dict[str, list[float]] = {}
        for h in hot:
            for k, v in h["breakdown"].items():
                phases.setdefault(k, []).append(v)
        res["hot_phase_medians_s"] = {k: _med(v) for k, v in phases.items()}
        res["bare_phase_medians_s"] = {k: _med([b[k] for b in bare]) for k in bare[0]}
        res["published_unvalidated"] = any(
            h["published"] is not None and h["verification"] != "engine-checksum" for h in hot)
        run.log(f"hot {_f(res['hot_s'], '.4f')}s bare {_f(res['bare_primitives_s'], '.4f')}s "
                f"nccl {_f(res['nccl_gbps'], '.1f')} GB/s")
    with run.stage(res, "restart"):
        with contextlib.suppress(Exception):
            st["transport"].close()
        eng.stop()
        stop_s = eng.last_stop_s or 0.0
        eng.start()
        res["restart_stop_s"], res["restart_start_s"] = stop_s, eng.last_start_s
        res["restart_s"] = stop_s + (eng.last_start_s or 0.0)
        _, cmp = reference_check(load_helper4().Http(eng.base_url), res["dummy_reference"])
        res["dummy_reference_reproducible"] = cmp["passed"]
        run.log(f"restart {res['restart_s']:.1f}s; dummy reference reproducible {cmp['passed']}")
    res["nccl_transports"] = nccl_logs(run.state)
    eng.stop()
    torch.cuda.synchronize()
    return res


# ---------------------------------------------------------------------- phase: kill-engine

@dataclass
class Carry:
    """What the kill-engine phase hands to kill-trainer in the same process."""

    controller: Any
    clock: TransitionClock
    engine: Any
    gpu: int
    reference: Mapping[str, Any]
    identity: Any


def phase_kill_engine(run: Run, hot: Mapping[str, Any] | None) -> tuple[dict[str, Any],
                                                                        Carry | None]:
    from rolloutcore.engine.process import _group_alive

    cfg = run.cfg
    res = run.base_result()
    res["phase"] = "kill-engine"
    trainer: Trainer | None = None
    eng: Any = None
    st: dict[str, Any] = {}
    rec = KillRecord("kill-engine", cfg.transfer_deadline_s)
    with run.stage(res, "trainer_weights"):
        trainer = Trainer("cuda:0")
    with run.stage(res, "engine_start"):
        eng = run.start_engine(res, cfg.engine_gpu, "victim")
    if trainer is None or eng is None:
        return res, None
    controller, clock = run.controller()
    arm: dict[str, Callable[[], None]] = {}
    with run.stage(res, "bootstrap"):
        st = run.rolloutcore_stack(eng, trainer, controller,
                                   on_transfer_start=lambda: arm.get("timer", lambda: None)())
        ref = st["validator"].learn_layout()
        reference = {"names": ref["names"], "values": ref["values"]}
        if hot and hot.get("dummy_reference"):
            h = hot["dummy_reference"]
            res["dummy_reference_matches_hot_phase"] = compare_checksum_lists(
                h["names"], h["values"], ref["names"], ref["values"])["passed"]
        identity0 = run.dummy_identity(trainer.source.manifest())
        st["runner"].bootstrap(identity0)
        res["trainer_engine"] = st["holder"].kind
    if not st:
        return res, None
    measured = cfg.transfer_deadline_s / 10
    with run.stage(res, "warmup"):
        # Bare rounds on the driver's own communicator: NCCL is warm and the transfer
        # time known, while the controller stays READY whatever the validation would say
        # (the kill transition never reaches validation).
        comm = st["holder"].comm()
        ups = []
        for seed in (1, 2):
            trainer.fill(seed)
            ups.append(bare_cycle(st["http"], comm, trainer)["update"])
        res["warm_update_s"] = ups
        measured = min(ups)

    def kill_engine() -> None:
        rec.t_kill = time.monotonic()
        try:
            eng.signal_group(signal.SIGKILL)
        except Exception as exc:
            rec.notes.append(f"kill failed: {exc!r}")
            return
        pgid = eng.pid
        end = time.monotonic() + 10.0
        while time.monotonic() < end and _group_alive(pgid):
            time.sleep(0.005)
        rec.t_dead = time.monotonic()

    trigger = HalfwayTrigger(trainer.source.nbytes, cfg.kill_fraction)

    def on_half() -> None:
        rec.kill_fraction_at_fire = trigger.fraction_at_fire
        kill_engine()

    with run.stage(res, "kill_transition"):
        seed = 3
        trainer.fill(seed)
        source = trainer.source
        if cfg.kill_mode == "bytes":
            source = gated_source(trainer.source, trigger, on_half)
        else:
            delay = timer_delay_s(measured, cfg.kill_fraction)
            res["kill_timer_s"] = delay

            def arm_timer() -> None:
                threading.Timer(delay, kill_engine).start()
                arm.pop("timer", None)

            arm["timer"] = arm_timer
        st["adapter"].stage(source, provenance=trainer.provenance(seed))
        st["validator"].stage()
        from rolloutcore.core.versions import VerificationLevel

        out = supervised_update(st["runner"], clock, trainer.identity(seed), rec, st["adapter"],
                                min_verification=VerificationLevel.ENGINE_CHECKSUM)
        res["published_outcome"] = None if out is None else out.breakdown()
        res["committed_after"] = controller.committed and controller.committed.to_dict()
        run.log(f"kill: classified {rec.classification} state {rec.state_after}")
    with run.stage(res, "abort_effects"):
        # What the driver's abort did: it forgets the group; the broadcast thread?
        res["send_thread_alive_after_driver_abort"] = send_thread_alive()
        comm = st["holder"].comm()
        t = time.monotonic()
        done, why = run_with_timeout(lambda: comm.destroy() if comm is not None else None,
                                     20.0, "comm-abort")
        res["comm_abort"] = {"returned": done, "detail": why, "s": time.monotonic() - t}
        end = time.monotonic() + 10.0
        while send_thread_alive() and time.monotonic() < end:
            time.sleep(0.05)
        res["send_thread_alive_after_comm_abort"] = send_thread_alive()
        ok, val = run_with_timeout(lambda: _gpu_probe(0), 15.0, "gpu0-probe")
        res["trainer_gpu_probe"] = {"finished": ok, "value": val}
        clean = ok and val == 2.0 and not res["send_thread_alive_after_comm_abort"]
        res["trainer_gpu_clean"] = clean

        def free() -> Any:
            import gc

            import torch

            nonlocal trainer
            st.clear()
            trainer = None
            gc.collect()
            torch.cuda.empty_cache()
            return torch.cuda.memory_allocated(0)

        ok, left = run_with_timeout(free, 30.0, "free-trainer")
        res["trainer_freed"] = {"finished": ok, "allocated_after": left}
        res["gpu_memory_used_mib"] = _smi_memory()
    gpu, why = choose_recovery_gpu(cfg.recover_gpu, engine_gpu=cfg.engine_gpu,
                                   trainer_gpu=cfg.trainer_gpu,
                                   trainer_gpu_clean=bool(res.get("trainer_gpu_clean")))
    res["summary"] = summarize_kill(rec)
    carry: Carry | None = None
    with run.stage(res, "recovery"):

        rcv = DummyCheckpointRecoverer(eng, run.new_engine, gpu, reference, identity0)
        res["recovery"] = recover_and_record(controller, rcv, run, gpu, why, eng)
        carry = Carry(controller, clock, rcv.engine, gpu, reference, identity0)
        run.log(f"recovered on GPU {gpu}: {res['recovery']['state']} "
                f"epoch {rcv.engine.epoch}")
    res["nccl_transports"] = nccl_logs(run.state)
    res["summary"] = summarize_kill(rec)
    res["record"] = dataclasses.asdict(rec)
    return res, carry


def _gpu_probe(index: int) -> float:
    import torch

    x = torch.ones(1, device=f"cuda:{index}") * 2
    torch.cuda.synchronize(index)
    return float(x.item())


def _smi_memory() -> Any:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used",
                            "--format=csv,noheader,nounits"], capture_output=True, text=True,
                           timeout=20)
        return {int(a): int(b) for a, b in (ln.split(",") for ln in r.stdout.strip().splitlines())}
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------------- phase: kill-trainer

class ChildTrainer(RemoteTrainer):
    """The trainer child process: JSON lines on stdout (``CHILD_TAG``), GO on stdin."""

    def __init__(self, cmd: list[str], env: Mapping[str, str], log: Path) -> None:
        import queue

        self._q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._log = open(log, "w")  # noqa: SIM115 - closed by the reader thread
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=dict(env), text=True,
                                     start_new_session=True, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            if line.startswith(CHILD_TAG):
                with contextlib.suppress(ValueError):
                    self._q.put(json.loads(line[len(CHILD_TAG):]))
        self._log.close()

    def next_event(self, timeout_s: float) -> dict[str, Any] | None:
        import queue

        try:
            return self._q.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def wait_for(self, kind: str, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            ev = self.next_event(0.2)
            if ev is not None and ev.get("event") == kind:
                return ev
            if ev is not None and ev.get("event") == "error":
                raise RuntimeError(f"trainer child failed: {ev}")
            if self.proc.poll() is not None and self._q.empty():
                raise RuntimeError(f"trainer child exited with {self.proc.returncode}")
        raise TimeoutError(f"trainer child: no {kind!r} within {timeout_s:g}s")

    def go(self, label: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"go": True, "label": label}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> float:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        return time.monotonic()


def observe_engine(eng: Any, seconds: float) -> list[dict[str, Any]]:
    """What a trainer's death leaves the engine doing: health, pause query, liveness."""
    import httpx

    samples = []
    t0 = time.monotonic()
    for at in (0.0, 2.0, 5.0, 10.0, seconds):
        if at > seconds:
            continue
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        s: dict[str, Any] = {"t": round(time.monotonic() - t0, 2), "alive": eng.alive()}
        for path in ("/health", "/is_paused"):
            try:
                r = httpx.get(eng.base_url + path, timeout=3.0)
                s[path] = r.status_code
            except Exception as exc:
                s[path] = type(exc).__name__
        samples.append(s)
    return samples


def phase_kill_trainer(run: Run, carry: Carry | None) -> dict[str, Any]:
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service.config import ServiceConfig
    from rolloutcore.service.control import UpdateManager
    from rolloutcore.service.metrics import ServiceMetrics

    cfg = run.cfg
    res = run.base_result()
    res["phase"] = "kill-trainer"
    rec = KillRecord("kill-trainer", cfg.lease_s)
    h4 = load_helper4()
    specs = h4.qwen3_specs(h4.QWEN3_8B)
    from rolloutcore.core.versions import ParameterManifest, Provenance, WeightIdentity

    manifest = ParameterManifest.from_items((n, s, "bfloat16") for n, s in specs)
    if carry is None:
        with run.stage(res, "engine_start"):
            eng = run.start_engine(res, cfg.engine_gpu, "standalone")
            controller, clock = run.controller()
            v = nccl_checksum_validator(h4.Http(eng.base_url), None)
            got = v.learn_layout()
            reference = {"names": got["names"], "values": got["values"]}
            identity0 = run.dummy_identity(manifest)
            ad = VllmAdapter(VllmHTTP(eng.base_url, timeout_s=30), None, engine_epoch=eng.epoch)
            LifecycleRunner(controller, ad, run.deadlines()).bootstrap(identity0)
            carry = Carry(controller, clock, eng, cfg.engine_gpu, reference, identity0)
    if carry is None:
        return res
    eng, controller, clock = carry.engine, carry.controller, carry.clock
    child_gpu = 1 - carry.gpu
    res["layout"] = {"engine_gpu": carry.gpu, "trainer_child_gpu": child_gpu,
                     "engine_epoch": eng.epoch}
    child: ChildTrainer | None = None
    with run.stage(res, "child_ready"):
        spec = {"engine_url": eng.base_url, "seed": 5, "fraction": cfg.kill_fraction,
                "deadline_s": cfg.adapter_transfer_timeout_s, "hold_s": 120.0}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trainer-child",
               json.dumps(spec)]
        env = trainer_child_env(cfg, child_gpu, str(run.state))
        env["PYTHONPATH"] = run.pythonpath()
        res["commands"].append(f"CUDA_VISIBLE_DEVICES={child_gpu} " + " ".join(cmd))
        child = ChildTrainer(cmd, env, run.state / "trainer-child.log")
        ready = child.wait_for("ready", 300.0)
        res["child_ready"] = ready
    if child is None or "child_ready" not in res:
        if child is not None:
            child.kill()
        return res
    with run.stage(res, "lease_kill"):
        ad = VllmAdapter(VllmHTTP(eng.base_url, timeout_s=30), None, engine_epoch=eng.epoch)
        ad.bootstrap()  # reads the routes (cache resets); no transport to connect
        runner = LifecycleRunner(controller, ad, run.deadlines())
        # The experiment measures how a killed trainer's lease is classified, not
        # verification: the floor of its begin stays what it was ("declared").
        scfg = ServiceConfig(upstream_url=eng.base_url, control_token="h200x2-harness-0123456789",
                             lease_s=cfg.lease_s, transport={"backend": "nccl"},
                             min_verification="declared")
        metrics = ServiceMetrics(controller)
        controller.add_listener(metrics.listener)
        mgr = UpdateManager(runner, scfg, metrics)
        ident = WeightIdentity.declare(manifest, Provenance("synthetic-qwen3-8b-seed5",
                                                            "h200x2-harness-child", 5))
        body = {"identity": {"manifest_digest": ident.manifest_digest,
                             "provenance": {"checkpoint": ident.provenance.checkpoint,
                                            "trainer_run": ident.provenance.trainer_run,
                                            "step": ident.provenance.step}},
                "owner": "trainer-child", "lease_s": cfg.lease_s,
                "source_manifest_digest": res["child_ready"].get("manifest_digest")}
        drive = asyncio.run(drive_remote_update(mgr, body, child, clock, rec,
                                                max_wait_s=cfg.lease_s + 120.0))
        res["drive"] = {k: v for k, v in drive.items() if k != "begin"}
        rec.t_trainer_returned = None  # the trainer is dead: nothing of it returns
        res["trainer_exit_code"] = child.proc.returncode
        run.log(f"lease: {drive.get('status')} {rec.classification} state {rec.state_after}")
    with run.stage(res, "engine_after_trainer_death"):
        res["engine_samples"] = observe_engine(eng, cfg.observe_s)
    res["summary"] = summarize_kill(rec)
    with run.stage(res, "recovery"):
        gpu, why = choose_recovery_gpu(cfg.recover_gpu, engine_gpu=carry.gpu,
                                       trainer_gpu=child_gpu,
                                       trainer_gpu_clean=child.proc.poll() is not None)
        rcv = DummyCheckpointRecoverer(eng, run.new_engine, gpu, carry.reference, carry.identity)
        res["recovery"] = recover_and_record(controller, rcv, run, gpu, why, eng)
        run.log(f"recovered on GPU {gpu}: {controller.state.value}")
    res["record"] = dataclasses.asdict(rec)
    res["nccl_transports"] = nccl_logs(run.state)
    return res


# ---------------------------------------------------------------------- the trainer child

def emit(event: str, **data: Any) -> None:
    print(CHILD_TAG + json.dumps({"event": event, "t": time.time(), **data}, default=str),
          flush=True)


def trainer_child_main(spec: Mapping[str, Any]) -> int:
    """A trainer in its own process (killed by the parent halfway through its broadcast)."""
    import torch

    from rolloutcore.errors import RolloutCoreError

    try:
        torch.cuda.set_device(0)
        tr = Trainer("cuda:0")
        tr.fill(int(spec["seed"]))
        transport, holder = make_nccl_transport()
        url = str(spec["engine_url"])
        t = time.monotonic()
        transport.connect(url, timeout_s=120)
        emit("ready", bytes=tr.source.nbytes, tensors=len(tr.source),
             manifest_digest=tr.source.manifest().digest, connect_s=time.monotonic() - t,
             trainer_engine=holder.kind)
        go = json.loads(sys.stdin.readline())
        trigger = HalfwayTrigger(tr.source.nbytes, float(spec["fraction"]))

        def on_fire() -> None:
            emit("half", bytes=trigger.fired_at, fraction=trigger.fraction_at_fire)
            time.sleep(float(spec.get("hold_s", 120.0)))  # the parent kills us here

        src = gated_source(tr.source, trigger, on_fire)
        emit("sending", label=go["label"])
        t = time.monotonic()
        ev = transport.send(url, str(go["label"]), src, timeout_s=float(spec["deadline_s"]),
                            expected_manifest_digest=tr.source.manifest().digest)
        emit("report", transfer={
            "completed": ev.completed, "mutation_started": ev.mutation_started,
            "backend": ev.backend, "tensors": ev.tensors, "bytes": ev.bytes,
            "finish_label": ev.finish_label, "elapsed_s": time.monotonic() - t})
        return 0
    except RolloutCoreError as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}",
             mutation_started=getattr(exc, "mutation_started", True))
        return 1
    except Exception as exc:
        emit("error", error=f"{type(exc).__name__}: {exc}", mutation_started=True,
             traceback=traceback.format_exc())
        return 1


# ---------------------------------------------------------------------- main

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                    help="print and check the plan; needs neither CUDA nor vLLM")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--state", default=DEFAULT_STATE)
    ap.add_argument("--assemble", action="store_true",
                    help="merge the phases' JSON found in --state into the artifact")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--transfer-deadline-s", type=float, default=10.0)
    ap.add_argument("--kill-fraction", type=float, default=0.5)
    ap.add_argument("--kill-mode", choices=("bytes", "timer"), default="bytes")
    ap.add_argument("--recover-gpu", choices=("other", "same", "0", "1"), default="other")
    ap.add_argument("--observe-s", type=float, default=20.0)
    ap.add_argument("--no-nccl-debug", action="store_true")
    ap.add_argument("--trainer-child", metavar="SPEC_JSON", default=None,
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def config_from(args: argparse.Namespace) -> HarnessConfig:
    return HarnessConfig(reps=args.reps, gpu_util=args.gpu_util,
                         transfer_deadline_s=args.transfer_deadline_s,
                         kill_fraction=args.kill_fraction, kill_mode=args.kill_mode,
                         recover_gpu=args.recover_gpu, observe_s=args.observe_s,
                         phases=tuple(p for p in args.phases.split(",") if p),
                         nccl_debug=not args.no_nccl_debug)


def plan_main(cfg: HarnessConfig) -> int:
    """Print the plan with the real engine commands (``ManagedEngine.command``) and check it."""
    import tempfile

    from rolloutcore.engine.process import ManagedEngine

    h4 = load_helper4()
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(h4.QWEN3_8B))

        def command(gpu: int) -> list[str]:
            eng = ManagedEngine(d, backend="nccl", port=8000 + gpu, scale_out=False,
                                max_model_len=cfg.max_model_len, extra_args=engine_args(cfg),
                                env=engine_env(cfg, gpu, "<PYTHONPATH>"))
            return eng.command()

        pieces = sorted((REPO / ".carry").glob("piece-*"))
        sizes = {f".carry/{p.name}": p.stat().st_size for p in pieces}
        if (REPO / ".carry/MANIFEST").exists():
            sizes[".carry/MANIFEST"] = (REPO / ".carry/MANIFEST").stat().st_size
        plan = build_plan(cfg, engine_command=command, n_pieces=len(pieces) or 7,
                          tree_bytes=_tree_bytes(), piece_bytes=sizes)
    plan["harness_env"] = {k: os.environ.get(k) for k in MULTICAST_OFF}
    problems = validate_plan(plan)
    plan["problems"] = problems
    print(json.dumps(plan, indent=1))
    print(("PLAN OK" if not problems else f"PLAN HAS {len(problems)} PROBLEM(S)"), flush=True)
    return 0 if not problems else 1


def _tree_bytes() -> int | None:
    """Bytes of the working tree that travels (tracked + untracked not ignored)."""
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


def assemble(run: Run) -> int:
    parts = {}
    for p in PHASES:
        f = run.state / f"{p}.json"
        if f.exists():
            parts[p] = json.loads(f.read_text())
    a = assemble_artifact(parts)
    a["problems"] = check_artifact(a)
    (run.out / ARTIFACT_NAME).write_text(json.dumps(a, indent=1, default=str))
    (run.out / "gpu-2x-results.md").write_text(results_table(a))
    print(results_table(a), flush=True)
    for prob in a["problems"]:
        print(f"artifact problem: {prob}", flush=True)
    return 0 if a["complete"] and not a["problems"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    apply_multicast_off(os.environ)  # before anything can start CUDA or NCCL
    if args.trainer_child is not None:
        return trainer_child_main(json.loads(args.trainer_child))
    cfg = config_from(args)
    if args.plan:
        return plan_main(cfg)
    for p in (str(REPO / "src"), str(HERE)):
        if p not in sys.path:
            sys.path.insert(0, p)
    out, state = Path(args.out), Path(args.state)
    out.mkdir(parents=True, exist_ok=True)
    state.mkdir(parents=True, exist_ok=True)
    if cfg.nccl_debug:
        os.environ.update(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,P2P,SHM,NET",
                          NCCL_DEBUG_FILE=f"{state}/nccl-trainer.%h.%p.log")
    import torch

    if torch.cuda.device_count() < 2:
        print(f"needs two GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    torch.cuda.set_device(cfg.trainer_gpu)
    run = Run(cfg, out, state)
    rc = 0
    try:
        hot = None
        if "hot" in cfg.phases:
            hot = phase_hot(run)
            run.write("hot", hot)
        elif (state / "hot.json").exists():
            hot = json.loads((state / "hot.json").read_text())
        carry = None
        if "kill-engine" in cfg.phases:
            ke, carry = phase_kill_engine(run, hot)
            run.write("kill-engine", ke)
        if "kill-trainer" in cfg.phases:
            kt = phase_kill_trainer(run, carry)
            run.write("kill-trainer", kt)
        if args.assemble or set(cfg.phases) == set(PHASES):
            rc = assemble(run)
    finally:
        run.stop_all()
        logs = sorted(run.log_dir.glob("*.log"), key=lambda f: f.stat().st_mtime) \
            if run.log_dir.is_dir() else []
        for i, f in enumerate(logs[-3:]):
            with contextlib.suppress(OSError):  # at most 8 files come back from $OUT
                (out / f"vllm-{i + 1}-{f.stem[-16:]}.log").write_bytes(
                    f.read_bytes()[-2_000_000:])
    return rc


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # A collective that never completed can make interpreter teardown wait forever.
    os._exit(code)
