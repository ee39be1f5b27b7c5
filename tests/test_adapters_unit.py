"""LoRA-adapter versions without an engine: the pure machine and the adapter's checks.

The machine (``core.adapters.AdapterTable``) is driven directly and its whole
state compared after each step, including that every refused or illegal step
changes nothing; every (state, event) pair of the table is walked. The
adapter's own checks (``verification.adapters.AdapterSource``) refuse bad
adapters, naming what is wrong, before anything reaches an engine.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from rolloutcore.core.adapters import (
    ADAPTER_TRANSITIONS,
    AdapterChange,
    AdapterConfig,
    AdapterEvent,
    AdapterState,
    AdapterTable,
    AdapterVersion,
    adapter_name,
)
from rolloutcore.core.records import JournalRecord, decode
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import AdmissionRefused, BadInput, InvalidTransition, UpdateRefused

S, E = AdapterState, AdapterEvent


def _v(gen: int, fill: str = "a", size: int = 10) -> AdapterVersion:
    digest = (fill * 64)[:64]
    name = adapter_name(gen, digest)
    return AdapterVersion(gen, name, f"/store/{name}", digest, "rc-0", size)


def _snapshot(t: AdapterTable) -> Any:
    v = t.view()
    return (v.current, dict(v.states), dict(v.bound), t.next_generation,
            [x.name for x in t.evictable()])


def _publish(t: AdapterTable, v: AdapterVersion) -> None:
    t.propose(v)
    t.move(v.name, E.LOADED)
    t.move(v.name, E.VERIFIED)


def test_name_is_generation_and_content() -> None:
    assert adapter_name(3, "ab" * 32) == "rcl-3-" + "ab" * 8
    for bad in ((0, "a" * 64), (True, "a" * 64), (1, "A" * 64), (1, "a" * 63)):
        with pytest.raises(BadInput):
            adapter_name(*bad)  # type: ignore[arg-type]


def test_version_and_config_validate() -> None:
    with pytest.raises(BadInput):
        AdapterVersion(1, "bad name", "/p", "a" * 64, "rc-0")
    with pytest.raises(BadInput):
        AdapterVersion(1, "x", "", "a" * 64, "rc-0")
    with pytest.raises(BadInput):
        AdapterVersion(1, "x", "/p", "a" * 64, "rc-0", -1)
    v = _v(1)
    assert AdapterVersion.from_dict(v.to_dict()) == v
    with pytest.raises(BadInput):
        AdapterVersion.from_dict({"name": "x"})
    with pytest.raises(BadInput, match="max_staleness \\+ 2"):
        AdapterConfig(max_loaded=2, max_staleness=1)
    with pytest.raises(BadInput):
        AdapterConfig(max_staleness=-1)
    with pytest.raises(BadInput):
        AdapterConfig(max_bytes=0)


def test_publish_supersedes_in_one_decision_and_records_every_step() -> None:
    t = AdapterTable(AdapterConfig(max_loaded=3, max_staleness=1))
    t.recording = True
    a, b = _v(1, "a"), _v(2, "b")
    _publish(t, a)
    assert t.current == a and t.state(a.name) is S.PUBLISHED
    t.propose(b)
    t.move(b.name, E.LOADED)
    assert t.current == a   # verifying: nothing routed to b yet
    bind = t.admit("r1")
    assert bind.adapter == a
    t.move(b.name, E.VERIFIED, evidence=("probe ok",))
    assert t.current == b and t.state(a.name) is S.STANDBY
    recs = t.take()
    assert [(r.name, r.before, r.after) for r in recs if isinstance(r, AdapterChange)] == [
        (a.name, None, S.LOADING), (a.name, S.LOADING, S.VERIFYING),
        (a.name, S.VERIFYING, S.PUBLISHED), (b.name, None, S.LOADING),
        (b.name, S.LOADING, S.VERIFYING), (a.name, S.PUBLISHED, S.STANDBY),
        (b.name, S.VERIFYING, S.PUBLISHED)]
    for r in recs:   # each reads back equal through the journal's codec
        line = JournalRecord(1, 0.0, 0.0, r).to_json()
        obj = json.loads(line)
        assert decode(obj["kind"], obj["data"]) == r


def test_retirement_keeps_max_staleness_superseded_and_waits_for_bound_requests() -> None:
    t = AdapterTable(AdapterConfig(max_loaded=4, max_staleness=1))
    a, b, c = _v(1, "a"), _v(2, "b"), _v(3, "c")
    _publish(t, a)
    t.admit("on-a")
    _publish(t, b)
    assert t.evictable() == []          # a is the one superseded adapter kept
    _publish(t, c)
    assert t.evictable() == []          # a is outside max_staleness, but a request runs on it
    with pytest.raises(UpdateRefused, match="bound"):
        t.move(a.name, E.UNLOAD)
    assert t.complete("on-a") == a
    assert t.evictable() == [a]
    t.move(a.name, E.UNLOAD)
    t.move(a.name, E.UNLOADED)
    assert t.state(a.name) is S.RETIRED and [v.name for v in t.loaded()] == [b.name, c.name]


def test_refusals_change_nothing() -> None:
    t = AdapterTable(AdapterConfig(max_loaded=2, max_staleness=0, max_bytes=25))
    a = _v(1, "a")
    _publish(t, a)
    before = _snapshot(t)
    cases: list[tuple[Any, type[Exception], str]] = [
        (lambda: t.propose(_v(1, "b")), BadInput, "generation must be 2"),
        (lambda: t.propose(AdapterVersion(2, a.name, "/x", "c" * 64, "rc-0")),
         UpdateRefused, "used before"),
        (lambda: t.propose(_v(2, "b", size=20)), UpdateRefused, "bytes exceed"),
        (lambda: t.move(a.name, E.LOADED), InvalidTransition, "not in ADAPTER_TRANSITIONS"),
        (lambda: t.move("nope", E.LOADED), BadInput, "no adapter"),
        (lambda: t.move(a.name, "loaded"), BadInput, "not an AdapterEvent"),
        (lambda: t.propose("x"), BadInput, "AdapterVersion"),
        (lambda: t.complete("never"), BadInput, "not bound"),
        (lambda: t.admit(""), BadInput, "non-empty"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()
        assert _snapshot(t) == before
    t.propose(_v(2, "b"))
    mid = _snapshot(t)
    with pytest.raises(UpdateRefused, match="one adapter update at a time"):
        t.propose(_v(3, "c"))
    assert _snapshot(t) == mid


def test_slot_budget_refuses_before_anything_changes() -> None:
    t = AdapterTable(AdapterConfig(max_loaded=3, max_staleness=1))
    a, b, c = _v(1, "a"), _v(2, "b"), _v(3, "c")
    _publish(t, a)
    t.admit("long")      # pins a
    _publish(t, b)
    _publish(t, c)        # a: bound, b: kept by max_staleness, c: current -> 3 loaded
    before = _snapshot(t)
    with pytest.raises(UpdateRefused, match="3 adapters loaded, the budget is 3"):
        t.propose(_v(4, "d"))
    assert _snapshot(t) == before and t.next_generation == 4


def test_failures_unload_or_fence_and_never_publish() -> None:
    t = AdapterTable(AdapterConfig(max_loaded=4, max_staleness=1))
    a = _v(1, "a")
    _publish(t, a)
    b, c, d = _v(2, "b"), _v(3, "c"), _v(4, "d")
    t.propose(b)
    t.move(b.name, E.REJECTED)
    assert t.state(b.name) is S.REFUSED and t.current == a
    t.propose(c)
    t.move(c.name, E.LOADED)
    t.move(c.name, E.FAILED, reason="probe through the adapter: 0.45 > 0.005")
    assert t.state(c.name) is S.REFUSING and t.current == a
    t.move(c.name, E.UNLOADED)
    assert t.state(c.name) is S.REFUSED
    t.propose(d)
    t.move(d.name, E.FAILED)
    t.move(d.name, E.FAILED)
    assert t.state(d.name) is S.FENCED and d in t.loaded() and t.current == a


def test_a_withdrawn_version_is_not_current_and_goes_once_nothing_bound_runs() -> None:
    """The client unloaded it (vLLM's unload route on the gateway): no new request gets
    it, its bound ones keep it, then it is evictable whatever max_staleness keeps."""
    t = AdapterTable(AdapterConfig(max_loaded=4, max_staleness=1))
    t.recording = True
    a, b = _v(1, "a"), _v(2, "b")
    _publish(t, a)
    _publish(t, b)
    assert t.evictable() == []            # a: the one superseded version kept
    t.move(a.name, E.WITHDRAWN)
    assert t.state(a.name) is S.STANDBY and t.evictable() == [a] and t.current == b
    t.admit("r1")                         # bound to b
    t.move(b.name, E.WITHDRAWN, reason="unloaded by the client")
    assert t.current is None and t.state(b.name) is S.STANDBY
    with pytest.raises(AdmissionRefused, match="no adapter is published"):
        t.admit("r2")
    assert t.evictable() == [a]           # b: its request still runs
    t.complete("r1")
    assert t.evictable() == [a, b]
    recs = [r for r in t.take() if isinstance(r, AdapterChange)]
    # a restart reading these records claims no current version
    assert AdapterTable().restore(recs) is None
    was = AdapterTable().restore(recs[:-1])   # before the withdrawal: b
    assert was is not None and was.name == b.name


def test_every_state_event_pair() -> None:
    """Each legal pair leads to its table's target; each other pair changes nothing."""
    paths: dict[AdapterState, list[AdapterEvent]] = {
        S.LOADING: [], S.VERIFYING: [E.LOADED], S.PUBLISHED: [E.LOADED, E.VERIFIED],
        S.REFUSING: [E.FAILED], S.REFUSED: [E.REJECTED], S.FENCED: [E.FAILED, E.FAILED],
    }
    for state in S:
        for event in E:
            t = AdapterTable(AdapterConfig(max_loaded=5, max_staleness=0))
            x = _v(1, "e")
            t.propose(x)
            if state in paths:
                for ev in paths[state]:
                    t.move(x.name, ev)
            else:   # STANDBY, UNLOADING, RETIRED: superseded by y
                for ev in (E.LOADED, E.VERIFIED):
                    t.move(x.name, ev)
                _publish(t, _v(2, "f"))
                if state in (S.UNLOADING, S.RETIRED):
                    t.move(x.name, E.UNLOAD)
                if state is S.RETIRED:
                    t.move(x.name, E.UNLOADED)
            assert t.state(x.name) is state
            before = _snapshot(t)
            target = ADAPTER_TRANSITIONS.get((state, event))
            if target is None:
                with pytest.raises(InvalidTransition):
                    t.move(x.name, event)
                assert _snapshot(t) == before
            else:
                assert t.move(x.name, event) is target


def test_admission_needs_a_published_adapter_and_fails_closed() -> None:
    t = AdapterTable()
    with pytest.raises(AdmissionRefused, match="no adapter is published"):
        t.admit("r")
    a = _v(1)
    _publish(t, a)
    t.fail_closed("journal lost")
    with pytest.raises(AdmissionRefused, match="failed closed"):
        t.admit("r")
    with pytest.raises(UpdateRefused, match="failed closed"):
        t.propose(_v(2, "b"))


def test_names_listed_by_the_engine_are_never_reused() -> None:
    t = AdapterTable()
    v = _v(1)
    t.note_loaded({v.name: "policy"})
    with pytest.raises(UpdateRefused, match="used before"):
        t.propose(v)
    assert t.next_generation == 1 and t.loaded() == []


# --------------------------------------------------------------------------- the adapter

def _peft(tmp_path: Path, *, zero_b: bool = False) -> Any:
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from rolloutcore.testing.models import make_checkpoint

    ck = make_checkpoint(tmp_path / "base", 1)
    base = AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32)
    # PEFT draws lora_A from torch's global generator, which holds whatever the tests
    # before this one (in this worker, in its order) left there: the adapter, and how far
    # it moves the base, would change with the run. Its own seed, the global one untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj",
                                                                          "v_proj"]))
    if not zero_b:
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return m


def test_adapter_source_digest_and_refusals(tmp_path: Path) -> None:
    from rolloutcore.verification.adapters import AdapterSource

    m = _peft(tmp_path)
    src = AdapterSource.of(m)
    assert src.rank == 4 and len(src.content_digest) == 64 and src.size_bytes > 0
    d = tmp_path / "saved"
    m.save_pretrained(d)
    assert AdapterSource.of(d).content_digest == src.content_digest  # model and dir agree
    out = src.write(tmp_path / "store" / "v1")
    assert AdapterSource.of(out).content_digest == src.content_digest
    with pytest.raises(BadInput, match="never reused"):
        src.write(out)
    with pytest.raises(BadInput, match="max-lora-rank 2"):
        AdapterSource.of(m, max_rank=2)
    with pytest.raises(BadInput, match="does not exist"):
        AdapterSource.of(tmp_path / "nope")
    with pytest.raises(BadInput, match="a PEFT model or an adapter directory"):
        AdapterSource.of(42)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInput, match=r"no adapter_config\.json"):
        AdapterSource.of(empty)
    cfg = json.loads((d / "adapter_config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    (bad / "adapter_model.safetensors").write_bytes((d / "adapter_model.safetensors")
                                                    .read_bytes())
    with pytest.raises(BadInput, match="peft_type must be LORA"):
        AdapterSource.of(bad)
    (bad / "adapter_config.json").write_text(json.dumps(cfg))
    (bad / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(BadInput, match="not a readable safetensors"):
        AdapterSource.of(bad)
    from safetensors.torch import save_file
    torch = pytest.importorskip("torch")
    save_file({"model.layers.0.mlp.weight": torch.zeros(2, 2)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(BadInput, match="0 of 1 tensors are lora_A/lora_B"):
        AdapterSource.of(bad)
    one = {k: v for k, v in src.tensors.items() if "lora_B" not in k}
    save_file(one, str(bad / "adapter_model.safetensors"))
    with pytest.raises(BadInput, match="unpaired"):
        AdapterSource.of(bad)
    nan = {k: v.clone() for k, v in src.tensors.items()}
    next(iter(nan.values()))[0, 0] = float("nan")
    save_file(nan, str(bad / "adapter_model.safetensors"))
    with pytest.raises(BadInput, match="non-finite"):
        AdapterSource.of(bad)


def test_a_zero_adapter_has_another_digest(tmp_path: Path) -> None:
    from rolloutcore.verification.adapters import AdapterSource

    trained = AdapterSource.of(_peft(tmp_path / "t"))
    init = AdapterSource.of(_peft(tmp_path / "i", zero_b=True))
    assert trained.content_digest != init.content_digest


# --------------------------------------------------------------------------- the probe's path

class _Table:
    """An engine stand-in for ``measure_generated``'s bookkeeping: a fixed next-token
    table (context length -> (greedy token, {token: logprob})), counting requests."""

    def __init__(self, rows: dict[int, tuple[int, dict[int, float]]]) -> None:
        self.rows = rows
        self.calls: list[int] = []

    def top_logprobs(self, ids: list[int], *, max_tokens: int, top: int, model: Any,
                     timeout_s: Any) -> list[tuple[int, dict[int, float]]]:
        self.calls.append(len(ids))
        return [self.rows[len(ids) + k] for k in range(max_tokens)]


def test_measure_generated_reanchors_after_a_divergence_and_counts_absent_as_inf() -> None:
    import math

    from rolloutcore.verification.adapters import measure_generated
    from rolloutcore.verification.probe import PolicyProbe, ProbeCase

    probe = PolicyProbe([ProbeCase((1, 2), (5, 6, 7), (-0.1, -0.2, -0.3))], tolerance=0.01)
    same = _Table({2: (5, {5: -0.1}), 3: (6, {6: -0.2}), 4: (7, {7: -0.3})})
    res = measure_generated(probe, same, None)
    assert res.max_abs_diff == 0.0 and res.positions == 3 and same.calls == [2]
    # A near-tie at position 1: the engine picks 9, the reference's 6 is close behind;
    # the next request continues from the reference's token (context of length 4).
    tie = _Table({2: (5, {5: -0.1}), 3: (9, {9: -0.19, 6: -0.21}), 4: (7, {7: -0.3})})
    res = measure_generated(probe, tie, None)
    assert tie.calls == [2, 4] and res.positions == 3
    assert math.isclose(res.max_abs_diff, 0.01, abs_tol=1e-9) and res.worst_position == 1
    # The reference's token is not among the engine's top: an infinite deviation.
    wrong = _Table({2: (8, {8: -0.01}), 3: (8, {8: -0.01}), 4: (8, {8: -0.01})})
    res = measure_generated(probe, wrong, None)
    assert res.max_abs_diff == math.inf and wrong.calls == [2, 3, 4]
    assert not probe.judge(res).passed


def test_measure_generated_sends_the_cases_together_and_keeps_their_order() -> None:
    """The cases are in flight at once (the engine batches them); the worst case and
    position are reported in the probe's own case order; a case whose request fails
    fails the measurement after the others answered."""
    import threading

    from rolloutcore.errors import EffectError
    from rolloutcore.verification.adapters import measure_generated
    from rolloutcore.verification.probe import PolicyProbe, ProbeCase

    cases = [ProbeCase((1, k), (5, 6), (-0.1, -0.2)) for k in (10, 11, 12)]
    probe = PolicyProbe(cases, tolerance=0.01)
    barrier = threading.Barrier(3, timeout=10)   # only passes with all three in flight

    class Together:
        def __init__(self, fail: int | None = None) -> None:
            self.fail, self.answered = fail, []

        def top_logprobs(self, ctx: list[int], **kw: Any) -> list[tuple[int, dict[int, float]]]:
            barrier.wait()
            if ctx[1] == self.fail:
                raise EffectError("validate_live", "cut")
            self.answered.append(ctx[1])
            off = 0.05 if ctx[1] == 11 else 0.0     # case 1 deviates at its last position
            return [(5, {5: -0.1}), (6, {6: -0.2 - off})]

    res = measure_generated(probe, Together(), None)
    assert res.positions == 6 and res.worst_case == 1 and res.worst_position == 1
    assert math.isclose(res.max_abs_diff, 0.05, abs_tol=1e-9)
    barrier.reset()
    cut = Together(fail=12)
    with pytest.raises(EffectError, match="cut"):
        measure_generated(probe, cut, None)
    assert sorted(cut.answered) == [10, 11]


def test_a_journal_with_adapter_records_checks_and_restores(tmp_path: Path) -> None:
    """The adapter machine writes into the engine's journal: the invariant checker and
    the crash restore read past its records, and the engine's state comes back."""
    from coretools import boot_ev, ident
    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal, read_journal, restore_controller
    from rolloutcore.control.shell import Shell
    from rolloutcore.core.adapters import AdapterView
    from rolloutcore.core.invariants import check_journal

    path = tmp_path / "j.jsonl"
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    c.bootstrap(boot_ev(), ident())
    shell: Shell[AdapterTable, AdapterView] = Shell(AdapterTable(), AdapterTable.view,
                                                    listener=j.listener)
    a = _v(1, "a")
    shell.run(shell.machine.propose, a)
    shell.run(shell.machine.move, a.name, E.LOADED)
    shell.run(shell.machine.move, a.name, E.VERIFIED, evidence=("adapter-probe: ok",))
    c.admit("r1")
    c.complete("r1")
    j.close()
    recs = read_journal(path)
    kinds = [r.kind for r in recs]
    assert kinds.count("adapter") == 3 and "admit" in kinds
    assert check_journal(recs) == []
    c2, j2 = restore_controller(path)
    try:
        assert c2.committed == c.committed and c2.state == c.state
    finally:
        j2.close()


def test_the_gateway_adapter_body_is_checked() -> None:
    from rolloutcore.service.adapter_control import parse_adapter_body

    prov = {"checkpoint": "c", "trainer_run": "r", "step": 3}
    path, p = parse_adapter_body({"adapter_dir": "/a", "provenance": prov})
    assert str(path) == "/a" and p.step == 3 and p.trainer_run == "r"
    for bad, match in (([], "exactly"), ({"adapter_dir": "/a"}, "exactly"),
                       ({"adapter_dir": "", "provenance": prov}, "adapter_dir"),
                       ({"adapter_dir": "/a", "provenance": {"step": 1}}, "checkpoint"),
                       ({"adapter_dir": "/a", "provenance": {**prov, "x": 1}}, "checkpoint"),
                       ({"adapter_dir": "/a", "provenance": {**prov, "step": True}}, "step"),
                       ({"adapter_dir": "/a", "provenance": {**prov, "step": -1}}, "step"),
                       ({"adapter_dir": 5, "provenance": prov}, "adapter_dir")):
        with pytest.raises(BadInput, match=match):
            parse_adapter_body(bad)


def test_the_test_kits_adapter_is_seeded_and_refuses_bad_input(tmp_path: Path) -> None:
    """``testing.models.make_adapter`` (the benchmark's and the engine tests' adapters):
    every projection adapted, B random by seed (the same seed, the same adapter), 0: PEFT's
    own B = 0."""
    pytest.importorskip("peft")
    import torch

    from rolloutcore.testing.models import LORA_TARGETS, make_adapter, make_checkpoint

    ck = make_checkpoint(tmp_path / "base", 1)
    a, b, z = make_adapter(ck, 3), make_adapter(ck, 3), make_adapter(ck, 3, std=0.0)
    bs = {n: p for n, p in a.named_parameters() if "lora_B" in n}
    assert {n.split(".lora_B")[0].rsplit(".", 1)[-1] for n in bs} == set(LORA_TARGETS)
    assert all(p.abs().sum() > 0 for p in bs.values())
    assert all(torch.equal(p, dict(b.named_parameters())[n]) for n, p in bs.items())
    assert all(p.abs().sum() == 0 for n, p in z.named_parameters() if "lora_B" in n)
    for bad in ({"seed": True}, {"seed": "1"}, {"std": -1.0}, {"rank": 0}):
        kw: dict[str, Any] = {"seed": 3, **bad}
        with pytest.raises(BadInput):
            make_adapter(ck, kw.pop("seed"), **kw)


def test_the_adapter_probe_and_the_base_probe_have_their_own_tolerances(tmp_path: Path) -> None:
    """An adapter's probe defaults to ``ADAPTER_TOLERANCE`` (a LoRA engine's extra bf16
    matmuls), the base's beside it to the base's own ``DEFAULT_TOLERANCE``; a tolerance
    outside (0, MAX_TOLERANCE] is refused before a manager exists."""
    from rolloutcore.control.adapters import ADAPTER_TOLERANCE, AdapterManager
    from rolloutcore.verification.probe import DEFAULT_TOLERANCE, MAX_TOLERANCE

    class Http:
        def models(self, **kw: Any) -> dict[str, str | None]:
            return {}

    assert DEFAULT_TOLERANCE < ADAPTER_TOLERANCE < MAX_TOLERANCE
    m = AdapterManager(Http(), object(), base_model=tmp_path, store=tmp_path / "s")
    assert (m.probe_tolerance, m.base_tolerance) == (ADAPTER_TOLERANCE, DEFAULT_TOLERANCE)
    m2 = AdapterManager(Http(), object(), base_model=tmp_path, store=tmp_path / "s2",
                        probe_tolerance=0.05, base_tolerance=0.004)
    assert (m2.probe_tolerance, m2.base_tolerance) == (0.05, 0.004)
    for bad in (0, -0.01, MAX_TOLERANCE * 2, True, "0.01", float("nan")):
        for kw in ("probe_tolerance", "base_tolerance"):
            with pytest.raises(BadInput, match="probe_tolerance"):
                AdapterManager(Http(), object(), base_model=tmp_path,
                               store=tmp_path / "s3", **{kw: bad})
    assert not (tmp_path / "s3").exists()


def test_a_tolerance_above_the_cap_is_taken_only_for_an_adapter_the_probe_can_tell(
        tmp_path: Path) -> None:
    """A manager whose ``max_tolerance`` allows more than ``MAX_TOLERANCE`` (an engine
    measured noisier than that) takes such a tolerance only for an adapter whose
    reference lies ``DISCRIMINATION`` times it away from the base's on the probe's
    tokens: an untrained adapter (B = 0, the base's own policy) is refused before
    anything is written; a trained one is prepared with that distance as evidence.
    Within the cap nothing changes (no distance computed)."""
    from types import SimpleNamespace

    from rolloutcore.control.adapters import DISCRIMINATION, AdapterManager
    from rolloutcore.core.vocab import State
    from rolloutcore.verification.probe import MAX_TOLERANCE, ModelScorer

    class Http:
        def models(self, **kw: Any) -> dict[str, str | None]:
            return {}

    from transformers import AutoModelForCausalLM

    trained = _peft(tmp_path / "t")
    untrained = _peft(tmp_path / "u", zero_b=True)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "t" / "base")
    ctl = SimpleNamespace(state=State.READY, committed=SimpleNamespace(label="v1"),
                          identity=None)
    with pytest.raises(BadInput, match="max_tolerance"):
        AdapterManager(Http(), ctl, base_model=base, store=tmp_path / "bad",
                       max_tolerance=float("inf"))
    # The default manager refuses above the cap, before anything is written; within it
    # no distance is computed.
    m0 = AdapterManager(Http(), ctl, base_model=base, store=tmp_path / "s0")
    with pytest.raises(BadInput, match="probe_tolerance"):
        m0.prepare(trained, Provenance("t", "unit", 1), probe_tolerance=0.1)
    assert not any((tmp_path / "s0").iterdir())
    within = m0.prepare(trained, Provenance("t", "unit", 1), probe_tolerance=MAX_TOLERANCE)
    assert within.effect is None
    # An operator's ceiling of 1 nat: the trained adapter's distance from the base,
    # measured here independently, decides.
    dist = within.probe.measure(ModelScorer(base))
    ok_tol = dist.max_abs_diff / (DISCRIMINATION * 1.05)
    too_loose = dist.max_abs_diff / (DISCRIMINATION * 0.95)
    assert ok_tol > MAX_TOLERANCE, dist   # the test adapter moves the base that far
    m = AdapterManager(Http(), ctl, base_model=base, store=tmp_path / "s", max_tolerance=1.0)
    p = m.prepare(trained, Provenance("t", "unit", 3), probe_tolerance=ok_tol)
    assert p.effect is not None
    assert p.effect.max_abs_diff == pytest.approx(dist.max_abs_diff, rel=1e-4)
    shutil.rmtree(p.version.path)   # prepared, never applied: the same generation next
    with pytest.raises(BadInput, match="cannot tell"):
        m.prepare(trained, Provenance("t", "unit", 4), probe_tolerance=too_loose)
    assert not any((tmp_path / "s").iterdir())
    with pytest.raises(BadInput, match="cannot tell"):
        m.prepare(untrained, Provenance("u", "unit", 5), probe_tolerance=0.2)
    assert not any((tmp_path / "s").iterdir())


def test_the_audit_matches_a_fleet_sample_to_its_own_replicas_publication(
        tmp_path: Path) -> None:
    """A fleet's replicas each publish one adapter name, each on its own base label (a
    rejoined replica's carries a suffix): the journal summary keeps every publication,
    and a sample matches the one on its replica's label; another label, generation or
    content is a mismatch, a name never published is unpublished."""
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.shell import Shell
    from rolloutcore.core.adapters import AdapterView
    from rolloutcore.provenance.adapter_use import AdapterUse, adapter_problems
    from rolloutcore.provenance.audit import read_journal_summary

    d = tmp_path / "fleet"
    d.mkdir()
    for replica, base in (("r0", "fleet-2"), ("r1", "fleet-2.1")):
        j = Journal(d / f"{replica}.jsonl")
        shell: Shell[AdapterTable, AdapterView] = Shell(AdapterTable(), AdapterTable.view,
                                                        listener=j.listener)
        v = _v(1, "a")
        v = AdapterVersion(v.generation, v.name, v.path, v.content_digest, base, v.size_bytes)
        shell.run(shell.machine.propose, v)
        shell.run(shell.machine.move, v.name, E.LOADED)
        shell.run(shell.machine.move, v.name, E.VERIFIED, evidence=("adapter-probe: ok",))
        j.close()
    summary = read_journal_summary(d)
    name, digest = _v(1, "a").name, _v(1, "a").content_digest
    assert summary.adapters[name] == {(1, digest, "fleet-2"), (1, digest, "fleet-2.1")}
    listed = summary.to_dict()["adapters_published"][name]
    assert [x["base"] for x in listed] == ["fleet-2", "fleet-2.1"]
    for base in ("fleet-2", "fleet-2.1"):
        assert adapter_problems(AdapterUse(name, 1, digest, base), summary.adapters) == []
    for bad in (AdapterUse(name, 1, digest, "fleet-3"), AdapterUse(name, 2, digest, "fleet-2"),
                AdapterUse(name, 1, "b" * 64, "fleet-2")):
        ((issue, detail),) = adapter_problems(bad, summary.adapters)
        assert issue == "adapter-mismatch" and "fleet-2.1" in detail
    ((issue, _),) = adapter_problems(AdapterUse("rcl-9-" + "c" * 16, 9, "c" * 64, "fleet-2"),
                                     summary.adapters)
    assert issue == "unpublished-adapter"


def test_probe_scoring_chooses_prompt_logprobs_or_generation_and_refuses_others(
        tmp_path: Path) -> None:
    """``probe_scoring="prompt_logprobs"`` scores each case with one ``score`` call through
    the named model (the adapter's, or None for the base) and says so in the check; the
    default goes through generation (``top_logprobs``); anything else is refused before a
    manager exists."""
    from rolloutcore.control.adapters import PROBE_SCORINGS, AdapterManager
    from rolloutcore.verification.probe import PolicyProbe, ProbeCase

    calls: list[tuple[str, str | None]] = []

    class Http:
        def models(self, **kw: Any) -> dict[str, str | None]:
            return {}

        def score(self, ids: list[int], *, timeout_s: float | None = None,
                  model: str | None = None) -> list[float | None]:
            calls.append(("score", model))
            return [None, -0.5, -0.1, -0.2]

        def top_logprobs(self, ctx: list[int], *, model: str | None = None,
                         **kw: Any) -> list[tuple[int, dict[int, float]]]:
            calls.append(("top_logprobs", model))
            return [(5, {5: -0.1}), (6, {6: -0.2})]

    assert {"generation", "prompt_logprobs"} == PROBE_SCORINGS
    probe = PolicyProbe([ProbeCase((1, 2), (5, 6), (-0.1, -0.2))], tolerance=0.01)
    for bad in ("logprobs", None, ""):
        with pytest.raises(BadInput, match="probe_scoring"):
            AdapterManager(Http(), object(), base_model=tmp_path, store=tmp_path / "x",
                           probe_scoring=bad)   # type: ignore[arg-type]
    m = AdapterManager(Http(), object(), base_model=tmp_path, store=tmp_path / "s",
                       probe_scoring="prompt_logprobs")
    c = m._probe(probe, "rcl-1-aaaa", "probe through the adapter")
    assert calls == [("score", "rcl-1-aaaa")] and c.passed and "(prompt_logprobs)" in c.detail
    calls.clear()
    m.probe_scoring = "generation"
    c = m._probe(probe, None, "probe of the base")
    assert calls == [("top_logprobs", None)] and c.passed and "prompt_logprobs" not in c.detail
