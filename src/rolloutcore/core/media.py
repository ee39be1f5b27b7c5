"""Images in requests, as data: what was sent, checked before anything is admitted.

A multimodal rollout is only attributable if its record says which images
the policy saw, and only safe to admit if the image is one the engine will
take. Both need the same facts, computed once at the edge from the bytes
the client sent: the image's format (sniffed from its signature, not taken
from the declared type), its dimensions (read from its header, without
decoding pixels, so a decompression bomb is refused before any decoder sees
it), its size and its sha256. ``ImageRef`` carries those facts into
trajectories and audits; the bytes themselves are never recorded.

Only ``data:`` URLs with base64 payloads are accepted: the gateway records
a digest of every image, so it must hold the bytes; a remote URL would make
vLLM fetch something nobody digested (and fetch it from wherever the client
says). Supported formats: PNG, JPEG, GIF, WebP, the ones every vLLM image
processor decodes through Pillow.

Every refusal is a ``MediaError`` (a ``BadInput``) with the HTTP status a
gateway answers: 400 malformed, 413 too large, 415 unsupported. Standard
library only; no clocks, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.strict import HEX64, check_int
from rolloutcore.errors import BadInput

__all__ = [
    "IMAGE_MIME_TYPES",
    "ImageRef",
    "MediaError",
    "MediaLimits",
    "decode_image_url",
    "sniff_image",
]

#: The formats accepted, by MIME type (``image/jpg`` is a common alias of JPEG).
IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/gif", "image/webp"})
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg"}
_B64 = re.compile(rb"^[A-Za-z0-9+/]*={0,2}$")
# JPEG start-of-frame markers (the ones that carry the frame size).
_SOF = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE,
                  0xCF})


class MediaError(BadInput):
    """An image that is refused; ``status`` is the HTTP status to answer (400, 413, 415)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    """Bounds on the images of one request, checked before decoding any pixel."""

    max_bytes: int = 8 << 20        # decoded bytes of one image
    max_pixels: int = 4096 * 4096   # width * height of one image
    max_images: int = 16            # per request

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_pixels", "max_images"):
            v = getattr(self, name)
            check_int(name, v, 1)


@dataclass(frozen=True)
class ImageRef:
    """What one image was: sha256 of its bytes, format, size; never the bytes."""

    digest: str
    mime: str
    nbytes: int
    width: int
    height: int

    def __post_init__(self) -> None:
        if not isinstance(self.digest, str) or not HEX64.fullmatch(self.digest):
            raise BadInput(f"image digest must be 64 lowercase hex digits, got {self.digest!r}")
        if self.mime not in IMAGE_MIME_TYPES:
            raise BadInput(f"image mime must be one of {sorted(IMAGE_MIME_TYPES)}, "
                           f"got {self.mime!r}")
        for name in ("nbytes", "width", "height"):
            v = getattr(self, name)
            check_int(f"image {name}", v, 1)

    @classmethod
    def of(cls, data: bytes, limits: MediaLimits | None = None) -> ImageRef:
        """Check ``data`` (an encoded image) against ``limits`` and describe it."""
        lim = limits or MediaLimits()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise BadInput(f"image data must be bytes, got {type(data).__name__}")
        raw = bytes(data)
        if not raw:
            raise MediaError(400, "the image is empty")
        if len(raw) > lim.max_bytes:
            raise MediaError(413, f"the image has {len(raw)} bytes, more than the limit "
                                  f"of {lim.max_bytes}")
        mime, w, h = sniff_image(raw)
        if w * h > lim.max_pixels:
            raise MediaError(413, f"the image is {w}x{h} pixels, more than the limit of "
                                  f"{lim.max_pixels} pixels")
        return cls(hashlib.sha256(raw).hexdigest(), mime, len(raw), w, h)

    def to_dict(self) -> dict[str, Any]:
        return {"type": "image", "digest": self.digest, "mime": self.mime,
                "bytes": self.nbytes, "width": self.width, "height": self.height}

    @classmethod
    def from_dict(cls, d: object) -> ImageRef:
        if not isinstance(d, dict):
            raise BadInput(f"an image record must be a JSON object, got {type(d).__name__}")
        keys = {"type", "digest", "mime", "bytes", "width", "height"}
        if set(d) != keys:
            raise BadInput(f"an image record has exactly the keys {sorted(keys)}, "
                           f"got {sorted(d)}")
        if d["type"] != "image":
            raise BadInput(f"media type must be 'image', got {d['type']!r}")
        return cls(d["digest"], d["mime"], d["bytes"], d["width"], d["height"])


def _u16be(b: bytes, i: int) -> int:
    return (b[i] << 8) | b[i + 1]


def _u16le(b: bytes, i: int) -> int:
    return b[i] | (b[i + 1] << 8)


def _u24le(b: bytes, i: int) -> int:
    return b[i] | (b[i + 1] << 8) | (b[i + 2] << 16)


def _jpeg_size(b: bytes) -> tuple[int, int] | None:
    i, n = 2, len(b)
    while i + 3 < n:
        if b[i] != 0xFF:
            return None
        while i < n and b[i] == 0xFF:  # fill bytes
            i += 1
        if i >= n:
            return None
        marker = b[i]
        i += 1
        if marker in (0xD8, 0x01) or 0xD0 <= marker <= 0xD7:
            continue  # standalone markers
        if marker == 0xD9 or i + 2 > n:
            return None
        seg = _u16be(b, i)
        if seg < 2:
            return None
        if marker in _SOF:
            if i + 7 > n:
                return None
            return _u16be(b, i + 5), _u16be(b, i + 3)
        i += seg
    return None


def sniff_image(data: bytes) -> tuple[str, int, int]:
    """(MIME type, width, height) from the image's signature and header.

    ``MediaError(415)`` when the bytes are no supported format, ``(400)``
    when they start like one but their header is truncated or nonsensical.
    """
    b = bytes(data)
    size: tuple[int, int] | None
    if b.startswith(b"\x89PNG\r\n\x1a\n"):
        mime = "image/png"
        size = (int.from_bytes(b[16:20], "big"), int.from_bytes(b[20:24], "big")) \
            if len(b) >= 24 and b[12:16] == b"IHDR" else None
    elif b.startswith(b"\xff\xd8\xff"):
        mime = "image/jpeg"
        size = _jpeg_size(b)
    elif b[:6] in (b"GIF87a", b"GIF89a"):
        mime = "image/gif"
        size = (_u16le(b, 6), _u16le(b, 8)) if len(b) >= 10 else None
    elif len(b) >= 12 and b[:4] == b"RIFF" and b[8:12] == b"WEBP":
        mime = "image/webp"
        chunk = b[12:16]
        size = None
        if chunk == b"VP8 " and len(b) >= 30 and b[23:26] == b"\x9d\x01\x2a":
            size = (_u16le(b, 26) & 0x3FFF, _u16le(b, 28) & 0x3FFF)
        elif chunk == b"VP8L" and len(b) >= 25 and b[20] == 0x2F:
            bits = int.from_bytes(b[21:25], "little")
            size = ((bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1)
        elif chunk == b"VP8X" and len(b) >= 30:
            size = (_u24le(b, 24) + 1, _u24le(b, 27) + 1)
    else:
        raise MediaError(415, "unsupported image format (accepted: PNG, JPEG, GIF, WebP)")
    if size is None or size[0] < 1 or size[1] < 1:
        raise MediaError(400, f"malformed {mime} image: its header is truncated or invalid")
    return mime, size[0], size[1]


def decode_image_url(url: object, limits: MediaLimits | None = None) -> tuple[ImageRef, bytes]:
    """The checked image of a ``data:image/...;base64,...`` URL, and its bytes."""
    lim = limits or MediaLimits()
    if not isinstance(url, str) or not url:
        raise MediaError(400, "an image URL must be a non-empty string")
    if url[:5].lower() != "data:":
        scheme = url.split(":", 1)[0][:16] if ":" in url else ""
        raise MediaError(400, "only data: URLs are accepted for images (the gateway records "
                              "a digest of each image), got "
                              + (f"a {scheme}: URL" if scheme else "no URL scheme"))
    head, sep, payload = url[5:].partition(",")
    if not sep:
        raise MediaError(400, "malformed data URL: no ',' before the data")
    params = [p.strip().lower() for p in head.split(";")]
    declared = _ALIASES.get(params[0], params[0])
    if "base64" not in params[1:]:
        raise MediaError(400, "image data URLs must be base64-encoded (';base64,')")
    if declared and not declared.startswith("image/"):
        raise MediaError(415, f"a data URL of type {declared!r} is not an image")
    if declared and declared not in IMAGE_MIME_TYPES:
        raise MediaError(415, f"unsupported image type {declared!r} "
                              f"(accepted: {', '.join(sorted(IMAGE_MIME_TYPES))})")
    compact = payload.strip()
    # Refuse before decoding what could not fit: 4 base64 characters per 3 bytes.
    if len(compact) // 4 * 3 > lim.max_bytes + 3:
        raise MediaError(413, f"the image is larger than the limit of {lim.max_bytes} bytes")
    raw_b = compact.encode("ascii", "replace")
    if not _B64.fullmatch(raw_b) or len(raw_b) % 4:
        raise MediaError(400, "malformed data URL: the payload is not valid base64")
    try:
        data = base64.b64decode(raw_b, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(400, "malformed data URL: the payload is not valid base64") from None
    ref = ImageRef.of(data, lim)
    if declared and declared != ref.mime:
        raise MediaError(400, f"the data URL says {declared} but the bytes are {ref.mime}")
    return ref, data
