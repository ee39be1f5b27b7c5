"""``rolloutcore train --lora`` on a real vLLM (CPU build), a short run: TRL's
GRPOTrainer with ``peft_config``, the trainer's adapter published as verified
adapter versions, every sample bound to (base version, adapter version).

Negative controls: the audit of the samples of one step, their adapter's
content changed, finds every one of them; the replay of a sample on an engine
that does not list its adapter is refused (never replayed on the base).
The last step's samples are replayed through their adapter, kept in the run's
adapter store, on a fresh engine.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from enginetools import EngineFactory
from rolloutcore.control.journal import read_journal
from rolloutcore.core.adapters import AdapterChange, AdapterState
from rolloutcore.core.records import Commit, RequestUpdate
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import vllm_available
from rolloutcore.provenance.audit import audit_file, audit_purity, read_journal_summary
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.replay import LaneStatus, ReplayRefused, ReplayValidator
from rolloutcore.provenance.trajectory import TrajectorySample

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,   # an engine start and 3 steps: 100 s on the shared 2 cores
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

pytest.importorskip("peft")
pytest.importorskip("trl")

STEPS = 3


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from rolloutcore.cli.train import LoraSettings, run_train

    work = tmp_path_factory.mktemp("trl-lora")
    rep = run_train(work, steps=STEPS, prompts_per_step=2, num_generations=4, max_tokens=8,
                    progress=None, lora=LoraSettings(rank=4, alpha=8))
    return {"work": work, "report": rep}


def test_an_adapter_version_is_published_per_step_and_the_base_never_changes(
        run: dict[str, Any]) -> None:
    rep, work = run["report"], run["work"]
    assert rep["interrupted"] is None and rep["steps"] == STEPS, rep.get("interrupted")
    lora = rep["lora"]
    # one before the first generation, one after each optimizer step but the last
    assert rep["updates_published"] == STEPS == len(lora["adapter_versions"])
    assert len(set(lora["adapter_versions"])) == STEPS
    assert all(u["adapter"] is not None and u["drain_s"] == 0.0 for u in rep["updates"])
    assert all(u["probe_max_abs_diff"] is not None for u in rep["updates"])
    assert (lora["rank"], lora["alpha"]) == (4, 8) and "unchanged" in lora["base_weights"]
    recs = [r.record for r in read_journal(work / "journal.jsonl")]
    published = [r for r in recs if isinstance(r, AdapterChange)
                 and r.after is AdapterState.PUBLISHED]
    assert [p.name for p in published] == lora["adapter_versions"]
    # the base: committed once (the takeover), never updated
    assert not any(isinstance(r, RequestUpdate) for r in recs)
    assert len({r.version for r in recs if isinstance(r, Commit)}) == 1
    assert {p.base for p in published} == {lora["base_version"]}
    assert [r["adapter_generation"] for r in rep["rows"]] == list(range(1, STEPS + 1))


def test_every_recorded_sample_names_the_adapter_of_its_step_and_the_audit_passes(
        run: dict[str, Any]) -> None:
    rep, work = run["report"], run["work"]
    by_step = {u["step"]: u["adapter"] for u in rep["updates"]}
    samples = [s for g in read_groups(work / "trajectories.jsonl") for s in g.samples]
    assert len(samples) == rep["samples_recorded"] == STEPS * 2 * 4
    assert rep["lora"]["samples_through_adapter"] == len(samples)
    for s in samples:
        assert s.adapter is not None and s.schema_version == 5
        want = by_step[s.step]
        assert (s.adapter.name, s.adapter.generation, s.adapter.content_digest) == (
            want["name"], want["generation"], want["content_digest"])
        assert s.adapter.base == s.binding.version.label == rep["lora"]["base_version"]
    assert Counter(s.step for s in samples) == {k: 8 for k in range(STEPS)}
    assert rep["audit"]["ok"] and rep["audit"]["samples"] == len(samples)
    audit = json.loads((work / "audit.json").read_text())
    assert len(audit["purity"]["journal"]["adapters_published"]) == STEPS
    assert (work / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_audit_finds_samples_naming_adapter_content_never_published(
        run: dict[str, Any]) -> None:
    """The recorded samples of step 1, their adapter's digest changed (the group
    commits would refuse the edited file first: the samples are audited directly)."""
    work = run["work"]
    samples = []
    for line in (work / "trajectories.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d.get("record") != "sample":
            continue
        if d["step"] == 1:
            d["adapter"]["content_digest"] = "0" * 64
        samples.append(TrajectorySample.from_dict(d))
    rep = audit_purity(samples, read_journal_summary(work / "journal.jsonl"))
    bad = {(f.group_id, f.sample_index) for f in rep.findings}
    assert {f.issue.value for f in rep.findings} == {"adapter-mismatch"}
    assert len(bad) == 8 == sum(1 for s in samples if s.step == 1)
    assert audit_file(work / "trajectories.jsonl", work / "journal.jsonl").ok


def test_the_last_step_replays_through_its_adapter_and_is_refused_without_it(
        run: dict[str, Any], engine_factory: EngineFactory) -> None:
    from rolloutcore.integrations.trl.rollout import LORA_ENV, lora_engine_args

    rep, work = run["report"], run["work"]
    last = rep["updates"][-1]["adapter"]
    kept = {Path(p).name for p in rep["lora"]["adapters_kept"]}
    assert last["name"] in kept and len(kept) == 2   # current + max_staleness 1
    samples = [s for g in read_groups(work / "trajectories.jsonl") for s in g.samples
               if s.step == STEPS - 1]
    eng = engine_factory(work / "policy-0", extra_args=lora_engine_args(4), env=LORA_ENV)
    http = VllmHTTP(eng.base_url, timeout_s=120.0)
    try:
        validator = ReplayValidator(http)
        with pytest.raises(ReplayRefused, match="does not list"):
            validator.replay(samples)
        http.load_lora_adapter(last["name"], str(work / "adapters" / last["name"]))
        report = validator.replay(samples)
        lanes = [x.logprob for x in report.samples]
        assert len(lanes) == 8 and all(x.status is LaneStatus.PASS for x in lanes), \
            report.format_table()
        assert max(x.max_abs_diff or 0.0 for x in lanes) < 0.05
    finally:
        http.close()
        engine_factory.stop(eng)
