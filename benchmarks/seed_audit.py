"""A real-engine audit: grouped rollouts with derived seeds vs colliding seeds.

Generates, on the real CPU vLLM through RolloutCore's controller, groups of n
sampled completions (temperature 1) per prompt: half with per-sample seeds
from ``seeds.derive_seed(run, step, group, sample)``, half with every sibling
given the same seed (what happens when engines or replicas share one seed
stream: seed 002, section 1). Records them with the transactional recorder
and runs the audit (version purity + group diversity) over the file and the
journal. Writes results/seed-audit.json and prints the audit table. Not a test.

    .venv/bin/python benchmarks/seed_audit.py [--groups 6] [--n 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--groups", type=int, default=6, help="groups of each kind")
    ap.add_argument("--n", type=int, default=8, help="samples per group")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "results" / "seed-audit.json"))
    args = ap.parse_args()

    import vllm

    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.state import engine_identity
    from rolloutcore.provenance.audit import audit_file
    from rolloutcore.provenance.recorder import TrajectoryRecorder
    from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
    from rolloutcore.provenance.trajectory import (
        SEED_EXTERNAL,
        Prompt,
        SampledCompletion,
        SamplingSpec,
        Timestamps,
        TrajectoryGroup,
        TrajectorySample,
        VersionSpan,
        group_id_for,
    )
    from rolloutcore.session import EngineSession
    from rolloutcore.testing.models import make_checkpoint

    work = Path(tempfile.mkdtemp(prefix="rc-seed-audit-"))
    ckpt = make_checkpoint(work / "A", 1)
    traj, journal = work / "trajectories.jsonl", work / "journal.jsonl"
    session = EngineSession.launch(ckpt, journal_path=journal)
    run, step = "seed-audit", 0
    rng = random.Random(7)
    try:
        session.bootstrap(ckpt, Provenance("A", run, 0))
        http, ctl = session.http, session.controller
        ident = engine_identity(http)
        with TrajectoryRecorder(traj, lock_timeout_s=5) as rec:
            for p in range(2 * args.groups):
                colliding = p >= args.groups
                prompt = [rng.randrange(1, 256) for _ in range(40)]
                gid = group_id_for(run, step, p)
                samples = []
                for i in range(args.n):
                    seed = 1234 if colliding else derive_seed(run, step, gid, i)
                    rid = f"{gid}/{i}"
                    b = ctl.admit(rid)
                    w0, m0 = time.time(), time.monotonic()
                    g = http.generate(prompt, max_tokens=args.tokens, temperature=1.0,
                                      seed=seed, ignore_eos=True)
                    ctl.complete(rid)
                    assert g.logprobs is not None and g.weight_versions is not None
                    samples.append(TrajectorySample(
                        run, step, gid, p, args.n, i, Prompt(tuple(prompt)),
                        SamplingSpec(1.0, 1.0, -1, args.tokens, seed,
                                     SEED_EXTERNAL if colliding else SEED_DERIVATION,
                                     {"logprobs": 0}),
                        SampledCompletion(g.token_ids, g.finish_reason or "length",
                                          g.logprobs, None,
                                          tuple(VersionSpan(s.version, s.start, s.end)
                                                for s in g.weight_versions)),
                        b, ident,
                        Timestamps(w0, m0, time.time(), time.monotonic())))
                rec.append_group(TrajectoryGroup(tuple(samples)))
    finally:
        session.close()
    report = audit_file(traj, journal)
    table = report.format_table()
    print(table)
    out = {"report": report.to_dict(), "table": table, "trajectories": str(traj),
           "journal": str(journal),
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "python": sys.version.split()[0], "vllm": vllm.__version__},
           "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
