"""The trainer side of a weight transfer, and what every transport shares.

A transport moves a ``WeightSource`` into a running vLLM through vLLM's own
weight-transfer path::

    connect:  POST /init_weight_transfer_engine    (side thread)  ||  trainer opens its end
    send:     POST /start_weight_update
              POST /update_weights                  (side thread)  ||  trainer sends tensors
              POST /finish_weight_update {"weight_version": <target label>}

Two rules from the seed's experiments:

* **Target-aware finish.** The target label travels *in* the finalize call.
  It is never written afterwards with ``/update_weight_version``: a label
  written after the fact can be observed before it is true, or stay
  unwritten when the trainer dies between the two calls.
* **Liveness.** A collective blocked on a dead peer may never return (the
  seed's trainer stayed blocked more than 120 s). So nothing that can block
  runs on the caller's thread: each HTTP call and each collective runs on a
  side thread, and the caller waits with a deadline while watching an abort
  flag. ``abort()`` (from any other thread) makes a pending ``send`` or
  ``connect`` raise ``TransferError`` at once and tears the group down; the
  abandoned side threads end on their own timeouts.

Failure classification: ``TransferError.mutation_started`` is ``False`` only
when nothing can have reached the engine's weights: the preflight refused,
the engine could not be reached, or ``/start_weight_update`` was refused
(HTTP 4xx). Anything after ``/start_weight_update`` was accepted, or an
ambiguous answer to it (timeout, 5xx: the worker may have begun its
layerwise reload), is ``mutation_started=True``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.strict import check_timeout
from rolloutcore.core.versions import check_label
from rolloutcore.engine.errors import is_refusal, request
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports.net import local_address_towards
from rolloutcore.transports.source import WeightSource

__all__ = [
    "TransportBase",
    "WeightTransport",
    "check_label",
    "check_timeout",
    "local_address_towards",
    "preflight",
    "remaining",
    "run_side",
    "world_size_of",
]

T = TypeVar("T")


@runtime_checkable
class WeightTransport(Protocol):
    """What the adapter and the trainer API need from any transport."""

    @property
    def backend(self) -> str:
        """The name vLLM knows the engine half by (``--weight-transfer-config``)."""
        ...

    def engine_config(self) -> dict[str, Any]:
        """The ``--weight-transfer-config`` JSON the engine must be started with."""
        ...

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        """The init handshake with the engine at ``base_url``; no weights change."""
        ...

    def send(self, base_url: str, target_label: str, source: WeightSource, *,
             timeout_s: float) -> TransferEvidence:
        """Move ``source`` into the engine and finish with ``target_label``."""
        ...

    def abort(self) -> None:
        """From another thread: make a pending send/connect raise promptly."""
        ...

    def close(self) -> None:
        ...




def check_url(base_url: object, name: str = "base_url") -> str:
    """An engine's http(s) URL without its trailing slash; else ``BadInput`` naming ``name``."""
    if not isinstance(base_url, str):
        raise BadInput(f"{name} must be a string, got {base_url!r}")
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadInput(f"{name} must be http(s)://host:port, got {base_url!r}")
    return base_url.rstrip("/")


def check_targets(targets: object) -> dict[str, str]:
    """A fan-out round's ``(url, label)`` pairs as url -> label, in their order; ``BadInput``
    for anything else, an engine targeted twice included (before anything is sent)."""
    if isinstance(targets, str) or not isinstance(targets, Sequence) or not targets:
        raise BadInput("targets must be a non-empty sequence of (url, label)")
    labels: dict[str, str] = {}
    for item in targets:
        if not isinstance(item, tuple) or len(item) != 2:
            raise BadInput(f"each target is (url, label), got {item!r}")
        url = check_url(item[0])
        if url in labels:
            raise BadInput(f"{url} is targeted twice")
        labels[url] = check_label(item[1])
    return labels


def preflight(source: WeightSource, expected_manifest_digest: str | None) -> None:
    """The identity preflight: ``source`` must be a ``WeightSource`` (``BadInput``) and
    what the target declares.

    Runs before any engine call, so a refusal is ``mutation_started=False``.
    """
    if not isinstance(source, WeightSource):
        raise BadInput(f"source must be a rolloutcore WeightSource, "
                       f"got {type(source).__name__}")
    if expected_manifest_digest is None:
        return
    got = source.manifest().digest
    if got != expected_manifest_digest:
        raise TransferError(
            "transfer", f"preflight: source manifest {got[:12]} differs from the "
            f"target's {expected_manifest_digest[:12]}; nothing was sent",
            mutation_started=False)


def remaining(deadline: float) -> float:
    """What is left until ``deadline`` (``time.monotonic``), never less than 0.1 s."""
    return max(0.1, deadline - time.monotonic())


def world_size_of(answer: object, who: str = "engine") -> int:
    """The ``world_size`` of a ``/get_world_size`` answer; ``TransferError`` (no
    mutation) for anything but an int >= 1."""
    n = answer.get("world_size") if isinstance(answer, Mapping) else None
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise TransferError("transfer", f"{who} reported world size {answer!r}",
                            mutation_started=False)
    return n


def run_side(fn: Callable[[], T], name: str) -> Future[T]:
    """Run ``fn`` on a daemon thread; the result (or exception) lands in a Future.

    Daemon, not an executor thread: a side call blocked on a dead peer must
    not hold up interpreter exit, and nobody joins it.
    """
    fut: Future[T] = Future()

    def body() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn())
        except BaseException as exc:  # delivered to the waiter
            fut.set_exception(exc)

    threading.Thread(target=body, name=f"rolloutcore-{name}", daemon=True).start()
    return fut


class TransportBase:
    """Deadline-and-abort plumbing, and HTTP calls with a timeout each."""

    backend: str = ""

    def __init__(self) -> None:
        self._abort = threading.Event()
        self._lock = threading.Lock()
        self._busy = False

    # -- one operation at a time ----------------------------------------------

    def _enter(self) -> None:
        with self._lock:
            if self._busy:
                raise BadInput("a connect or send is already running on this transport")
            self._busy = True
        self._abort.clear()

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        """Rendezvous with every worker of the engine; changes no weights."""
        url = check_url(base_url)
        t = check_timeout(timeout_s)
        self._enter()
        try:
            self._connect(url, time.monotonic() + t)
        finally:
            self._busy = False

    def _connect(self, url: str, deadline: float) -> None:
        raise NotImplementedError

    # -- HTTP -------------------------------------------------------------------

    @staticmethod
    def post(base_url: str, path: str, body: dict[str, Any] | None,
             timeout_s: float) -> Any:
        """POST and return the JSON body (or the text); failures as ``engine.errors`` maps them.

        A 4xx is ``EngineRefused`` and no connection ``EngineUnreachable``:
        ``engine.errors.is_refusal`` tells those from a call that may have
        been acted on.
        """
        r = request("POST", f"{base_url}{path}", step=path.lstrip("/"), timeout_s=timeout_s,
                    json_body=body)
        try:
            return r.json()
        except ValueError:
            return r.text

    @staticmethod
    def get(base_url: str, path: str, timeout_s: float) -> Any:
        return request("GET", f"{base_url}{path}", step=path.lstrip("/"),
                       timeout_s=timeout_s).json()

    def engine_world_size(self, url: str, deadline: float) -> int:
        """``GET /get_world_size`` of ``url``, waited for until ``deadline`` (no mutation)."""
        f = run_side(lambda: self.get(url, Routes.GET_WORLD_SIZE, remaining(deadline)),
                     "world-size")
        self.wait([f], deadline, "get_world_size", mutation_started=False)
        return world_size_of(f.result())

    # -- waiting ----------------------------------------------------------------

    def wait(self, futs: list[Future[Any]], deadline: float, what: str, *,
             mutation_started: bool, refusal_is_safe: bool = False) -> None:
        """Wait for all ``futs``; raise on the first failure, the deadline, or abort.

        The first side call to fail decides the error: when the trainer's
        end fails, the engine's matching HTTP call will only fail later (on
        its own timeout), and vice versa. With ``refusal_is_safe``, an
        engine that refused the call (``engine.errors.is_refusal``) is reported as
        ``mutation_started=False``; abort and deadline never are, since the
        request may have arrived.
        """
        pending = list(futs)
        while pending:
            if self._abort.is_set():
                raise TransferError("transfer", f"aborted during {what}",
                                    mutation_started=mutation_started)
            for f in list(pending):
                if f.done():
                    exc = f.exception()
                    if exc is not None:
                        safe = refusal_is_safe and is_refusal(exc)
                        raise self.classify(exc, what, mutation_started and not safe) from exc
                    pending.remove(f)
            if not pending:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferError("transfer", f"deadline expired during {what}",
                                    mutation_started=mutation_started)
            with contextlib.suppress(Exception):
                pending[0].exception(timeout=min(0.05, left))

    @staticmethod
    def classify(exc: BaseException, what: str, mutation_started: bool) -> TransferError:
        if isinstance(exc, TransferError):
            return exc
        return TransferError("transfer", f"{what} failed: {exc}",
                             mutation_started=mutation_started)

    def abort(self) -> None:
        """Make a pending ``send``/``connect`` raise now; subclasses also drop the group."""
        self._abort.set()
