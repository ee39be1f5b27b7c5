"""GPU time of a callable on the current stream: CUDA events, median of ``n``."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["gpu_time"]


def gpu_time(fn: Any, n: int = 5) -> float:
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return float(sorted(ts)[n // 2])
