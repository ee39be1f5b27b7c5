"""The gateway's settings, checked once when the service is built.

Every limit the service enforces lives here (body size, lease length, queue
bound, upstream timeouts), so that a bad value fails at start with a
``BadInput`` naming the setting, never on the first request.

The bind rule is here too: a service that listens beyond loopback must have
been *given* a control token (a generated one is only acceptable on a
loopback address, where the operator reads it from the console) and a data
token: beyond loopback the data plane is never open.
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rolloutcore.core.media import MediaLimits
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput

__all__ = ["ServiceConfig", "check_bind", "is_loopback"]

#: The update modes a deployment may name (``core.vocab.UpdateMode``'s values).
_MODES = ("strict", "keep", "recompute", "engine_recompute")


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and the loopback ranges (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name other than localhost may resolve anywhere


def check_bind(host: str, control_token_given: bool, data_token_given: bool = False) -> None:
    """Refuse a non-loopback bind unless the operator gave a control *and* a data token.

    The data plane spends the engine's compute and its answers are training
    data: open to anyone who can reach a non-loopback address, it is neither
    private nor attributable to a known client.
    """
    if not isinstance(host, str) or not host:
        raise BadInput("host must be a non-empty string")
    if not is_loopback(host) and not control_token_given:
        raise BadInput(f"refusing to bind {host!r} (not loopback) without a control token: "
                       "pass --token or --token-file (or set ROLLOUTCORE_TOKEN)")
    if not is_loopback(host) and not data_token_given:
        raise BadInput(f"refusing to bind {host!r} (not loopback) with an open data plane: "
                       "pass --data-token (or set ROLLOUTCORE_DATA_TOKEN)")


def _positive(name: str, v: object, *, integer: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise BadInput(f"{name} must be a positive {'integer' if integer else 'number'}, "
                       f"got {v!r}")
    if not (v > 0 and math.isfinite(v)):
        raise BadInput(f"{name} must be a positive finite number, got {v!r}")


def _url(name: str, v: object) -> str:
    if not isinstance(v, str):
        raise BadInput(f"{name} must be a URL string, got {v!r}")
    p = urlsplit(v)
    if p.scheme not in ("http", "https") or not p.hostname:
        raise BadInput(f"{name} must be http(s)://host[:port], got {v!r}")
    return v.rstrip("/")


@dataclass(frozen=True)
class ServiceConfig:
    """Settings of one gateway in front of one vLLM server."""

    #: The vLLM server the data plane forwards to.
    upstream_url: str
    #: The engine URL handed to trainers for the weight transfer; defaults to
    #: ``upstream_url`` (differs when the trainer reaches vLLM by another route).
    engine_url: str | None = None
    #: Bearer token of the control endpoints (``/control/*``). Required.
    control_token: str = ""
    #: Bearer token of the data endpoints; ``None`` leaves them open.
    data_token: str | None = None
    #: Largest request body accepted on any endpoint.
    max_body_bytes: int = 1 << 20
    #: Requests refused during an update wait in a queue of at most this many
    #: (0: answer 503 + Retry-After at once).
    queue_max: int = 0
    #: How long a queued request waits for the update to end before its 503.
    queue_wait_s: float = 30.0
    #: Lease granted by a begin when the trainer asks for none, and the cap.
    lease_s: float = 120.0
    max_lease_s: float = 1800.0
    #: Upstream timeouts: connecting, and the longest silence while reading
    #: (a stream may last longer; each read waits at most this).
    upstream_connect_s: float = 5.0
    upstream_read_s: float = 300.0
    #: How long an idle upstream connection is kept for reuse; below vLLM's
    #: own keep-alive (5 s), so the gateway never reuses one vLLM is closing.
    upstream_keepalive_s: float = 4.0
    #: Connection pool towards vLLM.
    upstream_max_connections: int = 512
    #: What the trainer's transport needs besides the engine URL (backend
    #: name, its settings); returned verbatim by a begin.
    transport: Mapping[str, Any] = field(default_factory=dict)
    #: The model name requests use (reported by status; not enforced).
    model: str | None = None
    #: Transitions kept for ``/control/status``.
    history: int = 64
    #: Finished updates remembered for ``GET /control/updates/{id}``.
    remember_updates: int = 64
    #: Between updates the engine is watched (``/health`` and its process
    #: identity) every this many seconds; 0 turns the watch off. A restarted
    #: engine is tainted at once, one that stops answering after
    #: ``health_failures`` checks in a row, each given ``health_timeout_s``.
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 2
    #: Bounds on the images of one data-plane request (size, pixels, count);
    #: images must also fit in ``max_body_bytes``, base64-encoded.
    media: MediaLimits = field(default_factory=MediaLimits)
    # -- liveness and bounds of the data plane (#16): no client can hold an
    # update, a connection or the gateway's memory without limit.
    #: The whole request body must arrive within this (else 408).
    client_body_s: float = 30.0
    #: The request line and headers must arrive within this (the server's side).
    client_header_s: float = 10.0
    #: The longest a client may leave a piece of its answer unread; past it the
    #: client is cut off (its stream ends, the upstream request is aborted).
    client_send_s: float = 30.0
    #: Data-plane requests in progress at once; beyond, 503 with Retry-After.
    max_concurrent_requests: int = 1024
    #: Largest non-streamed answer from vLLM the gateway holds (else 502).
    max_response_bytes: int = 64 << 20
    #: Most bytes of one streamed answer collected for the trajectory recorder.
    max_record_bytes: int = 16 << 20
    #: Deepest JSON nesting accepted in a request body (else 400).
    max_json_depth: int = 64
    #: The verification floor: a begin that asks for less is refused (422).
    #: Default: the highest level reachable here (``reachable_verification``).
    min_verification: VerificationLevel | None = None
    #: The highest level this engine and transport can reach (``probe`` on any
    #: engine that scores prompts); ``rolloutcore serve`` reads it from the engine.
    reachable_verification: VerificationLevel = VerificationLevel.PROBE
    #: The largest probe tolerance (nats) a trainer may send: above it a
    #: ``probe`` would pass anything.
    max_probe_tolerance: float = 0.05
    #: What probe token ids and lengths are checked against at the edge (the
    #: served model's vocabulary and context; ``None``: not known, not checked).
    vocab_size: int | None = None
    max_model_len: int | None = None
    #: Salt every admitted request's prefix cache by its version (``cache_salt``;
    #: ``service.salting``): no request reuses KV of another version, reset or not.
    salt_prefix_cache: bool = True
    #: The update mode this deployment runs (``strict``, ``keep``, ``recompute``,
    #: ``engine_recompute``): the
    #: controller behind the gateway must be in it (``create_app`` refuses another), so
    #: a strict-only deployment never runs an asynchronous controller by mistake.
    update_mode: str = "strict"
    #: Only for a negative control (a benchmark's cache control): let an asynchronous
    #: mode run without the version salt, so that cross-version prefix reuse shows.
    unsafe_unsalted: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "upstream_url", _url("upstream_url", self.upstream_url))
        if self.engine_url is not None:
            object.__setattr__(self, "engine_url", _url("engine_url", self.engine_url))
        for name in ("control_token", "data_token"):
            tok = getattr(self, name)
            if tok is None and name == "data_token":
                continue
            if not isinstance(tok, str) or len(tok) < 16 or any(c.isspace() for c in tok):
                raise BadInput(f"{name} must be a string of at least 16 characters "
                               "without whitespace")
        if isinstance(self.queue_max, bool) or not isinstance(self.queue_max, int) or (
                self.queue_max < 0):
            raise BadInput(f"queue_max must be an integer >= 0, got {self.queue_max!r}")
        for name in ("queue_wait_s", "lease_s", "max_lease_s", "upstream_connect_s",
                     "upstream_read_s", "upstream_keepalive_s", "health_timeout_s",
                     "client_body_s", "client_header_s", "client_send_s"):
            _positive(name, getattr(self, name))
        for name in ("max_body_bytes", "upstream_max_connections", "history",
                     "remember_updates", "health_failures", "max_concurrent_requests",
                     "max_response_bytes", "max_record_bytes", "max_json_depth"):
            _positive(name, getattr(self, name), integer=True)
        if self.health_interval_s != 0:
            _positive("health_interval_s (or 0: no watch)", self.health_interval_s)
        if self.lease_s > self.max_lease_s:
            raise BadInput("lease_s must not exceed max_lease_s")
        if not isinstance(self.salt_prefix_cache, bool):
            raise BadInput("salt_prefix_cache must be a bool")
        if self.update_mode not in _MODES:
            raise BadInput(f"update_mode must be one of {', '.join(_MODES)}, got "
                           f"{self.update_mode!r}")
        if self.update_mode != "strict" and not self.salt_prefix_cache and \
                self.unsafe_unsalted is not True:
            raise BadInput(f"update_mode {self.update_mode!r} needs salt_prefix_cache (a "
                           "request under N+1 could reuse KV of N)")
        if not isinstance(self.media, MediaLimits):
            raise BadInput("media must be a MediaLimits")
        if not isinstance(self.transport, Mapping):
            raise BadInput("transport must be a mapping")
        object.__setattr__(self, "transport", dict(self.transport))
        for name in ("min_verification", "reachable_verification"):
            v = getattr(self, name)
            if isinstance(v, str):
                v = VerificationLevel.parse(v)
                object.__setattr__(self, name, v)
            if not (v is None and name == "min_verification") and not isinstance(
                    v, VerificationLevel):
                raise BadInput(f"{name} must be a VerificationLevel, got {v!r}")
        if self.floor > self.reachable_verification:
            raise BadInput(f"min_verification {self.floor.wire} cannot be reached here (the "
                           f"highest level is {self.reachable_verification.wire})")
        _positive("max_probe_tolerance", self.max_probe_tolerance)
        for name in ("vocab_size", "max_model_len"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name), integer=True)

    @property
    def floor(self) -> VerificationLevel:
        """The level every update must reach (``min_verification``, else the highest)."""
        return (self.reachable_verification if self.min_verification is None
                else self.min_verification)

    @property
    def advertised_engine_url(self) -> str:
        return self.engine_url or self.upstream_url
