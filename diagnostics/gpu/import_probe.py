"""What a carried vLLM still lacks on the device, in one pass (no GPU work).

Imports vLLM's serve path (API server, engine core, GPU worker, the Qwen3 model,
the weight-transfer engines RolloutCore's backends subclass, RolloutCore's own
plugin) and, where a module is missing, records its name, puts an empty stand-in
module in its place and goes on, so one call lists every missing package instead
of the first. Also prints the torch, CUDA, NCCL and cuDNN versions the process
loaded. The stand-ins exist only inside this probe: a run that lists nothing
missing is the run that may start the engine.

    PYTHONPATH=/tmp/site034:$PWD/src python3 diagnostics/gpu/import_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import traceback
import types
from pathlib import Path
from typing import Any

MODULES = (
    "torch",
    "vllm",
    "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core",
    "vllm.v1.worker.gpu_worker",
    "vllm.model_executor.models.qwen3",
    "vllm.model_executor.model_loader.reload",
    "vllm.distributed.weight_transfer.base",
    "vllm.distributed.weight_transfer.factory",
    "vllm.distributed.weight_transfer.clients",
    "rolloutcore.transports.vllm_plugin",
    "rolloutcore.transports.cuda_ipc.engine",
    "rolloutcore.transports.gloo",
)


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StandIn(f"{self.__name__}.{name}")

    def __call__(self, *a: Any, **k: Any) -> Any:
        return _StandIn(self.__name__ + "()")


class _Recorder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: whatever no real finder found is recorded and stood in for."""

    def __init__(self) -> None:
        self.missing: dict[str, str] = {}
        self.active = True

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if not self.active:
            return None
        who = next((f.f_globals.get("__name__", "?") for f in _frames()), "?")
        self.missing.setdefault(fullname, who)
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: Any) -> Any:
        m = _StandIn(spec.name)
        m.__path__ = []  # type: ignore[attr-defined]
        return m

    def exec_module(self, module: Any) -> None:
        return None


def _frames() -> Any:
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if not name.startswith(("importlib", "_frozen_importlib", "__main__")):
            yield f
        f = f.f_back


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--stand-ins", action="store_true",
                    help="(the second pass, in a child) stand in for what is missing")
    args = ap.parse_args()
    rec = _Recorder()
    rec.active = args.stand_ins
    sys.meta_path.append(rec)
    report: dict[str, Any] = {"python": sys.version, "imported": {}, "errors": {},
                              "pass": "stand-ins" if args.stand_ins else "plain"}
    for name in MODULES:
        try:
            importlib.import_module(name)
            report["imported"][name] = True
        except Exception as exc:
            report["imported"][name] = False
            report["errors"][name] = "".join(traceback.format_exception_only(exc)).strip()
    rec.active = False
    report["missing"] = rec.missing
    try:
        import torch

        report["torch"] = {"version": torch.__version__, "file": torch.__file__,
                           "cuda": torch.version.cuda,
                           "cuda_available": torch.cuda.is_available()}
        if torch.cuda.is_available():
            report["torch"]["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            report["torch"]["cudnn"] = torch.backends.cudnn.version()
            x = torch.ones(1024, device="cuda")
            report["torch"]["cuda_sum_ok"] = float(x.sum().item()) == 1024.0
    except Exception as exc:
        report["torch_error"] = repr(exc)
    try:
        import vllm

        report["vllm"] = {"version": vllm.__version__, "file": vllm.__file__}
    except Exception as exc:
        report["vllm_error"] = repr(exc)
    if report["errors"] and not args.stand_ins:
        # Everything a plain import lacks, in one go: a child that stands in for each.
        import subprocess

        child = subprocess.run([sys.executable, __file__, "--stand-ins", "--out",
                                str(Path(args.out) / "stand-ins")], capture_output=True,
                               text=True, timeout=300)
        report["stand_in_pass"] = {"rc": child.returncode, "tail": child.stdout[-6000:],
                                   "stderr_tail": child.stderr[-2000:]}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "import-probe.json").write_text(text)
    return 0 if not rec.missing and not report["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
