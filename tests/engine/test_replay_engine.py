"""``rolloutcore replay`` against a real vLLM (CPU, tiny Llama) under RolloutCore control.

One engine for the module, driven by an ``EngineSession``: a real hot update
installs A as ``rc-1`` (probe-verified), a rollout is generated through
``VllmHTTP`` with logprobs and recorded with ``TrajectoryRecorder`` under the
controller's bindings, and replayed at the same version (it must pass, and
the report is printed). A real hot update to B then makes the same replay
refused (nothing sent to the engine, by its own metrics) or reported as a
version mismatch; the lanes themselves, forced against B, show how far apart
the two policies are. An engine relabelled ``rc-1`` while holding B passes
the label check but not the checksum check against A's cold-loaded
reference. Finally the engine's label is changed *during* a replay (through
vLLM's ``/update_weight_version``) and the replay voids what it cannot vouch
for.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.cli import build_parser
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import vllm_available
from rolloutcore.engine.state import engine_identity
from rolloutcore.engine.verify import ChecksumCache, take_reference
from rolloutcore.provenance.recorder import TrajectoryRecorder, read_trajectories
from rolloutcore.provenance.replay import (
    DEFAULT_TOLERANCE,
    LaneStatus,
    MismatchPolicy,
    ReplayRefused,
    ReplayValidator,
    SampleStatus,
    replay_file,
    replay_lanes,
)
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
from rolloutcore.provenance.trajectory import (
    SEED_NONE,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    group_id_for,
)
from rolloutcore.session import EngineSession
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    # The slow lane since #30 (2.5 min of engine start of CI's 45 minutes);
    # tests/test_replay_unit.py is the CI lane's replay.
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

MAX_TOKENS = 24
_rng = random.Random(11)
#: (prompt, mode): greedy siblings; seeded siblings at temperature 1; seeded
#: siblings plus one unseeded (not token-replayable) on a prompt longer than
#: one 128-token KV block.
GROUPS: list[tuple[list[int], str]] = [
    ([_rng.randrange(256) for _ in range(12)], "greedy"),
    ([_rng.randrange(256) for _ in range(60)], "seeded"),
    ([_rng.randrange(256) for _ in range(200)], "mixed"),
]
N = 3


@pytest.fixture(scope="module")
def session(engine_factory: EngineFactory, tiny_models: TinyModels,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineSession]:
    eng = engine_factory(tiny_models.A)  # rolloutcore_gloo weight transfer
    s = EngineSession(VllmHTTP(eng.base_url, timeout_s=120.0), GlooTransport(op_timeout_s=60),
                      engine=eng,
                      journal_path=tmp_path_factory.mktemp("replay") / "journal.jsonl")
    try:
        s.bootstrap(tiny_models.A, Provenance(str(tiny_models.A), "replay-test", 0))
        yield s
    finally:
        try:
            s.close()
        finally:
            engine_factory.stop(eng)


def record_rollout(session: EngineSession, path: Path, *, run: str, step: int,
                   groups: list[tuple[list[int], str]] = GROUPS) -> list[TrajectorySample]:
    """Generate each group through VllmHTTP, admitted by the controller, and record it."""
    http, ctl = session.http, session.controller
    ident = engine_identity(http)
    out: list[TrajectorySample] = []
    with TrajectoryRecorder(path, lock_timeout_s=5) as rec:
        for p, (prompt, mode) in enumerate(groups):
            gid = group_id_for(run, step, p)
            samples = []
            for i in range(N):
                unseeded = mode == "mixed" and i == N - 1
                temp = 0.0 if mode == "greedy" else 1.0
                seed = None if unseeded else derive_seed(run, step, gid, i)
                rid = f"{gid}/{i}"
                b = ctl.admit(rid)
                w0, m0 = time.time(), time.monotonic()
                g = http.generate(prompt, max_tokens=MAX_TOKENS, temperature=temp, seed=seed,
                                  logprobs=True)
                ctl.complete(rid)
                assert g.logprobs is not None and g.weight_versions is not None
                samples.append(TrajectorySample(
                    run, step, gid, p, N, i, Prompt(tuple(prompt)),
                    SamplingSpec(temp, 1.0, -1, MAX_TOKENS, seed,
                                 SEED_NONE if seed is None else SEED_DERIVATION,
                                 {"logprobs": 0}),
                    SampledCompletion(g.token_ids, g.finish_reason or "length", g.logprobs,
                                      None, tuple(VersionSpan(s.version, s.start, s.end)
                                                  for s in g.weight_versions)),
                    b, ident,
                    Timestamps(w0, m0, time.time(), time.monotonic())))
            group = TrajectoryGroup(tuple(samples))
            rec.append_group(group)
            out += group.samples
    return out


def cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    args = build_parser("replay").parse_args(["replay", *argv])
    capsys.readouterr()
    rc: int = args.func(args)
    return rc, capsys.readouterr().out


def prompt_tokens_total(http: VllmHTTP) -> float:
    v = http.metrics().get("vllm:prompt_tokens_total")
    assert v is not None
    return v


@pytest.fixture(scope="module")
def cold_cache(session: EngineSession, tiny_models: TinyModels,
               tmp_path_factory: pytest.TempPathFactory) -> ChecksumCache:
    """A's engine checksums from this engine's cold load (nothing has updated it yet)."""
    assert session.http.label() == "default"
    cache = ChecksumCache(tmp_path_factory.mktemp("replay-cache"))
    cache.put(take_reference(
        session.http, WeightSource.from_checkpoint(tiny_models.A).content_digest(),
        origin="cold-load", source=str(tiny_models.A)))
    return cache


@pytest.fixture(scope="module")
def recorded(session: EngineSession, cold_cache: ChecksumCache, tiny_models: TinyModels,
             tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A rollout recorded at rc-1 = A, installed by a real, probe-verified hot update."""
    res = session.update(tiny_models.A, Provenance(str(tiny_models.A), "replay-test", 1))
    assert res.version.label == "rc-1"
    assert res.identity.verification is VerificationLevel.PROBE
    path = tmp_path_factory.mktemp("replay-traj") / "rc1.jsonl"
    samples = record_rollout(session, path, run="replay-a", step=1)
    assert {s.binding.version.label for s in samples} == {"rc-1"}
    assert all(s.completion.span_versions == ("rc-1",) for s in samples)
    return path


def test_recorded_rollout_replays_within_tolerance_at_the_same_version(
        session: EngineSession, recorded: Path, cold_cache: ChecksumCache,
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = cli(["--trajectories", str(recorded), "--engine", session.http.base_url],
                   capsys)
    with capsys.disabled():
        print(f"\n{text}")
    assert rc == 0, text
    report = replay_file(recorded, session.http.base_url)
    assert report.ok and report.engine_label == "rc-1"
    by_status = report.counts()
    assert by_status["pass"] == len(GROUPS) * N
    token = [s.token.status for s in report.samples]
    # Every greedy and seeded sample was regenerated exactly; the unseeded one cannot be.
    assert token.count(LaneStatus.PASS) == len(GROUPS) * N - 1
    assert token.count(LaneStatus.NOT_APPLICABLE) == 1
    for s in report.samples:
        assert s.logprob.status is LaneStatus.PASS
        assert s.logprob.positions == MAX_TOKENS or s.token.recorded < MAX_TOKENS
        assert s.logprob.max_abs_diff is not None
        assert s.logprob.max_abs_diff <= DEFAULT_TOLERANCE
    d = json.loads(cli(["--trajectories", str(recorded), "--engine", session.http.base_url,
                        "--json"], capsys)[1])
    assert d["ok"] is True and d["lanes"]["logprob_positions"] > 0
    assert d["lanes"]["logprob_max_abs_diff"] <= DEFAULT_TOLERANCE

    # With the checksum cache the engine's weights are checked too, not only its label.
    verified = replay_file(recorded, session.http.base_url, checksum_cache=cold_cache.root)
    assert verified.ok
    (w,) = verified.weights
    assert w.status == "verified" and w.coverage is not None and 0 < w.coverage <= 1


def test_after_a_hot_update_the_replay_is_refused_or_reported(
        session: EngineSession, recorded: Path, cold_cache: ChecksumCache,
        tiny_models: TinyModels, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = session.update(tiny_models.B, Provenance(str(tiny_models.B), "replay-test", 2))
    assert res.version.label == "rc-2"
    http = session.http
    url = http.base_url

    before = prompt_tokens_total(http)
    with pytest.raises(ReplayRefused, match=r"9 of 9 samples .*'rc-2'.*bound to 'rc-1'"):
        replay_file(recorded, url)
    with pytest.raises(ReplayRefused):
        cli(["--trajectories", str(recorded), "--engine", url], capsys)
    assert prompt_tokens_total(http) == before  # nothing was sent to the engine

    rc, text = cli(["--trajectories", str(recorded), "--engine", url,
                    "--on-mismatch", "report"], capsys)
    with capsys.disabled():
        print(f"\n{text}")
    assert rc == 1
    report = replay_file(recorded, url, policy=MismatchPolicy.REPORT)
    assert not report.ok
    assert {s.status for s in report.samples} == {SampleStatus.VERSION_MISMATCH}
    assert all("bound to 'rc-1', engine serves 'rc-2'" in s.detail for s in report.samples)
    assert prompt_tokens_total(http) == before

    # The engine relabelled 'rc-1' while holding B: the label check passes, the
    # checksums against A's cold-loaded reference do not.
    relabel(session, "rc-1")
    try:
        with pytest.raises(ReplayRefused, match="checksums differ"):
            replay_file(recorded, url, checksum_cache=cold_cache)
        lying = replay_file(recorded, url, checksum_cache=cold_cache, policy="report")
        assert {s.status for s in lying.samples} == {SampleStatus.VERSION_MISMATCH}
        assert lying.weights[0].status == "mismatch"
        assert "lm_head" in lying.weights[0].detail
        assert prompt_tokens_total(http) == before
    finally:
        relabel(session, "rc-2")

    # A file holding both versions: 'skip' replays what is at the engine's version.
    mixed = tmp_path / "mixed.jsonl"
    with TrajectoryRecorder(mixed) as rec:
        for g in _groups(recorded):
            rec.append_group(g)
    record_rollout(session, mixed, run="replay-b", step=2, groups=GROUPS[:1])
    skip = replay_file(mixed, url, policy="skip")
    assert not skip.ok   # the skipped samples are not verified (#48)
    assert skip.counts()["skipped"] == len(GROUPS) * N and skip.counts()["pass"] == N

    # The lanes, forced past the version check: B does not reproduce A's rollout.
    diffs = []
    token_fail = 0
    for s in read_trajectories(recorded):
        tok, lp, seen = replay_lanes(http, s)
        assert seen <= {"rc-2"}
        token_fail += tok.status is LaneStatus.FAIL
        assert lp.status is LaneStatus.FAIL and lp.max_abs_diff is not None
        diffs.append(lp.max_abs_diff)
    with capsys.disabled():
        print(f"\nA's rollout re-scored on B: max |logprob diff| per sample "
              f"min {min(diffs):.2f}, max {max(diffs):.2f} nats "
              f"(tolerance {DEFAULT_TOLERANCE}); token lane failed on {token_fail} of "
              f"{len(diffs) - 1} reproducible samples")
    assert min(diffs) > 4 * DEFAULT_TOLERANCE  # measured: min 0.42 nats
    assert token_fail >= len(diffs) - 2  # a short greedy run may agree by chance


def relabel(session: EngineSession, label: str) -> None:
    """vLLM's own ``/update_weight_version``: the label changes, the weights do not."""
    r = httpx.post(f"{session.http.base_url}/update_weight_version",
                   json={"new_version": label}, timeout=60)
    r.raise_for_status()
    assert session.http.label() == label


def _groups(path: Path) -> list[TrajectoryGroup]:
    from rolloutcore.provenance.recorder import read_groups

    return list(read_groups(path))


class _DriftingHTTP(VllmHTTP):
    """A real client that, after the first scoring, relabels the real engine.

    This is the engine changing under a replay (another controller, an
    operator): vLLM's own ``/update_weight_version`` does it.
    """

    def __init__(self, base_url: str, new_label: str) -> None:
        super().__init__(base_url, timeout_s=120.0)
        self.new_label = new_label
        self.scored = 0

    def score(self, token_ids: Any, **kw: Any) -> list[float | None]:
        out = super().score(token_ids, **kw)
        self.scored += 1
        if self.scored == 1:
            r = httpx.post(f"{self.base_url}/update_weight_version",
                           json={"new_version": self.new_label}, timeout=60)
            r.raise_for_status()
        return out


def test_a_label_change_during_the_replay_voids_the_rest(
        session: EngineSession, tmp_path: Path) -> None:
    committed = session.controller.committed
    assert committed is not None
    path = tmp_path / "drift.jsonl"
    record_rollout(session, path, run="replay-drift", step=3, groups=GROUPS[:2])
    drifting = _DriftingHTTP(session.http.base_url, "rc-drift")
    try:
        report = ReplayValidator(drifting).replay(list(read_trajectories(path)))
    finally:
        drifting.close()
        relabel(session, committed.label)
    assert not report.ok
    first, *rest = report.samples
    assert first.status is SampleStatus.VERSION_MISMATCH
    assert "changed during this sample" in first.detail and "rc-drift" in first.detail
    assert rest and all(s.status is SampleStatus.VERSION_MISMATCH for s in rest)
    assert all("changed to 'rc-drift'" in s.detail for s in rest)
    assert any("rc-drift" in n for n in report.notes)
