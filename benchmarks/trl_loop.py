"""The TRL GRPO loop through RolloutCore on the real CPU vLLM: where a step's time goes.

Runs the main job (``rolloutcore train``, defaults: 20 steps of 4 prompts x 8
completions of up to 16 tokens on the tiny model) and writes
results/trl-loop.json: the issue's keys (steps, reward_first5, reward_last5,
updates_published, update_share_of_step, restart_share_of_step,
samples_recorded, samples_generated, trl_version, vllm_version), the mean
per-step split (generation, reward, training, RolloutCore update, drain),
the reward curve and the machine. ``restart_share_of_step`` is the share a
vLLM restart per step would take instead of the update, with ``restart_s``
from results/cpu-hot-vs-restart.json (benchmarks/cpu_hot_vs_restart.py).
Not a test.

    .venv/bin/python benchmarks/trl_loop.py [--steps 20] [--out results/trl-loop.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from rolloutcore.cli.train import format_summary, run_train

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "results" / "trl-loop.json"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-trl-loop-"))
    rep = run_train(work, steps=args.steps)
    print(format_summary(rep))
    split = rep["time_split_s"]
    out = {
        **rep["results"],
        "time_split_s": {k: split[k] for k in ("generate_s", "reward_s", "train_s",
                                               "update_s", "drain_s", "step_s")},
        "update_s_per_update": split["update_s_over_updates"],
        "update_phases_median_s": _median_phases(rep["updates"]),
        "restart_s": rep["restart_s"],
        "reward_curve": rep["reward_curve"],
        "reward_gain": rep["reward_gain"],
        "probe_max_abs_diff": [u["probe_max_abs_diff"] for u in rep["updates"]],
        "audit_ok": rep["audit"]["ok"],
        "engine_start_s": rep["engine_start_s"],
        "wall_s": rep["wall_s"],
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "command": "rolloutcore train (benchmarks/trl_loop.py)",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "notes": "update_share_of_step = mean update s / mean step s over all steps (step 0 "
                 "has none); restart_share_of_step = restart_s / (step - update + restart); "
                 "drain = admission closed until the engine is paused (drain + pause "
                 "phases); training = step wall - rollout call - reward.",
    }
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if rep["audit"]["ok"] else 1


def _median_phases(updates: list[dict[str, object]]) -> dict[str, float]:
    import statistics

    keys: set[str] = set()
    for u in updates:
        keys |= set(u["phases_s"])  # type: ignore[arg-type]
    return {k: statistics.median(float(u["phases_s"].get(k, 0.0))  # type: ignore[attr-defined]
                                 for u in updates) for k in sorted(keys)} if updates else {}


if __name__ == "__main__":
    raise SystemExit(main())
