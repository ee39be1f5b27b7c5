"""The vLLM adapter: lifecycle effects on a real vLLM server, over HTTP.

Two layers:

* ``VllmHTTP`` is a thin, typed client of vLLM's own HTTP surface (the dev
  endpoints of ``VLLM_SERVER_DEV_MODE=1``, ``/metrics``, token-in/token-out
  generation). Every call has a timeout; every failure leaves it as a
  ``rolloutcore.errors`` exception (``raise ... from exc``); every answer is
  parsed once, at this edge, into a typed result.
* ``VllmAdapter`` implements the port (``rolloutcore.control.port.LifecycleAdapter``)
  over a ``VllmHTTP`` and a weight transport, and returns evidence.

Rules this module keeps:

* **Capabilities come from ``/openapi.json``**, never from a version string.
  vLLM 0.26 has pause/resume, the weight-transfer endpoints and the cache
  resets, but no ``/weight_info``, no ``/weight_checker`` and no per-token
  ``weight_versions``; 0.32 has all of them. What the engine does not offer
  is stated in ``Evidence.unverified`` instead of being assumed.
* **A 200 is not a success.** ``/reset_prefix_cache`` answers
  ``{"success": false}`` with HTTP 200 when KV blocks are still held (for
  example by a request frozen by ``/pause?mode=keep``); that is
  ``engine_success=False``. ``/reset_encoder_cache`` and ``/reset_mm_cache``
  answer an empty 200 whatever happened: their evidence says so.
* **A checksum of zero bytes proves nothing.** vLLM's CPU backend repacks the
  fused linear layers; ``/weight_checker`` then hashes them to the sha256 of
  the empty string. Those parameters are *unverifiable*, never matches.
* **A stuck call can be unblocked from another thread.** Closing an httpx
  client does not wake a thread blocked in ``recv``; shutting the socket
  down does. ``VllmHTTP`` learns the socket of every connection it opens
  (through httpcore's public ``trace`` extension) so that ``cancel()`` can
  shut them all down; the blocked call then fails at once and is reported as
  a timeout of its step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import httpx

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    Check,
    DrainEvidence,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    ResumeEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
)
from rolloutcore.core.media import ImageRef, MediaLimits, decode_image_url
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    EngineUnavailable,
    RolloutCoreError,
    TransferError,
)
from rolloutcore.provenance.trajectory import EngineIdentity
from rolloutcore.transports.base import WeightTransport
from rolloutcore.transports.source import WeightSource

__all__ = [
    "CACHE_ROUTES",
    "engine_identity",
    "EMPTY_SHA256",
    "KEEPALIVE_S",
    "ChecksumComparison",
    "Completion",
    "Generation",
    "MetricsSnapshot",
    "PrefixCacheDelta",
    "ProbeSet",
    "Routes",
    "VersionSpan",
    "VllmAdapter",
    "VllmHTTP",
    "WeightChecksums",
    "WeightInfo",
    "compare_checksums",
    "prefix_cache_delta",
]

#: sha256 of zero bytes: what ``/weight_checker`` reports for a parameter it
#: could not read (repacked CPU weights). Never a match.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


class Routes:
    """vLLM's route paths that RolloutCore uses, as ``/openapi.json`` lists them."""

    HEALTH = "/health"
    VERSION = "/version"
    SERVER_INFO = "/server_info"
    MODELS = "/v1/models"
    METRICS = "/metrics"
    PAUSE = "/pause"
    RESUME = "/resume"
    IS_PAUSED = "/is_paused"
    IS_SLEEPING = "/is_sleeping"
    RESET_PREFIX = "/reset_prefix_cache"
    RESET_ENCODER = "/reset_encoder_cache"
    RESET_MM = "/reset_mm_cache"
    WEIGHT_INFO = "/weight_info"
    WEIGHT_CHECKER = "/weight_checker"
    GENERATE = "/inference/v1/generate"
    COMPLETIONS = "/v1/completions"


CACHE_ROUTES: Mapping[CacheKind, str] = {
    CacheKind.PREFIX: Routes.RESET_PREFIX,
    CacheKind.ENCODER: Routes.RESET_ENCODER,
    CacheKind.MULTIMODAL: Routes.RESET_MM,
}

_OPENAPI = "/openapi.json"
_BODY_SNIPPET = 300

#: How long an idle pooled connection is reused. vLLM's server closes one
#: after ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE`` (5 s by default), httpx's default
#: reuse is also 5 s, and a request sent on a connection the server is
#: closing fails with "Server disconnected without sending a response": on
#: ``/pause`` that reads as an engine failure. Seen on a loaded 2-core machine.
KEEPALIVE_S = 2.0


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class WeightInfo:
    """The engine's weight-version label; ``None`` where it has none (vLLM 0.26)."""

    label: str | None
    label_supported: bool


@dataclass(frozen=True)
class VersionSpan:
    """Output tokens ``[start, end)`` were sampled by weights the engine labels ``version``."""

    version: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise BadInput(f"bad weight-version span [{self.start}, {self.end})")


@dataclass(frozen=True)
class Generation:
    """One choice of ``/inference/v1/generate``.

    ``logprobs`` are the sampled tokens' logprobs (``None`` if not asked);
    ``weight_versions`` is ``None`` when the engine does not report spans;
    ``media`` describes the images sent with the prompt (for its trajectory).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    weight_versions: tuple[VersionSpan, ...] | None
    media: tuple[ImageRef, ...] = ()

    def versions(self) -> frozenset[str]:
        """The labels that sampled at least one output token."""
        return frozenset(s.version for s in self.weight_versions or () if s.end > s.start)


@dataclass(frozen=True)
class Completion:
    """One choice of ``/v1/completions``."""

    text: str
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float | None, ...] | None
    finish_reason: str | None


@dataclass(frozen=True)
class MetricsSnapshot:
    """Prometheus samples of one ``/metrics`` scrape, summed over label sets.

    Histogram buckets and summary quantiles are left out (their sum over
    labels means nothing); counters and gauges are kept by sample name, so
    ``values["vllm:prefix_cache_hits_total"]`` is the engine-wide total.
    """

    values: Mapping[str, float]
    taken_at: float

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class PrefixCacheDelta:
    """Prefix-cache tokens queried and hit between two scrapes (after minus before)."""

    queries: float
    hits: float

    @property
    def hit_rate(self) -> float | None:
        return None if self.queries == 0 else self.hits / self.queries


@dataclass(frozen=True)
class WeightChecksums:
    """``/weight_checker`` checksums keyed by parameter name, rank prefix stripped.

    ``raw_keys`` maps each name back to the engine's key
    (``dp0:pp0:pcp0:tp0:<name>``). With several ranks a name can repeat, so
    such names keep their full key.
    """

    digests: Mapping[str, str]
    raw_keys: Mapping[str, str]

    @property
    def total(self) -> int:
        return len(self.digests)

    @property
    def unverifiable(self) -> frozenset[str]:
        """Parameters the engine hashed as zero bytes: their content cannot be checked."""
        return frozenset(n for n, d in self.digests.items() if d == EMPTY_SHA256)

    @property
    def hashable(self) -> frozenset[str]:
        return frozenset(n for n, d in self.digests.items() if d != EMPTY_SHA256)

    @property
    def coverage(self) -> float:
        """Fraction of parameters whose content the engine could hash at all."""
        return 0.0 if not self.digests else len(self.hashable) / len(self.digests)


@dataclass(frozen=True)
class ChecksumComparison:
    """Engine checksums against a reference map. Unverifiable never counts as matched."""

    total: int
    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unverifiable: tuple[str, ...]
    no_reference: tuple[str, ...]
    missing_in_engine: tuple[str, ...]

    @property
    def compared(self) -> int:
        return len(self.matched) + len(self.mismatched)

    @property
    def coverage(self) -> float:
        """Fraction of the engine's parameters whose content was actually compared."""
        return 0.0 if self.total == 0 else self.compared / self.total

    @property
    def passed(self) -> bool:
        return not self.mismatched and not self.missing_in_engine and self.compared > 0

    def detail(self) -> str:
        parts = [f"{len(self.matched)}/{self.total} matched",
                 f"{len(self.unverifiable)} unverifiable (zero-byte hash)"]
        if self.no_reference:
            parts.append(f"{len(self.no_reference)} without reference")
        if self.mismatched:
            parts.append("MISMATCH: " + ", ".join(self.mismatched[:8])
                         + (" ..." if len(self.mismatched) > 8 else ""))
        if self.missing_in_engine:
            parts.append("missing in engine: " + ", ".join(self.missing_in_engine[:8]))
        if self.compared == 0:
            parts.append("nothing compared")
        return "; ".join(parts)

    def to_check(self, name: str = "engine_checksum") -> Check:
        return Check(name=name, passed=self.passed, detail=self.detail(),
                     coverage=self.coverage, level=VerificationLevel.ENGINE_CHECKSUM)


_RANK_PREFIX = re.compile(r"^(?:[a-z]+\d+:)+")


def _strip_rank(key: str) -> str:
    """``"dp0:pp0:pcp0:tp0:model.x.weight"`` -> ``"model.x.weight"``."""
    return _RANK_PREFIX.sub("", key, count=1)


def compare_checksums(engine: WeightChecksums, reference: Mapping[str, str]) -> ChecksumComparison:
    """Compare engine checksums with a reference keyed by parameter name (or raw key).

    A parameter the engine hashed as zero bytes is unverifiable whatever the
    reference says; a reference entry the engine does not have is a failure.
    """
    if not isinstance(reference, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reference.items()):
        raise BadInput("reference checksums must be a mapping of str to str")
    by_raw = {raw: name for name, raw in engine.raw_keys.items()}
    ref: dict[str, str] = {}
    missing: list[str] = []
    for k, v in reference.items():
        name = k if k in engine.digests else by_raw.get(k)
        if name is None:
            missing.append(k)
        else:
            ref[name] = v.lower()
    matched, mismatched, unverifiable, no_ref = [], [], [], []
    for name, digest in sorted(engine.digests.items()):
        if digest == EMPTY_SHA256:
            unverifiable.append(name)
        elif name not in ref:
            no_ref.append(name)
        elif ref[name] == digest:
            matched.append(name)
        else:
            mismatched.append(name)
    return ChecksumComparison(engine.total, tuple(matched), tuple(mismatched),
                              tuple(unverifiable), tuple(no_ref), tuple(sorted(missing)))


def engine_identity(http: VllmHTTP, *, timeout_s: float | None = None) -> EngineIdentity:
    """What a trajectory records about the engine, read from the engine (``/server_info``).

    The settings that decide whether a sample can be replayed exactly (dtype,
    context, logprobs mode, prefix caching), never assumed by the caller.
    """
    cfg = http.server_info(timeout_s=timeout_s, mutation_started=False).get("vllm_config") or {}
    mc = cfg.get("model_config") or {}
    cc = cfg.get("cache_config") or {}
    config = {"dtype": str(mc.get("dtype", "")).removeprefix("torch.") or None,
              "max_model_len": mc.get("max_model_len"),
              "logprobs_mode": mc.get("logprobs_mode"),
              "enable_prefix_caching": cc.get("enable_prefix_caching")}
    return EngineIdentity(http.version(timeout_s=timeout_s, mutation_started=False),
                          http.model(timeout_s=timeout_s, mutation_started=False),
                          {k: v for k, v in config.items() if v is not None}, http.base_url)


def prefix_cache_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> PrefixCacheDelta:
    """Prefix-cache queries and hits between two scrapes of one engine incarnation."""
    out = []
    for name in (PREFIX_QUERIES, PREFIX_HITS):
        a, b = after.get(name), before.get(name)
        if a is None or b is None:
            raise BadInput(f"metric {name} missing from a snapshot "
                           "(is prefix caching enabled?)")
        if a < b:
            raise BadInput(f"{name} went down ({b} -> {a}): the snapshots come from "
                           "different engine incarnations")
        out.append(a - b)
    return PrefixCacheDelta(queries=out[0], hits=out[1])


# --------------------------------------------------------------------------- HTTP client


def _snippet(text: str) -> str:
    text = text.strip()
    return text if len(text) <= _BODY_SNIPPET else text[:_BODY_SNIPPET] + "..."


def _timeout(v: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise BadInput(f"timeout must be a positive number of seconds, got {v!r}")
    return float(v)


class VllmHTTP:
    """A typed httpx client of one vLLM server. Thread-safe.

    Every method takes ``timeout_s`` (default: the client's) and
    ``mutation_started``: what the caller knows about whether the engine's
    weights may already have changed, copied into any ``EffectError`` raised.
    Connection errors and 5xx raise ``EngineUnavailable``, timeouts
    ``EffectTimeout``, a 4xx on a request we built ``BadInput``.
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
        self.timeout_s = _timeout(timeout_s)
        self._client = httpx.Client(base_url=self.base_url, transport=transport,
                                    timeout=self.timeout_s,
                                    limits=httpx.Limits(keepalive_expiry=keepalive_s))
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._cancels = 0
        self._capabilities: frozenset[str] | None = None
        self._model: str | None = None
        self._closed = False

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
                 mutation_started: bool, params: Mapping[str, Any] | None = None,
                 json_body: Any = None, check_status: bool = True) -> httpx.Response:
        if self._closed:
            raise EngineUnavailable(step, "client is closed", mutation_started=mutation_started)
        t = self.timeout_s if timeout_s is None else _timeout(timeout_s)
        with self._lock:
            cancels = self._cancels
        t0 = time.monotonic()
        try:
            resp = self._client.request(method, path, params=params, json=json_body,
                                        timeout=t, extensions={"trace": self._trace})
        except httpx.TimeoutException as exc:
            raise EffectTimeout(step, t, mutation_started=mutation_started) from exc
        except httpx.TransportError as exc:
            with self._lock:
                cancelled = self._cancels != cancels
            if cancelled:
                raise EffectTimeout(step, time.monotonic() - t0,
                                    mutation_started=mutation_started) from exc
            raise EngineUnavailable(step, f"{method} {path}: {type(exc).__name__}: {exc}",
                                    mutation_started=mutation_started) from exc
        if not check_status:
            return resp
        if resp.status_code >= 500:
            raise EngineUnavailable(
                step, f"{method} {path} answered HTTP {resp.status_code}: "
                f"{_snippet(resp.text)}", mutation_started=mutation_started)
        caps = self._capabilities
        if resp.status_code == 403 or (resp.status_code in (404, 405) and caps is not None
                                       and path not in caps):
            # The engine does not offer this route, or refuses it by configuration
            # (no VLLM_SERVER_DEV_MODE, no --enable-scale-out): not our request's fault.
            raise EffectError(step, f"{method} {path} not offered by this engine (HTTP "
                              f"{resp.status_code}): {_snippet(resp.text)}",
                              mutation_started=mutation_started)
        if resp.status_code >= 400:
            try:
                resp.raise_for_status()
            except httpx.HTTPStatusError as exc:
                raise BadInput(f"{step}: {method} {path} refused with HTTP "
                               f"{resp.status_code}: {_snippet(resp.text)}") from exc
        return resp

    @staticmethod
    def _json(resp: httpx.Response, step: str, mutation_started: bool) -> Any:
        try:
            return resp.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise EffectError(step, f"malformed JSON from {resp.request.url.path}: "
                              f"{_snippet(resp.text)!r}",
                              mutation_started=mutation_started) from exc

    @staticmethod
    def _field(body: Any, key: str, kind: type | tuple[type, ...], step: str,
               mutation_started: bool) -> Any:
        if not isinstance(body, dict) or not isinstance(body.get(key), kind) or (
                kind is int and isinstance(body.get(key), bool)):
            raise EffectError(step, f"unexpected answer (no {key!r} of type "
                              f"{getattr(kind, '__name__', kind)}): {_snippet(str(body))}",
                              mutation_started=mutation_started)
        return body[key]

    # -- capabilities and identity -----------------------------------------

    def capabilities(self, *, refresh: bool = False, timeout_s: float | None = None,
                     mutation_started: bool = True) -> frozenset[str]:
        """Route paths the server offers, from its ``/openapi.json``."""
        if self._capabilities is None or refresh:
            step = "capabilities"
            body = self._json(self._request("GET", _OPENAPI, step=step, timeout_s=timeout_s,
                                            mutation_started=mutation_started),
                              step, mutation_started)
            paths = self._field(body, "paths", dict, step, mutation_started)
            self._capabilities = frozenset(str(p) for p in paths)
        return self._capabilities

    def has(self, route: str, *, timeout_s: float | None = None,
            mutation_started: bool = True) -> bool:
        return route in self.capabilities(timeout_s=timeout_s, mutation_started=mutation_started)

    def health(self, *, timeout_s: float | None = None, mutation_started: bool = True) -> bool:
        """``True`` on 200; ``False`` when the server answers but its engine is dead."""
        resp = self._request("GET", Routes.HEALTH, step="health", timeout_s=timeout_s,
                             mutation_started=mutation_started, check_status=False)
        return resp.status_code == 200

    def version(self, *, timeout_s: float | None = None, mutation_started: bool = True) -> str:
        step = "version"
        body = self._json(self._request("GET", Routes.VERSION, step=step, timeout_s=timeout_s,
                                        mutation_started=mutation_started),
                          step, mutation_started)
        return str(self._field(body, "version", str, step, mutation_started))

    def server_info(self, *, timeout_s: float | None = None,
                    mutation_started: bool = True) -> dict[str, Any]:
        """``/server_info?config_format=json``: the engine's config and environment."""
        step = "server_info"
        body = self._json(self._request("GET", Routes.SERVER_INFO, step=step,
                                        timeout_s=timeout_s, mutation_started=mutation_started,
                                        params={"config_format": "json"}),
                          step, mutation_started)
        if not isinstance(body, dict):
            raise EffectError(step, "server_info is not an object",
                              mutation_started=mutation_started)
        return body

    def model(self, *, timeout_s: float | None = None, mutation_started: bool = True) -> str:
        """The served model name (first of ``/v1/models``), cached."""
        if self._model is None:
            step = "models"
            body = self._json(self._request("GET", Routes.MODELS, step=step,
                                            timeout_s=timeout_s,
                                            mutation_started=mutation_started),
                              step, mutation_started)
            data = self._field(body, "data", list, step, mutation_started)
            if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
                raise EffectError(step, "no served model listed", mutation_started=mutation_started)
            self._model = data[0]["id"]
        return self._model

    # -- pause / resume -----------------------------------------------------

    def pause(self, mode: PauseMode, *, clear_cache: bool = False, timeout_s: float | None = None,
              mutation_started: bool = True) -> bool:
        """``/pause``. With ``WAIT`` it returns once the engine's in-flight work is done.

        Returns whether the answer itself says ``{"status": "paused"}``: vLLM
        sends it only after its engine core has paused the scheduler.
        """
        if not isinstance(mode, PauseMode):
            raise BadInput(f"mode must be a PauseMode, got {mode!r}")
        if not isinstance(clear_cache, bool):
            raise BadInput("clear_cache must be a bool")
        r = self._request("POST", Routes.PAUSE, step="pause", timeout_s=timeout_s,
                          mutation_started=mutation_started,
                          params={"mode": mode.value, "clear_cache": str(clear_cache).lower()})
        return self._status_is(r, "paused")

    def resume(self, *, timeout_s: float | None = None, mutation_started: bool = True) -> bool:
        """``/resume``; returns whether the answer says ``{"status": "resumed"}``."""
        r = self._request("POST", Routes.RESUME, step="resume", timeout_s=timeout_s,
                          mutation_started=mutation_started)
        return self._status_is(r, "resumed")

    @staticmethod
    def _status_is(resp: httpx.Response, want: str) -> bool:
        try:
            body = resp.json()
        except ValueError:
            return False
        return isinstance(body, dict) and body.get("status") == want

    def is_paused(self, *, timeout_s: float | None = None, mutation_started: bool = True) -> bool:
        step = "is_paused"
        body = self._json(self._request("GET", Routes.IS_PAUSED, step=step, timeout_s=timeout_s,
                                        mutation_started=mutation_started),
                          step, mutation_started)
        return bool(self._field(body, "is_paused", bool, step, mutation_started))

    def is_sleeping(self, *, timeout_s: float | None = None,
                    mutation_started: bool = True) -> bool:
        step = "is_sleeping"
        body = self._json(self._request("GET", Routes.IS_SLEEPING, step=step,
                                        timeout_s=timeout_s,
                                        mutation_started=mutation_started),
                          step, mutation_started)
        return bool(self._field(body, "is_sleeping", bool, step, mutation_started))

    # -- cache resets -------------------------------------------------------

    def _reset(self, kind: CacheKind, *, params: Mapping[str, Any] | None,
               timeout_s: float | None, mutation_started: bool) -> CacheResetEvidence:
        route = CACHE_ROUTES[kind]
        step = f"reset_{kind.value}_cache"
        if not self.has(route, timeout_s=timeout_s, mutation_started=mutation_started):
            return CacheResetEvidence(
                kind, None, None, detail=f"{route} not offered by this engine",
                unverified=(f"{kind.value} cache reset route absent: cache not reset",))
        t0 = time.monotonic()
        resp = self._request("POST", route, step=step, timeout_s=timeout_s,
                             mutation_started=mutation_started, params=params)
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
                                  detail=f"unrecognised answer: {_snippet(text)}")

    def reset_prefix_cache(self, *, reset_running_requests: bool = False,
                           timeout_s: float | None = None,
                           mutation_started: bool = True) -> CacheResetEvidence:
        """Reset the KV prefix cache; ``engine_success`` is the engine's own flag.

        ``reset_running_requests=True`` preempts running requests first (they
        recompute their KV from scratch) so that the reset cannot be refused.
        """
        if not isinstance(reset_running_requests, bool):
            raise BadInput("reset_running_requests must be a bool")
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        return self._reset(CacheKind.PREFIX, params=params, timeout_s=timeout_s,
                           mutation_started=mutation_started)

    def reset_encoder_cache(self, *, timeout_s: float | None = None,
                            mutation_started: bool = True) -> CacheResetEvidence:
        return self._reset(CacheKind.ENCODER, params=None, timeout_s=timeout_s,
                           mutation_started=mutation_started)

    def reset_mm_cache(self, *, timeout_s: float | None = None,
                       mutation_started: bool = True) -> CacheResetEvidence:
        return self._reset(CacheKind.MULTIMODAL, params=None, timeout_s=timeout_s,
                           mutation_started=mutation_started)

    def reset_cache(self, kind: CacheKind, *, timeout_s: float | None = None,
                    mutation_started: bool = True) -> CacheResetEvidence:
        if not isinstance(kind, CacheKind):
            raise BadInput(f"not a CacheKind: {kind!r}")
        return self._reset(kind, params=None, timeout_s=timeout_s,
                           mutation_started=mutation_started)

    # -- weights ------------------------------------------------------------

    def weight_info(self, *, timeout_s: float | None = None,
                    mutation_started: bool = True) -> WeightInfo:
        """The engine's ``weight_version``; ``label_supported=False`` without the route."""
        if not self.has(Routes.WEIGHT_INFO, timeout_s=timeout_s,
                        mutation_started=mutation_started):
            return WeightInfo(None, False)
        step = "weight_info"
        body = self._json(self._request("GET", Routes.WEIGHT_INFO, step=step,
                                        timeout_s=timeout_s,
                                        mutation_started=mutation_started),
                          step, mutation_started)
        if not isinstance(body, dict) or "weight_version" not in body:
            raise EffectError(step, f"unexpected answer: {_snippet(str(body))}",
                              mutation_started=mutation_started)
        v = body["weight_version"]
        if v is not None and not isinstance(v, str):
            raise EffectError(step, f"weight_version is not a string: {v!r}",
                              mutation_started=mutation_started)
        return WeightInfo(v, True)

    def label(self, *, timeout_s: float | None = None,
              mutation_started: bool = True) -> str | None:
        return self.weight_info(timeout_s=timeout_s, mutation_started=mutation_started).label

    def weight_checksums(self, *, timeout_s: float | None = None,
                         mutation_started: bool = True) -> WeightChecksums:
        """``/weight_checker {"action": "checksum"}``: one sha256 per engine parameter.

        ``EffectError`` (``mutation_started`` as given) when the engine has no
        checker; callers that can do without check ``has(Routes.WEIGHT_CHECKER)``.
        (Its ``reset`` action zeroes the weights and is deliberately not exposed.)
        """
        step = "weight_checksum"
        if not self.has(Routes.WEIGHT_CHECKER, timeout_s=timeout_s,
                        mutation_started=mutation_started):
            raise EffectError(step, "engine has no /weight_checker",
                              mutation_started=mutation_started)
        body = self._json(self._request("POST", Routes.WEIGHT_CHECKER, step=step,
                                        timeout_s=timeout_s, mutation_started=mutation_started,
                                        json_body={"action": "checksum"}),
                          step, mutation_started)
        raw = self._field(body, "checksums", dict, step, mutation_started)
        names = [_strip_rank(k) for k in raw]
        dup = {n for n in names if names.count(n) > 1}
        digests: dict[str, str] = {}
        raw_keys: dict[str, str] = {}
        for key, digest in raw.items():
            if not isinstance(digest, str):
                raise EffectError(step, f"checksum of {key} is not a string",
                                  mutation_started=mutation_started)
            name = _strip_rank(key)
            name = key if name in dup else name
            digests[name] = digest.lower()
            raw_keys[name] = key
        return WeightChecksums(digests, raw_keys)

    # -- metrics ------------------------------------------------------------

    def metrics(self, *, timeout_s: float | None = None,
                mutation_started: bool = True) -> MetricsSnapshot:
        """One scrape of ``/metrics``, parsed with ``prometheus_client.parser``."""
        from prometheus_client.parser import text_string_to_metric_families

        step = "metrics"
        resp = self._request("GET", Routes.METRICS, step=step, timeout_s=timeout_s,
                             mutation_started=mutation_started)
        values: dict[str, float] = {}
        try:
            for family in text_string_to_metric_families(resp.text):
                for s in family.samples:
                    if "le" in s.labels or "quantile" in s.labels:
                        continue
                    values[s.name] = values.get(s.name, 0.0) + float(s.value)
        except ValueError as exc:
            raise EffectError(step, f"unparseable metrics: {exc}",
                              mutation_started=mutation_started) from exc
        return MetricsSnapshot(values, time.time())

    # -- generation ---------------------------------------------------------

    @staticmethod
    def _sampling(max_tokens: int, temperature: float, logprobs: bool, seed: int | None,
                  ignore_eos: bool, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadInput(f"max_tokens must be an int >= 1, got {max_tokens!r}")
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

    def generate(self, token_ids: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 logprobs: bool = True, seed: int | None = None, ignore_eos: bool = False,
                 request_id: str | None = None, sampling_extra: Mapping[str, Any] | None = None,
                 images: Sequence[str] = (), timeout_s: float | None = None,
                 mutation_started: bool = True) -> Generation:
        """Token-in/token-out ``/inference/v1/generate`` (needs ``--enable-scale-out``).

        ``images`` are ``data:`` URLs sent as vLLM's ``content_parts``; the
        prompt must hold the model's image placeholder token once per image
        (vLLM expands it). They are checked like the gateway checks them, and
        described in ``Generation.media``.
        """
        step = "generate"
        media, parts = self._images(images)
        body: dict[str, Any] = {
            "model": self.model(timeout_s=timeout_s, mutation_started=mutation_started),
            "token_ids": self._token_ids(token_ids),
            "sampling_params": self._sampling(max_tokens, temperature, logprobs, seed,
                                              ignore_eos, sampling_extra),
        }
        if parts:
            body["content_parts"] = parts
        if request_id is not None:
            if not isinstance(request_id, str) or not request_id:
                raise BadInput("request_id must be a non-empty string")
            body["request_id"] = request_id
        resp = self._json(self._request("POST", Routes.GENERATE, step=step, timeout_s=timeout_s,
                                        mutation_started=mutation_started, json_body=body),
                          step, mutation_started)
        try:
            ch = resp["choices"][0]
            toks = tuple(int(t) for t in ch.get("token_ids") or ())
            lps: tuple[float, ...] | None = None
            if logprobs:
                content = (ch.get("logprobs") or {}).get("content") or []
                lps = tuple(float(c["logprob"]) for c in content)
                if len(lps) != len(toks):
                    raise ValueError(f"{len(lps)} logprobs for {len(toks)} tokens")
            spans_raw = ch.get("weight_versions")
            spans = None if spans_raw is None else tuple(
                VersionSpan(str(s["version"]), int(s["start"]), int(s["end"]))
                for s in spans_raw)
            return Generation(str(resp.get("request_id", body.get("request_id", ""))), toks, lps,
                              ch.get("finish_reason"), spans, media)
        except (KeyError, IndexError, TypeError, ValueError, BadInput) as exc:
            raise EffectError(step, f"unexpected generate answer: {exc}: "
                              f"{_snippet(json.dumps(resp))}",
                              mutation_started=mutation_started) from exc

    def complete(self, prompt: str | Sequence[int], *, max_tokens: int,
                 temperature: float = 0.0, logprobs: bool = True, seed: int | None = None,
                 ignore_eos: bool = False, timeout_s: float | None = None,
                 mutation_started: bool = True) -> Completion:
        """OpenAI ``/v1/completions`` with one prompt (text or token ids)."""
        step = "completions"
        if isinstance(prompt, str):
            if not prompt:
                raise BadInput("prompt must be non-empty")
            p: str | list[int] = prompt
        else:
            p = self._token_ids(prompt)
        sp = self._sampling(max_tokens, temperature, False, seed, ignore_eos, None)
        body: dict[str, Any] = {"model": self.model(timeout_s=timeout_s,
                                                    mutation_started=mutation_started),
                                "prompt": p, "return_token_ids": True, **sp}
        if logprobs:
            body["logprobs"] = 0
        resp = self._json(self._request("POST", Routes.COMPLETIONS, step=step,
                                        timeout_s=timeout_s, mutation_started=mutation_started,
                                        json_body=body),
                          step, mutation_started)
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
            raise EffectError(step, f"unexpected completions answer: {exc}",
                              mutation_started=mutation_started) from exc

    def score(self, token_ids: Sequence[int], *, images: Sequence[str] = (),
              timeout_s: float | None = None,
              mutation_started: bool = True) -> list[float | None]:
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
            "model": self.model(timeout_s=timeout_s, mutation_started=mutation_started),
            "token_ids": ids,
            "sampling_params": self._sampling(1, 0.0, False, None, True,
                                              {"prompt_logprobs": 0}),
        }
        if parts:
            body["content_parts"] = parts
            body["return_token_ids"] = True
        resp = self._json(self._request("POST", Routes.GENERATE, step=step, timeout_s=timeout_s,
                                        mutation_started=mutation_started, json_body=body),
                          step, mutation_started)
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
            if len(out) != len(ids):
                raise ValueError(f"{len(out)} prompt logprobs for {len(ids)} tokens")
            return out
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EffectError(step, f"unexpected score answer: {exc}: "
                              f"{_snippet(json.dumps(resp))}",
                              mutation_started=mutation_started) from exc

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


# --------------------------------------------------------------------------- adapter


@runtime_checkable
class ProbeSet(Protocol):
    """Behavioural validation (issue 9): run fixed probes, compare with expectations.

    Provided by another module; the adapter calls it after resume with
    admission still closed and records the returned check.
    """

    def run(self, http: VllmHTTP, target: UpdateTarget) -> Check:
        ...


@dataclass
class _Staged:
    source: WeightSource
    provenance: Provenance | None
    reference_checksums: Mapping[str, str] | None
    probes: ProbeSet | None
    manifest_digest: str


class VllmAdapter:
    """``LifecycleAdapter`` for one vLLM server: ``VllmHTTP`` + a weight transport.

    The trainer side calls ``stage(source, ...)`` before each update; the
    runner then drives ``drain -> preflight -> transfer -> reset_cache ->
    validate -> resume -> validate(live=True)``. ``engine_epoch`` should come
    from the launcher (``ManagedEngine.epoch``); without it the adapter derives
    one from the engine's ``instance_id`` (new on every process start).
    """

    def __init__(self, http: VllmHTTP, transport: WeightTransport | None = None, *,
                 engine_epoch: str | None = None, probes: ProbeSet | None = None,
                 drain_timeout_s: float = 120.0, transfer_timeout_s: float = 300.0,
                 connect_timeout_s: float = 120.0, early_transport_check: bool = True) -> None:
        if not isinstance(http, VllmHTTP):
            raise BadInput("http must be a VllmHTTP")
        if engine_epoch is not None and (not isinstance(engine_epoch, str) or not engine_epoch):
            raise BadInput("engine_epoch must be a non-empty string or None")
        if probes is not None and not isinstance(probes, ProbeSet):
            raise BadInput("probes must implement ProbeSet.run(http, target) -> Check")
        self.http = http
        self.transport = transport
        self.probes = probes
        self._epoch = engine_epoch
        self._drain_timeout_s = _timeout(drain_timeout_s)
        self._transfer_timeout_s = _timeout(transfer_timeout_s)
        self._connect_timeout_s = _timeout(connect_timeout_s)
        self._staged: _Staged | None = None
        self._connected = False
        self._caches: tuple[CacheKind, ...] = tuple(CacheKind)
        self._sleeping_at_drain: bool | None = None
        # The engine's enable_sleep_mode, read at bootstrap (None: not known).
        self._sleep_mode: bool | None = None
        self._side_pool: ThreadPoolExecutor | None = None
        if not isinstance(early_transport_check, bool):
            raise BadInput("early_transport_check must be a boolean")
        # The transport's own check of what it installed, started as soon as the
        # transfer returns (see ``transfer``) and collected by the paused validation.
        self.early_transport_check = early_transport_check
        self._early: tuple[UpdateTarget, Future[Check], Future[bool] | None] | None = None
        # vLLM's instance_id at bootstrap (None: the engine does not say); a
        # different one later means the engine process was replaced behind us.
        self._instance_id: str | None = None

    @classmethod
    def for_engine(cls, engine: Any, transport: WeightTransport | None = None, *,
                   timeout_s: float = 30.0, **kw: Any) -> VllmAdapter:
        """An adapter for a launcher's engine (anything with ``base_url`` and ``epoch``)."""
        return cls(VllmHTTP(engine.base_url, timeout_s=timeout_s), transport,
                   engine_epoch=str(engine.epoch), **kw)

    # -- trainer side -------------------------------------------------------

    def stage(self, source: WeightSource, *, provenance: Provenance | None = None,
              reference_checksums: Mapping[str, str] | None = None,
              probes: ProbeSet | None = None) -> None:
        """Set what the next transfer sends, and what the next validation compares with.

        ``source`` is a ``rolloutcore.transports.source.WeightSource``; ``reference_checksums``
        are ``/weight_checker``-style sha256 digests of the target's engine
        parameters; ``probes`` override the adapter's default probe set.
        """
        if not isinstance(source, WeightSource):
            raise BadInput(f"source must be a WeightSource, got {type(source).__name__} "
                           "(WeightSource.of() takes a module, a state dict or a checkpoint)")
        if provenance is not None and not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance or None")
        if reference_checksums is not None:
            if not isinstance(reference_checksums, Mapping) or not reference_checksums or \
                    not all(isinstance(k, str) and isinstance(v, str)
                            for k, v in reference_checksums.items()):
                raise BadInput("reference_checksums must be a non-empty mapping of str to str")
            reference_checksums = dict(reference_checksums)
        if probes is not None and not isinstance(probes, ProbeSet):
            raise BadInput("probes must implement ProbeSet.run(http, target) -> Check")
        self._staged = _Staged(source, provenance, reference_checksums, probes,
                               source.manifest().digest)

    @property
    def staged(self) -> WeightSource | None:
        return None if self._staged is None else self._staged.source

    # -- port ---------------------------------------------------------------

    @property
    def caches(self) -> tuple[CacheKind, ...]:
        """Caches with a reset route (all three until ``bootstrap`` has read the routes)."""
        return self._caches

    def bootstrap(self) -> BootstrapEvidence:
        t0 = time.monotonic()
        h = self.http
        unverified: list[str] = []
        healthy = h.health(mutation_started=False)
        if not healthy:
            # The API server answers but its engine is dead: describe nothing more.
            return BootstrapEvidence(self._epoch or f"vllm-dead-{uuid.uuid4().hex[:12]}",
                                     False, elapsed_s=time.monotonic() - t0,
                                     unverified=("engine unhealthy: not described",))
        caps = h.capabilities(refresh=True, mutation_started=False)
        self._caches = tuple(k for k in CacheKind if CACHE_ROUTES[k] in caps)
        info: dict[str, Any] = {"base_url": h.base_url, "model": h.model(mutation_started=False)}
        info["vllm_version"] = (h.version(mutation_started=False)
                                if Routes.VERSION in caps else None)
        instance_id = None
        if Routes.SERVER_INFO in caps:
            si = h.server_info(mutation_started=False)
            cfg = si.get("vllm_config")
            if isinstance(cfg, dict):
                instance_id = cfg.get("instance_id")
                wt = cfg.get("weight_transfer_config")
                info["weight_transfer_config"] = wt
                mc = cfg.get("model_config")
                sleep = mc.get("enable_sleep_mode") if isinstance(mc, dict) else None
                self._sleep_mode = sleep if isinstance(sleep, bool) else None
                info["enable_sleep_mode"] = self._sleep_mode
        info["instance_id"] = instance_id
        self._instance_id = instance_id if isinstance(instance_id, str) and instance_id else None
        epoch = self._epoch
        if epoch is None:
            if instance_id:
                epoch = f"vllm-{instance_id}"
            else:
                epoch = f"vllm-unidentified-{uuid.uuid4().hex[:12]}"
                unverified.append("engine incarnation not identifiable (no instance_id): "
                                  "epoch is local to this adapter")
            self._epoch = epoch
        wi = h.weight_info(mutation_started=False)
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        if Routes.WEIGHT_CHECKER not in caps:
            unverified.append("no /weight_checker: engine checksums not available")
        if Routes.GENERATE not in caps:
            unverified.append("no /inference/v1/generate: per-token weight versions not seen")
        missing = [k.value for k in CacheKind if k not in self._caches]
        if missing:
            unverified.append(f"cache reset routes absent: {', '.join(missing)}")
        if Routes.IS_PAUSED in caps:
            info["paused"] = h.is_paused(mutation_started=False)
        if self.transport is not None:
            wt = info.get("weight_transfer_config")
            engine_backend = wt.get("backend") if isinstance(wt, dict) else None
            if Routes.SERVER_INFO in caps and engine_backend != self.transport.backend:
                # Connecting would block on a handshake the engine never joins.
                raise EngineUnavailable(
                    "bootstrap", f"engine weight-transfer backend is {engine_backend!r}, "
                    f"the transport is {self.transport.backend!r} (start the engine with "
                    f"--weight-transfer-config {json.dumps(self.transport.engine_config())})",
                    mutation_started=False)
            self._ensure_connected(self.transport, EngineUnavailable, "bootstrap")
            info["transport"] = self.transport.backend
        return BootstrapEvidence(epoch, healthy, wi.label, wi.label_supported, caps, info,
                                 elapsed_s=time.monotonic() - t0, unverified=tuple(unverified))

    def _ensure_connected(self, transport: WeightTransport,
                          error: type[EngineUnavailable | TransferError], step: str) -> None:
        """The transport's init handshake (no weights change), once per engine."""
        if self._connected:
            return
        try:
            transport.connect(self.http.base_url, timeout_s=self._connect_timeout_s)
        except RolloutCoreError:
            raise
        except Exception as exc:
            raise error(step, f"transport connect failed: {exc!r}",
                        mutation_started=False) from exc
        self._connected = True

    def drain(self, mode: PauseMode) -> DrainEvidence:
        """``/pause?mode=...&clear_cache=false`` then ``/is_paused``.

        The cache is never cleared here: invalidation is its own step, after the
        transfer, with its own evidence.
        """
        if not isinstance(mode, PauseMode):
            raise BadInput(f"mode must be a PauseMode, got {mode!r}")
        t0 = time.monotonic()
        self._sleeping_at_drain = self._sleep_state()
        said = self.http.pause(mode, clear_cache=False, timeout_s=self._drain_timeout_s,
                               mutation_started=False)
        # The answer is sent once the engine core has paused; only an answer
        # that does not say so costs a second round trip to ask.
        paused = said or self.http.is_paused(mutation_started=False)
        return DrainEvidence(paused, mode, elapsed_s=time.monotonic() - t0,
                             unverified=("engine in-flight count not observed "
                                         "(the pause call's return is the drain signal)",))

    def _sleep_state(self) -> bool | None:
        """Whether the engine's weights are asleep; ``None`` when it cannot be told.

        vLLM's ``/is_sleeping`` is true when the engine sleeps *or* is paused,
        so it is read before the drain's pause, and a paused engine is unknown.
        (An update into sleeping weights writes to freed memory: vLLM #57853.)
        """
        h = self.http
        if self._sleep_mode is False:
            return False  # started without sleep mode: its weights cannot be put to sleep
        if Routes.IS_SLEEPING not in h.capabilities(mutation_started=False):
            return None
        if not h.is_sleeping(mutation_started=False):
            return False
        if Routes.IS_PAUSED in h.capabilities(mutation_started=False) and \
                not h.is_paused(mutation_started=False):
            return True
        return None

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        """Compare the staged source with the target's identity. Mutates nothing."""
        t0 = time.monotonic()
        if not isinstance(target, UpdateTarget):
            raise BadInput("target must be an UpdateTarget")
        unverified = ["engine parameter manifest not compared "
                      "(vLLM fuses and renames parameters)"]
        st = self._staged
        if st is None:
            return PreflightEvidence("", None, detail="no weight source staged for this update",
                                     elapsed_s=time.monotonic() - t0,
                                     unverified=tuple(unverified))
        details = []
        want_content = target.identity.content_digest
        if want_content is not None:
            got = st.source.content_digest()
            if got != want_content:
                details.append(f"source content digest {got[:12]} differs from the "
                               f"target's {want_content[:12]}")
        else:
            unverified.append("target declares no content digest: source content not checked")
        if st.provenance is None:
            unverified.append("no provenance staged with the source: provenance not compared")
        if self._sleeping_at_drain is True:
            details.append("engine was asleep when drained: weights cannot be updated")
        elif self._sleeping_at_drain is None:
            unverified.append("engine sleep state unknown (vLLM's is_sleeping also reports "
                              "a pause): not checked")
        return PreflightEvidence(st.manifest_digest, st.provenance, None,
                                 detail="; ".join(details), elapsed_s=time.monotonic() - t0,
                                 unverified=tuple(unverified))

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        if self._staged is None or self.transport is None:
            raise TransferError("transfer", "no weight source staged" if self.transport
                                else "no weight transport", mutation_started=False)
        self._ensure_connected(self.transport, TransferError, "transfer")
        self._early = None
        try:
            ev = self.transport.send(self.http.base_url, target.version.label,
                                     self._staged.source, timeout_s=self._transfer_timeout_s)
        except RolloutCoreError:
            raise
        except Exception as exc:
            raise TransferError("transfer", f"{type(exc).__name__}: {exc}",
                                mutation_started=True) from exc
        # The update session is over and the engine stays paused until the runner
        # resumes it, after the validation: the transport's check of what it
        # installed (a read of the parameters on the workers) can start now and
        # overlap the cache reset, which does not touch weights. The validation
        # collects it, for this target only.
        # The paused state is read then too (the engine stays paused until the runner
        # resumes it after the validation, so a read from here on is inside the
        # same paused window as one taken during the validation).
        tcheck = getattr(self.transport, "validation_check", None)
        if self.early_transport_check and callable(tcheck):
            side = self._side()
            check = side.submit(tcheck, self.http.base_url)
            paused = (side.submit(self.http.is_paused)
                      if Routes.IS_PAUSED in self.http.capabilities() else None)
            self._early = (target, check, paused)
        return ev

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        return self.http.reset_cache(cache, mutation_started=True)

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        """``live=False``: label, paused state, engine checksums; ``live=True``: probes."""
        t0 = time.monotonic()
        h = self.http
        st = self._staged
        if live:
            probes = (st.probes if st is not None and st.probes is not None else self.probes)
            if probes is None:
                return None
            wi = h.weight_info()
            check = probes.run(h, target)
            if not isinstance(check, Check):
                raise EffectError("validate_live", f"probe set returned {type(check).__name__}, "
                                  "not a Check")
            live_paused = h.is_paused() if h.has(Routes.IS_PAUSED) else None
            return ValidationEvidence(wi.label, wi.label_supported, paused=live_paused,
                                      checks=(check,), elapsed_s=time.monotonic() - t0)
        unverified: list[str] = []
        wi = h.weight_info()
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        caps = h.capabilities()
        # A transport that can check what it installed (e.g. rc_cuda_ipc's block
        # checksum of the updated slices, computed on the workers) adds its own
        # evidence: on vLLM 0.26 it is the only evidence there is. The paused
        # state is read alongside it: both are taken inside the paused window
        # (only the runner resumes, after this returns), one round trip apart.
        tcheck = getattr(self.transport, "validation_check", None)
        early, self._early = self._early, None
        if early is not None and early[0] != target:
            early = None
        paused_read: Future[bool] | None = None
        if early is not None and early[2] is not None:
            paused_read = early[2]
        elif Routes.IS_PAUSED in caps and callable(tcheck):
            paused_read = self._side().submit(h.is_paused)
        checks: list[Check] = []
        ref = None if st is None else st.reference_checksums
        if Routes.WEIGHT_CHECKER not in caps:
            unverified.append("no /weight_checker: engine checksums not verified")
        elif ref is None:
            unverified.append("no reference checksums for the target: "
                              "engine checksums not compared")
        else:
            cmp = compare_checksums(h.weight_checksums(), ref)
            checks.append(cmp.to_check())
            if cmp.unverifiable:
                unverified.append(f"{len(cmp.unverifiable)} of {cmp.total} engine parameters "
                                  "hash as zero bytes (repacked): content not verifiable")
        if callable(tcheck):
            if early is not None:
                chk = early[1].result()
                if isinstance(chk, Check):
                    chk = dataclasses.replace(chk, detail=(
                        f"{chk.detail}; read after the transfer, alongside the cache reset"
                    ).lstrip("; "))
            else:
                chk = tcheck(h.base_url)
            if not isinstance(chk, Check):
                raise EffectError("validate", f"transport check returned {type(chk).__name__}")
            checks.append(chk)
        if paused_read is not None:
            paused: bool | None = paused_read.result()
        else:
            paused = h.is_paused() if Routes.IS_PAUSED in caps else None
        return ValidationEvidence(wi.label, wi.label_supported, paused=paused,
                                  checks=tuple(checks), elapsed_s=time.monotonic() - t0,
                                  unverified=tuple(unverified))

    def observe_health(self, *, timeout_s: float = 5.0) -> HealthEvidence:
        """Between updates: does the engine answer, is it healthy, is it the same process?

        ``/health``, then (when bootstrap saw an ``instance_id``)
        ``/server_info``'s ``instance_id``: a restarted engine answers healthy
        but serves its start checkpoint, which only the incarnation reveals.
        """
        t0 = time.monotonic()
        h = self.http
        try:
            healthy = h.health(timeout_s=timeout_s, mutation_started=False)
            now: object = None
            if healthy and self._instance_id is not None:
                cfg = h.server_info(timeout_s=timeout_s, mutation_started=False).get(
                    "vllm_config")
                now = cfg.get("instance_id") if isinstance(cfg, dict) else None
        except RolloutCoreError as exc:
            return HealthEvidence(False, False, reason=str(exc),
                                  elapsed_s=time.monotonic() - t0)
        restarted = healthy and self._instance_id is not None and now != self._instance_id
        reason = (f"instance_id {self._instance_id} is now {now}" if restarted
                  else "" if healthy else "/health answered non-200")
        return HealthEvidence(True, healthy, restarted, reason,
                              elapsed_s=time.monotonic() - t0)

    def _side(self) -> ThreadPoolExecutor:
        """Worker threads for engine reads that overlap another call (two: the early
        transport check and the paused-state read may be in flight together)."""
        if self._side_pool is None:
            self._side_pool = ThreadPoolExecutor(2, thread_name_prefix="rc-vllm-side")
        return self._side_pool

    def resume(self) -> ResumeEvidence:
        t0 = time.monotonic()
        said = self.http.resume()
        unverified: tuple[str, ...] = ()
        after: bool | None
        if said:  # sent once the engine core has resumed its scheduler
            after = False
        elif Routes.IS_PAUSED in self.http.capabilities():
            after = self.http.is_paused()
        else:
            after, unverified = None, ("no /is_paused: resume not confirmed",)
        return ResumeEvidence(True, after, elapsed_s=time.monotonic() - t0,
                              unverified=unverified)

    def fence(self) -> None:
        """Best effort: abort and hold everything. A tainted engine must serve no one."""
        with contextlib.suppress(RolloutCoreError):
            self.http.pause(PauseMode.ABORT, clear_cache=False,
                            timeout_s=min(10.0, self.http.timeout_s))

    def cancel(self, step: str) -> None:
        """Unblock ``step``, called from the runner's watchdog thread."""
        if step == "transfer" and self.transport is not None:
            # The transfer group is torn down: the next transfer reconnects.
            self._connected = False
            self.transport.abort()
        else:
            self.http.cancel_inflight()

    def close(self) -> None:
        try:
            if self.transport is not None:
                self.transport.close()
        finally:
            self._connected = False
            if self._side_pool is not None:
                self._side_pool.shutdown(wait=False)
                self._side_pool = None
            self.http.close()

    def __enter__(self) -> VllmAdapter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
