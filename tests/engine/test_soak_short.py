"""A short soak on a real vLLM: concurrent rollouts, repeated updates, random faults.

The long run is ``python benchmarks/soak.py``; this is the same code for
about a minute, with at most one fault that needs an engine restart, so it
fits CI. Afterwards the journal, the trajectory records and the engine's own
per-token version spans must report zero violations, and no record may be
lost.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.engine.process import vllm_available

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]


def _load_soak() -> ModuleType:
    name = "rolloutcore_bench_soak"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / "soak.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow  # a soak (2+ min of faults and updates): the slow lane
def test_short_soak_reports_zero_violations(engine_factory: EngineFactory,
                                            tiny_models: TinyModels, tmp_path: Path) -> None:
    soak = _load_soak()
    eng = engine_factory(tiny_models.A, extra_args=["--enforce-eager"])
    try:
        cfg = soak.SoakConfig(duration_s=50.0, rollout_threads=6, seed=7, fault_rate=0.8,
                              max_tainting_faults=1, update_interval_s=(0.2, 1.5),
                              warmup_updates=2)
        rep = soak.run_soak(cfg, tmp_path, engine=eng, models=tiny_models)
    finally:
        engine_factory.stop(eng)
    soak._print(rep)
    chk = rep["checks"]
    assert rep["errors"] == []
    assert chk["journal_violations"] == [] and chk["purity_findings"] == []
    assert chk["samples_without_spans"] == 0 and chk["records_lost"] == 0
    assert chk["duplicate_labels"] == []
    assert rep["violations"] == 0
    # It really ran: rollouts recorded, updates published, faults injected.
    assert rep["rollouts"]["recorded"] > 0 and chk["samples"] == rep["rollouts"]["recorded"]
    assert rep["updates"].get("published", 0) >= 1
    assert rep["faults"]["injected"] >= 1
    # Every tainted engine came back.
    assert rep["recoveries"].get("failed", 0) == 0
    assert len(chk["published"]) >= 2
