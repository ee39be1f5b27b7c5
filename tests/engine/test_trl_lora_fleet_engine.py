"""``rolloutcore train --lora --gateway URL`` against a fleet: ``rolloutcore serve --engines 2
--lora`` started as a user starts it (a subprocess launching two real vLLM engines with
LoRA enabled), a 2-step run: every adapter version is published on both replicas through
the fleet's trainer protocol (each replica's acknowledgement read, its own copy kept),
every recorded sample names its replica, the fleet version and that replica's copy of
its step's adapter, and the audit against the fleet's journal directory is clean.

With ``--ray`` (where ray is installed: ``scripts/test.sh --ray`` installs it) the two
engines are Ray actors, which may sit on other nodes: each adapter version's files are
uploaded into each engine's own store (``transports.adapter_store``) and vLLM lists the
engine's copy as the adapter's root, never the gateway's.

The fast-lane version (fake replicas, an in-process PEFT engine):
tests/test_trl_lora_fleet_unit.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import stop_group
from helpers.gateway_rig import TOKEN
from rolloutcore.control.journal import read_journal
from rolloutcore.core.adapters import AdapterChange, AdapterState
from rolloutcore.engine.process import vllm_available
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.transports.net import free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,   # two engine starts and 2 steps through the fleet gateway
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]
pytest.importorskip("peft")
pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[2]
STEPS = 2


def _wait(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log.read_text()[-4000:]
        with contextlib.suppress(httpx.HTTPError):
            st = httpx.get(f"{url}/control/status", timeout=2,
                           headers={"authorization": f"Bearer {TOKEN}"})
            if st.status_code == 200 and st.json().get("serving") == 2:
                return
        assert time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)


@pytest.mark.parametrize("placement", ["local", "ray"])
def test_train_lora_through_a_fleet_gateway(tmp_path: Path, placement: str) -> None:
    from rolloutcore.cli.train import MODEL_SEED, LoraSettings, run_train
    from rolloutcore.testing.models import make_checkpoint

    work = tmp_path / "train"
    ckpt = make_checkpoint(work / "policy-0", MODEL_SEED)   # the checkpoint train uses
    journals, log = tmp_path / "journals", tmp_path / "serve.log"
    port = free_port()
    path = [str(ROOT / "src")]
    if placement == "ray":
        ray = pytest.importorskip("ray")
        path.append(str(Path(ray.__file__).parents[1]))   # where this ray came from
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--engines", "2", "--lora",
           "--max-lora-rank", "8", "--model", str(ckpt), "--port", str(port),
           "--token", TOKEN, "--workdir", str(tmp_path / "serve"), "--journal", str(journals),
           *(["--ray"] if placement == "ray" else [])]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(path)})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(url, proc, log, 900)
        rep: dict[str, Any] = run_train(
            work, steps=STEPS, prompts_per_step=2, num_generations=2, max_tokens=4,
            progress=None, lora=LoraSettings(rank=4, alpha=8), gateway=url, token=TOKEN,
            gateway_journal=journals)
        st = httpx.get(f"{url}/control/status", timeout=10,
                       headers={"authorization": f"Bearer {TOKEN}"}).json()
        roots = []
        for r in st["replicas"]:
            models = httpx.get(f"{r['url']}/v1/models", timeout=30).json()["data"]
            roots += [m["root"] for m in models if m.get("parent")]
    finally:
        if placement == "ray" and proc.poll() is None:
            # The gateway alone, as an operator stops it: SIGTERM to the whole group
            # would also stop the Ray cluster it started (its GCS) under it.
            proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(120)
        stop_group(proc, 120)   # what is still running (nothing, once it exited)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)   # anything it left in its group
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    assert rep["interrupted"] is None and rep["steps"] == STEPS, rep.get("interrupted")
    lora = rep["lora"]
    assert rep["updates_published"] == STEPS == len(set(lora["adapter_versions"]))
    # Published on both replicas: each replica's journal has every version, in order.
    for n in ("e0", "e1"):
        recs = [r.record for r in read_journal(journals / f"{n}.journal.jsonl")]
        assert [r.name for r in recs if isinstance(r, AdapterChange)
                and r.after is AdapterState.PUBLISHED] == lora["adapter_versions"]
    by_step = {u["step"]: u["adapter"] for u in rep["updates"]}
    samples = [s for g in read_groups(work / "trajectories.jsonl") for s in g.samples]
    assert len(samples) == rep["samples_recorded"] == STEPS * 2 * 2
    for s in samples:
        want = by_step[s.step]
        assert s.fleet is not None and s.fleet.replica in ("e0", "e1")
        assert s.adapter is not None and (s.adapter.name, s.adapter.content_digest) == (
            want["name"], want["content_digest"])
        assert s.adapter.base == s.binding.version.label
    # Where each engine loaded its adapters from: the gateway's files (local engines), or
    # the engine's own store, uploaded (Ray actors).
    assert roots
    served = str((tmp_path / "serve").resolve())
    assert all(Path(x).resolve().is_relative_to(served) == (placement == "local")
               for x in roots), roots
    assert rep["journal"] == str(journals)
    assert rep["audit"]["ok"] and rep["audit"]["samples"] == len(samples), \
        rep["audit"]["table"]
