"""How the verified transition's cost grows with the model (issue 49): Qwen3 0.6B to 32B.

For each size, one run of ``h200_8b_ipc.py --model SIZE`` in its own process (one
engine start per size; the GPU is free again between sizes), keeping only the
stages the curve needs: the RolloutCore transition and vLLM's bare sequence
interleaved, the gateway path, the transfer and the device-to-device copy of the
same bytes. Each size's JSON is kept under ``$OUT/scaling/SIZE/``; ``scaling.json``
gathers every size measured so far (a later call adds its sizes to the file), and
``scaling.png`` plots them: the ratios against the model's bytes, which must not
grow with the model, and the transfer rate against the copy's.

    python3 diagnostics/gpu/h200_scaling.py --sizes 0.6b,1.7b,4b --out $OUT
    python3 diagnostics/gpu/h200_scaling.py --plan            # the calls, on any machine
    python3 diagnostics/gpu/h200_scaling.py --plot results/gpu/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from qwen3_shapes import QWEN3, qwen3_specs  # noqa: E402

#: What the curve does not need (``h200_8b_ipc.py --skip``).
SKIP = ("kernel_tiles", "impl_compare", "copy_probe", "hot_cycle", "cache_negative_control",
        "spans_and_pause", "bitexact", "restart")
#: Per-size keys of ``scaling.json``.
KEYS = ("bytes", "tensors", "hot_s", "bare_primitives_s", "hot_over_bare", "service_s",
        "service_over_bare", "service_over_hot", "transfer_gbps", "d2d_copy_gbps",
        "transfer_fraction_of_d2d", "controller_overhead_fraction", "cold_start_s")
#: Seconds one size takes on the H200 (engine start with --enforce-eager ~60 s, the
#: trainer's buffer, warm-up, reps): the plan's estimate, not a measurement.
EST_S = {"0.6b": 75, "1.7b": 80, "4b": 90, "8b": 110, "14b": 140, "32b": 220}
#: The engine's memory share by size: 32B's weights (65.5 GB) beside the trainer's own
#: copy leave one H200 (141 GB) little room, so its engine takes just over its weights.
GPU_UTIL = {"32b": 0.52}


def nbytes(size: str) -> int:
    n = 0
    for _, shape in qwen3_specs(QWEN3[size]):
        k = 1
        for d in shape:
            k *= d
        n += 2 * k  # bf16
    return n


def plan(sizes: list[str], budget_s: int = 400) -> list[list[str]]:
    """Sizes grouped into device calls of at most ``budget_s`` each (estimates)."""
    calls: list[list[str]] = [[]]
    used = 0
    for s in sizes:
        if calls[-1] and used + EST_S[s] > budget_s:
            calls.append([])
            used = 0
        calls[-1].append(s)
        used += EST_S[s]
    return calls


def row(run: dict[str, Any], size: str) -> dict[str, Any]:
    out = {k: run.get(k) for k in KEYS}
    out["bytes"] = (run.get("model") or {}).get("bytes") or nbytes(size)
    out["tensors"] = (run.get("model") or {}).get("tensors")
    sp = run.get("service_path") or {}
    out["verification"] = sp.get("verification")
    out["errors"] = sorted((run.get("errors") or {}).keys())
    out["vllm"] = (run.get("versions") or {}).get("vllm")
    out["device"] = run.get("device")
    return out


def gather(out: Path, sizes: list[str], existing: Path | None) -> dict[str, Any]:
    data: dict[str, Any] = {"sizes": {}}
    if existing is not None and existing.exists():
        data = json.loads(existing.read_text())
    for s in sizes:
        f = out / "scaling" / s / "h200-8b-ipc.json"
        if not f.exists():
            f = out / "scaling" / s / "h200-8b-ipc.partial.json"
        if f.exists():
            data["sizes"][s] = row(json.loads(f.read_text()), s)
    order = [s for s in QWEN3 if s in data["sizes"]]
    data["sizes"] = {s: data["sizes"][s] for s in order}
    ratios = [data["sizes"][s].get("hot_over_bare") for s in order]
    known = [r for r in ratios if isinstance(r, (int, float))]
    data["ratio_grows_with_model"] = (None if len(known) < 2 else
                                      known[-1] > known[0] * 1.1)
    return data


def plot(data: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(data["sizes"])
    gb = [data["sizes"][s]["bytes"] / 1e9 for s in sizes]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("hot_over_bare", "verified transition / bare"),
                       ("service_over_bare", "through the gateway / bare")):
        ys = [data["sizes"][s].get(key) for s in sizes]
        pts = [(x, y) for x, y in zip(gb, ys, strict=True) if isinstance(y, (int, float))]
        if pts:
            a.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    a.axhline(1.0, color="grey", lw=0.8, ls="--")
    a.set_xscale("log")
    a.set_xlabel("model weights (GB, bf16)")
    a.set_ylabel("time / vLLM's bare sequence")
    a.set_title("cost ratio by model size")
    a.legend()
    for x, s in zip(gb, sizes, strict=True):
        a.annotate(s, (x, 1.0), textcoords="offset points", xytext=(0, -12), fontsize=7,
                   ha="center")
    for key, label in (("transfer_gbps", "transfer (update_weights)"),
                       ("d2d_copy_gbps", "device-to-device copy")):
        ys = [data["sizes"][s].get(key) for s in sizes]
        pts = [(x, y) for x, y in zip(gb, ys, strict=True) if isinstance(y, (int, float))]
        if pts:
            b.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    b.set_xscale("log")
    b.set_xlabel("model weights (GB, bf16)")
    b.set_ylabel("GB/s")
    b.set_title("transfer rate")
    b.legend()
    fig.suptitle(f"RolloutCore verified transition vs vLLM bare calls, "
                 f"{data['sizes'][sizes[0]].get('device') or 'GPU'}" if sizes else "")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def table(data: dict[str, Any]) -> str:
    lines = ["| size | GB | hot s | bare s | hot/bare | gateway/bare | transfer GB/s | d2d GB/s |",
             "|---|---|---|---|---|---|---|---|"]

    def f(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for s, r in data["sizes"].items():
        lines.append(f"| {s} | {r['bytes'] / 1e9:.2f} | {f(r.get('hot_s'), '.4f')} | "
                     f"{f(r.get('bare_primitives_s'), '.4f')} | "
                     f"{f(r.get('hot_over_bare'), '.3f')} | "
                     f"{f(r.get('service_over_bare'), '.3f')} | "
                     f"{f(r.get('transfer_gbps'), '.0f')} | {f(r.get('d2d_copy_gbps'), '.0f')} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="0.6b,1.7b,4b,8b,14b")
    ap.add_argument("--out", default=os.environ.get("OUT", "results/gpu"))
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--existing", default=None,
                    help="a scaling.json to add this call's sizes to")
    ap.add_argument("--plan", action="store_true", help="print the device calls and exit")
    ap.add_argument("--plot", default=None, help="only re-plot this scaling.json")
    args = ap.parse_args()
    sizes = [s for s in args.sizes.split(",") if s]
    bad = [s for s in sizes if s not in QWEN3]
    if bad:
        ap.error(f"unknown sizes {bad}; known: {', '.join(QWEN3)}")
    if args.plot:
        p = Path(args.plot)
        data = json.loads(p.read_text())
        plot(data, p.with_suffix(".png"))
        print(table(data))
        return 0
    if args.plan:
        for i, call in enumerate(plan(sizes), 1):
            est = sum(EST_S[s] for s in call)
            gb = sum(nbytes(s) for s in call) / 1e9
            print(f"call {i}: --sizes {','.join(call)}  (~{est} s, {gb:.1f} GB of weights)")
        return 0
    out = Path(args.out)
    for s in sizes:
        d = out / "scaling" / s
        d.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, str(HERE / "h200_8b_ipc.py"), "--model", s, "--out", str(d),
               "--reps", str(args.reps), "--skip", ",".join(SKIP),
               "--gpu-util", str(GPU_UTIL.get(s, 0.45))]
        t = time.monotonic()
        print(f"== {s}: {' '.join(cmd)}", flush=True)
        with open(d / "run.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"== {s}: exit {rc} in {time.monotonic() - t:.0f} s", flush=True)
    data = gather(out, sizes, Path(args.existing) if args.existing else None)
    data["command"] = " ".join([sys.executable, *sys.argv])
    (out / "scaling.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    if data["sizes"]:
        plot(data, out / "scaling.png")
    print(table(data))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
