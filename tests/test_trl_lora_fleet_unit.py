"""``train --lora --gateway`` through a fleet gateway, in process (``run_train``).

The fleet is the fast lane's: two fake replicas (their own controllers and file
journals) behind the real fleet gateway on a loopback port (uvicorn), each
replica's adapter routes the one fake scoring with PEFT (``testing.peft_scorer``: the
real tiny model, so the adapter probes compare real computations), its
generation a ``FakeVllm``. The trainer is TRL's GRPO on the run's own tiny
checkpoint. What is checked: every adapter version published on both replicas
(each acknowledgement kept, each replica's copy), each sample recorded with its
replica, fleet version and that replica's copy of its step's adapter, and the
audit against the fleet's journal directory clean, and not clean once a
recorded sample is made to lie.

The same with a real ``serve --engines 2 --lora``:
tests/engine/test_trl_lora_fleet_engine.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from helpers.needs import installed

installed("peft")
installed("trl")


# Slow lane: a GRPO run of several steps through the fleet gateway in this process
# (TRL's trainer imported, then trained): 7 s of CPU and 20 s of wall in the fast lane
# (2 workers, load 8), the longest test there; it proves the whole run, not a fast path.
@pytest.mark.slow
def test_train_lora_through_a_fleet_gateway(tmp_path: Path, one_torch_thread: None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from fleettools import fake_fleet, served
    from helpers.gateway_rig import TOKEN, uvicorn_thread
    from rolloutcore.cli.train import MODEL_SEED, LoraSettings, run_train
    from rolloutcore.control.adapters import AdapterManager
    from rolloutcore.core.adapters import AdapterConfig
    from rolloutcore.fleet.adapter_gateway import create_lora_fleet_app
    from rolloutcore.fleet.adapters import FleetAdapters
    from rolloutcore.provenance.audit import audit_file
    from rolloutcore.provenance.recorder import TrajectoryRecorder, read_groups
    from rolloutcore.service import ServiceConfig
    from rolloutcore.testing.models import make_checkpoint
    from rolloutcore.testing.peft_scorer import peft_vllm

    # run_train gives torch half the cores; keep it at one beside the fake engines.
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    work, jdir = tmp_path / "w", tmp_path / "journals"
    jdir.mkdir()
    base = make_checkpoint(work / "policy-0", MODEL_SEED)   # what train uses and serve makes
    f = fake_fleet(2, journal_dir=str(jdir))
    engines = {n: peft_vllm(base) for n in f.coord.replicas}   # (the one fake, client)

    def make(rep: Any) -> AdapterManager:
        return AdapterManager(engines[rep.name][1], rep.controller, base_model=base,
                              store=tmp_path / "store" / rep.name,
                              config=AdapterConfig(max_loaded=3, max_staleness=1),
                              listener=rep.journal.listener, max_rank=8)

    fa = FleetAdapters(f.coord, make, base_model=base, deadline_s=120)
    try:
        with served(f) as fakes:
            for n, fk in fakes.items():
                fk.loras = engines[n][0].loras  # one engine: the adapters loaded
            app = create_lora_fleet_app(f.coord, ServiceConfig(
                upstream_url="http://127.0.0.1:1", control_token=TOKEN), fa, supervise=False)
            with uvicorn_thread(app) as url:
                rep = run_train(work, steps=2, lora=LoraSettings(4, 8, ("q_proj", "v_proj")),
                                gateway=url, token=TOKEN, gateway_journal=jdir,
                                prompts_per_step=2, num_generations=2, max_tokens=4,
                                progress=None)
        names = rep["lora"]["adapter_versions"]
        assert len(names) == 2 and len(set(names)) == 2
        assert rep["lora"]["base_version"] == "fleet-0"
        assert rep["lora"]["samples_through_adapter"] == 8
        assert rep["audit"]["ok"] and rep["audit"]["samples"] == 8, rep["audit"]["table"]
        assert rep["journal"] == str(jdir)
        # Published on both replicas, each from its own copy of the files.
        assert fa.current is not None and fa.current.name == names[-1]
        assert set(fa.current.replicas) == {"r0", "r1"}
        for n, (e, _) in engines.items():
            assert set(names) <= set(e.loras) and str(tmp_path / "store" / n) in \
                e.loras[names[-1]]
        # Every sample: its replica, the fleet version, its step's adapter on that replica,
        # bound to the engine version its replica served the fleet version as.
        samples = [json.loads(x) for x in (work / "trajectories.jsonl").read_text()
                   .splitlines() if '"record": "sample"' in x or '"record":"sample"' in x]
        assert len(samples) == 8
        served_as = {n: r.controller.committed.to_dict() for n, r in f.coord.replicas.items()}
        for s in samples:
            fl, ad = s["fleet"], s["adapter"]
            assert fl["fleet_version"] == 0 and fl["fleet_label"] == "fleet-0"
            assert s["binding"]["version"] == served_as[fl["replica"]]
            assert ad["name"] == names[s["step"]] and ad["base"] == \
                s["binding"]["version"]["label"]
        assert {s["fleet"]["replica"] for s in samples} == {"r0", "r1"}
        assert sum(len(fk.bodies) for fk in fakes.values()) == 8
    finally:
        f.coord.close()
    # Negative controls: the audit reads the fleet's journals, so a sample that names
    # another replica or another adapter content is found (rewritten as committed groups).
    groups = list(read_groups(work / "trajectories.jsonl"))
    s0 = groups[0].samples[0]
    assert s0.fleet is not None and s0.adapter is not None
    for lie, issue in ((replace(s0, fleet=replace(s0.fleet, replica="r9")), "fleet-mismatch"),
                       (replace(s0, adapter=replace(s0.adapter, content_digest="0" * 64)),
                        "adapter-mismatch")):
        bad = tmp_path / f"{issue}.jsonl"
        rec = TrajectoryRecorder(bad)
        rec.append_group(replace(groups[0], samples=(lie, *groups[0].samples[1:])))
        for g in groups[1:]:
            rec.append_group(g)
        rec.close()
        a = audit_file(bad, jdir)
        assert a.purity.samples == 8 and not a.ok
        assert {(x.group_id, x.issue.value) for x in a.purity.findings} == {
            (s0.group_id, issue)}
