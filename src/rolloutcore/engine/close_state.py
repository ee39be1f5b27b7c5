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

The guard's side is ``transports.engine_key`` (``_close_state``, ``_remember``), the
adapter's ``engine.write_counts`` (``read_state``).

An engine whose vLLM lacks one of those answers 404 saying which; the adapter then
reads them separately, as it does on an engine without the guard (``--upstream``).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rolloutcore.engine.wire import WeightInfo, WeightOps

__all__ = ["CLOSE_STATE", "MARK_HEADER", "OPS_SAMPLES", "ClosingState", "new_mark",
           "ops_text"]

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


def ops_text() -> str | None:
    """What vLLM's ``/metrics/?name[]=...`` renders of ``OPS_SAMPLES`` (None: no registry)."""
    try:
        from prometheus_client import generate_latest
        from vllm.v1.metrics.prometheus import get_prometheus_registry
    except ImportError:
        return None
    reg = get_prometheus_registry().restricted_registry(list(OPS_SAMPLES))
    return generate_latest(reg).decode("utf-8")
