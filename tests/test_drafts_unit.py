"""Speculative-decoding drafts, the parts that need no engine.

The pair's identity (``policy_digest``, ``DraftedSource``), the combined
check, the up-front refusal of a target-only update (asserted against a
session whose engine URL answers nothing: any I/O would raise something
else), the acceptance arithmetic and every public entry's bad input.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput, TransferError, UpdateRefused
from rolloutcore.session import DraftedSession, DraftSpec, EngineSession
from rolloutcore.transports.drafted import (
    DRAFT_REFUSAL,
    DraftedGlooTransport,
    DraftedSource,
    combine_checks,
    policy_digest,
    refusal,
)
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.acceptance import (
    ACCEPTED,
    DRAFTED,
    AcceptanceProbe,
    AcceptanceSample,
    acceptance_between,
    default_acceptance_prompts,
)

H1, H2, H3 = "1" * 64, "2" * 64, "3" * 64
DEAD = "http://127.0.0.1:9"  # discard port: nothing answers


def _state(seed: int, n: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"w{i}": torch.randn(4, 2, generator=g) for i in range(n)}


def _pair(t: int = 1, d: int = 2) -> DraftedSource:
    return DraftedSource(WeightSource.from_state_dict(_state(t)),
                         WeightSource.from_state_dict(_state(d, n=2)))


# --------------------------------------------------------------------------- identity

def test_policy_digest_names_both_in_their_roles() -> None:
    a = policy_digest(H1, H2, H3)
    assert a == policy_digest(H1, H2, H3) and len(a) == 64
    assert a != policy_digest(H2, H1, H3)  # swapping target and draft is another policy
    assert a != policy_digest(H1, H2, H1)


@pytest.mark.parametrize("bad", ["", "x" * 64, "1" * 63, None, 5, "A" * 64])
def test_policy_digest_refuses_what_is_not_a_digest(bad: Any) -> None:
    with pytest.raises(BadInput):
        policy_digest(bad, H2, H3)
    with pytest.raises(BadInput):
        policy_digest(H1, bad, H3)
    with pytest.raises(BadInput):
        policy_digest(H1, H2, bad)


def test_drafted_source_sends_the_target_and_digests_both() -> None:
    p = _pair()
    t, d = p.target, p.draft
    assert p.manifest() == t.manifest()
    got = dict(p.named_tensors())
    assert list(got) == list(dict(t.named_tensors()))
    assert all(torch.equal(got[k], v) for k, v in t.named_tensors())
    assert p.content_digest() == policy_digest(t.content_digest(), d.content_digest(),
                                               d.manifest().digest)
    parts = p.parts()
    assert parts["target_content_digest"] == t.content_digest()
    assert parts["draft_content_digest"] == d.content_digest()
    assert parts["content_digest"] == p.content_digest()
    # Another draft, the same target: another pair.
    assert _pair(1, 3).content_digest() != p.content_digest()
    assert _pair(1, 2).content_digest() == p.content_digest()


def test_drafted_source_refuses_bad_parts() -> None:
    s = WeightSource.from_state_dict(_state(1))
    for target, draft in [(s, None), (None, s), (s, s), (_pair(), s), (s, _pair()),
                          ({"w": torch.zeros(1)}, s)]:
        with pytest.raises(BadInput):
            DraftedSource(target, draft)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- checks

def _chk(passed: bool, level: VerificationLevel | None, cov: float | None) -> Check:
    return Check("worker_shard_checksum", passed, "d", coverage=cov, level=level)


def test_combine_checks_takes_the_weaker_of_the_two() -> None:
    e = VerificationLevel.ENGINE_CHECKSUM
    both = combine_checks(_chk(True, e, 1.0), _chk(True, e, 0.5))
    assert both.passed and both.level is e and both.coverage == 0.5
    assert both.detail == "target: d; draft: d"
    assert not combine_checks(_chk(True, e, 1.0), _chk(False, e, 1.0)).passed
    assert not combine_checks(_chk(False, e, 1.0), _chk(True, e, 1.0)).passed
    none = combine_checks(_chk(True, e, 1.0), _chk(True, None, None))
    assert none.passed and none.level is None and none.coverage is None
    with pytest.raises(BadInput):
        combine_checks(_chk(True, e, 1.0), "draft")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- refusal

def test_refusal_is_for_a_drafted_transport_and_a_plain_source() -> None:
    plain = WeightSource.from_state_dict(_state(1))
    tr = DraftedGlooTransport()
    assert refusal(tr, plain) == DRAFT_REFUSAL
    assert refusal(tr, _pair()) is None
    assert refusal(DraftedGlooTransport(require_draft=False), plain) is None
    assert refusal(GlooTransport(), plain) is None
    assert refusal(object(), plain) is None


def test_drafted_transport_refuses_a_plain_source_before_connecting() -> None:
    tr = DraftedGlooTransport()
    with pytest.raises(TransferError, match="no draft weights") as ei:
        tr.send(DEAD, "v1", WeightSource.from_state_dict(_state(1)), timeout_s=5)
    assert ei.value.mutation_started is False
    assert tr.connected_to is None and tr.last_phases == {}
    with pytest.raises(BadInput):
        DraftedGlooTransport(require_draft="yes")  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        tr.send(DEAD, "v1", WeightSource.from_state_dict(_state(1)), timeout_s=5,
                draft="yes")  # type: ignore[arg-type]


def _dead_session(tmp_path: Path, transport: Any) -> EngineSession:
    return EngineSession(VllmHTTP(DEAD, timeout_s=2.0), transport,
                         engine_epoch="e1", journal_path=tmp_path / "j.jsonl")


def test_target_only_update_refused_before_any_io(tmp_path: Path) -> None:
    s = _dead_session(tmp_path, DraftedGlooTransport())
    try:
        ds = DraftedSession(s)
        state = s.controller.state
        prov = Provenance("ckpt", "run", 1)
        with pytest.raises(UpdateRefused, match="no draft weights"):
            ds.update(_state(1), prov)
        with pytest.raises(UpdateRefused, match="no draft weights"):
            s.update(_state(1), prov, probe=False)
        with pytest.raises(UpdateRefused, match="no draft weights"):
            ds.apply(s.prepare(_state(1), prov, probe=False))
        assert s.controller.state is state and s.controller.committed is None
        assert s.transport.connected_to is None
    finally:
        s.http.close()
        s.journal.close()


def test_drafted_session_refuses_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput):
        DraftedSession("session")  # type: ignore[arg-type]
    for tr in (GlooTransport(), DraftedGlooTransport(require_draft=False)):
        s = _dead_session(tmp_path, tr)
        try:
            with pytest.raises(BadInput, match="DraftedGlooTransport"):
                DraftedSession(s)
        finally:
            s.http.close()
            s.journal.close()
    s = _dead_session(tmp_path, DraftedGlooTransport())
    try:
        with pytest.raises(BadInput):
            DraftedSession(s, min_acceptance=1.5)
        ds = DraftedSession(s)
        state = s.controller.state
        with pytest.raises(BadInput):
            ds.update(_state(1), "prov", draft_weights=_state(2))  # type: ignore[arg-type]
        with pytest.raises(BadInput):
            ds.update(_state(1), Provenance("c", "r", 1), draft_weights=_state(2),
                      probe="yes")  # type: ignore[arg-type]
        with pytest.raises(BadInput):
            ds.update(_state(1), Provenance("c", "r", 1), draft_weights=42)
        assert s.controller.state is state and s.controller.committed is None
        assert s.transport.connected_to is None
    finally:
        s.http.close()
        s.journal.close()


# --------------------------------------------------------------------------- spec

def test_draft_spec_builds_the_speculative_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    spec = DraftSpec(tmp_path, num_speculative_tokens=4)
    flag, body = spec.engine_args()
    assert flag == "--speculative-config"
    assert json.loads(body) == {"method": "draft_model", "model": str(tmp_path.resolve()),
                                "num_speculative_tokens": 4}
    _, body = DraftSpec(tmp_path, method="eagle").engine_args()
    assert json.loads(body)["method"] == "eagle"


@pytest.mark.parametrize("kw", [{"num_speculative_tokens": 0},
                                {"num_speculative_tokens": 17},
                                {"num_speculative_tokens": True},
                                {"method": "eagle3"}, {"method": "ngram"},
                                {"method": "mtp"}])
def test_draft_spec_refuses_bad_input(tmp_path: Path, kw: dict[str, Any]) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(BadInput):
        DraftSpec(tmp_path, **kw)


def test_draft_spec_needs_a_checkpoint_dir(tmp_path: Path) -> None:
    for bad in (tmp_path, tmp_path / "missing", 5, None):
        with pytest.raises(BadInput):
            DraftSpec(bad)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- acceptance

def test_acceptance_between_two_scrapes() -> None:
    s = acceptance_between({DRAFTED: 10.0, ACCEPTED: 4.0}, {DRAFTED: 30.0, ACCEPTED: 19.0})
    assert (s.drafted, s.accepted, s.rate) == (20.0, 15.0, 0.75)
    # Counters absent before the first speculative step start at zero.
    assert acceptance_between({}, {DRAFTED: 6.0, ACCEPTED: 6.0}).rate == 1.0
    assert acceptance_between({DRAFTED: 3.0, ACCEPTED: 1.0},
                              {DRAFTED: 3.0, ACCEPTED: 1.0}).rate is None


@pytest.mark.parametrize("before, after", [
    ({}, {}),                                               # no draft on this engine
    ({}, {DRAFTED: 5.0}),
    ({DRAFTED: 9.0, ACCEPTED: 1.0}, {DRAFTED: 5.0, ACCEPTED: 1.0}),  # another process
    ({DRAFTED: 1.0, ACCEPTED: 1.0}, {DRAFTED: 2.0, ACCEPTED: 5.0}),  # accepted > drafted
    ("x", {}), ({}, None),
])
def test_acceptance_between_refuses_what_cannot_be_a_window(before: Any, after: Any) -> None:
    with pytest.raises(BadInput):
        acceptance_between(before, after)


@pytest.mark.parametrize("d, a", [(-1.0, 0.0), (1.0, 2.0), (math.nan, 0.0),
                                  (math.inf, 1.0), (True, 0)])
def test_acceptance_sample_refuses_bad_counts(d: Any, a: Any) -> None:
    with pytest.raises(BadInput):
        AcceptanceSample(d, a)


def test_acceptance_probe_judges_against_its_minimum() -> None:
    prompts = default_acceptance_prompts(259)
    assert len(prompts) == 4 and all(0 <= t < 256 for p in prompts for t in p)
    assert prompts == default_acceptance_prompts(259)
    gate = AcceptanceProbe(prompts, min_acceptance=0.5)
    assert gate.judge(AcceptanceSample(100, 90)).passed
    assert not gate.judge(AcceptanceSample(100, 10)).passed
    assert not gate.judge(AcceptanceSample(0, 0)).passed  # no evidence is no pass
    rec = AcceptanceProbe(prompts)
    assert rec.judge(AcceptanceSample(100, 0)).passed  # recorded, not required
    assert "0 of 100" in rec.judge(AcceptanceSample(100, 0)).detail


@pytest.mark.parametrize("kw", [{"prompts": []}, {"prompts": "abc"}, {"prompts": [[]]},
                                {"prompts": [[1, -1]]}, {"prompts": [[True]]},
                                {"max_tokens": 0}, {"max_tokens": 5000},
                                {"min_acceptance": 0}, {"min_acceptance": 1.1},
                                {"min_acceptance": True}, {"timeout_s": 0}])
def test_acceptance_probe_refuses_bad_input(kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"prompts": [[1, 2, 3]], **kw}
    prompts = args.pop("prompts")
    with pytest.raises(BadInput):
        AcceptanceProbe(prompts, **args)


@pytest.mark.parametrize("args", [(1,), (259, 0), (259, 4, 0), (True,)])
def test_default_acceptance_prompts_refuse_bad_input(args: tuple[Any, ...]) -> None:
    with pytest.raises(BadInput):
        default_acceptance_prompts(*args)


def test_gloo_keeps_a_draft_round_apart_from_the_target_round() -> None:
    from rolloutcore.transports.gloo import _round_key

    assert _round_key("http://e:1", False) == "http://e:1"
    assert _round_key("http://e:1", True) != _round_key("http://e:1", False)
    tr = GlooTransport()
    for draft in (False, True):  # nothing sent yet: a pass that establishes nothing
        chk = tr.validation_check(DEAD, draft=draft)
        assert chk.passed and chk.level is None and chk.coverage == 0.0
    drafted = DraftedGlooTransport()
    chk = drafted.validation_check(DEAD)  # no pair sent: the target's check alone
    assert chk.level is None and "draft" not in chk.detail


def test_drafted_source_reads_a_changing_draft_again() -> None:
    draft = _state(2, n=2)
    p = DraftedSource(WeightSource.from_state_dict(_state(1)),
                      WeightSource.from_state_dict(draft))
    first = p.parts()
    assert first["content_digest"] == p.content_digest()
    draft["w0"].add_(1.0)  # the trainer's draft moved in place
    second = p.content_digest()
    assert second != first["content_digest"]
    assert p.parts()["content_digest"] == second
    assert p.parts()["target_content_digest"] == first["target_content_digest"]
