"""The scaling harness on the CPU: its sizes, plan, gathering and plot (no GPU, no vLLM)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent.parent / "diagnostics" / "gpu"


def _load(name: str) -> Any:
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sc = _load("h200_scaling")


def test_the_sizes_have_their_public_shapes() -> None:
    specs = sc.qwen3_specs(sc.QWEN3["8b"])
    assert len(specs) == 399 and sc.nbytes("8b") == 16_381_470_720  # what the H200 runs held
    # The three smallest tie their output projection to the embedding: it is not sent.
    for s in ("0.6b", "1.7b", "4b"):
        names = [n for n, _ in sc.qwen3_specs(sc.QWEN3[s])]
        assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    sizes = [sc.nbytes(s) for s in sc.QWEN3]
    assert sizes == sorted(sizes) and sizes[0] < 1.6e9 and sizes[-1] > 60e9


def test_the_plan_fits_each_call_in_the_device_limit() -> None:
    calls = sc.plan(list(sc.QWEN3))
    assert [s for c in calls for s in c] == list(sc.QWEN3)
    assert all(sum(sc.EST_S[s] for s in c) <= 400 for c in calls)


def _run(size: str, hot: float, bare: float) -> dict[str, Any]:
    return {"model": {"bytes": sc.nbytes(size), "tensors": 1}, "hot_s": hot,
            "bare_primitives_s": bare, "hot_over_bare": hot / bare, "service_s": hot * 1.1,
            "service_over_bare": hot * 1.1 / bare, "transfer_gbps": 1200.0,
            "d2d_copy_gbps": 2000.0, "device": "NVIDIA H200", "versions": {"vllm": "0.26.0"},
            "errors": {}}


@pytest.mark.parametrize("grows", [False, True])
def test_gather_adds_sizes_to_the_file_and_plots(tmp_path: Path, grows: bool) -> None:
    for size, hot in (("0.6b", 0.02), ("8b", 0.06 if grows else 0.045)):
        d = tmp_path / "scaling" / size
        d.mkdir(parents=True)
        (d / "h200-8b-ipc.json").write_text(json.dumps(_run(size, hot, 0.05 if size == "8b"
                                                            else 0.022)))
    first = sc.gather(tmp_path, ["8b"], None)
    (tmp_path / "scaling.json").write_text(json.dumps(first))
    data = sc.gather(tmp_path, ["0.6b"], tmp_path / "scaling.json")
    assert list(data["sizes"]) == ["0.6b", "8b"]  # kept in size order, both calls' sizes
    assert data["ratio_grows_with_model"] is grows
    sc.plot(data, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| 8b | 16.38 |" in sc.table(data)
