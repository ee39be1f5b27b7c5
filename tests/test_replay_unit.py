"""The replay validator's comparison logic, report and refusals, without an engine.

The lanes against a real engine (a recorded rollout replayed at the same
version, refused after a real hot update, a label changed mid-replay) are in
``tests/engine/test_replay_engine.py``. ``httpx.MockTransport`` stands in
here only for what vLLM 0.32 cannot be made to show: an engine without
``/weight_info`` (vLLM 0.26).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from helpers.trajtools import make_group, make_sample, version
from helpers.vllm_fake import vllm
from rolloutcore.cli import build_parser
from rolloutcore.cli import replay as cli_replay
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.errors import BadInput
from rolloutcore.provenance.recorder import TrajectoryRecorder
from rolloutcore.provenance.replay import (
    DEFAULT_TOLERANCE,
    LaneStatus,
    LogprobLane,
    MismatchPolicy,
    ReplayRefused,
    ReplayReport,
    ReplayValidator,
    SampleReplay,
    SampleStatus,
    TokenLane,
    compare_logprobs,
    compare_tokens,
    record_version_issue,
    replay_file,
    token_lane_reason,
)

# --------------------------------------------------------------------------- token lane


def test_identical_tokens_pass() -> None:
    lane = compare_tokens([1, 2, 3], (1, 2, 3))
    assert lane.status is LaneStatus.PASS and lane.first_mismatch is None
    assert lane.recorded == lane.replayed == 3


def test_first_differing_token_is_reported() -> None:
    lane = compare_tokens([1, 2, 3, 4], [1, 2, 9, 4])
    assert lane.status is LaneStatus.FAIL and lane.first_mismatch == 2
    assert "position 2: recorded 3, replayed 9" in lane.detail


@pytest.mark.parametrize(("rec", "rep", "first"), [([1, 2, 3], [1, 2], 2),
                                                   ([1, 2], [1, 2, 3], 2),
                                                   ([], [5], 0)])
def test_length_differences_fail_at_the_shorter_end(rec: list[int], rep: list[int],
                                                    first: int) -> None:
    lane = compare_tokens(rec, rep)
    assert lane.status is LaneStatus.FAIL and lane.first_mismatch == first
    assert "then the record has" in lane.detail


def test_prefix_mode_accepts_a_longer_replay_of_a_cut_record() -> None:
    assert compare_tokens([1, 2], [1, 2, 3], prefix=True).status is LaneStatus.PASS
    assert compare_tokens([1, 2], [1, 7, 3], prefix=True).first_mismatch == 1
    assert compare_tokens([1, 2, 3], [1, 2], prefix=True).status is LaneStatus.FAIL


def test_token_lane_applies_to_greedy_and_seeded_samples_only() -> None:
    assert token_lane_reason(make_sample(temperature=0.0)) is None
    assert token_lane_reason(make_sample(temperature=1.0, seed=7)) is None
    why = token_lane_reason(make_sample(temperature=0.8, seed=None))
    assert why is not None and "without a seed" in why
    empty = make_sample(tokens=(), temperature=0.0, spans=None)
    assert token_lane_reason(empty) == "no output tokens recorded"


# --------------------------------------------------------------------------- logprob lane


def test_logprobs_within_tolerance_pass_with_statistics() -> None:
    lane = compare_logprobs([-1.0, -2.0, -0.5], [-1.0, -2.01, -0.53], 0.05)
    assert lane.status is LaneStatus.PASS and lane.positions == 3
    assert lane.max_abs_diff == pytest.approx(0.03) and lane.worst_position == 2
    assert lane.mean_abs_diff == pytest.approx(0.04 / 3)
    assert lane.over_tolerance == 0 and lane.first_mismatches == ()


def test_logprobs_over_tolerance_fail_and_name_the_first_positions() -> None:
    rec = [-1.0] * 10
    scored: list[float | None] = [-1.0, -3.0, -1.0, -2.0, -1.5, -1.6, -1.7, -1.8, -1.9, -1.0]
    lane = compare_logprobs(rec, scored, 0.1)
    assert lane.status is LaneStatus.FAIL and lane.over_tolerance == 7
    assert lane.first_mismatches == (1, 3, 4, 5, 6)  # the first five
    assert lane.max_abs_diff == pytest.approx(2.0) and lane.worst_position == 1
    assert "7 of 10 positions differ by more than 0.1 nats" in lane.detail


def test_exactly_at_tolerance_passes() -> None:
    assert compare_logprobs([-1.0], [-1.25], 0.25).status is LaneStatus.PASS


def test_unscored_positions_are_left_out_and_said() -> None:
    lane = compare_logprobs([-1.0, -2.0], [-1.0, None])
    assert lane.status is LaneStatus.PASS and lane.positions == 1
    assert "1 position(s) not scored" in lane.detail
    none = compare_logprobs([-1.0], [None])
    assert none.status is LaneStatus.ERROR and none.max_abs_diff is None


@pytest.mark.parametrize("tol", [-0.1, math.nan, math.inf, True, "0.1"])
def test_bad_tolerance_is_bad_input(tol: Any) -> None:
    with pytest.raises(BadInput, match="tolerance"):
        compare_logprobs([-1.0], [-1.0], tol)


def test_misaligned_or_non_finite_logprobs_are_bad_input() -> None:
    with pytest.raises(BadInput, match="recorded logprobs"):
        compare_logprobs([-1.0, -1.0], [-1.0])
    with pytest.raises(BadInput, match="non-finite"):
        compare_logprobs([-1.0], [-math.inf])


# --------------------------------------------------------------------------- versions


def test_record_at_the_engine_version_has_no_issue() -> None:
    assert record_version_issue(make_sample(bound=version(2)), "rc-2") is None


def test_binding_at_another_version_is_an_issue() -> None:
    why = record_version_issue(make_sample(bound=version(1)), "rc-2")
    assert why == "record bound to 'rc-1', engine serves 'rc-2'"


def test_record_spans_disagreeing_with_its_binding_is_an_issue() -> None:
    s = make_sample(bound=version(2), spans=[("rc-1", 0, 2), ("rc-2", 2, 3)])
    why = record_version_issue(s, "rc-2")
    assert why is not None and "spans name rc-1, rc-2" in why
    # Empty spans (two label changes between tokens) are not a version that sampled.
    ok = make_sample(bound=version(2), spans=[("rc-1", 0, 0), ("rc-2", 0, 3)])
    assert record_version_issue(ok, "rc-2") is None
    assert record_version_issue(make_sample(bound=version(2), spans=None), "rc-2") is None


# --------------------------------------------------------------------------- report


def _row(status: SampleStatus, tok: LaneStatus = LaneStatus.PASS,
         lp: LaneStatus = LaneStatus.PASS, diff: float | None = 0.0) -> SampleReplay:
    return SampleReplay("g", 0, "rc-1", status, TokenLane(tok, "", 3, 3),
                        LogprobLane(lp, "", DEFAULT_TOLERANCE, 3, diff, diff, 0))


def _report(*rows: SampleReplay) -> ReplayReport:
    return ReplayReport("t.jsonl", "http://e", "rc-1", DEFAULT_TOLERANCE,
                        MismatchPolicy.REPORT, rows)


def test_report_ok_needs_a_pass_and_no_failure() -> None:
    assert _report(_row(SampleStatus.PASS)).ok
    # A skipped sample is not verified: a replay that skipped any is not OK (#48).
    skipped = _report(_row(SampleStatus.PASS), _row(SampleStatus.SKIPPED))
    assert not skipped.ok
    assert "NOT VERIFIED (1 of 2 samples skipped" in skipped.format_table().splitlines()[0]
    assert _report(_row(SampleStatus.PASS), _row(SampleStatus.NOT_REPLAYABLE)).ok
    assert not _report(_row(SampleStatus.NOT_REPLAYABLE)).ok
    for bad in (SampleStatus.FAIL, SampleStatus.ERROR, SampleStatus.VERSION_MISMATCH):
        assert not _report(_row(SampleStatus.PASS), _row(bad)).ok


def test_report_dict_and_table() -> None:
    r = _report(_row(SampleStatus.PASS, diff=0.01),
                _row(SampleStatus.FAIL, LaneStatus.FAIL, LaneStatus.FAIL, 2.5))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["ok"] is False and d["counts"]["pass"] == 1 and d["counts"]["fail"] == 1
    assert d["lanes"]["logprob_max_abs_diff"] == 2.5
    assert d["lanes"]["logprob_mean_abs_diff"] == pytest.approx((0.01 * 3 + 2.5 * 3) / 6)
    t = r.format_table()
    assert "FAILED" in t and "1 pass, 1 fail" in t and "fail 2.5/2.5" in t
    assert "max |diff| 2.5" in t
    assert "more samples" in r.format_table(max_rows=1)


# --------------------------------------------------------------------------- validator


def _engine(routes: frozenset[str], seen: list[str]) -> VllmHTTP:
    """The one fake of vLLM serving ``routes`` (its label ``rc-1``); ``seen``: the paths
    it is sent."""
    fake = vllm(only=routes)
    fake.before = lambda req: seen.append(req.url.path)
    return VllmHTTP("http://engine.test", transport=fake.transport())


def test_an_engine_without_a_version_label_is_refused_before_any_request() -> None:
    seen: list[str] = []
    http = _engine(frozenset({Routes.GENERATE, Routes.HEALTH}), seen)  # vLLM 0.26
    with pytest.raises(ReplayRefused, match="no weight version"):
        ReplayValidator(http).replay([make_sample(bound=version(1))])
    assert Routes.GENERATE not in seen and Routes.WEIGHT_INFO not in seen


@pytest.mark.parametrize("policy", list(MismatchPolicy))
def test_samples_all_at_another_version(policy: MismatchPolicy) -> None:
    seen: list[str] = []
    http = _engine(frozenset({Routes.WEIGHT_INFO, Routes.GENERATE}), seen)
    samples = [make_sample(bound=version(2), sample_index=0)]
    v = ReplayValidator(http, policy=policy)
    if policy is MismatchPolicy.REPORT:
        # Reported without a single generation; the report fails.
        r = v.replay(samples)
        assert [s.status for s in r.samples] == [SampleStatus.VERSION_MISMATCH]
        assert not r.ok and "bound to 'rc-2'" in r.samples[0].detail
    else:
        with pytest.raises(ReplayRefused, match="rc-1"):
            v.replay(samples)
    assert Routes.GENERATE not in seen


def test_validator_bad_input() -> None:
    http = _engine(frozenset(), [])
    with pytest.raises(BadInput):
        ReplayValidator("http://x")  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="policy"):
        ReplayValidator(http, policy="ignore")
    with pytest.raises(BadInput, match="tolerance"):
        ReplayValidator(http, tolerance=-1)
    with pytest.raises(BadInput, match="timeout"):
        ReplayValidator(http, timeout_s=0)
    with pytest.raises(BadInput, match="no committed samples"):
        ReplayValidator(http).replay([])
    with pytest.raises(BadInput, match="TrajectorySample"):
        ReplayValidator(http).replay([{"not": "a sample"}])  # type: ignore[list-item]


def test_replay_file_bad_input(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="does not exist"):
        replay_file(tmp_path / "missing.jsonl", "http://127.0.0.1:9")
    empty = tmp_path / "empty.jsonl"
    with TrajectoryRecorder(empty):
        pass
    http = _engine(frozenset({Routes.WEIGHT_INFO}), [])
    with pytest.raises(BadInput, match="is empty"):
        replay_file(empty, http)


def test_cli_parser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser("replay")
    args = parser.parse_args(["replay", "--trajectories", "t.jsonl", "--engine", "http://e"])
    assert args.tolerance == DEFAULT_TOLERANCE and args.on_mismatch == "refuse"
    assert args.func is cli_replay._run and args.checksum_cache is None
    for bad in (["--tolerance", "-1"], ["--tolerance", "nan"], ["--on-mismatch", "ignore"],
                ["--timeout", "0"]):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args(["replay", "--trajectories", "t", "--engine", "http://e", *bad])
        assert exc.value.code == 2
    capsys.readouterr()
    args = parser.parse_args(["replay", "--trajectories", str(tmp_path / "nope.jsonl"),
                              "--engine", "http://127.0.0.1:9"])
    with pytest.raises(BadInput, match="does not exist"):
        args.func(args)
    with pytest.raises(BadInput, match="does not exist"):
        replay_file(tmp_path / "nope.jsonl", "http://127.0.0.1:9")


def test_group_helper_records_are_replay_candidates(tmp_path: Path) -> None:
    """Records written by the recorder come back as the validator reads them."""
    path = tmp_path / "t.jsonl"
    with TrajectoryRecorder(path) as rec:
        rec.append_group(make_group(n=2, bound=version(3)))
    http = _engine(frozenset({Routes.WEIGHT_INFO}), [])
    with pytest.raises(ReplayRefused, match=r"2 of 2 samples .* 'rc-1'"):
        replay_file(path, http)
