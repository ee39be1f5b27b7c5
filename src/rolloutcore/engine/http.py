"""``VllmHTTP``: a thin, typed client of one vLLM server's own HTTP surface.

The dev endpoints of ``VLLM_SERVER_DEV_MODE=1``, ``/metrics``, token-in /
token-out generation. Every call has a timeout; every failure leaves as a
``rolloutcore.errors`` exception, translated at one point
(``rolloutcore.engine.errors``, shared with every other client of vLLM);
every answer is parsed once, here, into a typed result (``wire``).

What this client does not say is whether the engine's weights may have
changed when a call failed (``EffectError.mutation_started`` is left
``True``, unknown): none of its calls moves weights, but a reset after a
transfer meets weights the transfer changed. The adapter's step knows, and
says so once per step (``adapter.STEP_MAY_MUTATE``).

Rules it keeps:

* **Capabilities come from ``/openapi.json``**, never from a version string.
* **A 200 is not a success.** ``/reset_prefix_cache`` answers
  ``{"success": false}`` with HTTP 200 when KV blocks are still held;
  ``/reset_encoder_cache`` and ``/reset_mm_cache`` answer an empty 200
  whatever happened: their evidence says so.
* **A stuck call can be unblocked from another thread.** Closing an httpx
  client does not wake a thread blocked in ``recv``; shutting the socket
  down does. The client learns the socket of every connection it opens
  (through httpcore's public ``trace`` extension) so that
  ``cancel_inflight()`` can shut them all down; the blocked call then fails
  at once and is reported as a timeout of its step.
"""

from __future__ import annotations

import json
import math
import re
import socket
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import httpx

from rolloutcore.core.evidence import CacheKind, CacheResetEvidence, PauseMode
from rolloutcore.core.media import ImageRef, MediaLimits, decode_image_url
from rolloutcore.core.strict import check_int, check_timeout
from rolloutcore.engine.client import EngineClient
from rolloutcore.engine.close_state import MARK_HEADER, OPS_SAMPLES
from rolloutcore.engine.errors import map_errors, route_url, snippet, status_error
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.stream import GenerationStream, chunk_of
from rolloutcore.engine.wire import (
    Completion,
    Generation,
    MetricsSnapshot,
    WeightInfo,
    WeightOps,
    logprob_token_id,
)
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable
from rolloutcore.transports import engine_key
from rolloutcore.verification.checksums import WeightChecksums, strip_rank

__all__ = ["CACHE_ROUTES", "KEEPALIVE_S", "GenerationStream", "Routes", "VllmHTTP",
           "check_timeout"]


CACHE_ROUTES: Mapping[CacheKind, str] = {
    CacheKind.PREFIX: Routes.RESET_PREFIX,
    CacheKind.ENCODER: Routes.RESET_ENCODER,
    CacheKind.MULTIMODAL: Routes.RESET_MM,
}

#: The samples ``weight_ops`` reads, and where vLLM renders only those (``weight_ops``).
_OPS_SAMPLES = OPS_SAMPLES
_OPS_PATH = Routes.METRICS + "/"
#: One Prometheus text sample: name, {labels}, value (timestamps are not used by vLLM).
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)')


def _label(labels: str, key: str) -> str | None:
    m = re.search(rf'(?:^|,){key}="([^"]*)"', labels)
    return None if m is None else m.group(1)

#: How long an idle pooled connection is reused. vLLM's server closes one
#: after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by default), httpx's default
#: reuse is also 5 s, and a request sent on a connection the server is
#: closing fails with "Server disconnected without sending a response": on
#: ``/pause`` that reads as an engine failure. Seen on a loaded 2-core machine.
KEEPALIVE_S = 2.0


def _put_ids(body: dict[str, Any], **ids: object) -> None:
    """``request_id`` / ``cache_salt`` into a generate body: each a non-empty string or None."""
    for name, value in ids.items():
        if value is not None:
            if not isinstance(value, str) or not value:
                raise BadInput(f"{name} must be a non-empty string")
            body[name] = value


class VllmHTTP:
    """A typed httpx client of one vLLM server. Thread-safe.

    Every method takes ``timeout_s`` (default: the client's). Failures are
    ``engine.errors``'s: a timeout ``EffectTimeout``, no connection
    ``EngineUnreachable``, a broken one or a 5xx ``EngineUnavailable``, a
    route the engine does not offer ``EngineRefused``, a 4xx on a request we
    built ``RequestRejected`` (a ``BadInput``), an answer we cannot read
    ``EffectError``.
    """

    def __init__(self, base_url: str, *, timeout_s: float = 30.0,
                 transport: httpx.BaseTransport | None = None,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise BadInput(f"base_url must be an http(s) URL, got {base_url!r}")
        if isinstance(keepalive_s, bool) or not isinstance(keepalive_s, (int, float)) or not (
                math.isfinite(keepalive_s) and keepalive_s >= 0):
            raise BadInput(f"keepalive_s must be a number of seconds >= 0, got {keepalive_s!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = check_timeout(timeout_s)
        self._client = EngineClient(self.base_url, transport=transport,
                                    timeout_s=self.timeout_s, keepalive_s=keepalive_s).http
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._cancels = 0
        self._capabilities: frozenset[str] | None = None
        self._model: str | None = None
        self._closed = False
        self._urls: dict[str, Any] = {}  # route -> httpx.URL (route_url)
        #: Whether ``/metrics/`` answers ``weight_ops``' restricted read (None: not tried;
        #: False: its first try was not a 200, so it is not asked again).
        self._ops_filtered: bool | None = None

    # -- plumbing -----------------------------------------------------------

    def _trace(self, event: str, info: Mapping[str, Any]) -> None:
        # httpcore's public trace extension: remember each new connection's socket
        # so that cancel_inflight() can shut it down from another thread.
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if isinstance(sock, socket.socket):
                with self._lock:
                    self._sockets.add(sock)

    def cancel_inflight(self) -> int:
        """Shut down every connection of this client; blocked calls return at once.

        Idle pooled connections go too (the pool opens new ones). Returns how
        many sockets were shut down.
        """
        with self._lock:
            self._cancels += 1
            socks = list(self._sockets)
            self._sockets.clear()
        n = 0
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
                n += 1
            except OSError:
                pass  # already closed
        return n

    def _request(self, method: str, path: str, *, step: str, timeout_s: float | None,
                 params: Mapping[str, Any] | None = None, json_body: Any = None,
                 check_status: bool = True, mark: str | None = None) -> httpx.Response:
        what = f"{method} {path}"
        headers = engine_key.headers_for(self.base_url)
        if mark is not None:  # the reset the guard renders the counters at (close_state)
            headers = {**headers, MARK_HEADER: mark}
        if self._closed:
            raise EngineUnavailable(step, f"{what}: client is closed")
        t = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        with self._lock:
            cancels = self._cancels

        def cancelled() -> bool:
            with self._lock:
                return self._cancels != cancels

        with map_errors(step, what, timeout_s=t, cancelled=cancelled):
            resp = self._client.request(method, route_url(self._urls, self.base_url, path),
                                        params=params, json=json_body,
                                        timeout=t, headers=headers,
                                        extensions={"trace": self._trace})
        if check_status:
            caps = self._capabilities
            err = status_error(step, what, resp.status_code, resp.text,
                               offered=caps is None or path in caps)
            if err is not None:
                raise err
        return resp

    @staticmethod
    def _json(resp: httpx.Response, step: str) -> Any:
        try:
            return resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EffectError(step, f"malformed JSON from {resp.request.url.path}: "
                              f"{snippet(resp.text)!r}") from exc

    @staticmethod
    def _field(body: Any, key: str, kind: type | tuple[type, ...], step: str) -> Any:
        if not isinstance(body, dict) or not isinstance(body.get(key), kind) or (
                kind is int and isinstance(body.get(key), bool)):
            raise EffectError(step, f"unexpected answer (no {key!r} of type "
                              f"{getattr(kind, '__name__', kind)}): {snippet(str(body))}")
        return body[key]

    def _get_json(self, path: str, step: str, timeout_s: float | None,
                  params: Mapping[str, Any] | None = None) -> Any:
        return self._json(self._request("GET", path, step=step, timeout_s=timeout_s,
                                        params=params), step)

    # -- capabilities and identity -----------------------------------------

    def capabilities(self, *, refresh: bool = False,
                     timeout_s: float | None = None) -> frozenset[str]:
        """Route paths the server offers, from its ``/openapi.json``."""
        if self._capabilities is None or refresh:
            step = "capabilities"
            paths = self._field(self._get_json(Routes.OPENAPI, step, timeout_s), "paths", dict,
                                step)
            self._capabilities = frozenset(str(p) for p in paths)
        return self._capabilities

    def has(self, route: str, *, timeout_s: float | None = None) -> bool:
        return route in self.capabilities(timeout_s=timeout_s)

    def health(self, *, timeout_s: float | None = None) -> bool:
        """``True`` on 200; ``False`` when the server answers but its engine is dead."""
        resp = self._request("GET", Routes.HEALTH, step="health", timeout_s=timeout_s,
                             check_status=False)
        return resp.status_code == 200

    def version(self, *, timeout_s: float | None = None) -> str:
        step = "version"
        return str(self._field(self._get_json(Routes.VERSION, step, timeout_s),
                               "version", str, step))

    def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``/server_info?config_format=json``: the engine's config and environment."""
        step = "server_info"
        body = self._get_json(Routes.SERVER_INFO, step, timeout_s, {"config_format": "json"})
        if not isinstance(body, dict):
            raise EffectError(step, "server_info is not an object")
        return body

    def model(self, *, timeout_s: float | None = None) -> str:
        """The served model name (first of ``/v1/models``), cached."""
        if self._model is None:
            step = "models"
            data = self._field(self._get_json(Routes.MODELS, step, timeout_s), "data", list,
                               step)
            if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
                raise EffectError(step, "no served model listed")
            self._model = data[0]["id"]
        return self._model

    def models(self, *, timeout_s: float | None = None) -> dict[str, str | None]:
        """Every name ``/v1/models`` lists -> its ``parent`` (a LoRA adapter's; None: base)."""
        data = self._field(self._get_json(Routes.MODELS, "models", timeout_s), "data", list,
                           "models")
        if not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise EffectError("models", f"unexpected model list: {snippet(str(data))}")
        return {m["id"]: m["parent"] if isinstance(m.get("parent"), str) else None
                for m in data}

    def load_lora_adapter(self, name: str, path: str, *,
                          timeout_s: float | None = None) -> None:
        """``/v1/load_lora_adapter``, never ``load_inplace`` (vLLM 0.32 keys its prefix
        cache by (name, path): an in-place reload could serve the old KV). A name it
        holds is a 400 (``RequestRejected``); a 200 proves nothing: check the listing."""
        self._lora(Routes.LOAD_LORA, "load_adapter", timeout_s, lora_name=name, lora_path=path)

    def unload_lora_adapter(self, name: str, *, timeout_s: float | None = None) -> None:
        """``/v1/unload_lora_adapter``; an unknown name is a 404 (``RequestRejected``)."""
        self._lora(Routes.UNLOAD_LORA, "unload_adapter", timeout_s, lora_name=name)

    def _lora(self, route: str, step: str, timeout_s: float | None, **body: str) -> None:
        if not all(isinstance(v, str) and v for v in body.values()):
            raise BadInput(f"{step}: {sorted(body)} must be non-empty strings")
        self._request("POST", route, step=step, timeout_s=timeout_s, json_body=body)

    # -- pause / resume -----------------------------------------------------

    def pause(self, mode: PauseMode, *, clear_cache: bool = False,
              timeout_s: float | None = None) -> bool:
        """``/pause``. With ``WAIT`` it returns once the engine's in-flight work is done.

        Returns whether the answer itself says ``{"status": "paused"}``: vLLM
        sends it only after its engine core has paused the scheduler.
        """
        if not isinstance(mode, PauseMode):
            raise BadInput(f"mode must be a PauseMode, got {mode!r}")
        if not isinstance(clear_cache, bool):
            raise BadInput("clear_cache must be a bool")
        r = self._request("POST", Routes.PAUSE, step="pause", timeout_s=timeout_s,
                          params={"mode": mode.value, "clear_cache": str(clear_cache).lower()})
        return self._status_is(r, "paused")

    def resume(self, *, timeout_s: float | None = None) -> bool:
        """``/resume``; returns whether the answer says ``{"status": "resumed"}``."""
        r = self._request("POST", Routes.RESUME, step="resume", timeout_s=timeout_s)
        return self._status_is(r, "resumed")

    @staticmethod
    def _status_is(resp: httpx.Response, want: str) -> bool:
        try:
            body = resp.json()
        except ValueError:
            return False
        return isinstance(body, dict) and body.get("status") == want

    def is_paused(self, *, timeout_s: float | None = None) -> bool:
        step = "is_paused"
        return bool(self._field(self._get_json(Routes.IS_PAUSED, step, timeout_s),
                                "is_paused", bool, step))

    def is_sleeping(self, *, timeout_s: float | None = None) -> bool:
        step = "is_sleeping"
        return bool(self._field(self._get_json(Routes.IS_SLEEPING, step, timeout_s),
                                "is_sleeping", bool, step))

    # -- sleep mode (a CUDA engine started with --enable-sleep-mode) ---------

    def sleep(self, level: int, *, mode: PauseMode = PauseMode.WAIT,
              timeout_s: float | None = None) -> None:
        """``POST /sleep?level=N&mode=...``: pause (waiting for in-flight work with WAIT),
        then release the weights (offloaded at level 1, discarded at 2) and the KV cache.

        The answer says nothing the caller can rely on (vLLM 0.32: ``{"status":
        "sleeping"}``, whatever the worker did): read ``is_sleeping`` after.
        """
        if isinstance(level, bool) or level not in (1, 2):
            raise BadInput(f"sleep level must be 1 or 2, got {level!r}")
        if not isinstance(mode, PauseMode):
            raise BadInput(f"mode must be a PauseMode, got {mode!r}")
        self._request("POST", Routes.SLEEP, step="sleep", timeout_s=timeout_s,
                      params={"level": str(level), "mode": mode.value})

    def wake_up(self, tags: Sequence[str] | None = None, *,
                timeout_s: float | None = None) -> bool | None:
        """``POST /wake_up`` (``?tags=weights``, ``?tags=kv_cache``; none: everything).

        Returns whether the engine says it is fully awake (vLLM 0.32 answers
        ``{"status": "awake" | "sleeping"}``), or ``None`` when the answer
        does not say (an older vLLM answers an empty 200).
        """
        if tags is not None and (isinstance(tags, (str, bytes)) or not tags or any(
                t not in ("weights", "kv_cache") for t in tags)):
            raise BadInput(f"wake tags must be 'weights' and/or 'kv_cache', got {tags!r}")
        r = self._request("POST", Routes.WAKE_UP, step="wake_up", timeout_s=timeout_s,
                          params=None if tags is None else {"tags": list(tags)})
        if self._status_is(r, "awake"):
            return True
        if self._status_is(r, "sleeping"):
            return False
        return None

    # -- cache resets -------------------------------------------------------

    def _reset(self, kind: CacheKind, *, params: Mapping[str, Any] | None,
               timeout_s: float | None, mark: str | None = None) -> CacheResetEvidence:
        route = CACHE_ROUTES[kind]
        step = f"reset_{kind.value}_cache"
        if not self.has(route, timeout_s=timeout_s):
            return CacheResetEvidence(
                kind, None, None, detail=f"{route} not offered by this engine",
                unverified=(f"{kind.value} cache reset route absent: cache not reset",))
        t0 = time.monotonic()
        resp = self._request("POST", route, step=step, timeout_s=timeout_s, params=params,
                             mark=mark)
        elapsed = time.monotonic() - t0
        text = resp.text.strip()
        if not text:
            # vLLM answers these with an empty 200 whatever happened
            # ("we currently do not check if the ... cache is successfully reset").
            return CacheResetEvidence(
                kind, resp.status_code, None, elapsed_s=elapsed,
                unverified=(f"{kind.value} cache reset: the engine reports no success flag",))
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("success"), bool):
            ok: bool = body["success"]
            return CacheResetEvidence(
                kind, resp.status_code, ok, elapsed_s=elapsed,
                detail="" if ok else "engine refused the reset (blocks still held, "
                                     "e.g. by running or paused-in-place requests)")
        # A body we do not understand is not a success: fail closed.
        return CacheResetEvidence(kind, resp.status_code, False, elapsed_s=elapsed,
                                  detail=f"unrecognised answer: {snippet(text)}")

    def reset_prefix_cache(self, *, reset_running_requests: bool = False,
                           timeout_s: float | None = None) -> CacheResetEvidence:
        """Reset the KV prefix cache; ``engine_success`` is the engine's own flag.

        ``reset_running_requests=True`` preempts running requests first (they
        recompute their KV from scratch) so that the reset cannot be refused.
        """
        if not isinstance(reset_running_requests, bool):
            raise BadInput("reset_running_requests must be a bool")
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        return self._reset(CacheKind.PREFIX, params=params, timeout_s=timeout_s)

    def reset_encoder_cache(self, *, timeout_s: float | None = None) -> CacheResetEvidence:
        return self._reset(CacheKind.ENCODER, params=None, timeout_s=timeout_s)

    def reset_mm_cache(self, *, timeout_s: float | None = None) -> CacheResetEvidence:
        return self._reset(CacheKind.MULTIMODAL, params=None, timeout_s=timeout_s)

    def reset_cache(self, kind: CacheKind, *, timeout_s: float | None = None,
                    mark: str | None = None) -> CacheResetEvidence:
        if not isinstance(kind, CacheKind):
            raise BadInput(f"not a CacheKind: {kind!r}")
        return self._reset(kind, params=None, timeout_s=timeout_s, mark=mark)

    # -- weights ------------------------------------------------------------

    def weight_info(self, *, timeout_s: float | None = None) -> WeightInfo:
        """The engine's ``weight_version``; ``label_supported=False`` without the route."""
        if not self.has(Routes.WEIGHT_INFO, timeout_s=timeout_s):
            return WeightInfo(None, False)
        step = "weight_info"
        body = self._get_json(Routes.WEIGHT_INFO, step, timeout_s)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EffectError(step, f"unexpected answer: {snippet(str(body))}")
        v = body["weight_version"]
        if v is not None and not isinstance(v, str):
            raise EffectError(step, f"weight_version is not a string: {v!r}")
        return WeightInfo(v, True)

    def label(self, *, timeout_s: float | None = None) -> str | None:
        return self.weight_info(timeout_s=timeout_s).label

    def set_weight_version(self, label: str, *, timeout_s: float | None = None) -> None:
        """``POST /update_weight_version``: only for a cold-loaded engine.

        A label written after a transfer can be seen before it is true (the
        transports put it in the finish call instead); after a cold load of
        a known checkpoint, with nothing admitted, it is the only way to name
        what the process loaded (``engine.recovery``).
        """
        if not isinstance(label, str) or not label or any(c.isspace() for c in label):
            raise BadInput(f"label must be a non-empty string without spaces, got {label!r}")
        self._request("POST", Routes.UPDATE_WEIGHT_VERSION, step="update_weight_version",
                      timeout_s=timeout_s, json_body={"new_version": label})

    def weight_checksums(self, *, timeout_s: float | None = None) -> WeightChecksums:
        """``/weight_checker {"action": "checksum"}``: one sha256 per engine parameter.

        ``EffectError`` when the engine has no checker; callers that can do
        without check ``has(Routes.WEIGHT_CHECKER)``. (Its ``reset`` action
        zeroes the weights and is deliberately not exposed.)
        """
        step = "weight_checksum"
        if not self.has(Routes.WEIGHT_CHECKER, timeout_s=timeout_s):
            raise EffectError(step, "engine has no /weight_checker")
        body = self._json(self._request("POST", Routes.WEIGHT_CHECKER, step=step,
                                        timeout_s=timeout_s, json_body={"action": "checksum"}),
                          step)
        raw = self._field(body, "checksums", dict, step)
        names = [strip_rank(k) for k in raw]
        dup = {n for n in names if names.count(n) > 1}
        digests: dict[str, str] = {}
        raw_keys: dict[str, str] = {}
        for key, digest in raw.items():
            if not isinstance(digest, str):
                raise EffectError(step, f"checksum of {key} is not a string")
            name = strip_rank(key)
            name = key if name in dup else name
            digests[name] = digest.lower()
            raw_keys[name] = key
        return WeightChecksums(digests, raw_keys)

    # -- metrics ------------------------------------------------------------

    def _ops_text(self, step: str, timeout_s: float | None) -> str:
        """``weight_ops``' samples: ``/metrics/`` restricted by ``name[]`` while the
        engine answers it 200, else the whole ``/metrics`` (see ``weight_ops``)."""
        if self._ops_filtered is not False:
            resp = self._request("GET", _OPS_PATH, step=step, timeout_s=timeout_s,
                                 params={"name[]": list(_OPS_SAMPLES)}, check_status=False)
            if resp.status_code == 200:
                self._ops_filtered = True
                return resp.text
            if self._ops_filtered is None:  # never answered: an engine without the mount
                self._ops_filtered = False
        return self._request("GET", Routes.METRICS, step=step, timeout_s=timeout_s).text

    def metrics(self, *, timeout_s: float | None = None) -> MetricsSnapshot:
        """One scrape of ``/metrics``, parsed with ``prometheus_client.parser``."""
        from prometheus_client.parser import text_string_to_metric_families

        step = "metrics"
        resp = self._request("GET", Routes.METRICS, step=step, timeout_s=timeout_s)
        values: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(resp.text):
                for s in family.samples:
                    if "le" in s.labels or "quantile" in s.labels:
                        continue
                    values[s.name] = values.get(s.name, 0.0) + float(s.value)
        except ValueError as exc:
            raise EffectError(step, f"unparseable metrics: {exc}") from exc
        return MetricsSnapshot(values, time.time())

    def weight_ops(self, *, timeout_s: float | None = None) -> WeightOps:
        """vLLM's count of weight-transfer operations and its sleep state, from ``/metrics``.

        Read line by line (only the three families it needs), not through a
        full Prometheus parse: the health watch reads it every few seconds, and
        an update twice (beside its pause, beside its first cache reset).

        Only those families are rendered where the engine can: vLLM mounts
        ``prometheus_client``'s own exposition app at ``/metrics/`` (its
        workaround for the 307 of ``/metrics/``), which takes ``name[]`` and
        collects only the named metrics from the same registry as ``/metrics``
        (``_OPS_SAMPLES``). On the CPU engine that is ~0.5 KB in about 4 ms instead
        of the whole registry's ~50 KB in 13-15 ms, on the API server's event loop
        the update's own calls wait on. Any other answer there than a 200 (an
        engine without that mount: a 404 or the 307) and the whole ``/metrics`` is
        read, as before; the parse below is the same for both, so the counters are.
        """
        step = "weight_ops"
        return self.parse_ops(self._ops_text(step, timeout_s), step)

    @staticmethod
    def parse_ops(text: str, step: str) -> WeightOps:
        """``weight_ops``' parse of the samples' text (also ``engine.close_state``'s)."""
        done: dict[str, float] = {}
        flight: dict[str, float] = {}
        awake: bool | None = None
        for line in text.splitlines():
            if not line.startswith(("vllm:rl_weight_update_", "vllm:engine_sleep_state{")):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.group(1), m.group(2) or "", m.group(3)
            try:
                v = float(value)
            except ValueError as exc:
                raise EffectError(step, f"unparseable metric line {snippet(line)!r}") from exc
            op = _label(labels, "operation")
            if name == "vllm:rl_weight_update_operation_duration_seconds_count" and op:
                done[op] = done.get(op, 0.0) + v
            elif name == "vllm:rl_weight_update_operations_in_flight" and op:
                flight[op] = flight.get(op, 0.0) + v
            elif name == "vllm:engine_sleep_state" and _label(labels, "sleep_state") == "awake":
                awake = (awake or False) or v >= 1.0
        return WeightOps(done, flight, awake)

    # -- generation ---------------------------------------------------------

    @staticmethod
    def _sampling(max_tokens: int, temperature: float, logprobs: bool, seed: int | None,
                  ignore_eos: bool, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        check_int("max_tokens", max_tokens, 1)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or (
                not math.isfinite(temperature) or temperature < 0):
            raise BadInput(f"temperature must be a finite number >= 0, got {temperature!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadInput(f"seed must be an int or None, got {seed!r}")
        sp: dict[str, Any] = {"max_tokens": max_tokens, "temperature": float(temperature),
                              "ignore_eos": bool(ignore_eos)}
        if logprobs:
            sp["logprobs"] = 0
        if seed is not None:
            sp["seed"] = seed
        if extra:
            sp.update(extra)
        return sp

    @staticmethod
    def _token_ids(token_ids: Sequence[int]) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise BadInput("token_ids must be a sequence of ints")
        ids = list(token_ids)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                              for t in ids):
            raise BadInput("token_ids must be a non-empty sequence of ints >= 0")
        return ids

    def _model_or(self, model: str | None, timeout_s: float | None) -> str:
        if model is None:  # the base; else a LoRA adapter's name
            return self.model(timeout_s=timeout_s)
        if not isinstance(model, str) or not model:
            raise BadInput("model must be a non-empty string")
        return model

    def _post_json(self, path: str, step: str, body: Any, timeout_s: float | None) -> Any:
        return self._json(self._request("POST", path, step=step, timeout_s=timeout_s,
                                        json_body=body), step)

    def generate(self, token_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 logprobs: bool = True, seed: int | None = None, ignore_eos: bool = False,
                 request_id: str | None = None, sampling_extra: Mapping[str, Any] | None = None,
                 images: Sequence[str] = (), timeout_s: float | None = None,
                 cache_salt: str | None = None, model: str | None = None) -> Generation:
        """Token-in/token-out ``/inference/v1/generate`` (needs ``--enable-scale-out``).

        ``cache_salt`` (top level of the body) is the version salt of the
        prefix cache (``core.cache_salt``): blocks of another salt are never hit.

        ``images`` are ``data:`` URLs sent as vLLM's ``content_parts``; the
        prompt must hold the model's image placeholder token once per image
        (vLLM expands it). They are checked like the gateway checks them, and
        described in ``Generation.media``.
        """
        step = "generate"
        media, parts = self._images(images)
        body: dict[str, Any] = {
            "model": self._model_or(model, timeout_s),
            "token_ids": self._token_ids(token_ids),
            "sampling_params": self._sampling(max_tokens, temperature, logprobs, seed,
                                              ignore_eos, sampling_extra),
        }
        if parts:
            body["content_parts"] = parts
        _put_ids(body, request_id=request_id, cache_salt=cache_salt)
        resp = self._post_json(Routes.GENERATE, step, body, timeout_s)
        try:  # choice 0, read as a streamed event's is
            if not resp.get("choices"):
                raise BadInput("no choices")
            c = chunk_of(resp, logprobs, 0.0)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # BadInput too
            raise EffectError(step, f"unexpected generate answer: {exc}: "
                              f"{snippet(json.dumps(resp))}") from exc
        return Generation(str(resp.get("request_id", body.get("request_id", ""))), c.token_ids,
                          c.logprobs, c.finish_reason, c.weight_versions, media)

    def top_logprobs(self, token_ids: Sequence[int], *, max_tokens: int, top: int,
                     model: str | None = None, timeout_s: float | None = None
                     ) -> list[tuple[int, dict[int, float]]]:
        """Greedy continuation: each token and the engine's ``top`` logprobs at its position
        (the sampling path: see ``verification.adapters``)."""
        check_int("top", top, 1, 20)
        resp = self._post_json(Routes.GENERATE, "generate", {
            "model": self._model_or(model, timeout_s), "token_ids": self._token_ids(token_ids),
            "sampling_params": self._sampling(max_tokens, 0.0, False, None, True,
                                              {"logprobs": top, "detokenize": False})},
            timeout_s)
        try:
            return [(logprob_token_id(c), {logprob_token_id(c): float(c["logprob"]), **{
                logprob_token_id(t): float(t["logprob"]) for t in c.get("top_logprobs") or ()}})
                for c in resp["choices"][0]["logprobs"]["content"]]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EffectError("generate", f"unexpected generate answer: {exc}: "
                              f"{snippet(json.dumps(resp))}") from exc

    def generate_stream(self, token_ids: Sequence[int], *, max_tokens: int,
                        temperature: float = 0.0, logprobs: bool = True,
                        seed: int | None = None, ignore_eos: bool = False,
                        request_id: str | None = None, cache_salt: str | None = None,
                        sampling_extra: Mapping[str, Any] | None = None,
                        read_timeout_s: float = 300.0) -> GenerationStream:
        """Streamed ``/inference/v1/generate``: the events as they come, each timestamped.

        ``cache_salt`` goes in the body's top level (vLLM hashes it into the
        first KV block). ``read_timeout_s`` bounds each silence, which must
        outlast an update that keeps the request frozen.
        """
        body: dict[str, Any] = {
            "model": self.model(), "token_ids": self._token_ids(token_ids),
            "sampling_params": self._sampling(max_tokens, temperature, logprobs, seed,
                                              ignore_eos, sampling_extra),
            "stream": True, "stream_options": {"include_usage": True}}
        _put_ids(body, request_id=request_id, cache_salt=cache_salt)
        if self._closed:
            raise EngineUnavailable("generate", "client is closed")
        trace = self._trace

        def open_stream(timeout: httpx.Timeout) -> AbstractContextManager[httpx.Response]:
            return self._client.stream("POST", Routes.GENERATE, json=body, timeout=timeout,
                                       headers=engine_key.headers_for(self.base_url),
                                       extensions={"trace": trace})

        return GenerationStream(open_stream, f"POST {Routes.GENERATE} (stream)",
                                check_timeout(read_timeout_s), logprobs)

    def complete(self, prompt: str | Sequence[int], *, max_tokens: int,
                 temperature: float = 0.0, logprobs: bool = True, seed: int | None = None,
                 ignore_eos: bool = False, timeout_s: float | None = None) -> Completion:
        """OpenAI ``/v1/completions`` with one prompt (text or token ids)."""
        step = "completions"
        if isinstance(prompt, str):
            if not prompt:
                raise BadInput("prompt must be non-empty")
            p: str | list[int] = prompt
        else:
            p = self._token_ids(prompt)
        sp = self._sampling(max_tokens, temperature, False, seed, ignore_eos, None)
        body: dict[str, Any] = {"model": self.model(timeout_s=timeout_s),
                                "prompt": p, "return_token_ids": True, **sp}
        if logprobs:
            body["logprobs"] = 0
        resp = self._post_json(Routes.COMPLETIONS, step, body, timeout_s)
        try:
            ch = resp["choices"][0]
            ids = ch.get("token_ids")
            lp = ch.get("logprobs")
            return Completion(
                str(ch["text"]), None if ids is None else tuple(int(t) for t in ids),
                None if not lp else tuple(None if x is None else float(x)
                                          for x in lp["token_logprobs"]),
                ch.get("finish_reason"))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EffectError(step, f"unexpected completions answer: {exc}") from exc

    def score(self, token_ids: Sequence[int], *, images: Sequence[str] = (),
              timeout_s: float | None = None, model: str | None = None
              ) -> list[float | None]:
        """Teacher-forced log-probability of every token of ``token_ids`` (the first is None).

        One ``/inference/v1/generate`` call with ``prompt_logprobs=0``: the
        engine scores the sequence as a prompt and generates one token that
        is ignored. Used by the policy probe and the replay validator.

        With ``images`` (``data:`` URLs, one placeholder token each in
        ``token_ids``) the engine expands each placeholder into the image's
        tokens, so the answer has one entry per token of the *expanded*
        prompt (vLLM returns it, and the logprobs are aligned to it).
        """
        step = "score"
        ids = self._token_ids(token_ids)
        _, parts = self._images(images)
        body: dict[str, Any] = {
            "model": self._model_or(model, timeout_s),
            "token_ids": ids,
            # Token ids only: the engine's detokenization of every prompt position's
            # logprob was ~2/3 of a 6 x 176-token probe on a CPU engine (84 vs 29 ms,
            # benchmarks/score_cost.py); the answer is keyed by token id either way.
            "sampling_params": self._sampling(1, 0.0, False, None, True,
                                              {"prompt_logprobs": 0, "detokenize": False}),
        }
        if parts:
            body["content_parts"] = parts
            body["return_token_ids"] = True
        resp = self._post_json(Routes.GENERATE, step, body, timeout_s)

        def unexpected(why: object) -> EffectError:
            return EffectError(step, f"unexpected score answer: {why}: "
                               f"{snippet(json.dumps(resp))}")

        try:
            if parts:
                ids = [int(t) for t in resp["prompt_token_ids"]]
            raw = resp["prompt_logprobs"]
            out: list[float | None] = []
            for pos, entry in enumerate(raw):
                if entry is None:
                    out.append(None)
                    continue
                tok = ids[pos]
                e = entry.get(str(tok), entry.get(tok)) if isinstance(entry, dict) else None
                out.append(None if e is None else float(e["logprob"]))
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise unexpected(exc) from exc
        if len(out) != len(ids):
            raise unexpected(f"{len(out)} prompt logprobs for {len(ids)} tokens")
        return out

    @staticmethod
    def _images(images: Sequence[str]) -> tuple[tuple[ImageRef, ...], list[dict[str, str]]]:
        if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
            raise BadInput("images must be a sequence of data: URLs")
        lim = MediaLimits()
        if len(images) > lim.max_images:
            raise BadInput(f"{len(images)} images, more than the limit of {lim.max_images}")
        refs = tuple(decode_image_url(u, lim)[0] for u in images)
        return refs, [{"type": "image_url", "url": u} for u in images]

    def close(self) -> None:
        self._closed = True
        self._client.close()

    def __enter__(self) -> VllmHTTP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"VllmHTTP({self.base_url})"
