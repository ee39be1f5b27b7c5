"""Measure what the policy probe sees on correct and on wrong updates (real CPU vLLM).

For each architecture (``--architectures``: the tiny Llama, a tied-embedding
Qwen3, the tiny Idefics3 vision-language model; all made offline by
``rolloutcore.testing``):

* **takeover**: the engine cold-started on checkpoint 0 is probed with that
  checkpoint's own probe: the deviation a correct engine shows on this
  model, which the takeover's calibration starts from
  (``verification.probe.Calibration``);
* **correct**: verified RolloutCore updates to ``--checkpoints`` other
  checkpoints; each probe computed by the trainer from the checkpoint
  (float32 forward of the bf16 weights) and compared with the engine (bf16
  kernels): the difference is kernel noise;
* **cold start**: the engine that was updated hot to the last checkpoint and
  an engine cold-started on it answer the same greedy ids and logprobs
  (compared as floats);
* **wrong**: for every parameter tensor in turn, the engine receives the
  target checkpoint with that one tensor taken from another checkpoint (a
  mis-routed tensor; sent outside the controller, every endpoint
  succeeding), and the same probe measures the difference.

The tolerance used is what the takeover calibrated from that engine
(``EngineSession.bootstrap``; the adapter's ``calibrations``), and the
correct updates go through the real path with the default probe, so
``false_refusals`` counts correct updates the controller refused. Each
mis-sent tensor is judged as the adapter judges it (``Calibrated.judge``)
and, as the paused validation's other evidence, by the engine's checksums
(vLLM's ``/weight_checker``) against the target's and by the ranks' own
checksums of what they wrote, taken before the CPU backend repacks a layer
(``transports.rank_checksums``, against the target's tensors): ``missed_by_probe``
counts the differing tensors the probe alone lets through (``probe_blind``
names them), ``missed_mis_sent`` those that neither catches. Both
``false_refusals`` and ``missed_mis_sent`` must be 0.

    .venv/bin/python benchmarks/probe_tolerance.py [--checkpoints 4] \\
        [--architectures llama,qwen3-tied,vlm]

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
ARCHITECTURES = ("llama", "qwen3-tied", "vlm")


def _say(msg: str) -> None:
    print(f"[probe-tolerance] {msg}", file=sys.stderr, flush=True)


def _checkpoints(arch: str, root: Path, n: int) -> list[Path]:
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.testing.vlm import make_vlm_checkpoint

    out = []
    for seed in range(1, n + 2):
        d = root / f"{arch}-s{seed}"
        if arch == "llama":
            out.append(make_checkpoint(d, seed))
        elif arch == "qwen3-tied":
            out.append(make_checkpoint(d, seed, architecture="qwen3", tie_word_embeddings=True))
        else:
            out.append(make_vlm_checkpoint(d, seed))
    return out


def _probe(arch: str, ckpt: Path, **kw: Any) -> Any:
    from rolloutcore.verification.image_probe import vlm_probe
    from rolloutcore.verification.probe import PolicyProbe

    if arch == "vlm":
        return vlm_probe(ckpt, **kw)
    return PolicyProbe.from_checkpoint(str(ckpt), **kw)


def _parts(probe: Any) -> list[Any]:
    """The probe sets of a probe (a suite's members, or itself)."""
    return list(getattr(probe, "probes", None) or [probe])


def _deviations(probe: Any, http: Any, calib: dict[str, Any]) -> dict[str, Any]:
    """Each probe set's max and mean |dlogp| on the engine, by name, and whether the
    calibrated probe (``Calibrated.judge``, what the adapter runs) passes it."""
    out: dict[str, Any] = {}
    for p in _parts(probe):
        res = p.measure(http)
        out[p.name] = {"max": res.max_abs_diff, "mean": res.mean_abs_diff,
                       "passes": p.judge(res, calib).passed}
    return out


def _greedy(http: Any, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in prompts:
        g = http.generate(ids, max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True)
        out.append((list(g.token_ids), [float(x) for x in (g.logprobs or [])]))
    return out


def run_architecture(arch: str, root: Path, n: int) -> dict[str, Any]:
    import torch

    from rolloutcore.core.evidence import PauseMode
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.errors import UpdateFailed
    from rolloutcore.session import EngineSession
    from rolloutcore.transports.source import WeightSource
    from rolloutcore.verification.checksums import compare_checksums
    from rolloutcore.verification.probe import default_prompts

    t0 = time.monotonic()
    ckpts = _checkpoints(arch, root, n)
    _say(f"{arch}: {len(ckpts)} checkpoints; starting vLLM on {ckpts[0].name}")
    session = EngineSession.launch(ckpts[0], progress=True)
    correct: list[dict[str, Any]] = []
    wrong: list[dict[str, Any]] = []
    try:
        # The takeover of the engine on its start checkpoint (probe level): its
        # deviation is this engine's calibration (the adapter keeps it).
        session.bootstrap(ckpts[0], Provenance(ckpts[0].name, "probe-bench", 0))
        calib = dict(session.vllm.calibrations)
        start = _parts(_probe(arch, ckpts[0]))
        kinds = {p.name: p.kind for p in start}
        takeover = {name: calib[kind].baseline for name, kind in kinds.items()}
        tolerance = {p.name: p.effective_tolerance(calib) for p in start}
        _say(f"{arch}: takeover deviation {takeover}; tolerance {tolerance}")
        for i, ck in enumerate(ckpts[1:], 1):
            # The real path: the default probe, calibrated by the adapter. A refusal
            # taints the engine; it is counted and this architecture stops there.
            probe = _probe(arch, ck)
            entry: dict[str, Any] = {"checkpoint": ck.name}
            try:
                res = session.update(ck, Provenance(ck.name, "probe-bench", i), probe=probe)
                entry["version"] = res.version.label
                entry["published"] = True
            except UpdateFailed as exc:
                entry["published"] = False
                entry["refusal"] = str(exc)
            entry["max_abs_diff"] = {p.name: p.last.max_abs_diff for p in _parts(probe)
                                     if p.last is not None}
            entry["mean_abs_diff"] = {p.name: p.last.mean_abs_diff for p in _parts(probe)
                                      if p.last is not None}
            correct.append(entry)
            _say(f"{arch}: correct update to {ck.name}: {entry['max_abs_diff']} "
                 f"({'published' if entry['published'] else 'REFUSED'})")
            if not entry["published"]:
                break
        # Hot vs cold on the last checkpoint: greedy ids and logprobs, as floats.
        vocab = 256
        prompts = [p[:40] for p in default_prompts(vocab)]
        hot = _greedy(session.http, prompts)
        last = ckpts[-1]
        with ManagedEngine(last, log_dir=root / f"{arch}-cold") as cold, \
                VllmHTTP(cold.base_url, timeout_s=120) as ch:
            cold_out = _greedy(ch, prompts)
        bit_exact = hot == cold_out
        _say(f"{arch}: hot update == cold start of {last.name}: {bit_exact}")
        # Wrong updates, driven outside the controller (which would taint on the first).
        target, other = ckpts[1], ckpts[2]
        probe = _probe(arch, target)
        tgt = dict(WeightSource.from_checkpoint(target).named_tensors())
        oth = dict(WeightSource.from_checkpoint(other).named_tensors())
        h, tr = session.http, session.transport

        def install(label: str, state: dict[str, Any]) -> None:
            h.pause(PauseMode.WAIT)
            tr.send(h.base_url, label, WeightSource.from_state_dict(state), timeout_s=120)
            assert h.reset_prefix_cache().engine_success
            if arch == "vlm":
                h.reset_mm_cache()
                h.reset_encoder_cache()
            h.resume()

        # The paused validation's other evidence (vLLM 0.32's /weight_checker): the
        # engine's checksums against the target's, read while it holds the target.
        install("target", tgt)
        reference = dict(h.weight_checksums().digests)
        for k, name in enumerate(sorted(tgt)):
            install(f"wrong-{k}", {key: (oth[key] if key == name else v)
                                   for key, v in tgt.items()})
            cmp = compare_checksums(h.weight_checksums(), reference)
            # The ranks' own checksums of what they wrote (before the CPU repack),
            # against the target's tensors as each rank must hold them.
            ranks = tr.validation_check(h.base_url, reference=tgt)
            wrong.append({"mis_sent": name,
                          "identical_in_both": bool(torch.equal(tgt[name], oth[name])),
                          "deviation": _deviations(probe, h, calib),
                          "checksum_caught": not cmp.to_check().passed or not ranks.passed,
                          "weight_checker_caught": not cmp.to_check().passed,
                          "rank_checksum_caught": not ranks.passed,
                          "checksum_unverifiable": len(cmp.unverifiable)})
        _say(f"{arch}: {len(wrong)} mis-sent tensors measured")
    finally:
        session.close()

    differing = [w for w in wrong if not w["identical_in_both"]]
    refused = [c["checkpoint"] for c in correct if not c["published"]]
    # A mis-sent tensor is caught by the probe when some probe set refuses it (as the
    # adapter would), and by the update when the probe or the checksums refuse it.
    probe_blind = [w for w in differing if all(d["passes"] for d in w["deviation"].values())]
    missed = [w["mis_sent"] for w in probe_blind if not w["checksum_caught"]]

    def closeness(w: dict[str, Any]) -> float:
        """How near the weakest probe set came to passing it (<= 1: it passed)."""
        return max(max(d["max"] / tolerance[k], d["mean"] / mean_tol[k])
                   for k, d in w["deviation"].items())

    mean_tol = {p.name: calib[p.kind].mean_tolerance(p.tolerance) for p in start}
    smallest = min(differing, key=closeness)
    return {
        "name": arch,
        "takeover_deviation": takeover,
        "calibration": {k: c.to_dict() for k, c in calib.items()},
        "default_tolerance": {p.name: p.tolerance for p in start},
        "tolerance_used": tolerance,
        "mean_tolerance_used": mean_tol,
        "takeover_mean_deviation": {name: calib[kind].baseline_mean
                                    for name, kind in kinds.items()},
        "correct_update_deviation": [c["max_abs_diff"] for c in correct],
        "correct_update_mean_deviation": [c["mean_abs_diff"] for c in correct],
        "correct_update_deviation_max": {k: max(c["max_abs_diff"][k] for c in correct)
                                         for k in tolerance},
        "correct_update_mean_deviation_max": {k: max(c["mean_abs_diff"][k] for c in correct)
                                              for k in tolerance},
        "smallest_mis_sent_deviation": {k: d["max"]
                                        for k, d in smallest["deviation"].items()},
        "smallest_mis_sent_mean_deviation": {k: d["mean"]
                                             for k, d in smallest["deviation"].items()},
        "smallest_mis_sent_tensor": smallest["mis_sent"],
        "smallest_mis_sent_over_tolerance": closeness(smallest),
        "mis_sent_median": {k: statistics.median(w["deviation"][k]["max"] for w in differing)
                            for k in tolerance},
        "differing_tensors": len(differing),
        "false_refusals": len(refused),
        "refused_correct": refused,
        "missed_mis_sent": len(missed),
        "missed": missed,
        "missed_by_probe": len(probe_blind),
        "probe_blind": [w["mis_sent"] for w in probe_blind],
        "caught_by_checksum": sum(1 for w in differing if w["checksum_caught"]),
        "caught_by_weight_checker": sum(1 for w in differing if w["weight_checker_caught"]),
        "caught_by_rank_checksum": sum(1 for w in differing if w["rank_checksum_caught"]),
        "hot_equals_cold_start": bit_exact,
        "correct": correct,
        "wrong": wrong,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=4,
                    help="correct updates per architecture (default 4)")
    ap.add_argument("--architectures", default=",".join(ARCHITECTURES),
                    help=f"comma-separated, of {', '.join(ARCHITECTURES)}")
    ap.add_argument("--out", default=str(ROOT / "results" / "probe-tolerance.json"))
    args = ap.parse_args(argv)
    archs = [a.strip() for a in args.architectures.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHITECTURES]
    if bad or not archs or args.checkpoints < 2:
        ap.error(f"unknown architectures {bad} (of {ARCHITECTURES}); --checkpoints >= 2")

    import torch
    import vllm

    work = Path(tempfile.mkdtemp(prefix="rc-probe-"))
    entries = [run_architecture(a, work, args.checkpoints) for a in archs]
    result = {
        "architectures": entries,
        "false_refusals": sum(e["false_refusals"] for e in entries),
        "missed_mis_sent": sum(e["missed_mis_sent"] for e in entries),
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": sys.version.split()[0], "torch": torch.__version__,
                    "vllm": vllm.__version__},
        "command": " ".join(["python", "benchmarks/probe_tolerance.py", *sys.argv[1:]]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    head = (f"{'architecture':<12} {'probe':<13} {'takeover':>15} {'tolerance':>15} "
            f"{'correct worst':>15} {'weakest mis-sent':>17} {'false ref':>9} {'missed':>6} "
            f"{'probe-blind':>11} {'hot=cold':>8}")
    print(head)
    print("(each column: max / mean |dlogp|, nats)")
    print("-" * len(head))
    for e in entries:
        for k, tol in e["tolerance_used"].items():
            def pair(a: float, b: float, w: int = 15) -> str:
                return f"{a:.4f}/{b:.4f}".rjust(w)
            worst = pair(e["correct_update_deviation_max"][k],
                         e["correct_update_mean_deviation_max"][k])
            weakest = pair(e["smallest_mis_sent_deviation"][k],
                           e["smallest_mis_sent_mean_deviation"][k], 17)
            print(f"{e['name']:<12} {k:<13} "
                  f"{pair(e['takeover_deviation'][k], e['takeover_mean_deviation'][k])} "
                  f"{pair(tol, e['mean_tolerance_used'][k])} {worst} {weakest} "
                  f"{e['false_refusals']:9d} {e['missed_mis_sent']:6d} "
                  f"{e['missed_by_probe']:11d} {e['hot_equals_cold_start']!s:>8}")
    print(f"wrote {args.out}")
    return 0 if result["false_refusals"] == 0 and result["missed_mis_sent"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
