"""A tiny vLLM data plane over a FakeEngine, for the gateway's FAST tests only.

It answers the three data routes the gateway forwards, in vLLM's shapes
(non-streaming JSON, or SSE events ending with ``data: [DONE]``), with the
engine's per-token version spans as ``weight_versions`` on
``/inference/v1/generate``. Generation runs in the FakeEngine (so its pause,
drain and version labels are real); the stream is then played out event by
event with ``event_delay_s`` between events, so a client can be mid-stream
when something happens.

Faults, set on the instance: ``break_after_events`` (the connection drops
after N events: the app raises), ``omit_done`` (the stream ends without its
terminator), ``status_error`` (answer this HTTP status with vLLM's error body).

It also answers the read-only routes the gateway passes through
(``/v1/models``, ``/version``, ``/tokenizer_info``, ``/tokenize``,
``/detokenize``) and, to show that the gateway never forwards them, one dev
route (``/pause``, counted in ``dev_calls``).

``/abort_requests`` answers as vLLM's dev route does (``{"status": "aborted",
"aborted": n}``) and keeps the ids it was given in ``aborted`` (the engine
here generates before it streams, so there is nothing left to stop).

The real-engine tests (tests/engine/) never use this: they run vLLM.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rolloutcore.testing.fake_engine import VOCAB, EnginePaused, FakeEngine, Generation


def _err(status: int, msg: str) -> JSONResponse:
    return JSONResponse({"error": {"message": msg, "type": "BadRequestError", "code": status}},
                        status_code=status)


async def _paused(request: Request, exc: Exception) -> Response:
    """vLLM 0.33+'s refusal of a request that reaches a paused engine."""
    return JSONResponse({"error": {"message": str(exc), "type": "ServiceUnavailableError",
                                   "code": "engine_paused"}}, status_code=503)


class FakeVllm:
    def __init__(self, engine: FakeEngine, *, event_delay_s: float = 0.0,
                 live: bool = False) -> None:
        self.engine = engine
        self.event_delay_s = event_delay_s
        #: Stream each token as the engine makes it (its pause modes reach the stream:
        #: ``keep`` freezes it, ``abort`` ends it with ``finish_reason: abort``), as
        #: vLLM does, instead of generating first and playing the events out.
        self.live = live
        self.break_after_events: int | None = None
        self.omit_done = False
        self.status_error: int | None = None
        self.received: list[dict[str, Any]] = []
        self.streams_closed_early = 0
        self.aborted: list[list[str]] = []
        self.dev_calls = 0
        self.inits: list[Any] = []   # the bodies of /init_weight_transfer_engine
        self.app = Starlette(exception_handlers={EnginePaused: _paused}, routes=[
            Route("/abort_requests", self.abort_requests, methods=["POST"]),
            Route("/inference/v1/generate", self.generate, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenizer_info", self.tokenizer_info, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/pause", self.pause, methods=["POST"]),
            # vLLM's weight routes over the fake engine (service.native's fast tests):
            # update_info carries the bytes itself ("fake_data", hex), the fake's
            # stand-in for the broadcast beside the call.
            Route("/start_weight_update", self.start_update, methods=["POST"]),
            Route("/update_weights", self.update_weights, methods=["POST"]),
            Route("/finish_weight_update", self.finish_update, methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix, methods=["POST"]),
            Route("/get_world_size", self.world_size, methods=["GET"]),
            Route("/init_weight_transfer_engine", self.init_transfer, methods=["POST"]),
        ])

    # ------------------------------------------------------------ helpers
    async def _run(self, prompt: list[int], max_tokens: int,
                   cache_salt: str | None = None) -> Generation:
        return await anyio.to_thread.run_sync(self.engine.generate, prompt, max_tokens, None,
                                              cache_salt)

    def _live(self, ids: list[int], n: int, salt: Any,
              event: Any) -> StreamingResponse:
        """A stream of the engine's tokens as they come: ``event(tokens, finish, spans)``."""
        stream = self.engine.generate_stream(ids, max_tokens=n,
                                             cache_salt=salt if isinstance(salt, str) else None)
        it = iter(stream)
        end = object()

        async def body() -> AsyncIterator[bytes]:
            try:
                while True:
                    ch = await anyio.to_thread.run_sync(next, it, end)
                    if ch is end:
                        break
                    spans = None if ch.weight_versions is None else [
                        {"version": v.version, "start": v.start, "end": v.end}
                        for v in ch.weight_versions]
                    ev = event(list(ch.token_ids), ch.finish_reason, spans)
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                yield b"data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                self.streams_closed_early += 1
                raise
            finally:
                await anyio.to_thread.run_sync(stream.close)
        return StreamingResponse(body(), media_type="text/event-stream")

    def _sse(self, events: list[dict[str, Any]]) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            sent = 0
            try:
                for ev in events:
                    if self.break_after_events is not None and sent >= self.break_after_events:
                        raise ConnectionResetError("fake vLLM: connection dropped mid-stream")
                    yield f"data: {json.dumps(ev)}\n\n".encode()
                    sent += 1
                    if self.event_delay_s:
                        await asyncio.sleep(self.event_delay_s)
                if not self.omit_done:
                    yield b"data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                self.streams_closed_early += 1
                raise
        return StreamingResponse(body(), media_type="text/event-stream")

    async def _parse(self, request: Request) -> dict[str, Any] | Response:
        if self.status_error is not None:
            return _err(self.status_error, "injected upstream error")
        try:
            body = await request.json()
        except ValueError:
            return _err(400, "JSON decode error")
        if not isinstance(body, dict):
            return _err(400, "body must be an object")
        self.received.append(body)
        return body

    @staticmethod
    def _max_tokens(v: Any) -> int | None:
        if v is None:
            return 16
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            return None
        return v

    # ------------------------------------------------------------ read-only routes
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": "fake-model", "object": "model", "owned_by": "vllm", "max_model_len": 512}]})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": "fake-0.0"})

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse({"tokenizer_class": "FakeByteTokenizer", "vocab_size": VOCAB})

    async def tokenize(self, request: Request) -> Response:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        text = body.get("prompt")
        if not isinstance(text, str):
            return _err(400, "prompt must be a string")
        toks = list(text.encode())
        return JSONResponse({"tokens": toks, "count": len(toks), "max_model_len": 512})

    async def detokenize(self, request: Request) -> Response:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        toks = body.get("tokens")
        if not isinstance(toks, list) or any(not isinstance(t, int) for t in toks):
            return _err(400, "tokens must be a list of ints")
        return JSONResponse({"prompt": bytes(t % 256 for t in toks).decode("latin-1")})

    async def pause(self, request: Request) -> Response:
        self.dev_calls += 1
        return JSONResponse({"status": "paused"})

    async def start_update(self, request: Request) -> Response:
        self.engine.start_update()
        return JSONResponse({"message": "Weight update started"})

    async def update_weights(self, request: Request) -> Response:
        info = (await request.json())["update_info"]
        for name, hexdata in zip(info["names"], info.get("fake_data", []), strict=False):
            try:
                self.engine.load(name, bytes.fromhex(hexdata))
            except Exception as exc:  # vLLM answers a failed load with a 500
                return _err(500, str(exc))
        return JSONResponse({"message": "Weights updated"})

    async def finish_update(self, request: Request) -> Response:
        body = await request.json() if await request.body() else {}
        self.engine.finish_update(body.get("weight_version") or "default")
        return JSONResponse({"message": "Weight update finished"})

    async def reset_prefix(self, request: Request) -> Response:
        return JSONResponse({"success": self.engine.reset_prefix_cache()})

    async def world_size(self, request: Request) -> Response:
        return JSONResponse({"world_size": 1})

    async def init_transfer(self, request: Request) -> Response:
        self.inits.append(await request.json() if await request.body() else None)
        return JSONResponse({"message": "Weight transfer initialized"})

    # ------------------------------------------------------------ routes
    async def abort_requests(self, request: Request) -> Response:
        body = await request.json()
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if not isinstance(ids, list) or not ids:
            return _err(400, "the fake aborts only named requests")
        self.aborted.append([str(i) for i in ids])
        return JSONResponse({"status": "aborted", "aborted": len(ids)})

    async def generate(self, request: Request) -> Response:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        ids = body.get("token_ids")
        sp = body.get("sampling_params") or {}
        n = self._max_tokens(sp.get("max_tokens") if isinstance(sp, dict) else None)
        if not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < VOCAB
                for t in ids) or n is None:
            return _err(400, "token_ids must be ids below the vocabulary size")
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        salt = body.get("cache_salt")
        want_lp = isinstance(sp, dict) and sp.get("logprobs") is not None

        def lp(toks: list[int]) -> dict[str, Any]:  # the fake's logprob is -1.0 per token
            return {"logprobs": {"content": [{"token_id": t, "logprob": -1.0}
                                             for t in toks]}} if want_lp else {}
        if self.live and body.get("stream"):
            return self._live(ids, n, salt, lambda toks, fin, spans: {
                "request_id": rid, "choices": [{"index": 0, "token_ids": toks,
                                                "finish_reason": fin,
                                                "weight_versions": spans, **lp(toks)}]})
        g = await self._run(ids, n, salt if isinstance(salt, str) else None)
        if not body.get("stream"):
            return JSONResponse({"request_id": rid, "choices": [{
                "index": 0, "token_ids": g.tokens, "finish_reason": g.finish_reason,
                "weight_versions": g.version_spans, **lp(g.tokens)}]})
        events = []
        for i, tok in enumerate(g.tokens):
            last = i == len(g.tokens) - 1
            events.append({"request_id": rid, "choices": [{
                "index": 0, "token_ids": [tok],
                "finish_reason": g.finish_reason if last else None,
                "weight_versions": g.version_spans if last else None}]})
        return self._sse(events)

    @staticmethod
    def _text(tokens: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in tokens)

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        prompt = body.get("prompt")
        n = self._max_tokens(body.get("max_tokens"))
        if isinstance(prompt, str) and prompt:
            ids = [b % VOCAB for b in prompt.encode()]
        elif isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and 0 <= t < VOCAB for t in prompt):
            ids = list(prompt)
        else:
            return _err(400, "prompt must be a non-empty string or token ids")
        if n is None:
            return _err(400, "max_tokens must be a positive integer")
        cid = f"cmpl-{uuid.uuid4().hex}"
        tids = body.get("return_token_ids") is True
        salt = body.get("cache_salt")
        if self.live and body.get("stream"):
            return self._live(ids, n, salt, lambda toks, fin, spans: {
                "id": cid, "object": "text_completion", "choices": [{
                    "index": 0, "text": self._text(toks), "finish_reason": fin,
                    **({"token_ids": toks} if tids else {})}]})
        g = await self._run(ids, n, salt if isinstance(salt, str) else None)
        if not body.get("stream"):
            return JSONResponse({"id": cid, "object": "text_completion",
                                 "model": body.get("model"), "choices": [{
                                     "index": 0, "text": self._text(g.tokens),
                                     "finish_reason": g.finish_reason,
                                     **({"token_ids": g.tokens} if tids else {})}]})
        events = [{"id": cid, "object": "text_completion", "choices": [{
            "index": 0, "text": self._text([t]),
            "finish_reason": g.finish_reason if i == len(g.tokens) - 1 else None}]}
            for i, t in enumerate(g.tokens)]
        return self._sse(events)

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request)
        if isinstance(body, Response):
            return body
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), (str, list))
                for m in msgs):
            return _err(400, "messages must be a non-empty list of {role, content}")

        def text_of(content: Any) -> str:  # content parts: the text ones (images ignored)
            if isinstance(content, str):
                return content
            return "".join(p.get("text", "") for p in content
                           if isinstance(p, dict) and p.get("type") == "text")

        text = "\n".join(text_of(m["content"]) for m in msgs) or " "
        n = self._max_tokens(body.get("max_tokens"))
        if n is None:
            return _err(400, "max_tokens must be a positive integer")
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        tids = body.get("return_token_ids") is True
        salt = body.get("cache_salt")
        ids = [b % VOCAB for b in text.encode()]
        if self.live and body.get("stream"):
            return self._live(ids, n, salt, lambda toks, fin, spans: {
                "id": cid, "object": "chat.completion.chunk", "choices": [{
                    "index": 0, "delta": {"content": self._text(toks)}, "finish_reason": fin,
                    **({"token_ids": toks} if tids else {})}]})
        g = await self._run(ids, n, salt if isinstance(salt, str) else None)
        if not body.get("stream"):
            return JSONResponse({"id": cid, "object": "chat.completion", "choices": [{
                "index": 0, "message": {"role": "assistant", "content": self._text(g.tokens)},
                "finish_reason": g.finish_reason,
                **({"token_ids": g.tokens} if tids else {})}]})
        events = [{"id": cid, "object": "chat.completion.chunk", "choices": [{
            "index": 0, "delta": {"content": self._text([t])},
            "finish_reason": g.finish_reason if i == len(g.tokens) - 1 else None}]}
            for i, t in enumerate(g.tokens)]
        return self._sse(events)
