"""Audit: version purity against spans/binding/journal, and group diversity vs seed 002."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers.trajtools import IDENTITY, ToyEngine, make_group, make_sample, version
from rolloutcore.cli import build_parser
from rolloutcore.control.journal import Journal
from rolloutcore.core.records import Admit, Commit
from rolloutcore.errors import BadInput
from rolloutcore.provenance.audit import (
    DiversityBaseline,
    DiversityFlag,
    PurityIssue,
    audit_diversity,
    audit_file,
    audit_group,
    audit_purity,
    binomial_tail,
    read_journal_summary,
)
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.trajectory import TrajectoryGroup

# --------------------------------------------------------------------------- diversity


def _groups(seed_mode: str, *, prompts: int = 16, n: int = 8, dp_engines: int = 4,
            short: bool = False, first: int = 0) -> list[TrajectoryGroup]:
    """Groups whose siblings a router spreads round-robin over DP engines.

    Every engine resets its global RNG to the same seed (seed 002's mechanism),
    so unseeded siblings sent to different engines draw the same stream.
    """
    engines = [ToyEngine(global_seed=0) for _ in range(dp_engines)]
    return [make_group(prompt_index=first + p, n=n, seed_mode=seed_mode, engines=engines,
                       short=short) for p in range(prompts)]


def test_colliding_unseeded_streams_are_flagged() -> None:
    report = audit_diversity(_groups("none"))
    t = report.totals()
    assert t["sampling_groups"] == 16 and t["greedy_groups"] == 0
    # 8 siblings over 4 engines in lockstep: 2 distinct answers per group.
    assert all(g.distinct == 2 for g in report.groups)
    assert len(report.flagged) == 16
    for g in report.flagged:
        assert DiversityFlag.IDENTICAL_LONG in g.flags
        assert DiversityFlag.PREFIX_SHARE in g.flags
        assert g.identical_pairs == 12 and g.pairs == 28 and g.unseeded == 8
    assert t["identical_above_baseline"] and t["prefix_above_baseline"]
    assert t["unseeded_samples"] == 128
    assert not report.ok
    text = report.format_table()
    assert "ABOVE baseline" in text and "flagged groups: 16" in text
    assert "carry no seed" in text


def test_derived_seeds_on_the_same_engines_are_clean() -> None:
    report = audit_diversity(_groups("derived"))
    assert report.flagged == ()
    assert all(g.distinct == 8 for g in report.groups)
    t = report.totals()
    assert t["identical_pairs"] == 0 and t["prefix_pairs"] == 0
    assert report.ok
    assert "flagged groups: 0" in report.format_table()


def test_same_seed_for_every_sibling_is_flagged() -> None:
    # verl's full_determinism: each sibling gets the same seed (seed 002: do not).
    report = audit_diversity(_groups("same", prompts=3))
    for g in report.groups:
        assert g.distinct == 1 and g.duplicate_seed_pairs == 28
        assert {DiversityFlag.DUPLICATE_SEED, DiversityFlag.IDENTICAL_LONG} <= set(g.flags)


def test_seed_that_claims_derivation_but_is_not_derived() -> None:
    (g,) = audit_diversity(_groups("wrong", prompts=1)).groups
    assert g.flags == (DiversityFlag.SEED_NOT_DERIVED,)


def test_identical_short_answers_are_baseline_not_flags() -> None:
    report = audit_diversity(_groups("derived", short=True))
    t = report.totals()
    assert t["identical_pairs"] > 0 and t["identical_long_pairs"] == 0
    assert report.flagged == ()
    assert report.ok  # identical short answers alone do not fail the audit
    # ... but they make the aggregate identical fraction exceed 0.1%, which is reported.
    assert t["identical_above_baseline"]


def test_greedy_groups_are_not_screened() -> None:
    engines = [ToyEngine(0)]
    g = make_group(n=4, seed_mode="same", engines=engines, temperature=0.0)
    d = audit_group(g)
    assert d.greedy and d.flags == () and d.distinct == 1
    assert audit_diversity([g]).totals()["greedy_groups"] == 1


def test_prefix_screen_is_a_binomial_tail() -> None:
    # A prefix shared by 3 of 8 siblings (3 pairs of 28) is within a 3% baseline at
    # alpha=1e-3; a stricter alpha flags it, a higher baseline does not.
    toks = [list(range(1, 40)) for _ in range(8)]
    for i in range(8):
        toks[i][16 if i < 3 else 0] = 200 + i  # 0..2 share 16 tokens, then differ
    samples = [make_sample(group_size=8, sample_index=i, tokens=t, seed=i)
               for i, t in enumerate(toks)]
    g = TrajectoryGroup(tuple(samples))
    d = audit_group(g)
    assert (d.prefix_pairs, d.identical_pairs, d.distinct) == (3, 0, 8)
    assert d.prefix_p_value == pytest.approx(binomial_tail(3, 28, 0.03))
    assert DiversityFlag.PREFIX_SHARE not in d.flags
    assert DiversityFlag.PREFIX_SHARE in audit_group(g, DiversityBaseline(alpha=0.1)).flags
    assert audit_group(g, DiversityBaseline(prefix_tokens=17)).prefix_pairs == 0


def test_binomial_tail_matches_exact_sum() -> None:
    for m, p in [(28, 0.03), (120, 0.001), (6, 0.5)]:
        for k in range(0, min(m, 12) + 1):
            exact = sum(math.comb(m, i) * p**i * (1 - p) ** (m - i) for i in range(k, m + 1))
            assert binomial_tail(k, m, p) == pytest.approx(exact, rel=1e-9, abs=1e-300)
    assert binomial_tail(1, 0, 0.5) == 0.0
    assert binomial_tail(0, 0, 0.5) == 1.0
    assert binomial_tail(3, 10, 0.0) == 0.0
    assert 0 < binomial_tail(400, 2_000_000, 0.0001) < 1  # large m stays finite


def test_baseline_validation() -> None:
    with pytest.raises(BadInput):
        DiversityBaseline(prefix_pair_fraction=2.0)
    with pytest.raises(BadInput):
        DiversityBaseline(prefix_tokens=0)


# --------------------------------------------------------------------------- purity

@pytest.fixture
def journal(tmp_path: Path) -> Path:
    """A lifecycle journal written by the controller's own Journal: rc-0, rc-1, rc-2."""
    path = tmp_path / "journal.jsonl"
    j = Journal(path)
    for gen in range(3):
        j.write(Commit(version(gen), IDENTITY))
    j.write(Admit("r-9", version(2), IDENTITY.digest))
    j.close()
    with path.open("a") as f:  # a torn last line must not stop the audit
        f.write('{"seq": 99, "kind": "comm')
    return path


def test_journal_summary(journal: Path) -> None:
    s = read_journal_summary(journal)
    assert s.commits == frozenset({version(0), version(1), version(2)})
    assert s.admissions == {"r-9": version(2)}
    assert (s.lines, s.skipped) == (5, 1)
    with pytest.raises(BadInput, match="does not exist"):
        read_journal_summary(journal.parent / "nope.jsonl")


def _issues(sample: object, j: Path | None) -> set[PurityIssue]:
    summary = read_journal_summary(j) if j else None
    return {f.issue for f in audit_purity([sample], summary).findings}  # type: ignore[list-item]


def test_pure_sample_has_no_findings(journal: Path) -> None:
    s = make_sample(tokens=range(10), bound=version(1))
    r = audit_purity([s], read_journal_summary(journal))
    assert r.ok and r.samples == 1 and r.with_spans == 1


def test_mixed_spans(journal: Path) -> None:
    s = make_sample(tokens=range(10), bound=version(1),
                    spans=[("rc-1", 0, 5), ("rc-2", 5, 10)])
    r = audit_purity([s], read_journal_summary(journal))
    assert {f.issue for f in r.findings} == {PurityIssue.MIXED_VERSIONS,
                                            PurityIssue.BINDING_MISMATCH}
    mixed = next(f for f in r.findings if f.issue is PurityIssue.MIXED_VERSIONS)
    assert mixed.detail == "spans rc-1[0:5) rc-2[5:10)"
    assert r.impure_samples == 1


def test_binding_disagrees_with_engine(journal: Path) -> None:
    s = make_sample(tokens=range(4), bound=version(1), spans=[("rc-2", 0, 4)])
    assert _issues(s, journal) == {PurityIssue.BINDING_MISMATCH}
    assert _issues(s, None) == {PurityIssue.BINDING_MISMATCH}


def test_uncommitted_version(journal: Path) -> None:
    s = make_sample(tokens=range(4), bound=version(3))  # rc-3 never committed
    assert _issues(s, journal) == {PurityIssue.UNCOMMITTED_BINDING,
                                   PurityIssue.UNCOMMITTED_SPAN}
    assert _issues(s, None) == set()  # without a journal that check cannot run
    other_epoch = make_sample(tokens=range(4), bound=version(1, epoch="epoch-b"))
    r = audit_purity([other_epoch], read_journal_summary(journal))
    assert [f.issue for f in r.findings] == [PurityIssue.UNCOMMITTED_BINDING]
    assert "committed on epoch(s) epoch-a" in r.findings[0].detail


def test_admission_recorded_elsewhere(journal: Path) -> None:
    s = make_sample(tokens=range(4), bound=version(1), rollout_id="r-9")
    assert _issues(s, journal) == {PurityIssue.ADMISSION_MISMATCH}
    ok = make_sample(tokens=range(4), bound=version(2), rollout_id="r-9")
    assert _issues(ok, journal) == set()


def test_unverifiable_and_empty_spans(journal: Path) -> None:
    no_spans = make_sample(tokens=range(4), bound=version(1), spans=None)
    # An empty span of another label sampled no token: not a mixture.
    empty = make_sample(tokens=range(3), bound=version(1),
                        spans=[("rc-1", 0, 3), ("rc-2", 3, 3)])
    r = audit_purity([no_spans, empty], read_journal_summary(journal))
    assert r.ok and r.with_spans == 1 and r.without_spans == 1
    assert "1 without (unverifiable)" in r.format_table()


# --------------------------------------------------------------------------- file + CLI

def _cli(argv: list[str]) -> int:
    args = build_parser("audit").parse_args(argv)
    rc: int = args.func(args)
    return rc


def test_audit_file_and_cli(tmp_path: Path, journal: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    clean, dirty = tmp_path / "clean.jsonl", tmp_path / "dirty.jsonl"
    with TrajectoryRecorder(clean) as rec:
        for g in _groups("derived", prompts=4):
            rec.append_group(g)
    with TrajectoryRecorder(dirty) as rec:
        for g in _groups("none", prompts=3):
            rec.append_group(g)
        mixed = make_sample(prompt_index=50, tokens=range(10), bound=version(1),
                            spans=[("rc-1", 0, 5), ("rc-2", 5, 10)])
        rec.append_group(TrajectoryGroup((mixed,)))

    r = audit_file(dirty, journal)
    assert r.purity.samples == 3 * 8 + 1 and not r.ok
    assert [f.issue for f in r.purity.findings] == [PurityIssue.MIXED_VERSIONS,
                                                     PurityIssue.BINDING_MISMATCH]
    assert len(r.diversity.flagged) == 3

    assert _cli(["audit", "--trajectories", str(clean), "--journal", str(journal)]) == 0
    out = capsys.readouterr().out
    assert "audit of" in out and ": OK" in out and "0 samples with findings" in out

    assert _cli(["audit", "--trajectories", str(dirty), "--journal", str(journal)]) == 1
    out = capsys.readouterr().out
    assert "mixed-versions" in out and "identical-long" in out and "FINDINGS" in out

    assert _cli(["audit", "--trajectories", str(dirty), "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is False and doc["purity"]["journal"] is None
    assert doc["purity"]["counts"]["mixed-versions"] == 1
    assert len(doc["diversity"]["flagged"]) == 3


def test_cli_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        _cli(["audit", "--trajectories", str(tmp_path / "missing.jsonl")])
