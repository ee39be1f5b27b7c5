"""Which block-checksum implementation reads 16 GB fastest on this GPU (no vLLM needed).

The paused validation of ``rc_cuda_ipc`` hashes every updated slice on the
engine's workers and the trainer hashes what it sent; both use
``cuda_ipc.block_checksum``. On the H200 its torch form took 10.5-13 ms for
Qwen3-8B's 16.4 GB while a plain read of the same bytes takes about 3.8 ms.
This sweeps the Triton kernel's forms (``cuda_ipc.kernels.CSUM_KERNELS``), tile
rows and warps, checks every result equals the torch definition, and times
each (CUDA events, median of 5), on the trainer's packed buffer and on the
same tensors in separate allocations (as an engine's parameters are).

Runs with only torch and triton (the device image has both)::

    PYTHONPATH=src python3 diagnostics/gpu/csum_bench.py --out $OUT

Writes ``csum-bench.json`` (machine, versions, command, every timing) and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gputime import gpu_time  # noqa: E402
from qwen3_shapes import QWEN3_8B, qwen3_specs  # noqa: E402

from rolloutcore.transports.cuda_ipc import PackedWeights, block_checksum  # noqa: E402
from rolloutcore.transports.cuda_ipc import kernels as ck  # noqa: E402


def sweep(tensors: list[torch.Tensor], ref: list[int], rows_set: tuple[int, ...],
          warps_set: tuple[int, ...], kernels: tuple[str, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kern in kernels:
        for rows in rows_set:
            for warps in warps_set:
                key = f"{kern}/r{rows}/w{warps}"
                ck.CSUM_KERNEL, ck.CSUM_ROWS, ck.CSUM_WARPS = kern, rows, warps
                try:
                    got = block_checksum(tensors, impl="kernel")
                    if got != ref:
                        out[key] = "disagrees"
                        continue
                    out[key] = gpu_time(lambda: block_checksum(tensors, impl="kernel"))
                except Exception as exc:  # one form failing to compile is data
                    out[key] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                print(f"  {key:24s} {out[key]}", flush=True)
    return out


def best(d: dict[str, Any]) -> tuple[str, float] | None:
    ok = {k: v for k, v in d.items() if isinstance(v, float)}
    if not ok:
        return None
    k = min(ok, key=lambda x: ok[x])
    return k, ok[k]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    R: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]),
                         "machine": {"host": platform.node(),
                                     "gpu": torch.cuda.get_device_name(0),
                                     "sms": torch.cuda.get_device_properties(0)
                                     .multi_processor_count},
                         "versions": {"torch": torch.__version__, "python": sys.version}}
    try:
        import triton
        R["versions"]["triton"] = triton.__version__
    except ImportError:
        R["versions"]["triton"] = None
    t0 = time.monotonic()
    specs = qwen3_specs(QWEN3_8B)
    packed = PackedWeights([(n, s, torch.bfloat16) for n, s in specs], device="cuda:0")
    g = torch.Generator(device="cuda:0").manual_seed(1)
    with torch.no_grad():
        for _, t in packed.items():
            t.normal_(0.0, 0.02, generator=g)
    torch.cuda.synchronize()
    views = [t for _, t in packed.items()]
    nbytes = sum(t.numel() * t.element_size() for t in views)
    R["bytes"] = nbytes
    R["tensors"] = len(views)
    flat = packed.buffer.view(torch.int32)
    R["read_flat_s"] = gpu_time(lambda: flat.sum(dtype=torch.int32))
    scratch = [torch.empty_like(packed.buffer)]
    R["d2d_flat_s"] = gpu_time(lambda: scratch[0].copy_(packed.buffer))
    scratch.clear()
    ref = block_checksum(views, impl="torch")
    R["torch_packed_s"] = gpu_time(lambda: block_checksum(views, impl="torch"))
    print(f"{len(views)} tensors, {nbytes / 1e9:.2f} GB: read {R['read_flat_s'] * 1e3:.2f} ms, "
          f"torch checksum {R['torch_packed_s'] * 1e3:.2f} ms", flush=True)
    R["packed"] = sweep(views, ref, (16, 32, 64, 128), (4, 8, 16), ck.CSUM_KERNELS)
    top = best(R["packed"])
    # Separate allocations, as an engine's parameters are: the best few forms again.
    sep = [t.clone() for t in views]
    torch.cuda.synchronize()
    assert block_checksum(sep, impl="torch") == ref
    R["torch_separate_s"] = gpu_time(lambda: block_checksum(sep, impl="torch"))
    ranked = sorted((v, k) for k, v in R["packed"].items() if isinstance(v, float))[:6]
    R["separate"] = {}
    for _, key in ranked:
        kern, r, w = key.split("/")
        R["separate"].update(sweep(sep, ref, (int(r[1:]),), (int(w[1:]),), (kern,)))
    R["best_packed"] = top
    R["best_separate"] = best(R["separate"])
    R["wall_s"] = time.monotonic() - t0
    (args.out / "csum-bench.json").write_text(json.dumps(R, indent=1))
    gb = nbytes / 1e9
    print("\n| what | ms | GB/s |\n|---|---|---|")
    for name, v in [("plain read (flat sum)", R["read_flat_s"]),
                    ("d2d copy (flat)", R["d2d_flat_s"]),
                    ("torch checksum, packed", R["torch_packed_s"]),
                    ("torch checksum, separate", R["torch_separate_s"]),
                    (f"best kernel, packed {top[0] if top else ''}", top[1] if top else None),
                    (f"best kernel, separate {R['best_separate'][0] if R['best_separate'] else ''}",
                     R["best_separate"][1] if R["best_separate"] else None)]:
        if v is not None:
            print(f"| {name} | {v * 1e3:.2f} | {gb / v:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
