"""vLLM's LoRA routes through ``rolloutcore serve --lora --native-routes`` on a real CPU vLLM.

An unmodified client that loads adapters through vLLM's own routes changes
only its base URL (``/rc/<token>``): its ``/v1/load_lora_adapter`` publishes a
verified adapter version (journaled), its ``/v1/completions`` for the name it
loaded are answered through that version (the engine's own log-probabilities
are base + adapter's, not the base's), an in-place reload publishes the next
one, and its ``/v1/unload_lora_adapter`` retires it; vLLM's bodies, answers
and status codes throughout, and no 5xx on bad input.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from test_serve_lora_engine import PROMPT, _reference_logprobs, _saved_adapter

from enginetools import TinyModels, stop_group, wait_healthy
from helpers.gateway_rig import TOKEN
from rolloutcore.engine.process import vllm_available
from rolloutcore.transports.net import free_port

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]
pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]
NATIVE = "native-lora-engine-token-0123456789"


def test_an_unmodified_lora_client_loads_generates_reloads_and_unloads(
        tiny_models: TinyModels, tmp_path: Path) -> None:
    a1 = _saved_adapter(tiny_models.A, 21, tmp_path / "a21", rank=8)
    a2 = _saved_adapter(tiny_models.A, 22, tmp_path / "a22", rank=8)
    port = free_port()
    log = tmp_path / "serve.log"
    journal = tmp_path / "journal.jsonl"
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--lora", "--native-routes",
           "--max-lora-rank", "8", "--model", str(tiny_models.A), "--port", str(port),
           "--token", TOKEN, "--workdir", str(tmp_path / "work"), "--journal", str(journal)]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src"),
                                     "ROLLOUTCORE_NATIVE_TOKEN": NATIVE})
    url = f"http://127.0.0.1:{port}"
    base = f"{url}/rc/{NATIVE}"
    try:
        wait_healthy(url, proc, log, 600)
        with httpx.Client(base_url=base, timeout=300) as c:
            def gen(model: str) -> httpx.Response:
                return c.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                    "logprobs": 0, "return_token_ids": True})

            r = c.post("/v1/load_lora_adapter", json={"lora_name": "my-lora",
                                                      "lora_path": str(a1)})
            assert r.status_code == 200, r.text
            assert r.text == "Success: LoRA adapter 'my-lora' added successfully."
            v1 = r.headers["x-rolloutcore-adapter"]
            listed = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            assert listed["my-lora"]["root"] == str(a1) and v1 in listed
            # vLLM's own refusal of a second load under the name, nothing changed
            again = c.post("/v1/load_lora_adapter", json={"lora_name": "my-lora",
                                                          "lora_path": str(a2)})
            assert again.status_code == 400 and "load_inplace" in again.json()["error"]["message"]
            g = gen("my-lora")
            assert g.status_code == 200, g.text
            assert g.headers["x-rolloutcore-adapter"] == v1
            ch = g.json()["choices"][0]
            toks = [int(t) for t in ch["token_ids"]]
            lps = [float(x) for x in ch["logprobs"]["token_logprobs"]]
            ids = PROMPT + toks
            d_adapter = max(abs(a - b) for a, b in zip(
                lps, _reference_logprobs(tiny_models.A, a1, ids), strict=True))
            d_base = max(abs(a - b) for a, b in zip(
                lps, _reference_logprobs(tiny_models.A, None, ids), strict=True))
            assert d_adapter < 0.05 < d_base, (d_adapter, d_base)
            # an in-place reload: the next version, verified, serves the name
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "my-lora",
                                                      "lora_path": str(a2),
                                                      "load_inplace": True})
            assert r.status_code == 200, r.text
            v2 = r.headers["x-rolloutcore-adapter"]
            assert v2 != v1 and gen("my-lora").headers["x-rolloutcore-adapter"] == v2
            # hostile input: vLLM's error shape, a 4xx
            for body, status in (({"lora_name": "x", "lora_path": str(tmp_path / "nope")},
                                  404), ({"lora_path": str(a1)}, 400),
                                 ({"lora_name": "policy", "lora_path": str(a1)}, 400)):
                bad = c.post("/v1/load_lora_adapter", json=body)
                assert bad.status_code == status, bad.text
                assert set(bad.json()["error"]) == {"message", "type", "param", "code"}
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "my-lora"})
            assert r.status_code == 200, r.text
            assert r.text == "Success: LoRA adapter 'my-lora' removed successfully."
            gone = c.post("/v1/unload_lora_adapter", json={"lora_name": "my-lora"})
            assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
            assert gen("my-lora").status_code == 404   # vLLM's: the model does not exist
            models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
            assert not {m["id"] for m in models} & {v1, v2}   # both unloaded from vLLM
    finally:
        stop_group(proc, 120)
    assert proc.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
    recs = [json.loads(line) for line in journal.read_text().splitlines()]
    ev = [(x["data"]["name"], x["data"]["event"], x["data"]["after"]) for x in recs
          if x["kind"] == "adapter"]
    assert (v1, "verified", "published") in ev and (v2, "verified", "published") in ev
    assert (v2, "withdrawn", "standby") in ev
    assert (v1, "unloaded", "retired") in ev and (v2, "unloaded", "retired") in ev
