"""The gateway's checks of the images in a data-plane request, before admission.

An image the engine would refuse, or one the gateway cannot describe, must
not be admitted: admission binds the request to a version and holds up the
next update's drain, and a request that fails inside vLLM after that is a
rollout with no sample. So every image is checked here, on the event loop
before ``admit``, and described (``core.media.ImageRef``: digest, format,
size) for the request's trajectory. The bytes are never kept.

Where images are looked for (vLLM 0.32's multimodal inputs):

* ``/v1/chat/completions``: every ``messages[].content[]`` part of type
  ``image_url`` (``{"image_url": {"url": ...}}``, or the URL as a string);
* ``/inference/v1/generate``: every ``content_parts[]`` entry of type
  ``image_url`` (``{"type": "image_url", "url": ...}``).

Refused, with the status of ``core.media.MediaError``: malformed parts
(400), non-``data:`` URLs (400: the gateway records what was seen, so it
must see it), oversized images or too many of them (413), and media it does
not take: other formats, audio and video parts, pre-computed embeddings,
and ``/inference/v1/generate``'s pre-rendered ``features`` (415). A request
with no media costs one dictionary lookup per message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rolloutcore.core.media import ImageRef, MediaError, MediaLimits, decode_image_url
from rolloutcore.engine.routes import Routes

__all__ = ["CHAT", "GENERATE", "REFUSED_PART_TYPES", "inspect_media"]

CHAT = Routes.CHAT
GENERATE = Routes.GENERATE

#: Content-part types that carry media the gateway does not take (vLLM 0.32
#: names). Anything else that is not an image is left to vLLM to validate.
REFUSED_PART_TYPES = frozenset({
    "audio_url", "input_audio", "audio_embeds", "video_url", "image_embeds", "image_pil",
    "input_image", "file", "input_file",
})


def _image(url: object, limits: MediaLimits, refs: list[ImageRef]) -> None:
    if len(refs) >= limits.max_images:
        raise MediaError(413, f"more than {limits.max_images} images in one request")
    refs.append(decode_image_url(url, limits)[0])


def _part(where: str, part: object, limits: MediaLimits, refs: list[ImageRef],
          *, nested: bool) -> None:
    if not isinstance(part, Mapping):
        return  # vLLM's to validate
    ptype = part.get("type")
    if not isinstance(ptype, str) or not ptype:
        # vLLM reads an untyped part by its keys (as image_url, audio_url, ...): every
        # media rule would be skipped for it. A part says what it is, or is refused.
        raise MediaError(400, f"{where}: a content part needs its 'type' (a string), "
                              f"got {ptype!r}")
    if ptype == "image_url":
        url: object = part.get("image_url") if nested else part.get("url")
        if nested and isinstance(url, Mapping):
            url = url.get("url")
        if url is None:
            raise MediaError(400, f"{where}: an image_url part without a URL")
        _image(url, limits, refs)
    elif ptype in REFUSED_PART_TYPES:
        raise MediaError(415, f"{where}: content parts of type {ptype!r} are not accepted "
                              "(images as data: URLs in image_url parts only)")


def inspect_media(route: str, payload: Mapping[str, Any],
                  limits: MediaLimits) -> tuple[ImageRef, ...]:
    """The images of one request, described, or ``MediaError`` (with its status)."""
    refs: list[ImageRef] = []
    if route == CHAT:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return ()
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, Mapping) else None
            if isinstance(content, list):
                for j, part in enumerate(content):
                    _part(f"messages[{i}].content[{j}]", part, limits, refs, nested=True)
    elif route == GENERATE:
        if payload.get("features") is not None:
            raise MediaError(415, "pre-rendered multimodal 'features' are not accepted: send "
                                  "the images as content_parts so that the gateway can "
                                  "record what the policy saw")
        parts = payload.get("content_parts")
        if parts is None:
            return ()
        if not isinstance(parts, list):
            raise MediaError(400, "content_parts must be a list")
        for j, part in enumerate(parts):
            if not isinstance(part, Mapping):
                raise MediaError(400, f"content_parts[{j}] must be an object")
            _part(f"content_parts[{j}]", part, limits, refs, nested=False)
            if part.get("type") != "image_url":
                raise MediaError(415, f"content_parts[{j}]: only image_url parts are "
                                      f"accepted, got {part.get('type')!r}")
    return tuple(refs)
