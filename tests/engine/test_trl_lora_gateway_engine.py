"""``rolloutcore train --lora --gateway URL`` against ``rolloutcore serve --model A --lora``
started as a user starts it (a subprocess launching a real vLLM with LoRA enabled), a
3-step run: every adapter version is published through the gateway's trainer protocol
(``RolloutCoreClient.update_adapter``, journaled by the gateway), every recorded sample
names the adapter version published for its step (as the gateway's answers named it),
the base never changes, and the audit against the gateway's journal is clean.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from enginetools import stop_group, wait_healthy
from helpers.gateway_rig import TOKEN
from rolloutcore.control.journal import read_journal
from rolloutcore.core.adapters import AdapterChange, AdapterState
from rolloutcore.core.records import RequestUpdate
from rolloutcore.engine.process import vllm_available
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.transports.net import free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,   # an engine start and 3 steps through the gateway
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]
pytest.importorskip("peft")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3




def test_train_lora_through_a_serve_lora_gateway(tmp_path: Path) -> None:
    from rolloutcore.cli.train import MODEL_SEED, LoraSettings, run_train
    from rolloutcore.testing.models import make_checkpoint

    work = tmp_path / "train"
    ckpt = make_checkpoint(work / "policy-0", MODEL_SEED)   # the checkpoint train uses
    journal, log = tmp_path / "journal.jsonl", tmp_path / "serve.log"
    port = free_port()
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--lora", "--max-lora-rank", "8",
           "--model", str(ckpt), "--port", str(port), "--token", TOKEN,
           "--workdir", str(work), "--journal", str(journal)]   # train's workdir too
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log, 600)
        rep: dict[str, Any] = run_train(
            work, steps=STEPS, prompts_per_step=2, num_generations=4, max_tokens=8,
            progress=None, lora=LoraSettings(rank=4, alpha=8), gateway=url, token=TOKEN,
            gateway_journal=journal)
    finally:
        stop_group(proc, 120)
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert rep["interrupted"] is None and rep["steps"] == STEPS, rep.get("interrupted")
    lora = rep["lora"]
    # one before the first generation, one after each optimizer step but the last
    assert rep["updates_published"] == STEPS == len(set(lora["adapter_versions"]))
    assert all(u["adapter"] is not None and u["probe_max_abs_diff"] is not None
               for u in rep["updates"])
    # published through the gateway: its journal has them, in order, on the one base
    recs = [r.record for r in read_journal(journal)]
    published = [r for r in recs if isinstance(r, AdapterChange)
                 and r.after is AdapterState.PUBLISHED]
    assert [p.name for p in published] == lora["adapter_versions"]
    assert {p.base for p in published} == {lora["base_version"]}
    assert not any(isinstance(r, RequestUpdate) for r in recs)   # the base never updated
    # the trainer's saved copies were removed; the gateway's store holds its own (the
    # versions not retired: the last two)
    assert not list((work / "adapters-sent").iterdir())
    assert all(Path(u["adapter"]["path"]).parent == work / "adapters" for u in rep["updates"])
    assert lora["adapters_kept"] == sorted(u["adapter"]["path"] for u in rep["updates"][1:])
    # every sample names its step's adapter version, as the gateway answered it
    by_step = {u["step"]: u["adapter"] for u in rep["updates"]}
    samples = [s for g in read_groups(work / "trajectories.jsonl") for s in g.samples]
    assert len(samples) == rep["samples_recorded"] == STEPS * 2 * 4
    assert Counter(s.step for s in samples) == {k: 8 for k in range(STEPS)}
    for s in samples:
        want = by_step[s.step]
        assert s.adapter is not None
        assert (s.adapter.name, s.adapter.generation, s.adapter.content_digest) == (
            want["name"], want["generation"], want["content_digest"])
        assert s.adapter.base == s.binding.version.label == lora["base_version"]
    assert [r["adapter_generation"] for r in rep["rows"]] == [
        by_step[k]["generation"] for k in range(STEPS)]
    # the audit against the gateway's journal
    assert rep["journal"] == str(journal)
    assert rep["audit"]["ok"] and rep["audit"]["samples"] == len(samples), \
        rep["audit"]["table"]
    assert (work / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
