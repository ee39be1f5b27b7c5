"""Measure what the policy probe sees on correct and on wrong updates (real CPU vLLM).

Correct: verified RolloutCore updates to several checkpoints; the probe is
computed by the trainer from each checkpoint (float32 forward of the bf16
weights) and compared with the engine (bf16 kernels): the difference is kernel
noise. Wrong: for every parameter tensor in turn, the engine receives the
target checkpoint with that one tensor taken from another checkpoint (a
mis-routed tensor; sent outside the controller, every endpoint succeeding),
and the same probe measures the difference. The tolerance must sit between
the two distributions; this script records both, and which single-tensor
faults the probe cannot see at that tolerance.

    .venv/bin/python benchmarks/probe_tolerance.py [--checkpoints 5]

Writes results/probe-tolerance.json and prints a summary. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "results" / "probe-tolerance.json"))
    args = ap.parse_args()

    import torch
    import vllm

    from rolloutcore.control.session import EngineSession
    from rolloutcore.core.evidence import PauseMode
    from rolloutcore.core.versions import Provenance
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.source import WeightSource
    from rolloutcore.verification.probe import DEFAULT_TOLERANCE, PolicyProbe

    work = Path(tempfile.mkdtemp(prefix="rc-probe-"))
    ckpts = [make_checkpoint(work / f"s{seed}", seed) for seed in range(1, args.checkpoints + 2)]
    session = EngineSession.launch(ckpts[0])
    correct: list[dict[str, Any]] = []
    wrong: list[dict[str, Any]] = []
    try:
        session.bootstrap(ckpts[0], Provenance("s1", "probe-bench", 0))
        for i, ck in enumerate(ckpts[1:], 1):
            probe = PolicyProbe.from_checkpoint(str(ck))
            res = session.update(ck, Provenance(ck.name, "probe-bench", i), probe=probe)
            assert probe.last is not None
            correct.append({"checkpoint": ck.name, "version": res.version.label,
                            **probe.last.to_dict()})
        # Wrong updates, driven outside the controller (which would taint on the first).
        target, other = ckpts[1], ckpts[2]
        probe = PolicyProbe.from_checkpoint(str(target))
        tgt = dict(WeightSource.from_checkpoint(target).named_tensors())
        oth = dict(WeightSource.from_checkpoint(other).named_tensors())
        h, tr = session.http, session.transport
        for n, name in enumerate(sorted(tgt)):
            mixed = {k: (oth[k] if k == name else v) for k, v in tgt.items()}
            h.pause(PauseMode.WAIT)
            tr.send(h.base_url, f"wrong-{n}", WeightSource.from_state_dict(mixed), timeout_s=120)
            assert h.reset_prefix_cache().engine_success
            h.resume()
            r = probe.measure(h)
            wrong.append({"mis_sent": name, "identical_in_both": bool(torch.equal(tgt[name],
                                                                                   oth[name])),
                          **r.to_dict()})
    finally:
        session.close()

    tol = DEFAULT_TOLERANCE
    cmax = max(c["max_abs_diff"] for c in correct)
    differing = [w for w in wrong if not w["identical_in_both"]]
    missed = [w["mis_sent"] for w in differing if w["max_abs_diff"] <= tol]
    result = {
        "tolerance_nats": tol,
        "correct_max_abs_diff": [c["max_abs_diff"] for c in correct],
        "correct_max": cmax,
        "wrong_max_abs_diff": {w["mis_sent"]: w["max_abs_diff"] for w in wrong},
        "wrong_min_over_differing": min(w["max_abs_diff"] for w in differing),
        "wrong_median": statistics.median(w["max_abs_diff"] for w in differing),
        "detected": len(differing) - len(missed),
        "differing_tensors": len(differing),
        "missed_at_tolerance": missed,
        "correct": correct,
        "wrong": wrong,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "vllm": vllm.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"correct updates ({len(correct)}): max |dlogp| = "
          + ", ".join(f"{c['max_abs_diff']:.4f}" for c in correct))
    print(f"single mis-sent tensor ({len(differing)} differing): "
          f"min {result['wrong_min_over_differing']:.4f}, median {result['wrong_median']:.4f}")
    print(f"tolerance {tol}: detected {result['detected']}/{len(differing)}; missed: {missed}")
    for w in sorted(wrong, key=lambda w: w["max_abs_diff"]):
        print(f"  {w['mis_sent']:<48} {w['max_abs_diff']:10.4f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
