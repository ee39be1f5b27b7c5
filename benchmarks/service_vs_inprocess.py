"""The same update through the gateway and in process: same engine, same verification.

Not a test: it measures and writes ``results/service-vs-inprocess.json``
(``inprocess_s``, ``service_s``, ``service_over_inprocess``,
``protocol_overhead_s``, ``verification_service``, ``verification_inprocess``,
plus every update's numbers, the machine, the versions and the command) and
prints a table.

Setup: one vLLM (launched here on a generated tiny checkpoint A, with B as
the other policy; or ``--upstream URL --checkpoint-a DIR --checkpoint-b DIR``)
with the gloo weight-transfer backend, and one gateway in its own process
(``python -m rolloutcore serve --upstream ...``). Both paths drive the same
engine with the same weight transport object (one transfer group per
engine) and the same trainer-side work done beforehand, outside the timed
region: the identity (content digest) and the policy probe of A and B are
computed once. Timed:

* in process: ``EngineSession.apply(prepared)`` (drain, pause, preflight,
  transfer, reset, paused validation, resume, probe with admission closed,
  publish), min_verification ``probe``;
* through the gateway: ``RolloutCoreClient.update(source, provenance,
  identity=..., probe=...)``: begin (with the probe's expectations), the
  same transfer, one report that answers once the gateway has validated,
  resumed, probed and published; min_verification the gateway's floor,
  ``probe``.

The two alternate update by update (which one goes first alternates too),
so drift in the machine's load hits both alike; every update changes the
weights (A to B and back). The gateway's engine watch is off
(``--health-interval-s 0``): the in-process path's writes are, to the
gateway, out-of-band writes, and it would rightly taint on them.

``protocol_overhead_s`` is the median, over the service path's updates, of
the client's wall time minus the time inside engine and transport effects
(the gateway's own phase times: pause, transfer, invalidate, validate,
resume, validate_live): the begin and report round trips and the gateway's
bookkeeping. ``inprocess_overhead_s`` is the same for the in-process path.

    python benchmarks/service_vs_inprocess.py [--updates 11] [--out results/...]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
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
EFFECT_PHASES = ("pause", "preflight", "transfer", "invalidate", "validate", "resume",
                 "validate_live", "lease_check")
TOKEN = "service-vs-inprocess-0123456789abcdef"


def _soak() -> Any:
    spec = importlib.util.spec_from_file_location("rc_bench_soak", ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _overhead(wall_s: float, phases: dict[str, float]) -> float:
    return max(0.0, wall_s - sum(phases.get(p, 0.0) for p in EFFECT_PHASES))


def _gateway(upstream: str, checkpoint: Path, work: Path) -> tuple[subprocess.Popen[bytes],
                                                                  str]:
    from rolloutcore.engine.process import free_port

    port = free_port()
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    log = work / "gateway.log"
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", upstream,
           "--checkpoint", str(checkpoint), "--port", str(port), "--token-file",
           str(token_file), "--health-interval-s", "0", "--journal",
           str(work / "gateway-journal.jsonl")]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"the gateway exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the gateway did not start:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.session import EngineSession, PreparedUpdate, identity_of
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource
    from rolloutcore.verification.probe import PolicyProbe

    soak = _soak()
    load_start = os.getloadavg()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-service-vs-inprocess-"))
    engine = None
    if args.upstream:
        url, ckpt = args.upstream.rstrip("/"), {"A": Path(args.checkpoint_a),
                                                "B": Path(args.checkpoint_b)}
    else:
        from rolloutcore.engine.process import ManagedEngine
        from rolloutcore.testing.models import make_checkpoint

        ckpt = {"A": make_checkpoint(work / "A", 1), "B": make_checkpoint(work / "B", 2)}
        engine = ManagedEngine(ckpt["A"], backend="rolloutcore_gloo", log_dir=work / "logs",
                               startup_timeout_s=900)
        print("[bench] starting vLLM ...", file=sys.stderr)
        engine.start()
        url = engine.base_url
    gw_proc = None
    try:
        src = {k: WeightSource.from_checkpoint(p) for k, p in ckpt.items()}
        probes = {k: PolicyProbe.from_checkpoint(str(p)) for k, p in ckpt.items()}
        transport = GlooTransport()
        session = EngineSession(VllmHTTP(url, timeout_s=120), transport,
                                engine_epoch=None if engine is None else engine.epoch)
        session.runner.bootstrap(identity_of(src["A"], Provenance(str(ckpt["A"]), "bench", 0)))
        gw_proc, gw = _gateway(url, ckpt["A"], work)
        client = RolloutCoreClient(gw, TOKEN, transport=transport, begin_timeout_s=300,
                                   report_timeout_s=300)
        rows: list[dict[str, Any]] = []
        holds = "A"
        for i in range(args.warmup + args.updates):
            order = ("inprocess", "service") if i % 2 == 0 else ("service", "inprocess")
            for path in order:
                nxt = "B" if holds == "A" else "A"
                prov = Provenance(str(ckpt[nxt]), "bench", i + 1)
                ident = identity_of(src[nxt], prov)
                if path == "inprocess":
                    prepared = PreparedUpdate(src[nxt], prov, ident, probes[nxt], None)
                    t0 = time.monotonic()
                    res = session.apply(prepared, label=f"ip-{i}")
                    wall = time.monotonic() - t0
                    phases = res.outcome.breakdown()
                    level = res.identity.verification.wire
                else:
                    t0 = time.monotonic()
                    sres = client.update(src[nxt], prov, identity=ident, probe=probes[nxt],
                                         owner="bench")
                    wall = time.monotonic() - t0
                    phases = dict(sres.phases)
                    level = str(sres.verification)
                holds = nxt
                row = {"round": i, "path": path, "target": nxt, "wall_s": wall,
                       "overhead_s": _overhead(wall, phases), "verification": level,
                       "phases": phases, "warmup": i < args.warmup}
                rows.append(row)
                print(f"[bench] {i:2d} {path:9s} -> {nxt}: {wall:.3f} s "
                      f"(overhead {row['overhead_s']:.4f} s, {level})", file=sys.stderr)
        client.close()
        session.http.close()
        session.journal.close()
    finally:
        if gw_proc is not None and gw_proc.poll() is None:
            os.killpg(gw_proc.pid, signal.SIGTERM)
            try:
                gw_proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(gw_proc.pid, signal.SIGKILL)
        if engine is not None:
            engine.stop()
    timed = [r for r in rows if not r["warmup"]]
    ip = [r["wall_s"] for r in timed if r["path"] == "inprocess"]
    sv = [r["wall_s"] for r in timed if r["path"] == "service"]
    pairs = [s["wall_s"] / p["wall_s"] for p, s in zip(
        [r for r in timed if r["path"] == "inprocess"],
        [r for r in timed if r["path"] == "service"], strict=True)]
    lv_ip = sorted({r["verification"] for r in timed if r["path"] == "inprocess"})
    lv_sv = sorted({r["verification"] for r in timed if r["path"] == "service"})

    def med_phase(path: str, name: str) -> float:
        return _median([r["phases"].get(name, 0.0) for r in timed if r["path"] == path])

    return {
        "inprocess_s": round(_median(ip), 4),
        "service_s": round(_median(sv), 4),
        "service_over_inprocess": round(_median(sv) / _median(ip), 3),
        "service_over_inprocess_paired_median": round(_median(pairs), 3),
        "protocol_overhead_s": round(_median([r["overhead_s"] for r in timed
                                              if r["path"] == "service"]), 4),
        "inprocess_overhead_s": round(_median([r["overhead_s"] for r in timed
                                               if r["path"] == "inprocess"]), 4),
        "verification_service": lv_sv[0] if len(lv_sv) == 1 else lv_sv,
        "verification_inprocess": lv_ip[0] if len(lv_ip) == 1 else lv_ip,
        "updates_per_path": len(ip),
        "warmup_rounds": args.warmup,
        "phases_median_s": {p: {n: round(med_phase(p, n), 4) for n in
                                ("pause", "transfer", "invalidate", "validate", "resume",
                                 "validate_live", "controller_overhead", "total")}
                            for p in ("inprocess", "service")},
        "updates": rows,
        "machine": {**soak.machine(), "loadavg_at_start": load_start},
        "load_average_after": os.getloadavg(),
        "versions": soak.versions(),
        "command": shlex.join([sys.executable, *sys.argv]),
        "notes": ["same engine, same GlooTransport object, same precomputed identity and "
                  "policy probe on both paths; paths alternate update by update",
                  "the gateway's engine watch is off (--health-interval-s 0): the in-process "
                  "path's writes would be out-of-band writes to it",
                  "protocol_overhead_s: client wall time minus the gateway's engine/transport "
                  "phase times (begin + report round trips and bookkeeping)"],
    }


def _table(rep: dict[str, Any]) -> str:
    lines = ["| path | median s per update | overhead s (outside engine/transport) | "
             "verification |", "|---|---|---|---|",
             f"| in process | {rep['inprocess_s']:.3f} | {rep['inprocess_overhead_s']:.4f} | "
             f"{rep['verification_inprocess']} |",
             f"| through the gateway | {rep['service_s']:.3f} | {rep['protocol_overhead_s']:.4f}"
             f" | {rep['verification_service']} |",
             f"| ratio | {rep['service_over_inprocess']:.3f} (paired "
             f"{rep['service_over_inprocess_paired_median']:.3f}) | | |"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--updates", type=int, default=11, help="timed updates per path (>= 9)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    p.add_argument("--upstream", default=None)
    p.add_argument("--checkpoint-a", default=None)
    p.add_argument("--checkpoint-b", default=None)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default=str(ROOT / "results" / "service-vs-inprocess.json"))
    args = p.parse_args(argv)
    if args.updates < 9:
        p.error("--updates must be at least 9 (medians of at least 9)")
    if args.upstream and not (args.checkpoint_a and args.checkpoint_b):
        p.error("--upstream needs --checkpoint-a (what it serves) and --checkpoint-b")
    rep = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rep, indent=2, default=str) + "\n")
    print(_table(rep))
    print(f"[bench] wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
