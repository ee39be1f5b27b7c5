"""``rolloutcore live-update``: the main job, a live policy update on a real vLLM.

It generates two tiny checkpoints offline (A and B: same architecture,
different weights), starts vLLM on A, starts a long rollout under A's
version, and while that rollout is mid-generation moves the running engine
to B through RolloutCore. It then shows that the rollout finished under A
(controller binding and vLLM's own per-token version spans), that B was
published only after every step produced evidence that holds, and that the
same engine process now serves B.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from rolloutcore.cli import argtypes
from rolloutcore.cli.vocab import add_report, emit, timeline_lines

__all__ = ["add_arguments", "run_live_update"]


def run_live_update(workdir: Path, *, journal_path: Path | None = None,
                    rollout_tokens: int = 400, progress: bool = True) -> dict[str, Any]:
    from rolloutcore.core.versions import Provenance
    from rolloutcore.session import EngineSession
    from rolloutcore.testing.models import make_checkpoint

    workdir.mkdir(parents=True, exist_ok=True)
    a, b = workdir / "policy-A", workdir / "policy-B"
    t0 = time.monotonic()
    for d, seed in ((a, 1), (b, 2)):
        if not (d / "config.json").exists():
            make_checkpoint(d, seed)
    report: dict[str, Any] = {"checkpoints": {"A": str(a), "B": str(b)},
                              "make_checkpoints_s": time.monotonic() - t0}
    t1 = time.monotonic()
    # Every log under the workdir: the engine's in WORKDIR/logs.
    session = EngineSession.launch(a, journal_path=journal_path, progress=progress,
                                   engine_kwargs={"log_dir": workdir / "logs"})
    try:
        report["engine_start_s"] = time.monotonic() - t1
        engine = session.engine
        assert engine is not None  # launch() starts one
        pid_before = engine.pid
        v0 = session.bootstrap(a, Provenance("policy-A", "live-update", 0))
        c, h = session.controller, session.http
        prompt = [(7 * i + 3) % 250 + 1 for i in range(100)]
        result: dict[str, Any] = {}

        def long_rollout() -> None:
            binding = c.admit("R-long")
            try:
                g = h.generate(prompt, max_tokens=rollout_tokens, ignore_eos=True)
                result["gen"] = g
            finally:
                result["done"] = c.complete("R-long")
                result["binding"] = binding

        # Identity, policy probe and transport connection first: admission is
        # closed only for the transition itself.
        prepared = session.prepare(b, Provenance("policy-B", "live-update", 1))
        th = threading.Thread(target=long_rollout, name="R-long")
        th.start()
        while not c.active and th.is_alive():
            time.sleep(0.01)
        time.sleep(0.05)  # genuinely mid-generation
        upd = session.apply(prepared)
        th.join()
        g = result["gen"]
        after = h.generate(prompt, max_tokens=16)
        report.update({
            "engine_pid_before": pid_before, "engine_pid_after": engine.pid,
            "committed_before": v0.to_dict(),
            "published": upd.version.to_dict(),
            "identity": upd.identity.to_dict(),
            "long_rollout": {
                "bound_to": result["binding"].version.label,
                "tokens": len(g.token_ids),
                "engine_spans": [s.__dict__ for s in (g.weight_versions or ())],
            },
            "after_update": {"engine_spans": [s.__dict__ for s in (after.weight_versions or ())],
                             "tokens": list(after.token_ids)},
            "timeline": c.history(),
            "phases_s": upd.outcome.breakdown(),
        })
        return report
    finally:
        session.close()


def _format(report: dict[str, Any]) -> str:
    lr, ident = report["long_rollout"], report["identity"]
    return "\n".join([
        f"engine started in {report['engine_start_s']:.1f}s (pid {report['engine_pid_before']})",
        f"long rollout: bound to {lr['bound_to']}, {lr['tokens']} tokens, "
        f"vLLM per-token spans {json.dumps(lr['engine_spans'])}",
        *timeline_lines(report["timeline"], report["phases_s"]),
        f"published {report['published']['label']} on the same engine process "
        f"(pid {report['engine_pid_after']}); verification: {ident['verification']}",
        *(f"  evidence: {e}" for e in ident["evidence"]),
        f"after the update: vLLM spans {json.dumps(report['after_update']['engine_spans'])}"])


def _cmd(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rc-live-"))
    try:
        rep = run_live_update(workdir, journal_path=Path(args.journal) if args.journal
                              else None, rollout_tokens=args.rollout_tokens,
                              progress=not args.quiet and not args.json)
    except BaseException:
        print(f"rolloutcore live-update: failed; the engine's log is in {workdir / 'logs'}",
              file=sys.stderr)
        raise
    emit(args, json.dumps(rep, indent=2, default=str), _format(rep))
    ok = (rep["engine_pid_before"] == rep["engine_pid_after"]
          and {s["version"] for s in rep["long_rollout"]["engine_spans"]}
          <= {rep["long_rollout"]["bound_to"]})
    return 0 if ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore live-update``."""
    p.add_argument("--workdir", help="where the checkpoints go, and every log (the engine's "
                   "in WORKDIR/logs, its path printed on a failure; default: a temp dir)")
    p.add_argument("--journal", help="write the lifecycle journal (JSON lines) here")
    add_report(p, "the full report", old_json=True)
    p.add_argument("--rollout-tokens", type=argtypes.int_in(1, 400), default=400,
                   help="length of the rollout in flight during the update (1-400: the "
                        "model's context is 512)")
    p.add_argument("--quiet", action="store_true", help="no start-up progress")
    p.set_defaults(func=_cmd)
