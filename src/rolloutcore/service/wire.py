"""The bytes of the data plane: request checks, the SSE relay, the answer's version field.

Split from ``proxy`` (which routes, admits, relays and enforces deadlines)
so that each stays readable; nothing here does I/O or holds state beyond
one answer's relay. The rules kept here are the gateway's own: a request
body is standard JSON (no ``NaN``/``Infinity``, no overflowing number) of
bounded nesting, an answer carries its version in a body field spliced in
without a re-parse, and a stream that ends badly ends with an ``error``
event and ``[DONE]`` rather than silently.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from rolloutcore.core.versions import Binding
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    RequestTooLarge,
    RolloutCoreError,
)
from rolloutcore.service.auth import AuthResult

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

__all__ = [
    "BODY_FIELD",
    "DATA_HEADERS",
    "GENERATION_HEADER",
    "IDENTITY_HEADER",
    "ROLLOUT_HEADER",
    "VERSION_HEADER",
    "ClientGone",
    "Message",
    "Receive",
    "Scope",
    "Send",
    "SseRelay",
    "VersionView",
    "dumps",
    "error_body",
    "headers_of_interest",
    "inject_json",
    "json_depth",
    "body_or_answer",
    "read_body",
    "retry_headers",
    "send_auth_refusal",
    "send_error",
    "send_json",
    "splice_field",
    "upstream_failure",
    "validate_request",
    "vllm_request_ids",
]

BODY_FIELD = "rolloutcore"
VERSION_HEADER = "x-rolloutcore-version"
GENERATION_HEADER = "x-rolloutcore-generation"
IDENTITY_HEADER = "x-rolloutcore-identity"
ROLLOUT_HEADER = "x-rolloutcore-rollout-id"
_DONE = b"data: [DONE]"
#: The terminator, held back until the gateway has said its last word before it.
_TERM = _DONE + b"\n\n"
_MAX_FIRST_EVENT = 1 << 20
#: A JSON escape of a UTF-16 surrogate (paired ones are fine; lone ones are not).
_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _no_constant(name: str) -> Any:
    raise BadInput(f"{name} is not JSON")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BadInput(f"{text[:32]} overflows a double")
    return x


def json_depth(obj: Any, limit: int) -> int:
    """How deep ``obj`` nests containers, counted without recursion, stopping past ``limit``."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, dict):
            items: Iterable[Any] = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


def vllm_request_ids(route: str, rollout_id: str, payload: dict[str, Any]) -> list[str]:
    """The ids vLLM 0.32 gives the request the gateway sent with ``X-Request-Id: rollout_id``.

    vLLM prefixes the header's id per route (``generate-tokens-``,
    ``chatcmpl-``, and ``cmpl-`` plus ``-i`` for each prompt of a
    completion), and ``/abort_requests`` takes those.
    """
    if route == Routes.GENERATE:
        return [f"generate-tokens-{rollout_id}"]
    if route == Routes.CHAT:
        return [f"chatcmpl-{rollout_id}"]
    prompt = payload.get("prompt")
    n = 1
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        n = min(len(prompt), 1024)
    return [f"cmpl-{rollout_id}-{i}" for i in range(n)]


def error_body(status: int, message: str, kind: str, **extra: Any) -> dict[str, Any]:
    """vLLM's (OpenAI's) error shape, so existing clients read it."""
    out: dict[str, Any] = {"error": {"message": message, "type": kind, "code": status}}
    if extra:
        out[BODY_FIELD] = extra
    return out


class SseRelay:
    """Passes an SSE stream through, adding the version field to its first event.

    Only the first event is parsed; after it the bytes flow untouched and only
    a short tail is kept, to tell a complete stream (``data: [DONE]``) from a
    truncated one. With ``collect`` every event is parsed (for the recorder).
    """

    def __init__(self, info: dict[str, Any], collect: bool,
                 collect_limit: int = 16 << 20) -> None:
        self._info = info
        self._held = b""
        self._buf = bytearray()
        self._first_done = False
        self._tail = b""
        self._collect = collect
        self._cbuf = bytearray()
        self._room = collect_limit
        self.overflow = False
        self.events: list[dict[str, Any]] = []

    def _keep(self, out: bytes) -> bytes:
        self._tail = (self._tail + out)[-64:]
        if self._collect:
            self._room -= len(out)
            if self._room < 0:  # more than the recorder may hold: stop collecting
                self._collect, self.overflow = False, True
                self._cbuf.clear()
                self.events.clear()
                return out
            self._cbuf += out
            while (i := self._cbuf.find(b"\n\n")) >= 0:
                ev = bytes(self._cbuf[:i])
                del self._cbuf[:i + 2]
                if ev.startswith(b"data:") and ev[5:].strip() != b"[DONE]":
                    try:
                        obj = json.loads(ev[5:])
                    except ValueError:
                        continue
                    if isinstance(obj, dict):
                        self.events.append(obj)
        return out

    def _inject(self, ev: bytes) -> bytes:
        payload = ev[5:].lstrip() if ev.startswith(b"data:") else b""
        if payload.startswith(b"{"):
            out = splice_field(payload, dumps(self._info))
            if out is not None:
                return b"data: " + out
        # Not a JSON event (an empty stream's [DONE], a comment): put the
        # version in an event of its own in front of it.
        return b"data: " + dumps({BODY_FIELD: self._info}) + b"\n\n" + ev

    def _hold(self, out: bytes) -> bytes:
        """Hold back what may be the start of ``data: [DONE]`` (at most its 14 bytes), so a
        last event of the gateway's own can still go in front of it (``take_held``)."""
        data = self._held + out if self._held else out
        k = min(len(_TERM), len(data))
        while k and not _TERM.startswith(data[len(data) - k:]):
            k -= 1
        self._held = data[len(data) - k:] if k else b""
        return data[:len(data) - k] if k else data

    def take_held(self) -> bytes:
        """The bytes held back at the end (the terminator, normally)."""
        out, self._held = self._held, b""
        return out

    def feed(self, chunk: bytes) -> bytes:
        if self._first_done:
            return self._hold(self._keep(chunk))
        self._buf += chunk
        i = self._buf.find(b"\n\n")
        if i < 0:
            if len(self._buf) > _MAX_FIRST_EVENT:  # not SSE as we know it: pass through
                self._first_done = True
                out = bytes(self._buf)
                self._buf.clear()
                return self._hold(self._keep(out))
            return b""
        first = bytes(self._buf[:i])
        rest = bytes(self._buf[i + 2:])
        self._buf.clear()
        self._first_done = True
        return self._hold(self._keep(self._inject(first) + b"\n\n" + rest))

    def flush(self) -> bytes:
        """A stream that ended inside its first event: what it sent (the held-back
        terminator is not part of it: ``take_held``)."""
        out = bytes(self._buf)
        self._buf.clear()
        return self._keep(out) if out else b""

    @staticmethod
    def event(obj: Mapping[str, Any]) -> bytes:
        """One SSE event of the gateway's own."""
        return b"data: " + dumps(dict(obj)) + b"\n\n"

    @property
    def complete(self) -> bool:
        return self._tail.rstrip(b"\r\n").endswith(_DONE)

    def error_tail(self, message: str, status: int = 502, kind: str = "UpstreamError") -> bytes:
        ev = error_body(status, message, kind, **self._info)
        out = b""
        if self._tail and not self._tail.endswith(b"\n\n"):
            out += b"\n\n"  # close a torn event so the error parses on its own
        out += b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n"
        return self._keep(out + _DONE + b"\n\n")


def validate_request(raw: bytes, max_depth: int = 64) -> tuple[str, dict[str, Any]]:
    """The gateway's own checks; everything else is vLLM's to validate (it answers 400).

    JSON as the standard has it: no ``NaN``/``Infinity`` (Python's parser takes
    them, and so would vLLM's, as numbers), no number a double overflows on,
    no string with a lone surrogate escape (``"\\ud800"``: not a character;
    only a body that has such an escape at all is checked); nesting bounded
    (the C parser's recursion limit is far deeper, and whatever later walks
    the request recursively, the recorder among them, would fail on it).
    The depth is walked only when the body has enough brackets to be that
    deep, so an ordinary request pays two byte counts.
    """
    try:
        payload = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        return f"malformed JSON: nested deeper than {max_depth}", {}
    except (ValueError, UnicodeDecodeError) as exc:
        return f"malformed JSON: {exc}", {}
    if not isinstance(payload, dict):
        return "the request body must be a JSON object", {}
    if raw.count(b"[") + raw.count(b"{") > max_depth and json_depth(payload, max_depth) > \
            max_depth:
        return f"malformed JSON: nested deeper than {max_depth}", {}
    if _SURROGATE.search(raw) is not None:
        try:  # a lone surrogate is no character: tokenizers fail on it (a 500 upstream)
            json.dumps(payload, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return "malformed JSON: a string holds a lone UTF-16 surrogate", {}
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "'stream' must be a boolean", {}
    if BODY_FIELD in payload:
        return f"'{BODY_FIELD}' is reserved for the gateway's answer", {}
    return "", payload


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def splice_field(obj: bytes, value: bytes) -> bytes | None:
    """Add ``"rolloutcore": value`` to a serialized JSON object without re-parsing it.

    vLLM's answers are JSON objects; splicing before the closing brace costs
    one copy, where a parse and a dump cost a multiple of the gateway's whole
    budget for large answers (logprobs). ``None`` when ``obj`` is no object.
    """
    body = obj.strip()
    if len(body) < 2 or body[:1] != b"{" or body[-1:] != b"}":
        return None
    head = body[:-1].rstrip()
    sep = b"" if head == b"{" else b","
    return head + sep + b'"' + BODY_FIELD.encode() + b'":' + value + b"}"


def inject_json(body: bytes, info: dict[str, Any]) -> tuple[bytes, dict[str, Any] | None]:
    """Parse, add the field and re-serialize (for the recorder, which keeps the parsed answer)."""
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return body, None
    if not isinstance(obj, dict):
        return body, None
    obj[BODY_FIELD] = info
    return dumps(obj), obj


async def send_json(send: Send, status: int, obj: Any,
                    headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(obj, separators=(",", ":")).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def send_error(send: Send, status: int, message: str, kind: str,
                     headers: Iterable[tuple[bytes, bytes]] = (), **extra: Any) -> int:
    """``error_body`` sent as the answer; returns ``status`` (what a handler reports)."""
    await send_json(send, status, error_body(status, message, kind, **extra), headers)
    return status


def upstream_failure(exc: EffectError) -> tuple[int, str, str]:
    """(status, message, kind) of a request vLLM did not take: 504 when it did not answer
    in time, else 502 (unreachable, unavailable)."""
    if isinstance(exc, EffectTimeout):
        return 504, f"vLLM did not answer in time: {exc!r}", "UpstreamTimeout"
    return 502, f"vLLM unreachable: {exc!r}", "UpstreamError"


def retry_headers(retry: bool, after_s: float | None) -> list[tuple[bytes, bytes]]:
    """``x-should-retry`` (what OpenAI's SDKs obey before their own status rules) and,
    when a refusal says when, ``retry-after`` in whole seconds (at least 1)."""
    out = [(b"x-should-retry", b"true" if retry else b"false")]
    if after_s is not None:
        out.append((b"retry-after", str(max(1, math.ceil(after_s))).encode()))
    return out


class VersionView:
    """A version's answer decorations: body field (less the rollout id) and headers.

    ``extra`` joins the body field (a fleet's version and replica): the same
    object for every answer through one target, so the view is built once.
    """

    __slots__ = ("extra", "headers", "identity", "info", "info_head", "version")

    def __init__(self, b: Binding, extra: Mapping[str, Any] | None = None) -> None:
        self.version = b.version
        self.identity = b.identity
        self.extra = extra
        digest = b.identity.digest
        self.info: dict[str, Any] = {
            "version": b.version.label, "generation": b.version.generation,
            "engine_epoch": b.version.engine_epoch, "identity_digest": digest,
            **(extra or {})}
        # The serialized body field up to the rollout id, which is all that
        # differs between this version's answers (ids match _ROLLOUT_ID: no
        # character needs escaping in JSON).
        self.info_head = dumps({**self.info, "rollout_id": ""})[:-2]
        self.headers = ((VERSION_HEADER.encode(), b.version.label.encode()),
                        (GENERATION_HEADER.encode(), str(b.version.generation).encode()),
                        (IDENTITY_HEADER.encode(), digest.encode()))


class ClientGone(RolloutCoreError):
    """The client went away before its request body arrived (nothing to answer)."""


async def read_body(receive: Receive, limit: int, content_length: bytes | None) -> bytes:
    """The whole request body, refused as soon as it is known to exceed ``limit``.

    Unbounded in time by itself: the data plane's sweeper cuts a body that
    takes longer than ``client_body_s``.
    """
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadInput("Content-Length is not an integer") from None
        if declared > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    msg = await receive()
    if msg["type"] == "http.disconnect":
        raise ClientGone
    body = msg.get("body", b"")
    if len(body) > limit:
        raise RequestTooLarge(f"request body exceeds {limit} bytes")
    if not msg.get("more_body", False):  # the usual case: the whole body at once
        return bytes(body)
    chunks = [body]
    n = len(body)
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise ClientGone
        body = msg.get("body", b"")
        n += len(body)
        if n > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
        chunks.append(body)
        if not msg.get("more_body", False):
            return b"".join(chunks)


#: The request headers the data plane reads itself.
DATA_HEADERS = frozenset({b"authorization", b"content-type", b"content-length",
                          ROLLOUT_HEADER.encode()})


async def body_or_answer(receive: Receive, send: Send, limit: int,
                         content_length: bytes | None) -> bytes | int:
    """The request body, or the status of the answer already sent instead: 413 (the
    connection closes: the body was not read to its end), 400 (a bad Content-Length),
    499 (the client went away)."""
    try:
        return await read_body(receive, limit, content_length)
    except RequestTooLarge:
        return await send_error(send, 413, f"request body exceeds {limit} bytes",
                                "PayloadTooLarge", [(b"connection", b"close")])
    except ClientGone:
        return 499
    except BadInput as exc:
        return await send_error(send, 400, str(exc), "BadRequest")


async def send_auth_refusal(send: Send, auth: AuthResult) -> int:
    """A bearer token's refusal (``auth.check_bearer``): 401/403 with WWW-Authenticate."""
    assert auth.status is not None   # a refusal, never an allowed request
    return await send_error(send, auth.status, auth.reason, "Unauthorized",
                            [(b"www-authenticate", b"Bearer")])


def headers_of_interest(scope: Scope, wanted: frozenset[bytes] = DATA_HEADERS
                        ) -> dict[bytes, bytes]:
    """The request headers wanted, first occurrence of each, in one pass."""
    out: dict[bytes, bytes] = {}
    for k, v in scope["headers"]:
        if k in wanted and k not in out:
            out[k] = bytes(v)
    return out
