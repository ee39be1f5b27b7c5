"""vLLM 0.26 and 0.34 side by side: one table from two runs of ``h200_8b_ipc.py``.

The two runs happen on one warm device machine, one call each (0.26 from the
image's torch and ``/tmp/site``; 0.34 with the carried torch 2.14 from
``/tmp/site034`` and ``ROLLOUTCORE_VLLM_PREVIEW=1``: see README.md). This reads
their ``h200-8b-ipc.json`` and writes ``vllm034.json`` with, per vLLM version,
the keys issue 45 names: ``vllm``, ``hot_over_bare``, ``bitexact``,
``spans_checked``, ``pause_503_seen_by_clients``; and prints the table.

    python3 diagnostics/gpu/vllm_versions.py RUN026.json RUN034.json --out results/gpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def row(run: dict[str, Any]) -> dict[str, Any]:
    sp = run.get("service_path") or {}
    clients = sp.get("clients_during_updates") or {}
    sap = run.get("spans_and_pause") or {}
    return {
        "vllm": (run.get("versions") or {}).get("vllm"),
        "torch": (run.get("versions") or {}).get("torch"),
        "hot_over_bare": run.get("hot_over_bare"),
        "hot_s": run.get("hot_s"),
        "bare_s": run.get("bare_primitives_s"),
        "service_over_bare": run.get("service_over_bare"),
        "bitexact": (run.get("bitexact") or {}).get("passed"),
        "spans_checked": sap.get("spans_checked"),
        "spans_missing": sap.get("spans_missing"),
        "pause_503_seen_by_clients": clients.get("pause_503_seen_by_clients"),
        "client_statuses": clients.get("statuses"),
        "direct_while_paused": sap.get("direct_while_paused"),
        "errors": run.get("errors") or {},
        "commands": run.get("commands"),
        "device": run.get("device"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="h200-8b-ipc.json of each vLLM version")
    ap.add_argument("--out", default="results/gpu")
    ap.add_argument("--note", action="append", default=[],
                    help="a line on how to read these runs (kept in the JSON)")
    args = ap.parse_args()
    rows = [row(json.loads(Path(p).read_text())) for p in args.runs]
    out = {"what": "h200_8b_ipc.py on each vLLM version, one warm machine",
           "notes": args.note, "runs": {str(r["vllm"]): r for r in rows}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "vllm034.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    keys = ("hot_over_bare", "service_over_bare", "bitexact", "spans_checked",
            "pause_503_seen_by_clients")
    print("| vllm | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for r in rows:
        cells = [f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in keys]
        print(f"| {r['vllm']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
