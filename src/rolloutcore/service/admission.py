"""How the data plane binds a request: to its one engine, or through a router to one of N.

The data plane (``service.proxy.DataPlane``) does the same for every request,
whatever stands behind it: one parse, one auth, the same deadlines, limits,
salting and recording. What differs between a gateway over one engine and a
fleet gateway over N is only *where* an admitted request goes, and that is
an ``Admission``:

* ``routing(payload, header)`` reads what the request asks of its placement
  (a fleet's policy and group) and removes it from the body before it is
  forwarded; a request that can never be served as asked is refused here
  (``RouteRefused``, a 4xx), before anything is admitted;
* ``try_admit(rollout_id, routing)`` chooses the engine **and** binds the
  rollout on that engine's controller in one step: the binding names the
  very version the choice was made for (``admit(expect=)``), or nothing is
  bound and the answer is a retryable refusal (503 + Retry-After), never an
  answer labelled with another version;
* ``worth_retry`` says whether a refused request waiting in the queue
  should ask again now (after a change it was woken for);
* ``observe(target, ok, refused)`` hears how each answer went: a fleet's
  router prefers engines by recent success, and a connection the engine
  refused is reported to its supervisor (the engine's own signal; a
  client's answer is never one).

``OneEngine`` is the admission of a gateway over one engine. A fleet's is
``fleet.gateway.FleetAdmission``. ``AdapterEngine`` is one engine serving
LoRA-adapter versions (``control.adapters``): a request for the public model
name is bound to (base version, current adapter version) and sent to the
adapter's own name; its answer and record name the adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.lifecycle import State
from rolloutcore.core.records import Record, Transition
from rolloutcore.core.versions import Binding
from rolloutcore.errors import RouteRefused

if TYPE_CHECKING:
    from rolloutcore.control.adapters import AdapterManager

__all__ = ["AdapterEngine", "Admission", "ClientNames", "OneEngine", "Target"]


@dataclass(frozen=True, slots=True)
class Target:
    """Where one admitted request goes, and what its answer says of where it went.

    ``name`` keys the data plane's upstream pool (``""``: the one engine);
    ``info`` joins the answer's ``rolloutcore`` body field (and the record),
    ``headers`` its version headers. ``model``: the model name the request is
    sent with instead of its own (a LoRA adapter version's); ``on_release``
    hears the rollout id when the data plane releases its binding.
    """

    name: str
    controller: LifecycleController
    info: Mapping[str, Any] = field(default_factory=dict)
    headers: tuple[tuple[bytes, bytes], ...] = ()
    model: str | None = None
    on_release: Callable[[str], object] | None = None

    def body(self, raw: bytes, payload: dict[str, Any]) -> bytes:
        """The request as forwarded: ``raw``, or sent as ``model`` (``payload`` says so too,
        so the record names the adapter version)."""
        if self.model is None:
            return raw
        payload["model"] = self.model
        return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


class Admission(Protocol):
    """Where the data plane's requests go (see the module docstring)."""

    #: Request headers ``routing`` reads (lower-case), besides the data plane's own.
    headers: frozenset[bytes]

    def upstreams(self) -> Mapping[str, str]:
        """Target name -> the engine URL the data plane keeps a pool towards."""
        ...

    def routing(self, payload: dict[str, Any], headers: Mapping[bytes, bytes]
                ) -> tuple[Any, bool]:
        """What the request asks of its placement, and whether ``payload`` changed (its
        routing fields removed); ``RouteRefused`` (a 4xx) when it can never be served."""
        ...

    def try_admit(self, rollout_id: str, routing: Any) -> tuple[Binding, Target]:
        """Choose and bind in one step (``AdmissionRefused``/``RouteRefused`` otherwise)."""
        ...

    def worth_retry(self) -> bool:
        ...

    def on_change(self, wake: Callable[[], None]) -> None:
        """Call ``wake`` (any thread) whenever a refused request might be admitted now."""
        ...

    def observe(self, target: Target, ok: bool, refused: bool) -> None:
        ...


class OneEngine:
    """The admission of a gateway over one engine: its controller, nothing to choose."""

    headers: frozenset[bytes] = frozenset()

    def __init__(self, controller: LifecycleController,
                 upstream_url: str | Callable[[], str]) -> None:
        self.controller = controller
        self._url = upstream_url
        self.target = Target("", controller)

    def upstreams(self) -> Mapping[str, str]:
        """The one engine (a callable URL is read when the data plane starts)."""
        return {"": self._url() if callable(self._url) else self._url}

    def routing(self, payload: dict[str, Any], headers: Mapping[bytes, bytes]
                ) -> tuple[Any, bool]:
        return None, False

    def try_admit(self, rollout_id: str, routing: Any) -> tuple[Binding, Target]:
        return self.controller.admit(rollout_id), self.target

    def worth_retry(self) -> bool:
        # Ask again only when it can change the answer (READY, or a final TAINTED),
        # so a queued request leaves one refusal in the journal, not one per
        # transition of the update.
        return self.controller.state in (State.READY, State.TAINTED)

    def on_change(self, wake: Callable[[], None]) -> None:
        def listener(rec: Record) -> None:
            if type(rec) is Transition:
                wake()

        self.controller.add_listener(listener)
        # A publish is admitted under once its commit is on record, not at its transition.
        self.controller.on_recorded(wake)

    def observe(self, target: Target, ok: bool, refused: bool) -> None:
        return None  # one engine: its own watch notices it (service.app's health watch)


@dataclass
class ClientNames:
    """The names a vLLM client loaded adapter versions under (vLLM's
    ``/v1/load_lora_adapter`` on the gateway, ``service.native_lora``): each name ->
    the versions loaded under it, oldest first. Only ``current`` (the name loaded
    last, until it is unloaded) is served, by the current adapter version; a request
    for an older name is refused, never answered by another version."""

    current: str | None = None
    loaded: dict[str, list[str]] = field(default_factory=dict)


#: ``AdapterEngine.routing``'s answer for a request naming ``ClientNames.current``.
_CLIENT_NAME = "client-name"


class AdapterEngine(OneEngine):
    """One engine serving LoRA-adapter versions (``control.adapters.AdapterManager``).

    A request for ``public_model`` (the name the engine serves its base as,
    ``policy`` by default) is bound to (base version, current adapter
    version) and sent as the adapter's name; while no adapter is published it
    is the base's request, as ``OneEngine``'s. A request naming an adapter
    version itself is refused (400): the gateway chooses the version, so that
    every answer is bound and recorded, and no request can reach an adapter
    that is being retired. Once an adapter is published, a request for another
    model (the base) is refused unless ``base_beside_adapters``: vLLM 0.32's
    CPU LoRA kernels compute a base request batched with adapter requests with
    the last slot's adapter (``control.adapters.BASE_PROBE_MODES``). A request for
    the name a vLLM client loaded its adapter under (``names``) is the public
    model's while that name is current (the name loaded last).
    """

    def __init__(self, adapters: AdapterManager, upstream_url: str | Callable[[], str], *,
                 public_model: str = "policy", refuse_prompt_logprobs: bool = True,
                 base_beside_adapters: bool = False) -> None:
        super().__init__(adapters.controller, upstream_url)
        self.adapters = adapters
        self.public_model = public_model
        self.refuse_prompt_logprobs = refuse_prompt_logprobs
        self.base_beside_adapters = base_beside_adapters
        self._targets: dict[str, Target] = {}
        self.names = ClientNames()

    def routing(self, payload: dict[str, Any], headers: Mapping[bytes, bytes]
                ) -> tuple[Any, bool]:
        if self.refuse_prompt_logprobs and _asks_prompt_logprobs(payload):
            # vLLM 0.32's CPU build: a prompt_logprobs request batched with another one
            # while LoRA is enabled kills the engine (VllmHTTP.top_logprobs says how).
            raise RouteRefused(400, "prompt log-probabilities (prompt_logprobs, or echo with "
                                    "logprobs) are refused on this LoRA engine: on vLLM "
                                    "0.32's CPU build they crash it beside other requests")
        model = payload.get("model")
        if isinstance(model, str) and model in self.names.loaded:
            cur = self.names.current
            if model != cur:
                raise RouteRefused(400, f"adapter {model!r} was superseded by the load of "
                                        f"{cur!r}: this gateway serves one adapter version "
                                        f"at a time, the one loaded last")
            return _CLIENT_NAME, False
        if isinstance(model, str) and model != self.public_model and \
                self.adapters.is_adapter(model):
            raise RouteRefused(400, f"{model!r} is an adapter version: ask for model "
                                    f"{self.public_model!r}, the gateway binds the current one")
        return model == self.public_model, False

    def try_admit(self, rollout_id: str, routing: Any) -> tuple[Binding, Target]:
        if self.adapters.current is None:
            if routing == _CLIENT_NAME:   # unloaded since the routing was read
                raise RouteRefused(404, "the adapter was unloaded: no adapter is published",
                                   kind="NotFoundError")
            return super().try_admit(rollout_id, routing)
        if not routing:
            if not self.base_beside_adapters:
                # vLLM 0.32's CPU LoRA kernels give a base request batched with adapter
                # requests the last slot's adapter (control.adapters.BASE_PROBE_MODES).
                raise RouteRefused(400, f"an adapter is published: ask for model "
                                        f"{self.public_model!r}; base requests beside adapter "
                                        f"requests are refused on this engine")
            return super().try_admit(rollout_id, routing)
        rb = self.adapters.admit(rollout_id)
        a = rb.adapter.adapter
        t = self._targets.get(a.name)
        if t is None:
            if len(self._targets) > 64:
                self._targets.clear()
            t = self._targets[a.name] = Target(
                "", self.controller,
                {"adapter": a.name, "adapter_generation": a.generation,
                 "adapter_digest": a.content_digest, "adapter_base": a.base},
                ((b"x-rolloutcore-adapter", a.name.encode()),
                 (b"x-rolloutcore-adapter-digest", a.content_digest.encode())),
                a.name, self.adapters.release_soon)  # its unloads off the event loop
        return rb.base, t

    def on_change(self, wake: Callable[[], None]) -> None:
        super().on_change(wake)
        self.adapters.shell.watch(wake)


def _asks_prompt_logprobs(payload: Mapping[str, Any]) -> bool:
    sp = payload.get("sampling_params")
    return (payload.get("prompt_logprobs") is not None
            or (isinstance(sp, Mapping) and sp.get("prompt_logprobs") is not None)
            or (bool(payload.get("echo")) and payload.get("logprobs") is not None))
