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
the weight label, ``without`` (routes an older vLLM lacks), and
faults: ``fail(path, status, times)`` answers the next
``times`` calls of ``path`` with ``status`` and vLLM's error body, ``down``
drops every connection.

Blocking routes (``/pause?mode=wait``, a generation frozen by ``keep``) block
the calling thread, as a real server's answer would keep it waiting: an
async caller runs them off its loop (``anyio.to_thread``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx

from rolloutcore.core.evidence import PauseMode
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, EngineUnavailable, RolloutCoreError
from rolloutcore.testing.fake_engine import VOCAB, EnginePaused, FakeEngine

__all__ = ["FakeVllm"]

MODEL = "fake-model"
_Handler = Callable[[httpx.Request], httpx.Response]


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
                 without: Iterable[str] = ()) -> None:
        if not isinstance(model, str) or not model:
            raise BadInput("model must be a non-empty string")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < VOCAB:
            raise BadInput(f"vocab_size must be an int >= {VOCAB}")
        #: ids the served model accepts (a tokenizer's); the engine sees them modulo VOCAB
        self.vocab_size = vocab_size
        #: called with each request before it is answered (a test's hook; it may block)
        self.before: Callable[[httpx.Request], None] | None = None
        self.engine = engine
        self.model = model
        #: loaded LoRA adapters: name -> the path it was loaded from
        self.loras: dict[str, str] = {}
        self.down = False
        self.received: list[tuple[str, str]] = []   # (method, path) of every call
        self._faults: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._routes: dict[tuple[str, str], _Handler] = {
            ("GET", Routes.HEALTH): self._health,
            ("GET", Routes.VERSION): lambda r: httpx.Response(200, json={"version": "fake"}),
            ("GET", Routes.OPENAPI): self._openapi,
            ("GET", Routes.MODELS): self._models,
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

    def fail(self, path: str, status: int, times: int = 1) -> None:
        """Answer the next ``times`` calls of ``path`` with ``status`` (vLLM's error body)."""
        if not any(p == path for _, p in self._routes):
            raise BadInput(f"the fake does not serve {path!r}")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise BadInput(f"status must be an HTTP error status, got {status!r}")
        if isinstance(times, bool) or not isinstance(times, int) or times < 1:
            raise BadInput("times must be an int >= 1")
        with self._lock:
            self._faults.setdefault(path, []).extend([status] * times)

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        with self._lock:
            self.received.append((request.method, path))
            if self.down:
                raise httpx.ConnectError("fake vLLM: connection refused (down)",
                                         request=request)
            queued = self._faults.get(path)
            status = queued.pop(0) if queued else None
        if self.before is not None:
            self.before(request)
        if status is not None:
            return _error(status, f"injected fault on {path}",
                          "ServiceUnavailableError" if status >= 500 else "BadRequestError")
        route = self._routes.get((request.method, path))
        if route is None:
            known = any(p == path for _, p in self._routes)
            return httpx.Response(405 if known else 404,
                                  json={"detail": "Method Not Allowed" if known else "Not Found"})
        try:
            return route(request)
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

    @staticmethod
    def _body(request: httpx.Request) -> dict[str, Any]:
        try:
            body = json.loads(request.content or b"{}")
        except ValueError as exc:
            raise BadInput("JSON decode error") from exc
        if not isinstance(body, dict):
            raise BadInput("body must be a JSON object")
        return body

    # -- reading -------------------------------------------------------------

    def _health(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(503 if self.engine.dead else 200)

    def _openapi(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"openapi": "3.1.0", "paths": {
            p: {m.lower(): {}} for m, p in self._routes}})

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
                "logprobs_mode": "raw_logprobs"}}})

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
        return httpx.Response(200, json={"status": "sleeping", "level": int(raw)})

    def _wake(self, request: httpx.Request) -> httpx.Response:
        tags = request.url.params.get_list("tags")
        awake = True
        for t in tags or ["all"]:
            awake = self.engine.wake(t)
        return httpx.Response(200, json={"status": "awake" if awake else "sleeping",
                                         "tags": tags or None})

    def _reset_prefix(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"success": self.engine.reset_prefix_cache()})

    # -- generating ------------------------------------------------------------

    def _generate(self, request: httpx.Request) -> httpx.Response:
        body = self._body(request)
        ids, sp = body.get("token_ids"), body.get("sampling_params") or {}
        if not isinstance(ids, list) or not ids or any(
                isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size
                for t in ids):
            raise BadInput(f"token_ids must be a non-empty list of ids below {self.vocab_size}")
        if not isinstance(sp, dict):
            raise BadInput("sampling_params must be an object")
        n = sp.get("max_tokens", 16)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise BadInput("max_tokens must be an int >= 1")
        model = body.get("model", self.model)
        with self._lock:
            lora = model if model in self.loras else None
        if model != self.model and lora is None:
            return _error(404, f"The model `{model}` does not exist.", "NotFoundError")
        salt = body.get("cache_salt")
        # An adapter computes differently from the base: its name salts its KV and tokens
        key = None if salt is None and lora is None else f"{salt}|{lora}"
        rid = str(body.get("request_id") or uuid.uuid4().hex)
        g = self.engine.generate([t % VOCAB for t in ids], n, request_id=rid, cache_salt=key)
        toks = [(t + _shift(lora)) % VOCAB for t in g.tokens]
        choice = {"index": 0, "token_ids": toks, "finish_reason": g.finish_reason,
                  "weight_versions": g.version_spans}
        lp = sp.get("logprobs")
        if lp is not None:
            choice["logprobs"] = {"content": [
                {"token_id": t, "logprob": -1.0,
                 "top_logprobs": [{"token_id": t, "logprob": -1.0}] if lp else []}
                for t in toks]}
        if body.get("stream"):
            return self._sse(rid, choice)
        return httpx.Response(200, json={"request_id": rid, "choices": [choice]})

    @staticmethod
    def _sse(rid: str, choice: dict[str, Any]) -> httpx.Response:
        """The generation as one event per token, the spans on the last (vLLM 0.32)."""
        toks = choice["token_ids"]
        lps = (choice.get("logprobs") or {}).get("content")
        lines = []
        for i, t in enumerate(toks):
            last = i == len(toks) - 1
            ev = {"index": 0, "token_ids": [t],
                  "finish_reason": choice["finish_reason"] if last else None,
                  "weight_versions": choice["weight_versions"] if last else None}
            if lps is not None:
                ev["logprobs"] = {"content": [lps[i]]}
            lines.append(f"data: {json.dumps({'request_id': rid, 'choices': [ev]})}\n\n")
        lines.append("data: [DONE]\n\n")
        return httpx.Response(200, content="".join(lines).encode(),
                              headers={"content-type": "text/event-stream"})

    def _abort(self, request: httpx.Request) -> httpx.Response:
        ids = self._body(request).get("request_ids")
        if ids is not None and (not isinstance(ids, list)
                                or not all(isinstance(i, str) for i in ids)):
            raise BadInput("request_ids must be a list of strings")
        n = self.engine.abort(ids)
        return httpx.Response(200, json={"status": "aborted", "aborted": n})

    # -- weights ---------------------------------------------------------------

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
        if not (Path(path) / "adapter_config.json").is_file():  # vLLM reads the PEFT config
            return _error(404, f"Loading lora {name} failed: No adapter found for {path}",
                          "NotFoundError")
        with self._lock:
            self.loras[name] = path
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


def _shift(lora: str | None) -> int:
    return 0 if lora is None else hashlib.sha256(lora.encode()).digest()[0] or 1

