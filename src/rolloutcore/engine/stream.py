"""A streamed generation from vLLM's tokens-in route, read chunk by chunk.

``VllmHTTP.generate_stream`` opens it on its own connection pool; the stream
parses vLLM's server-sent events into ``GenerationChunk``s (tokens,
logprobs, the engine's per-token weight-version spans, cached prompt
tokens) and closes the connection to abort the request.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import httpx

from rolloutcore.engine.errors import map_errors, snippet, status_error
from rolloutcore.engine.wire import GenerationChunk, VersionSpan
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable

__all__ = ["GenerationStream", "chunk_of"]


def chunk_of(ev: Mapping[str, Any], logprobs: bool, read_at: float) -> GenerationChunk:
    """One parsed event of a streamed ``/inference/v1/generate`` (choice 0) as a chunk.

    Raises ``BadInput`` (or ``ValueError``/``KeyError``/``TypeError``/
    ``AttributeError`` from reading it) on an event of another shape; the
    callers say where it came from.
    """
    usage = ev.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens")
    choices = ev.get("choices") or []
    if not choices:
        return GenerationChunk((), None if not logprobs else (), None, None, read_at,
                               None if cached is None else int(cached))
    ch = choices[0]
    toks = tuple(int(x) for x in ch.get("token_ids") or ())
    lps: tuple[float, ...] | None = None
    if logprobs:
        content = (ch.get("logprobs") or {}).get("content") or []
        lps = tuple(float(c["logprob"]) for c in content)
        if len(lps) != len(toks):
            raise BadInput(f"{len(lps)} logprobs for {len(toks)} tokens")
    return GenerationChunk(toks, lps, ch.get("finish_reason"),
                           VersionSpan.parse(ch.get("weight_versions")), read_at,
                           None if cached is None else int(cached))


#: What opening the stream returns: httpx's streamed-response context manager.
_Opened = contextlib.AbstractContextManager[httpx.Response]


class GenerationStream:
    """One streamed generation: iterate ``GenerationChunk``s, ``close()`` to abort it.

    Closing the response closes its connection, which makes vLLM abort the
    request. Failures leave as the tree's errors (``engine.errors``), like
    every other call of ``VllmHTTP``.
    """

    def __init__(self, open_stream: Callable[[httpx.Timeout], _Opened], what: str,
                 read_timeout_s: float, logprobs: bool) -> None:
        self._open_stream, self._what = open_stream, what
        self._read_s, self._lp = read_timeout_s, logprobs
        self._cm: _Opened | None = None
        self._resp: httpx.Response | None = None
        self._closed = False

    def _open(self) -> httpx.Response:
        what = self._what
        timeout = httpx.Timeout(self._read_s, connect=min(30.0, self._read_s))
        with map_errors("generate", what, timeout_s=self._read_s):
            self._cm = self._open_stream(timeout)
            resp = self._cm.__enter__()
        if resp.status_code != 200:
            text = resp.read().decode("utf-8", "replace")
            self.close()
            err = status_error("generate", what, resp.status_code, text)
            raise err or EffectError("generate", f"{what}: HTTP {resp.status_code}")
        self._resp = resp
        return resp

    def __iter__(self) -> Iterator[GenerationChunk]:
        resp = self._resp or self._open()
        what = self._what
        with map_errors("generate", what, timeout_s=self._read_s):
            for line in resp.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = self._parse(data)
                if chunk is not None:
                    yield chunk

    def _parse(self, data: str) -> GenerationChunk | None:
        t = time.monotonic()
        try:
            ev = json.loads(data)
            if "error" in ev and not ev.get("choices"):
                err = ev["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                raise EngineUnavailable("generate", f"the stream reported an error: {msg}")
            return chunk_of(ev, self._lp, t)
        except (ValueError, KeyError, TypeError, AttributeError, BadInput) as exc:
            raise EffectError("generate", f"unreadable stream event: {exc}: "
                              f"{snippet(data)}") from exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        cm, self._cm = self._cm, None
        if cm is not None:
            with contextlib.suppress(Exception):
                cm.__exit__(None, None, None)

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
