"""Images in requests (issue 22): ``core.media`` and the gateway's ``service.images`` walk."""

from __future__ import annotations

import base64
import hashlib
import io
from typing import Any

import pytest

from rolloutcore.core.media import (
    ImageRef,
    MediaError,
    MediaLimits,
    decode_image_url,
    sniff_image,
)
from rolloutcore.errors import BadInput
from rolloutcore.service.images import CHAT, GENERATE, inspect_media

Image = pytest.importorskip("PIL.Image")


def encoded(fmt: str, size: tuple[int, int] = (37, 23), **kw: Any) -> bytes:
    buf = io.BytesIO()
    Image.new("RGBA" if fmt == "WEBP-X" else "RGB", size, (10, 20, 30)).save(
        buf, format="WEBP" if fmt == "WEBP-X" else fmt, **kw)
    return buf.getvalue()


def url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize(("fmt", "kw", "mime"), [
    ("PNG", {}, "image/png"),
    ("JPEG", {}, "image/jpeg"),
    ("JPEG", {"progressive": True}, "image/jpeg"),
    ("GIF", {}, "image/gif"),
    ("WEBP", {"lossless": False}, "image/webp"),   # VP8
    ("WEBP", {"lossless": True}, "image/webp"),    # VP8L
    ("WEBP-X", {"exif": b"Exif\x00\x00"}, "image/webp"),  # VP8X
])
def test_formats_and_sizes_come_from_the_bytes(fmt: str, kw: dict[str, Any], mime: str) -> None:
    data = encoded(fmt, **kw)
    assert sniff_image(data) == (mime, 37, 23)
    ref, raw = decode_image_url(url(data, mime))
    assert raw == data
    assert ref == ImageRef(hashlib.sha256(data).hexdigest(), mime, len(data), 37, 23)
    assert ImageRef.from_dict(ref.to_dict()) == ref


@pytest.mark.parametrize(("u", "status", "words"), [
    ("https://example.com/cat.png", 400, "only data: URLs"),
    ("cat.png", 400, "only data: URLs"),
    ("data:image/png;base64", 400, "no ','"),
    ("data:image/png,rawbytes", 400, "base64-encoded"),
    ("data:image/png;base64,@@@@", 400, "not valid base64"),
    ("data:image/png;base64,abc", 400, "not valid base64"),
    ("data:image/png;base64,", 400, "empty"),
    ("data:text/plain;base64,aGVsbG8=", 415, "not an image"),
    ("data:image/svg+xml;base64,PHN2Zy8+", 415, "unsupported image type"),
    ("data:;base64,aGVsbG8gd29ybGQ=", 415, "unsupported image format"),
])
def test_bad_urls_are_refused_with_their_status(u: str, status: int, words: str) -> None:
    with pytest.raises(MediaError, match=words) as ei:
        decode_image_url(u)
    assert ei.value.status == status and isinstance(ei.value, BadInput)


def test_unsupported_formats_truncation_and_lies() -> None:
    for fmt in ("BMP", "TIFF"):
        with pytest.raises(MediaError, match="unsupported image format") as ei:
            decode_image_url(url(encoded(fmt)))  # declared PNG: the bytes decide
        assert ei.value.status == 415
    png = encoded("PNG")
    with pytest.raises(MediaError, match="malformed image/png") as ei:
        decode_image_url(url(png[:20]))
    assert ei.value.status == 400
    with pytest.raises(MediaError, match="says image/png but the bytes are image/jpeg"):
        decode_image_url(url(encoded("JPEG"), "image/png"))
    assert decode_image_url(url(encoded("JPEG"), "image/jpg"))[0].mime == "image/jpeg"


def test_limits_refuse_before_decoding_pixels() -> None:
    png = encoded("PNG", (64, 64))
    with pytest.raises(MediaError, match="larger than the limit") as ei:
        decode_image_url(url(png), MediaLimits(max_bytes=len(png) // 4))
    assert ei.value.status == 413
    with pytest.raises(MediaError, match="more than the limit of 1000 pixels") as ei:
        decode_image_url(url(png), MediaLimits(max_pixels=1000))
    assert ei.value.status == 413
    # A header that claims a huge image is refused on the header alone.
    bomb = bytearray(png)
    bomb[16:24] = (100_000).to_bytes(4, "big") * 2
    with pytest.raises(MediaError, match="100000x100000") as ei:
        ImageRef.of(bytes(bomb))
    assert ei.value.status == 413
    for bad in ({"max_bytes": 0}, {"max_pixels": -1}, {"max_images": True}):
        with pytest.raises(BadInput):
            MediaLimits(**bad)


def test_image_refs_validate_themselves() -> None:
    ref = ImageRef.of(encoded("PNG"))
    d = ref.to_dict()
    assert d == {"type": "image", "digest": ref.digest, "mime": "image/png",
                 "bytes": ref.nbytes, "width": 37, "height": 23}
    for bad in ({**d, "digest": "x"}, {**d, "mime": "image/bmp"}, {**d, "width": 0},
                {**d, "type": "audio"}, {**d, "extra": 1}, {k: v for k, v in d.items()
                                                           if k != "bytes"}):
        with pytest.raises(BadInput):
            ImageRef.from_dict(bad)


# --------------------------------------------------------------------------- the walk

def chat(*parts: Any) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": list(parts)}]}


def test_chat_images_are_found_in_order_and_text_only_requests_cost_nothing() -> None:
    a, b = encoded("PNG"), encoded("JPEG")
    got = inspect_media(CHAT, chat({"type": "text", "text": "hi"},
                                   {"type": "image_url", "image_url": {"url": url(a)}},
                                   {"type": "image_url", "image_url": url(b, "image/jpeg")}),
                        MediaLimits())
    assert [r.digest for r in got] == [hashlib.sha256(x).hexdigest() for x in (a, b)]
    assert inspect_media(CHAT, {"messages": [{"role": "user", "content": "hi"}]},
                         MediaLimits()) == ()
    assert inspect_media(CHAT, {"messages": "not a list"}, MediaLimits()) == ()
    assert inspect_media("/v1/completions", {"prompt": "x"}, MediaLimits()) == ()


def test_generate_content_parts() -> None:
    png = encoded("PNG")
    body = {"token_ids": [1, 2], "content_parts": [{"type": "image_url", "url": url(png)}]}
    (ref,) = inspect_media(GENERATE, body, MediaLimits())
    assert ref.digest == hashlib.sha256(png).hexdigest()
    assert inspect_media(GENERATE, {"token_ids": [1]}, MediaLimits()) == ()


@pytest.mark.parametrize(("route", "body", "status", "words"), [
    (CHAT, chat({"type": "image_url"}), 400, "without a URL"),
    (CHAT, chat({"type": "image_url", "image_url": {"url": "http://x/y.png"}}), 400,
     "only data: URLs"),
    (CHAT, chat({"type": "input_audio", "input_audio": {}}), 415, "'input_audio'"),
    (CHAT, chat({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}),
     415, "'video_url'"),
    (CHAT, chat({"type": "image_embeds", "image_embeds": "..."}), 415, "'image_embeds'"),
    (GENERATE, {"token_ids": [1], "features": {"mm_hashes": {}}}, 415, "features"),
    (GENERATE, {"token_ids": [1], "content_parts": "x"}, 400, "must be a list"),
    (GENERATE, {"token_ids": [1], "content_parts": [3]}, 400, "must be an object"),
    (GENERATE, {"token_ids": [1], "content_parts": [{"type": "audio_url", "url": "x"}]}, 415,
     "audio_url"),
    (GENERATE, {"token_ids": [1], "content_parts": [{"type": "text", "text": "x"}]}, 415,
     "only image_url"),
])
def test_bad_parts_are_refused(route: str, body: dict[str, Any], status: int,
                               words: str) -> None:
    with pytest.raises(MediaError, match=words) as ei:
        inspect_media(route, body, MediaLimits())
    assert ei.value.status == status


def test_too_many_images() -> None:
    part = {"type": "image_url", "image_url": {"url": url(encoded("PNG"))}}
    with pytest.raises(MediaError, match="more than 2 images") as ei:
        inspect_media(CHAT, chat(part, part, part), MediaLimits(max_images=2))
    assert ei.value.status == 413
