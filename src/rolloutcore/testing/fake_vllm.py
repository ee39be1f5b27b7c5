"""The fake vLLM server: ``FakeEngine`` behind an httpx mock transport.

``FakeVllm(engine).transport()`` is an ``httpx.MockTransport`` (one handler,
usable by ``httpx.Client`` and ``httpx.AsyncClient``) answering the vLLM
routes of ``rolloutcore.engine.routes`` that RolloutCore drives, in the
shapes vLLM 0.32 answers them (``vllm/entrypoints/rl/online/api_router.py``,
``serve/dev/{cache,sleep}/api_router.py``, ``openai/``). The code under test
gets it by being handed ``transport=`` where it builds its client::

    http = VllmHTTP("http://fake-vllm", transport=FakeVllm(engine).transport())

The state is the engine's (in-flight requests, pause modes, a prefix cache
keyed by tokens and salt, weights that change every output, sleep levels);
this module adds LoRA adapters (a name, its path, and outputs of its own),
the weight label, ``version`` (what ``/version`` says: a vLLM release string
switches on what the client reads from that release), vLLM's own count of its
weight-update calls at ``/metrics``, ``without`` (routes an older vLLM lacks), and
faults: ``fail(path, status, times)`` answers the next
``times`` calls of ``path`` with ``status`` and vLLM's error body (or raises an
httpx transport error there), ``override(path, handler, times)`` answers them
with what ``handler`` returns (a body of a shape the engine never gives, a
route the fake does not serve: ``/collective_rpc``), ``down``
drops every connection, ``swallow_loads`` (that many LoRA loads answer and load
nothing), ``base_under_name`` (that many are listed while the base computes).
Given a ``scorer`` (``testing.peft_scorer``: the tiny model through PEFT), a
generation that asks top logprobs is answered by it, for the base or the
adapter's directory: what an adapter probe checks.

Blocking routes (``/pause?mode=wait``, a generation frozen by ``keep``) block
the calling thread, as a real server's answer would keep it waiting: an
async caller runs them off its loop (``anyio.to_thread``).

The fake is also an ASGI app, for code that must meet vLLM over a real socket
(the gateway's upstream pool): ``uvicorn.run(FakeVllm(engine))``, as vLLM
serves with uvicorn. There an event stream goes out event by event, with
``live`` as the engine makes each token (its pause modes reach the stream), and
the faults of a stream: ``event_delay_s`` between events, ``break_after_events``
(the connection drops after that many), ``omit_done`` (no ``[DONE]``).
``down`` there answers 500: an ASGI app cannot refuse a connection. ``peers``
says which connection each request came on (the client's address).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import prometheus_client

from rolloutcore.core.evidence import PauseMode
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, EngineUnavailable, RolloutCoreError
from rolloutcore.testing.fake_engine import VOCAB, EnginePaused, FakeEngine

if TYPE_CHECKING:  # starlette serves it over a socket (the service extra)
    from starlette.types import Receive, Scope, Send

__all__ = ["FakeVllm"]

MODEL = "fake-model"
#: vLLM's weight-update routes and the ``operation`` label its ``/metrics`` counts them
#: under (``vllm:rl_weight_update_operation_duration_seconds``, from 0.32).
_OPS = {Routes.INIT_TRANSFER: "init", Routes.START_UPDATE: "start",
        Routes.UPDATE_WEIGHTS: "update", Routes.FINISH_UPDATE: "finish"}
_Handler = Callable[[httpx.Request], httpx.Response]
_DONE = b"data: [DONE]"
_SSE = "text/event-stream"


def _error(status: int, message: str, kind: str = "BadRequestError") -> httpx.Response:
    """vLLM's ``ErrorResponse`` body (``openai/engine/protocol.py``)."""
    return httpx.Response(status, json={"error": {"message": message, "type": kind,
                                                  "param": None, "code": status}})


def _bool(v: str | None, default: bool) -> bool:
    if v is None:
        return default
    if v.lower() in ("true", "1"):
        return True
    if v.lower() in ("false", "0"):
        return False
    raise BadInput(f"not a bool: {v!r}")


class FakeVllm:
    """One fake vLLM server over ``engine``; ``transport()`` serves it."""

    def __init__(self, engine: FakeEngine, *, model: str = MODEL, vocab_size: int = VOCAB,
                 without: Iterable[str] = (), max_model_len: int = 512, live: bool = False,
                 event_delay_s: float = 0.0, scorer: Callable[..., list[tuple[
                     int, dict[int, float]]]] | None = None, device: str = "cpu") -> None:
        if not isinstance(model, str) or not model:
            raise BadInput("model must be a non-empty string")
        for name, v, least in (("vocab_size", vocab_size, VOCAB), ("max_model_len",
                                                                    max_model_len, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < least:
                raise BadInput(f"{name} must be an int >= {least}")
        if scorer is not None and not callable(scorer):
            raise BadInput("scorer must be callable (path, token_ids, max_tokens=, top=)")
        if not isinstance(live, bool):
            raise BadInput("live must be a bool")
        if not isinstance(device, str) or not device:
            raise BadInput("device must be a non-empty string (cpu, cuda, ...)")
        if isinstance(event_delay_s, bool) or not isinstance(event_delay_s, (int, float)) \
                or not 0 <= event_delay_s < 60:
            raise BadInput("event_delay_s must be seconds in [0, 60)")
        self.max_model_len = max_model_len
        #: streams over the socket: as the engine makes each token (a sync client's too)
        self.live = live
        #: stream faults over the socket (the module's docstring)
        self.event_delay_s = float(event_delay_s)
        self.break_after_events: int | None = None
        self.omit_done = False
        #: streams over the socket that the client left before their end
        self.streams_closed_early = 0
        #: the JSON bodies it was sent, in order (what the caller asked, as sent)
        self.bodies: list[dict[str, Any]] = []
        #: ids the served model accepts (a tokenizer's); the engine sees them modulo VOCAB
        self.vocab_size = vocab_size
        #: called with each request before it is answered (a test's hook; it may block)
        self.before: Callable[[httpx.Request], None] | None = None
        self.engine = engine
        self.model = model
        #: what ``/version`` answers: ``"0.32.0"`` makes the client read what 0.32 serves
        self.version = "fake"
        #: vLLM 0.26: ``/sleep`` and ``/wake_up`` answer an empty 200 (0.32 says the state;
        #: the engine's ``wake_resumes="always"`` is 0.26's wake)
        self.empty_sleep_answers = False
        #: loaded LoRA adapters: name -> the path it was loaded from
        self.loras: dict[str, str] = {}
        self.scorer = scorer
        #: the device ``/server_info`` says the engine runs on (``device_config``)
        self.device = device
        #: LoRA load faults (the module's docstring); names loaded under the base
        self.swallow_loads = self.base_under_name = 0
        self._as_base: set[str] = set()
        self.down = False
        self.received: list[tuple[str, str]] = []   # (method, path) of every call
        #: over the socket: the client's (host, port) of every request, in order (the
        #: connection it came on: a pooled connection is reused, a new one has a new port)
        self.peers: list[tuple[str, int]] = []
        self._faults: dict[str, list[int | type[httpx.TransportError]]] = {}
        #: path -> its handler, and the calls it has left (absent: every call), ``override``
        self._overrides: dict[str, _Handler] = {}
        self._overrides_left: dict[str, int] = {}
        #: vLLM's ``/metrics`` of this fake, rendered by ``prometheus_client`` as vLLM's
        #: are: its weight-update calls (observed by ``_OPS`` operation) and sleep state
        self._registry = prometheus_client.CollectorRegistry()
        self._op_seconds = prometheus_client.Histogram(
            "vllm:rl_weight_update_operation_duration_seconds",
            "Duration of weight update operations.", ["operation"], registry=self._registry)
        self._sleep_state = prometheus_client.Gauge(
            "vllm:engine_sleep_state", "Engine sleep state.", ["sleep_state"],
            registry=self._registry)
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, str], _Handler] = {
            ("GET", Routes.HEALTH): self._health,
            ("GET", Routes.VERSION): lambda r: httpx.Response(200, json={
                "version": self.version}),
            ("GET", Routes.OPENAPI): self._openapi,
            ("GET", Routes.MODELS): self._models,
            ("GET", Routes.METRICS): self._metrics,
            ("GET", Routes.SERVER_INFO): self._server_info,
            ("GET", Routes.IS_PAUSED): lambda r: httpx.Response(
                200, json={"is_paused": self.engine.paused}),
            ("GET", Routes.IS_SLEEPING): lambda r: httpx.Response(
                200, json={"is_sleeping": self.engine.is_sleeping}),
            ("GET", Routes.WEIGHT_INFO): lambda r: httpx.Response(
                200, json={"weight_version": self.engine.label}),
            ("POST", Routes.PAUSE): self._pause,
            ("POST", Routes.RESUME): self._resume,
            ("POST", Routes.SLEEP): self._sleep,
            ("POST", Routes.WAKE_UP): self._wake,
            ("POST", Routes.RESET_PREFIX): self._reset_prefix,
            ("POST", Routes.RESET_MM): lambda r: httpx.Response(200),
            ("POST", Routes.RESET_ENCODER): lambda r: httpx.Response(200),
            ("POST", Routes.GENERATE): self._generate,
            ("POST", Routes.ABORT): self._abort,
            ("POST", Routes.START_UPDATE): self._start_update,
            ("POST", Routes.FINISH_UPDATE): self._finish_update,
            ("POST", Routes.UPDATE_WEIGHT_VERSION): self._set_version,
            ("POST", Routes.WEIGHT_CHECKER): self._checksums,
            ("GET", Routes.TOKENIZER_INFO): lambda r: httpx.Response(200, json={
                "tokenizer_class": "FakeByteTokenizer", "vocab_size": self.vocab_size}),
            ("POST", Routes.TOKENIZE): self._tokenize,
            ("POST", Routes.DETOKENIZE): self._detokenize,
            ("POST", Routes.COMPLETIONS): self._completions,
            ("POST", Routes.CHAT): self._chat,
            ("GET", Routes.GET_WORLD_SIZE): lambda r: httpx.Response(200, json={
                "world_size": 1}),
            ("POST", Routes.INIT_TRANSFER): self._init_transfer,
            ("POST", Routes.UPDATE_WEIGHTS): self._update_weights,
            ("POST", Routes.LOAD_LORA): self._load_lora,
            ("POST", Routes.UNLOAD_LORA): self._unload_lora,
        }
        gone = frozenset(without)
        if isinstance(without, str) or not gone <= {p for _, p in self._routes}:
            raise BadInput(f"without must name routes the fake serves, got {without!r}")
        #: an older vLLM: ``without=(Routes.WEIGHT_INFO, Routes.WEIGHT_CHECKER)`` is 0.26
        self._routes = {k: v for k, v in self._routes.items() if k[1] not in gone}

    # -- serving -------------------------------------------------------------

    def transport(self) -> httpx.MockTransport:
        """A mock transport serving this fake, for ``httpx.Client`` or ``AsyncClient``."""
        return httpx.MockTransport(self.handle)

    def fail(self, path: str, status: int | type[httpx.TransportError], times: int = 1
             ) -> None:
        """Answer the next ``times`` calls of ``path`` with ``status`` (vLLM's error body),
        or raise it there: ``httpx.ReadTimeout`` is a call that hangs past its timeout."""
        if not any(p == path for _, p in self._routes):
            raise BadInput(f"the fake does not serve {path!r}")
        if not (isinstance(status, type) and issubclass(status, httpx.TransportError)) and (
                isinstance(status, bool) or not isinstance(status, int)
                or not 400 <= status <= 599):
            raise BadInput(f"status must be an HTTP error status or an httpx.TransportError "
                           f"type, got {status!r}")
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise BadInput("times must be an int >= 1")
        with self._lock:
            self._faults.setdefault(path, []).extend([status] * times)

    def override(self, path: str, handler: _Handler, times: int | None = None) -> None:
        """Answer the next ``times`` calls of ``path`` (every call: ``None``), whatever
        their method, with what ``handler(request)`` returns, or with what it raises (an
        ``httpx.TransportError`` instance: a reset connection, a refusal), instead of the
        fake's own answer: what a test needs the engine to say that this fake's state
        never does. A path the fake does not serve is served so (and listed by
        ``/openapi.json`` while it is); ``fail`` and ``down`` still come first."""
        if not isinstance(path, str) or not path.startswith("/"):
            raise BadInput(f"path must be a path (\"/...\"), got {path!r}")
        if not callable(handler):
            raise BadInput("handler must be callable (request) -> httpx.Response")
        if times is not None and (isinstance(times, bool) or not isinstance(times, int)
                                  or times < 1):
            raise BadInput("times must be None (every call) or an int >= 1")
        with self._lock:
            self._overrides[path] = handler
            if times is None:
                self._overrides_left.pop(path, None)
            else:
                self._overrides_left[path] = times

    @property
    def paths(self) -> frozenset[str]:
        """The paths this fake serves now (what ``/openapi.json`` lists)."""
        with self._lock:
            return frozenset({p for _, p in self._routes} | set(self._overrides))

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        with self._lock:
            self.received.append((request.method, path))
            if self.down:
                raise httpx.ConnectError("fake vLLM does not answer: connection refused (down)",
                                         request=request)
            queued = self._faults.get(path)
            status = queued.pop(0) if queued else None
            over = self._overrides.get(path) if status is None else None
            if over is not None and path in self._overrides_left:
                self._overrides_left[path] -= 1
                if self._overrides_left[path] == 0:
                    del self._overrides[path], self._overrides_left[path]
        if self.before is not None:
            self.before(request)
        if over is not None:
            return over(request)
        if isinstance(status, type):
            raise status(f"fake vLLM: injected {status.__name__} on {path}", request=request)
        if status is not None:
            return _error(status, f"injected fault on {path}",
                          "ServiceUnavailableError" if status >= 500 else "BadRequestError")
        route = self._routes.get((request.method, path))
        if route is None:
            known = any(p == path for _, p in self._routes)
            return httpx.Response(405 if known else 404,
                                  json={"detail": "Method Not Allowed" if known else "Not Found"})
        try:
            got = route(request)
            if path in _OPS and got.status_code == 200:
                self._op_seconds.labels(_OPS[path]).observe(0.0)
            return got
        except EnginePaused as exc:  # vLLM 0.33+: a request that reaches a paused engine
            return httpx.Response(503, json={"error": {
                "message": str(exc), "type": "ServiceUnavailableError",
                "param": None, "code": "engine_paused"}})
        except BadInput as exc:
            return _error(400, str(exc))
        except EngineUnavailable as exc:
            return _error(500, str(exc), "InternalServerError")
        except RolloutCoreError as exc:
            return _error(500, str(exc), "InternalServerError")

    def _body(self, request: httpx.Request) -> dict[str, Any]:
        try:
            body = json.loads(request.content or b"{}")
        except ValueError as exc:
            raise BadInput("JSON decode error") from exc
        if not isinstance(body, dict):
            raise BadInput("body must be a JSON object")
        with self._lock:
            self.bodies.append(body)
        return body

    # -- over a socket -----------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """ASGI: each request ``handle``d off the loop (it may block, as vLLM's answer
        would), an event stream sent event by event (``_play``)."""
        from starlette.requests import Request
        from starlette.responses import Response, StreamingResponse

        req = Request(scope, receive)
        if req.client is not None:
            with self._lock:
                self.peers.append((req.client.host, req.client.port))
        got = await anyio.to_thread.run_sync(self.handle, httpx.Request(
            req.method, str(req.url), headers=req.headers.raw, content=await req.body()))
        out = (StreamingResponse(self._play(got), got.status_code, media_type=_SSE)
               if got.headers.get("content-type") == _SSE
               else Response(got.read(), got.status_code, headers=got.headers))
        await out(scope, receive, send)

    async def _play(self, got: httpx.Response) -> AsyncIterator[bytes]:
        chunks, buf, sent = got.iter_bytes(), b"", 0
        try:
            while (chunk := await anyio.to_thread.run_sync(next, chunks, None)) is not None:
                *events, buf = (buf + chunk).split(b"\n\n")
                for ev in events:
                    if ev == _DONE and self.omit_done:
                        continue
                    if ev != _DONE and sent == self.break_after_events:
                        # raised in the stream: the server drops the connection
                        raise EngineUnavailable("engine", "fake vLLM: dropped mid-stream")
                    yield ev + b"\n\n"
                    sent += 1
                    if self.event_delay_s:
                        await anyio.sleep(self.event_delay_s)
        except (anyio.get_cancelled_exc_class(), GeneratorExit):
            self.streams_closed_early += 1
            raise
        finally:
            got.close()  # a live stream's request leaves the engine

    # -- reading -------------------------------------------------------------

    def _health(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(503 if self.engine.dead else 200)

    def _openapi(self, request: httpx.Request) -> httpx.Response:
        paths: dict[str, dict[str, Any]] = {p: {} for p in self.paths}
        for m, p in self._routes:
            paths[p][m.lower()] = {}
        return httpx.Response(200, json={"openapi": "3.1.0", "paths": paths})

    def _metrics(self, request: httpx.Request) -> httpx.Response:
        """vLLM's histogram of its weight-update calls (a labelled family: an operation
        appears with its first call) and its sleep-state gauge."""
        self._sleep_state.labels("awake").set(float(not self.engine.asleep))
        return httpx.Response(200, content=prometheus_client.generate_latest(self._registry),
                              headers={"content-type": prometheus_client.CONTENT_TYPE_LATEST})

    def _models(self, request: httpx.Request) -> httpx.Response:
        with self._lock:
            loras = dict(self.loras)
        data = [{"id": self.model, "object": "model", "owned_by": "vllm", "root": self.model,
                 "parent": None, "max_model_len": 512}]
        data += [{"id": n, "object": "model", "owned_by": "vllm", "root": p,
                  "parent": self.model} for n, p in loras.items()]
        return httpx.Response(200, json={"object": "list", "data": data})

    def _server_info(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"vllm_config": {
            "instance_id": self.engine.epoch, "model_config": {
                "model": self.model, "dtype": "torch.bfloat16",
                "logprobs_mode": "raw_logprobs"},
            "device_config": {"device": self.device}}})

    # -- pause, sleep, caches --------------------------------------------------

    def _pause(self, request: httpx.Request) -> httpx.Response:
        q = request.url.params
        try:
            mode = PauseMode(q.get("mode", "abort"))
        except ValueError as exc:
            raise BadInput(f"unknown pause mode {q.get('mode')!r}") from exc
        # vLLM ignores clear_cache with keep unless the caller preempts; its default is true
        self.engine.pause(mode, clear_cache=_bool(q.get("clear_cache"), True)
                          and mode is not PauseMode.KEEP)
        return httpx.Response(200, json={"status": "paused"})

    def _resume(self, request: httpx.Request) -> httpx.Response:
        self.engine.resume()
        return httpx.Response(200, json={"status": "resumed"})

    def _sleep(self, request: httpx.Request) -> httpx.Response:
        raw = request.url.params.get("level", "1")
        if not raw.isdigit() or int(raw) not in (1, 2):
            raise BadInput(f"sleep level must be 1 or 2, got {raw!r}")
        self.engine.sleep(int(raw))
        if self.empty_sleep_answers:
            return httpx.Response(200)
        return httpx.Response(200, json={"status": "sleeping", "level": int(raw)})

    def _wake(self, request: httpx.Request) -> httpx.Response:
        tags = request.url.params.get_list("tags")
        awake = True
        for t in tags or ["all"]:
            awake = self.engine.wake(t)
        if self.empty_sleep_answers:
            return httpx.Response(200)
        return httpx.Response(200, json={"status": "awake" if awake else "sleeping",
                                         "tags": tags or None})

    def _reset_prefix(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"success": self.engine.reset_prefix_cache()})

    # -- generating ------------------------------------------------------------

    def _tokens(self, ids: Any, what: str = "token_ids") -> list[int]:
        if not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
                for t in ids):
            raise BadInput(f"{what} must be a non-empty list of ids below {self.vocab_size}")
        return ids

    def _max_tokens(self, n: object, prompt: list[int]) -> int:
        n = 16 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadInput("max_tokens must be an int >= 1")
        if len(prompt) + n > self.max_model_len:  # vLLM's check, before the engine
            raise BadInput(f"This model's maximum context length is {self.max_model_len} "
                           f"tokens; the prompt and max_tokens ask {len(prompt) + n}.")
        return n

    def _run(self, body: dict[str, Any], ids: list[int], n: int,
             shape: Callable[[list[int], str | None, Any], dict[str, Any]],
             rid: str | None = None) -> httpx.Response:
        """Run the request in the engine and answer ``shape(tokens, finish, spans)``: one
        object, or with ``stream`` one event per token, the spans on the last (vLLM 0.32):
        played out from the whole generation or, ``live``, as the engine makes them."""
        model, salt = body.get("model") or self.model, body.get("cache_salt")
        if not isinstance(model, str):
            raise BadInput("model must be a string")
        with self._lock:
            lora = model if model in self.loras else None
        if model != self.model and lora is None:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        if salt is not None and not isinstance(salt, str):
            raise BadInput("cache_salt must be a string")
        # An adapter computes differently from the base: its name salts its KV and tokens
        key = None if salt is None and lora is None else f"{salt}|{lora}"
        rid = rid or uuid.uuid4().hex

        def out(toks: Iterable[int]) -> list[int]:
            return [(t + _shift(lora)) % VOCAB for t in toks]
        ids = [t % VOCAB for t in ids]
        if body.get("stream") and self.live:
            s = self.engine.generate_stream(ids, max_tokens=n, request_id=rid, cache_salt=key)
            return _sse((shape(out(c.token_ids), c.finish_reason, None if c.weight_versions
                               is None else [dataclasses.asdict(v) for v in c.weight_versions])
                         for c in s), s.close)
        g = self.engine.generate(ids, n, request_id=rid, cache_salt=key)
        toks = out(g.tokens)
        if not body.get("stream"):
            return httpx.Response(200, json=shape(toks, g.finish_reason, g.version_spans))
        last = len(toks) - 1
        return _sse(shape([t], g.finish_reason if i == last else None,
                          g.version_spans if i == last else None) for i, t in enumerate(toks))

    def _generate(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request)
        ids, sp = self._tokens(body.get("token_ids")), body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise BadInput("sampling_params must be an object")
        rid, lp = str(body.get("request_id") or uuid.uuid4().hex), sp.get("logprobs")
        if self.scorer is not None and sp.get("prompt_logprobs") is not None:
            return self._prompt_scored(body, ids, rid)
        if self.scorer is not None and lp:
            return self._scored(body, ids, self._max_tokens(sp.get("max_tokens"), ids), lp)

        def shape(toks: list[int], finish: str | None, spans: object) -> dict[str, Any]:
            choice = {"index": 0, "token_ids": toks, "finish_reason": finish,
                      "weight_versions": spans}
            if lp is not None:
                choice["logprobs"] = {"content": [
                    {"token_id": t, "logprob": -1.0,
                     "top_logprobs": [{"token_id": t, "logprob": -1.0}] if lp else []}
                    for t in toks]}
            return {"request_id": rid, "choices": [choice]}
        return self._run(body, ids, self._max_tokens(sp.get("max_tokens"), ids), shape, rid)

    def _scored_path(self, body: dict[str, Any]) -> str | httpx.Response | None:
        """The adapter path the model named is scored through (None: the base), or a 404."""
        model = body.get("model") or self.model
        with self._lock:
            if model != self.model and model not in self.loras:
                return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
            return None if model == self.model or model in self._as_base else self.loras[model]

    def _prompt_scored(self, body: dict[str, Any], ids: list[int], rid: str
                       ) -> httpx.Response:
        """``prompt_logprobs``: the scorer's teacher-forced logprob of every prompt token
        (the first has none), and one greedy token after it, as vLLM answers it."""
        path = self._scored_path(body)
        if isinstance(path, httpx.Response):
            return path
        assert self.scorer is not None
        prompt = getattr(self.scorer, "prompt_logprobs", None)
        if not callable(prompt):
            raise BadInput("this fake's scorer does not score prompts (prompt_logprobs)")
        lps = prompt(path, ids)
        ((tok, _),) = self.scorer(path, ids, max_tokens=1, top=1)
        return httpx.Response(200, json={"request_id": rid, "prompt_logprobs": [
            None if v is None else {str(t): {"logprob": v, "rank": 1}}
            for t, v in zip(ids, lps, strict=True)],
            "choices": [{"index": 0, "token_ids": [tok], "finish_reason": "length"}]})

    def _scored(self, body: dict[str, Any], ids: list[int], n: int, top: object
                ) -> httpx.Response:
        """The scorer's greedy tokens and their ``top`` logprobs, for the model named."""
        if isinstance(top, bool) or not isinstance(top, int) or not 1 <= top <= 20:
            raise BadInput("logprobs must be an int in 1..20")
        path = self._scored_path(body)
        if isinstance(path, httpx.Response):
            return path
        assert self.scorer is not None
        out = self.scorer(path, ids, max_tokens=n, top=top)
        return httpx.Response(200, json={"choices": [{
            "index": 0, "token_ids": [t for t, _ in out], "finish_reason": "length",
            "logprobs": {"content": [{"token_id": t, "logprob": tops[t], "top_logprobs": [
                {"token_id": k, "logprob": v} for k, v in tops.items()]} for t, tops in out]}}]})

    def _completions(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request)
        prompt = body.get("prompt")
        ids = ([b % VOCAB for b in prompt.encode()] if isinstance(prompt, str) and prompt
               else self._tokens(prompt, "prompt"))
        return self._openai(body, ids, "text_completion", "cmpl", lambda text: {"text": text})

    def _chat(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request)
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("content"), (str, list)) for m in msgs):
            raise BadInput("messages must be a non-empty list of {role, content}")
        text = "\n".join(m["content"] if isinstance(m["content"], str) else "".join(
            p.get("text", "") for p in m["content"]  # the text parts (images ignored)
            if isinstance(p, dict) and p.get("type") == "text") for m in msgs) or " "
        stream = bool(body.get("stream"))
        return self._openai(body, [b % VOCAB for b in text.encode()],
                            "chat.completion.chunk" if stream else "chat.completion", "chatcmpl",
                            lambda t: {"delta": {"content": t}} if stream else {
                                "message": {"role": "assistant", "content": t}})

    def _openai(self, body: dict[str, Any], ids: list[int], kind: str, prefix: str,
                part: Callable[[str], dict[str, Any]]) -> httpx.Response:
        """``/v1/completions`` and ``/v1/chat/completions``: the engine's tokens as text
        (one letter each), with ``return_token_ids`` the ids too."""
        cid, tids = f"{prefix}-{uuid.uuid4().hex}", body.get("return_token_ids") is True
        return self._run(body, ids, self._max_tokens(body.get("max_tokens"), ids),
                         lambda toks, finish, _: {
                             "id": cid, "object": kind, "model": body.get("model"),
                             "choices": [{"index": 0, **part("".join(chr(97 + t % 26)
                                                                     for t in toks)),
                                          "finish_reason": finish,
                                          **({"token_ids": toks} if tids else {})}]})

    def _tokenize(self, request: httpx.Request) -> httpx.Response:
        text = self._body(request).get("prompt")
        if not isinstance(text, str):
            raise BadInput("prompt must be a string")
        toks = list(text.encode())  # a byte tokenizer
        return httpx.Response(200, json={"tokens": toks, "count": len(toks),
                                         "max_model_len": self.max_model_len})

    def _detokenize(self, request: httpx.Request) -> httpx.Response:
        toks = self._body(request).get("tokens")
        if not isinstance(toks, list) or any(not isinstance(t, int) for t in toks):
            raise BadInput("tokens must be a list of ints")
        return httpx.Response(200, json={"prompt": bytes(t % 256 for t in toks).decode(
            "latin-1")})

    def _abort(self, request: httpx.Request) -> httpx.Response:
        ids = self._body(request).get("request_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, str) for i in ids)):
            raise BadInput("request_ids must be a list of strings")
        n = self.engine.abort(ids)
        return httpx.Response(200, json={"status": "aborted", "aborted": n})

    # -- weights ---------------------------------------------------------------

    def _init_transfer(self, request: httpx.Request) -> httpx.Response:
        self._body(request)
        return httpx.Response(200, json={"message": "Weight transfer initialized"})

    def _update_weights(self, request: httpx.Request) -> httpx.Response:
        """``update_info`` carries the bytes itself (``fake_data``, hex): the fake's
        stand-in for the broadcast beside the call."""
        info = self._body(request).get("update_info")
        if not isinstance(info, dict) or not isinstance(info.get("names"), list):
            raise BadInput("update_info must be an object with names")
        for name, data in zip(info["names"], info.get("fake_data", []), strict=False):
            try:
                raw = bytes.fromhex(data)
            except (TypeError, ValueError) as exc:
                raise BadInput(f"fake_data of {name!r} must be hex") from exc
            self.engine.load(name, raw)  # refused: a 500, as vLLM answers a failed load
        return httpx.Response(200, json={"message": "Weights updated"})

    def _start_update(self, request: httpx.Request) -> httpx.Response:
        self.engine.start_update()
        return httpx.Response(200, json={"message": "Weight update started"})

    def _finish_update(self, request: httpx.Request) -> httpx.Response:
        v = self._body(request).get("weight_version")
        if v is not None and not isinstance(v, str):
            raise BadInput("weight_version must be a string or null")
        self.engine.finish_update(v if v is not None else self.engine.label)
        return httpx.Response(200, json={"message": "Weight update finished"})

    def _set_version(self, request: httpx.Request) -> httpx.Response:
        v = self._body(request).get("new_version")
        if not isinstance(v, str):
            raise BadInput("new_version must be a string")
        self.engine.label = v
        return httpx.Response(200, json={"success": True, "new_version": v})

    def _checksums(self, request: httpx.Request) -> httpx.Response:
        action = self._body(request).get("action")
        if action != "checksum":
            raise BadInput("the fake's weight checker answers action='checksum' only")
        return httpx.Response(200, json={"checksums": {
            n: hashlib.sha256(b).hexdigest() for n, b in self.engine.weight_bytes().items()}})

    # -- LoRA adapters -----------------------------------------------------------

    def _load_lora(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise BadInput("lora_name and lora_path must be non-empty strings")
        if name == self.model:
            return _error(400, f"The lora adapter '{name}' conflicts with a served base "
                               "model.", "InvalidUserInput")
        with self._lock:
            if name in self.loras:
                return _error(400, f"The lora adapter '{name}' has already been loaded. "
                                   "If you want to load the adapter in place, set "
                                   "'load_inplace' to True.", "InvalidUserInput")
            swallowed = self.swallow_loads > 0
            self.swallow_loads -= swallowed
        if not swallowed and not (Path(path) / "adapter_config.json").is_file():
            # vLLM reads the PEFT config
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}",
                          "NotFoundError")
        with self._lock:
            if not swallowed:  # a swallowed load answers as a load and loads nothing
                self.loras[name] = path
                (self._as_base.add if self.base_under_name else self._as_base.discard)(name)
                self.base_under_name = max(0, self.base_under_name - 1)
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")

    def _unload_lora(self, request: httpx.Request) -> httpx.Response:
        name = self._body(request).get("lora_name")
        if not isinstance(name, str) or not name:
            raise BadInput("lora_name must be a non-empty string")
        with self._lock:
            if self.loras.pop(name, None) is None:
                return _error(404, f"The lora adapter '{name}' cannot be found.",
                              "NotFoundError")
        return httpx.Response(200, text=f"Success: LoRA adapter '{name}' removed successfully.")


class _Events(httpx.SyncByteStream):
    """An event stream, each event made as it is read; ``close`` ends it early."""

    def __init__(self, events: Iterable[dict[str, Any]], close: Callable[[], None]) -> None:
        self._events, self._close = events, close

    def __iter__(self) -> Iterator[bytes]:
        for ev in self._events:
            yield f"data: {json.dumps(ev)}\n\n".encode()
        yield _DONE + b"\n\n"

    def close(self) -> None:
        self._close()


def _sse(events: Iterable[dict[str, Any]],
         close: Callable[[], None] | None = None) -> httpx.Response:
    """Events made whole now (an async client reads them too), or, given the stream's
    ``close``, as they are read (over the socket or by a sync client)."""
    if close is None:
        return httpx.Response(200, content=b"".join(_Events(events, lambda: None)),
                              headers={"content-type": _SSE})
    return httpx.Response(200, stream=_Events(events, close), headers={"content-type": _SSE})


def _shift(lora: str | None) -> int:
    return 0 if lora is None else hashlib.sha256(lora.encode()).digest()[0] or 1

