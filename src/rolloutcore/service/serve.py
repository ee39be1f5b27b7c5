"""The gateway in front of a vLLM server, under uvicorn: ``rolloutcore serve``.

``run_serve(ServeOptions(...))`` gets the engine one of three ways: a vLLM
already running (``upstream`` with the ``checkpoint`` it was started from,
whose identity becomes the first committed version); a vLLM it launches on
``model`` and stops on exit; or, with neither, a vLLM it launches on a tiny
checkpoint it generates offline. The options are parsed in
``rolloutcore.cli.serve``.

Everything that can be refused is refused before anything is admitted: a
non-loopback bind without a given token, bad limits, a missing checkpoint,
and a vLLM that RolloutCore cannot drive (``engine.support``: its
version and routes, read from the engine itself).

The first version is published only verified (``LifecycleRunner.take_over``):
the engine must be awake and not paused, and its label and the policy probe
of the declared checkpoint must hold, to the verification floor
(``--min-verification``, by default the highest level the engine can reach).
With ``--journal`` the previous gateway's journal is restored first: an update
it had in flight restores as TAINTED (only a replacement engine, freshly
loaded from the checkpoint, is then accepted), the version it last published
must still be what the engine serves, and rollouts it had bound are released
as unattributable. A takeover that cannot verify exits with status 3 and
publishes nothing.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.engine.args import check_vllm_args
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.support import SupportVerdict, assess
from rolloutcore.errors import BadInput, EffectError, RolloutCoreError
from rolloutcore.service.auth import generate_token, read_token_file, write_token_file
from rolloutcore.service.config import ServiceConfig, check_bind
from rolloutcore.transports import engine_key

if TYPE_CHECKING:
    from rolloutcore.control.adapters import AdapterManager
    from rolloutcore.core.adapters import AdapterConfig
    from rolloutcore.core.versions import VerificationLevel, WeightIdentity
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service.recording import GatewayRecorder
    from rolloutcore.verification.checksums import ReferenceChecksums

__all__ = ["LORA_RANKS", "PORT_IN_USE", "TAKEOVER_REFUSED", "ServeOptions",
           "check_lora_options", "control_token", "exit_on_signal", "lora_engine_args",
           "port_in_use", "reachable_verification", "refuse_taken_port", "run_serve",
           "upstream_route_key", "vocab_size",
           "write_token_file"]

#: Exit status of ``serve`` when the engine it would take over cannot be verified.
TAKEOVER_REFUSED = 3
#: Exit status of ``serve`` when the gateway's port is taken: found before anything starts.
PORT_IN_USE = 4


@dataclass(frozen=True)
class ServeOptions:
    """Everything ``rolloutcore serve`` takes; the CLI's options map one to one.

    Checked on construction (types and ranges) and again in ``run_serve``
    (what needs the environment: tokens, the bind address), so a bad value
    is refused before any engine is started.
    """

    upstream: str | None = None          # a running vLLM server
    model: str | None = None             # launch vLLM on this checkpoint
    checkpoint: str | None = None        # with upstream: what the engine was started from
    step: int = 0                        # training step of the initial weights
    transport_backend: str = "rolloutcore_gloo"
    engine_url: str | None = None        # vLLM as trainers reach it (default: upstream)
    workdir: str | None = None           # a generated checkpoint and engine logs
    host: str = "127.0.0.1"
    port: int = 8100
    token: str | None = None
    token_file: str | None = None
    token_out: str | None = None
    data_token: str | None = None
    max_body_bytes: int = 1 << 20
    drain_policy: str = "abort"          # at the drain deadline: abort stragglers, or refuse
    client_body_s: float = 30.0          # a request body must arrive within this
    client_send_s: float = 30.0          # a client may leave its answer unread this long
    queue: int = 0
    queue_wait_s: float = 30.0
    lease_s: float = 120.0
    drain_timeout_s: float = 120.0
    health_interval_s: float = 2.0
    journal: str | None = None
    record: str | None = None
    min_verification: str | None = None   # the floor (default: the highest reachable)
    takeover_probe: str | None = None     # a saved PolicyProbe.to_wire() of the checkpoint
    takeover_checksums: str | None = None  # a saved ReferenceChecksums.to_dict() of it
    update_mode: str = "strict"           # strict|keep|recompute|engine_recompute (carried)
    max_staleness: int | None = None      # asynchronous modes: the bound, in versions
    tensor_parallel_size: int = 1         # with model: ranks of the launched engine
    pipeline_parallel_size: int = 1       # with model: stages of the launched engine
    worker_extension_cls: str | None = None  # with model: vLLM's --worker-extension-cls
    lora: bool = False                    # launch with LoRA; serve adapter versions
    native_routes: bool = False           # answer vLLM's RL routes under /rc/<token> (#46)
    max_loras: int | None = None          # with lora: vLLM's --max-loras (default 2)
    max_lora_rank: int | None = None      # with lora: vLLM's --max-lora-rank (default 16)
    #: vLLM engine options passed to a launched engine (--vllm-arg, or after ``--``);
    #: those RolloutCore owns are refused (engine.args).
    vllm_args: Sequence[str] = ()

    def __post_init__(self) -> None:
        check_lora_options(self.lora, self.max_loras, self.max_lora_rank)
        object.__setattr__(self, "vllm_args", check_vllm_args(
            self.vllm_args, launched=not self.upstream))
        if self.lora and self.upstream:
            raise BadInput("lora launches the engine with LoRA enabled (--enable-lora and "
                           "runtime adapter loading); a running engine (upstream) keeps the "
                           "flags it was started with: give model instead")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            n = getattr(self, name)
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 64:
                raise BadInput(f"{name} must be an int in 1..64, got {n!r}")
            if n > 1 and self.upstream:
                raise BadInput(f"{name} is how a launched engine starts; a running "
                               "engine (upstream) keeps the ranks it was started with")
        wx = self.worker_extension_cls
        if wx is not None and (not isinstance(wx, str) or not wx.strip() or any(
                c.isspace() for c in wx)):
            raise BadInput(f"worker_extension_cls must be a dotted class name, got {wx!r}")
        if wx is not None and self.upstream:
            raise BadInput("worker_extension_cls is how a launched engine starts; a running "
                           "engine (upstream) keeps the extension it was started with")
        if self.update_mode not in ("strict", "keep", "recompute", "engine_recompute"):
            raise BadInput(f"update_mode must be strict, keep, recompute or engine_recompute, "
                           f"got {self.update_mode!r}")
        if self.max_staleness is not None and (
                isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int)
                or self.max_staleness < 0):
            raise BadInput(f"max_staleness must be an integer >= 0, got {self.max_staleness!r}")
        if self.max_staleness is not None and self.update_mode == "strict":
            raise BadInput("max_staleness bounds the asynchronous modes: give --update-mode "
                           "keep or recompute (a strict update leaves nothing stale)")
        if self.upstream and self.model:
            raise BadInput("give upstream (a running vLLM) or model (launch one), not both")
        for name in ("step", "port", "max_body_bytes", "queue"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise BadInput(f"{name} must be an integer >= 0, got {v!r}")
        if not 0 < self.port < 65536:
            raise BadInput(f"port must be in 1..65535, got {self.port}")
        if not isinstance(self.transport_backend, str) or not self.transport_backend:
            raise BadInput("transport_backend must be a non-empty string")
        if self.drain_policy not in ("abort", "refuse"):
            raise BadInput(f"drain_policy must be 'abort' or 'refuse', got {self.drain_policy!r}")
        if (isinstance(self.drain_timeout_s, bool)
                or not isinstance(self.drain_timeout_s, (int, float))
                or not 0 < self.drain_timeout_s < float("inf")):
            raise BadInput(f"drain_timeout_s must be a positive number of seconds, "
                           f"got {self.drain_timeout_s!r}")


#: The ranks vLLM 0.32 accepts for ``--max-lora-rank``.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def check_lora_options(lora: object, max_loras: object, max_lora_rank: object) -> None:
    """``serve --lora`` and its limits, checked before anything starts (``BadInput``)."""
    if not isinstance(lora, bool):
        raise BadInput(f"lora must be a bool, got {lora!r}")
    if not lora and (max_loras is not None or max_lora_rank is not None):
        raise BadInput("max_loras and max_lora_rank size the LoRA slots of an engine "
                       "launched with lora (serve --lora); without it they are refused")
    if max_loras is not None and (isinstance(max_loras, bool) or not isinstance(
            max_loras, int) or not 1 <= max_loras <= 64):
        raise BadInput(f"max_loras must be an int in 1..64, got {max_loras!r}")
    if max_lora_rank is not None and (isinstance(max_lora_rank, bool) or not isinstance(
            max_lora_rank, int) or max_lora_rank not in LORA_RANKS):
        raise BadInput(f"max_lora_rank must be one of {list(LORA_RANKS)} (vLLM's), got "
                       f"{max_lora_rank!r}")


def lora_engine_args(max_loras: int | None, max_lora_rank: int | None
                     ) -> tuple[tuple[str, ...], dict[str, str], AdapterConfig]:
    """vLLM's arguments and environment for a LoRA engine, and the adapter budget.

    ``--max-loras`` bounds the adapters of one batch; the adapters loaded at once
    (``AdapterConfig.max_loaded``: the published one, one superseded one kept for
    requests still on it, and the next one being verified) are vLLM's
    ``--max-cpu-loras``, at least ``--max-loras``.
    """
    from rolloutcore.core.adapters import AdapterConfig

    check_lora_options(True, max_loras, max_lora_rank)
    n = 2 if max_loras is None else max_loras
    rank = 16 if max_lora_rank is None else max_lora_rank
    budget = AdapterConfig(max_loaded=max(n, 3), max_staleness=1)
    from rolloutcore.transports.adapter_store import MIDDLEWARE

    # The adapter store (uploads; it answers only the engine's route key) rides along:
    # what a trainer on another node loads from (transports.adapter_store).
    args = ("--enable-lora", "--max-loras", str(n), "--max-lora-rank", str(rank),
            "--max-cpu-loras", str(budget.max_loaded), "--middleware", MIDDLEWARE)
    return args, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}, budget


def control_token(token: str | None, token_file: str | None) -> tuple[str, bool]:
    """(token, given): given by flag, file or environment; else generated (a gateway over
    one engine and a fleet's alike)."""
    if token and token_file:
        raise BadInput("give --token or --token-file, not both")
    if token:
        return str(token), True
    if token_file:
        return read_token_file(token_file), True
    env = os.environ.get("ROLLOUTCORE_TOKEN")
    if env:
        return env.strip(), True
    return generate_token(), False


def reachable_verification(capabilities: frozenset[str] | set[str]) -> VerificationLevel:
    """The highest verification an engine with these routes can reach.

    ``probe`` needs only the scoring route (``/inference/v1/generate`` with
    prompt logprobs): every engine RolloutCore drives on the CPU and vLLM
    0.26+ on a GPU has it. Below it: engine checksums (``/weight_checker``),
    a label (``/weight_info``), nothing.
    """
    from rolloutcore.core.versions import VerificationLevel

    if Routes.GENERATE in capabilities:
        return VerificationLevel.PROBE
    if Routes.WEIGHT_CHECKER in capabilities:
        return VerificationLevel.ENGINE_CHECKSUM
    if Routes.WEIGHT_INFO in capabilities:
        return VerificationLevel.MANIFEST
    return VerificationLevel.DECLARED


def vocab_size(model_dir: Path) -> int | None:
    """The served model's vocabulary (its config.json), for the probe's edge checks."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for d in (cfg, cfg.get("text_config") or {}):
        v = d.get("vocab_size") if isinstance(d, dict) else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 1:
            return v
    return None


def port_in_use(host: str, port: int) -> str | None:
    """Why the gateway could not listen on ``host:port``; ``None`` when it can.

    Bound the way uvicorn binds (``SO_REUSEADDR``: a port in TIME_WAIT is free,
    one with a listener is not), and let go at once: checked before any engine
    starts, so a taken port costs nothing.
    """
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return f"{exc.strerror or exc}"
    return None


def refuse_taken_port(host: str, port: int) -> int | None:
    """``PORT_IN_USE`` (after saying why on stderr) when ``host:port`` is taken."""
    why = port_in_use(host, port)
    if why is None:
        return None
    print(f"rolloutcore serve: error: port {port} on {host} is not free ({why}): nothing "
          f"started; give another with --port, or stop what listens there (exit status "
          f"{PORT_IN_USE}; docs/troubleshooting.md)", file=sys.stderr)
    return PORT_IN_USE


def exit_on_signal(signum: int, frame: object) -> None:
    """SIGTERM as ``SystemExit``: uvicorn re-raises the signal after its shutdown, and the
    default disposition would kill the process before its engines are stopped."""
    raise SystemExit(128 + signum)


def _check_engine(http: VllmHTTP) -> SupportVerdict:
    """The engine's own version and routes, judged before anything is admitted."""

    def answer(call: Callable[[], object]) -> object:
        try:
            return call()
        except EffectError as exc:
            return {"error": str(exc)}

    return assess(answer(lambda: http.version(timeout_s=30.0)),
                  answer(lambda: http.capabilities(timeout_s=30.0)))


def _check_own_vllm(http: VllmHTTP, backend: str) -> None:
    from rolloutcore.engine.http import Routes
    from rolloutcore.service.own_vllm import check_upstream

    caps = http.capabilities()
    info = http.server_info() if Routes.SERVER_INFO in caps else None
    for warning in check_upstream(info, caps, backend):
        print(f"[rolloutcore] warning: {warning}", file=sys.stderr)


def native_routes_token(token_out: str | None, host: str, port: int) -> str:
    """``--native-routes``: the secret path segment of vLLM's RL routes (a client that
    sets only a base URL keeps it), from ``ROLLOUTCORE_NATIVE_TOKEN`` or generated and
    written to ``<token_out>.native``."""
    given = os.environ.get("ROLLOUTCORE_NATIVE_TOKEN")
    token = given or generate_token()
    if token_out and not given:
        write_token_file(token_out + ".native", token)
    where = ("ROLLOUTCORE_NATIVE_TOKEN" if given else f"{token_out}.native" if token_out
             else "not shown: set ROLLOUTCORE_NATIVE_TOKEN or --token-out")
    print(f"[rolloutcore] vLLM's RL routes: base URL http://{host}:{port}/rc/<token> "
          f"(token: {where})", file=sys.stderr)
    return token


def upstream_route_key(url: str) -> bool:
    """``--upstream``: hold the route key of an engine started behind RolloutCore's guard.

    A vLLM its user started as ``ROLLOUTCORE_ENGINE_ROUTE_SECRET=<key> vllm serve ...
    --middleware rolloutcore.transports.engine_key.RouteGuard`` closes its dev and
    weight routes as an engine ``serve`` launches does. Given the same key in this
    process's environment (``engine_key.ENV``), the gateway holds it as a launcher
    does: its calls carry it, it lends a key to a trainer for one lease, and it pauses
    through the guard's ``FAST_PAUSE`` (vLLM's ``/pause`` without its fixed 20 ms
    sleep). Checked at once: the engine must take the key as its own (taking back a
    lent key, which only the launcher's key may do), else ``BadInput`` and no key is
    held. False when the environment holds no key.
    """
    from rolloutcore.engine import lent_key

    raw = os.environ.get(engine_key.ENV)
    if raw is None:
        return False
    try:
        key = engine_key.check_key(raw.strip())
    except BadInput as exc:
        raise BadInput(f"{engine_key.ENV}: {exc}") from None
    import httpx

    from rolloutcore.engine.errors import map_errors, tls_context

    # A guard is there (it refuses the launcher's route to a call without the key) ...
    try:
        with map_errors("route key check", f"DELETE {engine_key.LENT_KEY}", timeout_s=10.0,
                        mutation_started=False):
            bare = httpx.delete(url + engine_key.LENT_KEY, timeout=10.0, verify=tls_context())
        why = None if bare.status_code == 403 else (
            f"it answered {bare.status_code} without the key, not the guard's 403")
    except EffectError as exc:
        why = str(exc)
    # ... and it takes this key as its launcher's.
    engine_key.register(url, key)
    if why is None:
        try:
            lent_key.revoke(url)
        except EffectError as exc:
            why = str(exc)
    if why is not None:
        engine_key.forget(url, key)
        raise BadInput(f"{engine_key.ENV} is set, but the engine at {url} does not take it as "
                       f"its route key ({why}): start vLLM with --middleware "
                       f"{engine_key.MIDDLEWARE} and the same key in its environment, or "
                       f"unset {engine_key.ENV}")
    return True


def run_serve(args: ServeOptions) -> int:
    """The ``serve`` command; blocks until interrupted. Returns an exit status."""
    if not isinstance(args, ServeOptions):
        raise BadInput(f"run_serve takes ServeOptions, got {type(args).__name__}")
    token, given = control_token(args.token, args.token_file)
    data_token = args.data_token or os.environ.get("ROLLOUTCORE_DATA_TOKEN") or None
    check_bind(args.host, given, data_token is not None)
    if args.upstream and not args.checkpoint:
        raise BadInput("--upstream needs --checkpoint: the weights the engine was started "
                       "from become the first committed version")
    if args.max_body_bytes <= 0:
        raise BadInput("--max-body-bytes must be positive")
    from rolloutcore.core.versions import VerificationLevel

    floor_asked = (None if args.min_verification is None
                   else VerificationLevel.parse(args.min_verification))
    if args.takeover_probe is not None and not Path(args.takeover_probe).is_file():
        raise BadInput(f"--takeover-probe {args.takeover_probe}: no such file")
    if args.takeover_checksums is not None and args.upstream is None:
        raise BadInput("--takeover-checksums is content evidence for taking over a running "
                       "engine (--upstream); an engine serve launches is loaded fresh")
    takeover_ref = _takeover_checksums(args.takeover_checksums)
    taken = refuse_taken_port(args.host, args.port)   # before any engine starts
    if taken is not None:
        return taken
    # Settings are checked before anything is launched.
    probe = ServiceConfig(upstream_url=args.upstream or "http://127.0.0.1:1",
                          engine_url=args.engine_url, control_token=token,
                          data_token=data_token, max_body_bytes=args.max_body_bytes,
                          queue_max=args.queue, queue_wait_s=args.queue_wait_s,
                          lease_s=min(args.lease_s, 1800.0),
                          health_interval_s=args.health_interval_s,
                          client_body_s=args.client_body_s, client_send_s=args.client_send_s,
                          update_mode=args.update_mode)

    from rolloutcore.control.controller import LifecycleController
    from rolloutcore.control.journal import Journal, open_controller
    from rolloutcore.control.runner import Deadlines, DrainPolicy, TakeoverRefused
    from rolloutcore.control.stack import wire
    from rolloutcore.core.lifecycle import State, UpdateMode
    from rolloutcore.core.lifecycle_state import ControllerConfig
    from rolloutcore.core.versions import Provenance, WeightIdentity
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.service.app import create_app
    from rolloutcore.transports.source import WeightSource

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rolloutcore-serve-"))
    engine: Any = None
    # Without --journal nothing would read the records: no journal then. With one,
    # the file has every record and memory only the last few (two records per
    # data-plane request would otherwise grow without bound).
    # The previous gateway's journal is read before any engine starts (a damaged one is
    # refused first): what it published, what it had in flight.
    controller: LifecycleController
    journal: Journal | None = None
    ccfg = ControllerConfig(update_mode=UpdateMode(args.update_mode),
                            max_staleness=args.max_staleness)
    if args.journal:
        controller, journal = open_controller(args.journal, keep=256, config=ccfg)
        if journal.repaired_bytes:
            print(f"[rolloutcore] journal {args.journal}: cut a torn last line "
                  f"({journal.repaired_bytes} bytes; a crash in the middle of a write)",
                  file=sys.stderr)
        if controller.state is not State.UNINITIALIZED or controller.published:
            print(f"[rolloutcore] restored the journal: {controller.state.value}, "
                  f"committed {controller.committed}", file=sys.stderr)
    else:
        controller = LifecycleController(config=ccfg)
    adapter: VllmAdapter | None = None
    recorder: GatewayRecorder | None = None
    adapters: AdapterManager | None = None
    lora_budget: AdapterConfig | None = None
    try:
        if args.upstream and args.checkpoint:  # (upstream without checkpoint: refused above)
            url, model_dir, epoch, served = args.upstream.rstrip("/"), Path(args.checkpoint), \
                None, None
            if upstream_route_key(url):
                print(f"[rolloutcore] the engine at {url} takes this gateway's route key "
                      "(the guard's): its dev and weight routes answer only this gateway "
                      "and the trainer it grants an update", file=sys.stderr)
            else:
                print(f"[rolloutcore] the engine at {url} was not launched by RolloutCore: "
                      "its dev and weight routes answer every process that reaches it. An "
                      "out-of-band write is detected (health ticks every "
                      f"{probe.health_interval_s:g} s, instance id, label), not refused; "
                      "launch the engine with `rolloutcore serve` (no --upstream), or behind "
                      f"the guard with the key in {engine_key.ENV}, to close them",
                      file=sys.stderr)
        else:
            from rolloutcore.engine.process import ManagedEngine

            if args.model:
                model_dir = Path(args.model)
            else:
                from rolloutcore.testing.models import make_checkpoint

                model_dir = make_checkpoint(workdir / "policy-0", seed=0)
                print(f"[rolloutcore] generated a tiny checkpoint at {model_dir}",
                      file=sys.stderr)
            # Its dev and weight routes answer only this gateway (and the trainer it
            # grants an update): transports.engine_key.
            extra: tuple[str, ...] = () if args.worker_extension_cls is None else (
                "--worker-extension-cls", args.worker_extension_cls)
            lora_env: dict[str, str] = {}
            if args.lora:
                lora_args, lora_env, lora_budget = lora_engine_args(args.max_loras,
                                                                    args.max_lora_rank)
                extra += lora_args
            extra += tuple(args.vllm_args)   # the user's engine options, last
            engine = ManagedEngine(model_dir, backend=args.transport_backend,
                                   log_dir=workdir / "logs", progress=True, guard_routes=True,
                                   tensor_parallel_size=args.tensor_parallel_size,
                                   pipeline_parallel_size=args.pipeline_parallel_size,
                                   extra_args=extra, env=lora_env or None)
            engine.start()
            url, epoch, served = engine.base_url, engine.epoch, engine.model_name
        source = WeightSource.from_checkpoint(model_dir)
        identity = WeightIdentity.declare(source.manifest(), Provenance(
            str(model_dir.resolve()), "", args.step), source.content_digest())
        if takeover_ref is not None and takeover_ref.content_digest != identity.content_digest:
            raise BadInput(f"--takeover-checksums {args.takeover_checksums} are of content "
                           f"{takeover_ref.content_digest[:16]}, not of {model_dir} "
                           f"({str(identity.content_digest)[:16]})")
        # The pause call's own timeout is the pause step's deadline, not the
        # drain deadline (how long bound rollouts may take): after a drain-policy
        # abort the pause may take a while on a busy engine.
        adapter = VllmAdapter(VllmHTTP(url), None, engine_epoch=epoch,
                              drain_timeout_s=Deadlines().pause_s)
        support = engine.support if engine is not None else None
        support = (support or _check_engine(adapter.http)).require("serve")
        print(f"[rolloutcore] {support.describe()}", file=sys.stderr)
        if engine is None:   # a vLLM the user started: what it lacks, named (own_vllm)
            _check_own_vllm(adapter.http, args.transport_backend)
        # the one composition; a launched process's exit taints at once (#47)
        runner = wire(adapter, controller=controller, journal=journal,
                      deadlines=Deadlines(drain_s=args.drain_timeout_s),
                      drain_policy=DrainPolicy(args.drain_policy), engine=engine).runner
        reachable = reachable_verification(adapter.http.capabilities())
        floor = reachable if floor_asked is None else floor_asked
        if floor > reachable:
            raise BadInput(f"--min-verification {floor.wire} cannot be reached on this engine "
                           f"(at most {reachable.wire})")
        takeover_probe = _takeover_probe(args, model_dir, reachable)
        try:
            runner.take_over(identity, probes=takeover_probe, min_verification=floor,
                             reference_checksums=(None if takeover_ref is None
                                                  else takeover_ref.checksums),
                             recoverer=_recoverer(url, model_dir, identity, takeover_probe))
        except TakeoverRefused as exc:
            print(f"[rolloutcore] refusing to serve: the engine at {url} could not be "
                  f"verified to hold {model_dir} ({exc.classification}, now {exc.state}): "
                  f"{exc.reason}", file=sys.stderr)
            return TAKEOVER_REFUSED
        ident = controller.identity
        print(f"[rolloutcore] took over {controller.committed} verified "
              f"{ident.verification.wire if ident else '?'}: "
              f"{', '.join(ident.evidence) if ident else ''}", file=sys.stderr)
        max_len = None
        try:
            mc = (adapter.http.server_info().get("vllm_config") or {}).get("model_config")
            max_len = mc.get("max_model_len") if isinstance(mc, dict) else None
        except EffectError:
            pass
        from rolloutcore.engine.sent import rank_reports_supported

        transport: dict[str, Any] = {"backend": args.transport_backend}
        if args.transport_backend == "rolloutcore_gloo" and rank_reports_supported(
                adapter.http):
            # The engine's workers answer their own reports of a round (a tensor-parallel
            # engine, gloo_report): the gateway compares them with the trainer's per-rank
            # declaration, and a gloo transfer's report must carry one.
            transport["rank_reports"] = True
            print("[rolloutcore] the engine's workers report what each rank wrote: "
                  "every rank's shards are checked by this gateway", file=sys.stderr)
        cfg = ServiceConfig(**{**probe.__dict__, "upstream_url": url, "model": served,
                               "transport": transport,
                               "min_verification": floor, "reachable_verification": reachable,
                               "vocab_size": vocab_size(model_dir),
                               "max_model_len": max_len if isinstance(max_len, int) else None})
        if args.record:
            from rolloutcore.core.versions import EngineIdentity
            from rolloutcore.service.recording import GatewayRecorder

            http = adapter.http
            caps = http.capabilities()
            econf: dict[str, Any] = {}
            if engine is not None:
                econf = {"dtype": engine.dtype, "max_model_len": engine.max_model_len,
                         "enable_prefix_caching": engine.prefix_caching}
            recorder = GatewayRecorder(args.record, EngineIdentity(
                http.version() if Routes.VERSION in caps else "unknown",
                served or http.model(), econf, url))
        if args.lora:
            adapters = _adapter_manager(args, adapter, controller, model_dir, workdir,
                                        lora_budget, journal)
            if journal is not None and args.journal:
                _restore_adapters(adapters, args.journal)
        native_token = (native_routes_token(args.token_out, args.host, args.port)
                        if args.native_routes else None)
        app = create_app(runner, cfg, on_finished=recorder, adapters=adapters,
                         native_token=native_token)
        from rolloutcore.service.server import run_until_signalled

        run_until_signalled(app, args.host, args.port, cfg, exit_on_signal, token=token,
                            token_given=given, token_out=args.token_out,
                            banner=f"gateway http://{args.host}:{args.port} -> vLLM {url} "
                                   f"(committed {controller.committed})")
        return 0
    finally:
        if recorder is not None:
            recorder.close()
        if adapters is not None:
            adapters.close()
        if adapter is not None:
            adapter.close()
        if engine is not None:
            engine.stop()
        if journal is not None:
            journal.close()


def _adapter_manager(args: ServeOptions, adapter: VllmAdapter, controller: Any, model_dir: Path,
                     workdir: Path, budget: AdapterConfig | None, journal: Any
                     ) -> AdapterManager:
    """``--lora``: the engine's adapter versions (``control.adapters``), journaled with the
    lifecycle's records; the adapters it publishes are written under the workdir."""
    from rolloutcore.control.adapters import AdapterManager

    assert budget is not None   # lora_engine_args made it, for the launched engine
    rank = 16 if args.max_lora_rank is None else args.max_lora_rank
    m = AdapterManager(adapter.http, controller, base_model=model_dir,
                       store=workdir / "adapters", config=budget,
                       listener=None if journal is None else journal.listener, max_rank=rank,
                       calibrations=lambda: dict(adapter.calibrations))
    print(f"[rolloutcore] LoRA adapters enabled (max rank {rank}, {budget.max_loaded} loaded "
          f"at most): POST /control/adapters publishes one; requests for model 'policy' "
          f"are served by the current one", file=sys.stderr)
    return m


def _restore_adapters(m: AdapterManager, journal_path: str) -> None:
    """A previous gateway's adapter records: its names are never reused, and the adapter
    it had published is published again (its files, verified on this engine's base,
    under a new name): the engine launched now holds none of its adapters, so nothing
    is claimed before it is loaded and verified. If that fails, ``policy`` is the
    base's until the trainer publishes an adapter, and the log says why."""
    import ast

    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.adapters import AdapterChange
    from rolloutcore.core.records import Commit
    from rolloutcore.core.versions import Provenance

    recs = read_journal(journal_path, live=True)
    changes = [r.record for r in recs if isinstance(r.record, AdapterChange)]
    was = m.restore(changes)
    if not changes:
        return
    print(f"[rolloutcore] restored {len({c.name for c in changes})} adapter names from the "
          f"journal (never reused); published then: {None if was is None else was.name}",
          file=sys.stderr)
    if was is None:
        return
    prov = Provenance(was.path, "restored", 0)
    for c in reversed(changes):
        if c.name == was.name and str(c.after) == "published":
            for e in c.evidence:
                if e.startswith("provenance: "):
                    try:
                        d = ast.literal_eval(e[len("provenance: "):])
                        prov = Provenance(str(d["checkpoint"]), str(d.get("trainer_run", "")),
                                          int(d.get("step", 0)))
                    except (ValueError, SyntaxError, KeyError, TypeError):
                        pass
            break
    # The base it was verified on: the identity the journal committed under its label
    # (a restart on another checkpoint must not serve it on that one).
    verified_on = next((r.record.identity for r in reversed(recs)
                        if isinstance(r.record, Commit) and r.record.version.label == was.base),
                       None)
    try:
        res = m.republish(was, prov, verified_on=verified_on)
    except RolloutCoreError as exc:
        print(f"[rolloutcore] the journal's adapter {was.name} was not published again: "
              f"{exc}; requests for 'policy' are the base's until an adapter is published",
              file=sys.stderr)
        return
    print(f"[rolloutcore] the journal's adapter {was.name} published again, verified, as "
          f"{res.version.name}", file=sys.stderr)


def _takeover_checksums(path: str | None) -> ReferenceChecksums | None:
    """``--takeover-checksums``: the checkpoint's reference checksums, read and checked
    before anything starts (a bad file is refused with the reason, nothing launched)."""
    if path is None:
        return None
    from rolloutcore.verification.checksums import ReferenceChecksums

    raw = _json_file("--takeover-checksums", path)
    try:
        return ReferenceChecksums.from_dict(raw)
    except BadInput as exc:
        raise BadInput(f"--takeover-checksums {path}: {exc}") from exc


def _json_file(flag: str, path: str) -> Any:
    """The JSON of the file an option names; ``BadInput`` naming the option if unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{flag} {path}: {exc}") from exc


def _takeover_probe(args: ServeOptions, model_dir: Path, reachable: VerificationLevel
                    ) -> Any:
    """The policy probe the takeover runs: saved (``--takeover-probe``) or computed from
    the declared checkpoint (a forward pass of it on this host's CPU)."""
    from rolloutcore.core.versions import VerificationLevel
    from rolloutcore.verification.probe import PolicyProbe

    if args.takeover_probe is not None:
        return PolicyProbe.from_wire(_json_file("--takeover-probe", args.takeover_probe),
                                     vocab_size=vocab_size(model_dir))
    if reachable < VerificationLevel.PROBE:
        return None
    return _LazyProbe(model_dir)


class _LazyProbe:
    """The checkpoint's probe, computed on first use: a takeover that is refused for a
    cheaper reason (a paused engine) does not pay a forward pass of the checkpoint."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._probe: Any = None

    def get(self) -> Any:
        if self._probe is None:
            from rolloutcore.verification.image_probe import is_vision_language, vlm_probe
            from rolloutcore.verification.probe import PolicyProbe

            print(f"[rolloutcore] computing the policy probe of {self.model_dir} for the "
                  "takeover", file=sys.stderr)
            if is_vision_language(self.model_dir):
                # A vision-language checkpoint: its text and image probes (the vision
                # tower is part of the policy the takeover declares).
                self._probe = vlm_probe(self.model_dir)
            else:
                self._probe = PolicyProbe.from_checkpoint(str(self.model_dir))
        return self._probe

    takes_calibration = True  # the takeover calibrates on it (verification.probe)

    def run(self, http: Any, target: Any, **calibration: Any) -> Any:
        from rolloutcore.verification.probe import takes_calibration

        p = self.get()
        return p.run(http, target, **calibration) if takes_calibration(p) else \
            p.run(http, target)


def _recoverer(url: str, model_dir: Path, identity: WeightIdentity, probe: Any) -> Any:
    """For a journal left TAINTED: accept a replacement engine, fresh from the checkpoint."""
    from rolloutcore.engine.recovery import OperatorRecoverer

    def make(previous_epoch: str) -> Any:
        p = probe.get() if isinstance(probe, _LazyProbe) else probe
        return OperatorRecoverer(url, model_dir, signal=lambda: True, wait_s=5.0,
                                 previous_epoch=previous_epoch, identity=identity,
                                 probe=p if p is not None else False)

    return make


if __name__ == "__main__":  # pragma: no cover - the old entry point, kept as a pointer
    # The options are parsed in rolloutcore.cli (a higher layer than this one),
    # so this module no longer runs the command; it says where it went.
    sys.exit("python -m rolloutcore.service.serve is now `rolloutcore serve` "
             "(or `python -m rolloutcore serve`), same options")
