"""The fleet gateway's LoRA-adapter half: ``model: "policy"`` routed to the fleet's adapter.

``AdapterFleetAdmission`` is the fleet's admission (``fleet.gateway.FleetAdmission``:
choose a replica and bind on its controller at the version chosen for) with
what ``service.admission.AdapterEngine`` does for one engine: a request for
the public model (``policy``) is bound to (base version, the fleet's current
adapter version) on a replica that serves that adapter
(``FleetAdapters.eligible``: published there, verified on the base its engine
serves now, not tainted for adapters), sent as the adapter's name, and its
answer and record name the adapter, besides the fleet's version and replica.
While no adapter is published, ``policy`` requests are the base's. A request
naming an adapter version itself is refused (400), as are prompt
log-probabilities (they crash vLLM 0.32's CPU LoRA engines beside other
requests) and, once an adapter is published, base requests (the CPU LoRA
kernels compute a base request batched with adapter requests with an
adapter) unless ``base_beside_adapters``.

``fleet_adapter_routes``: ``POST /control/adapters`` (control token; the body
of ``service.adapter_control``) runs ``FleetAdapters.update``: 200 with the
fleet's version and each replica's checks; 400 bad body or adapter; 409
refused (nothing changed) or failed (published nowhere: each replica's
outcome). ``GET /control/adapters``: the fleet's current adapter and each
replica's adapter table.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.adapters import AdapterVersion
from rolloutcore.core.versions import Binding
from rolloutcore.errors import BadInput, RouteRefused
from rolloutcore.fleet.adapters import FleetAdapters
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.gateway import FleetAdmission, create_fleet_app
from rolloutcore.fleet.routing import Policy, ReplicaView
from rolloutcore.service.adapter_control import adapter_routes
from rolloutcore.service.admission import Target, _asks_prompt_logprobs
from rolloutcore.service.config import ServiceConfig

__all__ = ["AdapterFleetAdmission", "create_lora_fleet_app", "fleet_adapter_routes"]


class AdapterFleetAdmission(FleetAdmission):
    """A fleet's admission that serves its adapter versions (module docstring)."""

    public_model = "policy"

    def __init__(self, coordinator: FleetCoordinator, default_policy: Policy,
                 adapters: FleetAdapters, *, base_beside_adapters: bool = False) -> None:
        if not isinstance(adapters, FleetAdapters) or adapters.coordinator is not coordinator:
            raise BadInput("adapters must be the FleetAdapters of this coordinator")
        super().__init__(coordinator, default_policy)
        self.adapters = adapters
        self.base_beside_adapters = base_beside_adapters
        self._targets: dict[tuple[str, int | None, str], Target] = {}

    def routing(self, payload: dict[str, Any], headers: Mapping[bytes, bytes]
                ) -> tuple[Any, bool]:
        if _asks_prompt_logprobs(payload):
            raise RouteRefused(400, "prompt log-probabilities (prompt_logprobs, or echo with "
                                    "logprobs) are refused on these LoRA engines: on vLLM "
                                    "0.32's CPU build they crash one beside other requests")
        model = payload.get("model")
        if isinstance(model, str) and model != self.public_model and \
                self.adapters.is_adapter(model):
            raise RouteRefused(400, f"{model!r} is an adapter version: ask for model "
                                    f"{self.public_model!r}, the gateway binds the current one")
        (policy, group), changed = super().routing(payload, headers)
        return (policy, group, model == self.public_model), changed

    def try_admit(self, rollout_id: str, routing: Any) -> tuple[Binding, Target]:
        policy, group, wants = routing
        cur = self.adapters.current
        if cur is None:
            return super().try_admit(rollout_id, (policy, group))
        if not wants:
            if not self.base_beside_adapters:
                raise RouteRefused(400, f"an adapter is published: ask for model "
                                        f"{self.public_model!r}; base requests beside adapter "
                                        f"requests are refused on these engines")
            return super().try_admit(rollout_id, (policy, group))
        m = self.adapters.manager

        def target(choice: ReplicaView, b: Binding) -> Target:
            rb = m(choice.name).bind(rollout_id, b, expect=cur.name)
            return self._adapter_target(choice, policy, rb.adapter.adapter, m(choice.name))

        return self._admit(rollout_id, policy, group,
                           {n for n in self._replicas if not self.adapters.eligible(n)},
                           f"no replica serving adapter {cur.name}", target)

    def _adapter_target(self, choice: ReplicaView, policy: Policy, a: AdapterVersion,
                        m: AdapterManager) -> Target:
        key = (choice.name, choice.generation, a.name)
        t = self._targets.get(key)
        if t is None or t.on_release != m.release_soon:
            base = self._target(choice, policy)
            if len(self._targets) > 256:
                self._targets.clear()
            t = self._targets[key] = Target(
                base.name, base.controller,
                {**base.info, "adapter": a.name, "adapter_generation": a.generation,
                 "adapter_digest": a.content_digest, "adapter_base": a.base},
                (*base.headers, (b"x-rolloutcore-adapter", a.name.encode()),
                 (b"x-rolloutcore-adapter-digest", a.content_digest.encode())),
                a.name, m.release_soon)  # its unloads off the event loop
        return t

    def on_change(self, wake: Callable[[], None]) -> None:
        super().on_change(wake)
        self.adapters.watch(wake)


def fleet_adapter_routes(adapters: FleetAdapters, denied: Callable[[Request], Response | None],
                         json_body: Callable[[Request], Awaitable[Any]]) -> list[Route]:
    """``POST``/``GET /control/adapters`` over a fleet's ``FleetAdapters``: the one
    engine's routes (``service.adapter_control.adapter_routes``) with the fleet's
    status (each replica's adapter table)."""
    return adapter_routes(adapters, denied, json_body, status=adapters.status)


def create_lora_fleet_app(coordinator: FleetCoordinator, config: ServiceConfig,
                          adapters: FleetAdapters, *,
                          default_policy: str | Policy = "latest",
                          base_beside_adapters: bool = False, **kw: Any) -> Starlette:
    """``fleet.gateway.create_fleet_app`` serving the fleet's adapter versions: its
    admission is ``AdapterFleetAdmission`` and ``/control/adapters`` is added."""
    if not isinstance(adapters, FleetAdapters):
        raise BadInput("adapters must be a FleetAdapters")
    policy = default_policy if isinstance(default_policy, Policy) else Policy.parse(
        default_policy)
    adm = AdapterFleetAdmission(coordinator, policy, adapters,
                                base_beside_adapters=base_beside_adapters)
    return create_fleet_app(coordinator, config, default_policy=policy, admission=adm,
                            extra_routes=lambda denied, json_body: fleet_adapter_routes(
                                adapters, denied, json_body), **kw)
