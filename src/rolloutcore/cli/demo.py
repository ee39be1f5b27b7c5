"""The no-install demo: one live policy update on the simulated engine.

A long rollout is admitted under the first version and is mid-generation
when the update is requested. The demo shows that the update waits for it
(DRAINING), that its tokens all carry the old version, that the new version
is published only after invalidation, validation and resume, and that the
next rollout runs under the new version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutcore.cli import argtypes
from rolloutcore.cli.vocab import add_json, emit, timeline_lines
from rolloutcore.control.journal import Journal, first_index
from rolloutcore.control.runner import Deadlines
from rolloutcore.control.stack import wire
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights, Generation

__all__ = ["DemoResult", "add_arguments", "format_demo", "run_demo"]


@dataclass
class DemoResult:
    timeline: list[dict[str, Any]]
    long_rollout: dict[str, Any]
    next_rollout: dict[str, Any]
    published: str
    phases: dict[str, float]
    journal_path: str | None
    ordering_ok: bool


def run_demo(*, tokens: int = 64, token_delay_s: float = 0.01,
             journal_path: str | None = None) -> DemoResult:
    engine = FakeEngine(FakeWeights.from_seed(0), token_delay_s=token_delay_s)
    adapter = FakeAdapter(engine)
    journal = Journal(journal_path)
    stack = wire(adapter, journal=journal, deadlines=Deadlines(drain_s=60.0))
    controller, runner = stack.controller, stack.runner
    start = FakeWeights.from_seed(0)
    adapter.stage(start)
    runner.bootstrap(start.identity())

    result: dict[str, Generation] = {}
    bound: dict[str, str] = {}
    started = threading.Event()

    def long_rollout() -> None:
        bound["long"] = controller.admit("R-long").version.label
        started.set()
        try:
            result["long"] = engine.generate(list(range(48)), tokens, request_id="R-long")
        finally:
            controller.complete("R-long")

    th = threading.Thread(target=long_rollout, name="R-long")
    th.start()
    started.wait(5.0)
    time.sleep(token_delay_s * tokens / 4)  # genuinely mid-generation
    nxt = FakeWeights.from_seed(1, step=1)
    adapter.stage(nxt)
    outcome = runner.run_update(nxt.identity(), owner="demo-trainer",
                                min_verification=VerificationLevel.PROBE)
    th.join()
    b2 = controller.admit("R-next")
    g2 = engine.generate(list(range(48)), 16, request_id="R-next")
    controller.complete("R-next")
    journal.close()

    recs = journal.records
    i_done = first_index(recs, "complete", rollout_id="R-long")
    i_begin = first_index(recs, "begin_update")
    g1 = result["long"]
    assert outcome.published is not None
    return DemoResult(
        timeline=controller.history(),
        long_rollout={"tokens": len(g1.tokens), "spans": g1.version_spans,
                      "bound": bound["long"]},
        next_rollout={"tokens": len(g2.tokens), "spans": g2.version_spans,
                      "bound": b2.version.label},
        published=outcome.published.label,
        phases=outcome.breakdown(),
        journal_path=journal_path,
        ordering_ok=0 <= i_done < i_begin,
    )


def format_demo(r: DemoResult) -> str:
    lines = timeline_lines(r.timeline, r.phases)
    lines.append(f"long rollout: bound to {r.long_rollout['bound']}, "
                 f"{r.long_rollout['tokens']} tokens, engine spans "
                 f"{json.dumps(r.long_rollout['spans'])}")
    lines.append(f"published: {r.published}; next rollout bound to "
                 f"{r.next_rollout['bound']}, spans {json.dumps(r.next_rollout['spans'])}")
    lines.append(f"journal shows complete(R-long) before begin_update: {r.ordering_ok}")
    if r.journal_path:
        lines.append(f"journal written to {Path(r.journal_path)}")
    return "\n".join(lines)


def _run(args: argparse.Namespace) -> int:
    r = run_demo(tokens=args.tokens, token_delay_s=args.token_delay_ms / 1000.0,
                 journal_path=args.journal)
    emit(args, json.dumps(dataclasses.asdict(r), indent=2, default=str), format_demo(r))
    return 0 if r.ordering_ok else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore demo``."""
    p.add_argument("--tokens", type=argtypes.positive_int, default=64,
                   help="length of the rollout that is mid-generation (default 64)")
    p.add_argument("--token-delay-ms", type=argtypes.nonneg_float, default=10.0,
                   help="simulated time per token (default 10)")
    p.add_argument("--journal", metavar="PATH", default=None,
                   help="write the lifecycle journal (JSON lines) to PATH")
    add_json(p, "the result (timeline, rollouts, phases)", old_dest="journal",
             old_new="--journal")
    p.add_argument("--report", metavar="PATH", default=None,
                   help="write the result (JSON) to PATH")
    p.set_defaults(func=_run)
