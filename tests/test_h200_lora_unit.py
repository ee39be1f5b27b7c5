"""The H200 LoRA harness's CPU-runnable part (fast lane), before device time is spent.

``diagnostics/gpu/h200_lora.py`` runs on one H200 with vLLM 0.26 (issue 32's GPU
measurement); its ``--plan`` runs anywhere and must fit one device call, its
arguments are checked before anything starts, and its goals and table read the
keys of ``results/lora.json``. (``--cpu-selftest`` runs every stage on the CPU
engine: too slow for this lane.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.scripts import load_script

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200_lora.py"
h = load_script("h200_lora", HARNESS)


def test_the_plan_fits_one_device_call(capsys: pytest.CaptureFixture[str]) -> None:
    assert h.main(["--plan"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and plan["estimated_s"] <= plan["budget_s"] <= 480
    assert plan["clients"] == 32 and plan["reps"] >= 3
    args = plan["engine_args"]
    assert args[:6] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16",
                        "--enforce-eager"]
    assert plan["engine_env"] == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert plan["stages"] == list(h.STAGES) and plan["stages_s"]["restart"] > 0
    cmd = plan["device_command"]
    assert "install_on_device.sh" in cmd and "h200_lora.py --out $OUT" in cmd
    assert "timeout 570" in cmd and "| tee $OUT/run.log" in cmd and len(cmd) <= 2000
    # Too long for one call: refused before anything starts.
    assert h.main(["--plan", "--serve-s", "200"]) == 2
    assert h.main(["--serve-s", "200", "--out", "/nonexistent/never-written"]) == 2


@pytest.mark.parametrize("bad", [["--gpu-util", "0.9"], ["--reps", "0"], ["--full-reps", "3"],
                                 ["--serve-s", "0"], ["--prompt-tokens", "4090"],
                                 ["--only", "nonsense"]])
def test_bad_arguments_are_refused(bad: list[str]) -> None:
    with pytest.raises(SystemExit):
        h.parse(bad)


def test_the_selftest_shortens_what_it_was_not_told() -> None:
    a = h.parse(["--cpu-selftest"])
    assert a.clients == 4 and a.reps == 2 and not a.beside
    assert h.parse(["--cpu-selftest", "--clients", "8"]).clients == 8


def test_a_rank_16_adapter_on_every_projection_of_qwen3_8b_is_87_mb() -> None:
    from qwen3_shapes import QWEN3_8B, qwen3_specs

    size = 0
    for name, shape in qwen3_specs(QWEN3_8B):
        if any(f".{t}." in name for t in h.LORA_TARGETS):
            out, inp = shape
            size += h.RANK * (inp + out) * 2          # A (r x in) and B (out x r), bf16
    assert 86e6 < size < 88e6


def test_goals_and_table_read_the_issues_keys() -> None:
    r = {"adapter_update_vs_bare_load": 30.0, "bare_load_s": 0.14, "adapter_update_s": 4.2,
         "scorings": {"generation": {"adapter_update_s": 5.7,
                                     "adapter_update_vs_bare_load": 54.0}},
         "discrimination": {"adapter_effect_min_nats": 5.8, "probe_noise_max_nats": 0.2,
                            "ratio": 29.0}, "discrimination_ratio": 29.0,
         "negative_controls_caught": 6, "negative_controls_total": 6,
         "serving_tokens_per_s": {"base": 552.0, "adapter": 169.0, "clients": 32},
         "errors": {}}
    g = h.goals(r)
    assert g["adapter_update<=2x_bare_load"] is False
    assert g["discrimination_ratio>=2"] is True
    assert g["negative_controls_all_caught"] is True
    assert h.goals({**r, "discrimination_ratio": 1.5})["discrimination_ratio>=2"] is False
    text = h.table(r)
    assert "552 / 169" in text and "6 / 6" in text and text.endswith("LORA OK")
    assert "5.8 / 0.2 = 29.0x" in text and "5.7000 / 54.0x" in text
    assert h.table({**r, "errors": {"full": "boom"}}).endswith(
        "ERROR in full: boom\nLORA HAS PROBLEMS")
    assert h.goals({"errors": {}}) == {"adapter_update<=2x_bare_load": None,
                                       "discrimination_ratio>=2": None,
                                       "negative_controls_all_caught": None}


def test_the_discrimination_is_the_smallest_effect_over_the_largest_noise() -> None:
    from lora import discrimination, series_summary

    ups = [{"effect": 6.4, "checks": {"adapter-probe": 0.22, "base-probe": 0.19,
                                      "adapter-effect": 6.4}, "phases": {"apply": 9.0}},
           {"effect": 5.8, "checks": {"adapter-probe": 0.18, "base-probe": 0.25},
            "phases": {"apply": 0.2, "probes": 0.1}},
           {"effect": 7.4, "checks": {"adapter-probe": 0.16}, "phases": {"apply": 0.4}}]
    d = discrimination(ups)
    assert (d["adapter_effect_min_nats"], d["probe_noise_max_nats"]) == (5.8, 0.25)
    assert d["ratio"] == pytest.approx(23.2)
    assert discrimination([{"effect": None, "checks": {}}])["ratio"] is None
    sm = series_summary([{**u, "scoring": "prompt_logprobs", "together": True} for u in ups],
                        0.1)
    assert sm["adapter_update_s"] == pytest.approx(0.3)      # the first left out
    assert sm["vs_bare_load"] == pytest.approx(3.0) and sm["phases_s"] == {"probes": 0.1}
