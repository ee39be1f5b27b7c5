"""Every vLLM route RolloutCore uses, in one table.

One entry per path: the method RolloutCore sends, whether a call may change
the engine (weights, caches, pause or sleep state, loaded LoRA adapters),
the vLLM minor versions that serve it, whether vLLM registers it only with
``VLLM_SERVER_DEV_MODE=1``, and which methods the route guard
(``transports.engine_key.RouteGuard``) answers without the launch's key.

Where the versions come from (``shared/VLLM-FACTS.md``): 0.26 run on the
H200 (RL routes, cache resets, sleep, token-in generation; no weight
version, no ``/weight_checker``), 0.32 run on the CPU (its route list is
the reference), 0.33 and 0.34 read from the wheels (the RL routes are
unchanged; 0.34 adds ``/checkpoint/*`` and moves ``/fault_tolerance/*``
under ``/v1``). A route whose first release between 0.27 and 0.32 was not
checked says ``since=(0, 27)`` when 0.26 lacks it: "absent in 0.26, present
in 0.32".

Capabilities are still read from the engine's ``/openapi.json``
(``VllmHTTP.capabilities``), never from its version: the versions here
document, they do not decide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "DATA_ROUTES",
    "NATIVE_PREFIX",
    "NATIVE_ROUTES",
    "NEWEST",
    "OLDEST",
    "TABLE",
    "Route",
    "Routes",
    "keyless_routes",
    "required_routes",
]

#: The vLLM minor versions this table speaks of.
OLDEST = (0, 26)
NEWEST = (0, 34)

_READ = frozenset({"GET", "HEAD"})
_POST = frozenset({"POST"})


class Routes:
    """vLLM's route paths, by name (the paths ``/openapi.json`` lists)."""

    # -- reading the engine
    HEALTH = "/health"
    VERSION = "/version"
    SERVER_INFO = "/server_info"
    OPENAPI = "/openapi.json"
    MODELS = "/v1/models"
    METRICS = "/metrics"
    PING = "/ping"
    LOAD = "/load"
    TOKENIZER_INFO = "/tokenizer_info"
    TOKENIZE = "/tokenize"
    DETOKENIZE = "/detokenize"
    # -- generating
    GENERATE = "/inference/v1/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"
    ABORT = "/abort_requests"
    ABORT_GENERATE = "/inference/v1/abort_requests"
    # -- pause, sleep, caches
    PAUSE = "/pause"
    RESUME = "/resume"
    IS_PAUSED = "/is_paused"
    SLEEP = "/sleep"
    WAKE_UP = "/wake_up"
    IS_SLEEPING = "/is_sleeping"
    RESET_PREFIX = "/reset_prefix_cache"
    RESET_ENCODER = "/reset_encoder_cache"
    RESET_MM = "/reset_mm_cache"
    # -- weights
    GET_WORLD_SIZE = "/get_world_size"
    INIT_TRANSFER = "/init_weight_transfer_engine"
    SHUTDOWN_TRANSFER = "/shutdown_weight_transfer_engine"
    START_UPDATE = "/start_weight_update"
    START_DRAFT_UPDATE = "/start_draft_weight_update"
    UPDATE_WEIGHTS = "/update_weights"
    FINISH_UPDATE = "/finish_weight_update"
    WEIGHT_INFO = "/weight_info"
    UPDATE_WEIGHT_VERSION = "/update_weight_version"
    WEIGHT_CHECKER = "/weight_checker"
    COLLECTIVE_RPC = "/collective_rpc"
    # -- LoRA adapters
    LOAD_LORA = "/v1/load_lora_adapter"
    UNLOAD_LORA = "/v1/unload_lora_adapter"
    # -- observed, not driven (0.34)
    CHECKPOINT_PREPARE = "/checkpoint/prepare"
    CHECKPOINT_RESTORE = "/checkpoint/restore"
    CHECKPOINT_STATUS = "/checkpoint/status"
    FAULT_TOLERANCE_STATUS = "/fault_tolerance/status"
    FAULT_TOLERANCE_APPLY = "/fault_tolerance/apply"
    V1_FAULT_TOLERANCE_STATUS = "/v1/fault_tolerance/status"
    V1_FAULT_TOLERANCE_APPLY = "/v1/fault_tolerance/apply"


@dataclass(frozen=True)
class Route:
    """One vLLM route as RolloutCore uses it.

    ``until`` is the last minor version that serves it (``None``: still
    served at ``NEWEST``). ``required``: support detection refuses an engine
    without it (with ``purpose`` as the reason it is needed).
    """

    path: str
    method: str
    mutates: bool
    since: tuple[int, int] = OLDEST
    until: tuple[int, int] | None = None
    dev_only: bool = False
    keyless: frozenset[str] = frozenset()
    required: bool = False
    purpose: str = ""

    def served_by(self, minor: tuple[int, int]) -> bool:
        """Whether vLLM ``minor`` (``(0, 32)``) serves this route, as far as known."""
        return self.since <= minor and (self.until is None or minor <= self.until)


R = Routes
_ROUTES = (
    # reading: open without the key (they change nothing)
    Route(R.HEALTH, "GET", mutates=False, keyless=_READ),
    Route(R.VERSION, "GET", mutates=False, keyless=_READ),
    Route(R.OPENAPI, "GET", mutates=False, keyless=_READ),
    Route(R.MODELS, "GET", mutates=False, keyless=_READ),
    Route(R.METRICS, "GET", mutates=False, keyless=_READ),
    Route(R.PING, "GET", mutates=False, keyless=_READ | _POST),
    Route(R.LOAD, "GET", mutates=False, keyless=_READ),
    Route(R.TOKENIZER_INFO, "GET", mutates=False, keyless=_READ),
    Route(R.TOKENIZE, "POST", mutates=False, keyless=_POST),
    Route(R.DETOKENIZE, "POST", mutates=False, keyless=_POST),
    Route(R.SERVER_INFO, "GET", mutates=False, dev_only=True),
    # generating: open (a generation changes no weights; the gateway labels what it relays)
    Route(R.GENERATE, "POST", mutates=False, keyless=_POST),
    Route(R.COMPLETIONS, "POST", mutates=False, keyless=_POST),
    Route(R.CHAT, "POST", mutates=False, keyless=_POST),
    Route(R.ABORT, "POST", mutates=True, dev_only=True),
    Route(R.ABORT_GENERATE, "POST", mutates=True),
    # pause
    Route(R.PAUSE, "POST", mutates=True, dev_only=True, required=True,
          purpose="drain the engine before the weights change"),
    Route(R.RESUME, "POST", mutates=True, dev_only=True, required=True,
          purpose="serve again after the update"),
    Route(R.IS_PAUSED, "GET", mutates=False, dev_only=True, keyless=_READ),
    # weights
    Route(R.GET_WORLD_SIZE, "GET", mutates=False, dev_only=True),
    Route(R.INIT_TRANSFER, "POST", mutates=True, dev_only=True),
    Route(R.SHUTDOWN_TRANSFER, "POST", mutates=True, dev_only=True, since=(0, 27)),
    Route(R.START_UPDATE, "POST", mutates=True, dev_only=True, required=True,
          purpose="open a weight update"),
    Route(R.START_DRAFT_UPDATE, "POST", mutates=True, dev_only=True, since=(0, 27)),
    Route(R.UPDATE_WEIGHTS, "POST", mutates=True, dev_only=True, required=True,
          purpose="receive the weights"),
    Route(R.FINISH_UPDATE, "POST", mutates=True, dev_only=True, required=True,
          purpose="close the update (and set its label)"),
    Route(R.WEIGHT_INFO, "GET", mutates=False, dev_only=True, since=(0, 27)),
    Route(R.UPDATE_WEIGHT_VERSION, "POST", mutates=True, dev_only=True, since=(0, 27)),
    # POST, but its checksum and compare actions read only (reset drops a baseline)
    Route(R.WEIGHT_CHECKER, "POST", mutates=False, dev_only=True, since=(0, 27)),
    Route(R.COLLECTIVE_RPC, "POST", mutates=True, dev_only=True),
    # sleep, caches
    Route(R.SLEEP, "POST", mutates=True, dev_only=True),
    Route(R.WAKE_UP, "POST", mutates=True, dev_only=True),
    Route(R.IS_SLEEPING, "GET", mutates=False, dev_only=True, keyless=_READ),
    Route(R.RESET_PREFIX, "POST", mutates=True, dev_only=True, required=True,
          purpose="drop KV computed by the old weights"),
    Route(R.RESET_ENCODER, "POST", mutates=True, dev_only=True),
    Route(R.RESET_MM, "POST", mutates=True, dev_only=True),
    # LoRA adapters (VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
    Route(R.LOAD_LORA, "POST", mutates=True),
    Route(R.UNLOAD_LORA, "POST", mutates=True),
    # 0.34's additions and renames, listed so that they are known, not driven
    Route(R.CHECKPOINT_PREPARE, "POST", mutates=True, since=(0, 34)),
    Route(R.CHECKPOINT_RESTORE, "POST", mutates=True, since=(0, 34)),
    Route(R.CHECKPOINT_STATUS, "GET", mutates=False, since=(0, 34)),
    Route(R.FAULT_TOLERANCE_STATUS, "GET", mutates=False, since=(0, 27), until=(0, 33)),
    Route(R.FAULT_TOLERANCE_APPLY, "POST", mutates=True, since=(0, 27), until=(0, 33)),
    Route(R.V1_FAULT_TOLERANCE_STATUS, "GET", mutates=False, since=(0, 34)),
    Route(R.V1_FAULT_TOLERANCE_APPLY, "POST", mutates=True, since=(0, 34)),
)
del R

#: Path -> its entry, for every route above.
TABLE: Mapping[str, Route] = {r.path: r for r in _ROUTES}


def required_routes() -> Mapping[str, str]:
    """Routes a hot update cannot do without, each with what it is for (in table order)."""
    return {r.path: r.purpose for r in _ROUTES if r.required}


def keyless_routes() -> Mapping[str, frozenset[str]]:
    """Path -> the methods the route guard answers without the key (reading, generating)."""
    return {r.path: r.keyless for r in _ROUTES if r.keyless}


#: The generation routes the gateway relays to vLLM under the same paths.
DATA_ROUTES = (Routes.COMPLETIONS, Routes.CHAT, Routes.GENERATE)


#: Where the gateway answers vLLM's own RL routes (``service.native``): base URL
#: ``http://host:port/rc/<token>``, so a client that can set only a base URL
#: authenticates by its path (TRL keeps the path part of ``vllm_server_base_url``).
NATIVE_PREFIX = "/rc/"

#: vLLM's RL control surface as the gateway answers it, path -> method.
NATIVE_ROUTES: Mapping[str, str] = {
    Routes.HEALTH: "GET", Routes.MODELS: "GET", Routes.VERSION: "GET",
    Routes.SERVER_INFO: "GET", Routes.GET_WORLD_SIZE: "GET", Routes.IS_PAUSED: "GET",
    Routes.WEIGHT_INFO: "GET", Routes.INIT_TRANSFER: "POST", Routes.PAUSE: "POST",
    Routes.RESUME: "POST", Routes.START_UPDATE: "POST", Routes.UPDATE_WEIGHTS: "POST",
    Routes.FINISH_UPDATE: "POST", Routes.RESET_PREFIX: "POST"}
