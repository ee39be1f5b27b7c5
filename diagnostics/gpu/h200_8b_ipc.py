#!/usr/bin/env python3
"""H200: a verified hot policy transition of a Qwen3-8B-shaped model over rc_cuda_ipc.

One run on one GPU (trainer and engine share it), against a real
``vllm serve`` (vLLM 0.26.0 carried to the device, see README.md here):

1. bring-up: the engine is started by RolloutCore's launcher (``ManagedEngine``)
   with ``--load-format dummy --skip-tokenizer-init --enforce-eager`` and the
   ``rc_cuda_ipc`` backend; the trainer holds its own bf16 weights of the same
   shapes in one buffer (``PackedWeights``);
2. bit-exactness, once: vLLM's ``load_weights`` path (``reference`` mode) and
   the fast slice copies leave every parameter bitwise equal;
3. the hot cycle with an in-flight rollout, driven by RolloutCore's runner and
   adapter (``LifecycleRunner`` + ``VllmAdapter``; with a thin adapter of this
   file if the real one cannot be imported or bootstrapped: the artifact says
   which ran);
4. the cache negative control (resume without the prefix reset: stale KV);
5. the benchmark, in one run: full RolloutCore transitions with their phase
   breakdown, the bare primitive sequence on the same engine and weights, a
   device-to-device copy of the same bytes, and stop + restart to health;
6. the service path (``--service``, on by default): the same hot transition
   through a gateway (``rolloutcore.service.create_app`` over the same
   controller, under uvicorn on loopback) and ``RolloutCoreClient`` over
   rc_cuda_ipc, timed against the bare primitives interleaved with it
   (``service_phase``; goal ``service_over_bare`` <= 1.3). The gateway
   verifies as the in-process path does here: the trainer reports its
   checksum of what it sent and the gateway has the workers hash what the
   update wrote (``/collective_rpc rc_cuda_ipc_checksum``) and compares,
   level engine-checksum.

Writes ``$OUT/h200-8b-ipc.json`` (or ``--out``), ``$OUT/gpu-results.md`` and
the engine logs. Every stage records its own error and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

import httpx  # noqa: E402
import torch  # noqa: E402

from rolloutcore.control.controller import LifecycleController  # noqa: E402
from rolloutcore.control.runner import Deadlines, LifecycleRunner  # noqa: E402
from rolloutcore.core.evidence import (  # noqa: E402
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    DrainEvidence,
    PauseMode,
    PreflightEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.versions import (  # noqa: E402
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
)
from rolloutcore.engine.process import ManagedEngine  # noqa: E402
from rolloutcore.errors import AdmissionRefused, BadInput  # noqa: E402
from rolloutcore.transports.cuda_ipc import (  # noqa: E402
    BACKEND,
    WORKER_EXTENSION,
    CudaIpcTransport,
    PackedWeights,
    encode_update,
)
from rolloutcore.transports.source import WeightSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gputime import gpu_time  # noqa: E402
from qwen3_shapes import QWEN3, QWEN3_8B, qwen3_specs  # noqa: E402,F401

RESULTS: dict[str, Any] = {"stages": {}, "errors": {}, "commands": []}
T_START = time.monotonic()


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T_START:7.1f}s] {msg}", flush=True)


#: Stages left out of this run (``--skip``): a stage checks ``skipped(name)`` first.
SKIP: set[str] = set()


class Skipped(Exception):
    pass


def skipped(name: str) -> None:
    if name in SKIP:
        raise Skipped(name)


@contextlib.contextmanager
def stage(name: str):  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    log(f"== {name}")
    try:
        yield
        RESULTS["stages"][name] = {"ok": True, "s": round(time.monotonic() - t0, 3)}
    except Skipped:
        RESULTS["stages"][name] = {"skipped": "--skip"}
    except Exception as exc:
        RESULTS["stages"][name] = {"ok": False, "s": round(time.monotonic() - t0, 3)}
        RESULTS["errors"][name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        log(f"!! {name} failed: {type(exc).__name__}: {exc}")
    finally:
        # What is measured so far survives a run cut short (the device's time limit).
        out = RESULTS.get("out_dir")
        if out:
            with contextlib.suppress(Exception):
                (Path(out) / "h200-8b-ipc.partial.json").write_text(
                    json.dumps(RESULTS, indent=1, default=str))


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# ---------------------------------------------------------------------- service path

@contextlib.contextmanager
def serve_in_thread(app: Any, host: str = "127.0.0.1"):  # type: ignore[no-untyped-def]
    """``app`` under uvicorn on a free loopback port, from a thread; yields its URL."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not th.is_alive():
            raise RuntimeError("the gateway (uvicorn) did not start")
        time.sleep(0.01)
    try:
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        th.join(15)
        sock.close()


def service_phase(runner: Any, config: Any, client_for: Any, prepare: Any, seeds: Any,
                  reps: int, bare: Any = None) -> dict[str, Any]:
    """The hot transition through a gateway and its client, against the bare primitives.

    ``runner``: a bootstrapped ``LifecycleRunner`` whose adapter holds no
    transport (the trainer sends); ``config``: its ``ServiceConfig``;
    ``client_for(url)``: a ``RolloutCoreClient`` with the trainer's transport;
    ``prepare(seed)``: the trainer's work before an update, outside the timing
    (fill the buffer, checksum it at staging), returning ``(source, identity,
    provenance, probe, min_verification)``; ``seeds``: an iterator of the next
    policy; ``bare()``: one timed bare-primitive cycle (seconds), run after
    each service update, or None. Returns the timings, the verification
    reached and every run.
    """
    from rolloutcore.service import create_app

    app = create_app(runner, config)
    runs: list[dict[str, Any]] = []
    bare_s: list[float] = []
    seen: dict[str, Any] = {"statuses": {}, "spans": [], "stop": False}
    with serve_in_thread(app) as url, client_for(url) as rc:
        for _ in range(reps):
            seed = next(seeds)
            source, ident, prov, probe, level = prepare(seed)
            t0 = time.monotonic()
            res = rc.update(source, prov, identity=ident, probe=probe,
                            min_verification=level, owner="h200-service-phase")
            wall = time.monotonic() - t0
            phases = dict(res.phases)
            effects = sum(phases.get(k, 0.0) for k in ("pause", "transfer", "invalidate",
                                                       "validate", "resume", "validate_live"))
            runs.append({"seed": seed, "service_s": wall, "gateway_total_s": phases.get("total"),
                         "protocol_overhead_s": max(0.0, wall - effects),
                         "verification": res.verification, "published": None
                         if res.published is None else res.published.to_dict(),
                         "phases": phases, "client_s": dict(res.client_s)})
            if bare is not None:
                bare_s.append(float(bare()))
        # Then, untimed: three more updates with generation clients on the gateway (the
        # timed ones above ran without them: a drain waits for their requests).
        clients = [threading.Thread(target=_gateway_client, args=(url, seen, i), daemon=True)
                   for i in range(4)]
        for c in clients:
            c.start()
        for _ in range(3):
            source, ident, prov, probe, level = prepare(next(seeds))
            rc.update(source, prov, identity=ident, probe=probe, min_verification=level,
                      owner="h200-service-phase-clients")
        seen["stop"] = True
        for c in clients:
            c.join(60)
    svc = med([r["service_s"] for r in runs])
    bs = med(bare_s)
    return {"reps": reps, "service_s": svc, "bare_primitives_s": bs,
            "service_over_bare": svc / bs if svc and bs else None,
            "protocol_overhead_s": med([r["protocol_overhead_s"] for r in runs]),
            "client_medians_s": {k: med([r["client_s"].get(k, 0.0) for r in runs])
                                 for k in ("begin", "transfer", "report", "total")},
            "gateway_phase_medians_s": {k: med([r["phases"].get(k, 0.0) for r in runs])
                                        for k in sorted({k for r in runs for k in r["phases"]})},
            "verification": sorted({str(r["verification"]) for r in runs}),
            "clients_during_updates": {"statuses": seen["statuses"],
                                       # the engine's own refusal reaching a client; the
                                       # gateway's retryable 503 while it updates is not it
                                       "pause_503_seen_by_clients":
                                       seen["statuses"].get("503 engine_paused", 0),
                                       "answers_with_version": len(seen["spans"])},
            "runs": runs, "bare": bare_s}


def _gateway_client(url: str, seen: dict[str, Any], i: int) -> None:
    """A generation client of the gateway while the trainer updates through it.

    Counts every status it is answered, a 503 by whose it is: vLLM 0.33+ answers 503
    ``engine_paused`` to a request that reaches a paused engine (none may reach a client
    through the gateway), the gateway its own retryable 503 while it updates (no queue);
    keeps the version the gateway names for each answer.
    """
    c = httpx.Client(timeout=120.0)
    prompt = [(j * 31 + i) % 150000 + 100 for j in range(48)]
    try:
        while True:  # at least one request, however soon the updates end
            try:
                r = c.post(url + "/v1/completions", json={
                    "model": "policy", "prompt": prompt, "max_tokens": 8,
                    "temperature": 0.0, "ignore_eos": True})
                key = str(r.status_code)
                if r.status_code == 503:
                    key += " engine_paused" if "engine_paused" in r.text else " gateway"
                if r.status_code == 200:
                    seen["spans"].append(r.headers.get("x-rolloutcore-version"))
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            seen["statuses"][key] = seen["statuses"].get(key, 0) + 1
            if seen["stop"]:
                break
    finally:
        c.close()


# ---------------------------------------------------------------------- trainer

def fill(packed: PackedWeights, seed: int) -> None:
    """The trainer's policy number ``seed``: its own random values, deterministic."""
    g = torch.Generator(device=packed.device).manual_seed(seed)
    with torch.no_grad():
        for name, t in packed.items():
            if "norm" in name:
                t.normal_(1.0, 0.05, generator=g)
            else:
                t.normal_(0.0, 0.02, generator=g)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------- engine HTTP

class Http:
    """Bare HTTP calls with their durations (the bare primitives and the probes)."""

    def __init__(self, base_url: str) -> None:
        self.base = base_url
        from rolloutcore.transports import engine_key

        # The engine is launched with the route guard: its key opens the dev routes
        # for these bare calls too (the same calls, the same cost, one header more).
        self.c = httpx.Client(timeout=120.0, headers=engine_key.headers_for(base_url))

    def post(self, path: str, body: Any = None, params: dict[str, str] | None = None,
             timeout: float = 120.0) -> tuple[Any, float]:
        t = time.monotonic()
        r = self.c.post(self.base + path, json=body, params=params, timeout=timeout)
        dt = time.monotonic() - t
        if r.status_code >= 300:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:400]}")
        try:
            return (r.json() if r.content else None), dt
        except ValueError:
            return r.text, dt

    def get(self, path: str, timeout: float = 60.0) -> Any:
        r = self.c.get(self.base + path, timeout=timeout)
        if r.status_code >= 300:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:400]}")
        try:
            return r.json()
        except ValueError:
            return r.text

    def generate(self, tokens: list[int], max_tokens: int) -> list[int]:
        body = {"token_ids": tokens, "model": "policy",
                "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0,
                                    "ignore_eos": True, "detokenize": False}}
        out, _ = self.post("/inference/v1/generate", body, timeout=90.0)
        return list(out["choices"][0]["token_ids"])

    def try_generate(self, tokens: list[int], max_tokens: int, where: str) -> list[int] | None:
        try:
            return self.generate(tokens, max_tokens)
        except Exception as exc:
            RESULTS["errors"].setdefault(f"generate:{where}", f"{type(exc).__name__}: {exc}")
            log(f"!! generate ({where}) failed: {exc}")
            return None

    def prefix_hits(self) -> float:
        text = self.c.get(self.base + "/metrics", timeout=30.0).text
        tot = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                tot += float(line.rsplit(" ", 1)[1])
        return tot

    def bare_cycle(self, body: dict[str, Any]) -> dict[str, float]:
        """pause, start, update, finish, reset, resume: no checks at all."""
        t0 = time.monotonic()
        ph: dict[str, float] = {}
        _, ph["pause"] = self.post("/pause", params={"mode": "wait", "clear_cache": "false"})
        _, ph["start"] = self.post("/start_weight_update")
        _, ph["update"] = self.post("/update_weights", {"update_info": body})
        _, ph["finish"] = self.post("/finish_weight_update")
        _, ph["reset"] = self.post("/reset_prefix_cache")
        _, ph["resume"] = self.post("/resume")
        ph["total"] = time.monotonic() - t0
        return ph


# ---------------------------------------------------------------------- adapters

class ThinAdapter:
    """Fallback port implementation over bare HTTP, used only if VllmAdapter fails."""

    caches = (CacheKind.PREFIX,)

    def __init__(self, http: Http, transport: CudaIpcTransport, epoch: str) -> None:
        self.h, self.t, self.epoch, self.source = http, transport, epoch, None

    def stage(self, source: Any, **_: Any) -> None:
        self.source = source

    def bootstrap(self) -> BootstrapEvidence:
        self.t.connect(self.h.base, timeout_s=60)
        return BootstrapEvidence(self.epoch, self.h.get("/health") is not None or True)

    def drain(self, mode: PauseMode) -> DrainEvidence:
        self.h.post("/pause", params={"mode": mode.value, "clear_cache": "false"})
        return DrainEvidence(bool(self.h.get("/is_paused")["is_paused"]), mode)

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        assert self.source is not None
        return PreflightEvidence(self.source.manifest().digest)

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        return self.t.send(self.h.base, target.version.label, self.source, timeout_s=300)

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        body, _ = self.h.post("/reset_prefix_cache")
        return CacheResetEvidence(cache, 200, bool(body.get("success")))

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        if live:
            return None
        paused = bool(self.h.get("/is_paused")["is_paused"])
        return ValidationEvidence(None, False, paused=paused,
                                  checks=(self.t.validation_check(self.h.base),))

    def resume(self) -> ResumeEvidence:
        self.h.post("/resume")
        return ResumeEvidence(True, bool(self.h.get("/is_paused")["is_paused"]))

    def fence(self) -> None:
        with contextlib.suppress(Exception):
            self.h.post("/pause", params={"mode": "abort"})

    def cancel(self, step: str) -> None:
        self.t.abort()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------- main

def spans_and_pause(http: Http, state: dict[str, Any], transition: Any) -> dict[str, Any]:
    """vLLM's own per-token version spans after a RolloutCore transition, and what a
    request that reaches the paused engine directly is answered.

    After one more verified transition, a greedy ``/v1/completions`` with
    ``return_weight_versions`` (vLLM 0.33+; 0.26 has no spans and says so): every
    span must name the label RolloutCore published, and cover every token. Then
    ``/pause?mode=wait`` with nothing in flight and one direct request: 0.33+
    answers 503 ``engine_paused`` at once, older vLLMs hold it until ``/resume``.
    """
    out: dict[str, Any] = {}
    nxt = 1 if state["seed"] == 2 else 2
    o = transition(nxt)
    label = None if o.published is None else o.published.to_dict().get("label")
    info = http.get("/weight_info") if "/weight_info" in RESULTS.get("engine_routes", ()) else None
    out.update(published_label=label, engine_weight_info=info)
    prompt = [(j * 13 + 7) % 150000 + 100 for j in range(40)]
    r = http.c.post(http.base + "/v1/completions", json={
        "model": state.get("model_name", "policy"), "prompt": prompt, "max_tokens": 24,
        "temperature": 0.0, "ignore_eos": True, "return_weight_versions": True,
        "return_token_ids": True},
        timeout=120.0)
    out["completion_status"] = r.status_code
    spans = None
    if r.status_code == 200:
        choice = r.json()["choices"][0]
        spans = choice.get("weight_versions")
        n = len(choice.get("token_ids") or []) or 24
        out["spans"] = spans
        if spans:
            covered = sorted((int(sp["start"]), int(sp["end"])) for sp in spans)
            contiguous = covered[0][0] == 0 and covered[-1][1] == n and all(
                a[1] == b[0] for a, b in itertools.pairwise(covered))
            out["spans_checked"] = bool(label) and contiguous and all(
                sp["version"] == label for sp in spans)
        else:
            out["spans_checked"] = False
            out["spans_missing"] = "the engine answered no weight_versions (vLLM < 0.33)"
    else:
        out["spans_checked"] = False
        out["completion_error"] = r.text[:300]
    # A request that reaches the paused engine itself.
    http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
    try:
        t = time.monotonic()
        try:
            d = http.c.post(http.base + "/v1/completions", json={
                "model": state.get("model_name", "policy"), "prompt": prompt[:8],
                "max_tokens": 2}, timeout=5.0)
            out["direct_while_paused"] = {"status": d.status_code, "body": d.text[:200],
                                          "s": round(time.monotonic() - t, 4)}
        except httpx.TimeoutException:
            out["direct_while_paused"] = {"status": "held until resume (no answer in 5 s)"}
    finally:
        http.post("/resume")
    return out


def versions(*also: Path) -> dict[str, Any]:
    """The versions that ran; ``tree_sha256`` names the code by content (RolloutCore's
    sources, this file and ``also``: the harness that imported it)."""
    v: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                         "cuda": torch.version.cuda}
    try:
        import vllm

        v["vllm"] = vllm.__version__
    except Exception as exc:  # recorded, not fatal here
        v["vllm"] = f"import failed: {exc}"
    with contextlib.suppress(Exception):
        v["transformers"] = __import__("transformers").__version__
    with contextlib.suppress(Exception):
        v["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    with contextlib.suppress(Exception):
        v["git"] = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                  capture_output=True, text=True, timeout=10).stdout.strip()
    # The device gets a copy of the working tree: name the code that ran by content.
    import hashlib

    h = hashlib.sha256()
    for f in sorted({*(REPO / "src" / "rolloutcore").rglob("*.py"), Path(__file__), *also}):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    v["tree_sha256"] = h.hexdigest()
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gpu-util", type=float, default=0.45)
    ap.add_argument("--service", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the hot transition through a gateway + RolloutCoreClient")
    ap.add_argument("--model", choices=sorted(QWEN3), default="8b",
                    help="the Qwen3 size whose public shapes are used (the scaling curve)")
    ap.add_argument("--skip", default="",
                    help="comma-separated stages to leave out (the scaling curve keeps "
                         "the transition, the bare sequence, the service path, the transfer)")
    ap.add_argument("--service-reps", type=int, default=None,
                    help="service-path transitions (default: --reps)")
    args = ap.parse_args()
    SKIP.update(x for x in args.skip.split(",") if x)
    model_cfg = QWEN3[args.model]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["out_dir"] = str(out)
    logs = Path("/tmp/rc-engine-logs")
    RESULTS["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    RESULTS["versions"] = versions()
    RESULTS["commands"].append(" ".join([sys.executable, *sys.argv]))
    log(json.dumps(RESULTS["versions"]))
    R: dict[str, Any] = RESULTS
    engine: ManagedEngine | None = None
    http: Http | None = None
    transport = CudaIpcTransport(mode="fast")
    packed: PackedWeights | None = None

    model_dir = Path(f"/tmp/rc-qwen3-{args.model}")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(model_cfg, indent=1))

    with stage("trainer_weights"):
        specs = qwen3_specs(model_cfg)
        packed = PackedWeights([(n, s, torch.bfloat16) for n, s in specs], device="cuda:0")
        transport.adopt(packed)
        t = time.monotonic()
        fill(packed, 1)
        R["model"] = {"config": f"Qwen3-{args.model} public config values", "size": args.model,
                      "tensors": len(specs),
                      "bytes": packed.nbytes, "fill_s": round(time.monotonic() - t, 4)}
        log(f"trainer buffer: {len(specs)} tensors, {packed.nbytes / 1e9:.3f} GB")

    with stage("kernel_tiles"):
        skipped("kernel_tiles")
        # The one-launch kernels' tile sizes, swept on the trainer's own buffer
        # (same GPU, same bytes); the engine is started with the best ones.
        from rolloutcore.transports.cuda_ipc import kernels as ck

        sweep: dict[str, Any] = {"checksum_s": {}, "copy_s": {}}
        R["kernel_tiles"] = sweep
        sweep["checksum_torch_s"] = gpu_time(lambda: packed.checksum("torch"))
        ref_sum = packed.checksum("torch")
        # Kernel form x rows per program x warps (results/gpu/csum-bench.json swept
        # more; these are its front runners).
        for form in ("flat", "2d", "flat-loop"):
            for rows in (64, 128):
                for warps in (8, 16):
                    ck.CSUM_KERNEL, ck.CSUM_ROWS, ck.CSUM_WARPS = form, rows, warps
                    key = f"{form}/{rows}/{warps}"
                    if packed.checksum("kernel") != ref_sum:
                        sweep["checksum_s"][key] = "disagrees"
                        continue
                    sweep["checksum_s"][key] = gpu_time(lambda: packed.checksum("kernel"))
        ok_rows = {k: v for k, v in sweep["checksum_s"].items() if isinstance(v, float)}
        best = min(ok_rows, key=lambda k: ok_rows[k]) if ok_rows else "flat/64/8"
        form, rows_s, warps_s = best.split("/")
        ck.CSUM_KERNEL, ck.CSUM_ROWS, ck.CSUM_WARPS = form, int(rows_s), int(warps_s)
        ck.forget_programs()
        scratch = torch.empty_like(packed.buffer)
        dv = [scratch[e.offset_bytes:e.offset_bytes + e.nbytes] for e in packed.entries]
        sv = [packed.buffer[e.offset_bytes:e.offset_bytes + e.nbytes] for e in packed.entries]
        sweep["copy_memcpy_flat_s"] = gpu_time(lambda: scratch.copy_(packed.buffer))
        for words in (4096, 8192, 16384, 32768, 65536):
            ck.COPY_WORDS = words
            mc = ck.MultiCopy(dv, sv)
            sweep["copy_s"][words] = gpu_time(mc.run)
        ck.COPY_WORDS = min(sweep["copy_s"], key=lambda k: sweep["copy_s"][k])
        scratch, dv, sv, mc = torch.empty(0), [], [], None  # free the 16 GB scratch
        torch.cuda.empty_cache()
        sweep["chosen"] = {"RC_CUDA_IPC_CSUM_ROWS": ck.CSUM_ROWS,
                           "RC_CUDA_IPC_CSUM_KERNEL": ck.CSUM_KERNEL,
                           "RC_CUDA_IPC_CSUM_WARPS": ck.CSUM_WARPS,
                           "RC_CUDA_IPC_COPY_WORDS": ck.COPY_WORDS}
        log(f"kernel tiles: {sweep}")

    extra = ["--load-format", "dummy", "--skip-tokenizer-init", "--enforce-eager",
             "--gpu-memory-utilization", str(args.gpu_util),
             "--worker-extension-cls", WORKER_EXTENSION]
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1",
           **{k: str(v) for k, v in R.get("kernel_tiles", {}).get("chosen", {}).items()}}
    with stage("engine_start"):
        # vLLM 0.34 answers /inference/v1/generate 403 without --enable-scale-out (seen on
        # the H200 on 2026-12-06); 0.26 predates the option.
        vv = str(RESULTS["versions"].get("vllm", ""))
        scale_out = vv[:1].isdigit() and tuple(
            int(x) for x in vv.split(".")[:2] if x.isdigit()) >= (0, 32)
        engine = ManagedEngine(model_dir, backend=BACKEND, scale_out=scale_out,
                               guard_routes=True,
                               max_model_len=4096, extra_args=extra, env=env,
                               log_dir=logs, startup_timeout_s=420, stop_grace_s=10)
        R["engine_env"] = env
        engine.start()
        R["commands"].append(" ".join(engine.command()))
        R["cold_start_s"] = engine.last_start_s
        log(f"engine healthy in {engine.last_start_s:.1f}s at {engine.base_url}")
        http = Http(engine.base_url)
        paths = sorted(http.get("/openapi.json")["paths"])
        R["engine_routes"] = paths

    if engine is None or http is None or packed is None or not engine.alive():
        return finish(out, logs)

    with stage("connect"):
        info = transport.connect(engine.base_url, timeout_s=120)
        R["connect"] = info
        R["label_supported"] = transport.label_supported
        log(f"connect: {info}")

    def send(seed: int | None, mode: str, label: str) -> dict[str, Any]:
        assert packed is not None and http is not None
        if seed is not None:
            fill(packed, seed)
        transport.mode = mode
        http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
        try:
            ev = transport.send(http.base, label, packed, timeout_s=300)
            http.post("/reset_prefix_cache")
        finally:
            http.post("/resume")  # never leave the engine paused (stalls later stages)
        st = transport.rpc(http.base, "rc_cuda_ipc_stats")[0]
        transport.mode = "fast"
        return {"update_s": transport.last_timings.update_s, "elapsed_s": ev.elapsed_s,
                "engine": st}

    def wire(by_reference: bool) -> dict[str, Any]:
        assert packed is not None
        return encode_update(transport._message(packed), by_reference=by_reference)

    with stage("warmup"):
        R["first_fast_update"] = send(2, "fast", "w2")  # maps the handle, builds the plan
        for s in (1, 2, 1):
            send(s, "fast", f"w{s}")

    with stage("impl_compare"):
        skipped("impl_compare")
        # Same engine, same weights, one run: how the update's copies are done
        # (per-tensor memcpy, torch _foreach_copy_, one Triton launch) and how the
        # block checksum is computed (per-tensor torch reductions, one Triton launch).
        cmpd: dict[str, Any] = {"copy": {}, "checksum": {}}
        R["impl_compare"] = cmpd
        for impl in ("memcpy", "foreach", "kernel", "auto"):
            transport.copy_impl = impl
            transport.connect(http.base, timeout_s=120)
            runs = [send(s, "fast", f"c-{impl}-{s}") for s in (2, 1, 2, 1, 2)]
            cmpd["copy"][impl] = {
                "update_s": med([r["update_s"] for r in runs[1:]]),
                "copy_gpu_s": med([r["engine"].get("copy_gpu_s", 0.0) for r in runs[1:]]),
                "launch_s": med([r["engine"].get("launch_s", 0.0) for r in runs[1:]]),
                "receive_s": med([r["engine"].get("receive_s", 0.0) for r in runs[1:]]),
                "engine_copy_impl": runs[-1]["engine"].get("copy_impl")}
            c = cmpd["copy"][impl]
            c["copy_gbps"] = packed.nbytes / c["copy_gpu_s"] / 1e9 if c["copy_gpu_s"] else None
            log(f"copy {impl}: update {c['update_s'] * 1e3:.1f} ms, GPU copies "
                f"{c['copy_gpu_s'] * 1e3:.2f} ms ({c['copy_gbps']:.0f} GB/s)")
        # Wire form: full entries vs the layout by reference (same copies).
        full = []
        for s in (2, 1, 2, 1):
            fill(packed, s)
            http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
            http.post("/start_weight_update")
            _, dt = http.post("/update_weights", {"update_info": wire(by_reference=False)})
            http.post("/finish_weight_update")
            http.post("/resume")
            full.append(dt)
        cmpd["full_entries_update_s"] = med(full[1:])
        cmpd["by_reference_update_s"] = cmpd["copy"]["auto"]["update_s"]
        # Checksums: equal values, and their cost, on both sides.
        eng = {}
        for impl in ("torch", "kernel", "torch", "kernel"):
            r = transport.rpc(http.base, "rc_cuda_ipc_checksum", impl)[0]
            eng.setdefault(impl, []).append(r)
        tr: dict[str, list[float]] = {}
        vals: dict[str, list[int]] = {}
        for impl in ("torch", "kernel", "torch", "kernel"):
            torch.cuda.synchronize()
            t = time.monotonic()
            vals[impl] = packed.checksum(impl)
            tr.setdefault(impl, []).append(time.monotonic() - t)
        same_engine = eng["torch"][-1]["values"] == eng["kernel"][-1]["values"]
        same_trainer = vals["torch"] == vals["kernel"]
        cross = eng["kernel"][-1]["values"] == vals["kernel"]
        cmpd["checksum"] = {
            "engine_s": {k: v[-1]["elapsed_s"] for k, v in eng.items()},
            "trainer_s": {k: v[-1] for k, v in tr.items()},
            "kernel_equals_torch_engine": same_engine,
            "kernel_equals_torch_trainer": same_trainer,
            "engine_equals_trainer": cross}
        log(f"checksum: {cmpd['checksum']}")
        # The rest of the run uses what measured fastest here (never a kernel whose
        # checksum disagrees with the torch definition).
        es = cmpd["checksum"]["engine_s"]
        if not (same_engine and same_trainer):
            transport.checksum_impl = "torch"
        else:
            transport.checksum_impl = min(("torch", "kernel"), key=lambda k: es[k])
        transport.copy_impl = min(("memcpy", "foreach", "kernel"),
                                  key=lambda k: cmpd["copy"][k]["update_s"])
        cmpd["used"] = {"checksum": transport.checksum_impl, "copy": transport.copy_impl}
        log(f"using {cmpd['used']}")
        transport.connect(http.base, timeout_s=120)

    with stage("copy_probe"):
        skipped("copy_probe")
        # Where the worker's copy time goes: the IPC-mapped source or the parameters.
        send(1, "fast", "probe-1")
        R["copy_probe"] = transport.rpc(http.base, "rc_cuda_ipc_copy_probe")[0]
        log(f"copy probe: {R['copy_probe']}")

    # -------------------------------------------------- RolloutCore runner + adapter
    controller = LifecycleController(required_caches=(CacheKind.PREFIX,))
    runner: LifecycleRunner | None = None
    adapter: Any = None
    R["driver"] = {}
    deadlines = Deadlines(pause_s=60, transfer_s=120, validate_s=60, resume_s=30,
                          reset_s=30, preflight_s=30, live_validate_s=60, drain_s=120)

    assert packed is not None
    # The buffer's layout never changes: its manifest is made once, not per update.
    manifest = ParameterManifest.from_items((e.name, e.shape, e.dtype) for e in packed.entries)

    def identity(seed: int) -> WeightIdentity:
        return WeightIdentity.declare(manifest, Provenance(f"synthetic-qwen3-8b-seed{seed}",
                                                           "h200-harness", seed))

    source = WeightSource.from_state_dict(dict(packed.items()),
                                          description="trainer PackedWeights views")
    with stage("rolloutcore_bootstrap"):
        try:
            from rolloutcore.engine.http import VllmHTTP
            from rolloutcore.engine.port import VllmAdapter

            adapter = VllmAdapter(VllmHTTP(engine.base_url, timeout_s=120), transport,
                                  engine_epoch=engine.epoch)
            runner = LifecycleRunner(controller, adapter, deadlines)
            adapter.stage(source, provenance=Provenance("synthetic-qwen3-8b-seed1",
                                                         "h200-harness", 1))
            runner.bootstrap(identity(1))
            R["driver"] = {"adapter": "rolloutcore.engine.port.VllmAdapter (its paused "
                           "validation adds the transport's worker checksum check)",
                           "runner": "rolloutcore.control.runner.LifecycleRunner"}
        except Exception as exc:
            R["driver"]["vllm_adapter_error"] = f"{type(exc).__name__}: {exc}"
            log(f"VllmAdapter unusable ({exc}); falling back to ThinAdapter")
            controller = LifecycleController(required_caches=(CacheKind.PREFIX,))
            adapter = ThinAdapter(http, transport, engine.epoch)
            adapter.stage(source)
            runner = LifecycleRunner(controller, adapter, deadlines)
            runner.bootstrap(identity(1))
            R["driver"].update(adapter="diagnostics ThinAdapter (VllmAdapter failed)",
                               runner="rolloutcore.control.runner.LifecycleRunner")
        R["driver"]["caches_reset"] = ("prefix only: controller required_caches=(prefix,), "
                                       "a text-only model has no encoder/mm cache")
    state: dict[str, Any] = {"seed": 1}

    def transition(seed: int) -> Any:
        assert runner is not None and packed is not None
        fill(packed, seed)
        adapter.stage(source, provenance=Provenance(f"synthetic-qwen3-8b-seed{seed}",
                                                    "h200-harness", seed))
        # The trainer's checksum of what it will send, taken at staging (the engine
        # still serves); the paused validation compares the workers' one with it.
        state["staging_checksum_s"] = transport.precompute_checksum(packed)
        o = runner.run_update(identity(seed),
                              min_verification=VerificationLevel.ENGINE_CHECKSUM)
        state["seed"] = seed
        return o

    prompt = [(i * 7919 + 13) % 150000 + 100 for i in range(320)]
    with stage("hot_cycle"):
        skipped("hot_cycle")
        assert runner is not None
        before = http.try_generate(prompt[:64], 16, "hot_before")
        binding = controller.admit("rollout-inflight")
        box: dict[str, Any] = {}

        def rollout() -> None:
            t = time.monotonic()
            box["tokens"] = http.try_generate(prompt[:200], 256, "inflight") or []
            box["end"] = time.monotonic()
            box["s"] = box["end"] - t
            box["completion"] = controller.complete("rollout-inflight")

        th = threading.Thread(target=rollout)
        th.start()
        time.sleep(0.3)
        refused: dict[str, Any] = {}

        def try_admit() -> None:
            time.sleep(0.1)
            try:
                controller.admit("late-rollout")
                refused["admitted"] = True
                controller.complete("late-rollout")
            except AdmissionRefused as exc:
                refused["refused"] = str(exc)

        la = threading.Thread(target=try_admit)
        la.start()
        t_upd = time.monotonic()
        o = transition(2)
        th.join(600)
        la.join(10)
        after = http.try_generate(prompt[:64], 16, "hot_after")
        comp = box.get("completion")
        R["hot_cycle"] = {
            "published": None if o.published is None else o.published.to_dict(),
            "state": o.state.value, "total_s": o.total_s, "breakdown": o.breakdown(),
            "inflight_rollout": {"tokens": len(box.get("tokens", [])), "s": box.get("s"),
                                 "bound_version": binding.version.to_dict(),
                                 "finished_before_update_returned": box.get("end", 1e18)
                                 < t_upd + o.total_s,
                                 "attributable": getattr(comp, "attributable", None)},
            "admission_during_update": refused,
            "outputs_changed": None if before is None or after is None else before != after,
            "identity": None if controller.identity is None else controller.identity.to_dict(),
        }
        log(f"hot cycle: published={R['hot_cycle']['published']} total={o.total_s:.3f}s "
            f"rollout tokens={len(box.get('tokens', []))} refused={bool(refused.get('refused'))}"
            f" outputs_changed={before != after}")

    with stage("cache_negative_control"):
        skipped("cache_negative_control")
        # Fill the prefix cache under the current weights, then update with no reset.
        body = wire(by_reference=True)
        http.generate(prompt, 8)
        nxt = 1 if state["seed"] == 2 else 2
        fill(packed, nxt)
        http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
        http.post("/start_weight_update")
        http.post("/update_weights", {"update_info": body})
        http.post("/finish_weight_update")
        http.post("/resume")  # deliberately NO /reset_prefix_cache
        h0 = http.prefix_hits()
        stale = http.generate(prompt, 8)
        h1 = http.prefix_hits()
        http.post("/pause", params={"mode": "wait", "clear_cache": "false"})
        reset, _ = http.post("/reset_prefix_cache")
        http.post("/resume")
        h2 = http.prefix_hits()
        fresh = http.generate(prompt, 8)
        h3 = http.prefix_hits()
        state["seed"] = nxt
        R["cache_negative_control"] = {
            "prompt_tokens": len(prompt), "stale_prefix_hits": h1 - h0,
            "fresh_prefix_hits": h3 - h2, "reset_answer": reset,
            "stale_tokens": stale, "fresh_tokens": fresh,
            "stale_differs_from_fresh": stale != fresh,
            "shows_reset_needed": (h1 - h0) > 0 and (h3 - h2) == 0 and stale != fresh}
        log(f"negative control: stale hits {h1 - h0:.0f}, fresh hits {h3 - h2:.0f}, "
            f"tokens differ {stale != fresh}")
        # Hand the engine back to the controller's committed version.
        if runner is not None and controller.identity is not None:
            transition(2 if nxt == 1 else 1)

    with stage("benchmark"):
        assert runner is not None
        hot: list[Any] = []
        bare: list[dict[str, float]] = []
        # The transport's steady-state wire form: the layout named by reference.
        body = wire(by_reference=True)
        for _ in range(args.reps):
            seed = 1 if state["seed"] == 2 else 2
            o = transition(seed)
            if o.published is None:
                raise RuntimeError(f"transition not published: {o.state}")
            hot.append({"total_s": o.total_s, "breakdown": o.breakdown(),
                        "controller_overhead_s": o.controller_overhead_s,
                        "transport": dataclasses.asdict(transport.last_timings),
                        "zero_copy": transport.last_zero_copy,
                        "staging_checksum_s": state.get("staging_checksum_s"),
                        "engine_checksum": {k: transport.last_check.get(k) for k in
                                            ("via", "engine_s", "engine_wait_s", "prefetched",
                                             "rpc_s", "coverage", "passed", "ipc_note")},
                        "engine": transport.rpc(http.base, "rc_cuda_ipc_stats")[0]})
            seed = 1 if state["seed"] == 2 else 2
            fill(packed, seed)
            bare.append(http.bare_cycle(body))
            state["seed"] = seed
            # Bare left the engine on other weights than the controller committed:
            # put the committed ones back, outside any timing.
            fill(packed, 1 if seed == 2 else 2)
            http.bare_cycle(body)
            state["seed"] = 1 if seed == 2 else 2
        # Ablations, after the headline reps and reported beside them (the headline
        # configuration is the default one: the workers hash at finish and write the
        # values into the trainer's result slot; the validation reads them there, and
        # the paused state read starts as the transfer returns).
        R["benchmark_config"] = {
            "early_transport_check": getattr(adapter, "early_transport_check", None),
            "hash_at_finish": transport.hash_at_finish,
            "checksum_results": transport.checksum_results,
            "checksum_impl": transport.checksum_impl, "copy_impl": transport.copy_impl}
        ablations: dict[str, Any] = {}
        if hasattr(adapter, "early_transport_check"):
            for name, early, at_finish, route in (
                    ("rpc_check_inside_validation", False, False, "rpc"),
                    ("rpc_check_beside_reset", True, False, "rpc"),
                    ("rpc_hash_at_finish", True, True, "rpc")):
                adapter.early_transport_check, transport.hash_at_finish = early, at_finish
                transport.checksum_results = route
                runs = []
                for _ in range(max(3, args.reps // 2)):
                    seed = 1 if state["seed"] == 2 else 2
                    o = transition(seed)
                    if o.published is None:
                        raise RuntimeError(f"{name}: transition not published: {o.state}")
                    runs.append({"total_s": o.total_s, "breakdown": o.breakdown(),
                                 "finish_s": transport.last_timings.finish_s})
                ablations[name] = {
                    "early_transport_check": early, "hash_at_finish": at_finish,
                    "checksum_results": route,
                    "hot_s": med([r["total_s"] for r in runs]),
                    "phase_medians_s": {k: med([r["breakdown"][k] for r in runs])
                                        for k in runs[0]["breakdown"]},
                    "finish_s": med([r["finish_s"] for r in runs]), "runs": runs}
                log(f"ablation {name}: hot {ablations[name]['hot_s']:.4f}s")
            adapter.early_transport_check = R["benchmark_config"]["early_transport_check"]
            transport.hash_at_finish = R["benchmark_config"]["hash_at_finish"]
            transport.checksum_results = R["benchmark_config"]["checksum_results"]
        R["ablations"] = ablations
        # Where the process spends CPU over a few transitions, per transition. Under
        # Python 3.12 cProfile sees every thread (the effects' too), so this does not
        # isolate the controller; the profile also slows what it watches.
        import cProfile
        import pstats
        prof = cProfile.Profile()
        n_prof = 5
        prof_ovh = []
        for _ in range(n_prof):
            seed = 1 if state["seed"] == 2 else 2
            prof.enable()
            o = transition(seed)
            prof.disable()
            prof_ovh.append(o.controller_overhead_s)
        ps = pstats.Stats(prof)
        rows = sorted(((v[2], v[0], f"{k[0].rsplit('/', 2)[-1]}:{k[1]}({k[2]})")
                       for k, v in ps.stats.items()), reverse=True)  # type: ignore[attr-defined]
        R["overhead_profile"] = {
            "transitions": n_prof,
            "controller_overhead_s_profiled": med(prof_ovh),
            "top_tottime_us_per_transition": [
                {"fn": fn, "calls": calls // n_prof, "us": round(tt / n_prof * 1e6, 1)}
                for tt, calls, fn in rows[:30]]}
        hot_s = med([h["total_s"] for h in hot])
        bare_s = med([b["total"] for b in bare])
        upd = med([h["transport"]["update_s"] for h in hot])
        copy_gpu = med([h["engine"].get("copy_gpu_s", 0.0) for h in hot])
        ovh = med([h["controller_overhead_s"] / h["total_s"] for h in hot])
        R["benchmark"] = {"reps": args.reps, "hot": hot, "bare": bare}
        R["staging_checksum_s"] = med([h["staging_checksum_s"] for h in hot])
        R["engine_checksum_s"] = med([h["engine_checksum"]["engine_s"] for h in hot])
        R["engine_checksum_rpc_s"] = med([h["engine_checksum"]["rpc_s"] for h in hot])
        R["engine_checksum_via"] = sorted({str(h["engine_checksum"]["via"]) for h in hot})
        R["worker_publish_s"] = med([float(h["engine"].get("publish_s") or 0.0) for h in hot])
        R["hot_s"] = hot_s
        R["bare_primitives_s"] = bare_s
        R["hot_over_bare"] = hot_s / bare_s if hot_s and bare_s else None
        R["controller_overhead_fraction"] = ovh
        R["transfer_update_call_s"] = upd
        R["transfer_gbps"] = packed.nbytes / upd / 1e9 if upd else None
        R["engine_copy_gpu_s"] = copy_gpu
        R["engine_copy_gbps"] = packed.nbytes / copy_gpu / 1e9 if copy_gpu else None
        phases: dict[str, list[float]] = {}
        for h in hot:
            for k, v in h["breakdown"].items():
                phases.setdefault(k, []).append(v)
        R["hot_phase_medians_s"] = {k: med(v) for k, v in phases.items()}
        bph: dict[str, list[float]] = {}
        for b in bare:
            for k, v in b.items():
                bph.setdefault(k, []).append(v)
        R["bare_phase_medians_s"] = {k: med(v) for k, v in bph.items()}
        log(f"hot {hot_s:.4f}s bare {bare_s:.4f}s update {upd * 1e3:.1f}ms "
            f"({R['transfer_gbps']:.0f} GB/s) overhead {ovh:.4%}")

    with stage("service_path"):
        if not args.service:
            R["service_path"] = {"skipped": "--no-service"}
        else:
            from rolloutcore.engine.http import VllmHTTP
            from rolloutcore.engine.port import VllmAdapter
            from rolloutcore.service import ServiceConfig
            from rolloutcore.service.client import RolloutCoreClient

            # The gateway's own adapter: no transport (the trainer sends through it).
            gw_adapter = VllmAdapter(VllmHTTP(engine.base_url, timeout_s=120), None,
                                     engine_epoch=engine.epoch)
            gw_adapter.bootstrap()
            gw_runner = LifecycleRunner(controller, gw_adapter, deadlines)
            token = "h200-service-phase-0123456789abcdef"
            # No engine watch: the bare cycles interleaved here are, to the gateway,
            # out-of-band writes (and vLLM 0.26 counts none it could see).
            cfg = ServiceConfig(upstream_url=engine.base_url, control_token=token,
                                transport={"backend": BACKEND}, health_interval_s=0,
                                min_verification="engine-checksum")
            sbody = wire(by_reference=True)

            def prepare(seed: int) -> tuple[Any, ...]:
                assert packed is not None
                fill(packed, seed)
                transport.precompute_checksum(packed)  # at staging, as in process
                state["seed"] = seed
                return (source, identity(seed), Provenance(
                    f"synthetic-qwen3-8b-seed{seed}", "h200-harness-service", seed), False,
                    "engine-checksum")

            def bare() -> float:
                assert packed is not None
                other = 1 if state["seed"] == 2 else 2
                fill(packed, other)
                t = http.bare_cycle(sbody)["total"]
                fill(packed, 1 if other == 2 else 2)  # back to what the gateway published
                http.bare_cycle(sbody)
                return t

            def seeds() -> Any:
                while True:
                    yield 1 if state["seed"] == 2 else 2

            R["service_path"] = service_phase(
                gw_runner, cfg,
                lambda url: RolloutCoreClient(url, token, transport=transport,
                                              connected_to=engine.base_url,
                                              begin_timeout_s=300, report_timeout_s=300),
                prepare, seeds(), args.service_reps or args.reps, bare)
            sp = R["service_path"]
            R["service_s"] = sp["service_s"]
            R["service_over_bare"] = sp["service_over_bare"]
            R["service_over_hot"] = (sp["service_s"] / R["hot_s"]
                                     if sp["service_s"] and R.get("hot_s") else None)
            log(f"service path: {sp['service_s']:.4f}s, bare {sp['bare_primitives_s']:.4f}s, "
                f"ratio {sp['service_over_bare']:.3f}, verification {sp['verification']}")

    with stage("spans_and_pause"):
        skipped("spans_and_pause")
        R["spans_and_pause"] = spans_and_pause(http, state, transition)
        sp = R["spans_and_pause"]
        R["spans_checked"] = sp.get("spans_checked")
        log(f"spans and pause: {json.dumps({k: v for k, v in sp.items() if k != 'spans'})}")

    with stage("d2d_copy"):
        skipped("d2d_copy")
        dst = torch.empty_like(packed.buffer)
        ts = []
        for _ in range(12):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(packed.buffer)
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e) / 1e3)
        t = med(ts[2:])
        assert t is not None
        cold = []
        for _ in range(6):  # as in an update: the GPU idle for a while before the copy
            time.sleep(0.05)
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            dst.copy_(packed.buffer)
            e.record()
            e.synchronize()
            cold.append(s.elapsed_time(e) / 1e3)
        tc = med(cold)
        assert tc is not None
        R["d2d_copy_after_idle_s"] = tc
        R["d2d_copy_after_idle_gbps"] = packed.nbytes / tc / 1e9
        seg = []  # the same bytes as 399 per-tensor copies (the update's launch pattern)
        views = [dst[e.offset_bytes:e.offset_bytes + e.nbytes] for e in packed.entries]
        srcs = [packed.buffer[e.offset_bytes:e.offset_bytes + e.nbytes] for e in packed.entries]
        for _ in range(6):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for a, b in zip(views, srcs, strict=True):
                a.copy_(b, non_blocking=True)
            e.record()
            e.synchronize()
            seg.append(s.elapsed_time(e) / 1e3)
        tp = med(seg[1:])
        assert tp is not None
        R["d2d_per_tensor_copies_gbps"] = packed.nbytes / tp / 1e9
        with contextlib.suppress(Exception):  # the SM-copy kernel, same process, same bytes
            from rolloutcore.transports.cuda_ipc import kernels as cuda_kernels

            kt = []
            for _ in range(6):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                cuda_kernels.multi_copy(views, srcs)
                e.record()
                e.synchronize()
                kt.append(s.elapsed_time(e) / 1e3)
            tk = med(kt[1:])
            assert tk is not None
            R["d2d_kernel_copy_gbps"] = packed.nbytes / tk / 1e9
            R["d2d_kernel_copy_bitexact"] = all(
                torch.equal(a, b) for a, b in zip(views, srcs, strict=True))
        log(f"d2d after idle {tc * 1e3:.2f} ms, per-tensor {tp * 1e3:.2f} ms")
        R["d2d_copy_s"] = t
        R["d2d_copy_gbps"] = packed.nbytes / t / 1e9
        R["d2d_note"] = ("one device-to-device copy of the trainer buffer (all 399 tensors, "
                         "same bytes), bytes/time counting each byte once; median of 10 "
                         "after 2 warm-ups")
        del dst, views, srcs
        torch.cuda.empty_cache()
        log(f"d2d copy {t * 1e3:.2f} ms = {R['d2d_copy_gbps']:.0f} GB/s")

    with stage("bitexact"):
        skipped("bitexact")
        rpc = transport.rpc
        ref = send(1, "reference", "ref-1")
        R["reference_update"] = ref
        R["reference_update_gbps"] = packed.nbytes / ref["update_s"] / 1e9
        log(f"reference (load_weights) update: {ref['update_s'] * 1e3:.1f} ms")
        snap = rpc(http.base, "rc_cuda_ipc_snapshot", "take")[0]
        a = rpc(http.base, "rc_cuda_ipc_param_checksums")[0]
        first = send(2, "fast", "fast-2")
        c = rpc(http.base, "rc_cuda_ipc_param_checksums")[0]
        back = send(1, "fast", "fast-1")
        cmp = rpc(http.base, "rc_cuda_ipc_snapshot", "compare")[0]
        b = rpc(http.base, "rc_cuda_ipc_param_checksums")[0]
        rpc(http.base, "rc_cuda_ipc_snapshot", "drop")
        changed = sum(x != y for x, y in zip(a["values"], c["values"], strict=True))
        R["bitexact"] = {
            "method": "engine params after vLLM's load_weights path (reference mode, "
                      "layerwise reload) snapshotted; fast path then loads other weights "
                      "(seed 2) and the same weights again (seed 1); every parameter is "
                      "compared bytewise (torch.equal on uint8 views) with the snapshot",
            "snapshot": snap, "compare": cmp,
            "params": len(a["names"]),
            "params_changed_by_other_weights": changed,
            "param_checksums_equal": a["values"] == b["values"],
            "passed": cmp["n_mismatched"] == 0 and cmp["compared"] == len(a["names"])
            and a["values"] == b["values"] and changed == len(a["names"]),
            "first_fast_update": first, "second_fast_update": back,
            "param_checksum_s": a["elapsed_s"]}
        log(f"bitexact: {R['bitexact']['passed']} (mismatched {cmp['n_mismatched']}, "
            f"changed by other weights {changed}/{len(a['names'])})")

    with stage("restart"):
        skipped("restart")
        engine.stop()
        stop_s = engine.last_stop_s
        engine.start()
        R["restart_stop_s"] = stop_s
        R["restart_start_s"] = engine.last_start_s
        R["restart_s"] = (stop_s or 0.0) + (engine.last_start_s or 0.0)
        t = time.monotonic()
        transport.close()
        transport.connect(engine.base_url, timeout_s=120)
        fill(packed, 1)
        h2 = Http(engine.base_url)
        h2.post("/pause", params={"mode": "wait", "clear_cache": "false"})
        transport.send(engine.base_url, "after-restart", packed, timeout_s=300)
        h2.post("/resume")
        R["restart_then_load_weights_s"] = R["restart_s"] + time.monotonic() - t
        log(f"restart {R['restart_s']:.1f}s (stop {stop_s:.1f}s)")

    if R.get("hot_s") and R.get("restart_s"):
        R["ratio"] = R["restart_s"] / R["hot_s"]
    if R.get("transfer_gbps") and R.get("d2d_copy_gbps"):
        R["transfer_fraction_of_d2d"] = R["transfer_gbps"] / R["d2d_copy_gbps"]
    R["evidence_used"] = (
        "vLLM 0.26 has no weight_version and no /weight_checker: the paused validation "
        "compares the workers' block checksum (int32 sums of 512-byte blocks weighted by "
        "position, mod 2^32, per tensor) of the parameter slices the update wrote with the "
        "trainer's block checksum of the buffer it sent (taken at staging); the workers "
        "hash inside /finish_weight_update and write the values, a names digest and the "
        "trainer's per-update nonce (last) into a trainer-owned CUDA IPC result buffer, "
        "which the validation reads (engine_checksum_via: ipc; /collective_rpc "
        "rc_cuda_ipc_checksum is the fallback and the ablations' route); coverage = "
        "fraction of tensors compared; it sets verification level engine-checksum")
    with contextlib.suppress(Exception):
        engine.stop()
    return finish(out, logs)


def finish(out: Path, logs: Path) -> int:
    R = RESULTS
    R["wall_s"] = time.monotonic() - T_START
    keys = ["hot_s", "bare_primitives_s", "restart_s", "ratio",
            "controller_overhead_fraction", "transfer_gbps", "d2d_copy_gbps",
            "service_s", "service_over_bare", "service_over_hot"]
    R["summary"] = {k: R.get(k) for k in keys}
    (out / "h200-8b-ipc.json").write_text(json.dumps(R, indent=1, default=str))
    (out / "gpu-results.md").write_text(table(R))
    if logs.is_dir():
        for i, f in enumerate(sorted(logs.glob("*.log"))[:3]):
            data = f.read_bytes()
            (out / f"vllm-{i + 1}.log").write_bytes(data[-3_000_000:])
    print(table(R), flush=True)
    for k, v in R["errors"].items():
        print(f"ERROR in {k}: {v.splitlines()[0]}", flush=True)
    return 0 if not R["errors"] else 1


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(R: dict[str, Any]) -> str:
    hp = R.get("hot_phase_medians_s", {})
    bp = R.get("bare_phase_medians_s", {})
    lines = [
        "| measure | value | target |", "| --- | --- | --- |",
        f"| hot_s (full verified RolloutCore transition, median) | {_f(R.get('hot_s'), '.4f')} s"
        " | <= 0.25 s |",
        f"| bare_primitives_s (pause, start, update, finish, reset, resume) | "
        f"{_f(R.get('bare_primitives_s'), '.4f')} s | |",
        f"| hot / bare | {_f(R.get('hot_over_bare'), '.3f')} | <= 1.3 |",
        f"| service_s (same transition through gateway + client, median) | "
        f"{_f(R.get('service_s'), '.4f')} s | |",
        f"| service / bare | {_f(R.get('service_over_bare'), '.3f')} | <= 1.3 |",
        f"| controller_overhead_fraction | {_f(R.get('controller_overhead_fraction'), '.4%')}"
        " | < 1% |",
        f"| restart_s (stop + start to health) | {_f(R.get('restart_s'), '.1f')} s | |",
        f"| ratio restart / hot | {_f(R.get('ratio'), '.0f')} | >= 300 |",
        f"| transfer_gbps (bytes / update_weights call) | {_f(R.get('transfer_gbps'), '.0f')}"
        " GB/s | |",
        f"| engine copy (GPU time in the worker) | {_f(R.get('engine_copy_gbps'), '.0f')} GB/s"
        " | |",
        f"| d2d_copy_gbps (same bytes) | {_f(R.get('d2d_copy_gbps'), '.0f')} GB/s | |",
        f"| transfer / d2d | {_f(R.get('transfer_fraction_of_d2d'), '.1%')} | >= 50% |",
        f"| bit-exact vs load_weights | {R.get('bitexact', {}).get('passed')} | True |",
    ]
    if hp:
        lines += ["", "Phase medians (s), RolloutCore: " + ", ".join(
            f"{k} {v:.4f}" for k, v in hp.items() if v is not None)]
    if bp:
        lines += ["Phase medians (s), bare: " + ", ".join(
            f"{k} {v:.4f}" for k, v in bp.items() if v is not None)]
    ic = R.get("impl_compare", {})
    if ic.get("copy"):
        lines += ["", "| copy impl | update call | GPU copies | GB/s (GPU) |",
                  "| --- | --- | --- | --- |"]
        for k, c in ic["copy"].items():
            lines.append(f"| {k} ({c.get('engine_copy_impl')}) | "
                         f"{_f(c.get('update_s'), '.4f')} s | {_f(c.get('copy_gpu_s'), '.4f')} s"
                         f" | {_f(c.get('copy_gbps'), '.0f')} |")
        lines.append(f"\nupdate call with full entries {_f(ic.get('full_entries_update_s'), '.4f')}"
                     f" s, by reference {_f(ic.get('by_reference_update_s'), '.4f')} s")
    if ic.get("checksum"):
        lines.append(f"checksum: {json.dumps(ic['checksum'])}")
    for name, a in (R.get("ablations") or {}).items():
        lines.append(f"ablation {name}: hot {_f(a.get('hot_s'), '.4f')} s, finish "
                     f"{_f(a.get('finish_s'), '.4f')} s, phases " + ", ".join(
                         f"{k} {v:.4f}" for k, v in a.get("phase_medians_s", {}).items()
                         if v is not None))
    if R.get("d2d_kernel_copy_gbps"):
        lines.append(f"d2d in one process: memcpy {_f(R.get('d2d_copy_gbps'), '.0f')} GB/s, "
                     f"one-launch kernel over the 399 tensors "
                     f"{_f(R.get('d2d_kernel_copy_gbps'), '.0f')} GB/s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    try:
        rc = main()
    except BadInput as exc:
        print(f"bad input: {exc}", file=sys.stderr)
        rc = 2
    finally:
        shutil.rmtree("/tmp/rc-qwen3-8b", ignore_errors=True)
    sys.exit(rc)
