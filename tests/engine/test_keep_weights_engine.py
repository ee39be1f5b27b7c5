"""``train --keep-weights`` on the real CPU vLLM (#48): a kept version replays.

A short ``run_train`` keeps every published version's weights. A fresh vLLM
is started on one of them (not the first), named with its label, and the
run's trajectory file is replayed against it with ``--on-mismatch skip``:
the samples of that version replay (the kept weights are the ones the engine
served), the others are skipped, and the verdict is not OK (a skipped sample
is not verified). Two engines, one after the other.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.provenance.recorder import read_trajectories
from rolloutcore.provenance.replay import SampleStatus, replay_file

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

pytest.importorskip("trl")


def test_a_kept_version_replays_and_skipping_the_others_is_not_ok(tmp_path: Path) -> None:
    from rolloutcore.cli.train import run_train

    work = tmp_path / "run"
    report = run_train(work, steps=3, prompts_per_step=2, num_generations=2, max_tokens=8,
                       progress=None, keep_weights=True)
    assert report["kept_weights"]["versions"] == 3, report["kept_weights"]
    index = json.loads((work / "weights" / "versions.json").read_text())
    traj = work / "trajectories.jsonl"
    by_label = Counter(s.binding.version.label for s in read_trajectories(traj))
    assert set(by_label) == set(index), (by_label, index)   # every sample's version kept
    first = next(iter(index))
    assert index[first] == str(work / "policy-0")
    label = sorted(set(index) - {first})[-1]   # a version the trainer made, not the start
    kept = Path(index[label])
    assert (kept / "model.safetensors").is_file() and (kept / "rolloutcore.json").is_file()

    engine = ManagedEngine(kept, log_dir=tmp_path / "logs")
    try:
        engine.start()
        with VllmHTTP(engine.base_url) as http:
            http.set_weight_version(label)   # a cold load names no version: name it
        result = replay_file(traj, engine.base_url, policy="skip")
    finally:
        engine.stop()
    counts = result.counts()
    assert counts[SampleStatus.SKIPPED.value] == sum(by_label.values()) - by_label[label]
    assert counts[SampleStatus.PASS.value] + counts[SampleStatus.NOT_REPLAYABLE.value] \
        == by_label[label], result.format_table()
    assert counts[SampleStatus.PASS.value] > 0 and counts[SampleStatus.FAIL.value] == 0
    assert not result.ok and "NOT VERIFIED" in result.format_table().splitlines()[0]
