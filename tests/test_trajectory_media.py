"""Trajectory schema version 2 (issue 22): ``prompt.media``, digests of the prompt's images."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from helpers.trajtools import make_sample
from rolloutcore.core.media import ImageRef
from rolloutcore.errors import BadInput
from rolloutcore.provenance.recorder import TrajectoryRecorder, read_groups
from rolloutcore.provenance.replay import LaneStatus, replay_lanes
from rolloutcore.provenance.trajectory import (
    KNOWN_SCHEMA_VERSIONS,
    SCHEMA_VERSION,
    Prompt,
    TrajectoryGroup,
    TrajectorySample,
    check_schema_version,
)

REF = ImageRef(hashlib.sha256(b"image bytes").hexdigest(), "image/png", 11, 8, 6)


def with_media(s: TrajectorySample, *refs: ImageRef) -> TrajectorySample:
    return dataclasses.replace(s, prompt=Prompt(s.prompt.token_ids, media=refs))


def test_versions_known() -> None:
    # 3: + attribution, written only for an unattributable sample
    # (tests/test_trajectory_attribution.py), and completion.versions
    # (issue 20: asynchronous updates); 4: + fleet, written only for a sample a
    # fleet gateway recorded (issue 28); 5: + adapter, written only for a sample
    # generated through a LoRA adapter (issue 32); it reads every earlier version.
    assert SCHEMA_VERSION == 5 and set(KNOWN_SCHEMA_VERSIONS) == {1, 2, 3, 4, 5}
    for v in (1, 2, 3, 4, 5):
        check_schema_version({"schema_version": v})
    with pytest.raises(BadInput, match="newer than"):
        check_schema_version({"schema_version": 6})


def test_a_text_prompt_is_written_as_version_1_exactly_as_before() -> None:
    s = make_sample()
    d = s.to_dict()
    assert s.schema_version == 1 and d["schema_version"] == 1
    assert d["prompt"] == {"digest": s.prompt.digest, "token_ids": [5, 6, 7]}
    assert TrajectorySample.from_dict(d) == s


def test_images_make_version_2_and_round_trip() -> None:
    s = with_media(make_sample(), REF, REF)
    d = json.loads(s.encode())
    assert d["schema_version"] == 2
    assert d["prompt"]["media"] == [REF.to_dict(), REF.to_dict()]
    back = TrajectorySample.from_dict(d)
    assert back == s and back.encode() == s.encode()
    assert back.prompt.digest == make_sample().prompt.digest  # the digest covers token ids


@pytest.mark.parametrize(("edit", "words"), [
    (lambda d: d.update(schema_version=1), "only then"),
    (lambda d: d["prompt"].pop("media"), "only then"),
    (lambda d: d["prompt"].update(media=[]), "non-empty"),
    (lambda d: d["prompt"]["media"][0].update(digest="bad"), "64 lowercase hex"),
    (lambda d: d["prompt"]["media"][0].update(bytes=1, extra=2), "exactly the keys"),
    (lambda d: d["prompt"].update(extra=1), "unknown keys"),
])
def test_inconsistent_media_records_are_refused(edit: Any, words: str) -> None:
    d = json.loads(with_media(make_sample(), REF).encode())
    edit(d)
    with pytest.raises(BadInput, match=words):
        TrajectorySample.from_dict(d)


def test_prompt_media_must_be_image_refs() -> None:
    with pytest.raises(BadInput, match="ImageRef only"):
        Prompt((1, 2), media=({"digest": "x"},))  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="sequence of ImageRef"):
        Prompt((1, 2), media="x")  # type: ignore[arg-type]


def test_commit_markers_carry_the_groups_version(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = TrajectoryRecorder(path)
    rec.append_group(TrajectoryGroup((make_sample(prompt_index=0),)))
    rec.append_group(TrajectoryGroup((with_media(make_sample(prompt_index=1), REF),)))
    rec.close()
    lines = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert [(x["record"], x["schema_version"]) for x in lines] == [
        ("sample", 1), ("commit", 1), ("sample", 2), ("commit", 2)]
    groups = list(read_groups(path))
    assert [g.samples[0].prompt.media for g in groups] == [(), (REF,)]


def test_a_sample_with_images_is_not_replayed_without_them() -> None:
    class NoEngine:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the engine must not be asked ({name})")

    s = with_media(make_sample(temperature=0.0, logprobs=(-1.0, -1.0, -1.0)), REF)
    tok, lp, labels = replay_lanes(NoEngine(), s)  # type: ignore[arg-type]
    assert tok.status is LaneStatus.NOT_APPLICABLE and lp.status is LaneStatus.NOT_APPLICABLE
    assert "digests only" in tok.detail and not labels
