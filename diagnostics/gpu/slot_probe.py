"""Probe: the result slot across two processes on one GPU (torch only, no vLLM).

A trainer process owns a ``PackedWeights`` and a ``CudaIpcTransport`` result
slot; an engine process maps both from the JSON wire form, copies the
weights into its own module with ``SliceLoader`` and publishes the checksum
into the slot at "finish". The trainer then runs ``engine_checksum`` with no
RPC route at all (it raises if asked), so a pass means the values came
through the trainer's own memory. Also: a tampered parameter fails; a row
with another nonce is never taken (the wait ends, the RPC is asked).

    PYTHONPATH=src python3 diagnostics/gpu/slot_probe.py --out $OUT

Prints its checks, writes ``slot-probe.json``; exit 1 if one fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from rolloutcore.transports.cuda_ipc import (
    CudaIpcTransport,
    PackedWeights,
    SliceLoader,
    decode_results,
    decode_update,
    encode_update,
    map_buffer,
)

SHAPES = [(f"layers.{i}.{k}.weight", (1024, 1024)) for i in range(8) for k in ("q", "o")]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for _ in range(8):
            m = torch.nn.Module()
            m.q = torch.nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16, device="cuda")
            m.o = torch.nn.Linear(1024, 1024, bias=False, dtype=torch.bfloat16, device="cuda")
            self.layers.append(m)


def engine(conn: Any) -> None:
    torch.cuda.set_device(0)
    model = Model()
    loader = SliceLoader(model)
    while True:
        cmd = conn.recv()
        if cmd is None:
            return
        body, nonce_override, tamper = cmd
        msg = decode_update(body)
        slot = decode_results(body)
        assert slot is not None
        bufs = [map_buffer(b, 0) for b in msg.buffers]
        loader.load(bufs, msg)
        if tamper:
            with torch.no_grad():
                model.layers[3].o.weight.view(-1)[7] += 1
        row = map_buffer(slot.buffer, 0).view(torch.int64).view(slot.rows, slot.row_len)[0]
        t = time.monotonic()
        ok = loader.publish_checksum(row, nonce_override or slot.nonce)
        conn.send({"published": ok, "publish_s": time.monotonic() - t})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child,), daemon=True)
    proc.start()
    pk = PackedWeights([(n, s, torch.bfloat16) for n, s in SHAPES], device="cuda")
    tr = CudaIpcTransport(device="cuda", results_wait_s=0.5)
    base = "http://probe"
    tr._ranks[base] = [0]
    asked: list[str] = []

    def no_rpc(*a: Any, **k: Any) -> list[Any]:
        asked.append(str(a[1] if len(a) > 1 else a))
        raise RuntimeError("the probe has no RPC route")

    tr.rpc = no_rpc  # type: ignore[method-assign]
    R: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                         "checks": {}}

    def update(seed: int, *, nonce: int | None = None, tamper: bool = False) -> dict[str, Any]:
        g = torch.Generator(device="cuda").manual_seed(seed)
        pk.buffer.copy_(torch.randint(0, 255, pk.buffer.shape, generator=g, device="cuda",
                                      dtype=torch.uint8))
        tr.last_sent_checksum, tr.last_sent_names = pk.checksum(), pk.names()
        torch.cuda.synchronize()
        body = encode_update(pk.message("fast"))
        slot = tr._result_slot(base, len(pk.entries))
        assert slot is not None
        body["results"] = slot.to_json()
        tr._expect = (slot, base)
        parent.send((json.loads(json.dumps(body)), nonce, tamper))
        info: dict[str, Any] = parent.recv()
        t = time.monotonic()
        try:
            r = tr.engine_checksum(base)
        except RuntimeError as exc:
            r = {"passed": False, "via": "rpc", "error": str(exc)}
        info.update(check_s=time.monotonic() - t, **{k: r.get(k) for k in (
            "passed", "via", "coverage", "n_mismatched", "mismatched", "error", "ipc_note")})
        return info

    runs = [update(s) for s in (1, 2, 3, 4, 5)]
    R["runs"] = runs
    R["checks"]["ipc_passes_without_rpc"] = all(r["passed"] and r["via"] == "ipc"
                                                for r in runs)
    R["check_s_median"] = sorted(r["check_s"] for r in runs)[2]
    bad = update(6, tamper=True)
    R["tampered"] = bad
    R["checks"]["tampered_parameter_fails"] = (not bad["passed"] and bad["via"] == "ipc"
                                               and bad["mismatched"] == ["layers.3.o.weight"])
    stale = update(7, nonce=12345)
    R["stale_nonce"] = stale
    R["checks"]["other_nonce_never_taken"] = (not stale["passed"] and stale["via"] == "rpc"
                                              and len(asked) == 1)
    parent.send(None)
    proc.join(30)
    ok = all(R["checks"].values())
    R["passed"] = ok
    (args.out / "slot-probe.json").write_text(json.dumps(R, indent=1, default=str))
    for k, v in R["checks"].items():
        print(f"{'PASS' if v else 'FAIL'} {k}")
    print(f"check_s median {R['check_s_median'] * 1e3:.3f} ms; runs {runs}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
