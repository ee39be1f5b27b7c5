"""The gateway (real uvicorn, own process) in front of a real vLLM, with a real trainer.

One vLLM on checkpoint A with the gloo weight-transfer backend; one gateway
process (``python -m rolloutcore serve --upstream ...``) writing its
journal to a file. The test process is both the rollout clients (asyncio,
streaming and not) and the trainer (``RolloutCoreClient`` + ``GlooTransport``,
in a thread).

Checked afterwards, from the responses and the gateway's journal:

* every answer is one version: its header, its body field, its admission
  binding (journal ``admit``) and vLLM's own ``weight_versions`` spans agree;
* no request straddles an update: no admission or release between an
  update's ``begin_update`` and its ``commit``;
* no answer was cut off without an error event;
* a trainer process SIGKILLed between begin and report, before it sent
  anything: the lease expires, nothing is published, and since the engine
  counted no weight write the update ends with no mutation: back in service
  on the old version (issue 16: a lease that ends with nothing sent must not
  taint).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels, gateway_process
from rolloutcore.control.journal import read_journal
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.service.client import RolloutCoreClient
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "engine-test-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    journal: Path
    log: Path
    trajectories: Path
    engine: ManagedEngine
    models: TinyModels
    answers: list[dict[str, Any]] = field(default_factory=list)


@pytest.fixture(scope="module")
def gateway(engine_factory: EngineFactory, tiny_models: TinyModels,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    work = tmp_path_factory.mktemp("gateway")
    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    journal, log = work / "journal.jsonl", work / "gateway.log"
    try:
        with gateway_process(eng.base_url, tiny_models.A, token_file, log,
                             ["--journal", str(journal), "--lease-s", "120",
                              "--record", str(work / "trajectories.jsonl")]) as (url, proc):
            yield Gateway(url, proc, journal, log, work / "trajectories.jsonl", eng,
                          tiny_models)
    finally:
        engine_factory.stop(eng)


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for ev in text.split("\n\n"):
        ev = ev.strip()
        if ev.startswith("data:"):
            p = ev[5:].strip()
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


async def _client(gw: Gateway, i: int, stop: asyncio.Event, rnd: random.Random,
                  out: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(base_url=gw.url, timeout=120) as c:
        prompt_index = 0
        while not stop.is_set():
            stream = rnd.random() < 0.75
            route = "/inference/v1/generate" if rnd.random() < 0.8 else "/v1/completions"
            n = rnd.randint(4, 40)
            if route == "/inference/v1/generate":
                body: dict[str, Any] = {
                    "model": "policy", "token_ids": [rnd.randrange(1, 250) for _ in range(12)],
                    "sampling_params": {"max_tokens": n, "temperature": 0.0, "ignore_eos": True},
                    "stream": stream}
            else:
                body = {"model": "policy", "prompt": f"rollout {i} {rnd.random()}",
                        "max_tokens": n, "temperature": 0.0, "ignore_eos": True,
                        "stream": stream}
            coords = {"x-rolloutcore-run": "engine-test", "x-rolloutcore-step": str(i),
                      "x-rolloutcore-prompt-index": str(prompt_index)}
            r = await c.post(route, json=body, headers=coords)
            if r.status_code == 503:
                assert r.headers.get("retry-after") == "1", r.text
                await asyncio.sleep(0.05)
                continue
            rec: dict[str, Any] = {"route": route, "stream": stream, "status": r.status_code,
                                   "header": r.headers.get("x-rolloutcore-version"),
                                   "rollout_id": r.headers.get("x-rolloutcore-rollout-id"),
                                   "max_tokens": n, "coords": (i, prompt_index)}
            prompt_index += 1
            if stream:
                evs = _events(r.text)
                rec["done"] = bool(evs) and evs[-1] == "[DONE]"
                rec["errors"] = [e for e in evs if isinstance(e, dict) and "error" in e]
                chunks = [e for e in evs if isinstance(e, dict) and "choices" in e]
                rec["body"] = chunks[0].get("rolloutcore") if chunks else None
                rec["spans"] = [s for e in chunks for ch in e["choices"]
                                for s in (ch.get("weight_versions") or [])]
                rec["tokens"] = sum(len(ch.get("token_ids") or []) for e in chunks
                                    for ch in e["choices"])
            else:
                data = r.json()
                rec["done"] = True
                rec["errors"] = [data] if "error" in data else []
                rec["body"] = data.get("rolloutcore")
                rec["spans"] = [s for ch in data.get("choices", [])
                                for s in (ch.get("weight_versions") or [])]
                rec["tokens"] = sum(len(ch.get("token_ids") or []) for ch in
                                    data.get("choices", []))
            out.append(rec)


def test_concurrent_streams_while_the_trainer_updates_three_times(gateway: Gateway) -> None:
    gw, models = gateway, gateway.models
    sources = [(models.B, 1), (models.A, 2), (models.B, 3)]
    results: list[Any] = []
    errors: list[BaseException] = []
    answers: list[dict[str, Any]] = []

    def trainer(stop_after: threading.Event) -> None:
        try:
            with RolloutCoreClient(gw.url, TOKEN, transport=GlooTransport(),
                                   begin_timeout_s=300, report_timeout_s=300) as rc:
                for ckpt, step in sources:
                    time.sleep(1.5)
                    res = rc.update(WeightSource.from_checkpoint(ckpt),
                                    Provenance(str(ckpt), "engine-test", step),
                                    owner="engine-test-trainer")
                    results.append(res)
                time.sleep(1.5)
        except BaseException as exc:
            errors.append(exc)
        finally:
            stop_after.set()

    async def run() -> None:
        stop = asyncio.Event()
        done = threading.Event()
        loop = asyncio.get_running_loop()
        th = threading.Thread(target=trainer, args=(done,), daemon=True)
        th.start()

        async def watch() -> None:
            await loop.run_in_executor(None, done.wait, 600)
            stop.set()

        rnd = random.Random(1234)
        await asyncio.gather(watch(), *(_client(gw, i, stop, random.Random(rnd.random()),
                                                answers) for i in range(8)))
        th.join(60)

    asyncio.run(run())
    assert not errors, errors
    assert [r.published.label for r in results] == ["rc-1", "rc-2", "rc-3"]
    assert all(r.state == "READY" for r in results)

    assert len(answers) >= 40, len(answers)
    by_version: dict[str, int] = {}
    for a in answers:
        assert a["status"] == 200, a
        assert a["done"] and not a["errors"], a  # nothing cut off, nothing failed
        assert a["body"] is not None and a["body"]["version"] == a["header"], a
        assert a["body"]["rollout_id"] == a["rollout_id"]
        if a["route"] == "/inference/v1/generate":
            assert a["tokens"] == a["max_tokens"], a
            assert a["spans"], a
            assert {s["version"] for s in a["spans"]} == {a["header"]}, a
            assert a["spans"][-1]["end"] == a["max_tokens"]
        by_version[a["header"]] = by_version.get(a["header"], 0) + 1
    assert {"default", "rc-3"} <= set(by_version), by_version

    # The journal is written by the gateway's writer thread: an answer can reach its
    # client a moment before its records reach the file. Every one of them arrives.
    answered = {a["rollout_id"] for a in answers}
    deadline = time.monotonic() + 30
    while True:
        recs = read_journal(gw.journal, live=True)
        admits = {r.data["rollout_id"]: r.data for r in recs if r.kind == "admit"}
        done = {r.data["rollout_id"]: r.data for r in recs if r.kind == "complete"}
        if answered <= set(admits) & set(done) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for a in answers:  # the binding is the answer's version
        assert admits[a["rollout_id"]]["version"]["label"] == a["header"]
    for k in (1, 2, 3):
        i_begin = next(i for i, r in enumerate(recs) if r.kind == "begin_update"
                       and r.data["update_id"] == k)
        i_commit = next(i for i, r in enumerate(recs) if r.kind == "commit"
                        and r.data["version"]["label"] == f"rc-{k}")
        inside = [r for r in recs[i_begin:i_commit] if r.kind in ("admit", "complete")]
        assert not inside, inside
    # every admitted rollout was released, under the version it was admitted with
    assert set(done) == set(admits)
    assert all(done[k]["version"] == admits[k]["version"] for k in done)
    status = httpx.get(f"{gw.url}/control/status", headers=AUTH, timeout=10).json()
    assert status["committed"]["label"] == "rc-3" and status["active_rollouts"] == 0
    # the recorded trajectories carry the same binding as the answers, and vLLM's spans
    gen = {(a["coords"][0], a["coords"][1]): a for a in answers
           if a["route"] == "/inference/v1/generate"}
    deadline = time.monotonic() + 30
    while True:
        groups = list(read_groups(gw.trajectories)) if gw.trajectories.exists() else []
        if len(groups) >= len(gen) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(groups) == len(gen)
    for g in groups:
        (s,) = g.samples
        a = gen[(s.step, s.prompt_index)]
        assert s.binding.rollout_id == a["rollout_id"]
        assert s.binding.version.label == a["header"]
        assert {sp.version for sp in s.completion.weight_versions or ()} == {a["header"]}
        assert len(s.completion.token_ids) == a["max_tokens"]
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert 'rolloutcore_updates_total{outcome="published"} 3.0' in text


def test_trainer_sigkilled_between_begin_and_report(gateway: Gateway) -> None:
    """Nothing was sent: the engine's own counters say so, and it is not tainted."""
    gw = gateway
    before = httpx.get(f"{gw.url}/control/status", headers=AUTH, timeout=10).json()
    ckpt = gw.models.A
    script = textwrap.dedent(f"""
        import time
        from rolloutcore.service.client import RolloutCoreClient, identity_of
        from rolloutcore.transports.gloo import GlooTransport
        from rolloutcore.core.versions import Provenance
        from rolloutcore.transports.source import WeightSource
        from rolloutcore.verification.probe import PolicyProbe
        src = WeightSource.from_checkpoint({str(ckpt)!r})
        rc = RolloutCoreClient({gw.url!r}, {TOKEN!r}, transport=GlooTransport())
        g = rc.begin(identity_of(src, Provenance({str(ckpt)!r}, "doomed", 9)),
                     owner="doomed-trainer", lease_s=8,
                     probe=PolicyProbe.from_checkpoint({str(ckpt)!r}))
        print("BEGUN", g.update_id, g.target.label, g.lease_secret, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("BEGUN"), (line, proc.stderr.read() if proc.stderr else "")
        uid, secret = int(line.split()[1]), line.split()[3]
        st = httpx.get(f"{gw.url}/control/status", headers=AUTH, timeout=10).json()
        assert st["state"] == "UPDATING" and st["update"]["owner"] == "doomed-trainer"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
    lease = {**AUTH, "x-rolloutcore-lease": secret}
    assert httpx.get(f"{gw.url}/control/updates/{uid}", headers=AUTH,
                     timeout=10).status_code == 403  # the lease is the trainer's
    deadline = time.monotonic() + 30
    while True:
        upd = httpx.get(f"{gw.url}/control/updates/{uid}", headers=lease, timeout=10).json()
        if upd["status"] == "expired" or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    st = httpx.get(f"{gw.url}/control/status", headers=AUTH, timeout=10).json()
    assert st["state"] == "READY"
    assert st["committed"] == before["committed"]
    assert st["published"] == before["published"]
    assert upd["status"] == "expired" and upd["result"]["classification"] == "no_mutation"
    assert "nothing was sent" in upd["result"]["reason"]
    r = httpx.post(f"{gw.url}/inference/v1/generate", timeout=30,
                   json={"model": "policy", "token_ids": [1, 2],
                         "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 200
    assert r.headers["x-rolloutcore-version"] == before["committed"]["label"]
    paused = httpx.get(f"{gw.engine.base_url}/is_paused", timeout=10).json()
    assert paused.get("is_paused") is False
    recs = read_journal(gw.journal, live=True)
    assert not [x for x in recs if x.kind == "commit" and x.data["version"]["generation"] > 3]
    assert not any(x.kind == "taint" for x in recs)
