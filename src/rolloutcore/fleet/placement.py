"""Where a fleet's engines come from, and the replicas built over them.

Three placements, one result (engine handles with ``base_url`` and ``epoch``):

* **URLs**: engines started by anything (Kubernetes, Slurm, by hand);
  ``vllm_replica(name, url)``; recovery then needs an operator
  (``engine.recovery.OperatorRecoverer``) or none (the replica stays fenced);
* **local processes**: ``launch_local(n, checkpoint)`` starts ``ManagedEngine``s
  in parallel, each on a port of its own that a restart keeps;
* **Ray actors**: ``place_ray(n, checkpoint)`` reserves one bundle per engine
  in a placement group (``{"GPU": 1, "CPU": c}`` on GPUs, ``{"CPU": c}`` on
  the CPU) and starts one ``EngineActor`` per bundle, which runs the engine
  process on the bundle's node; ``RayEngine`` is its handle on this side.
  With no cluster address a local Ray cluster is started (``ray.init()``), on
  loopback. Ray is what the RL frameworks (verl, OpenRLHF, NeMo-RL, SkyRL)
  already place vLLM with; RolloutCore adds no launcher protocol of its own.

``vllm_replica`` wires one engine as ``EngineSession`` does (adapter over its
HTTP API with a per-engine ``GlooTransport``, controller, runner, its own
journal) plus what a fleet needs: a recoverer for engines we launched
(restart on the start checkpoint, verified), a fan-out URL, and the hooks
that drop a transfer group another one replaced (``on_fanout``) and rebind
the adapter to the replacement process after a recovery (``on_recovered``).

``prepare_checkpoint`` turns a checkpoint directory into the ``FleetWeights``
of an update: identity (manifest, provenance, content digest), the policy
probe computed once from its tensors, the source a fan-out broadcasts.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.control.runner import Deadlines, DrainPolicy
from rolloutcore.control.stack import wire
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.errors import BadInput, EngineUnavailable
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import FleetConfig, FleetWeights, Replica
from rolloutcore.session import PreparedUpdate, identity_of
from rolloutcore.transports import engine_key
from rolloutcore.transports.net import free_port
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

    from rolloutcore.control.port import Recoverer
    from rolloutcore.transports.rank_checksums import RankReport
    from rolloutcore.verification.probe import PolicyProbe

__all__ = [
    "RayEngine",
    "RayPlacement",
    "build_fleet",
    "cpu_binding",
    "launch_local",
    "place_ray",
    "prepare_checkpoint",
    "start_all",
    "vllm_replica",
]


# --------------------------------------------------------------------------- weights

def prepare_checkpoint(path: str | os.PathLike[str], provenance: Provenance | None = None,
                       *, probe: bool = True) -> FleetWeights:
    """The ``FleetWeights`` of a checkpoint directory (probe computed once, for every engine)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise BadInput(f"{p} is not a model directory (no config.json)")
    src = WeightSource.from_checkpoint(p)
    prov = provenance or Provenance(str(p.resolve()), "", 0)
    ident = identity_of(src, prov)
    pr: PolicyProbe | None = None
    if probe:
        from rolloutcore.verification.probe import PolicyProbe

        pr = PolicyProbe.from_checkpoint(str(p))
    prepared = PreparedUpdate(src, prov, ident, pr, None)
    return FleetWeights(ident, prepared, src,
                        VerificationLevel.PROBE if pr is not None else VerificationLevel.DECLARED,
                        probe=pr)


# --------------------------------------------------------------------------- replicas

def vllm_replica(name: str, url: str, *, engine: Any = None, transport: Any = None,
                 journal_path: str | os.PathLike[str] | None = None,
                 journal_keep: int | None = None, deadlines: Deadlines | None = None,
                 checkpoint: str | os.PathLike[str] | None = None,
                 identity: WeightIdentity | None = None, op_timeout_s: float = 60.0,
                 drain_policy: DrainPolicy = DrainPolicy.ABORT,
                 controller_kw: Mapping[str, Any] | None = None,
                 recoverer: Recoverer | None = None) -> Replica:
    """One vLLM engine as a fleet replica (see the module docstring).

    ``engine``: the launcher's handle (``ManagedEngine``, ``RayEngine``);
    with ``checkpoint`` it gets a ``ManagedRecoverer`` that restarts it on
    that checkpoint, declared as ``identity`` (the fleet's start version, so
    a recovered replica is on it without an update); a recovery runs the
    checkpoint's policy probe. ``recoverer``: one built by the caller (e.g.
    once for a large checkpoint, whose content digest reads every byte)
    instead. ``controller_kw``: the replica controller's keyword arguments
    (``config``: its ``ControllerConfig``; ``required_caches``), as
    ``LifecycleController`` takes them.
    """
    from rolloutcore.transports.gloo import GlooTransport

    tr = transport or GlooTransport(op_timeout_s=op_timeout_s)
    # A journal a previous gateway wrote is restored (its versions, its open update).
    epoch = str(engine.epoch) if engine is not None else None
    adapter = VllmAdapter(VllmHTTP(url), tr, engine_epoch=epoch)
    # The one composition; a launched engine's exit taints its replica at once (#47).
    stack = wire(adapter, journal_path=journal_path, restore=True, journal_keep=journal_keep,
                 controller_kw=dict(controller_kw or {}), deadlines=deadlines,
                 drain_policy=drain_policy, engine=engine)
    journal, runner = stack.journal, stack.runner
    assert journal is not None  # restore=True always opens one
    adopt = None
    if checkpoint is not None:
        from rolloutcore.engine.recovery import ManagedRecoverer, OperatorRecoverer

        if recoverer is None and engine is not None:
            recoverer = ManagedRecoverer(engine, checkpoint, identity=identity)

        def adopt(previous_epoch: str) -> OperatorRecoverer:
            """The engine this start launched, as the journal's engine's replacement."""
            return OperatorRecoverer(url, checkpoint, signal=lambda: True, wait_s=5.0,
                                     previous_epoch=previous_epoch, identity=identity)

    def stage(payload: object) -> None:
        if not isinstance(payload, PreparedUpdate):
            raise BadInput("a vLLM replica stages a PreparedUpdate (prepare_checkpoint)")
        ad = runner.adapter
        if not isinstance(ad, VllmAdapter):
            raise BadInput("a vLLM replica's runner drives a VllmAdapter")
        ad.stage(payload.source, provenance=payload.provenance,
                             reference_checksums=payload.reference_checksums,
                             probes=payload.probe)

    def on_fanout() -> None:
        tr.abort()  # its per-engine group was replaced; the next per-engine send reconnects
        tr.forget_round(url)  # what the fan-out's ranks report replaces its last round

    def on_recovered() -> None:
        """A new process answers at the URL: a fresh adapter for it (instance id, group)."""
        old = runner.adapter
        tr.abort()
        new = VllmAdapter(VllmHTTP(url), tr,
                          engine_epoch=str(engine.epoch) if engine is not None else None)
        new.bootstrap()   # reads the new incarnation and joins a transfer group with it
        if isinstance(old, VllmAdapter):  # same model, same kernels: same noise
            new.calibrations.update(old.calibrations)
        runner.adapter = new
        with contextlib.suppress(Exception):
            if isinstance(old, VllmAdapter):
                old.http.close()

    def close() -> None:
        try:
            if isinstance(runner.adapter, VllmAdapter):
                runner.adapter.close()
        finally:
            journal.close()

    def on_round(nonce: str, sent: Mapping[str, torch.Tensor],
                 reports: Sequence[tuple[int, RankReport]]) -> None:
        """A fan-out round's reports of this engine's ranks: its validation checks them."""
        tr.adopt_round(url, nonce, sent, reports)

    # Only a gloo group is replaced by a fan-out round (a CUDA IPC mapping is not).
    gloo = isinstance(tr, GlooTransport)
    return Replica(name, runner, stage, url=url, recoverer=recoverer, fanout_url=url,
                   engine=engine, on_fanout=on_fanout if gloo else None,
                   close=close, journal=journal,
                   on_recovered=on_recovered, adopt=adopt, on_round=on_round if gloo else None)


# --------------------------------------------------------------------------- starting

def start_all(starters: Mapping[str, Callable[[], Any]], *, progress: bool = False,
              timeout_s: float = 900.0) -> dict[str, Any]:
    """Run every starter in parallel; show one progress line while they start.

    Returns name -> what each starter returned; if any fails, raises its
    error after the others have finished (the caller stops what did start).
    """
    from rolloutcore.engine.process import show_progress

    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    done: dict[str, float] = {}
    t0 = time.monotonic()

    def run(name: str, fn: Callable[[], Any]) -> None:
        try:
            results[name] = fn()
        except BaseException as exc:  # reported after every start has ended
            errors[name] = exc
        finally:
            done[name] = time.monotonic() - t0

    threads = [threading.Thread(target=run, args=(n, f), daemon=True,
                                name=f"rc-start-{n}") for n, f in starters.items()]
    for th in threads:
        th.start()
    tty = progress and sys.stderr.isatty()
    last = -1
    deadline = t0 + timeout_s
    while any(th.is_alive() for th in threads) and time.monotonic() < deadline:
        time.sleep(0.2)
        el = int(time.monotonic() - t0)
        if progress and el != last and (tty or el % 10 == 0):
            last = el
            show_progress(_line(starters, done, errors, el), tty)
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    if progress:
        show_progress(_line(starters, done, errors, int(time.monotonic() - t0)), tty, final=True)
    if errors:
        raise next(iter(errors.values()))
    missing = [n for n in starters if n not in results]
    if missing:
        raise EngineUnavailable("launch", f"{missing} did not start in {timeout_s:g}s",
                                mutation_started=False)
    return results


def _line(starters: Mapping[str, Any], done: Mapping[str, float],
          errors: Mapping[str, BaseException], el: int) -> str:
    parts = []
    for n in starters:
        if n in errors:
            parts.append(f"{n} FAILED")
        elif n in done:
            parts.append(f"{n} ready ({done[n]:.0f}s)")
        else:
            parts.append(f"{n} starting")
    ready = sum(1 for n in starters if n in done and n not in errors)
    return f"engines {ready}/{len(starters)} ready after {el}s: " + ", ".join(parts)


def cpu_binding(i: int, n: int, env: Mapping[str, str] | None = None, *,
                ranks: int = 1, cpus: Sequence[int] | None = None) -> dict[str, str]:
    """Engine ``i`` of ``n`` on one host: which cores vLLM's CPU backend binds its workers to.

    vLLM's CPU build binds every engine's worker to the same cores by default
    (``VLLM_CPU_OMP_THREADS_BIND=auto``: the first cores, one kept back), so
    engines started side by side compute on one core between them. Engine
    ``i`` gets its own share of the cores this process may use
    (``os.sched_getaffinity``, or ``cpus``), round robin when there are more
    one-rank engines than cores. An engine of ``ranks`` workers (tensor x
    pipeline parallel) gets ``ranks`` disjoint groups of its share, separated
    by ``|`` as vLLM reads them (``0|1``, ``4-5|6-7``); fewer cores than
    ``n * ranks`` is refused (``BadInput``): ranks sharing a core spin against
    each other (an operator who accepts that sets ``VLLM_CPU_OMP_THREADS_BIND``).
    Nothing is set for one one-rank engine, when the caller's ``env`` or this
    process's environment already chooses, or (``ranks`` > 1) where CUDA is
    present (the GPU build ignores it).
    """
    check_int("ranks", ranks, 1)
    if (n <= 1 and ranks <= 1) or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (
            env is not None and "VLLM_CPU_OMP_THREADS_BIND" in env):
        return {}
    if cpus is None:
        if ranks > 1:
            import torch

            if torch.cuda.is_available():
                return {}
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(
            range(os.cpu_count() or 1))
    cpus = sorted(cpus)
    if ranks == 1:
        share = max(1, len(cpus) // n)
        start = (i * share) % len(cpus)
        ids = [cpus[(start + k) % len(cpus)] for k in range(share)]
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in ids)}
    if len(cpus) < n * ranks:
        raise BadInput(f"{n} engine(s) of {ranks} ranks (tensor x pipeline parallel) need "
                       f"{n * ranks} CPU cores, one per rank, on vLLM's CPU build; this "
                       f"process may use {len(cpus)} ({','.join(map(str, cpus))}). Start "
                       "fewer engines or ranks, or set VLLM_CPU_OMP_THREADS_BIND yourself to "
                       "share cores between ranks")
    share = len(cpus) // (n * ranks)
    groups = [cpus[(i * ranks + r) * share:(i * ranks + r + 1) * share] for r in range(ranks)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 and g[-1] - g[0] == len(g) - 1
        else ",".join(map(str, g)) for g in groups)}


def _host_bindings(n: int, env: Mapping[str, str], engine_kwargs: Mapping[str, Any]
                   ) -> list[dict[str, str]]:
    """Every rank of every one of ``n`` engines on this host on cores of its own
    (``cpu_binding``), refused before anything starts where the host has too few.

    vLLM's idle spin is left as vLLM sets it: a shorter one
    (``ROLLOUTCORE_VLLM_IDLE_SPIN_S``, ``transports.vllm_plugin``) made a crowded
    host faster but put some answers over 5 s (``results/idle-spin.json``); an
    operator who wants that trade passes it in ``env``."""
    ranks = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        v = engine_kwargs.get(key, 1)
        check_int(key, v, 1)
        ranks *= v
    return [cpu_binding(i, n, env, ranks=ranks) for i in range(n)]


def launch_local(n: int, checkpoint: str | os.PathLike[str], *,
                 log_dir: str | os.PathLike[str] | None = None, progress: bool = False,
                 startup_timeout_s: float = 600.0, **engine_kwargs: Any) -> list[Any]:
    """``n`` ``ManagedEngine``s on ``checkpoint``, started in parallel (all or none)."""
    from rolloutcore.engine.process import ManagedEngine

    check_int("the number of engines", n, 1)
    env = dict(engine_kwargs.pop("env", None) or {})
    bindings = _host_bindings(n, env, engine_kwargs)
    # Their dev and weight routes answer only this process (transports.engine_key).
    engine_kwargs.setdefault("guard_routes", True)
    engines = [ManagedEngine(Path(checkpoint), port=free_port(),
                             startup_timeout_s=startup_timeout_s,
                             log_dir=None if log_dir is None else Path(log_dir) / f"e{i}",
                             env={**bindings[i], **env},
                             **engine_kwargs) for i in range(n)]
    try:
        start_all({f"e{i}": e.start for i, e in enumerate(engines)}, progress=progress,
                  timeout_s=startup_timeout_s + 30)
    except BaseException:
        for e in engines:
            e.stop()
        raise
    return engines


# --------------------------------------------------------------------------- Ray

_ACTOR: Any = None


def _engine_actor() -> Any:
    """The Ray actor class (built on first use: Ray is imported only here)."""
    global _ACTOR
    if _ACTOR is None:
        import ray

        class EngineActor:
            """Runs one vLLM engine process on its bundle's node (``ManagedEngine``)."""

            def __init__(self, checkpoint: str, kwargs: dict[str, Any]) -> None:
                from rolloutcore.engine.process import ManagedEngine

                kw = dict(kwargs)
                if kw.get("host") is None:
                    kw["host"] = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call,unused-ignore]
                kw.setdefault("port", free_port(kw["host"]))
                self.engine = ManagedEngine(checkpoint, **kw)

            def start(self, timeout_s: float | None = None) -> dict[str, Any]:
                self.engine.start(timeout_s)
                return self.info()

            def info(self) -> dict[str, Any]:
                e = self.engine
                return {"base_url": e.base_url, "epoch": e.epoch, "model_name": e.model_name,
                        "route_key": e.route_key, "command": e.command(),
                        "last_start_s": e.last_start_s,
                        "model_dir": str(e.model_dir), "pid": e.pid if e.alive() else None,
                        "node_id": ray.get_runtime_context().get_node_id()}

            def alive(self) -> bool:
                return self.engine.alive()

            def stop(self, grace_s: float | None = None) -> None:
                self.engine.stop(grace_s)

            def restart(self, checkpoint: str | None, timeout_s: float | None) -> dict[str, Any]:
                self.engine.restart(checkpoint, timeout_s)
                return self.info()

            def signal_group(self, sig: int) -> None:
                self.engine.signal_group(sig)

            def log_tail(self, lines: int = 40) -> str:
                return self.engine.log_tail(lines)

        _ACTOR = ray.remote(EngineActor)
    return _ACTOR


class RayEngine:
    """This side's handle of an ``EngineActor``: what ``ManagedEngine`` offers a fleet."""

    call_timeout_s = 900.0

    def __init__(self, actor: Any, info: Mapping[str, Any]) -> None:
        self.actor = actor
        self._info: dict[str, Any] = {}
        self._set_info(info)

    def _set_info(self, info: Mapping[str, Any]) -> None:
        """The actor's engine as it answers now; its route key for this process's clients."""
        old = self._info
        if old.get("route_key"):
            engine_key.forget(str(old["base_url"]), str(old["route_key"]))
        self._info = dict(info)
        if self._info.get("route_key"):
            engine_key.register(str(self._info["base_url"]), str(self._info["route_key"]))

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray

        return ray.get(ref, timeout=timeout_s or self.call_timeout_s)

    @property
    def base_url(self) -> str:
        return str(self._info["base_url"])

    @property
    def epoch(self) -> str:
        return str(self._info["epoch"])

    @property
    def model_name(self) -> str:
        return str(self._info["model_name"])

    @property
    def model_dir(self) -> Path:
        return Path(self._info["model_dir"])

    @property
    def node_id(self) -> str:
        return str(self._info.get("node_id"))

    @property
    def last_start_s(self) -> float | None:
        """Seconds the actor's engine took to become healthy at its last start."""
        v = self._info.get("last_start_s")
        return None if v is None else float(v)

    def command(self) -> list[str]:
        """The engine's command line, as the actor runs it."""
        return list(self._info.get("command") or [])

    def alive(self) -> bool:
        try:
            return bool(self._get(self.actor.alive.remote(), 30.0))
        except Exception:
            return False

    def stop(self, grace_s: float | None = None) -> None:
        with contextlib.suppress(Exception):
            self._get(self.actor.stop.remote(grace_s))

    def restart(self, model_dir: str | os.PathLike[str] | None = None,
                timeout_s: float | None = None) -> RayEngine:
        self._set_info(self._get(self.actor.restart.remote(
            None if model_dir is None else str(model_dir), timeout_s)))
        return self

    def signal_group(self, sig: int) -> None:
        self._get(self.actor.signal_group.remote(int(sig)), 30.0)

    def log_tail(self, lines: int = 40) -> str:
        return str(self._get(self.actor.log_tail.remote(lines), 30.0))

    def __repr__(self) -> str:
        return f"RayEngine({self.base_url}, node {self.node_id[:8]})"


@dataclass
class RayPlacement:
    """Engines placed through one placement group; ``shutdown`` undoes all of it."""

    engines: list[RayEngine]
    placement_group: Any
    started_ray: bool
    bundles: list[dict[str, float]] = field(default_factory=list)

    def shutdown(self) -> None:
        import ray

        for e in self.engines:
            e.stop(grace_s=5.0)   # the engine process first: killing the actor would orphan it
        for e in self.engines:
            with contextlib.suppress(Exception):
                ray.kill(e.actor)
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.placement_group)
        if self.started_ray:
            ray.shutdown()


def place_ray(n: int, checkpoint: str | os.PathLike[str], *, address: str | None = None,
              cpus_per_engine: float = 1.0, gpus_per_engine: float = 0.0,
              strategy: str = "PACK", progress: bool = False,
              startup_timeout_s: float = 900.0, sequential: bool = False,
              **engine_kwargs: Any) -> RayPlacement:
    """``n`` engines as Ray actors, one per bundle of a placement group.

    ``address``: a running cluster (``"auto"``, ``"ray://..."``); ``None``
    starts a local one on loopback with ``n * cpus_per_engine`` CPUs.
    ``sequential``: start the engines one after the other (engines sharing a
    GPU, ``gpus_per_engine`` < 1: vLLM sizes its KV cache from what the
    device's memory did while it profiled, so an engine loading beside it
    takes the cache's share; seen on an H200).
    With no ``address`` and no GPUs (vLLM's CPU build, a cluster on this host)
    each engine's ranks are bound to cores of their own, as ``launch_local``
    binds them (refused before anything starts where the host has too few), and
    keep them across restarts.
    """
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    check_int("the number of engines", n, 1)
    if strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise BadInput(f"unknown placement strategy {strategy!r}")
    engine_env = dict(engine_kwargs.pop("env", None) or {})
    bindings = (_host_bindings(n, engine_env, engine_kwargs) if address is None
                and not gpus_per_engine else [{} for _ in range(n)])
    started = False
    if not ray.is_initialized():
        env = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
        kw: dict[str, Any] = {"runtime_env": {"env_vars": env}} if env else {}
        if address is None:
            ray.init(num_cpus=max(1, round(n * cpus_per_engine)),
                     num_gpus=round(n * gpus_per_engine), include_dashboard=False,
                     _node_ip_address="127.0.0.1", log_to_driver=False, **kw)
        else:
            ray.init(address=address, log_to_driver=False, **kw)
        started = True
    bundle: dict[str, float] = {"CPU": float(cpus_per_engine)}
    if gpus_per_engine:
        bundle["GPU"] = float(gpus_per_engine)
    bundles = [dict(bundle) for _ in range(n)]
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=120)
    except Exception as exc:
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(pg)
        if started:
            ray.shutdown()
        raise EngineUnavailable("launch", f"Ray could not reserve {n} bundles of {bundle}: "
                                f"{exc}", mutation_started=False) from exc
    actor_cls = _engine_actor()
    # Their dev and weight routes answer only the holders of their keys: this
    # process, which learns them from the actors (transports.engine_key).
    kwargs = {"startup_timeout_s": startup_timeout_s, "guard_routes": True, **engine_kwargs}
    if gpus_per_engine == 0:
        kwargs.setdefault("host", "127.0.0.1" if address is None else None)
    actors = [actor_cls.options(
        num_cpus=cpus_per_engine, num_gpus=gpus_per_engine, max_concurrency=8,
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=i)).remote(
                str(checkpoint), {**kwargs, "env": {**bindings[i], **engine_env}}
                if bindings[i] or engine_env else kwargs)
        for i in range(n)]
    placement = RayPlacement([], pg, started, bundles)
    try:
        def starter(a: Any) -> Callable[[], Any]:
            return lambda: ray.get(a.start.remote(), timeout=startup_timeout_s + 60)

        starters = {f"e{i}": starter(a) for i, a in enumerate(actors)}
        infos: dict[str, Any] = {}
        for group in ([{k: f} for k, f in starters.items()] if sequential else [starters]):
            infos.update(start_all(group, progress=progress,
                                   timeout_s=startup_timeout_s + 90))
        placement.engines = [RayEngine(a, infos[f"e{i}"]) for i, a in enumerate(actors)]
    except BaseException:
        for a in actors:
            with contextlib.suppress(Exception):
                ray.get(a.stop.remote(5.0), timeout=60)
            with contextlib.suppress(Exception):
                ray.kill(a)
        placement.shutdown()
        raise
    return placement


# --------------------------------------------------------------------------- the fleet

def build_fleet(engines: Sequence[Any] | None = None, urls: Sequence[str] | None = None, *,
                checkpoint: str | os.PathLike[str], provenance: Provenance | None = None,
                fanout: bool = True, config: FleetConfig | None = None,
                journal_dir: str | os.PathLike[str] | None = None,
                deadlines: Deadlines | None = None, journal_keep: int | None = None,
                op_timeout_s: float = 60.0, weights: FleetWeights | None = None,
                drain_policy: DrainPolicy = DrainPolicy.ABORT) -> FleetCoordinator:
    """A bootstrapped coordinator over launched ``engines`` or running ``urls``.

    ``checkpoint`` is what every engine was started from: fleet version 0,
    retained for rejoins; launched engines recover onto it. Each engine is
    taken over verified, to ``weights.min_verification`` (``weights``: the
    checkpoint's ``prepare_checkpoint``, computed here when not given).
    """
    if (engines is None) == (urls is None):
        raise BadInput("give engines (launched) or urls (running), not both")
    if weights is None:
        weights = prepare_checkpoint(checkpoint, provenance)
    jd = Path(journal_dir) if journal_dir is not None else None
    if jd is not None:
        jd.mkdir(parents=True, exist_ok=True)
    items = ([(f"e{i}", e.base_url, e) for i, e in enumerate(engines)] if engines is not None
             else [(f"e{i}", u.rstrip("/"), None) for i, u in enumerate(urls or [])])
    if not items:
        raise BadInput("a fleet needs at least one engine")
    reps = [vllm_replica(name, url, engine=eng, checkpoint=checkpoint if eng is not None
                         else None, identity=weights.identity, deadlines=deadlines,
                         journal_path=None if jd is None else jd / f"{name}.journal.jsonl",
                         journal_keep=journal_keep, op_timeout_s=op_timeout_s,
                         drain_policy=drain_policy)
            for name, url, eng in items]
    fan = None
    if fanout and len(reps) > 1:
        from rolloutcore.transports.fanout import GlooFanout

        fan = GlooFanout(op_timeout_s=op_timeout_s)
    coord = FleetCoordinator(reps, config=config, fanout=fan,
                             journal_path=None if jd is None else str(jd / "fleet.jsonl"),
                             journal_keep=journal_keep)
    try:
        coord.bootstrap(weights.identity, weights=weights)
    except BaseException:
        coord.close()
        raise
    return coord

