"""The engine we talk to is the engine we launched, and it never outlives us (#47, 1 and 4).

``ManagedEngine`` launches a stand-in for vLLM here (``tests/data/fakevllm``,
first on the launched process's ``PYTHONPATH``): a real process in its own
session that binds its port after ``FAKEVLLM_IMPORT_S`` (vLLM's seconds of
imports) and answers the launch's checks. The squatter is another real
process bound to the port first, answering 200 to everything; the launcher
is a real process killed -9. (``tests/engine/test_launch_guard_engine.py``:
the same squatter against a real vLLM.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.fault_matrix import PromiseRows
from helpers.squatter import SQUATTER
from rolloutcore.engine import process
from rolloutcore.engine.launch_guard import listener_problem
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.errors import EngineUnavailable
from rolloutcore.transports import engine_key

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "data" / "fakevllm"
MATRIX = PromiseRows("tests/test_launch_guard.py",
                     engines="a stand-in vLLM process (tests/data/fakevllm) launched by the "
                             "real ManagedEngine; a real squatter process",
                     engine="stand-in process")
_fault_matrix = MATRIX.fixture()


@pytest.fixture(autouse=True)
def _quick_health_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in engines bind their port within a tenth of a second: read ``/health``
    every 50 ms while they start, not every 0.5 s as for vLLM."""
    monkeypatch.setattr(ManagedEngine, "health_poll_s", 0.05)



def _env(import_s: float = 0.0) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(FAKE), str(ROOT / "src")]),
            "FAKEVLLM_IMPORT_S": str(import_s)}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def squatter() -> Iterator[tuple[int, subprocess.Popen[str]]]:
    port = _free_port()
    p = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port)], stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "listening"
        yield port, p
    finally:
        p.kill()
        p.wait(timeout=10)


def _requests_seen(p: subprocess.Popen[str]) -> list[str]:
    p.kill()
    out, _ = p.communicate(timeout=10)
    return [line for line in out.splitlines() if line]


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    """Whether group ``pid`` has no live process within ``timeout_s``: a killed process
    whose parent died waits as a zombie until init reaps it (1-1.5 s on the fast lane's
    host), dead all the same (``_group_alive``, as the launcher's own stop reads it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not process._group_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_a_squatter_on_the_port_fails_the_start_and_is_sent_nothing_but_health(
        model_dir: Path, tmp_path: Path, squatter: tuple[int, subprocess.Popen[str]]) -> None:
    port, sq = squatter
    eng = ManagedEngine(model_dir, port=port, env=_env(import_s=2.0), log_dir=tmp_path / "logs",
                        guard_routes=True, startup_timeout_s=30, backend=None)
    with pytest.raises(EngineUnavailable, match="not the engine that was launched"):
        eng.start()
    assert not eng.alive() and eng.squatters and f"port {port}" in eng.squatters[0]
    seen = _requests_seen(sq)
    # Only /health reached it, and never with the launch's key.
    assert seen and {line.split()[0] for line in seen} == {"/health"}, seen
    assert all(line.split()[1] == "None" for line in seen), seen
    MATRIX.row("port_squat",
               "another process binds the launched engine's port during its imports and "
               "answers 200 to everything",
               "start refused (every listener on the port must be the launched session's); "
               "the squatter got /health only, without the route key; a chosen port is "
               "replaced by another", "not started (nothing served)",
               published_unvalidated=0, records_lost=0, part="stand-in")


def test_a_squatter_on_a_chosen_port_moves_the_start_to_another(
        model_dir: Path, tmp_path: Path, squatter: tuple[int, subprocess.Popen[str]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    port, sq = squatter
    ports = iter([port])
    monkeypatch.setattr(process, "free_port",
                        lambda host="127.0.0.1": next(ports, None) or _free_port())
    eng = ManagedEngine(model_dir, env=_env(import_s=1.0), log_dir=tmp_path / "logs",
                        startup_timeout_s=30, backend=None)
    try:
        eng.start()
        assert eng.port != port and len(eng.squatters) == 1
        assert listener_problem(eng.port, eng.pid) is None
    finally:
        eng.stop()
    assert {line.split()[0] for line in _requests_seen(sq)} == {"/health"}


def test_an_engine_that_exits_is_noticed_at_once_and_its_key_forgotten(
        model_dir: Path, tmp_path: Path) -> None:
    eng = ManagedEngine(model_dir, env=_env(), log_dir=tmp_path / "logs", guard_routes=True,
                        startup_timeout_s=30, backend=None)
    told: list[str] = []
    seen = threading.Event()
    eng.on_exit.append(lambda reason: (told.append(reason), seen.set()))
    eng.start()
    try:
        assert engine_key.headers_for(eng.base_url)  # the launch's key is in use
        pid = eng.pid
        os.killpg(pid, signal.SIGKILL)
        assert seen.wait(5), "the exit was not noticed"
        assert f"pid {pid}" in told[0] and "without being stopped" in told[0]
        assert engine_key.headers_for(eng.base_url) == {}  # whoever binds it next: no key
    finally:
        eng.stop()
    assert len(told) == 1


def test_a_stop_is_not_an_exit(model_dir: Path, tmp_path: Path) -> None:
    eng = ManagedEngine(model_dir, env=_env(), log_dir=tmp_path / "logs", startup_timeout_s=30,
                        backend=None)
    told: list[str] = []
    eng.on_exit.append(told.append)
    eng.start()
    pid = eng.pid
    eng.stop()
    assert _gone(pid)
    time.sleep(0.3)
    assert told == []


LAUNCHER = textwrap.dedent("""
    import sys, time
    from rolloutcore.engine.process import ManagedEngine
    ManagedEngine.health_poll_s = 0.05
    eng = ManagedEngine(sys.argv[1], log_dir=sys.argv[2], startup_timeout_s=30, backend=None,
                        env={"PYTHONPATH": sys.argv[3], "FAKEVLLM_IMPORT_S": "0"})
    eng.start()
    print(eng.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_engine_never_outlives_the_process_that_launched_it(
        model_dir: Path, tmp_path: Path, sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    p = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(model_dir), str(tmp_path / "logs"),
                          _env()["PYTHONPATH"]], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        engine_pid = int(p.stdout.readline())
        os.killpg(engine_pid, 0)  # running, in its own group
        p.send_signal(sig)
        p.wait(timeout=30)
        assert _gone(engine_pid), f"the engine (pid {engine_pid}) outlived its launcher ({sig!r})"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
        if p.stdout is not None:
            p.stdout.close()
    MATRIX.row("orphaned_engine", f"the process that launched the engine is killed ({sig.name})",
               "the engine's process group is killed by its tether within seconds",
               "no engine left", published_unvalidated=0, records_lost=0, part=sig.name)


def test_a_fleet_replicas_launched_engine_exit_taints_its_controller() -> None:
    """Fleet placement wires the launched engine's ``on_exit`` to its replica's runner."""
    from rolloutcore.core.evidence import BootstrapEvidence
    from rolloutcore.core.lifecycle import State
    from rolloutcore.fleet.placement import vllm_replica
    from rolloutcore.testing.fake import FakeWeights

    class Launched:  # what vllm_replica reads of a ManagedEngine
        epoch = "e1"
        on_exit: list = []  # noqa: RUF012

    eng = Launched()
    rep = vllm_replica("e0", "http://127.0.0.1:9", engine=eng)
    try:
        c = rep.runner.controller
        c.bootstrap(BootstrapEvidence(engine_epoch="e1", healthy=True),
                    FakeWeights.from_seed(0).identity())
        assert len(eng.on_exit) == 1 and c.state is State.READY
        eng.on_exit[0]("the launched vLLM (pid 1) exited (status -9)")
        assert c.state is State.TAINTED
    finally:
        if rep.close is not None:
            rep.close()
