"""A new user's first hour, on the real CPU vLLM (#48).

* ``serve`` launches a real model with vLLM's own options: a passed-through
  option (``--vllm-arg=...`` and after ``--``) is on the launched vLLM's
  command line, the tiny default it replaces is not.
* Bring your own vLLM: the engine is started from ``docs/own-vllm.md``'s own
  CPU command line (parsed out of the doc, run by bash as written, only the
  ports changed), and the doc's ``serve --upstream`` line takes it over.

One vLLM at a time (about 2.9 GiB, 40-70 s to start on the CPU).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from enginetools import stop_group, wait_healthy
from rolloutcore.engine.process import free_port, vllm_available

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "first-hour-test-token-0123456789abcdef"


def _env() -> dict[str, str]:
    """This tree's code, and the venv's ``python`` and ``rolloutcore`` first on PATH."""
    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "ROLLOUTCORE_TOKEN": TOKEN,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}




def _start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as lf:
        return subprocess.Popen(cmd, cwd=cwd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True, env=_env())


def _ready(url: str) -> bool:
    """The gateway took the engine over, verified, and serves a committed version."""
    st = httpx.get(f"{url}/control/status", timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}"}).json()
    return bool(st["state"] == "READY" and st["committed"]["label"])


def test_a_passthrough_option_reaches_the_launched_vllm(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    proc = _start([sys.executable, "-m", "rolloutcore", "serve", "--workdir", str(tmp_path),
                   "--port", str(port), "--vllm-arg=--max-model-len=256", "--",
                   "--max-num-seqs", "8"], tmp_path, log)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log)
        engine_logs = sorted((tmp_path / "logs").glob("*.log"))
        assert engine_logs, "the engine's log is under --workdir"
        line = engine_logs[0].read_text().splitlines()[0]
        assert line.startswith("$ ") and "vllm.entrypoints.openai.api_server" in line
        argv = line[2:].split()
        # The user's options, as given, and the tiny default they replace gone.
        assert "--max-model-len=256" in argv and "--max-model-len" not in argv
        assert argv[argv.index("--max-num-seqs") + 1] == "8"
        assert argv[argv.index("--dtype") + 1] == "bfloat16"   # still the tiny default
        # The running vLLM has it: its own configuration says so.
        running = [p for p in Path("/proc").iterdir() if p.name.isdigit()]
        cmdlines = []
        for p in running:
            with contextlib.suppress(OSError):
                cmdlines.append((p / "cmdline").read_bytes().split(b"\0"))
        ours = [c for c in cmdlines if b"vllm.entrypoints.openai.api_server" in c
                and str(tmp_path / "policy-0").encode() in c]
        assert ours and b"--max-model-len=256" in ours[0]
        assert _ready(f"http://127.0.0.1:{port}")
    finally:
        stop_group(proc, 60)


def _doc_block(marker: str) -> str:
    text = (ROOT / "docs" / "own-vllm.md").read_text()
    m = re.search(rf"<!-- own-vllm:{marker} -->\n```bash\n(.*?)```", text, re.S)
    assert m, f"docs/own-vllm.md has no block marked own-vllm:{marker}"
    return m.group(1)


def test_the_own_vllm_recipe_runs_as_documented(tmp_path: Path) -> None:
    engine_block, serve_block = _doc_block("cpu"), _doc_block("serve")
    assert "8000" in engine_block and "8000" in serve_block and "8100" in serve_block
    engine_port, gateway_port = free_port(), free_port()
    engine_block = engine_block.replace("8000", str(engine_port))
    serve_block = serve_block.replace("8000", str(engine_port)).replace(
        "8100", str(gateway_port))
    elog, glog = tmp_path / "engine.log", tmp_path / "gateway.log"
    engine = _start(["bash", "-ec", engine_block], tmp_path, elog)
    gateway = None
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}", engine, elog)
        gateway = _start(["bash", "-ec", serve_block], tmp_path, glog)
        wait_healthy(f"http://127.0.0.1:{gateway_port}", gateway, glog)
        assert _ready(f"http://127.0.0.1:{gateway_port}")
        said = glog.read_text()
        assert "was not launched by RolloutCore" in said   # the route guard's absence
        assert "warning: no /inference/v1/generate" not in said   # the recipe has it all
        gw = f"http://127.0.0.1:{gateway_port}"
        model = httpx.get(f"{gw}/v1/models", timeout=30).json()["data"][0]["id"]
        done = httpx.post(f"{gw}/v1/completions", timeout=120,
                          json={"model": model, "prompt": "Hi", "max_tokens": 4,
                                "temperature": 0})
        assert done.status_code == 200, done.text
    finally:
        if gateway is not None:
            stop_group(gateway, 60)
        stop_group(engine, 60)


def test_serve_upstream_names_a_missing_weight_transfer_backend(tmp_path: Path) -> None:
    """The doc's engine line without its weight-transfer config: refused, named."""
    block = _doc_block("cpu")
    stripped = re.sub(r"\s*\\\n\s*--weight-transfer-config '[^']*'", "", block)
    assert "--weight-transfer-config" not in stripped and stripped != block
    engine_port = free_port()
    elog = tmp_path / "engine.log"
    engine = _start(["bash", "-ec", stripped.replace("8000", str(engine_port))], tmp_path,
                    elog)
    try:
        wait_healthy(f"http://127.0.0.1:{engine_port}", engine, elog)
        done = subprocess.run(
            [sys.executable, "-m", "rolloutcore", "serve", "--upstream",
             f"http://127.0.0.1:{engine_port}", "--checkpoint", "ckpt",
             "--port", str(free_port())], cwd=tmp_path, env=_env(), capture_output=True,
            text=True, timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        first = next(ln for ln in done.stderr.splitlines() if "error:" in ln)
        # vLLM 0.32 without the flag: no backend, or its own default one; named either way
        assert re.search(r"started (without a weight-transfer backend|with the "
                         r"weight-transfer backend '\w+')", first), done.stderr[-3000:]
        assert "--weight-transfer-config '{\"backend\": \"rolloutcore_gloo\"}'" in first
    finally:
        stop_group(engine, 60)
