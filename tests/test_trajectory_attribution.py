"""Trajectory schema version 3 (#16): ``attribution``, for samples credited to no version.

A sample the controller released unattributable (cut by the drain policy,
finished after a taint) is recorded, marked, so that nothing is lost and
nothing is credited to a version. Every other record is written exactly as
before (version 1, or 2 with images), so older readers keep reading those
files and content digests do not move.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from helpers.trajtools import make_sample
from rolloutcore.core.media import ImageRef
from rolloutcore.errors import BadInput
from rolloutcore.provenance.audit import audit_purity
from rolloutcore.provenance.recorder import TrajectoryRecorder, read_groups
from rolloutcore.provenance.trajectory import (
    Attribution,
    Prompt,
    TrajectoryGroup,
    TrajectorySample,
)

CUT = Attribution(False, "aborted by the drain policy: the drain deadline of 3s expired")


def test_an_attributable_sample_is_written_as_before() -> None:
    s = make_sample()
    d = s.to_dict()
    assert d["schema_version"] == 1 and "attribution" not in d
    assert TrajectorySample.from_dict(d).attribution == Attribution()
    img = ImageRef(hashlib.sha256(b"x").hexdigest(), "image/png", 1, 1, 1)
    m = dataclasses.replace(s, prompt=Prompt(s.prompt.token_ids, media=(img,)))
    assert m.to_dict()["schema_version"] == 2 and "attribution" not in m.to_dict()


@pytest.mark.parametrize("media", [False, True])
def test_an_unattributable_sample_is_version_3_and_round_trips(media: bool) -> None:
    s = dataclasses.replace(make_sample(), attribution=CUT)
    if media:
        img = ImageRef(hashlib.sha256(b"x").hexdigest(), "image/png", 1, 1, 1)
        s = dataclasses.replace(s, prompt=Prompt(s.prompt.token_ids, media=(img,)))
    d = json.loads(s.encode())
    assert d["schema_version"] == 3
    assert d["attribution"] == {"attributable": False, "reason": CUT.reason}
    back = TrajectorySample.from_dict(d)
    assert back == s and back.encode() == s.encode()


@pytest.mark.parametrize("edit", [
    lambda d: d.update(attribution={"attributable": True, "reason": None}),  # v3 but credited
    lambda d: d.pop("attribution"),
    lambda d: d.update(attribution={"attributable": False, "reason": ""}),
    lambda d: d.update(attribution={"attributable": "no", "reason": "x"}),
    lambda d: d.update(attribution={"attributable": False, "reason": "x", "extra": 1}),
    lambda d: d.update(schema_version=2),  # an attribution in a version-2 record
])
def test_bad_attributions_are_refused(edit: object) -> None:
    d = json.loads(dataclasses.replace(make_sample(), attribution=CUT).encode())
    edit(d)  # type: ignore[operator]
    with pytest.raises(BadInput):
        TrajectorySample.from_dict(d)


def test_attribution_itself_checks_its_fields() -> None:
    with pytest.raises(BadInput):
        Attribution(True, "a reason for an attributable sample")
    with pytest.raises(BadInput):
        Attribution(False, None)
    with pytest.raises(BadInput):
        Attribution(False, "x" * 513)


def test_the_file_and_the_audit_carry_it(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = make_sample()
    cut = dataclasses.replace(make_sample(prompt_index=1), attribution=CUT)
    with TrajectoryRecorder(path) as rec:
        rec.append_group(TrajectoryGroup((good,)))
        rec.append_group(TrajectoryGroup((cut,)))
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["schema_version"] for x in lines] == [1, 1, 3, 3]  # samples and markers
    groups = list(read_groups(path))
    assert [g.samples[0].attribution.attributable for g in groups] == [True, False]
    rep = audit_purity([g.samples[0] for g in groups])
    assert rep.unattributable == 1 and rep.to_dict()["unattributable"] == 1
