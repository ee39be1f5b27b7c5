#!/usr/bin/env python3
"""What a ``prompt_logprobs`` policy probe costs an engine: prompt length and detokenization.

Not a test: it measures and writes ``results/score-cost.json`` and prints a table.

A verified update scores its probe cases with ``VllmHTTP.score``: one
``/inference/v1/generate`` call per case with ``prompt_logprobs=0``, all cases
at once (the LoRA default on CUDA: ``control.adapters.ENGINE_SCORINGS``). vLLM
answers one logprob entry per prompt position; by default its engine also
detokenizes each of them (the ``decoded_token`` of every entry), which the
probe never reads: it looks entries up by token id. This script starts one
real vLLM (CPU, a generated tiny checkpoint), sends ``--cases`` cases at once
(``default_prompts`` + 16 continuation tokens), and times a round for each
prompt length and with the engine's detokenization on (vLLM's default) and
off (``"detokenize": false``, what ``VllmHTTP.score`` sends), interleaved
round by round so the machine's load falls on all alike. It checks that both
give the same log-probabilities (``same_logprobs``).

Keys: ``rounds_ms[<len>][<detok>]`` per-round wall times, ``median_ms`` their
medians, ``detok_share`` (1 - off/on at each length: the share of a probe's
round that was detokenization), ``same_logprobs``.

On a GPU the model's forward is cheaper and the detokenization (CPU work in
the engine's output processor) is the same, so its share is larger there.

    PYTHONPATH=src .venv/bin/python benchmarks/score_cost.py --rounds 12
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONT = 16  # continuation tokens per case (``PolicyProbe.from_model``'s ``new_tokens``)


def _vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.routes import Routes
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.verification.probe import default_prompts

    work = Path(tempfile.mkdtemp(prefix="rc-score-cost-"))
    ckpt = make_checkpoint(work / "A", 1)
    vocab = int(json.loads((ckpt / "config.json").read_text())["vocab_size"])
    engine = ManagedEngine(ckpt, log_dir=work / "logs", startup_timeout_s=900)
    engine.start()
    try:
        http = VllmHTTP(engine.base_url, timeout_s=120)
        model = http.model()

        def score(seq: list[int], detok: bool) -> list[float | None]:
            sp: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                                  "prompt_logprobs": 0}
            if not detok:
                sp["detokenize"] = False
            resp = http._post_json(Routes.GENERATE, "score", {
                "model": model, "token_ids": seq, "sampling_params": sp}, 120)
            return [None if e is None else float(e[str(t)]["logprob"])
                    for t, e in zip(seq, resp["prompt_logprobs"], strict=True)]

        lengths = [int(x) for x in args.lengths.split(",")]
        cases = {n: [p + p[:CONT] for p in default_prompts(vocab, n=args.cases, length=n)]
                 for n in lengths}
        rounds: dict[str, dict[str, list[float]]] = {
            str(n): {"on": [], "off": []} for n in lengths}
        same = True
        with ThreadPoolExecutor(args.cases) as pool:
            for r in range(args.warmup + args.rounds):
                order = [(n, d) for n in lengths for d in (True, False)]
                if r % 2:
                    order.reverse()
                for n, detok in order:
                    t = time.perf_counter()
                    got = list(pool.map(lambda s, d=detok: score(s, d), cases[n]))
                    wall = time.perf_counter() - t
                    if r >= args.warmup:
                        rounds[str(n)]["on" if detok else "off"].append(round(wall * 1e3, 2))
                    if r == 0 and not detok:
                        same = same and got == list(pool.map(lambda s: score(s, True), cases[n]))
                print(f"[score-cost] round {r + 1}/{args.warmup + args.rounds}",
                      file=sys.stderr, flush=True)
        http.close()
    finally:
        engine.stop()
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in rounds.items()}
    return {"benchmark": "score_cost", "machine": platform.platform(), "cpus": os.cpu_count(),
            "load_avg": os.getloadavg(), "vllm": _vllm_version(),
            "cases": args.cases, "continuation": CONT, "rounds": args.rounds,
            "rounds_ms": rounds, "median_ms": med,
            "detok_share": {n: round(1 - m["off"] / m["on"], 3) for n, m in med.items()},
            "same_logprobs": same,
            "command": "PYTHONPATH=src .venv/bin/python benchmarks/score_cost.py "
                       f"--rounds {args.rounds} --cases {args.cases} --lengths {args.lengths}"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--cases", type=int, default=6, help="cases sent at once (both probes' 3)")
    p.add_argument("--lengths", default="160,48", help="prompt lengths, comma-separated")
    p.add_argument("--out", default=str(ROOT / "results" / "score-cost.json"))
    args = p.parse_args()
    if args.rounds < 1 or args.warmup < 0 or args.cases < 1:
        raise SystemExit("--rounds >= 1, --warmup >= 0, --cases >= 1")
    res = run(args)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(f"{'prompt':>7} {'detok on (ms)':>14} {'off (ms)':>9} {'share':>6}")
    for n, m in res["median_ms"].items():
        print(f"{n:>7} {m['on']:>14.1f} {m['off']:>9.1f} {res['detok_share'][n]:>6.2f}")
    print(f"same log-probabilities: {res['same_logprobs']}")


if __name__ == "__main__":
    main()
