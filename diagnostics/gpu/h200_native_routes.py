#!/usr/bin/env python3
"""GPU: vLLM's own ``ipc`` trainer engine through the gateway's native routes, and direct.

Issue #46's GPU part, on one GPU (trainer and engine share it), Qwen3-8B shapes
(399 bf16 tensors, 16.4 GB), vLLM 0.26.0 carried to the device (README.md here):

* the engine: ``vllm serve`` started by ``ManagedEngine`` with vLLM's own
  ``--weight-transfer-config '{"backend":"ipc"}'``,
  ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the handles travel pickled),
  ``--load-format dummy --skip-tokenizer-init --enforce-eager`` and
  RolloutCore's route guard (``--engine guarded``, what ``serve --model``
  runs; ``open``: no guard, as an ``--upstream`` vLLM);
* the sender, unmodified, in this process: vLLM's
  ``HTTPVLLMWeightSyncClient(base_url)`` for ``/start_weight_update`` and
  ``/finish_weight_update`` and
  ``IPCWeightTransferEngine.trainer_send_weights(params, {"send_mode":
  "http", "url": base_url})`` for ``/update_weights`` (0.26 has no ipc
  trainer engine for ``WeightTransferTrainerFactory``), then
  ``/reset_prefix_cache`` as TRL does. ``base_url`` is the engine's (direct)
  or the gateway's ``http://127.0.0.1:<port>/rc/<token>`` (native: a path
  prefix; vLLM joins ``f"{url}/update_weights"``);
* the gateway: a process of its own (``--gateway-child``) running what
  ``rolloutcore serve --upstream URL --native-routes`` composes
  (``control.stack.wire``, ``create_app(..., native_token=...)``,
  ``run_until_signalled``), with the guard's key as ``serve`` takes it
  (``upstream_route_key``), engine watch off (the direct rounds are writes it
  does not make), floor ``declared``. ``serve`` itself is not started: its
  takeover needs the checkpoint's safetensors (a dummy-loaded engine has
  none) and computes the checkpoint's policy probe with a forward pass of it
  on the host's CPU (Qwen3-8B: 32 GB float32, minutes), and without that probe
  it refuses a vLLM 0.26 (no label, no check: "no evidence at all", seen on
  the H100); here the runner starts from the declared dummy weights
  (``runner.bootstrap(identity)``, as ``h200_8b_ipc``'s gateway does) and the
  rounds are what is measured.

Rounds: ``--warmup`` + ``--reps`` pairs, interleaved (direct, native; native,
direct; ...), the trainer's buffer refilled with the other policy (seed 1 or
2) before each, outside the timing. After each native round
(``benchmarks/native_routes.after_native_round``): the label the gateway
published (its own, not the previous one; vLLM's client sends none), the
level its journal notes reached, one greedy answer through the gateway
attributed to it (vLLM 0.26 has no per-token spans: the gateway's
``x-rolloutcore-version`` header). Then ``bitexact``: a direct round of seed 1
(vLLM's ``load_weights`` path) is snapshotted in the worker
(``CudaIpcWorkerExtension.rc_cuda_ipc_snapshot``, any backend); two native
rounds (seed 2, seed 1) follow; every parameter must have changed with seed 2
(block checksums) and be bitwise equal to the snapshot after seed 1; greedy
ids from the engine and through the gateway must equal the direct round's.

Writes ``$OUT/native-routes.json`` (the keys of ``results/native-routes.json``:
``native_over_direct``, ``verification``, ``labels_assigned``,
``mislabeled_answers``, the medians, ``round_ratios``, ``phase_medians``, every
round; plus ``bitexact``, ``greedy_equal``, ``problems``, ``machine``,
``versions``, ``command``), ``native-routes.partial.json`` after each stage,
``gateway.log`` and the vLLM log; prints a table and ``NATIVE ROUTES OK`` or
``NATIVE ROUTES HAS PROBLEMS``. ``--plan`` prints what each call measures.

    PYTHONPATH=/tmp/site:$PWD/src python3 diagnostics/gpu/h200_native_routes.py \\
        --out $OUT --gpu-util 0.35 --reps 5
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
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
for _p in (REPO / "src", HERE, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import native_routes as nr  # noqa: E402  (benchmarks/native_routes.py)

TOKEN = "gpu-native-control-0123456789abcdef"
NATIVE = "gpu-native-routes-0123456789abcdef"
LEVEL = "native-unreferenced"
#: What each part takes (s), for the plan; the budget is the device's ~400 s call.
BUDGET_S = 400.0
COSTS = {"import": 15.0, "trainer_weights": 5.0, "engine_start": 95.0, "gateway_start": 15.0,
         "round": 0.6, "after_round": 0.4, "bitexact": 20.0, "stop": 20.0}
PROMPT = [(i * 7919 + 13) % 150000 + 100 for i in range(64)]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    p.add_argument("--reps", type=int, default=5, help="measured pairs (direct + native)")
    p.add_argument("--warmup", type=int, default=1, help="pairs before the measured ones")
    p.add_argument("--gpu-util", type=float, default=0.35,
                   help="vLLM's --gpu-memory-utilization (0.35 on an 80 GB H100: the "
                        "trainer's 16.4 GB and the bit-exact snapshot's 16.4 GB beside it)")
    p.add_argument("--engine", choices=("guarded", "open"), default="guarded",
                   help="guarded: the route guard, its key given to the gateway (what serve "
                        "--model runs; the direct sender's calls carry the key); open: none")
    p.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True,
                   help="--enforce-eager (about 60 s to health instead of 85 s)")
    p.add_argument("--plan", action="store_true", help="print what each call measures")
    p.add_argument("--gateway-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--upstream", default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--journal", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be at least 1 and --warmup at least 0")
    if not 0.05 <= args.gpu_util <= 0.95:
        p.error(f"--gpu-util must be in [0.05, 0.95], got {args.gpu_util}")
    if args.gateway_child and (not args.upstream or not args.port or not args.journal):
        p.error("--gateway-child needs --upstream, --port and --journal")
    return args


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Each call the run makes and what it measures; the time against the budget."""
    pairs = args.warmup + args.reps
    c = COSTS
    est = (c["import"] + c["trainer_weights"] + c["engine_start"] + c["gateway_start"]
           + pairs * (2 * c["round"] + c["after_round"]) + c["bitexact"] + c["stop"])
    return {
        "engine": f"vllm serve (ManagedEngine, backend ipc, {args.engine}), "
                  f"--gpu-memory-utilization {args.gpu_util}"
                  + (", --enforce-eager" if args.eager else ""),
        "calls": {
            "direct round (timed)": "HTTPVLLMWeightSyncClient(engine).start_weight_update; "
                                    "IPCWeightTransferEngine.trainer_send_weights(http, "
                                    "engine) -> POST /update_weights (399 handles, pickled); "
                                    "finish_weight_update; POST /reset_prefix_cache",
            "native round (timed)": "the same four calls with base URL gateway/rc/<token>: "
                                    "the gateway opens the round at start (drain, pause), "
                                    "forwards start/update as sent and finish with its "
                                    "label, closes at finish (reset checked, validated "
                                    "paused, resumed, published); the reset is relayed",
            "after a native round (untimed)": "GET /control/status (label, state), the "
                                              "journal's native_round notes (level, gateway "
                                              "phases), one greedy /inference/v1/generate "
                                              "through the gateway (its version header)",
            "bitexact (untimed)": "direct seed 1 -> /collective_rpc rc_cuda_ipc_snapshot "
                                  "take + rc_cuda_ipc_param_checksums; native seed 2 -> "
                                  "checksums (all changed); native seed 1 -> snapshot "
                                  "compare (0 mismatched) + checksums; greedy ids engine "
                                  "and gateway vs the direct round's",
        },
        "rounds": {"warmup_pairs": args.warmup, "measured_pairs": args.reps,
                   "order": [f"{i}:{p}" for i, p in nr.interleaved(pairs)]},
        "estimate_s": round(est, 1), "budget_s": BUDGET_S, "fits": est <= BUDGET_S,
    }


# ---------------------------------------------------------------------- results

def build_result(rows: list[dict[str, Any]], seen: list[dict[str, Any]],
                 bitexact: dict[str, Any] | None, meta: dict[str, Any]) -> dict[str, Any]:
    """The result JSON: ``benchmarks/native_routes.py``'s keys over the measured rounds,
    the checks of each native round (``seen``: ``after_native_round``), the bit-exact
    check and what ran (``meta``); ``problems`` lists every check that did not hold."""
    measured = [s for s in seen if not s.get("warmup")]
    # Only whole pairs are compared (a run cut short may end inside one).
    pairs = [r for r in rows if sum(x["round"] == r["round"] for x in rows) == 2]
    res: dict[str, Any] = {
        "benchmark": "native_routes_gpu", **meta,
        **(nr.summarize(pairs) if any(not r["warmup"] for r in pairs) else {}),
        "verification": sorted({lv for s in seen for lv in s["levels"]}),
        "labels_assigned": sum(bool(s["assigned"]) for s in measured),
        "mislabeled_answers": sum(bool(s["mislabeled"]) for s in measured),
        "native_rounds": len(measured),
        "attributed_by": sorted({s["attributed_by"] for s in seen}),
        "bitexact": bitexact,
        "greedy_equal": None if bitexact is None else bitexact.get("greedy_equal"),
        "rounds": rows, "after_native_rounds": seen}
    res["problems"] = problems(res)
    return res


def problems(res: dict[str, Any]) -> list[str]:
    """The checks, in words: every measured native round published under the gateway's
    label at the native level, every answer after it attributed to it, the engine's
    weights bit-exact with the direct (``load_weights``) round's, greedy ids equal."""
    out: list[str] = []
    n = res.get("native_rounds", 0)
    if not n or res.get("native_over_direct") is None:
        out.append("no measured native round")
    if res.get("labels_assigned") != n:
        out.append(f"labels_assigned {res.get('labels_assigned')} of {n} native rounds")
    if res.get("mislabeled_answers") != 0:
        out.append(f"mislabeled_answers {res.get('mislabeled_answers')} (0 expected)")
    if res.get("verification") != [LEVEL]:
        out.append(f"verification {res.get('verification')} (expected [{LEVEL!r}])")
    be = res.get("bitexact")
    if not be or not be.get("passed"):
        out.append(f"bitexact did not pass: {None if not be else be.get('why')}")
    if res.get("greedy_equal") is not True:
        out.append(f"greedy ids equal: {res.get('greedy_equal')}")
    return out


def bitexact_verdict(snapshot: dict[str, Any], compare: dict[str, Any], before: list[int],
                     other: list[int], after: list[int], names: list[str],
                     greedy: dict[str, list[int] | None]) -> dict[str, Any]:
    """The bit-exact check from the worker's answers: every parameter changed by the
    other policy (block checksums), bitwise equal to the snapshot of the direct round
    after the same policy came back through the gateway, greedy ids equal."""
    changed = sum(x != y for x, y in zip(before, other, strict=True))
    why = []
    if compare.get("compared") != len(names) or snapshot.get("taken") != len(names):
        why.append(f"compared {compare.get('compared')}, snapshot {snapshot.get('taken')}, "
                   f"parameters {len(names)}")
    if compare.get("n_mismatched") != 0:
        why.append(f"{compare.get('n_mismatched')} parameters differ from the direct "
                   f"round's: {compare.get('mismatched')}")
    if before != after:
        why.append("the parameter checksums differ from the direct round's")
    if changed != len(names):
        why.append(f"the other policy changed {changed} of {len(names)} parameters")
    ref = greedy.get("direct_engine")
    g_eq = ref is not None and all(v == ref for v in greedy.values())
    return {"method": "worker parameters after a direct round (vLLM's load_weights "
                      "through its ipc backend) snapshotted; two rounds through the "
                      "gateway (the other policy, then the same one) follow; every "
                      "parameter compared bytewise (torch.equal on uint8 views) with the "
                      "snapshot, block checksums before, between and after",
            "params": len(names), "params_changed_by_other_weights": changed,
            "snapshot": snapshot, "compare": compare,
            "param_checksums_equal": before == after, "greedy": greedy,
            "greedy_equal": g_eq, "passed": not why, "why": "; ".join(why) or None}


def _f(v: Any, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def table(res: dict[str, Any]) -> str:
    ph = res.get("phase_medians", {})
    lines = ["| measure | value | expected |", "| --- | --- | --- |",
             f"| direct round, median | {_f(res.get('direct_median_s'), '.4f')} s | |",
             f"| native round (gateway), median | {_f(res.get('native_median_s'), '.4f')} s"
             " | |",
             f"| native_over_direct | {_f(res.get('native_over_direct'), '.3f')} | |",
             f"| round_ratio_median | {_f(res.get('round_ratio_median'), '.3f')} | |",
             f"| verification | {res.get('verification')} | ['{LEVEL}'] |",
             f"| labels_assigned | {res.get('labels_assigned')} | "
             f"{res.get('native_rounds')} |",
             f"| mislabeled_answers | {res.get('mislabeled_answers')} | 0 |",
             f"| bit-exact with the direct round | "
             f"{(res.get('bitexact') or {}).get('passed')} | True |",
             f"| greedy ids equal | {res.get('greedy_equal')} | True |"]
    for path in ("direct", "native"):
        calls = (ph.get(path) or {}).get("calls") or {}
        if calls:
            lines.append(f"\n{path} calls (median s): " + ", ".join(
                f"{k} {v:.4f}" for k, v in calls.items()))
    gw = (ph.get("native") or {}).get("phases") or {}
    if gw:
        lines.append("gateway phases (median s): " + ", ".join(
            f"{k} {v:.4f}" for k, v in gw.items()))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- the gateway

def gateway_child(args: argparse.Namespace) -> int:
    """The gateway process: what ``rolloutcore serve --upstream URL --native-routes``
    composes over the running engine (see the module docstring for why not ``serve``
    itself), until SIGTERM."""
    from qwen3_shapes import QWEN3_8B, qwen3_specs

    from rolloutcore.control.runner import Deadlines
    from rolloutcore.control.stack import wire
    from rolloutcore.core.versions import (
        ParameterManifest,
        Provenance,
        VerificationLevel,
        WeightIdentity,
    )
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service import ServiceConfig
    from rolloutcore.service.app import create_app
    from rolloutcore.service.serve import (
        exit_on_signal,
        reachable_verification,
        upstream_route_key,
    )
    from rolloutcore.service.server import run_until_signalled

    url = args.upstream.rstrip("/")
    keyed = upstream_route_key(url)
    adapter = VllmAdapter(VllmHTTP(url), None, drain_timeout_s=Deadlines().pause_s)
    stack = wire(adapter, journal_path=args.journal)
    try:
        manifest = ParameterManifest.from_items(
            (n, s, "bfloat16") for n, s in qwen3_specs(QWEN3_8B))
        ident = WeightIdentity.declare(manifest, Provenance(
            "vllm --load-format dummy (Qwen3-8B shapes)", "h200-native-routes", 0))
        # The declared start, as h200_8b_ipc's gateway has it: the takeover refuses an
        # engine with no label (0.26 has none) when no check runs ("no evidence at all").
        stack.runner.bootstrap(ident)
        reach = reachable_verification(adapter.http.capabilities())
        cfg = ServiceConfig(upstream_url=url, control_token=TOKEN, model="policy",
                            transport={"backend": "ipc"}, health_interval_s=0,
                            min_verification=VerificationLevel.DECLARED,
                            reachable_verification=reach, lease_s=120.0,
                            vocab_size=int(QWEN3_8B["vocab_size"]), max_model_len=4096)
        app = create_app(stack.runner, cfg, native_token=NATIVE)
        run_until_signalled(app, "127.0.0.1", args.port, cfg, exit_on_signal, token=TOKEN,
                            token_given=True, token_out=None,
                            banner=f"native-routes gateway -> vLLM {url} (route key "
                                   f"{'held' if keyed else 'none'}, committed "
                                   f"{stack.controller.committed})")
        return 0
    finally:
        adapter.close()
        if stack.journal is not None:
            stack.journal.close()


@contextlib.contextmanager
def gateway(upstream: str, work: Path, route_key: str | None) -> Iterator[str]:
    """The gateway process on a free loopback port; yields its URL, stops it after."""
    from rolloutcore.engine.process import free_port
    from rolloutcore.transports import engine_key

    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(engine_key.ENV, None)
    if route_key is not None:
        env[engine_key.ENV] = route_key
    log = work / "gateway.log"
    with open(log, "wb") as lf:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()),
                                 "--gateway-child", "--upstream", upstream, "--port",
                                 str(port), "--journal", str(work / "journal.jsonl")],
                                stdout=lf, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        nr.wait_for_health(proc, url, log, 180)
        yield url
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


# ---------------------------------------------------------------------- the sender

class Posts:
    """Every ``requests.post`` of this process (vLLM's clients call it): its route and
    times, for the rows; to a guarded engine the guard's key header is added (a direct
    sender of such an engine must carry it: the same cost, one header more). The
    gateway's URL has no key registered, so its calls go as vLLM sends them."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.handles_chars: int | None = None

    def install(self) -> None:
        import requests

        from rolloutcore.transports import engine_key

        orig = requests.post

        def post(url: str, *a: Any, **kw: Any) -> Any:
            key = engine_key.headers_for(url)
            if key:
                kw["headers"] = {**key, **(kw.get("headers") or {})}
            info = (kw.get("json") or {}).get("update_info") if isinstance(
                kw.get("json"), dict) else None
            if isinstance(info, dict) and "ipc_handles_pickled" in info:
                self.handles_chars = len(info["ipc_handles_pickled"])
            t = time.monotonic()
            try:
                return orig(url, *a, **kw)
            finally:
                self.calls.append({"route": "/" + url.rsplit("/", 1)[-1], "t0": t,
                                   "t1": time.monotonic()})

        requests.post = post


def ipc_round(base: str, params: Callable[[], Iterator[tuple[str, Any]]]) -> None:
    """One round of vLLM's own sender on ``base``: start, the ipc update (http send
    mode), finish, then the prefix reset."""
    import requests
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    client = HTTPVLLMWeightSyncClient(base_url=base)
    client.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(params(), {"send_mode": "http", "url": base})
    client.finish_weight_update()
    requests.post(f"{base}/reset_prefix_cache", timeout=60).raise_for_status()


# ---------------------------------------------------------------------- the run

def gpu_main(args: argparse.Namespace) -> int:
    t_start = time.monotonic()
    import h200_8b_ipc as h4
    import torch
    from h200_colocated import stage_recorder

    from rolloutcore.engine.weight_sync import HttpWeightSync

    log = h4.log          # seconds since that import, as its own runs log
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/rc-native-routes")
    work.mkdir(exist_ok=True)
    (work / "journal.jsonl").unlink(missing_ok=True)
    R: dict[str, Any] = {"stages": {}, "errors": {},
                         "command": " ".join([sys.executable, *sys.argv]),
                         "machine": platform.platform(), "plan": plan(args)}
    state: dict[str, Any] = {"rows": [], "seen": [], "bitexact": None}

    def save(final: bool = False) -> dict[str, Any]:
        res = build_result(state["rows"], state["seen"], state["bitexact"],
                           {k: v for k, v in R.items()})
        name = "native-routes.json" if final else "native-routes.partial.json"
        (out / name).write_text(json.dumps(res, indent=1, default=str))
        return res

    stage = stage_recorder(R, out, log, save)
    R["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    R["versions"] = h4.versions(Path(__file__).resolve(), Path(nr.__file__).resolve())
    vv = str(R["versions"].get("vllm", ""))
    vtuple = tuple(int(x) for x in vv.split(".")[:2] if x.isdigit())
    log(json.dumps(R["versions"]))
    posts = Posts()
    posts.install()
    engine: Any = None
    packed: Any = None
    model_dir = Path("/tmp/rc-qwen3-8b-native")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(h4.QWEN3_8B, indent=1))
    logs = work / "logs"
    closing = contextlib.ExitStack()
    try:
        with stage("trainer_weights"):
            packed = h4.PackedWeights([(n, s, torch.bfloat16)
                                       for n, s in h4.qwen3_specs(h4.QWEN3_8B)],
                                      device="cuda:0")
            h4.fill(packed, 1)
            R["model"] = {"config": "Qwen3-8B public config values", "tensors":
                          len(packed.names()), "bytes": packed.nbytes}
        with stage("engine_start"):
            extra = ["--load-format", "dummy", "--skip-tokenizer-init",
                     "--gpu-memory-utilization", str(args.gpu_util),
                     "--worker-extension-cls", h4.WORKER_EXTENSION,
                     *(["--enforce-eager"] if args.eager else [])]
            engine = h4.ManagedEngine(
                model_dir, backend="ipc", scale_out=vtuple >= (0, 32),
                guard_routes=args.engine == "guarded", max_model_len=4096, extra_args=extra,
                env={"VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1",
                     "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"},
                log_dir=logs, startup_timeout_s=420, stop_grace_s=10)
            engine.start()
            R["engine_command"] = " ".join(engine.command())
            R["cold_start_s"] = engine.last_start_s
            log(f"engine healthy in {engine.last_start_s:.1f}s at {engine.base_url}")
        with stage("sender_import"):
            # vLLM's sender modules (and ray, which its ipc engine imports), before any
            # timed round: the first import is seconds.
            t = time.monotonic()
            import vllm.distributed.weight_transfer.clients
            import vllm.distributed.weight_transfer.ipc_engine  # noqa: F401

            R["sender_import_s"] = round(time.monotonic() - t, 2)
        gw = None
        with stage("gateway_start"):
            if engine is None or packed is None or not engine.alive():
                raise RuntimeError("no engine or no trainer weights: nothing to measure")
            t = time.monotonic()
            gw = closing.enter_context(gateway(engine.base_url, work, engine.route_key))
            R["gateway_start_s"] = round(time.monotonic() - t, 2)
        if gw is not None:
            import httpx

            sync = HttpWeightSync(engine.base_url)

            def rpc(method: str, *a: str) -> Any:
                return sync.collective_rpc(method, list(a), timeout_s=300,
                                           step="rpc")["results"][0]

            eng_http = h4.Http(engine.base_url)
            auth = {"authorization": f"Bearer {TOKEN}"}
            bases = {"direct": engine.base_url, "native": f"{gw}/rc/{NATIVE}"}
            spans = vtuple >= (0, 32)
            sampling = {"detokenize": False}

            def round_on(path: str, seed: int, i: int, warm: bool) -> dict[str, Any]:
                h4.fill(packed, seed)
                posts.calls.clear()
                t0 = time.monotonic()
                ipc_round(bases[path], packed.items)
                t_end = time.monotonic()
                row: dict[str, Any] = {"path": path, "round": i, "seed": seed,
                                       "wall_s": t_end - t0, "warmup": warm,
                                       "calls": nr.calls_of(posts.calls, t0)}
                if path == "native":
                    fin = next(c["t1"] for c in posts.calls
                               if c["route"] == "/finish_weight_update")
                    row["phases"] = {k: round(v, 4) for k, v in nr._phases(
                        nr._journal(work / "journal.jsonl"), t0, t_end, fin).items()}
                return row

            with stage("rounds"):
                prev = httpx.get(f"{gw}/control/status", headers=auth,
                                 timeout=30).json()["committed"]["label"]
                seed = 1
                for i, path in nr.interleaved(args.warmup + args.reps):
                    seed = 2 if seed == 1 else 1
                    row = round_on(path, seed, i, i < args.warmup)
                    if path == "native":
                        seen = nr.after_native_round(gw, auth, work / "journal.jsonl", None,
                                                     spans=spans, previous=prev,
                                                     sampling=sampling)
                        seen.update(round=i, warmup=i < args.warmup)
                        state["seen"].append(seen)
                        row["label"] = prev = seen["label"]
                    state["rows"].append(row)
                    log(f"{path:6s} {i:2d} seed {seed}: {row['wall_s']:.4f} s")
                R["update_handles_pickled_chars"] = posts.handles_chars
            with stage("bitexact"):
                names = rpc("rc_cuda_ipc_param_checksums")["names"]
                round_on("direct", 1, -1, True)
                greedy: dict[str, list[int] | None] = {
                    "direct_engine": eng_http.generate(PROMPT, 16)}
                snap = rpc("rc_cuda_ipc_snapshot", "take")
                before = rpc("rc_cuda_ipc_param_checksums")["values"]
                try:
                    round_on("native", 2, -1, True)
                    other = rpc("rc_cuda_ipc_param_checksums")["values"]
                    round_on("native", 1, -1, True)
                    cmp = rpc("rc_cuda_ipc_snapshot", "compare")
                    after = rpc("rc_cuda_ipc_param_checksums")["values"]
                finally:
                    rpc("rc_cuda_ipc_snapshot", "drop")
                greedy["native_engine"] = eng_http.generate(PROMPT, 16)
                g = httpx.post(f"{gw}/inference/v1/generate", timeout=120, json={
                    "model": "policy", "token_ids": PROMPT, "sampling_params": {
                        "max_tokens": 16, "temperature": 0.0, "ignore_eos": True,
                        **sampling}})
                greedy["native_gateway"] = (list(g.json()["choices"][0]["token_ids"])
                                            if g.status_code == 200 else None)
                state["bitexact"] = bitexact_verdict(snap, cmp, before, other, after, names,
                                                     greedy)
                log(f"bitexact: {state['bitexact']['passed']} "
                    f"({state['bitexact']['why'] or 'every parameter'})")
    finally:
        closing.close()      # the gateway first, then the engine
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.stop()
        for f in sorted(logs.glob("*.log"))[:2] if logs.is_dir() else []:
            (out / f"vllm-{f.name}").write_bytes(f.read_bytes()[-3_000_000:])
        if (work / "gateway.log").is_file():
            (out / "gateway.log").write_bytes((work / "gateway.log").read_bytes()[-3_000_000:])
        R["wall_s"] = round(time.monotonic() - t_start, 1)
    res = save(final=True)
    print(table(res), flush=True)
    for k, v in R["errors"].items():
        print(f"ERROR in {k}: {v.splitlines()[0]}", flush=True)
    bad = res["problems"] or R["errors"]
    print("NATIVE ROUTES HAS PROBLEMS: " + "; ".join(res["problems"]) if bad
          else "NATIVE ROUTES OK", flush=True)
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(json.dumps(plan(args), indent=1))
        return 0
    if args.gateway_child:
        return gateway_child(args)
    return gpu_main(args)


if __name__ == "__main__":
    sys.exit(main())
