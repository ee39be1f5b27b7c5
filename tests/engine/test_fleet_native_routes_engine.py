"""``serve --engines 2 --native-routes``: two real CPU vLLMs behind one vLLM URL.

The trainer is the same unmodified gloo sender the single-engine test uses
(``GlooTransport.send(base_url, ...)``): it asks ``/get_world_size`` (the sum,
2), initialises one group of 3 ranks through the gateway (split there by rank
offset: e0 gets rank 1, e1 rank 2), and sends A -> B once. One fleet version is
published, each replica verified under the fleet's label, both engines then compute
B's greedy tokens and logprobs exactly as a cold engine started on B. Then e1 is
killed: the next round is refused (4xx) naming e1, nothing is published, and e0
serves the last published version.
Slow lane: two engines and a reference engine cold-start on a 2-core host.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from fleettools_engine import greedy

from enginetools import Greedy, ServeEngines, TinyModels
from rolloutcore.engine.process import vllm_available
from rolloutcore.errors import RolloutCoreError
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "fleet-native-token-0123456789abcdef"
NATIVE = "fleet-native-path-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _pid_listening_on(port: int) -> int:
    import psutil

    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    raise AssertionError(f"no process listens on {port}")


def test_a_two_engine_fleet_behind_one_url_is_updated_by_an_unmodified_sender(
        tiny_models: TinyModels, tmp_path: Path, cold_greedy: Callable[..., Greedy],
        serve_engines: ServeEngines) -> None:
    ref_b = cold_greedy(tiny_models.B)
    args = ["--engines", "2", "--model", str(tiny_models.A), "--token", TOKEN,
            "--workdir", str(tmp_path / "work"), "--native-routes",
            "--min-verification", "declared", "--health-interval-s", "0"]
    with serve_engines(args, tmp_path / "serve.log", {"ROLLOUTCORE_NATIVE_TOKEN": NATIVE}
                       ) as (url, proc), contextlib.closing(GlooTransport()) as tr:
        base = f"{url}/rc/{NATIVE}"

        def status() -> dict[str, object]:
            return dict(httpx.get(f"{url}/control/status", headers=AUTH, timeout=30).json())

        st = status()
        engines = {r["name"]: r["url"] for r in st["replicas"]}  # type: ignore[attr-defined]
        assert sorted(engines) == ["e0", "e1"] and st["serving"] == 2
        assert httpx.get(f"{base}/get_world_size", timeout=30).json() == {"world_size": 2}

        ev = tr.send(base, "trainer-label", WeightSource.from_checkpoint(tiny_models.B),
                     timeout_s=600)
        assert ev.completed
        st = status()
        newest = st["newest"]
        assert isinstance(newest, dict) and newest["generation"] == 1
        assert st["versions_served"] == {newest["label"]: 2}, st
        for r in st["replicas"]:  # type: ignore[attr-defined]
            # each replica verified its engine's label (set by the forwarded finish; the
            # engine's own routes need the launch's key, which only the gateway holds)
            assert r["in_pool"] and r["engine_version"]["label"] == newest["label"], r
        assert httpx.get(f"{base}/weight_info", timeout=30).json() == {
            "weight_version": newest["label"]}
        # both engines compute B exactly as a cold engine started on B
        assert [greedy(engines[n]) for n in ("e0", "e1")] == [ref_b, ref_b]
        g = httpx.post(f"{base}/inference/v1/generate", timeout=120, json={
            "model": "policy", "token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 4, "temperature": 0}})
        assert g.status_code == 200, g.text
        assert g.headers["x-rolloutcore-fleet-version"] == "1"

        # e1 dies: the next round is refused naming it; nothing published; e0 serves
        e1_port = int(str(engines["e1"]).rsplit(":", 1)[1].split("/")[0])
        os.kill(_pid_listening_on(e1_port), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RolloutCoreError) as info:
            tr.send(base, "again", WeightSource.from_checkpoint(tiny_models.A),
                    timeout_s=300)
        assert "e1" in str(info.value), str(info.value)
        assert time.monotonic() - t0 < 300
        st = status()
        assert st["newest"] == newest and st["update"] is None, st
        assert st["versions_served"] == {newest["label"]: 1}, st
        reps = {r["name"]: r for r in st["replicas"]}  # type: ignore[attr-defined]
        assert reps["e0"]["in_pool"] and not reps["e1"]["in_pool"]
        assert greedy(engines["e0"]) == ref_b
    assert proc.returncode == 128 + signal.SIGTERM, (tmp_path / "serve.log").read_text()[-3000:]
