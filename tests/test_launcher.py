"""ManagedEngine's own logic, with stand-in executables instead of vLLM.

The real server is exercised in tests/engine/; here the launcher's process
handling is checked with small shell scripts in the place of the Python
interpreter: a server that dies while starting, one that never gets healthy
(with a grandchild in its process group), and an interpreter without vLLM.
"""

from __future__ import annotations

import json
import stat
import sys
import time
from pathlib import Path

import pytest

from rolloutcore.engine.process import (
    DEFAULT_ENV,
    ManagedEngine,
    _group_alive,
    free_port,
    vllm_available,
)
from rolloutcore.engine.support import REQUIRED_ROUTES
from rolloutcore.errors import BadInput, EffectTimeout, EngineUnavailable


@pytest.fixture(autouse=True)
def _quick_health_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The stand-in engines bind their port within a tenth of a second: read ``/health``
    every 50 ms while they start, not every 0.5 s as for vLLM."""
    monkeypatch.setattr(ManagedEngine, "health_poll_s", 0.05)


def _model(tmp_path: Path) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def _script(tmp_path: Path, body: str) -> str:
    """A fake interpreter: answers the vLLM import probe, otherwise runs ``body``."""
    p = tmp_path / "fakepython"
    p.write_text('#!/bin/sh\nif [ "$1" = "-c" ]; then exit 0; fi\n' + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IEXEC)
    return str(p)


def test_command_line_and_environment(tmp_path: Path) -> None:
    e = ManagedEngine(_model(tmp_path), port=18000, backend="rolloutcore_gloo",
                      extra_args=["--enforce-eager"], env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    cmd = e.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for flag in ("--enable-prefix-caching", "--enable-scale-out", "--enforce-eager"):
        assert flag in cmd
    assert cmd[cmd.index("--port") + 1] == "18000"
    # Not a tiny checkpoint: vLLM's own dtype and context length (#48; the tiny
    # defaults: tests/test_vllm_passthrough_unit.py).
    assert "--dtype" not in cmd and "--max-model-len" not in cmd
    wtc = json.loads(cmd[cmd.index("--weight-transfer-config") + 1])
    assert wtc == {"backend": "rolloutcore_gloo"}
    env = e.environment()
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert set(DEFAULT_ENV) <= set(env)
    assert e.base_url == "http://127.0.0.1:18000"
    assert "--weight-transfer-config" not in ManagedEngine(
        e.model_dir, port=1, backend=None).command()


def test_the_engine_logs_what_rolloutcore_reads_whatever_trl_did_to_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # ``import trl`` sets VLLM_LOGGING_LEVEL=ERROR process-wide (trl/_compat.py); CI's
    # shell sets no PYTHONUNBUFFERED: the engine's log (iteration details, errors) must
    # still be written, unbuffered, at INFO.
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)
    model = _model(tmp_path)
    env = ManagedEngine(model, port=18000).environment()
    assert env["VLLM_LOGGING_LEVEL"] == "INFO" and env["PYTHONUNBUFFERED"] == "1"
    quiet = ManagedEngine(model, port=18000, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    assert quiet.environment()["VLLM_LOGGING_LEVEL"] == "WARNING"  # the caller's word wins


@pytest.mark.parametrize("kwargs", [
    {"port": 0}, {"port": 70000}, {"backend": ""}, {"startup_timeout_s": 0},
    {"max_model_len": -1}, {"stop_grace_s": -1.0},
])
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object]) -> None:
    with pytest.raises(BadInput):
        ManagedEngine(_model(tmp_path), **kwargs)  # type: ignore[arg-type]


def test_not_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(BadInput, match=r"config\.json"):
        ManagedEngine(tmp_path)
    e = ManagedEngine(_model(tmp_path))
    with pytest.raises(BadInput):
        e.restart(tmp_path / "nope")
    with pytest.raises(BadInput):
        _ = e.pid


def test_missing_vllm_is_a_clear_error(tmp_path: Path) -> None:
    nopy = tmp_path / "nopython"
    nopy.write_text("#!/bin/sh\nexit 1\n")
    nopy.chmod(0o755)
    assert not vllm_available(str(nopy))
    e = ManagedEngine(_model(tmp_path), python=str(nopy))
    with pytest.raises(EngineUnavailable, match=r"rolloutcore\[gpu\].*rolloutcore\[cpu\]") as ei:
        e.start()
    assert ei.value.mutation_started is False
    assert not e.alive()


def test_death_while_starting_fails_fast_with_log_tail(tmp_path: Path) -> None:
    py = _script(tmp_path, 'echo "boom: Unsupported thing"; exit 3')
    e = ManagedEngine(_model(tmp_path), python=py, startup_timeout_s=60, log_dir=tmp_path)
    t0 = time.monotonic()
    with pytest.raises(EngineUnavailable, match="boom: Unsupported thing") as ei:
        e.start()
    assert time.monotonic() - t0 < 10
    assert "status 3" in str(ei.value)
    assert e.log_path.parent == tmp_path and "boom" in e.log_path.read_text()
    assert not e.alive()


def test_deadline_kills_the_whole_group(tmp_path: Path) -> None:
    marker = tmp_path / "grandchild.pid"
    # The server never answers /health and leaves a grandchild in its group.
    py = _script(tmp_path, f"sleep 300 & echo $! > {marker}; sleep 300")
    # The deadline only has to outlast the script's first line (a fork and an echo).
    e = ManagedEngine(_model(tmp_path), python=py, startup_timeout_s=0.8, stop_grace_s=2)
    with pytest.raises(EffectTimeout) as ei:
        e.start()
    assert ei.value.mutation_started is False
    gpid = int(marker.read_text())
    assert not _pid_alive(gpid)
    assert not e.alive()


def _standin_server(tmp_path: Path, version: str = "0.32.0",
                    routes: tuple[str, ...] = tuple(REQUIRED_ROUTES)) -> str:
    """A fake interpreter that serves /health, /version and /openapi.json.

    python's http.server answers 200 on any existing path, so it serves a
    directory holding files of those names, in vLLM's shapes.
    """
    www = tmp_path / "www"
    www.mkdir()
    (www / "health").write_text("ok")
    (www / "version").write_text(json.dumps({"version": version}))
    (www / "openapi.json").write_text(json.dumps({"paths": {r: {} for r in routes}}))
    body = f'exec {sys.executable} -m http.server --bind 127.0.0.1 "$PORT" -d {www}'
    return _script(tmp_path, 'PORT=$(echo "$@" | sed "s/.*--port \\([0-9]*\\).*/\\1/")\n'
                   + body)


def test_stop_and_restart_give_new_epoch_and_kill_group(tmp_path: Path) -> None:
    port = free_port()
    py = _standin_server(tmp_path)
    e = ManagedEngine(_model(tmp_path), python=py, port=port, startup_timeout_s=30)
    e.start()
    assert e.support is not None and e.support.supported
    try:
        first_pid, first_epoch = e.pid, e.epoch
        assert e.alive() and e.last_start_s is not None
        e.restart()
        assert e.pid != first_pid and e.epoch != first_epoch
        assert not _pid_alive(first_pid)
        assert e.base_url == f"http://127.0.0.1:{port}"
    finally:
        pid = e.pid
        e.stop()
    assert not e.alive() and not _group_alive(pid)
    e.stop()  # idempotent


def test_stops_from_several_threads_at_once_stop_it_once(tmp_path: Path) -> None:
    """A fleet's close, a recovery thread and a test's teardown may all stop one engine."""
    import threading

    e = ManagedEngine(_model(tmp_path), python=_standin_server(tmp_path), port=free_port(),
                      startup_timeout_s=30, stop_grace_s=1)
    e.start()
    pid = e.pid
    errors: list[BaseException] = []

    def stop() -> None:
        try:
            e.stop()
        except BaseException as exc:  # any error here is the defect
            errors.append(exc)

    threads = [threading.Thread(target=stop) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and not e.alive() and not _group_alive(pid)


@pytest.mark.parametrize("version,routes,match", [
    ("0.25.1", tuple(REQUIRED_ROUTES), "outside the supported range 0.26..0.34"),
    ("0.32.0", ("/health", "/version"), "VLLM_SERVER_DEV_MODE=1"),
])
def test_unsupported_engine_fails_start_and_is_stopped(
        tmp_path: Path, version: str, routes: tuple[str, ...], match: str) -> None:
    """A vLLM RolloutCore cannot drive fails at start, with the reason, and is killed."""
    py = _standin_server(tmp_path, version, routes)
    e = ManagedEngine(_model(tmp_path), python=py, startup_timeout_s=30, stop_grace_s=2)
    with pytest.raises(EngineUnavailable, match=match) as ei:
        e.start()
    assert ei.value.mutation_started is False
    assert not e.alive()


def _pid_alive(pid: int) -> bool:
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return st[st.rfind(")") + 2] != "Z"


def test_free_port_is_bindable() -> None:
    import socket

    p = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", p))


def test_vllms_ipc_backend_takes_pickled_handles_only_behind_the_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``ipc`` backend over HTTP sends its CUDA IPC handles pickled: the engine
    must allow it (``serve --model --transport-backend ipc``), only behind the route
    guard; an unguarded engine keeps what its caller gave, and the caller's word wins."""
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    model = _model(tmp_path)
    key = "VLLM_ALLOW_INSECURE_SERIALIZATION"
    guarded = ManagedEngine(model, port=18000, backend="ipc", guard_routes=True)
    assert guarded.environment()[key] == "1"
    assert json.loads(guarded.command()[guarded.command().index(
        "--weight-transfer-config") + 1]) == {"backend": "ipc"}
    assert key not in ManagedEngine(model, port=18000, backend="ipc").environment()
    for backend in ("rolloutcore_gloo", "nccl", "rc_cuda_ipc", None):
        assert key not in ManagedEngine(model, port=18000, backend=backend,
                                        guard_routes=True).environment()
    assert ManagedEngine(model, port=18000, backend="ipc", guard_routes=True,
                         env={key: "0"}).environment()[key] == "0"
