"""TRL's GRPOTrainer training through RolloutCore on a real vLLM (CPU): the loop itself.

One engine for the module. A few GRPO steps of the tiny model with
``RolloutCoreRollout`` as TRL's ``rollout_func``; the trainer subclass only
watches what TRL computes (its scored batch and its loss calls), it changes
nothing. Then, on the same engine, a training whose next update mis-sends
one tensor: it must stop with the typed error and nothing of that step may
reach TRL's loss. That leaves the engine tainted, so it is the module's last
test.
"""

from __future__ import annotations

import os
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.control.journal import read_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import vllm_available
from rolloutcore.provenance.audit import audit_file
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.replay import (
    DEFAULT_TOLERANCE,
    LaneStatus,
    ReplayValidator,
    SampleStatus,
    compare_logprobs,
)
from rolloutcore.session import EngineSession
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

pytest.importorskip("trl")

STEPS = 3
PROMPTS, GENS, TOKENS = 2, 4, 8
RUN = "trl-engine-test"
CORRUPTED = "model.layers.1.mlp.down_proj.weight"


@dataclass
class Loop:
    session: EngineSession
    ckpt: Path
    work: Path
    trl: Any
    scored: list[dict[str, Any]] = field(default_factory=list)   # TRL's scored batches
    rewarded: list[dict[str, Any]] = field(default_factory=list)  # what reward funcs got
    losses: list[int] = field(default_factory=list)              # global step per loss call
    rescored: list[dict[str, Any]] = field(default_factory=list)  # engine re-score per sample
    rollout: Any = None
    trainer: Any = None
    error: BaseException | None = None

    def train(self, run: str, steps: int, traj: Path, *, lr: float = 2e-3) -> None:
        """A GRPO training of ``steps`` steps from the engine's current weights' checkpoint."""
        import torch
        import transformers

        from rolloutcore.cli.train import target_reward
        from rolloutcore.integrations.trl import RolloutCoreRollout

        trl, loop = self.trl, self
        self.rollout = RolloutCoreRollout(self.session, checkpoint=self.ckpt, run=run,
                                          trajectories=traj)

        class Watched(trl.GRPOTrainer):  # type: ignore[misc, name-defined]
            def _generate_and_score_completions(self, inputs: Any) -> Any:
                out = super()._generate_and_score_completions(inputs)
                loop.scored.append({
                    "step": self.state.global_step,
                    "completion_ids": out["completion_ids"].tolist(),
                    "mask": out["completion_mask"].tolist(),
                    "sampling": out["sampling_per_token_logps"].tolist(),
                    "is_ratio": "importance_sampling_ratio" in out})
                return out

            def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
                loop.losses.append(self.state.global_step)
                return super().compute_loss(model, inputs, *a, **kw)

        def reward(prompts: Any, completions: Any, completion_ids: list[list[int]],
                   trainer_state: Any, rc_version: list[str], rc_generation: list[int],
                   rc_rollout_id: list[str], **kw: Any) -> list[float]:
            step = int(trainer_state.global_step)
            loop.rewarded.append({"step": step, "versions": list(rc_version),
                                  "generations": list(rc_generation),
                                  "rollout_ids": list(rc_rollout_id),
                                  "completion_ids": [list(c) for c in completion_ids]})
            # Re-score every recorded sample of this step while the engine still
            # serves the version it was bound to.
            http = loop.session.http
            label = http.label()
            for g in read_groups(traj):
                if g.step != step or g.run != run:
                    continue
                for s in g.samples:
                    assert s.binding.version.label == label
                    prompt, comp = list(s.prompt.token_ids), list(s.completion.token_ids)
                    scored = http.score(prompt + comp)[len(prompt):]
                    lane = compare_logprobs(list(s.completion.logprobs or ()), scored,
                                            DEFAULT_TOLERANCE)
                    loop.rescored.append({"step": step, "label": label,
                                          "rollout_id": s.binding.rollout_id,
                                          "status": lane.status, "max": lane.max_abs_diff})
            return target_reward(completion_ids)

        tok = transformers.AutoTokenizer.from_pretrained(self.ckpt)
        model = transformers.AutoModelForCausalLM.from_pretrained(self.ckpt, dtype=torch.float32)
        args = trl.GRPOConfig(
            output_dir=str(self.work / f"trl-{run}"), use_cpu=True, bf16=False, seed=0,
            per_device_train_batch_size=PROMPTS * GENS, num_generations=GENS,
            max_completion_length=TOKENS, temperature=1.0, learning_rate=lr,
            max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
            disable_tqdm=True, log_level="error", gradient_checkpointing=False)
        from datasets import Dataset

        ds = Dataset.from_dict({"prompt": [f"Write a's please ({i}): " for i in range(32)]})
        self.trainer = Watched(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                               processing_class=tok, rollout_func=self.rollout)
        self.trainer.remove_callback(transformers.PrinterCallback)
        try:
            self.trainer.train()
        except BaseException as exc:
            self.error = exc
        finally:
            self.rollout.close()


@pytest.fixture(scope="module")
def loop(engine_factory: EngineFactory, tiny_models: TinyModels,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Loop]:
    import torch

    from rolloutcore.integrations.trl import import_trl

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    trl = import_trl()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the engine shares the two cores (see cli/train.py)
    work = tmp_path_factory.mktemp("trl-loop")
    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo")
    session = EngineSession(VllmHTTP(eng.base_url), GlooTransport(), engine=eng,
                            journal_path=work / "journal.jsonl")
    session.bootstrap(tiny_models.A, Provenance(str(tiny_models.A.resolve()), RUN, 0))
    lp = Loop(session, tiny_models.A, work, trl)
    lp.train(RUN, STEPS, work / "traj.jsonl")
    try:
        yield lp
    finally:
        torch.set_num_threads(threads)
        session.close()
        engine_factory.stop(eng)


def test_the_training_ran_every_step_through_rolloutcore(loop: Loop) -> None:
    assert loop.error is None, repr(loop.error)
    assert [s.step for s in loop.rollout.steps] == list(range(STEPS))
    assert sorted({b["step"] for b in loop.scored}) == list(range(STEPS))
    assert loop.losses == list(range(STEPS))


def test_each_step_is_bound_to_the_version_published_after_the_previous_optimizer_step(
        loop: Loop) -> None:
    published = {u.step: u.version for u in loop.rollout.updates}
    assert sorted(published) == list(range(1, STEPS))
    for rec in loop.rewarded:
        k = rec["step"]
        assert set(rec["generations"]) == {k}          # version k for step k
        if k:
            assert set(rec["versions"]) == {published[k].label}
    for g in read_groups(loop.work / "traj.jsonl"):
        for s in g.samples:
            v = s.binding.version
            assert v.generation == g.step
            assert s.binding.identity.provenance == Provenance(
                str(loop.ckpt.resolve()), RUN, g.step)
            spans = s.completion.weight_versions
            assert spans is not None and {sp.version for sp in spans if sp.end > sp.start} \
                <= {v.label}, "vLLM's own spans name the bound version"


def test_the_journal_shows_one_verified_update_per_step(loop: Loop) -> None:
    recs = read_journal(loop.work / "journal.jsonl")
    commits = [r for r in recs if r.kind == "commit"]
    assert len(commits) == 1 + (STEPS - 1)  # bootstrap, then one per optimizer step
    assert [c.data["version"]["generation"] for c in commits] == list(range(STEPS))
    for c in commits[1:]:
        ident = c.data["identity"]
        assert ident["verification"] == "probe"
        assert ident["provenance"]["trainer_run"] == RUN
        assert any(e.startswith("policy-probe=") for e in ident["evidence"])
    assert len([r for r in recs if r.kind == "begin_update"]) == STEPS - 1
    assert not [r for r in recs if r.kind == "taint"]
    for u in loop.rollout.updates:
        assert u.probe_max_abs_diff is not None and u.probe_max_abs_diff < 0.05


def test_the_recorder_holds_every_sample_trl_got_exactly_once(loop: Loop) -> None:
    groups = list(read_groups(loop.work / "traj.jsonl"))
    assert len(groups) == STEPS * PROMPTS and all(len(g) == GENS for g in groups)
    recorded = [s.binding.rollout_id for g in groups for s in g.samples]
    given = [rid for rec in loop.rewarded for rid in rec["rollout_ids"]]
    assert len(recorded) == len(set(recorded)) == STEPS * PROMPTS * GENS
    assert sorted(recorded) == sorted(given)
    by_id = {s.binding.rollout_id: list(s.completion.token_ids)
             for g in groups for s in g.samples}
    for rec in loop.rewarded:
        for rid, ids in zip(rec["rollout_ids"], rec["completion_ids"], strict=True):
            assert by_id[rid] == ids
    assert loop.rollout.samples_recorded == loop.rollout.samples_generated == len(recorded)
    rep = audit_file(loop.work / "traj.jsonl", loop.work / "journal.jsonl")
    assert rep.ok, rep.format_table()


def test_trl_s_behaviour_logprobs_are_the_engine_s_and_rescore_within_tolerance(
        loop: Loop) -> None:
    import torch

    groups = list(read_groups(loop.work / "traj.jsonl"))
    for batch in loop.scored:
        assert batch["is_ratio"], "TRL applied its importance-sampling correction"
        mine = [s for g in groups if g.step == batch["step"] for s in g.samples]
        assert len(mine) == len(batch["completion_ids"])
        for s, ids, mask, lps in zip(mine, batch["completion_ids"], batch["mask"],
                                     batch["sampling"], strict=True):
            n = int(sum(mask))
            assert ids[:n] == list(s.completion.token_ids)
            want = torch.tensor(s.completion.logprobs, dtype=torch.float32).tolist()
            assert lps[:n] == want  # exactly the engine's numbers, as float32
    assert len(loop.rescored) == STEPS * PROMPTS * GENS
    bad = [r for r in loop.rescored if r["status"] is not LaneStatus.PASS]
    assert not bad, bad[:3]
    print(f"\nre-score on the bound version: max |dlogp| "
          f"{max(r['max'] for r in loop.rescored):.4f} (tolerance {DEFAULT_TOLERANCE})")
    # The replay validator agrees on the last step (the engine still serves its version).
    last = [s for g in groups if g.step == STEPS - 1 for s in g.samples]
    rep = ReplayValidator(loop.session.http, policy="skip").replay(last)
    assert {r.status for r in rep.samples} == {SampleStatus.PASS}, rep.format_table()


def test_a_mis_sent_tensor_stops_training_and_nothing_of_the_step_reaches_the_loss(
        loop: Loop) -> None:
    """The transport delivers one tensor wrong; every endpoint says success; the probe
    (computed from what the trainer meant to send) catches it before anything is admitted."""
    from rolloutcore.integrations.trl import TrainingStopped

    s = loop.session
    tr = s.transport
    original = tr.send

    def mis_send(self: Any, base_url: str, label: str, source: WeightSource,
                 **kw: Any) -> Any:
        bad = {n: (-t if n == CORRUPTED else t) for n, t in source.named_tensors()}
        return original(base_url, label, WeightSource.from_state_dict(bad), **kw)

    c = s.controller
    before = c.committed
    assert before is not None and c.state is State.READY
    # The next training starts from the checkpoint the engine was started from: put
    # it back first, verified (the engine now serves the previous run's last step).
    s.update(loop.ckpt, Provenance(str(loop.ckpt.resolve()), "fault", 0))
    restored = c.committed
    assert restored is not None
    tr.send = types.MethodType(mis_send, tr)
    loop.scored.clear()
    loop.rewarded.clear()
    loop.losses.clear()
    traj = loop.work / "traj-fault.jsonl"
    try:
        loop.train("trl-fault", 3, traj)
    finally:
        tr.send = original
    err = loop.error
    assert isinstance(err, TrainingStopped), repr(err)
    assert (err.step, err.reason, err.classification, err.state) == (
        1, "update_failed", "ambiguous", "TAINTED")
    assert "policy-probe" in str(err) and "Nothing of step 1 was returned to TRL" in str(err)
    print(f"\nmis-sent {CORRUPTED}: {err}")
    assert c.state is State.TAINTED and c.committed == restored
    assert c.published[-1] == restored  # the failed target was never published
    # Step 0 was trained on; nothing of step 1 was scored, rewarded or in a loss.
    assert loop.losses == [0]
    assert [b["step"] for b in loop.scored] == [0] and [r["step"] for r in loop.rewarded] == [0]
    assert {g.step for g in read_groups(traj)} == {0}
    recs = read_journal(loop.work / "journal.jsonl")
    assert [r for r in recs if r.kind == "taint"]
    assert recs[-1].kind != "commit" and not [
        r for r in recs if r.kind == "commit" and r.data["identity"]["provenance"][
            "trainer_run"] == "trl-fault"]
