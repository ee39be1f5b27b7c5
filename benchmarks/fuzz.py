"""The gateway fuzz run (#16): thousands of examples, counts written to results/fuzz.json.

Runs, with ``ROLLOUTCORE_FUZZ_JSON`` set so that each test adds its counts:

* ``tests/test_gateway_fuzz.py`` (the hand-written hostile bodies for the
  data and control routes, the fast data-plane sample, and the slow-marked
  long data-plane run of ``--examples`` hypothesis examples);
* ``tests/test_service_schemathesis.py`` (the control API from its OpenAPI
  document, positive and negative cases, ``--examples`` per operation).

Every run is over real loopback HTTP to a gateway over the fake vLLM. The
JSON has, per part: examples, statuses, server errors (5xx or a dropped
connection), hangs (no answer within 10 s) and requests after which the
gateway was not idle and READY. Usage::

    python benchmarks/fuzz.py [--examples 3000] [--out results/fuzz.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=3000)
    ap.add_argument("--out", default=str(ROOT / "results" / "fuzz.json"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.unlink(missing_ok=True)
    env = {**os.environ, "ROLLOUTCORE_FUZZ_JSON": str(out),
           "ROLLOUTCORE_FUZZ_EXAMPLES": str(a.examples),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "tests/test_gateway_fuzz.py", "tests/test_service_schemathesis.py"]
    rc = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
    data = json.loads(out.read_text()) if out.exists() else {}
    data["run"] = {"command": " ".join(["python", "benchmarks/fuzz.py", "--examples",
                                        str(a.examples)]),
                   "pytest_exit": rc, "started_unix": t0, "seconds": round(time.time() - t0, 1),
                   "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    parts = [v for k, v in data.items() if k != "run"]
    data["total"] = {k: sum(p.get(k, 0) for p in parts)
                     for k in ("examples", "server_errors", "hangs", "not_idle_after")}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    print(json.dumps(data["total"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
