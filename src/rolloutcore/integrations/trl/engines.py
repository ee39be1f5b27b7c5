"""Where the TRL integration generates: an in-process session or a gateway, behind one protocol."""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rolloutcore.core.adapters import AdapterVersion
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.evidence import Check
from rolloutcore.core.records import Classification, FailureKind, Interrupted, Step
from rolloutcore.core.versions import (
    Binding,
    EngineIdentity,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import (
    BadInput,
    EffectError,
    JournalError,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.integrations.trl.common import (
    _RETRY_503_S,
    EndedUpdate,
    Interruption,
    deferred_interrupts,
)
from rolloutcore.provenance.trajectory import (
    FleetPlacement,
    SamplingSpec,
    Timestamps,
    VersionSpan,
)
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import httpx
    import torch

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.runner import LifecycleRunner
    from rolloutcore.session import EngineSession
    from rolloutcore.transports.base import WeightTransport
    from rolloutcore.verification.image_probe import ProbeSuite
    from rolloutcore.verification.probe import PolicyProbe

    #: What an update checks the engine with (``EngineSession.update``'s ``probe``).
    Probe = PolicyProbe | ProbeSuite | bool

__all__ = ["FLEET_EPOCH", "EngineSample", "PublishedUpdate", "RolloutEngine", "answer_adapter",
           "end_open_update"]

#: The engine epoch of the version a trainer holds through a fleet gateway: the fleet's
#: version (generation, label), which each replica serves as an engine version of its
#: own (each sample's binding names that one, and its ``fleet`` placement the replica).
FLEET_EPOCH = "fleet"

# --------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class PublishedUpdate:
    """What an engine's update published (the transition's phase times included)."""

    version: WeightVersion
    identity: WeightIdentity
    phases_s: Mapping[str, float]
    #: A LoRA run's update: the adapter version published (the base unchanged), and
    #: the probe through it (nats, the largest on any engine).
    adapter: AdapterVersion | None = None
    probe_max_abs_diff: float | None = None
    #: The adapter version as each engine that acknowledged it holds it (its path, its
    #: base), by replica; ``""``: the one engine of a session or a gateway.
    adapters: Mapping[str, AdapterVersion] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSample:
    """One generated sample as the engine answered it, with its binding."""

    binding: Binding
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str
    spans: tuple[VersionSpan, ...] | None
    stamps: Timestamps
    attributable: bool = True
    #: The LoRA-adapter version it was generated through (a LoRA run), on the
    #: binding's base version.
    adapter: AdapterVersion | None = None
    #: Through a fleet gateway: the replica that answered and the fleet version it
    #: served as the binding's engine version.
    fleet: FleetPlacement | None = None


class RolloutEngine(Protocol):
    """What the rollout function needs from where the policy is served.

    Two are built in (an ``EngineSession``; a gateway); another serving stack
    under a ``LifecycleController`` can be plugged in by implementing this.
    """

    replica: str

    def committed(self) -> tuple[WeightVersion, WeightIdentity]: ...

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Probe,
               owner: str) -> PublishedUpdate: ...

    def generate(self, rollout_id: str, prompt: Sequence[int],
                 spec: SamplingSpec) -> EngineSample: ...

    def engine_identity(self) -> EngineIdentity: ...

    def close(self) -> None: ...


def _vllm_extra(spec: SamplingSpec) -> dict[str, Any]:
    """``spec.to_vllm()`` less what ``VllmHTTP.generate`` takes as arguments."""
    out = spec.to_vllm()
    for k in ("max_tokens", "temperature", "seed", "logprobs", "ignore_eos"):
        out.pop(k, None)
    return out


#: The names of the runner's effect threads (``LifecycleRunner._effect``).
_EFFECT_THREADS = frozenset(f"rolloutcore-{s}" for s in (*(x.value for x in Step),
                                                          "validate_live"))


def _await_effects(deadline: float) -> None:
    """Wait, until ``deadline`` at most, for the effects under way to unwind.

    An effect's worker is reused, not ended, when its effect returns
    (``control.effects``): it is renamed idle, so its name says whether it still
    runs an effect; waiting for the thread to end would wait out the deadline.
    """
    me = threading.current_thread()
    while any(th.name in _EFFECT_THREADS and th is not me for th in threading.enumerate()):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def end_open_update(controller: LifecycleController, runner: LifecycleRunner,
                    reason: str) -> EndedUpdate | None:
    """End the update left open when its owner was interrupted; ``None`` if none is open.

    An interrupt (``KeyboardInterrupt``, ``SystemExit``) is not an exception the
    runner classifies: it leaves the runner wherever it was, the update open
    (admission closed, the engine perhaps paused with half of the weights in).
    It is ended here as the runner ends an effect whose deadline expired: the
    effect still running in its worker thread is cancelled (``adapter.cancel``)
    and given the runner's grace to unwind, the step the update was in is failed
    as a TIMEOUT (its outcome is unknown), and the failure path does what the
    policy says (``LifecycleRunner._after_failure``): a drain or a preflight
    mutated nothing, the engine is resumed on the old version; from the transfer
    on it is ambiguous, TAINTED and fenced. Never leaves it serving unverified
    weights. Ctrl-C is deferred meanwhile (bounded by the runner's deadlines).
    """
    from rolloutcore.control.outcomes import UpdateOutcome
    from rolloutcore.control.runner import _STEP_OF_STATE

    with deferred_interrupts("ending the update in progress"):
        ticket = controller.current_ticket
        state = controller.state
        step = _STEP_OF_STATE.get(state)
        if ticket is None or step is None:
            return None
        with contextlib.suppress(Exception):
            runner.adapter.cancel(step)
        _await_effects(time.monotonic() + runner.deadlines.cancel_grace_s)
        try:
            verdict = controller.fail(ticket, step, FailureKind.TIMEOUT, reason)
        except JournalError:  # applied (as ambiguous), not recorded: the journal failed
            runner._fence_quietly()
            return EndedUpdate(ticket.update_id, ticket.target.version, state, step.value,
                               Classification.AMBIGUOUS, controller.state)
        with contextlib.suppress(UpdateFailed):
            runner._after_failure(ticket, verdict, UpdateOutcome(ticket, None, state, 0.0))
        return EndedUpdate(ticket.update_id, ticket.target.version, state, step.value,
                           verdict.classification, controller.state)


def interrupted_record(controller: LifecycleController, what: Interruption) -> Interrupted:
    """The journal's ``interrupted`` record of ``what`` on this controller, as it is now."""
    u = what.update
    return Interrupted(what.cause, what.phase, what.step, controller.state,
                       controller.committed, None if u is None else u.update_id,
                       None if u is None else u.state,
                       None if u is None else u.classification, controller.load,
                       "; ".join(x for x in (what.samples_text, what.detail) if x))


def adapter_reference(model: torch.nn.Module, engine_dtype: str | None) -> torch.nn.Module:
    """The trainer's PEFT model with its adapter weights as the engine holds them.

    A float32 copy whose ``lora_`` tensors went through ``engine_dtype`` (bf16 for
    the tiny checkpoint) and back: the probe's reference then differs from the
    engine only by the engine's arithmetic, as the full update's reference
    (``weights._probe_reference``) is made of the tensors sent. ``None``: the
    model itself.
    """
    if engine_dtype is None:
        return model
    import copy

    import torch

    dt = getattr(torch, engine_dtype, None)
    if not isinstance(dt, torch.dtype):
        raise BadInput(f"engine dtype {engine_dtype!r} is not a torch dtype")
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.requires_grad_(False)
            if "lora_" in name:
                p.data = p.data.to(dt).to(p.dtype)
    return ref.eval()


def answer_adapter(info: Mapping[str, Any], headers: Mapping[str, str],
                   published: Mapping[str, AdapterVersion]) -> AdapterVersion | None:
    """The adapter version a gateway's answer names (``None``: none, the base answered).

    ``info`` is the answer's ``rolloutcore`` body field, ``headers`` its headers
    (``X-RolloutCore-Adapter`` and ``-Digest`` must name the same version as the
    body); ``published``: the versions the gateway published for this trainer, by
    name. A version among them, with the same generation, content and base, is
    returned as published (with its path); any other is returned as the answer
    names it (``path`` ``gateway:NAME``): it is not this step's, and the rollout
    refuses the sample. ``BadInput`` for an answer that does not say it coherently.
    """
    name = info.get("adapter")
    h_name, h_digest = headers.get("x-rolloutcore-adapter"), headers.get(
        "x-rolloutcore-adapter-digest")
    if name is None:
        if h_name is not None or any(k in info for k in ("adapter_generation",
                                                         "adapter_digest", "adapter_base")):
            raise BadInput("the answer names an adapter only in part")
        return None
    gen, digest, base = info["adapter_generation"], info["adapter_digest"], info["adapter_base"]
    if isinstance(gen, bool) or not isinstance(gen, int):
        raise BadInput(f"adapter_generation is not an int: {gen!r}")
    if h_name != name or h_digest != digest:
        raise BadInput(f"the headers name adapter {h_name!r} ({h_digest!r}), the body "
                       f"{name!r} ({digest!r})")
    known = published.get(str(name))
    if known is not None and (known.generation, known.content_digest, known.base) == (
            gen, digest, base):
        return known
    return AdapterVersion(gen, str(name), f"gateway:{name}", str(digest), str(base))


def _placement(info: Mapping[str, Any], fleet: bool) -> FleetPlacement | None:
    """The replica and fleet version an answer names (a fleet gateway's); ``BadInput``
    when a fleet's answer does not name them, or one engine's does."""
    keys = ("replica", "fleet_version", "fleet_label")
    if not any(k in info for k in keys):
        if fleet:
            raise BadInput("a fleet gateway's answer names no replica and fleet version")
        return None
    if not fleet:
        raise BadInput("the answer names a fleet placement; the gateway's status is one "
                       "engine's")
    v = info["fleet_version"]
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadInput(f"fleet_version is not an int: {v!r}")
    return FleetPlacement(info["replica"], v, info["fleet_label"])


def _probe_diff(checks: Iterable[Check]) -> float | None:
    """The adapter probe's largest difference among an adapter update's checks; ``None``
    without one."""
    ch = next((c for c in checks if c.name == "adapter-probe"), None)
    return None if ch is None or ch.max_abs_diff is None else float(ch.max_abs_diff)


class _AdapterPublisher(abc.ABC):
    """What both engines do for a LoRA run (``adapters=True``): the base is never updated,
    ``update_adapter`` publishes the trainer's adapter as the next adapter version and
    answers the base version (unchanged) with it. Each engine says only how it publishes
    (``_publish_adapter``)."""

    adapters: bool

    @abc.abstractmethod
    def committed(self) -> tuple[WeightVersion, WeightIdentity]: ...

    def _no_base_update(self) -> None:
        if self.adapters:
            raise BadInput("a LoRA run publishes adapters (update_adapter), never the base")

    @abc.abstractmethod
    def _publish_adapter(self, model: Any, provenance: Provenance, engine_dtype: str | None
                         ) -> tuple[Mapping[str, AdapterVersion], Mapping[str, float],
                                    float | None]:
        """The version published, as each engine holds it (by replica, ``""`` for one
        engine), the phases, and the largest probe difference through it."""

    def update_adapter(self, model: Any, provenance: Provenance,
                       engine_dtype: str | None = None) -> PublishedUpdate:
        """Publish ``model``'s adapter (a PEFT model, not merged) as the next adapter
        version; the base version is unchanged."""
        if not self.adapters:
            raise BadInput("this engine was not set up for adapters (adapters=True)")
        by_replica, phases, diff = self._publish_adapter(model, provenance, engine_dtype)
        version, identity = self.committed()
        first = by_replica[min(by_replica)]
        return PublishedUpdate(version, identity, dict(phases), first, diff, dict(by_replica))


class _SessionEngine(_AdapterPublisher):
    """An in-process ``EngineSession``: its controller admits, its runner updates.

    ``adapters=True`` (a LoRA run, ``session.enable_adapters`` done): the base is
    never updated; ``update_adapter`` publishes the trainer's adapter as the next
    adapter version (``control.adapters``: loaded, listed, probed through it and
    the base beside it, then published), and every request is bound to (base
    version, current adapter version) and sent as that adapter.
    """

    def __init__(self, session: EngineSession, *, owns: bool, adapters: bool = False) -> None:
        if adapters and getattr(session, "adapters", None) is None:
            raise BadInput("adapters=True needs a session with adapters enabled "
                           "(session.enable_adapters, on an engine started with "
                           "--enable-lora)")
        self.session = session
        self.owns = owns
        self.adapters = adapters
        self.replica = str(session.http.base_url)

    def committed(self) -> tuple[WeightVersion, WeightIdentity]:
        c = self.session.controller
        if c.committed is None or c.identity is None:
            raise BadInput("the session is not bootstrapped: call session.bootstrap(checkpoint) "
                           "first (or use RolloutCoreRollout.launch)")
        return c.committed, c.identity

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Probe,
               owner: str) -> PublishedUpdate:
        self._no_base_update()
        res = self.session.update(state, provenance, probe=probe, owner=owner)
        return PublishedUpdate(res.version, res.identity, res.outcome.breakdown())

    def _publish_adapter(self, model: Any, provenance: Provenance, engine_dtype: str | None
                         ) -> tuple[Mapping[str, AdapterVersion], Mapping[str, float],
                                    float | None]:
        """In process: verified against ``model`` itself, its adapter weights rounded to
        ``engine_dtype`` (what the engine holds: vLLM loads an adapter in the model's
        dtype)."""
        res = self.session.update_adapter(model, provenance,
                                          reference=adapter_reference(model, engine_dtype))
        return {"": res.version}, res.phases, _probe_diff(res.checks)

    def generate(self, rollout_id: str, prompt: Sequence[int], spec: SamplingSpec) -> EngineSample:
        c, http = self.session.controller, self.session.http
        mgr = self.session.adapters if self.adapters else None   # not None: __init__
        adapter: AdapterVersion | None = None
        if mgr is not None:
            bound = mgr.admit(rollout_id)  # (base, adapter) or refused
            binding, adapter = bound.base, bound.adapter.adapter
        else:
            binding = c.admit(rollout_id)
        aw, am = time.time(), time.monotonic()
        try:
            assert spec.max_tokens is not None
            g = http.generate(prompt, max_tokens=spec.max_tokens, temperature=spec.temperature,
                              seed=spec.seed, logprobs=True,
                              ignore_eos=bool(spec.extra.get("ignore_eos", False)),
                              request_id=rollout_id, sampling_extra=_vllm_extra(spec),
                              cache_salt=salt_for(binding.version),
                              model=None if adapter is None else adapter.name)
        finally:
            try:
                if adapter is not None and mgr is not None:
                    mgr.release(rollout_id)
            finally:
                done = c.complete(rollout_id)
        cw, cm = time.time(), time.monotonic()
        return EngineSample(binding, tuple(g.token_ids), tuple(g.logprobs or ()),
                            g.finish_reason or "unknown", g.weight_versions,
                            Timestamps(aw, am, cw, max(cm, am)), done.attributable, adapter)

    def engine_identity(self) -> EngineIdentity:
        from rolloutcore.engine.state import engine_identity

        return engine_identity(self.session.http)

    def end_update(self, reason: str) -> EndedUpdate | None:
        """End an update left open by an interrupt (``end_open_update``)."""
        return end_open_update(self.session.controller, self.session.runner, reason)

    def record_interruption(self, what: Interruption) -> Interruption:
        """Write the journal's ``interrupted`` record; an update still open is ended first.

        Returns ``what``, with the update this ended if it named none.
        """
        ended = self.end_update(f"interrupted ({what.cause}) during {what.phase}: the "
                                "journal closes with the update open")
        if ended is not None and what.update is None:
            what = dataclasses.replace(what, update=ended)
        self.session.runner.emit(interrupted_record(self.session.controller, what))
        return what

    def close(self) -> None:
        if self.owns:
            self.session.close()


class _GatewayEngine(_AdapterPublisher):
    """A ``rolloutcore serve`` gateway: its data plane admits, its control API updates.

    ``adapters=True`` (a LoRA run, the gateway started with ``serve --lora``): the base
    is never updated; ``update_adapter`` saves the trainer's adapter (``save_pretrained``,
    not merged) to a fresh directory under ``adapter_dir`` (where the gateway can read
    it: the same machine) and publishes it through the trainer protocol
    (``RolloutCoreClient.update_adapter``: the gateway copies it into its own store,
    verifies and publishes it); the directory is removed once it is published. Every
    request asks for ``public_model`` (the gateway binds it to (base version, current
    adapter version)), and each sample takes the adapter version its answer names
    (``rolloutcore.adapter``, ``adapter_generation``, ``adapter_digest``,
    ``adapter_base``, and the ``X-RolloutCore-Adapter`` headers, which must agree).

    A fleet gateway (``serve --engines N --lora``; its status has replicas, not one
    committed version) is a LoRA run's only: the version held is the fleet's
    (``FLEET_EPOCH``), its identity the one the fleet published (``GET
    /control/adapters``' ``base``); an adapter version is taken as published only
    when every serving replica acknowledged it (``service.adapter_answer``), and each
    replica's copy is kept (``published[replica]``). Each sample names its replica
    and fleet version (``fleet``); its binding is that replica's engine version, which
    must be the one the fleet's status says it serves that fleet version as.
    """

    def __init__(self, url: str, token: str, *, transport: WeightTransport | None,
                 data_token: str | None, timeout_s: float, min_verification: str | None,
                 adapters: bool = False, adapter_dir: str | Path | None = None,
                 public_model: str = "policy", http_transport: httpx.BaseTransport | None = None,
                 probe_tolerance: float | None = None) -> None:
        from rolloutcore.engine.client import EngineClient
        from rolloutcore.service.client import RolloutCoreClient

        if not adapters and adapter_dir is not None:
            raise BadInput("adapter_dir is for adapters=True (a LoRA run)")
        if not isinstance(public_model, str) or not public_model:
            raise BadInput("public_model must be a non-empty model name")
        self.replica = url.rstrip("/")
        self.client = RolloutCoreClient(self.replica, token, transport=transport,
                                        http_transport=http_transport)
        headers = {"authorization": f"Bearer {data_token}"} if data_token else {}
        self.http = EngineClient(self.replica, timeout_s=timeout_s, headers=headers,
                                 transport=http_transport)
        self.timeout_s = timeout_s
        self.min_verification = min_verification
        #: The tolerance this trainer declares for each adapter version's probe (the
        #: gateway's own default when None), as for its full updates.
        self.probe_tolerance = probe_tolerance
        self.adapters = bool(adapters)
        self.adapter_dir = None if adapter_dir is None else Path(adapter_dir)
        self.public_model = public_model
        #: The adapter versions the gateway published for this trainer: by replica
        #: (``""``: a gateway's one engine), then by name, as that engine holds it.
        self.published: dict[str, dict[str, AdapterVersion]] = {}
        #: A fleet gateway (known from its status, ``committed``): (replica, fleet
        #: generation) -> the engine version that replica serves it as; None: one engine.
        self.fleet: dict[tuple[str, int], WeightVersion] | None = None
        self._lock = threading.Lock()
        self._version: WeightVersion | None = None
        self._identity: WeightIdentity | None = None
        self._model: str | None = public_model if adapters else None

    def committed(self) -> tuple[WeightVersion, WeightIdentity]:
        st = self.client.status()
        if "committed" not in st and isinstance(st.get("replicas"), list):
            return self._fleet_committed(st)
        if not st.get("committed") or not st.get("identity"):
            raise BadInput(f"the gateway has no committed version (state {st.get('state')})")
        v, ident = WeightVersion.from_dict(st["committed"]), WeightIdentity.from_dict(
            st["identity"])
        with self._lock:
            if self.fleet is not None:
                raise BadInput("the gateway answered as a fleet before, as one engine now")
            self._version, self._identity = v, ident
        return v, ident

    def _fleet_committed(self, st: Mapping[str, Any]) -> tuple[WeightVersion, WeightIdentity]:
        """A fleet gateway's version (its newest), as the trainer holds it, and what each
        serving replica serves it as (class docstring)."""
        if not self.adapters:
            raise BadInput("a fleet gateway (serve --engines N) takes a full update as a "
                           "checkpoint (POST /control/fleet/updates), not through this "
                           "trainer's transfer: only a LoRA run (adapters=True, train "
                           "--lora) trains through one")
        try:
            newest = st["newest"]
            if not newest:
                raise BadInput(f"the fleet has published no version (serving "
                               f"{st.get('serving')})")
            gen, label, digest = (int(newest["generation"]), str(newest["label"]),
                                  str(newest["identity_digest"]))
            served = {(str(r["name"]), int(r["fleet_generation"])):
                      WeightVersion.from_dict(r["engine_version"])
                      for r in st["replicas"] if r.get("in_pool") is True
                      and r.get("fleet_generation") is not None and r.get("engine_version")}
            base = self.client.adapters().get("base")
            if not isinstance(base, Mapping):
                raise BadInput("GET /control/adapters names no base (the fleet's version "
                               "the adapters apply to)")
            ident = WeightIdentity.from_dict(base["identity"])
        except (KeyError, TypeError, ValueError) as exc:   # BadInput is a ValueError
            raise BadInput(f"unexpected fleet status: {exc!r}") from exc
        if (base.get("generation"), base.get("label"), ident.digest) != (gen, label, digest):
            raise BadInput(f"the fleet's adapters apply to {base.get('label')} "
                           f"({ident.digest[:16]}), its newest version is {label} "
                           f"({digest[:16]})")
        v = WeightVersion(gen, label, FLEET_EPOCH)
        with self._lock:
            if self.fleet is None and self._version is not None:
                raise BadInput("the gateway answered as one engine before, as a fleet now")
            self.fleet, self._version, self._identity = served, v, ident
        return v, ident

    def update(self, state: Mapping[str, Any], provenance: Provenance, probe: Probe,
               owner: str) -> PublishedUpdate:
        self._no_base_update()
        # The probe was computed from the trainer's own model (``probe_for``): a
        # state dict alone cannot give one, and the gateway's floor is the probe.
        res = self.client.update(WeightSource.of(state), provenance, owner=owner,
                                 probe=probe, min_verification=self.min_verification)
        if res.published is None or res.identity is None:
            raise UpdateFailed(res.phase or "commit", res.classification or "ambiguous",
                               res.state, f"the gateway answered {res.status} without a "
                               "published version")
        ident = WeightIdentity.from_dict(res.identity)
        with self._lock:
            self._version, self._identity = res.published, ident
        return PublishedUpdate(res.published, ident, dict(res.phases))

    def _publish_adapter(self, model: Any, provenance: Provenance, engine_dtype: str | None
                         ) -> tuple[Mapping[str, AdapterVersion], Mapping[str, float],
                                    float | None]:
        """Through the gateway: it computes the references itself, from the base it serves
        and the directory it is sent (``engine_dtype`` is not needed). Fail-closed: a
        refusal or failure raises (``UpdateRefused``, ``UpdateFailed``; an answer of
        any other kind, or a fleet's where a serving replica did not acknowledge it, is
        an ``UpdateFailed``, ambiguous); the directory of an adapter not published is
        kept (the gateway may still be reading it)."""
        if self.adapter_dir is not None:
            self.adapter_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"step{provenance.step}-",
                                    dir=None if self.adapter_dir is None else self.adapter_dir))
        model.save_pretrained(out)
        try:
            res = self.client.update_adapter(out, provenance,
                                             probe_tolerance=self.probe_tolerance)
        except (UpdateRefused, UpdateFailed, EffectError, BadInput):
            raise
        except RolloutCoreError as exc:   # an answer neither published nor refused
            raise UpdateFailed("adapter", "ambiguous", "unknown",
                               f"the gateway's adapter update answered: {exc}") from exc
        with self._lock:
            fleet = self.fleet is not None
        if res.fleet != fleet:
            raise UpdateFailed("adapter", "ambiguous", "unknown",
                               f"unexpected answer to the adapter update: "
                               f"{'a fleet' if res.fleet else 'one engine'} acknowledged "
                               f"{res.name}, the gateway's status is "
                               f"{'a fleet' if fleet else 'one engine'}'s")
        by_replica = {n: a.version for n, a in res.acks.items()}
        with self._lock:
            for n, v in by_replica.items():
                self.published.setdefault(n, {})[v.name] = v
        shutil.rmtree(out, ignore_errors=True)   # the gateway holds its own copy
        return by_replica, res.phases, res.probe_max_abs_diff

    def _served_model(self) -> str:
        if self._model is None:
            r = self.http.request("GET", Routes.MODELS, step="generate", mutation_started=False)
            self._model = str(r.json()["data"][0]["id"])
        return self._model

    def generate(self, rollout_id: str, prompt: Sequence[int], spec: SamplingSpec) -> EngineSample:
        body = {"model": self._served_model(), "token_ids": list(prompt),
                "sampling_params": spec.to_vllm()}
        deadline = time.monotonic() + _RETRY_503_S
        while True:
            aw, am = time.time(), time.monotonic()
            r = self.http.request("POST", Routes.GENERATE, step="generate", json_body=body,
                                  headers={"x-rolloutcore-rollout-id": rollout_id},
                                  check_status=False, mutation_started=False,
                                  what=f"POST {Routes.GENERATE} (gateway)")
            retry = r.headers.get("retry-after")
            if r.status_code == 503 and retry is not None and time.monotonic() < deadline:
                time.sleep(min(float(retry), max(0.0, deadline - time.monotonic())))
                continue
            break
        cw, cm = time.time(), time.monotonic()
        if r.status_code != 200:
            raise EffectError("generate", f"gateway answered {r.status_code}: {r.text[:300]}",
                              mutation_started=False)
        try:
            d = r.json()
            info = d["rolloutcore"]
            ch = d["choices"][0]
            toks = tuple(int(t) for t in ch.get("token_ids") or ())
            lps = tuple(float(c["logprob"]) for c in (ch.get("logprobs") or {}).get(
                "content") or ())
            version = WeightVersion(int(info["generation"]), str(info["version"]),
                                    str(info["engine_epoch"]))
            digest = str(info["identity_digest"])
            spans = VersionSpan.parse(ch.get("weight_versions"))
            finish = str(ch.get("finish_reason") or "unknown")
            placed = _placement(info, self.fleet is not None)
            with self._lock:
                adapter = answer_adapter(info, r.headers, self.published.get(
                    "" if placed is None else placed.replica, {})) if self.adapters else None
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EffectError("generate", f"unexpected gateway answer: {exc!r}",
                              mutation_started=False) from exc
        with self._lock:
            ident = self._identity
        if ident is None or ident.digest != digest or (
                placed is not None and self._serves(placed) != version):
            self.committed()
            with self._lock:
                ident = self._identity
        assert ident is not None
        if placed is not None and self._serves(placed) != version:
            raise EffectError("generate", f"unexpected gateway answer: replica "
                              f"{placed.replica} answered as engine version {version}, the "
                              f"fleet's status says it serves fleet version "
                              f"{placed.fleet_version} as {self._serves(placed)}",
                              mutation_started=False)
        # Credited to its binding only if the gateway's release said so (an answer it
        # released unattributable carries ``attributable: false``) and the identity is
        # the one this side knows.
        credited = ident.digest == digest and info.get("attributable", True) is not False
        rid = str(info.get("rollout_id") or rollout_id)
        return EngineSample(Binding(version, ident, rid), toks, lps, finish, spans,
                            Timestamps(aw, am, cw, max(cm, am)), credited, adapter, placed)

    def _serves(self, placed: FleetPlacement) -> WeightVersion | None:
        with self._lock:
            return None if self.fleet is None else self.fleet.get(
                (placed.replica, placed.fleet_version))

    def engine_identity(self) -> EngineIdentity:
        r = self.http.request("GET", Routes.VERSION, step="identity", check_status=False,
                              mutation_started=False)
        version = str(r.json().get("version", "unknown")) if r.status_code == 200 else "unknown"
        return EngineIdentity(version, self._served_model(), {}, self.replica)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.http.close()


