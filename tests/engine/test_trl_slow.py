"""The long TRL runs on a real vLLM (slow): an engine killed mid-update, and the main job.

* The engine process group is SIGKILLed while RolloutCore moves step 1's
  weights into it: training stops with ``TrainingStopped``, the engine is
  tainted, nothing is published, and nothing of step 1 reaches TRL.
* ``rolloutcore train``, the README's first command, as a subprocess: the
  reward rises (last-5 mean at least 3x the first 5, fixed seed), and the
  plot, the trajectory file, the journal and the audit are written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from enginetools import EngineFactory, TinyModels, kill_engine
from rolloutcore.control.journal import read_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import vllm_available
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.session import EngineSession
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]


def test_an_engine_killed_during_an_update_stops_training_with_nothing_published(
        engine_factory: EngineFactory, tiny_models: TinyModels, tmp_path: Path) -> None:
    import torch
    import transformers

    from rolloutcore.cli.train import target_reward
    from rolloutcore.integrations.trl import RolloutCoreRollout, TrainingStopped, import_trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl = import_trl()
    from datasets import Dataset

    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo")
    session = EngineSession(VllmHTTP(eng.base_url), GlooTransport(op_timeout_s=30), engine=eng,
                            journal_path=tmp_path / "journal.jsonl")
    session.bootstrap(tiny_models.A, Provenance("A", "kill-test", 0))
    v0 = session.controller.committed
    tr = session.transport
    original = tr.send
    killed: list[float] = []

    def kill_then_send(self: Any, base_url: str, label: str, source: WeightSource,
                       **kw: Any) -> Any:
        # The same tensors, but the engine's process group is SIGKILLed once half of
        # them are on their way: the engine has accepted the update and is loading.
        half = len(source.manifest()) // 2

        def load() -> Iterator[tuple[str, Any]]:
            for i, (name, t) in enumerate(source.named_tensors()):
                if i == half:
                    killed.append(kill_engine(eng))
                yield name, t

        entries = [(p.name, p.shape, p.dtype) for p in source.manifest().params]
        return original(base_url, label, WeightSource(entries, load, "killing"), **kw)

    tr.send = types.MethodType(kill_then_send, tr)
    losses: list[int] = []
    rewarded: list[int] = []

    class Watched(trl.GRPOTrainer):  # type: ignore[misc, name-defined]
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            losses.append(self.state.global_step)
            return super().compute_loss(model, inputs, *a, **kw)

    def reward(prompts: Any, completions: Any, completion_ids: list[list[int]],
               trainer_state: Any, **kw: Any) -> list[float]:
        rewarded.append(int(trainer_state.global_step))
        return target_reward(completion_ids)

    traj = tmp_path / "traj.jsonl"
    rollout = RolloutCoreRollout(session, checkpoint=tiny_models.A, run="kill-test",
                                 trajectories=traj, origin="A")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
            learning_rate=2e-3, max_steps=3, logging_steps=1, report_to="none",
            save_strategy="no", disable_tqdm=True, log_level="error",
            gradient_checkpointing=False)
        trainer = Watched(
            model=transformers.AutoModelForCausalLM.from_pretrained(tiny_models.A,
                                                                    dtype=torch.float32),
            reward_funcs=reward, args=args,
            train_dataset=Dataset.from_dict({"prompt": [f"say a ({i})" for i in range(16)]}),
            processing_class=transformers.AutoTokenizer.from_pretrained(tiny_models.A),
            rollout_func=rollout)
        with pytest.raises(TrainingStopped) as ei:
            trainer.train()
    finally:
        torch.set_num_threads(threads)
        tr.send = original
        rollout.close()
        session.close()
        engine_factory.stop(eng)
    err = ei.value
    assert killed, "the update never reached the transfer"
    assert (err.step, err.reason, err.classification, err.state) == (
        1, "update_failed", "ambiguous", "TAINTED")
    print(f"\nengine killed mid-update: {err}")
    c = session.controller
    assert c.state is State.TAINTED and c.committed == v0 and c.published == (v0,)
    assert losses == [0] and rewarded == [0]
    assert {g.step for g in read_groups(traj)} == {0}
    recs = read_journal(tmp_path / "journal.jsonl")
    assert [r.kind for r in recs if r.kind == "commit"] == ["commit"]  # the bootstrap only
    assert [r for r in recs if r.kind == "taint"]


def test_the_main_job_trains_and_the_reward_rises(tmp_path: Path) -> None:
    """``rolloutcore train`` exactly as the README runs it (default settings)."""
    work = tmp_path / "run"
    cmd = [sys.executable, "-m", "rolloutcore", "train", "--workdir", str(work),
           "--json", str(tmp_path / "report.json"), "--results", str(tmp_path / "results.json")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, check=False,
                       env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    out = r.stdout
    assert r.returncode == 0, (out[-4000:], r.stderr[-4000:])
    rep = json.loads((tmp_path / "report.json").read_text())
    steps = rep["steps"]
    # A live line per step, then the summary and the audit.
    for k in range(1, steps + 1):
        assert f"step {k:>3}/{steps}  reward " in out
    assert "share of the step spent updating" in out and "audit of" in out
    assert rep["reward_last5"] >= 3 * rep["reward_first5"] > 0
    assert rep["updates_published"] == steps - 1
    assert rep["samples_recorded"] == rep["samples_generated"] > 0
    assert rep["audit"]["ok"] and json.loads((work / "audit.json").read_text())["ok"]
    assert (work / "reward.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (work / "trajectories.jsonl").stat().st_size > 0
    assert [x.kind for x in read_journal(work / "journal.jsonl")].count("commit") == steps
    results = json.loads((tmp_path / "results.json").read_text())
    assert set(results) == {"steps", "reward_first5", "reward_last5", "updates_published",
                            "update_share_of_step", "restart_share_of_step",
                            "samples_recorded", "samples_generated", "trl_version",
                            "vllm_version"}
    print(f"\nmain job: reward {rep['reward_first5']:.3f} -> {rep['reward_last5']:.3f}, "
          f"update share {rep['update_share_of_step']:.2f}, wall {rep['wall_s']:.0f} s")
