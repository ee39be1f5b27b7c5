"""Real-engine test support: the tiny model set and the engine factory.

Used by tests/engine/conftest.py (which turns them into session fixtures)
and imported by tests for type annotations.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from rolloutcore.engine.process import ManagedEngine, free_port

__all__ = ["MAX_ALIVE", "ROOT", "EngineFactory", "Greedy", "NativeGateway", "ServeEngines",
           "TinyModels", "gateway_process", "kill_engine", "merge_rows", "spawn_serve"]

ROOT = Path(__file__).resolve().parents[1]

MAX_ALIVE = 2

#: Greedy token ids and their logprobs, per prompt (``fleettools_engine.greedy``).
Greedy = list[tuple[list[int], list[float]]]
#: The launch fixtures of tests/engine/conftest.py (``native_gateway``, ``serve_engines``).
NativeGateway = Callable[..., contextlib.AbstractContextManager[str]]
ServeEngines = Callable[..., contextlib.AbstractContextManager[
    tuple[str, subprocess.Popen[bytes]]]]


@dataclass(frozen=True)
class TinyModels:
    root: Path
    A: Path
    B: Path
    B_neg: Path


class EngineFactory:
    """Starts engines for tests; owns them until ``stop`` or session end."""

    def __init__(self, log_dir: Path, max_alive: int = MAX_ALIVE) -> None:
        self.log_dir = log_dir
        self.max_alive = max_alive
        self._all: list[ManagedEngine] = []
        self._shared: dict[str, ManagedEngine] = {}

    def alive(self) -> list[ManagedEngine]:
        return [e for e in self._all if e.alive()]

    def __call__(self, model_dir: Path, **kwargs: Any) -> ManagedEngine:
        """A new, started engine (``kwargs`` go to ``ManagedEngine``)."""
        if len(self.alive()) >= self.max_alive:
            raise RuntimeError(
                f"{len(self.alive())} test engines already alive (max {self.max_alive}): "
                f"{self.alive()}; stop one with engine_factory.stop(engine) first")
        kwargs.setdefault("log_dir", self.log_dir)
        # Other suites' servers share the 2 cores: cold starts of 160 s were seen.
        kwargs.setdefault("startup_timeout_s", 600.0)
        eng = ManagedEngine(model_dir, **kwargs)
        self._all.append(eng)
        eng.start()
        return eng

    def together(self, *starts: tuple[Path, Mapping[str, Any]]) -> list[ManagedEngine]:
        """Started engines, one per ``(model_dir, kwargs)``, in that order, all started at
        once (a thread each).

        A start spends most of its time importing and compiling in one process after
        another, on one core: two started at once take about as long as one on the
        2-core machine. If any start fails, the others are stopped and the first
        failure is raised.
        """
        if len(self.alive()) + len(starts) > self.max_alive:
            raise RuntimeError(
                f"{len(self.alive())} test engines alive and {len(starts)} asked for "
                f"(max {self.max_alive}): {self.alive()}")
        engines: list[ManagedEngine] = []
        for model_dir, kwargs in starts:
            kw = {"log_dir": self.log_dir, "startup_timeout_s": 600.0, **kwargs}
            engines.append(ManagedEngine(model_dir, **kw))
        self._all.extend(engines)
        errors: list[BaseException] = []

        def start(eng: ManagedEngine) -> None:
            try:
                eng.start()
            except BaseException as exc:  # raised below, in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(e,), name=f"start-{i}")
                   for i, e in enumerate(engines)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if errors:
            for eng in engines:
                eng.stop()
            raise errors[0]
        return engines

    def shared(self, key: str, model_dir: Path, **kwargs: Any) -> ManagedEngine:
        """The session's engine for ``key``, started on first use (restarted if it died).

        Tests that use a shared engine must leave it serving (resumed) and
        must not assume its weights: they are whatever the last test installed.
        """
        eng = self._shared.get(key)
        if eng is not None and eng.alive():
            return eng
        if eng is not None:
            eng.stop()
        eng = self(model_dir, **kwargs)
        self._shared[key] = eng
        return eng

    def stop(self, eng: ManagedEngine) -> None:
        eng.stop()
        for k, v in list(self._shared.items()):
            if v is eng:
                del self._shared[k]

    def stop_all(self) -> None:
        errors: list[BaseException] = []
        for eng in self._all:
            try:
                eng.stop()
            except BaseException as exc:  # keep stopping the others
                errors.append(exc)
        self._shared.clear()
        if errors:
            raise errors[0]


def spawn_serve(args: Sequence[str], log: Path, env: Mapping[str, str] | None = None
                ) -> tuple[str, subprocess.Popen[bytes]]:
    """``python -m rolloutcore serve --port <free> *args`` in its own process group, its
    output in ``log``, ``env`` added to this process's environment: (its URL, the
    process), at once (not yet answering)."""
    port = free_port()
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--port", str(port), *args]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                     **(env or {})})
    return f"http://127.0.0.1:{port}", proc


@contextlib.contextmanager
def gateway_process(upstream: str, checkpoint: Path, token_file: Path, log: Path,
                    extra: Sequence[str] = (), env: Mapping[str, str] | None = None
                    ) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m rolloutcore serve --upstream ...`` in its own process group (``env``
    added to this process's environment).

    Yields (its URL, the process) once ``/health`` answers; stops the group on exit.
    """
    url, proc = spawn_serve(["--upstream", upstream, "--checkpoint", str(checkpoint),
                             "--token-file", str(token_file), *extra], log, env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield url, proc
    finally:
        stop_group(proc, 30)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM a subprocess's process group, SIGKILL it after ``grace_s``; waited for."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def kill_engine(engine: ManagedEngine) -> float:
    """SIGKILL the engine's whole process group; return when its API server is gone."""
    t = time.monotonic()
    engine.signal_group(signal.SIGKILL)
    deadline = t + 10
    while engine.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine.alive()
    return t


def merge_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write fault-matrix ``rows`` into the JSON list at ``path``, replacing the rows of the
    same ``case`` and keeping the others (several engine modules write one matrix)."""
    old: list[dict[str, Any]] = []
    if path.exists():
        with contextlib.suppress(ValueError):
            loaded = json.loads(path.read_text())
            old = loaded if isinstance(loaded, list) else []
    names = {r["case"] for r in rows}
    merged = [r for r in old if r.get("case") not in names] + rows
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=2, default=str) + "\n")


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path,
                 timeout_s: float = 600) -> None:
    """Until ``url``/health answers 200; fails with the log's tail if ``proc`` exits or time
    runs out (a ``rolloutcore serve`` or ``vllm`` started by a test)."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.1)
