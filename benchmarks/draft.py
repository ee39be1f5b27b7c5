"""Speculative decoding with a draft model on vLLM's CPU build: draft updated vs left stale.

One engine (the tiny target A, decoding with a draft that is a copy of A:
``--speculative-config`` method ``draft_model``, 3 speculative tokens),
taken over by a ``DraftedSession`` (``min_acceptance`` 0.5), then:

* ``--reps`` drafted updates, B -> A -> B ..., each target and draft in one
  transaction (draft round, target round, both checked on the workers,
  target probe + acceptance window, one version): the transaction's phases,
  and the acceptance rate before and after each from vLLM's counters
  (``acceptance_updated``: all windows after an update, pooled);
* a target-only update refused (``UpdateRefused``, nothing changed): its cost;
* the target moved by a draft-unaware trainer (a plain gloo transport, the
  bare vLLM calls), the draft left where it was: the acceptance rate then
  (``acceptance_stale``), the same window's wall time, and whether the
  session's ``check_draft`` catches it.

Writes ``results/draft.json`` and prints a table. Not a test.

``--method eagle``: the same with EAGLE-1 heads (``make_eagle_head``) in
place of the draft copies: A's head is random (accepted about never), B's a
"repeat" head (it proposes the target's last token again, accepted wherever
B repeats one); the stale window moves the target to B and leaves A's head.
No acceptance gate (the random head could not pass one). Writes
``results/draft-eagle.json``.

    .venv/bin/python benchmarks/draft.py [--reps 4] [--method eagle]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SPEC_TOKENS = 3
MIN_ACCEPTANCE = 0.5


def _say(msg: str) -> None:
    print(f"[draft] {msg}", file=sys.stderr, flush=True)


def _pooled(samples: list[Any]) -> dict[str, float | None]:
    d = sum(s.drafted for s in samples)
    a = sum(s.accepted for s in samples)
    return {"drafted": d, "accepted": a, "rate": None if d == 0 else a / d}


def _window(ds: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    s = ds.acceptance.measure(ds.session.http)
    return s, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--method", choices=["draft_model", "eagle"], default="draft_model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    eagle = args.method == "eagle"
    if eagle and args.reps % 2:
        ap.error("--method eagle needs an even --reps (the stale window moves A to B)")
    args.out = args.out or str(ROOT / "results" / ("draft-eagle.json" if eagle
                                                   else "draft.json"))

    import torch
    import vllm

    from rolloutcore.core.versions import Provenance
    from rolloutcore.errors import UpdateRefused
    from rolloutcore.session import DraftedSession, DraftSpec
    from rolloutcore.testing.models import make_eagle_head, make_pair
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource

    t_all = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="rc-draft-bench-"))
    a, b = make_pair(tmp / "ck")
    ckpts = [a, b]
    drafts = ({a: make_eagle_head(tmp / "head-A", 5, target=a),
               b: make_eagle_head(tmp / "head-B", 6, target=b, kind="repeat")} if eagle
              else {a: a, b: b})
    gate = None if eagle else MIN_ACCEPTANCE
    _say(f"checkpoints in {tmp}; starting the engine on A with draft {drafts[a].name}")
    t0 = time.perf_counter()
    ds = DraftedSession.launch(a, DraftSpec(drafts[a], SPEC_TOKENS, method=args.method),
                               min_acceptance=gate,
                               journal_path=tmp / "journal.jsonl", start_timeout_s=900)
    start_s = time.perf_counter() - t0
    out: dict[str, Any] = {}
    try:
        assert ds.session.engine is not None
        command = ds.session.engine.command()
        v0 = ds.bootstrap(a, drafts[a])
        _say(f"engine up in {start_s:.1f} s, taken over as {v0.label}")
        initial, initial_s = _window(ds)
        updates: list[dict[str, Any]] = []
        afters, befores = [], []
        for i in range(args.reps):
            ck = ckpts[(i + 1) % 2]
            t0 = time.perf_counter()
            r = ds.update(ck, Provenance(ck.name, "draft-bench", i + 1),
                          draft_weights=drafts[ck])
            total = time.perf_counter() - t0
            assert r.acceptance_after is not None and r.acceptance_before is not None
            if not eagle or ck == b:  # eagle: B's (repeat) head is the one updated to
                afters.append(r.acceptance_after)
                befores.append(r.acceptance_before)
            updates.append({"to": ck.name, "version": r.version.label, "call_s": total,
                            "transaction_s": r.outcome.total_s, "phases_s": r.phases,
                            "acceptance_before": r.acceptance_before.to_dict(),
                            "acceptance_after": r.acceptance_after.to_dict(),
                            "identity_content_digest": r.identity.content_digest,
                            "digests": r.digests,
                            "verification": r.identity.verification.wire})
            _say(f"drafted update {i + 1}/{args.reps} to {ck.name}: {r.outcome.total_s:.3f} s "
                 f"(draft round {r.phases['draft_transfer_s']:.3f} s, target round "
                 f"{r.phases['target_transfer_s']:.3f} s), acceptance after "
                 f"{r.acceptance_after.rate}")
        updated_window, updated_s = _window(ds)
        now = ckpts[args.reps % 2]
        other = ckpts[(args.reps + 1) % 2]
        # The refusal: a target-only update to this engine.
        state, committed = ds.session.controller.state, ds.session.controller.committed
        t0 = time.perf_counter()
        try:
            ds.update(other, Provenance(other.name, "draft-bench", 99))
            refused = False
        except UpdateRefused:
            refused = True
        refused_s = time.perf_counter() - t0
        unchanged = (ds.session.controller.state is state
                     and ds.session.controller.committed == committed
                     and ds.session.http.weight_info().label == committed.label)
        # A draft-unaware trainer: the bare calls, target only (the draft stays on `now`).
        _say(f"moving the target to {other.name} with the bare calls; draft stays {now.name}")
        ds.transport.close()
        bare = GlooTransport()
        try:
            t0 = time.perf_counter()
            bare.send(ds.session.http.base_url, "target-only",
                      WeightSource.from_checkpoint(other), timeout_s=120)
            target_only_s = time.perf_counter() - t0
        finally:
            bare.close()
        ds.session.http.reset_prefix_cache()
        stale, stale_s = _window(ds)
        caught = ds.check_draft()
        out = {
            "acceptance_updated": _pooled(afters)["rate"],
            "acceptance_stale": stale.rate,
            "acceptance_initial": initial.rate,
            "acceptance_before_updates": _pooled(befores)["rate"],
            "acceptance_updated_pooled": _pooled(afters),
            "acceptance_stale_window": stale.to_dict(),
            "acceptance_updated_window": updated_window.to_dict(),
            "window_s_updated": updated_s,
            "window_s_stale": stale_s,
            "window_s_initial": initial_s,
            "window": {"prompts": len(ds.acceptance.prompts),
                       "max_tokens": ds.acceptance.max_tokens, "temperature": 0.0},
            # Without a gate (eagle) the window is measured, not judged.
            "stale_caught_by_check_draft": None if gate is None else not caught.passed,
            "stale_check_detail": caught.detail,
            "target_only_refused": refused,
            "target_only_refused_s": refused_s,
            "target_only_refusal_changed_nothing": unchanged,
            "bare_target_only_transfer_s": target_only_s,
            "transaction_s": [u["transaction_s"] for u in updates],
            "transaction_median_s": statistics.median(u["transaction_s"] for u in updates),
            "phases_median_s": {k: statistics.median(u["phases_s"].get(k, 0.0)
                                                     for u in updates)
                                for k in sorted({k for u in updates for k in u["phases_s"]})},
            "updates": updates,
            "engine_start_s": start_s,
            "num_speculative_tokens": SPEC_TOKENS,
            "min_acceptance": gate,
            "method": args.method,
            "draft": ("EAGLE-1 heads made offline: A's random, B's a repeat head (proposes "
                      "the target's last token again); acceptance_updated pools the updates "
                      "to B, acceptance_stale is B's target with A's head" if eagle else
                      "a copy of the target (method draft_model): same vocabulary and policy"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": __import__("os").cpu_count(), "torch": torch.__version__,
                        "vllm": vllm.__version__},
            "versions": {"vllm": vllm.__version__, "torch": torch.__version__},
            "command": " ".join(["python", "benchmarks/draft.py", *sys.argv[1:]]),
            "engine_command": command[1:],
            "reps": args.reps,
        }
    finally:
        ds.close()
    out["wall_s"] = time.perf_counter() - t_all
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    ph = out["phases_median_s"]
    rows = [("acceptance, draft updated with the target", f"{out['acceptance_updated']:.3f}"),
            ("acceptance, draft left stale", f"{out['acceptance_stale']:.3f}"),
            ("greedy window, updated / stale (s)",
             f"{out['window_s_updated']:.2f} / {out['window_s_stale']:.2f}"),
            ("drafted transaction, median (s)", f"{out['transaction_median_s']:.3f}"),
            ("  draft round / target round (s)",
             f"{ph.get('draft_transfer_s', 0):.3f} / {ph.get('target_transfer_s', 0):.3f}"),
            ("  validate paused / live (s)",
             f"{ph.get('validate', 0):.3f} / {ph.get('validate_live', 0):.3f}"),
            ("target-only update refused", f"{refused} in {refused_s * 1e6:.0f} us"),
            ("stale draft caught by check_draft", str(out["stale_caught_by_check_draft"]))]
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
