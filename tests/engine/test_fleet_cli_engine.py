"""``rolloutcore serve --engines 2`` as a user runs it: a subprocess, two real vLLM engines.

The command launches both engines on A (with its progress display), puts
them behind the fleet gateway and takes updates on
``POST /control/fleet/updates``. Here: the gateway comes up, both replicas
serve fleet version 0, a synchronous update to B (one fan-out broadcast) is
published on both, the data plane then answers from version 1 on either
replica with B's greedy tokens, a bad update body is refused field by field,
and SIGTERM stops the gateway and both engines (their ports close).
Slow lane: two engines cold-start on a 2-core host; once with one-rank engines, once
with two TP=2 engines (`--tensor-parallel-size 2`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fleettools_engine import greedy

from enginetools import Greedy, ServeEngines, TinyModels
from rolloutcore.engine.process import vllm_available
from rolloutcore.fleet.gateway import FLEET_VERSION_HEADER, REPLICA_HEADER

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "fleet-cli-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


#: Two TP=2 engines are four ranks: on this 2-core host they share the cores by the
#: operator's binding (without it ``serve`` refuses, naming the cores it needs).
SHARED = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "ROLLOUTCORE_VLLM_IDLE_SPIN_S": "0.05"}


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_serve_engines_2_starts_updates_and_stops_a_fleet(
        tiny_models: TinyModels, tmp_path: Path, tp: int, cold_greedy: Callable[..., Greedy],
        serve_engines: ServeEngines) -> None:
    env = SHARED if tp > 1 else {}
    ref_b = cold_greedy(tiny_models.B, tensor_parallel_size=tp, env=env)
    log = tmp_path / "serve.log"
    args = ["--engines", "2", "--model", str(tiny_models.A), "--token", TOKEN,
            "--workdir", str(tmp_path / "work"), "--tensor-parallel-size", str(tp)]
    engine_urls: list[str] = []
    with serve_engines(args, log, env) as (url, proc):
        text = log.read_text()
        assert "starting 2 vLLM engines as local processes" in text
        st = httpx.get(f"{url}/control/status", headers=AUTH, timeout=30).json()
        engine_urls = [r["url"] for r in st["replicas"]]
        assert [r["name"] for r in st["replicas"]] == ["e0", "e1"] and st["serving"] == 2
        assert st["newest"]["generation"] == 0
        # A bad body: refused field by field, nothing starts.
        bad = httpx.post(f"{url}/control/fleet/updates", headers=AUTH, timeout=30,
                         json={"checkpoint": str(tiny_models.B), "strategy": "sideways"})
        assert bad.status_code in (400, 422) and "strategy" in bad.text
        assert httpx.post(f"{url}/control/fleet/updates", timeout=30,
                          json={"checkpoint": str(tiny_models.B)}).status_code == 401
        r = httpx.post(f"{url}/control/fleet/updates", headers=AUTH, timeout=30,
                       json={"checkpoint": str(tiny_models.B), "strategy": "synchronous",
                             "label": "cli-1", "step": 1})
        assert r.status_code == 202, r.text
        status_url = url + r.json()["status_url"]
        deadline = time.monotonic() + 600
        while True:
            job = httpx.get(status_url, headers=AUTH, timeout=30).json()
            if job["state"] != "running":
                break
            assert time.monotonic() < deadline, job
            time.sleep(0.1)
        assert job["state"] == "published", job
        assert job["result"]["transfer"] == "fanout"
        assert job["result"]["outcomes"] == {"e0": "passed", "e1": "passed"}
        st = httpx.get(f"{url}/control/status", headers=AUTH, timeout=30).json()
        assert st["newest"]["label"] == "cli-1" and st["versions_served"] == {"cli-1": 2}
        replicas = set()
        for i in range(6):
            a = httpx.post(f"{url}/inference/v1/generate", timeout=60, json={
                "model": "policy", "token_ids": [5, i, 9],
                "sampling_params": {"max_tokens": 4, "temperature": 0}})
            assert a.status_code == 200, a.text
            assert a.headers[FLEET_VERSION_HEADER] == "1"
            replicas.add(a.headers[REPLICA_HEADER])
        assert replicas <= {"e0", "e1"} and replicas
        assert [greedy(u) for u in engine_urls] == [ref_b, ref_b]
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    for u in engine_urls:  # the gateway stopped its engines on the way out
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{u}/health", timeout=2)
