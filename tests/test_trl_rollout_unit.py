"""RolloutCoreRollout (TRL's rollout_func) over the in-process fake engine: the fast lane.

The trainer here is a stand-in with the attributes GRPOTrainer 1.16 gives a
rollout function (``state.global_step``, ``model``, ``num_generations``,
``processing_class``, sampling settings, ``_metrics``); real TRL and a real
vLLM are in tests/engine/test_trl_loop.py. The engine is the fake engine under
a real controller and runner, so admission, binding, the update lifecycle
and its failure classes are RolloutCore's own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import FAST
from helpers.trl_fakes import (
    RUN,
    N,
    Tiny,
    fake_weights,
    make_trainer,
    write_checkpoint,
)
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import (
    EngineIdentity,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput
from rolloutcore.integrations.trl import (
    EngineSample,
    PublishedUpdate,
    RolloutCoreRollout,
    TrainingStopped,
    engine_state_dict,
)
from rolloutcore.provenance.audit import audit_file
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
from rolloutcore.provenance.trajectory import (
    SamplingSpec,
    Timestamps,
    VersionSpan,
)
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FaultKind
from rolloutcore.transports.source import WeightSource


class FakeRolloutEngine:
    """A ``RolloutEngine`` over the fake engine, a real controller and a real runner."""

    replica = "fake://engine-0"

    def __init__(self, ckpt: Path) -> None:
        w0 = fake_weights(dict(WeightSource.from_checkpoint(ckpt).named_tensors()),
                          Provenance(str(ckpt.resolve()), RUN, 0))
        self.engine = FakeEngine(w0, token_delay_s=0.0)
        self.adapter = FakeAdapter(self.engine)
        self.adapter.stage(w0)
        self.journal = Journal()
        self.controller = LifecycleController(listener=self.journal.listener)
        self.runner = LifecycleRunner(self.controller, self.adapter, FAST,
                                      record=self.journal.write)
        self.runner.bootstrap(w0.identity())
        self.specs: list[tuple[str, SamplingSpec]] = []
        self.sent: list[Mapping[str, Any]] = []
        self.closed = False

    def committed(self) -> tuple[WeightVersion, WeightIdentity]:
        c = self.controller
        assert c.committed is not None and c.identity is not None
        return c.committed, c.identity

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Any,
               owner: str) -> PublishedUpdate:
        self.sent.append(state)
        w = fake_weights(state, provenance)
        self.adapter.stage(w)
        out = self.runner.run_update(w.identity(), owner=owner)
        assert out.published is not None and self.controller.identity is not None
        return PublishedUpdate(out.published, self.controller.identity, out.breakdown())

    def generate(self, rollout_id: str, prompt: Sequence[int],
                 spec: SamplingSpec) -> EngineSample:
        self.specs.append((rollout_id, spec))
        b = self.controller.admit(rollout_id)
        aw, am = time.time(), time.monotonic()
        try:
            assert spec.max_tokens is not None
            g = self.engine.generate([t % 256 for t in prompt], spec.max_tokens,
                                     request_id=rollout_id)
        finally:
            done = self.controller.complete(rollout_id)
        spans = tuple(VersionSpan(str(s["version"]), int(s["start"]), int(s["end"]))  # type: ignore[call-overload]
                      for s in g.version_spans)
        return EngineSample(b, tuple(g.tokens),
                            tuple(-1.0 - 0.01 * i for i in range(len(g.tokens))),
                            g.finish_reason or "length", spans,
                            Timestamps(aw, am, time.time(), time.monotonic()), done.attributable)

    def engine_identity(self) -> EngineIdentity:
        return EngineIdentity("fake-0", "fake-model", {"logprobs_mode": "raw_logprobs"},
                              self.replica)

    def close(self) -> None:
        self.closed = True


class Rig:
    def __init__(self, tmp: Path) -> None:
        torch.manual_seed(0)
        self.model = Tiny()
        self.ckpt = write_checkpoint(tmp / "ckpt", self.model)
        self.engine = FakeRolloutEngine(self.ckpt)
        self.traj = tmp / "traj.jsonl"
        self.rollout = RolloutCoreRollout(self.engine, checkpoint=self.ckpt, run=RUN,
                                          trajectories=self.traj, probe=False)
        self.trainer = make_trainer(self.model)

    def prompts(self, k: int = 2, n: int = N) -> list[str]:
        return [f"prompt {i}" for i in range(k) for _ in range(n)]

    def train_step(self) -> None:
        """What an optimizer step does to the rollout function's view: weights and step move."""
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05)
        self.trainer.state.global_step += 1


@pytest.fixture
def rig(tmp_path: Path) -> Rig:
    r = Rig(tmp_path)
    yield r
    r.rollout.close()


def test_a_step_without_an_update_binds_every_sample_to_the_bootstrap_version(rig: Rig) -> None:
    out = rig.rollout(rig.prompts(), rig.trainer)
    v0 = rig.engine.controller.committed
    assert v0 is not None and v0.generation == 0
    assert rig.rollout.updates == []
    assert set(out) >= {"prompt_ids", "completion_ids", "logprobs", "rc_version",
                        "rc_generation", "rc_rollout_id"}
    assert all(len(v) == 2 * N for v in out.values())
    assert out["prompt_ids"][:N] == [list(b"prompt 0")] * N
    assert out["rc_version"] == [v0.label] * (2 * N) and out["rc_generation"] == [0] * (2 * N)
    assert [len(lp) for lp in out["logprobs"]] == [len(c) for c in out["completion_ids"]]
    groups = list(read_groups(rig.traj))
    assert [g.group_id for g in groups] == [f"{RUN}:s0:p0", f"{RUN}:s0:p1"]
    assert all(len(g) == N and g.step == 0 for g in groups)
    ids = [s.binding.rollout_id for g in groups for s in g.samples]
    assert ids == out["rc_rollout_id"] and len(set(ids)) == 2 * N
    # What TRL got is what was recorded, sample by sample.
    flat = [s for g in groups for s in g.samples]
    assert [list(s.completion.token_ids) for s in flat] == out["completion_ids"]
    assert [list(s.completion.logprobs or ()) for s in flat] == out["logprobs"]
    assert rig.rollout.samples_generated == rig.rollout.samples_recorded == 2 * N


def test_every_step_moved_pushes_one_verified_update_and_binds_the_step_to_it(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    for step in (1, 2, 3):
        rig.train_step()
        if step == 2:
            # TRL's own hook (use_vllm is on: the rollout function took its place)
            # runs first; the rollout call then finds the step already pushed.
            rig.trainer.vllm_generation.sync_weights()
        out = rig.rollout(rig.prompts(), rig.trainer)
        v = rig.engine.controller.committed
        assert v is not None and v.generation == step
        assert set(out["rc_version"]) == {v.label} and set(out["rc_generation"]) == {step}
        ident = rig.engine.controller.identity
        assert ident is not None
        assert ident.provenance == Provenance(str(rig.ckpt.resolve()), RUN, step)
    assert [u.step for u in rig.rollout.updates] == [1, 2, 3]
    assert [s.update is not None for s in rig.rollout.steps] == [False, True, True, True]
    # A second call at the same step (TRL's evaluation) pushes nothing.
    rig.trainer.model.eval()
    out = rig.rollout(rig.prompts(n=2), rig.trainer)
    assert len(out["completion_ids"]) == 4 and len(rig.rollout.updates) == 3
    commits = [r for r in rig.engine.journal.records if r.kind == "commit"]
    assert len(commits) == 1 + 3  # bootstrap, then one per step
    groups = list(read_groups(rig.traj))
    assert [g.group_id for g in groups][-2:] == [f"{RUN}:s3:p2", f"{RUN}:s3:p3"]
    rep = audit_file(rig.traj)
    assert rep.purity.ok and rep.purity.samples == 4 * 2 * N + 4


def test_trl_s_importance_sampling_correction_is_switched_on_with_rolloutcore_as_backend(
        rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    assert rig.trainer.use_vllm is True
    assert rig.trainer._last_loaded_step == 0
    with pytest.raises(AttributeError, match="RolloutCore generates"):
        rig.trainer.vllm_generation.llm  # noqa: B018
    m = rig.trainer._metrics["train"]
    assert m["rolloutcore/generation"] == [0.0] and len(m["rolloutcore/generate_s"]) == 1


def test_the_update_carries_the_module_cast_to_the_engine_dtypes(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    rig.train_step()
    rig.rollout(rig.prompts(), rig.trainer)
    (sent,) = rig.engine.sent
    man = WeightSource.from_checkpoint(rig.ckpt).manifest()
    assert {(n, tuple(t.shape), str(t.dtype)) for n, t in sent.items()} == {
        (p.name, p.shape, f"torch.{p.dtype}") for p in man.params}
    for n, p in rig.model.named_parameters():
        assert torch.equal(sent[n], p.detach().to(torch.bfloat16))


def test_siblings_get_derived_distinct_seeds_and_the_record_says_so(rig: Rig) -> None:
    rig.rollout(rig.prompts(k=3), rig.trainer)
    seen = {rid: spec for rid, spec in rig.engine.specs}
    for g in read_groups(rig.traj):
        for s in g.samples:
            spec = seen[f"{g.group_id}/{s.sample_index}"]
            assert spec.seed == derive_seed(RUN, 0, g.group_id, s.sample_index)
            assert s.sampling == spec and s.sampling.seed_derivation == SEED_DERIVATION
            assert spec.top_k == -1 and spec.max_tokens == 6
            assert dict(spec.extra) == {"logprobs": 0, "ignore_eos": False}
    assert len({spec.seed for spec in seen.values()}) == 3 * N
    assert audit_file(rig.traj).diversity.ok


def test_a_tainting_update_stops_training_and_nothing_of_the_step_reaches_trl(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    before = rig.traj.read_bytes()
    rig.engine.adapter.inject("transfer", FaultKind.DIE)
    rig.train_step()
    with pytest.raises(TrainingStopped) as ei:
        rig.rollout(rig.prompts(), rig.trainer)
    e = ei.value
    assert (e.step, e.reason, e.classification, e.state) == (1, "update_failed", "ambiguous",
                                                             "TAINTED")
    assert e.published is not None and e.published.generation == 0
    assert "step 1" in str(e) and "Nothing of step 1 was returned to TRL" in str(e)
    c = rig.engine.controller
    assert c.state is State.TAINTED and c.committed is not None and c.committed.generation == 0
    assert rig.traj.read_bytes() == before
    assert rig.rollout.samples_generated == 2 * N and len(rig.rollout.steps) == 1
    # Sticky: the trainer cannot carry on by calling again, through either hook.
    with pytest.raises(TrainingStopped) as again:
        rig.rollout(rig.prompts(), rig.trainer)
    assert again.value is e
    with pytest.raises(TrainingStopped):
        rig.trainer.vllm_generation.sync_weights()


def test_a_refused_update_stops_training_on_the_old_version(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    rig.engine.adapter.inject("preflight", FaultKind.LIE)  # wrong manifest: refused
    rig.train_step()
    with pytest.raises(TrainingStopped) as ei:
        rig.rollout(rig.prompts(), rig.trainer)
    assert ei.value.reason == "update_failed"
    assert ei.value.classification == "no_mutation"
    c = rig.engine.controller
    assert c.state is State.READY and c.committed is not None and c.committed.generation == 0
    assert len(list(read_groups(rig.traj))) == 2


def test_a_sample_the_engine_labels_with_another_version_stops_training(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    n_groups = len(list(read_groups(rig.traj)))
    rig.engine.engine.label = "changed-behind-our-back"
    with pytest.raises(TrainingStopped) as ei:
        rig.rollout(rig.prompts(), rig.trainer)
    assert ei.value.reason == "attribution"
    assert "changed-behind-our-back" in str(ei.value)
    assert len(list(read_groups(rig.traj))) == n_groups


def test_an_engine_lost_mid_generation_stops_training(rig: Rig) -> None:
    rig.engine.engine.kill()
    with pytest.raises(TrainingStopped) as ei:
        rig.rollout(rig.prompts(), rig.trainer)
    assert ei.value.reason == "generation" and "EngineUnavailable" in str(ei.value)
    assert not rig.traj.exists() or not list(read_groups(rig.traj))


def test_chat_prompts_are_rendered_with_the_template(rig: Rig) -> None:
    chat = [[{"role": "user", "content": f"hi {i}"}] for i in range(2) for _ in range(N)]
    out = rig.rollout(chat, rig.trainer)
    assert out["prompt_ids"][0] == list(b"hi 0>") and out["prompt_ids"][-1] == list(b"hi 1>")


@pytest.mark.parametrize(("prompts", "match"), [
    ([], "non-empty"),
    (["a", "a", "a"], "not groups of num_generations=4"),
    (["a", "a", "b", "a"], "not one prompt repeated"),
])
def test_prompts_not_in_trl_s_groups_are_refused_and_nothing_is_generated(
        rig: Rig, prompts: list[str], match: str) -> None:
    with pytest.raises(BadInput, match=match):
        rig.rollout(prompts, rig.trainer)
    assert rig.engine.specs == []


def test_bad_set_ups_are_refused_before_the_engine_is_touched(rig: Rig, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="not a checkpoint"):
        RolloutCoreRollout(rig.engine, checkpoint=tmp_path / "none", run=RUN)
    with pytest.raises(BadInput, match="run"):
        RolloutCoreRollout(rig.engine, checkpoint=rig.ckpt, run="no spaces allowed")
    with pytest.raises(BadInput, match="EngineSession or a RolloutEngine"):
        RolloutCoreRollout(object(), checkpoint=rig.ckpt, run=RUN)
    with pytest.raises(BadInput, match="probe_tolerance"):
        RolloutCoreRollout(rig.engine, checkpoint=rig.ckpt, run=RUN, probe_tolerance=0)
    two = make_trainer(rig.model)
    two.accelerator.num_processes = 2
    with pytest.raises(BadInput, match="one training process"):
        rig.rollout(rig.prompts(), two)
    own = make_trainer(rig.model)
    own.use_vllm, own.vllm_generation = True, object()
    with pytest.raises(BadInput, match="use_vllm"):
        rig.rollout(rig.prompts(), own)
    vespo = make_trainer(rig.model)
    vespo.loss_type, vespo.vllm_importance_sampling_mode = "vespo", "sequence_mask"
    with pytest.raises(BadInput, match="vespo"):
        rig.rollout(rig.prompts(), vespo)
    assert vespo.use_vllm is False
    assert rig.engine.specs == [] and rig.engine.controller.committed is not None


def test_a_model_that_does_not_fit_the_engine_is_refused_with_its_names(rig: Rig) -> None:
    man = WeightSource.from_checkpoint(rig.ckpt).manifest()
    other = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(BadInput, match=r"missing \['layer.bias', 'layer.weight'\]"):
        engine_state_dict(other, man)
    wide = Tiny()
    wide.layer = torch.nn.Linear(5, 3)
    with pytest.raises(BadInput, match="shape"):
        engine_state_dict(wide, man)
    with pytest.raises(BadInput, match=r"not a torch\.nn\.Module"):
        engine_state_dict({"layer.weight": torch.zeros(3, 4)}, man)
    rig.rollout(rig.prompts(), rig.trainer)
    rig.trainer.model = other
    rig.trainer.state.global_step = 1
    with pytest.raises(BadInput, match="does not match the engine's checkpoint"):
        rig.rollout(rig.prompts(), rig.trainer)
    assert rig.engine.controller.state is State.READY and rig.engine.sent == []


def test_engine_state_dict_copies_so_the_optimizer_cannot_change_what_is_sent(
        rig: Rig) -> None:
    man = WeightSource.from_checkpoint(rig.ckpt).manifest()
    sd = engine_state_dict(rig.model, man)
    snap = {n: t.clone() for n, t in sd.items()}
    with torch.no_grad():
        rig.model.layer.weight.add_(1.0)
    assert all(torch.equal(sd[n], snap[n]) for n in sd)
    assert all(t.dtype == torch.bfloat16 for t in sd.values())


def test_reports_serialize(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    rig.train_step()
    rig.rollout(rig.prompts(), rig.trainer)
    d = [s.to_dict() for s in rig.rollout.steps]
    json.dumps(d)
    assert d[1]["update"]["version"]["generation"] == 1
    assert d[1]["update"]["drain_s"] >= 0 and d[1]["generation"]["samples"] == 2 * N


def test_close_closes_the_file_and_the_engine_and_refuses_more(rig: Rig) -> None:
    rig.rollout(rig.prompts(), rig.trainer)
    rig.rollout.close()
    assert rig.engine.closed
    with pytest.raises(BadInput, match="closed"):
        rig.rollout(rig.prompts(), rig.trainer)


#: The fault-matrix part of #29's unattributable_answer this module proves (helpers.fault_matrix).
MATRIX = PromiseRows(
    "tests/test_trl_rollout_unit.py",
    engines="FakeEngine under the real controller and runner; the real gateway app served by "
            "uvicorn on loopback HTTP, its upstream a FakeVllm on loopback HTTP; TRL's gateway "
            "engine (integrations.trl.engines._GatewayEngine) its client")
_fault_matrix = MATRIX.fixture()


def test_the_gateway_engine_credits_no_sample_the_gateway_released_unattributable() -> None:
    """#29: the gateway released a request unattributable (its engine tainted while it
    ran) and said nothing; TRL's gateway engine recorded the sample as attributable. The
    gateway now marks the answer and the engine credits it to no version."""
    import threading

    from helpers.gateway_rig import TOKEN, make_parts, serve_fake, uvicorn_thread
    from rolloutcore.core.lifecycle import FailureKind, Step
    from rolloutcore.integrations.trl.engines import _GatewayEngine
    from rolloutcore.provenance.trajectory import SamplingSpec
    from rolloutcore.service import ServiceConfig
    from rolloutcore.service.app import create_app

    eng, ad, c, r, j, fake = make_parts(token_delay_s=0.01)
    app = create_app(r, ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN))
    with uvicorn_thread(app) as url:
        ge = _GatewayEngine(url, TOKEN, transport=None, data_token=None, timeout_s=30,
                            min_verification=None)
        try:
            ge.committed()
            ok = ge.generate("r-ok", [1, 2, 3], SamplingSpec(0.0, max_tokens=4))
            assert ok.attributable
            taint = threading.Timer(0.15, lambda: c.fail(None, Step.SERVE, FailureKind.DIED,
                                                         "engine lost (test)"))
            taint.start()
            late = ge.generate("r-late", [1, 2, 3], SamplingSpec(0.0, max_tokens=60))
            taint.join()
            assert late.attributable is False
            assert late.binding.version.label == "default"
        finally:
            ge.close()
    MATRIX.row("unattributable_answer", "the same, answered to TRL's gateway engine",
               "the sample credited to no version (attributable False, its binding the old "
               "version's)", "TAINTED", part="trl", mislabeled_answers=0)


# --------------------------------------------------------------------------- Ctrl-C (#29)

class SessionRig:
    """The rollout function over ``_SessionEngine`` (what ``launch`` builds) on a fake session."""

    def __init__(self, tmp: Path, *, interrupt_wait_s: float = 10.0) -> None:
        from helpers.trl_fakes import FakeSession
        from rolloutcore.integrations.trl.engines import _SessionEngine

        torch.manual_seed(0)
        self.model = Tiny()
        self.ckpt = write_checkpoint(tmp / "ckpt", self.model)
        self.journal_path = tmp / "journal.jsonl"
        self.session = FakeSession(self.ckpt, RUN, journal=self.journal_path)
        self.traj = tmp / "traj.jsonl"
        self.rollout = RolloutCoreRollout(_SessionEngine(self.session, owns=True),
                                          checkpoint=self.ckpt, run=RUN, trajectories=self.traj,
                                          probe=False, interrupt_wait_s=interrupt_wait_s)
        self.trainer = make_trainer(self.model)

    def records(self) -> list[Any]:
        from rolloutcore.control.journal import read_journal

        return [r.record for r in read_journal(self.journal_path)]


def _waiting_for_samples(stack: list[str]) -> bool:
    from helpers.trl_fakes import calls

    return calls(stack, "._generate_all", "concurrent.futures._base.wait")


@pytest.mark.parametrize("held", [0, 1])
def test_ctrl_c_during_generation_is_an_interrupt_not_a_failed_sample(
        tmp_path: Path, held: int) -> None:
    """#29: Ctrl-C while the samples were generated stopped with "generation failed: 1 of
    32 samples failed; first: KeyboardInterrupt" (exit 2), every sample completed. The
    interrupt now propagates as itself; the step's requests are awaited (at most
    ``interrupt_wait_s``), nothing of the step is recorded, and the rollout says what
    was stopped."""
    import threading

    from helpers.trl_fakes import prompts, sigint_when

    # held=0: every request is released by the Ctrl-C and must end within the bounded
    # wait, a few seconds on a loaded host too (0.2 s failed with two cores kept busy).
    # held=1: the bound itself: the others were generated before the Ctrl-C, one request
    # never is, and the rollout gives up on it after the bounded wait.
    rig = SessionRig(tmp_path, interrupt_wait_s=0.5 if held else 3.0)
    sent, hold = threading.Event(), threading.Event()
    arrived: list[str] = []
    try:
        rig.rollout(prompts(), rig.trainer)                 # step 0, recorded
        groups_before = len(list(read_groups(rig.traj)))

        def before(req: httpx.Request) -> None:
            if req.url.path != Routes.GENERATE:
                return
            rid = json.loads(req.content)["request_id"]
            arrived.append(rid)
            if held and rid.endswith("p3/3"):
                hold.wait(30)   # one request outlives the bounded wait
            elif not held:
                sent.wait(30)   # every request waits for the Ctrl-C: the rollout is waiting

        rig.session.fake.before = before
        # Ctrl-C once every request reached the engine (before that, a loaded host may not
        # have started them all, and a request not started is cancelled, not awaited).
        engine = rig.session.fake.engine
        term = sigint_when(lambda st: len(arrived) == 2 * N and _waiting_for_samples(st)
                           and (not held or engine.in_flight == 0))
        threading.Thread(target=lambda: (term.join(), sent.set()), daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            rig.rollout(prompts(), rig.trainer)
        it = rig.rollout.interrupted
        assert it is not None and (it.phase, it.step, it.cause) == (
            "generation", 0, "KeyboardInterrupt")
        assert (it.samples, it.completed, it.unfinished) == (2 * N, 2 * N - held, held)
        assert "none was recorded" in it.describe()
        assert rig.rollout.stopped is None
        assert len(list(read_groups(rig.traj))) == groups_before
        assert rig.rollout.samples_recorded == 2 * N
        hold.set()
        # Not sticky: the same rollout function generates again (a notebook's next train()).
        rig.session.fake.before = None
        out = rig.rollout(prompts(), rig.trainer)
        assert len(out["completion_ids"]) == 2 * N and rig.rollout.interrupted is None
    finally:
        hold.set()
        rig.rollout.close()
    assert [r for r in rig.records() if r.KIND == "interrupted"] == []  # the run went on


@pytest.mark.parametrize(("effect", "state", "outcome", "after"), [
    ("drain", State.DRAINING, "no_mutation", State.READY),
    ("transfer", State.UPDATING, "ambiguous", State.TAINTED),
])
def test_ctrl_c_during_an_update_ends_it_decided_and_the_journal_names_it(
        tmp_path: Path, effect: str, state: State, outcome: str, after: State) -> None:
    """#29: an update interrupted half-way stayed open (admission closed, the engine paused,
    perhaps half of the weights in) with no closing record, and the audit said nothing.
    It is now ended as a timeout of its step: resumed on the old version when nothing was
    mutated, else TAINTED and fenced; the journal closes with an ``interrupted`` record
    that names it, and the audit reports it."""
    from helpers.trl_fakes import calls, prompts, sigint_when, train_step
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.invariants import check_journal
    from rolloutcore.core.records import Abandon, Failure, RequestUpdate, Taint

    rig = SessionRig(tmp_path)
    c = rig.session.controller
    try:
        rig.rollout(prompts(), rig.trainer)
        v0 = c.committed
        rig.session.vllm.inject(effect, FaultKind.HANG)
        train_step(rig.model, rig.trainer)
        sigint_when(lambda st: c.state is state
                    and calls(st, "LifecycleRunner._effect",
                              "rolloutcore.control.effects.Job.wait"))
        with pytest.raises(KeyboardInterrupt):
            rig.rollout(prompts(), rig.trainer)
        assert c.current_ticket is None and c.state is after and c.committed == v0
        assert rig.session.engine.paused is (after is State.TAINTED)  # fenced, or serving
        it = rig.rollout.interrupted
        assert it is not None and it.phase == "update" and it.step == 1
        assert it.update is not None and it.update.state is state
        assert it.update.classification is not None
        assert it.update.classification.value == outcome
        if after is State.TAINTED:
            with pytest.raises(TrainingStopped, match="interrupted"):
                rig.rollout(prompts(), rig.trainer)
    finally:
        rig.rollout.close()
    from rolloutcore.core.records import Interrupted

    recs = rig.records()
    (req,) = [r for r in recs if type(r) is RequestUpdate]
    assert it.update.update_id == req.update_id
    fail = [r for r in recs if isinstance(r, Failure)][-1]
    assert (fail.step.value, fail.kind.value) == (effect, "timeout")
    assert "interrupted (KeyboardInterrupt)" in fail.reason
    ends = [r for r in recs if isinstance(r, (Abandon, Taint))]
    assert [type(r) for r in ends] == [Abandon if outcome == "no_mutation" else Taint]
    last = recs[-1]
    assert isinstance(last, Interrupted)
    assert (last.phase, last.step, last.update_id, last.update_state, last.state) == (
        "update", 1, req.update_id, state, after)
    assert last.outcome is not None and last.outcome.value == outcome
    assert last.committed == v0 and last.rollouts == 0
    # The journal is whole: its invariants hold and it restores to the decided state.
    assert check_journal(read_journal(rig.journal_path)) == []
    assert LifecycleController.restore(read_journal(rig.journal_path)).state is after
    rep = audit_file(rig.traj, rig.journal_path)
    assert rep.ok and rep.purity.journal is not None
    assert rep.purity.journal.interruptions == (last,)
    assert rep.purity.journal.unended == ()
    assert f"interrupted: KeyboardInterrupt during update at global_step 1; update " \
        f"{req.update_id} in {state.value}" in rep.format_table()


def test_the_audit_names_an_update_a_journal_leaves_without_an_end(tmp_path: Path) -> None:
    """A process killed mid-update (no chance to end it) leaves a journal whose last update
    has no end: the audit says so, rather than nothing."""
    from helpers.trl_fakes import prompts, train_step
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.records import BeginUpdate
    from rolloutcore.provenance.audit import read_journal_summary

    rig = SessionRig(tmp_path)
    rig.rollout(prompts(), rig.trainer)
    train_step(rig.model, rig.trainer)
    rig.rollout(prompts(), rig.trainer)   # update 1, published
    rig.rollout.close()
    whole = read_journal(rig.journal_path)
    assert read_journal_summary(rig.journal_path).unended == ()
    # The same journal as a process SIGKILLed during the transfer leaves it.
    cut = next(i for i, r in enumerate(whole) if isinstance(r.record, BeginUpdate))
    died = tmp_path / "died.jsonl"
    died.write_text("".join(r.to_json() + "\n" for r in whole[:cut + 1]))
    s = read_journal_summary(died)
    assert [(f, r.update_id) for f, r in s.unended] == [(str(died), 1)]
    text = audit_file(rig.traj, died).format_table()
    assert "update 1 (to " in text and "has no end in" in text


def test_work_that_must_not_stop_half_way_notes_ctrl_c_and_gives_way_at_the_third(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Ending an update and ``rolloutcore train``'s finishing defer Ctrl-C (bounded work);
    a user who will not wait presses it three times."""
    import signal

    from rolloutcore.integrations.trl.common import deferred_interrupts

    with deferred_interrupts("busy ending the update") as presses:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
        assert len(presses) == 2
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert "busy ending the update (Ctrl-C 2 more times to quit at once)" in \
        capsys.readouterr().err
