"""What a newer vLLM says about its own weights, read as evidence while paused.

Two answers of vLLM 0.34 decide whether a round may be published, and the
older releases give neither:

* ``has_incomplete_weight_update`` (a worker method, through
  ``/collective_rpc``): set on every worker from ``start_weight_update`` until a
  *successful* finish. A failed update leaves it set and vLLM keeps serving
  (nothing in its serving path refuses on it), so an engine that says its
  weights are half-written is never published: the check fails, the
  validation fails, the controller taints.
* ``/checkpoint/status``: the process-checkpoint lifecycle (``running``,
  ``preparing``, ``prepared``, ``restoring``, ``failed``). Only ``running``
  serves; a round validated in any other state is not evidence of what will be
  served after a restore, so it fails too.

Each check is ``None`` where the engine cannot give the answer (an older vLLM):
the validation then lists it as unverified rather than passed.

``pause`` drains an engine RolloutCore launched through its route guard's
``/rolloutcore/pause`` (the engine core's own pause, without the fixed 20 ms
sleep vLLM's ``/pause`` adds: ``transports.engine_key``), and any other engine
through vLLM's ``/pause``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import Check, PauseMode
from rolloutcore.core.versions import EngineIdentity
from rolloutcore.engine.routes import Routes
from rolloutcore.transports import engine_key

if TYPE_CHECKING:
    from rolloutcore.engine.http import VllmHTTP

__all__ = [
    "CHECKPOINT_ROUTE",
    "COUNTS_WEIGHT_OPS_FROM",
    "REPORTS_INCOMPLETE_FROM",
    "checkpoint_check",
    "engine_identity",
    "incomplete_update_check",
    "pause",
    "version_tuple",
]

#: vLLM versions from which the engine counts its weight-transfer operations in
#: ``/metrics`` (the counters are created on the first operation, so before one
#: they are absent: absent is zero only where the engine is known to count).
COUNTS_WEIGHT_OPS_FROM = (0, 32)
#: From 0.34 every worker answers ``has_incomplete_weight_update``.
REPORTS_INCOMPLETE_FROM = (0, 34)
CHECKPOINT_ROUTE = Routes.CHECKPOINT_STATUS


def version_tuple(v: object) -> tuple[int, ...]:
    """(major, minor, patch) of a version string, as far as it reads; () for none."""
    out: list[int] = []
    for part in str(v).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


def incomplete_update_check(http: VllmHTTP, version: tuple[int, ...]) -> Check | None:
    """Every worker says its last weight update finished (vLLM 0.34+), else ``None``."""
    if version[:2] < REPORTS_INCOMPLETE_FROM:
        return None
    body = http._post_json(Routes.COLLECTIVE_RPC, "validate",
                           {"method": "has_incomplete_weight_update"}, None)
    results = body.get("results") if isinstance(body, Mapping) else None
    if not isinstance(results, list) or not results:
        return Check("weights-complete", False,
                     f"/collective_rpc has_incomplete_weight_update answered {str(body)[:120]}")
    # vLLM's /collective_rpc answers a worker's bool as its str(): "False", not false.
    incomplete = [i for i, r in enumerate(results) if r not in (False, "False")]
    if incomplete:
        return Check("weights-complete", False,
                     f"workers {incomplete} of {len(results)} say a weight update started and "
                     "did not finish: their weights may be half-written")
    return Check("weights-complete", True,
                 f"{len(results)} of {len(results)} workers: no incomplete weight update")


def checkpoint_check(http: VllmHTTP, routes: frozenset[str] | Any) -> Check | None:
    """The engine's process-checkpoint state is ``running`` (vLLM 0.34+), else ``None``."""
    if CHECKPOINT_ROUTE not in routes:
        return None
    body = http._get_json(CHECKPOINT_ROUTE, "validate", None)
    state = body.get("state") if isinstance(body, Mapping) else None
    if state == "running":
        return Check("checkpoint-running", True, "process checkpoint state: running")
    error = body.get("error") if isinstance(body, Mapping) else None
    return Check("checkpoint-running", False,
                 f"process checkpoint state is {state!r}"
                 + (f" ({error})" if error else "") + ": only 'running' serves what was written")


def pause(http: VllmHTTP, mode: PauseMode, *, clear_cache: bool,
          timeout_s: float | None) -> bool:
    """Pause the engine; whether its answer says it paused (``VllmHTTP.pause``'s contract).

    An engine this process holds the route key of (it was launched with the
    route guard) is paused through the guard's ``FAST_PAUSE``; one whose guard
    does not know the route (404) through vLLM's ``/pause``, as any other.
    """
    if not isinstance(mode, PauseMode) or not isinstance(clear_cache, bool):
        return http.pause(mode, clear_cache=clear_cache, timeout_s=timeout_s)  # its refusal
    if engine_key.headers_for(http.base_url):
        r = http._request("POST", engine_key.FAST_PAUSE, step="pause", timeout_s=timeout_s,
                          params={"mode": mode.value, "clear_cache": str(clear_cache).lower()},
                          check_status=False)
        if r.status_code != 404:
            if r.status_code != 200:
                return http.pause(mode, clear_cache=clear_cache, timeout_s=timeout_s)
            return http._status_is(r, "paused")
    return http.pause(mode, clear_cache=clear_cache, timeout_s=timeout_s)


def engine_identity(http: VllmHTTP, *, timeout_s: float | None = None) -> EngineIdentity:
    """What a trajectory records about the engine, read from the engine (``/server_info``).

    The settings that decide whether a sample can be replayed exactly (dtype,
    context, logprobs mode, prefix caching), never assumed by the caller.
    """
    cfg = http.server_info(timeout_s=timeout_s).get("vllm_config") or {}
    mc = cfg.get("model_config") or {}
    cc = cfg.get("cache_config") or {}
    config = {"dtype": str(mc.get("dtype", "")).removeprefix("torch.") or None,
              "max_model_len": mc.get("max_model_len"),
              "logprobs_mode": mc.get("logprobs_mode"),
              "enable_prefix_caching": cc.get("enable_prefix_caching")}
    return EngineIdentity(http.version(timeout_s=timeout_s),
                          http.model(timeout_s=timeout_s),
                          {k: v for k, v in config.items() if v is not None}, http.base_url)
