"""A takeover over an engine updated to a near checkpoint, on a real vLLM (#47, symptom 2).

A1 is A after one optimizer step: on the probe it deviates from A by far less
than the engine's own noise, so a gateway restarted without its journal and
told ``--checkpoint A`` went READY and credited every answer to A. Now the
engine's label (``rc-1``) says it was written since it started, and without
the journal that published that update (or content evidence) the takeover is
refused, whichever checkpoint is declared; with the journal, A1 is confirmed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from enginetools import ROOT, EngineFactory, TinyModels, gateway_process, stop_group
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import free_port, vllm_available
from rolloutcore.service.client import RolloutCoreClient
from rolloutcore.transports.gloo import GlooTransport

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "takeover-near-token-0123456789abcdef"
TAKEOVER_REFUSED = 3


def _one_optimizer_step(a: Path, out: Path) -> Path:
    """A after one Adam step on a few tokens (lr 1e-5, saved in bf16 as A is): the near
    checkpoint A1 (a fraction of the weights move by one bf16 step)."""
    import shutil

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(a, torch_dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    ids = torch.tensor([[(7 * k) % 250 + 1 for k in range(24)]])
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for f in a.iterdir():   # the tokenizer and anything else the checkpoint carries
        if not (out / f.name).exists() and f.is_file():
            shutil.copy(f, out / f.name)
    from safetensors.torch import load_file

    before = {k: v for f in a.glob("*.safetensors") for k, v in load_file(f).items()}
    after = {k: v for f in out.glob("*.safetensors") for k, v in load_file(f).items()}
    assert any(not torch.equal(before[k], after[k]) for k in before)   # A1 is not A
    return out


def _serve(upstream: str, ckpt: Path, token: Path, log: Path) -> tuple[int | None, str]:
    """A gateway start expected to be refused: (its exit status, its log). One that
    serves instead is stopped at once and reported with status ``None``."""
    port = free_port()
    cmd = [sys.executable, "-m", "rolloutcore", "serve", "--upstream", upstream,
           "--checkpoint", str(ckpt), "--port", str(port), "--token-file", str(token)]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    return None, log.read_text(errors="replace")   # it took the engine over
            time.sleep(0.5)
        return proc.poll(), log.read_text(errors="replace")
    finally:
        stop_group(proc, 30)


def test_a_gateway_without_its_journal_refuses_an_engine_on_a_near_checkpoint(
        engine_factory: EngineFactory, tiny_models: TinyModels, tmp_path: Path) -> None:
    a = tiny_models.A
    a1 = _one_optimizer_step(a, tmp_path / "A1")
    eng = engine_factory(a, backend="rolloutcore_gloo")
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    journal = tmp_path / "journal.jsonl"
    try:
        with gateway_process(eng.base_url, a, token, tmp_path / "gw-0.log",
                             ["--journal", str(journal), "--lease-s", "120"]) as (url, _):
            with RolloutCoreClient(url, TOKEN, transport=GlooTransport(op_timeout_s=60),
                                   begin_timeout_s=300, report_timeout_s=300) as rc:
                res = rc.update(a1, Provenance(str(a1), "near", 1), owner="near")
            assert res.status == "published" and res.published is not None
            assert res.published.label == "rc-1"
        assert httpx.get(f"{eng.base_url}/weight_info", timeout=10).json()[
            "weight_version"] == "rc-1"
        for name, ckpt in (("A", a), ("A1", a1)):
            log = tmp_path / f"gw-nojournal-{name}.log"
            code, text = _serve(eng.base_url, ckpt, token, log)
            assert code == TAKEOVER_REFUSED, text[-3000:]
            assert "refusing to serve" in text and "'rc-1': it was updated" in text, \
                text[-3000:]
        # With the journal that published A1, A1 is confirmed on the same engine.
        with gateway_process(eng.base_url, a1, token, tmp_path / "gw-1.log",
                             ["--journal", str(journal)]) as (url, _):
            st = httpx.get(f"{url}/control/status", timeout=30,
                           headers={"authorization": f"Bearer {TOKEN}"}).json()
            assert st["state"] == "READY" and st["committed"]["label"] == "rc-1"
    finally:
        engine_factory.stop(eng)
