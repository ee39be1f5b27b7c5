"""An engine lost between updates, on a real vLLM: restarted behind us, or killed.

* ``VllmAdapter.observe_health`` tells a restarted vLLM (same URL, a new
  process that loaded its start checkpoint) from the one it bootstrapped,
  by vLLM's ``instance_id``: healthy is not enough.
* The gateway (its own process, ``--health-interval-s 0.5``) in front of a
  vLLM that is SIGKILLed while READY: within a bounded time it is TAINTED,
  data requests get 503 (not 502 forever), ``/health`` says so, the metric
  counts it, the journal holds the taint and breaks no invariant, and
  nothing was published.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from enginetools import EngineFactory, TinyModels, gateway_process, kill_engine
from rolloutcore.control.journal import read_journal
from rolloutcore.core.invariants import check_journal
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import vllm_available

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "engine-lost-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
GEN = {"model": "policy", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}


@pytest.mark.slow  # waits for the watch to see a killed engine (2 min): the slow lane
def test_engine_lost_between_updates(engine_factory: EngineFactory, tiny_models: TinyModels,
                                     tmp_path: Path) -> None:
    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo")
    try:
        # 1. A restart behind the adapter's back is seen, though /health is 200.
        ad = VllmAdapter(VllmHTTP(eng.base_url, timeout_s=30))
        assert ad.bootstrap().healthy
        first = ad.observe_health()
        assert first.answering and first.healthy and not first.restarted
        assert first.problems() == []
        url = eng.base_url
        eng.restart()
        if eng.base_url != url:
            pytest.skip("the port was taken while the engine restarted")
        again = ad.observe_health()
        assert again.answering and again.healthy and again.restarted
        assert any("restarted" in p for p in again.problems())
        ad.close()

        # 2. The gateway's watch: the engine SIGKILLed while READY.
        token_file, journal = tmp_path / "token", tmp_path / "journal.jsonl"
        token_file.write_text(TOKEN + "\n")
        with gateway_process(eng.base_url, tiny_models.A, token_file,
                             tmp_path / "gateway.log",
                             ["--journal", str(journal), "--health-interval-s", "0.5"]) \
                as (gw, _):
            ok = httpx.post(f"{gw}/inference/v1/generate", json=GEN, timeout=60)
            assert ok.status_code == 200, ok.text
            before = httpx.get(f"{gw}/control/status", headers=AUTH, timeout=10).json()
            assert before["state"] == "READY"
            t_kill = kill_engine(eng)
            # Two failed checks 0.5 s apart, each bounded by its own timeout.
            deadline = t_kill + 30
            while True:
                st = httpx.get(f"{gw}/control/status", headers=AUTH, timeout=10).json()
                if st["state"] != "READY" or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert st["state"] == "TAINTED"
            assert st["committed"] == before["committed"]
            assert st["published"] == before["published"]
            r = httpx.post(f"{gw}/inference/v1/generate", json=GEN, timeout=10)
            assert r.status_code == 503
            assert r.json()["rolloutcore"]["state"] == "TAINTED"
            assert httpx.get(f"{gw}/health", timeout=10).status_code == 503
            assert "rolloutcore_engine_lost_total 1.0" in httpx.get(
                f"{gw}/metrics", timeout=10).text
        recs = read_journal(journal)
        taints = [x for x in recs if x.kind == "taint"]
        assert len(taints) == 1
        assert "engine failed while serving" in taints[0].data["problems"][0]
        assert not [x for x in recs if x.kind == "commit" and x.data["version"]["generation"]]
        assert check_journal(recs) == []
    finally:
        engine_factory.stop(eng)
