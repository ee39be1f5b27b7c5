"""The engine's own count of its weight writes: the write-counter half of ``VllmAdapter``.

vLLM 0.32+ counts every ``/start_weight_update``, ``/update_weights`` and
``/finish_weight_update`` on ``/metrics`` (``engine.wire.WeightOps``), whoever
calls them. The adapter reads the counters at bootstrap and at each paused
validation (``_ops_verified``: what the published version was verified as, the
health watch's baseline). A drain takes that baseline as its own
(``_ops_at_drain``: ``writes_since_drain`` tells an expired lease whether
anything was sent) and reads the counters beside its pause only when there is
none (the last read failed): the weights are what was verified only while the
counters are, so a write since (out of band, before or after the pause; a
restarted engine's new counters) makes an expired round ambiguous (TAINTED),
never "nothing was sent", and a round that sent nothing and found nothing
changed returns to service on the verified weights. One ``/metrics`` read a
round instead of two.

The validation's read starts at the update's first cache reset
(``_read_counts_at_reset``), overlapping the resets: the caches are reset after
the update's writes and before the resume, so the counters already hold every
write of the update. A write between that read and the validation's end (none
is the gateway's) counts as out of band: read earlier, the baseline can only
find more written, never less. A reset outside an update (the keep-mode
sweep, after the resume) starts no read.

On an engine whose route guard answers ``engine.close_state``'s route (probed at
bootstrap), the first reset starts no read: it carries a mark, the guard renders the
counters as that reset passes through it, and the validation reads them with the
label and the paused state in one call after the resets.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rolloutcore.engine import close_state
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import EffectError, RolloutCoreError
from rolloutcore.transports import engine_key

if TYPE_CHECKING:
    from rolloutcore.engine.close_state import ClosingState
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.wire import WeightOps

__all__ = ["WriteCounts", "read_state", "state_supported"]


class WriteCounts:
    """The write-counter half of ``VllmAdapter`` (see the module docstring)."""

    http: VllmHTTP
    _side: Callable[[], ThreadPoolExecutor]

    def _init_write_counts(self) -> None:
        # The counters when the weights were last verified (bootstrap, each
        # validation), and at this update's drain; a difference is a write.
        self._ops_verified: WeightOps | None = None
        self._ops_at_drain: WeightOps | None = None
        self._counts_ops = False  # the engine is known to count weight operations
        # Drained until resumed; the validation's read, started at the first reset.
        self._drained = False
        # (or the mark of that reset, where the guard reads them: ``engine.close_state``)
        self._ops_closing: Future[WeightOps | None] | str | None = None
        self._state_route = False  # the guard answers close_state (``_probe_state_route``)

    def _read_counts_at_reset(self, *, sends: bool = True) -> str | None:
        """At a cache reset: start the paused validation's read, once per update. On an
        engine whose guard answers ``close_state``, no read: the mark the reset carries
        (``sends``: a reset sent to the engine), at which the guard renders the counters
        (``engine.close_state``); a retried reset carries it again, and the guard keeps
        the counters of the first that reached it."""
        pending = self._ops_closing
        if isinstance(pending, str):
            return pending if sends else None
        if self._drained and self._counts_ops and pending is None:
            if self._state_route and sends:
                self._ops_closing = mark = close_state.new_mark()
                return mark
            self._ops_closing = self._side().submit(self._weight_ops_or_none)
        return None

    def _close_reads(self) -> tuple[ClosingState | None, Future[WeightOps | None] | None]:
        """The paused validation's reads: on an engine whose guard answers
        ``close_state``, the label, paused state and counters in one (the counters at
        the marked reset, or from a read started at a reset not sent); else the
        counters' read (started at the first reset, or now)."""
        pending, self._ops_closing = self._ops_closing, None
        fut = pending if isinstance(pending, Future) else None
        if self._state_route:
            return read_state(self.http, pending if isinstance(pending, str) else None), \
                fut
        if fut is None and self._counts_ops:
            fut = self._side().submit(self._weight_ops_or_none)
        return None, fut

    def _probe_state_route(self, caps: frozenset[str]) -> None:
        """At bootstrap: whether the validation's three reads go as one (``close_state``):
        an engine this process holds a key of, whose vLLM has all three."""
        self._state_route = False
        self._state_route = bool(engine_key.headers_for(self.http.base_url)) and \
            self._counts_ops and {Routes.WEIGHT_INFO, Routes.IS_PAUSED} <= caps and \
            state_supported(self.http)

    def writes_since_drain(self, *, timeout_s: float = 5.0) -> tuple[str, ...] | None:
        """What wrote weights since this update's drain (``WriteObserver``), from the
        engine's own counters; ``None`` when the engine does not count or the drain
        could not read them."""
        before = self._ops_at_drain
        if before is None or not self._counts_ops:
            return None
        try:
            return self.http.weight_ops(timeout_s=timeout_s).writes_since(before)
        except RolloutCoreError:
            return None

    def _weight_ops(self) -> WeightOps | None:
        return self.http.weight_ops() if self._counts_ops else None

    def _weight_ops_or_none(self) -> WeightOps | None:
        try:
            return self._weight_ops()
        except RolloutCoreError:
            return None


# ------------------------------------------- the guard's one read (engine.close_state)

def _get_state(http: VllmHTTP, mark: str | None, step: str) -> Any:
    r = http._request("GET", close_state.CLOSE_STATE, step=step, timeout_s=None, check_status=False,
                      params=None if mark is None else {"mark": mark})
    if r.status_code != 200:
        return None
    return http._json(r, step)


def state_supported(http: VllmHTTP) -> bool:
    """Whether the engine's guard answers ``close_state.CLOSE_STATE`` with all three
    (read at bootstrap)."""
    try:
        body = _get_state(http, None, "close_state")
        return body is not None and _parse_state(http, body, "close_state") is not None
    except EffectError:
        return False


def read_state(http: VllmHTTP, mark: str | None) -> ClosingState:
    """One read of ``close_state.CLOSE_STATE``; any answer but a full one is an ``EffectError`` (the
    validation's observation failed, as a failed separate read fails it)."""
    step = "close_state"
    body = _get_state(http, mark, step)
    got = None if body is None else _parse_state(http, body, step)
    if got is None:
        raise EffectError(step, f"{close_state.CLOSE_STATE} did not answer the label, paused state "
                          "and counters")
    return got


def _parse_state(http: VllmHTTP, body: Any, step: str) -> ClosingState | None:
    from rolloutcore.engine.wire import WeightInfo

    if not isinstance(body, dict) or not {"weight_version", "is_paused", "metrics",
                                          "marked"} <= set(body):
        return None
    v, paused, text, marked = (body["weight_version"], body["is_paused"], body["metrics"],
                               body["marked"])
    if (v is not None and not isinstance(v, str)) or not isinstance(paused, bool) \
            or not isinstance(text, str) or not isinstance(marked, bool):
        return None
    return close_state.ClosingState(WeightInfo(v, True), paused, http.parse_ops(text, step), marked)
