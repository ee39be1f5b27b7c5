"""``rolloutcore serve --engines N`` / ``--ray``: a fleet of vLLM engines behind one gateway.

The engines are started here (local processes, or Ray actors through a
placement group), each taken over by its own controller through the same
verified takeover as ``serve --upstream`` (to the verification floor), put
into fleet version 0 on the checkpoint they were started from, and behind
the fleet gateway (``fleet.gateway``: the single gateway's data plane with a
router in front). Updates come through the control route
``POST /control/fleet/updates`` with a checkpoint directory the gateway can
read (``{"checkpoint": ..., "strategy": "synchronous"|"rolling", ...}``);
the coordinator then moves every engine (one fan-out broadcast for a
synchronous update, per-engine waves for a rolling one).

Every ``serve`` option either means the same for a fleet (tokens, binds,
limits, client deadlines, the drain deadline and policy, the verification
floor, a saved takeover probe, ``--record``, ``--journal``) or is refused at
start with the reason (``cli.serve.FLEET_REFUSED``). As for one engine,
everything that can be refused is refused before anything starts: a bad
option, a non-loopback bind without the tokens, a missing checkpoint, a
journal directory of another fleet.

A ``--journal`` directory a previous fleet gateway wrote is restored, as
``serve --journal`` restores one gateway: the published fleet versions and
every replica's engine versions continue (no label is given twice), an
update that was in flight is recorded as interrupted, and each new engine is
taken over as the replacement of its replica's previous one, verified like a
recovery (``FleetCoordinator.bootstrap``).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.core.pool import Strategy
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.errors import BadInput, RolloutCoreError
from rolloutcore.fleet.coordinator import FleetCoordinator
from rolloutcore.fleet.model import TRANSFERS, FleetConfig, FleetWeights, Replica
from rolloutcore.fleet.routing import Policy
from rolloutcore.service.config import ServiceConfig, check_bind
from rolloutcore.service.serve import control_token, exit_on_signal, vocab_size

if TYPE_CHECKING:
    from rolloutcore.core.adapters import AdapterConfig
    from rolloutcore.fleet.adapters import FleetAdapters
    from rolloutcore.fleet.placement import RayPlacement
    from rolloutcore.service.recording import GatewayRecorder

__all__ = ["FleetServeOptions", "parse_update_request", "run_fleet_serve"]


@dataclass(frozen=True)
class FleetServeOptions:
    engines: int = 2
    ray: bool = False
    ray_address: str | None = None
    model: str | None = None
    step: int = 0
    workdir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    token: str | None = None
    token_file: str | None = None
    token_out: str | None = None
    data_token: str | None = None
    default_policy: str = "latest"
    quorum: int | None = None
    min_serving: int | None = None
    queue: int = 0
    queue_wait_s: float = 30.0
    health_interval_s: float = 1.0        # the supervisor's period (0: none)
    journal_dir: str | None = None
    record: str | None = None
    min_verification: str | None = None   # the floor (default: the highest reachable)
    takeover_probe: str | None = None     # a saved PolicyProbe.to_wire() of the checkpoint
    drain_policy: str = "abort"
    drain_timeout_s: float = 120.0
    max_body_bytes: int = 1 << 20
    client_body_s: float = 30.0
    client_send_s: float = 30.0
    lora: bool = False                    # LoRA engines; the fleet's adapter versions
    max_loras: int | None = None
    max_lora_rank: int | None = None
    tensor_parallel_size: int = 1         # ranks of each launched engine
    pipeline_parallel_size: int = 1       # stages of each launched engine
    vllm_args: tuple[str, ...] = ()       # vLLM options passed to every engine
    native_routes: bool = False           # vLLM's RL routes under /rc/<token> (fleet.native)
    lease_s: float = 120.0                # a native round not finished by then is expired

    def __post_init__(self) -> None:
        from rolloutcore.engine.args import check_vllm_args
        from rolloutcore.service.serve import check_lora_options

        check_lora_options(self.lora, self.max_loras, self.max_lora_rank)
        object.__setattr__(self, "vllm_args", check_vllm_args(self.vllm_args))
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or \
                not 1 <= self.engines <= 512:
            raise BadInput(f"engines must be an int in 1..512, got {self.engines!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, name)
            check_int(name, v, 1, 64)
        if self.ray and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise BadInput("--ray places one-rank engines (one Ray bundle each); a fleet of "
                           "tensor- or pipeline-parallel engines runs as local processes "
                           "(--engines N), not placed by Ray yet")
        Policy.parse(self.default_policy)   # a RouteRefused (BadInput) when unknown
        if self.quorum is not None and not 1 <= self.quorum <= self.engines:
            raise BadInput(f"quorum must be in 1..{self.engines}, got {self.quorum}")
        if self.min_serving is not None and not 0 <= self.min_serving < self.engines:
            raise BadInput(f"min_serving must be in 0..{self.engines - 1}, "
                           f"got {self.min_serving}")
        if not 0 < self.port < 65536:
            raise BadInput(f"port must be in 1..65535, got {self.port}")
        if self.drain_policy not in ("abort", "refuse"):
            raise BadInput(f"drain_policy must be 'abort' or 'refuse', got {self.drain_policy!r}")
        if self.min_verification is not None:
            VerificationLevel.parse(self.min_verification)
        if not isinstance(self.native_routes, bool):
            raise BadInput("native_routes must be a bool")
        if isinstance(self.lease_s, bool) or not isinstance(self.lease_s, (int, float)) \
                or not 0 < self.lease_s < float("inf"):
            raise BadInput(f"lease_s must be a positive number of seconds, got {self.lease_s!r}")
        if self.lease_s != 120.0 and not self.native_routes:
            raise BadInput("--lease-s with a fleet: it bounds a round on vLLM's own routes "
                           "(--native-routes); the fleet's own updates "
                           "(POST /control/fleet/updates) run under their deadlines")
        if self.native_routes and self.lora:
            raise BadInput("--native-routes with --lora on a fleet: vLLM's adapter routes are "
                           "not mapped onto the fleet's adapter versions yet")
        if isinstance(self.health_interval_s, bool) or not isinstance(
                self.health_interval_s, (int, float)) or self.health_interval_s < 0:
            raise BadInput("health_interval_s must be >= 0 (0: no supervisor)")


_UPDATE_KEYS = frozenset({"checkpoint", "strategy", "label", "quorum", "min_serving",
                          "wave_size", "transfer", "step", "trainer_run", "owner"})


def parse_update_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A control-route body checked field by field (``BadInput`` names the first bad one)."""
    unknown = sorted(set(body) - _UPDATE_KEYS)
    if unknown:
        raise BadInput(f"unknown fields {unknown}; known: {sorted(_UPDATE_KEYS)}")
    ckpt = body.get("checkpoint")
    if not isinstance(ckpt, str) or not (Path(ckpt) / "config.json").is_file():
        raise BadInput("'checkpoint' must name a model directory the gateway can read")
    out: dict[str, Any] = {"checkpoint": ckpt}
    try:
        out["strategy"] = Strategy(body.get("strategy", "synchronous"))
    except ValueError:
        raise BadInput(f"'strategy' must be one of {[s.value for s in Strategy]}") from None
    for k in ("quorum", "min_serving", "wave_size", "step"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise BadInput(f"'{k}' must be an integer >= 0")
        out[k] = v
    for k in ("label", "trainer_run", "owner"):
        v = body.get(k)
        if v is not None and not isinstance(v, str):
            raise BadInput(f"'{k}' must be a string")
        out[k] = v
    tr = body.get("transfer")
    if tr is not None and tr not in TRANSFERS:
        raise BadInput(f"'transfer' must be one of {list(TRANSFERS)}")
    out["transfer"] = tr
    return out


def check_journal_dir(journal_dir: str | os.PathLike[str], engines: int) -> int:
    """A previous fleet gateway's journals, read before anything starts: the pool's must
    be of as many replicas, and every journal must read (``BadInput`` otherwise).
    Returns how many pool records a restart will restore (0: a new directory)."""
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.pool import ReplicaTable
    from rolloutcore.errors import JournalError

    d = Path(journal_dir)
    if d.exists() and not d.is_dir():
        raise BadInput(f"--journal {d}: a fleet's journal is a directory (the pool's "
                       "journal and one per replica)")
    pool = d / "fleet.jsonl"
    if not pool.exists() or not pool.stat().st_size:
        return 0
    names = [f"e{i}" for i in range(engines)]
    try:
        table = ReplicaTable.replay(read_journal(pool, live=True), names)
        for n in names:
            j = d / f"{n}.journal.jsonl"
            if not j.exists() or not j.stat().st_size:
                raise BadInput(f"{j} is missing: replica {n}'s engine versions could not "
                               "continue (its labels would repeat)")
            read_journal(j, live=True)  # a torn last line is cut when it opens
    except (JournalError, BadInput) as exc:
        raise BadInput(f"--journal {d}: cannot restore from it: {exc}") from exc
    return table.replayed


def _check(o: FleetServeOptions) -> tuple[str, bool, ServiceConfig]:
    """Everything refused before anything starts: (token, given, the gateway's config)."""
    token, given = control_token(o.token, o.token_file)
    data_token = o.data_token or os.environ.get("ROLLOUTCORE_DATA_TOKEN") or None
    check_bind(o.host, given, data_token is not None)
    if o.model is not None and not (Path(o.model) / "config.json").is_file():
        raise BadInput(f"{o.model} is not a model directory (no config.json)")
    if o.takeover_probe is not None and not Path(o.takeover_probe).is_file():
        raise BadInput(f"--takeover-probe {o.takeover_probe}: no such file")
    if o.journal_dir is not None:
        check_journal_dir(o.journal_dir, o.engines)
    if o.token_out is not None and os.path.islink(o.token_out):
        raise BadInput(f"--token-out {o.token_out} is a symbolic link: the control token is "
                       "never written through one")
    if o.record is not None and Path(o.record).is_dir():
        raise BadInput(f"--record {o.record} is a directory: give a trajectory file")
    floor = None if o.min_verification is None else VerificationLevel.parse(o.min_verification)
    cfg = ServiceConfig(upstream_url="http://127.0.0.1:1", control_token=token,
                        data_token=data_token, queue_max=o.queue, queue_wait_s=o.queue_wait_s,
                        max_body_bytes=o.max_body_bytes, client_body_s=o.client_body_s,
                        client_send_s=o.client_send_s, health_interval_s=0,
                        min_verification=floor, lease_s=min(o.lease_s, 1800.0))
    return token, given, cfg


def run_fleet_serve(o: FleetServeOptions) -> int:
    """Start the engines, the coordinator and the gateway; block until interrupted."""
    if not isinstance(o, FleetServeOptions):
        raise BadInput("run_fleet_serve takes FleetServeOptions")
    token, given, cfg = _check(o)
    floor = cfg.min_verification
    from rolloutcore.service.serve import refuse_taken_port

    taken = refuse_taken_port(o.host, o.port)   # before any engine starts
    if taken is not None:
        return taken
    if not o.ray:
        from rolloutcore.fleet.placement import cpu_binding

        # Cores for every rank of every engine, or a refusal before anything is made.
        ranks = o.tensor_parallel_size * o.pipeline_parallel_size
        for i in range(o.engines):
            cpu_binding(i, o.engines, ranks=ranks)
    from rolloutcore.control.runner import Deadlines, DrainPolicy
    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.fleet.placement import (
        build_fleet,
        launch_local,
        place_ray,
        prepare_checkpoint,
    )
    from rolloutcore.service.server import run_until_signalled

    workdir = Path(o.workdir or tempfile.mkdtemp(prefix="rolloutcore-fleet-"))
    if o.model is not None:
        model_dir = Path(o.model)
    else:
        from rolloutcore.testing.models import make_checkpoint

        model_dir = make_checkpoint(workdir / "policy-0", seed=0)
        print(f"[rolloutcore] generated a tiny checkpoint at {model_dir}", file=sys.stderr)
    weights0 = prepare_checkpoint(model_dir, Provenance(str(model_dir.resolve()), "", o.step),
                                  probe=o.takeover_probe is None)
    if o.takeover_probe is not None:
        weights0 = _with_saved_probe(weights0, o.takeover_probe, model_dir)
    reachable = weights0.min_verification
    if floor is not None and floor > reachable:
        raise BadInput(f"--min-verification {floor.wire} cannot be reached with this "
                       f"checkpoint's probe (at most {reachable.wire})")
    level = floor if floor is not None else reachable
    weights0 = dataclasses.replace(weights0, min_verification=level)
    where = "Ray actors" if o.ray else "local processes"
    print(f"[rolloutcore] starting {o.engines} vLLM engines as {where} on {model_dir}",
          file=sys.stderr)
    engines: list[Any] = []
    placement: RayPlacement | None = None
    coord: FleetCoordinator | None = None
    recorder: GatewayRecorder | None = None
    try:
        lora_kw: dict[str, Any] = {}
        lora_budget: AdapterConfig | None = None
        if o.lora:
            from rolloutcore.service.serve import lora_engine_args

            largs, lenv, lora_budget = lora_engine_args(o.max_loras, o.max_lora_rank)
            lora_kw = {"extra_args": largs + o.vllm_args, "env": lenv}
        elif o.vllm_args:
            lora_kw = {"extra_args": o.vllm_args}
        if o.ray:
            placement = place_ray(o.engines, model_dir, address=o.ray_address, progress=True,
                                  log_dir=workdir / "logs", **lora_kw)
            engines = list(placement.engines)
        else:
            engines = launch_local(o.engines, model_dir, log_dir=workdir / "logs",
                                   progress=True, tensor_parallel_size=o.tensor_parallel_size,
                                   pipeline_parallel_size=o.pipeline_parallel_size, **lora_kw)
        coord = build_fleet(engines, checkpoint=model_dir, weights=weights0,
                            config=FleetConfig(quorum=o.quorum, min_serving=o.min_serving,
                                               health_interval_s=o.health_interval_s),
                            deadlines=Deadlines(drain_s=o.drain_timeout_s),
                            drain_policy=DrainPolicy(o.drain_policy),
                            journal_dir=o.journal_dir or workdir / "journals", journal_keep=256)
        fleet = coord
        newest = coord.newest
        print(f"[rolloutcore] fleet version {newest.label if newest else '?'} on "
              f"{len(coord.serving())} of {o.engines} engines, each taken over verified to "
              f"{level.wire}", file=sys.stderr)

        fleet_adapters: FleetAdapters | None = None

        def updater(body: Mapping[str, Any]) -> Any:
            req = parse_update_request(body)
            ck = req["checkpoint"]
            w = prepare_checkpoint(ck, Provenance(str(Path(ck).resolve()),
                                                  req["trainer_run"] or "", req["step"] or 0))
            if w.min_verification < level:
                raise BadInput(f"this update reaches {w.min_verification.wire}, below the "
                               f"floor {level.wire}")
            res = fleet.update(dataclasses.replace(w, min_verification=level),
                               strategy=req["strategy"], label=req["label"],
                               owner=req["owner"] or "trainer", quorum=req["quorum"],
                               min_serving=req["min_serving"], wave_size=req["wave_size"],
                               transfer=req["transfer"])
            if fleet_adapters is not None:
                # The adapters' references follow the base; the current adapter was
                # verified on the old one and serves no request until an adapter is
                # published on the new one (docs/lora.md).
                fleet_adapters.set_base(Path(ck))
            return res

        if o.record is not None:
            recorder = _recorder(o.record, coord, engines)
        if o.lora:
            fleet_adapters = _fleet_adapters(coord, model_dir, workdir, lora_budget,
                                             o.max_lora_rank,
                                             Path(o.journal_dir or workdir / "journals"),
                                             upload=o.ray)
        app_kw: dict[str, Any] = dict(
            default_policy=o.default_policy, updater=updater, check_update=parse_update_request,
            on_finished=recorder, supervise=o.health_interval_s > 0)
        if o.native_routes:
            from rolloutcore.service.serve import native_routes_token

            # One vLLM to a trainer that speaks vLLM's contract: one fleet version a round.
            app_kw["native_token"] = native_routes_token(o.token_out, o.host, o.port)
        if fleet_adapters is not None:
            from rolloutcore.fleet.adapter_gateway import create_lora_fleet_app

            app = create_lora_fleet_app(coord, cfg, fleet_adapters, **app_kw)
        else:
            app = create_fleet_app(coord, cfg, **app_kw)
        run_until_signalled(app, o.host, o.port, cfg, exit_on_signal, token=token,
                            token_given=given, token_out=o.token_out,
                            banner=f"fleet gateway http://{o.host}:{o.port} -> "
                                   + ", ".join(e.base_url for e in engines))
        return 0
    finally:
        if recorder is not None:
            recorder.close()
        if coord is not None:
            coord.close()
        if placement is not None:
            placement.shutdown()
        else:
            for e in engines:
                e.stop()


def _fleet_adapters(coord: FleetCoordinator, model_dir: Path, workdir: Path,
                    budget: AdapterConfig | None,
                    max_lora_rank: int | None, journal_dir: Path, upload: bool = False
                    ) -> FleetAdapters:
    """``--lora``: each replica's ``AdapterManager`` (its engine's HTTP, its journal), and
    the fleet's adapter versions over them (``fleet.adapters``). ``upload`` (``--ray``:
    engines may sit on other nodes): each version's files go into each engine's own store
    (``transports.adapter_store``) and are loaded from there. A previous fleet's
    journals: their adapter names stay refused, and the adapter every replica had
    published is published again (verified, a new name) before the gateway serves."""
    from rolloutcore.control.adapters import AdapterManager
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.fleet.adapters import FleetAdapters

    rank = 16 if max_lora_rank is None else max_lora_rank

    def make(rep: Replica) -> AdapterManager:
        ad = rep.runner.adapter
        if not isinstance(ad, VllmAdapter):
            raise BadInput(f"--lora drives a vLLM engine; replica {rep.name} has none")
        epoch = rep.controller.committed.engine_epoch if rep.controller.committed else "x"
        return AdapterManager(ad.http, rep.controller, base_model=model_dir,
                              store=workdir / "adapters" / rep.name / str(epoch)[:32],
                              config=budget, listener=None if rep.journal is None
                              else rep.journal.listener, max_rank=rank,
                              calibrations=lambda: getattr(rep.runner.adapter, "calibrations",
                                                           {}),  # a recovery replaces it
                              upload=upload)

    fa = FleetAdapters(coord, make, base_model=model_dir, max_rank=rank)
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.adapters import AdapterChange

    changes = {}
    for n in fa.managers:
        jp = journal_dir / f"{n}.journal.jsonl"
        changes[n] = [r.record for r in read_journal(jp, live=True)
                      if isinstance(r.record, AdapterChange)] if jp.is_file() else []
    was = fa.restore(changes)
    if was is not None:
        try:
            res = fa.update(Path(was.path), Provenance(was.path, "restored", 0))
            print(f"[rolloutcore] the journals' adapter {was.name} published again on every "
                  f"engine as {res.version.name}", file=sys.stderr)
        except RolloutCoreError as exc:
            print(f"[rolloutcore] the journals' adapter {was.name} was not published again: "
                  f"{exc}; 'policy' is the base's until an adapter is published",
                  file=sys.stderr)
    print(f"[rolloutcore] LoRA adapters enabled on {len(fa.managers)} engines (max rank "
          f"{rank}): POST /control/adapters publishes one on every serving engine or none; "
          f"requests for model 'policy' are served by the fleet's current one",
          file=sys.stderr)
    return fa


def _with_saved_probe(weights: FleetWeights, path: str, model_dir: Path) -> FleetWeights:
    """``--takeover-probe``: the checkpoint's probe as saved, instead of computing it."""
    import json

    from rolloutcore.session import PreparedUpdate
    from rolloutcore.verification.probe import PolicyProbe

    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"--takeover-probe {path}: {exc}") from exc
    probe = PolicyProbe.from_wire(raw, vocab_size=vocab_size(model_dir))
    if not isinstance(weights.payload, PreparedUpdate):
        raise BadInput("--takeover-probe replaces the probe of prepare_checkpoint's weights")
    payload = dataclasses.replace(weights.payload, probe=probe)
    return dataclasses.replace(weights, payload=payload, probe=probe,
                               min_verification=VerificationLevel.PROBE)


def _recorder(path: str, coord: FleetCoordinator, engines: Sequence[Any]) -> GatewayRecorder:
    """``--record``: one trajectory file; each sample names its replica's engine."""
    from rolloutcore.core.versions import EngineIdentity
    from rolloutcore.errors import EffectError
    from rolloutcore.service.recording import GatewayRecorder

    ids: dict[str, EngineIdentity] = {}
    for name, rep in coord.replicas.items():
        http = getattr(rep.runner.adapter, "http", None)
        version = "unknown"
        if http is not None:
            try:
                version = str(http.version())
            except EffectError:  # an engine that cannot say is recorded as unknown
                version = "unknown"
        eng = next((e for e in engines if e.base_url == rep.url), None)
        econf: dict[str, Any] = {}
        if eng is not None and hasattr(eng, "dtype"):
            econf = {"dtype": eng.dtype, "max_model_len": eng.max_model_len,
                     "enable_prefix_caching": eng.prefix_caching}
        ids[name] = EngineIdentity(version, str(getattr(eng, "model_name", "policy")), econf,
                                   str(rep.url))
    return GatewayRecorder(path, next(iter(ids.values())), engines=ids)
