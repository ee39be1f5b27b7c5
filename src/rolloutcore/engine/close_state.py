"""A paused validation's three reads in one round trip, on a launched engine (issue 46).

A paused validation of a vLLM engine reads the label (``GET /weight_info``), the
paused state (``GET /is_paused``) and the weight-operation counters (``/metrics/``
restricted to ``weight_ops``' samples, started at the update's first cache reset,
``engine.write_counts``): three round trips to the same API server. On an engine
RolloutCore launched, its route guard (``transports.engine_key.RouteGuard``)
answers them in one, behind the key, as it answers ``FAST_PAUSE``:

``GET /rolloutcore/state?mark=TOKEN`` answers ``{"weight_version", "is_paused",
"metrics", "marked"}``, each from what vLLM's own route reads: ``/weight_info``'s
``engine_client.get_weight_version()``, ``/is_paused``'s ``engine_client.is_paused()``,
and the text ``/metrics/?name[]=...`` renders (``prometheus_client.generate_latest``
of the same registry, ``vllm.v1.metrics.prometheus.get_prometheus_registry``,
restricted to the same samples), parsed by the client as that read is
(``VllmHTTP.parse_ops``).

The counters are the first reset's, as the separate read's are: the adapter sends
that reset with ``MARK_HEADER: TOKEN`` and the guard renders the counters when it
passes the request on (the separate read is sent beside that reset, so it lands just
before or after it); ``?mark=TOKEN`` answers them (``"marked": true``) and the label
and paused state as they are now, after the resets. A retried reset carries the same mark;
the guard keeps the counters of the first that reached it. A mark the guard has not
seen (no reset sent in the round) answers the counters now, as the separate read would
then; a first reset not sent (a cache the engine does not have) starts the separate
read, as before.

An engine whose vLLM lacks one of those answers 404 saying which; the adapter then
reads them separately, as it does on an engine without the guard (``--upstream``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import TYPE_CHECKING, Any

from rolloutcore.errors import EffectError

if TYPE_CHECKING:
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.wire import WeightInfo, WeightOps
    from rolloutcore.transports.engine_key import Scope, Send

__all__ = ["CLOSE_STATE", "MARK_HEADER", "OPS_SAMPLES", "ClosingState", "new_mark",
           "ops_text", "read", "supported"]

#: The guard's route (keyed).
CLOSE_STATE = "/rolloutcore/state"
#: The header of the reset whose arrival the counters are rendered at.
MARK_HEADER = "x-rolloutcore-counts-mark"
#: The samples ``VllmHTTP.weight_ops`` reads (``/metrics/?name[]=...``).
OPS_SAMPLES = ("vllm:rl_weight_update_operation_duration_seconds_count",
               "vllm:rl_weight_update_operations_in_flight", "vllm:engine_sleep_state")


@dataclasses.dataclass(frozen=True)
class ClosingState:
    """The label, paused state and counters one read of ``CLOSE_STATE`` answered."""

    info: WeightInfo
    paused: bool
    ops: WeightOps
    marked: bool  # the counters are those at the marked reset


def new_mark() -> str:
    return secrets.token_urlsafe(16)


# ----------------------------------------------------------------- client side

def _get(http: VllmHTTP, mark: str | None, step: str) -> Any:
    r = http._request("GET", CLOSE_STATE, step=step, timeout_s=None, check_status=False,
                      params=None if mark is None else {"mark": mark})
    if r.status_code != 200:
        return None
    return http._json(r, step)


def supported(http: VllmHTTP) -> bool:
    """Whether the engine's guard answers ``CLOSE_STATE`` with all three (read at bootstrap)."""
    try:
        body = _get(http, None, "close_state")
        return body is not None and _parse(http, body, "close_state") is not None
    except EffectError:
        return False


def read(http: VllmHTTP, mark: str | None) -> ClosingState:
    """One read of ``CLOSE_STATE``; any answer but a full one is an ``EffectError`` (the
    validation's observation failed, as a failed separate read fails it)."""
    step = "close_state"
    body = _get(http, mark, step)
    got = None if body is None else _parse(http, body, step)
    if got is None:
        raise EffectError(step, f"{CLOSE_STATE} did not answer the label, paused state "
                          "and counters")
    return got


def _parse(http: VllmHTTP, body: Any, step: str) -> ClosingState | None:
    from rolloutcore.engine.wire import WeightInfo

    if not isinstance(body, dict) or not {"weight_version", "is_paused", "metrics",
                                          "marked"} <= set(body):
        return None
    v, paused, text, marked = (body["weight_version"], body["is_paused"], body["metrics"],
                               body["marked"])
    if (v is not None and not isinstance(v, str)) or not isinstance(paused, bool) \
            or not isinstance(text, str) or not isinstance(marked, bool):
        return None
    return ClosingState(WeightInfo(v, True), paused, http.parse_ops(text, step), marked)


# ----------------------------------------------------------------- engine side

def ops_text() -> str | None:
    """What vLLM's ``/metrics/?name[]=...`` renders of ``OPS_SAMPLES`` (None: no registry)."""
    try:
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry
    except ImportError:
        return None
    reg = get_prometheus_registry().restricted_registry(list(OPS_SAMPLES))
    return generate_latest(reg).decode("utf-8")


async def answer(scope: Scope, send: Send, marks: dict[str, str]) -> None:
    """``CLOSE_STATE`` on the guard (keyed): see the module's doc. ``marks``: the
    counters rendered at each marked reset, by mark (taken once)."""
    from urllib.parse import parse_qs

    from rolloutcore.transports.engine_key import send_json

    if scope.get("method") != "GET":
        await send_json(send, 405, {"error": "GET only"})
        return
    q = parse_qs(bytes(scope.get("query_string") or b"").decode("latin-1"))
    mark = (q.get("mark") or [""])[-1]
    engine = getattr(getattr(scope.get("app"), "state", None), "engine_client", None)
    version = getattr(engine, "get_weight_version", None)
    is_paused = getattr(engine, "is_paused", None)
    if version is None or is_paused is None:
        await send_json(send, 404, {"error": "this vLLM has no weight version or pause "
                                             "state to read"})
        return
    try:
        at_mark = marks.pop(mark, None) if mark else None
        text = at_mark if at_mark is not None else ops_text()
        if text is None:
            await send_json(send, 404, {"error": "this vLLM has no metrics registry"})
            return
        body = {"weight_version": await version(), "is_paused": bool(await is_paused()),
                "metrics": text, "marked": at_mark is not None}
    except Exception as exc:  # the engine's own failure: the client's read fails
        await send_json(send, 500, {"error": f"state read failed: {type(exc).__name__}: {exc}"})
        return
    await send_json(send, 200, body)


def remember(scope: Scope, marks: dict[str, str]) -> None:
    """A keyed request carrying ``MARK_HEADER``: render the counters now, under its mark."""
    mark = next((v for k, v in scope.get("headers") or () if k.lower() == _MARK_B), None)
    if mark is None or not 8 <= len(mark) <= 64:
        return
    text = ops_text()
    if text is not None:
        if len(marks) >= 16:
            marks.clear()
        marks.setdefault(mark.decode("latin-1"), text)  # a retried reset's: the first


_MARK_B = MARK_HEADER.encode()
