"""The encoder and multimodal cache boundary on a real vision-language vLLM (CPU).

One engine (tiny Idefics3 from ``rolloutcore.testing.vlm``), cold-started on
B, serves the same test image throughout:

  * the cold answer of B (the reference), then a RolloutCore update to A;
  * negative control, driven outside RolloutCore: B's weights sent under the
    running engine, the prefix cache reset, the encoder and multimodal
    resets skipped: stale encoder hits (vLLM's own iteration log), stale
    processor-cache hits (vLLM's /metrics), and whether the tokens differ
    from the cold engine on B;
  * through RolloutCore A -> B: the same counters and whether the answer is
    bit-identical (greedy tokens and logprobs) to the cold engine;
  * which reset matters: the negative control again with only the
    multimodal reset, then with only the encoder reset;
  * the transition's phase times, repeated A <-> B, every update validated
    by text and image probes (and engine checksums against B's cold-loaded
    reference on the updates to B);
  * the image probe's margins: its difference on correct updates, with the
    vision tower of the other policy, and on a stale encoder cache (B's
    weights, the probe images' A embeddings left in the cache).

Writes results/mm-cache.json and prints a summary. Not a test.

    .venv/bin/python benchmarks/mm_cache.py [--reps 6] [--out PATH] [--workdir DIR]
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
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", default=str(ROOT / "results" / "mm-cache.json"))
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    if args.reps < 2:
        ap.error("--reps must be >= 2")

    import PIL
    import torch
    import transformers
    import vllm

    from rolloutcore.core.evidence import CacheKind, PauseMode
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.verify import take_reference
    from rolloutcore.session import EngineSession
    from rolloutcore.testing.mmcache import (
        ITERATION_LOG_FLAG,
        EncoderLog,
        make_image_png,
        mm_cache_experiment,
        observe,
        png_data_url,
    )
    from rolloutcore.testing.vlm import ARCHITECTURE, make_vlm_pair
    from rolloutcore.transports.gloo import GlooTransport
    from rolloutcore.transports.source import WeightSource
    from rolloutcore.verification.image_probe import vlm_probe

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-mm-bench-"))
    a, b = work / "A", work / "B"
    if not (b / "config.json").exists():
        a, b = make_vlm_pair(work)
    image = png_data_url(make_image_png(7))
    t0 = time.monotonic()
    probes = {"A": vlm_probe(a), "B": vlm_probe(b)}
    probe_build_s = (time.monotonic() - t0) / 2
    flags = ["--enforce-eager", ITERATION_LOG_FLAG]
    eng = ManagedEngine(b, extra_args=flags, log_dir=work / "logs", startup_timeout_s=900)
    t0 = time.monotonic()
    eng.start()
    start_s = time.monotonic() - t0
    step = [0]

    def prov(name: str, _step: int | None = None) -> Provenance:
        step[0] += 1
        return Provenance(name, "mm-cache-bench", step[0])

    session = EngineSession(VllmHTTP(eng.base_url, timeout_s=120.0),
                            GlooTransport(op_timeout_s=60), engine=eng,
                            journal_path=work / "journal.jsonl")
    try:
        h = session.http
        cold_b = take_reference(h, WeightSource.from_checkpoint(b).content_digest(),
                                         origin="cold-load", source=str(b))
        session.bootstrap(b, Provenance("B", "mm-cache-bench", 0))

        def kw(name: str) -> dict[str, Any]:
            return {"probe": probes[name],
                    **({"reference_checksums": cold_b.checksums} if name == "B" else {})}

        def probe_diffs(name: str) -> dict[str, Any]:
            chk = probes[name].run(h, None)
            text, img = probes[name].last
            return {"passed": chk.passed, "text_max_abs_diff": text.max_abs_diff,
                    "image_max_abs_diff": img.max_abs_diff}

        wrong_tower = probe_diffs("A")  # A's probe on the cold engine on B

        log = EncoderLog(eng.log_path)
        res = mm_cache_experiment(session, log, a, b, image, provenance=prov,
                                  update_kwargs=kw)
        model = h.model()

        def only(reset: CacheKind) -> dict[str, Any]:
            """The negative control again, with one of the two resets done."""
            session.update(a, prov("A"), **kw("A"))
            before = observe(h, log, model, image)
            h.pause(PauseMode.WAIT, clear_cache=False)
            session.transport.send(h.base_url, "rogue-B", WeightSource.from_checkpoint(b),
                                   timeout_s=120)
            h.resume()
            h.reset_prefix_cache()
            h.reset_cache(reset)
            o = observe(h, log, model, image)
            return {"reset": reset.value, "encoder_hits": o.encoder_hits,
                    "mm_cache_hits": o.mm_hits, "equals_old_policy": o.answer == before.answer,
                    "identical_to_cold": o.answer == res.cold.answer}

        isolation = [only(CacheKind.MULTIMODAL), only(CacheKind.ENCODER)]
        runs: list[dict[str, Any]] = []
        for i in range(args.reps):
            name = "A" if i % 2 == 0 else "B"
            out = session.update(a if name == "A" else b, prov(name), **kw(name))
            o = observe(h, log, model, image)
            text, img = probes[name].last
            runs.append({"to": name, "version": out.version.label,
                         "probe_text_max_abs_diff": text.max_abs_diff,
                         "probe_image_max_abs_diff": img.max_abs_diff,
                         "verification": out.identity.verification.wire,
                         "phases_s": out.outcome.breakdown(),
                         "encoder_hits_after": o.encoder_hits,
                         "mm_cache_hits_after": o.mm_hits,
                         "identical_to_cold": (o.answer == res.cold.answer) if name == "B"
                         else None})
        # The engine is on A now and its probe images' A embeddings are cached:
        # B's weights without the encoder reset, then with it.
        if runs[-1]["to"] != "A":
            session.update(a, prov("A"), **kw("A"))
        h.pause(PauseMode.WAIT, clear_cache=False)
        session.transport.send(h.base_url, "rogue-B", WeightSource.from_checkpoint(b),
                               timeout_s=120)
        h.resume()
        h.reset_prefix_cache()
        stale_probe = probe_diffs("B")
        h.reset_cache(CacheKind.ENCODER)
        h.reset_cache(CacheKind.MULTIMODAL)
        reset_probe = probe_diffs("B")
        nbytes = WeightSource.from_checkpoint(b).nbytes
    finally:
        session.close()

    to_b = [r for r in runs if r["to"] == "B"]
    phases = {k: statistics.median(r["phases_s"].get(k, 0.0) for r in runs)
              for k in runs[0]["phases_s"]}
    summary = res.summary()
    result = {
        **summary,
        "phases_s": res.phases_s,
        "phases_median_s": phases,
        "reps": args.reps,
        "every_rep_without_stale_hits": all(
            r["encoder_hits_after"] == 0 and r["mm_cache_hits_after"] == 0 for r in runs),
        "every_update_to_b_identical_to_cold": all(r["identical_to_cold"] for r in to_b),
        "isolation": isolation,
        "probe": {
            "text_tolerance": probes["B"].probes[0].tolerance,
            "image_tolerance": probes["B"].probes[1].tolerance,
            "correct_updates_max_abs_diff": {
                "text": max(r["probe_text_max_abs_diff"] for r in runs),
                "image": max(r["probe_image_max_abs_diff"] for r in runs)},
            "wrong_vision_tower": wrong_tower,
            "stale_encoder_cache": stale_probe,
            "after_encoder_and_mm_reset": reset_probe,
            "build_s_per_checkpoint": probe_build_s},
        "observations": {
            "cold_b": res.cold.to_dict(), "warm_b": res.warm.to_dict(),
            "after_rolloutcore_to_a": res.after_rc_to_a.to_dict(),
            "negative_control": res.negative_control.to_dict(),
            "after_rolloutcore_to_b": res.rc_to_b.to_dict()},
        "reset_evidence": res.reset_evidence,
        "runs": runs,
        "model": {"architecture": ARCHITECTURE, "transfer_bytes": nbytes,
                  "engine_flags": flags, "engine_start_s": start_s},
        "measured_from": {
            "encoder_hits": "vLLM's log with --enable-logging-iteration-details: a request "
                            "whose scheduler steps logged no 'encoder inputs' was served "
                            "from the encoder cache (vLLM 0.32 has no encoder-cache metric)",
            "mm_cache_hits": "vLLM's /metrics: delta of vllm:mm_cache_hits_total "
                             "(the multimodal processor cache)"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "vllm": vllm.__version__, "transformers": transformers.__version__,
                    "pillow": PIL.__version__},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": "A and B share every text weight; B's vision tower and connector are "
                 "redrawn. The negative control answers exactly as the old policy A "
                 "(negative_control_equals_old_policy). The processor cache holds "
                 "preprocessed pixels, which do not depend on the weights: skipping only "
                 "its reset leaves no stale answer; skipping the encoder reset does. "
                 "Every RolloutCore update here is validated by text + image probes "
                 "(validate_live) and, to B, by engine checksums.",
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k in ("stale_encoder_hits_negative_control", "stale_mm_cache_hits_negative_control",
              "tokens_differ_negative_control", "stale_encoder_hits_rolloutcore",
              "stale_mm_cache_hits_rolloutcore", "identical_to_cold"):
        print(f"{k:<40}{result[k]!s:>8}")
    print("isolation: " + "; ".join(
        f"only {x['reset']} reset: encoder hits {x['encoder_hits']}, old answer "
        f"{x['equals_old_policy']}" for x in isolation))
    pr = result["probe"]
    print(f"image probe: correct <= {pr['correct_updates_max_abs_diff']['image']:.4f}, "
          f"wrong tower {wrong_tower['image_max_abs_diff']:.4f}, stale encoder "
          f"{stale_probe['image_max_abs_diff']:.4f} (tolerance {pr['image_tolerance']})")
    print("phase medians (ms): " + ", ".join(f"{k}={v * 1000:.1f}" for k, v in phases.items()))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
