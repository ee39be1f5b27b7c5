"""Images through the gateway (issue 22), fast lane: FakeEngine behind a fake vLLM.

Good images are admitted and bound like any rollout, and a recorded generate
request carries a digest of each image (never the bytes) in its trajectory
(schema version 2). Malformed, oversized and unsupported images, remote
URLs and media the gateway does not take get a clear 4xx before admission:
no admit record, no binding, nothing forwarded.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import RIG_ENGINES, rig
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.media import MediaLimits
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.provenance.trajectory import EngineIdentity
from rolloutcore.service.proxy import VERSION_HEADER
from rolloutcore.service.recording import (
    PROMPT_INDEX_HEADER,
    RUN_HEADER,
    STEP_HEADER,
    GatewayRecorder,
)

Image = pytest.importorskip("PIL.Image")
pytestmark = pytest.mark.anyio
ENGINE = EngineIdentity("fake-0", "fake-vlm", {"dtype": "bytes"}, "http://vllm.test")
GEN = "/inference/v1/generate"
CHAT = "/v1/chat/completions"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


#: Fault-matrix rows (with ROLLOUTCORE_FAULT_MATRIX set: helpers.fault_matrix).
MATRIX = PromiseRows("tests/test_service_images.py", engines=RIG_ENGINES)
_fault_matrix = MATRIX.fixture()


def png(seed: int, size: tuple[int, int] = (20, 10)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (seed % 256, 3, 4)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def chat_body(*urls: str) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]}


async def test_images_are_admitted_bound_and_recorded_as_digests(tmp_path: Path) -> None:
    path = tmp_path / "traj.jsonl"
    rec = GatewayRecorder(path, ENGINE)
    a, b = png(1), png(2, (30, 30))
    async with rig(on_finished=rec) as r:
        ok = await r.client.post(CHAT, json=chat_body(data_url(a), data_url(b)))
        assert ok.status_code == 200, ok.text
        assert ok.json()["rolloutcore"]["version"] == "default"
        gen = await r.client.post(GEN, headers={RUN_HEADER: "run-1", STEP_HEADER: "0",
                                                PROMPT_INDEX_HEADER: "0"}, json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3},
            "content_parts": [{"type": "image_url", "url": data_url(b)}]})
        assert gen.status_code == 200, gen.text
        text = await r.client.post(GEN, headers={RUN_HEADER: "run-1", STEP_HEADER: "0",
                                                 PROMPT_INDEX_HEADER: "1"}, json={
            "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 3}})
        assert text.status_code == 200
        with anyio.fail_after(10):
            while sum(rec.counts.values()) < 3:
                await anyio.sleep(0.005)
        assert len(r.kinds("admit")) == 3 and not r.controller.active
    rec.close()
    groups = {g.group_id: g for g in read_groups(path)}
    (s,) = groups["run-1:s0:p0"].samples
    (ref,) = s.prompt.media
    assert ref.digest == hashlib.sha256(b).hexdigest()
    assert (ref.mime, ref.width, ref.height, ref.nbytes) == ("image/png", 30, 30, len(b))
    assert s.binding.rollout_id == gen.json()["rolloutcore"]["rollout_id"]
    lines = [json.loads(x) for x in path.read_bytes().splitlines()]
    sample, commit, plain, plain_commit = lines
    assert sample["schema_version"] == 2 and commit["schema_version"] == 2
    assert sample["prompt"]["media"] == [ref.to_dict()]
    assert base64.b64encode(b).decode()[:40] not in path.read_text()  # never the bytes
    # A text-only sample is written exactly as before version 2.
    assert plain["schema_version"] == 1 and "media" not in plain["prompt"]
    assert plain_commit["schema_version"] == 1
    assert groups["run-1:s0:p1"].samples[0].prompt.media == ()


BAD: list[tuple[str, str, dict[str, Any], int, str]] = [
    ("malformed", CHAT, chat_body("data:image/png;base64,@@@"), 400, "BadRequest"),
    ("truncated", CHAT, chat_body(data_url(png(1)[:20])), 400, "BadRequest"),
    ("remote", CHAT, chat_body("https://example.com/x.png"), 400, "BadRequest"),
    ("unsupported format", CHAT, chat_body(data_url(b"BM" + b"\0" * 60, "image/bmp")), 415,
     "UnsupportedMediaType"),
    ("not an image", CHAT, chat_body("data:text/html;base64,PGI+"), 415,
     "UnsupportedMediaType"),
    ("audio", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}]}, 415,
     "UnsupportedMediaType"),
    ("oversized", CHAT, chat_body(data_url(png(3, (64, 64)))), 413, "PayloadTooLarge"),
    ("too many pixels", GEN, {"token_ids": [1], "sampling_params": {"max_tokens": 2},
                              "content_parts": [{"type": "image_url",
                                                 "url": data_url(png(4, (40, 40)))}]},
     413, "PayloadTooLarge"),
    ("features", GEN, {"token_ids": [1], "sampling_params": {"max_tokens": 2},
                       "features": {"mm_hashes": {"image": ["x"]}}}, 415,
     "UnsupportedMediaType"),
]


@pytest.mark.parametrize(("name", "route", "body", "status", "kind"),
                         [pytest.param(*c, id=c[0]) for c in BAD])
async def test_bad_images_get_a_clear_4xx_and_nothing_is_admitted(
        name: str, route: str, body: dict[str, Any], status: int, kind: str) -> None:
    limits = MediaLimits(max_bytes=len(png(3, (64, 64))) - 1, max_pixels=1500)
    async with rig(media=limits) as r:
        before = len(r.journal.records)
        resp = await r.client.post(route, json=body)
        assert resp.status_code == status, resp.text
        err = resp.json()["error"]
        assert err["type"] == kind and err["code"] == status and err["message"]
        assert "rolloutcore" not in resp.json()
        new = r.journal.records[before:]
        assert not [x for x in new if x.kind == "admit"], "a refused request was admitted"
        assert not r.controller.active
        # The gateway still serves: a good image right after is admitted.
        ok = await r.client.post(CHAT, json=chat_body(data_url(png(5))))
        assert ok.status_code == 200 and len(r.kinds("admit")) == 1


UNTYPED: list[dict[str, object]] = [
    {"image_url": {"url": "data:image/png;base64,AAAA"}},        # vLLM reads it as image_url
    {"audio_url": {"url": "http://example.test/a.wav"}},          # ... as audio_url
    {"type": None, "image_url": {"url": "http://example.test/x.png"}},
    {"type": 7, "text": "hi"},
]


@pytest.mark.parametrize("part", UNTYPED)
def test_a_chat_part_without_its_type_is_refused(part: dict[str, object]) -> None:
    """#29: an untyped part skipped every media check (the data-URL rule, the audio and
    video refusal, the image digest), though vLLM reads it by its keys."""
    from rolloutcore.core.media import MediaError, MediaLimits
    from rolloutcore.service.images import CHAT, inspect_media

    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, part]}]}
    with pytest.raises(MediaError) as ei:
        inspect_media(CHAT, body, MediaLimits())
    assert ei.value.status == 400 and "needs its 'type'" in str(ei.value)


async def test_the_gateway_refuses_an_untyped_chat_part_before_admission() -> None:
    """The same parts through the gateway's chat route: each 400 before admission (no admit
    record, nothing forwarded to vLLM); a typed image right after is admitted."""
    async with rig() as r:
        statuses = []
        for part in UNTYPED:
            body = {"model": "policy", "max_tokens": 3, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "what is it?"}, part]}]}
            resp = await r.client.post(CHAT, json=body)
            assert resp.status_code == 400, (part, resp.text)
            err = resp.json()["error"]
            assert err["type"] == "BadRequest" and "needs its 'type'" in err["message"]
            statuses.append(resp.status_code)
        assert r.kinds("admit") == [] and r.fake.bodies == [] and not r.controller.active
        ok = await r.client.post(CHAT, json=chat_body(data_url(png(5))))
        assert ok.status_code == 200 and len(r.kinds("admit")) == 1
        assert ok.json()["rolloutcore"]["version"] == ok.headers[VERSION_HEADER] == "default"
        assert r.controller.state is State.READY and check_journal(r.journal.records) == []
    MATRIX.row("untyped_chat_part", "chat content parts without a string 'type' (an "
               "image_url or audio_url part by its keys alone, type null, type 7)",
               f"{len(statuses)} x {statuses[0]} before admission: no admit record, nothing "
               "forwarded to the engine; a typed image after them admitted", "READY",
               statuses=statuses, published_unvalidated=0, mislabeled_answers=0)
