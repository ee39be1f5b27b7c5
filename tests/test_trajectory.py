"""The trajectory schema: validation in constructors, exact JSON round trips, versioning."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.trajtools import ENGINE, IDENTITY, make_group, make_sample
from rolloutcore.core.versions import Binding, WeightVersion
from rolloutcore.errors import BadInput
from rolloutcore.provenance.seeds import SEED_DERIVATION
from rolloutcore.provenance.trajectory import (
    SCHEMA_VERSION,
    SEED_EXTERNAL,
    SEED_NONE,
    EngineIdentity,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    check_schema_version,
    group_id_for,
    prompt_digest,
)


def _roundtrip(s: TrajectorySample) -> TrajectorySample:
    return TrajectorySample.from_dict(json.loads(json.dumps(s.to_dict())))


# --------------------------------------------------------------------------- strategies

_ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,20}", fullmatch=True)
_tok = st.integers(0, 300_000)
_finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
_json_scalar = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _finite | st.text(
    max_size=8)
_json = st.recursive(_json_scalar, lambda c: st.lists(c, max_size=3)
                     | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=8)


@st.composite
def _spans(draw: st.DrawFn, n: int) -> tuple[VersionSpan, ...] | None:
    if draw(st.booleans()):
        return None
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
    bounds = [0, *cuts, n]
    if n == 0 and draw(st.booleans()):
        return ()
    return tuple(VersionSpan(draw(st.sampled_from(["rc-1", "rc-2", "default"])), a, b)
                 for a, b in itertools.pairwise(bounds))


@st.composite
def samples(draw: st.DrawFn) -> TrajectorySample:
    toks = tuple(draw(st.lists(_tok, max_size=20)))
    lps = draw(st.none() | st.lists(_finite, min_size=len(toks), max_size=len(toks)))
    seed_kind = draw(st.sampled_from([SEED_DERIVATION, SEED_EXTERNAL, SEED_NONE]))
    seed = None if seed_kind == SEED_NONE else draw(st.integers(-(2**63), 2**64 - 1))
    n = draw(st.integers(1, 8))
    run, step, pidx = draw(_ids), draw(st.integers(0, 10**6)), draw(st.integers(0, 10**6))
    t0 = draw(st.floats(0, 1e9))
    dt = draw(st.floats(0, 1e4))
    return TrajectorySample(
        run=run, step=step, group_id=group_id_for(run, step, pidx), prompt_index=pidx,
        group_size=n, sample_index=draw(st.integers(0, n - 1)),
        prompt=Prompt(tuple(draw(st.lists(_tok, min_size=1, max_size=20)))),
        sampling=SamplingSpec(
            draw(st.floats(0, 5)), draw(st.floats(1e-6, 1)), draw(st.integers(-1, 100)),
            draw(st.none() | st.integers(1, 4096)), seed, seed_kind,
            draw(st.dictionaries(st.sampled_from(["logprobs", "min_p", "stop", "n"]), _json,
                                 max_size=3))),
        completion=SampledCompletion(
            toks, draw(st.sampled_from(["stop", "length", "abort"])),
            None if lps is None else tuple(lps),
            draw(st.none() | st.integers(0, 10) | st.text(min_size=1, max_size=4)),
            draw(_spans(len(toks)))),
        binding=Binding(WeightVersion(draw(st.integers(0, 50)), draw(_ids), "ep-1"),
                        IDENTITY, draw(st.none() | _ids)),
        engine=EngineIdentity("0.32.0", draw(_ids), draw(st.dictionaries(st.text(max_size=5),
                                                                         _json, max_size=4)),
                              draw(st.text(max_size=10))),
        timestamps=Timestamps(t0, t0, t0 + dt, t0 + dt))


@settings(max_examples=60, deadline=None)
@given(samples())
def test_sample_roundtrip_is_exact(s: TrajectorySample) -> None:
    back = _roundtrip(s)
    assert back == s
    assert back.encode() == s.encode()
    assert back.to_dict() == s.to_dict()


@settings(max_examples=25, deadline=None)
@given(samples())
def test_roundtrip_through_canonical_line(s: TrajectorySample) -> None:
    line = s.encode()
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert TrajectorySample.from_dict(json.loads(line)) == s


# --------------------------------------------------------------------------- versioning

def test_schema_version_is_checked_first() -> None:
    d = make_sample().to_dict()
    d["schema_version"] = SCHEMA_VERSION + 1
    d["new_field_from_the_future"] = 1
    with pytest.raises(BadInput, match=f"schema_version {SCHEMA_VERSION + 1}, newer than"):
        TrajectorySample.from_dict(d)
    d["schema_version"] = 0
    with pytest.raises(BadInput, match="unknown schema_version 0"):
        TrajectorySample.from_dict(d)
    del d["schema_version"]
    with pytest.raises(BadInput, match="no schema_version"):
        TrajectorySample.from_dict(d)
    with pytest.raises(BadInput, match="unreadable schema_version"):
        check_schema_version({"schema_version": "1"})


def test_unknown_and_missing_keys_are_refused() -> None:
    d = make_sample().to_dict()
    d["completion"]["extra_field"] = 1
    with pytest.raises(BadInput, match=r"completion: unknown keys \['extra_field'\]"):
        TrajectorySample.from_dict(d)
    d = make_sample().to_dict()
    del d["timestamps"]["admitted_mono"]
    with pytest.raises(BadInput, match="timestamps: missing keys"):
        TrajectorySample.from_dict(d)
    d = make_sample().to_dict()
    d["record"] = "commit"
    with pytest.raises(BadInput, match="not a sample record"):
        TrajectorySample.from_dict(d)


# --------------------------------------------------------------------------- validation

def test_prompt_digest_is_sha256_of_compact_json() -> None:
    import hashlib

    assert prompt_digest([1, 2, 3]) == hashlib.sha256(b"[1,2,3]").hexdigest()
    p = Prompt((1, 2, 3))
    assert p.digest == prompt_digest([1, 2, 3])
    with pytest.raises(BadInput, match="does not match"):
        Prompt((1, 2, 3), prompt_digest([1, 2, 4]))
    with pytest.raises(BadInput, match="must not be empty"):
        Prompt(())
    with pytest.raises(BadInput, match=r"token_ids\[1\]"):
        Prompt((1, -2))
    with pytest.raises(BadInput):
        Prompt((1, True))  # type: ignore[arg-type]


def test_completion_validation() -> None:
    with pytest.raises(BadInput, match="2 entries for 3 output tokens"):
        SampledCompletion((1, 2, 3), "stop", (-0.1, -0.2))
    with pytest.raises(BadInput, match="finite"):
        SampledCompletion((1,), "stop", (math.nan,))
    with pytest.raises(BadInput, match="finite"):
        SampledCompletion((1,), "stop", (-math.inf,))
    with pytest.raises(BadInput, match="finish_reason"):
        SampledCompletion((1,), "")
    with pytest.raises(BadInput, match="stop_reason"):
        SampledCompletion((1,), "stop", None, 1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("spans", "n", "msg"), [
    ([("rc-1", 1, 3)], 3, "must start at token 0"),
    ([("rc-1", 0, 2), ("rc-2", 3, 4)], 4, "not contiguous"),
    ([("rc-1", 0, 2)], 3, "end at 2, but there are 3"),
    ([("rc-1", 0, 4)], 3, "end at 4, but there are 3"),
    ([], 2, "empty but there are 2"),
])
def test_bad_spans(spans: list[tuple[str, int, int]], n: int, msg: str) -> None:
    with pytest.raises(BadInput, match=msg):
        SampledCompletion(tuple(range(n)), "stop", None, None,
                          tuple(VersionSpan(*s) for s in spans))


def test_spans_as_vllm_builds_them() -> None:
    # vLLM: no label and no tokens -> []; a label before any token -> [(v, 0, 0)];
    # two label changes between tokens -> an empty span in the middle.
    assert SampledCompletion((), "abort", None, None, ()).span_versions == ()
    assert SampledCompletion((), "abort", None, None,
                             (VersionSpan("rc-1", 0, 0),)).span_versions == ()
    c = SampledCompletion((1, 2, 3), "stop", None, None,
                          (VersionSpan("rc-1", 0, 2), VersionSpan("rc-2", 2, 2),
                           VersionSpan("rc-3", 2, 3)))
    assert c.span_versions == ("rc-1", "rc-3")
    assert SampledCompletion((1,), "stop").span_versions is None
    with pytest.raises(BadInput, match="before it starts"):
        VersionSpan("rc-1", 3, 2)
    with pytest.raises(BadInput, match="not a VersionSpan"):
        SampledCompletion((1,), "stop", None, None, ({"version": "rc-1"},))  # type: ignore


def test_sampling_validation_and_vllm_params() -> None:
    s = SamplingSpec(0.7, 0.9, 50, 32, 123, SEED_EXTERNAL, {"logprobs": 0})
    assert s.to_vllm() == {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "max_tokens": 32,
                           "seed": 123, "logprobs": 0}
    assert not s.greedy and SamplingSpec(0.0).greedy
    for bad, msg in [
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(temperature=math.inf), "finite"),
        (dict(temperature=1.0, top_p=0.0), "top_p"),
        (dict(temperature=1.0, top_k=-2), "top_k"),
        (dict(temperature=1.0, max_tokens=0), "max_tokens"),
        (dict(temperature=1.0, seed=5), "disagree"),
        (dict(temperature=1.0, seed_derivation=SEED_EXTERNAL), "disagree"),
        (dict(temperature=1.0, seed=2**64, seed_derivation=SEED_EXTERNAL), "seed"),
        (dict(temperature=1.0, seed=1, seed_derivation="mine"), "seed_derivation"),
        (dict(temperature=1.0, extra={"seed": 1}), "must not repeat"),
        (dict(temperature=1.0, extra={"x": {1, 2}}), "not a JSON value"),
        (dict(temperature=1.0, extra={"x": math.nan}), "non-finite"),
        (dict(temperature=1.0, extra={1: 2}), "keys must be strings"),
    ]:
        with pytest.raises(BadInput, match=msg):
            SamplingSpec(**bad)  # type: ignore[arg-type]


def test_json_fields_are_frozen_copies() -> None:
    cfg: dict[str, Any] = {"dtype": "bfloat16", "list": [1, 2]}
    e = EngineIdentity("0.32.0", "m", cfg)
    cfg["dtype"] = "float32"
    cfg["list"].append(3)
    assert e.config["dtype"] == "bfloat16" and e.config["list"] == (1, 2)
    with pytest.raises(TypeError):
        e.config["dtype"] = "x"  # type: ignore[index]
    assert e.to_dict()["config"] == {"dtype": "bfloat16", "list": [1, 2]}


def test_sample_validation() -> None:
    with pytest.raises(BadInput, match="out of range for group_size 2"):
        make_sample(group_size=2, sample_index=2)
    with pytest.raises(BadInput, match="run"):
        make_sample(run="bad run id")
    with pytest.raises(BadInput, match="completed_mono"):
        Timestamps(10.0, 10.0, 11.0, 9.0)
    s = make_sample()
    with pytest.raises(BadInput, match="binding must be a Binding"):
        dataclasses.replace(s, binding=s.binding.to_dict())  # type: ignore[arg-type]
    with pytest.raises(BadInput, match=r"binding\.version"):
        Binding.from_dict({"version": {"generation": -1, "label": "rc-1",
                                             "engine_epoch": "e"},
                                 "identity": IDENTITY.to_dict(), "rollout_id": None})
    tampered = s.to_dict()
    tampered["binding"]["identity"]["digest"] = "0" * 64
    with pytest.raises(BadInput, match="digest does not match"):
        TrajectorySample.from_dict(tampered)


def test_binding_from_the_lifecycle_controller_binding() -> None:
    """The controller's binding is the sample's: one type, recorded as it was handed out."""
    from coretools import boot_ev
    from rolloutcore.control.controller import LifecycleController

    c = LifecycleController(clock=lambda: 12.5)
    c.bootstrap(boot_ev(), IDENTITY)
    b = c.admit("rollout-7")
    assert isinstance(b, Binding) and b.admitted_at == 12.5
    assert (b.version, b.identity, b.rollout_id) == (c.committed, IDENTITY, "rollout-7")
    assert "admitted_at" not in b.to_dict()
    back = Binding.from_dict(json.loads(json.dumps(b.to_dict())))
    assert back == b and back.admitted_at is None
    s = make_sample(bound=b.version, rollout_id="rollout-7")
    assert s.binding == b and TrajectorySample.from_dict(s.to_dict()).binding == b


def test_group_validation_and_digest() -> None:
    g = make_group(n=3, t0=5.0)
    assert [s.sample_index for s in g.samples] == [0, 1, 2]
    assert TrajectoryGroup(tuple(reversed(g.samples))) == g  # sorted by index
    assert g.content_digest == make_group(n=3, t0=5.0).content_digest
    assert g.content_digest != make_group(n=3, t0=6.0).content_digest
    with pytest.raises(BadInput, match=r"not exactly 0\.\.2"):
        TrajectoryGroup(g.samples[:2])
    with pytest.raises(BadInput, match=r"not exactly 0\.\.2"):
        TrajectoryGroup((g.samples[0], g.samples[0], g.samples[2]))
    other = make_group(prompt_index=1, n=3)
    with pytest.raises(BadInput, match="group_id="):
        TrajectoryGroup((g.samples[0], other.samples[1], g.samples[2]))
    swapped = dataclasses.replace(g.samples[1], prompt=Prompt((1, 2)))
    with pytest.raises(BadInput, match="different prompts"):
        TrajectoryGroup((g.samples[0], swapped, g.samples[2]))
    with pytest.raises(BadInput, match="at least one"):
        TrajectoryGroup(())


def test_group_id_is_a_function_of_position() -> None:
    assert group_id_for("run-a", 3, 17) == "run-a:s3:p17"
    with pytest.raises(BadInput):
        group_id_for("", 3, 1)
    with pytest.raises(BadInput):
        group_id_for("run-a", -1, 1)


def test_engine_identity_validation() -> None:
    assert EngineIdentity.from_dict(ENGINE.to_dict()) == ENGINE
    with pytest.raises(BadInput, match="vllm_version"):
        EngineIdentity("", "m")
    with pytest.raises(BadInput, match=r"engine\.config"):
        EngineIdentity("0.32.0", "m", [1, 2])  # type: ignore[arg-type]
