"""A tensor-parallel (TP=2) CPU vLLM updated hot, every rank's writes checked.

vLLM's CPU build runs ``--tensor-parallel-size 2`` with one worker process
per rank, each bound to its own core (``tp_thread_binding``: ``0|1`` here).
An update goes through the trainer API (``EngineSession``): the gloo group
holds the trainer and both ranks, each rank reports the checksums of the
slices it wrote (``rank_checksums``) and the paused validation rebuilds them
from the full tensors. Negative controls break one rank's share while
every endpoint succeeds (``rankfault``, a worker extension loaded into the
real engine): a skipped shard, the other rank's slice, a rank killed
mid-transfer, a rank slow to join.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import rankfault

from enginetools import EngineFactory, TinyModels
from rolloutcore.control.runner import Deadlines
from rolloutcore.core.evidence import PauseMode
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.wire import prefix_cache_delta
from rolloutcore.errors import UpdateFailed
from rolloutcore.session import EngineSession
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
    pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 cores"),
]

TARGET = "model.layers.0.mlp.down_proj.weight"  # row-parallel: each rank holds half its columns


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * k) % 250 + 1 for k in range(24 + 8 * i)] for i in range(4)]


def _greedy(http: VllmHTTP) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in _prompts():
        g = http.generate(ids, max_tokens=10, temperature=0.0, logprobs=True, ignore_eos=True)
        out.append((list(g.token_ids), [float(x) for x in (g.logprobs or [])]))
    return out


@dataclass
class Rig:
    engine: ManagedEngine
    fault: Path
    models: TinyModels

    def session(self, ckpt: Path, **kw: Any) -> EngineSession:
        """A fresh controller on the engine, which must serve ``ckpt`` (taken over)."""
        s = EngineSession(VllmHTTP(self.engine.base_url, timeout_s=120.0),
                          GlooTransport(op_timeout_s=60), **kw)
        s.bootstrap(ckpt, Provenance(str(ckpt), "tp-test", 0))
        return s

    def install(self, ckpt: Path) -> None:
        """Put ``ckpt`` on the engine outside any controller and resume it (a repair)."""
        self.fault.write_text("")
        with VllmHTTP(self.engine.base_url, timeout_s=120.0) as h, \
                contextlib.closing(GlooTransport(op_timeout_s=60)) as tr:
            h.pause(PauseMode.ABORT)
            tr.send(h.base_url, f"repair-{time.monotonic_ns()}",
                    WeightSource.from_checkpoint(ckpt), timeout_s=120)
            assert tr.validation_check(h.base_url).passed
            assert h.reset_prefix_cache().engine_success
            h.resume()


def cold_greedy(engine_factory: EngineFactory, model: Path,
                **kw: Any) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and logprobs of a cold engine on ``model`` (no transfer backend;
    ``kw``: its layout and environment), stopped before returning."""
    cold = engine_factory(model, backend=None, **kw)
    try:
        with VllmHTTP(cold.base_url, timeout_s=120.0) as h:
            return _greedy(h)
    finally:
        engine_factory.stop(cold)


@contextlib.contextmanager
def fault_rig(engine_factory: EngineFactory, models: TinyModels, fault_dir: Path,
              env: dict[str, str] | None = None, **kw: Any) -> Iterator[Rig]:
    """An engine on A with the ``rankfault`` extension (its fault file empty), as a Rig."""
    fault = fault_dir / "fault"
    fault.write_text("")
    eng = engine_factory(models.A, guard_routes=True,
                         extra_args=("--worker-extension-cls", "rankfault.RankFault"),
                         env={**(env or {}), **rankfault.fault_env(fault)}, **kw)
    try:
        yield Rig(eng, fault, models)
    finally:
        engine_factory.stop(eng)


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    with fault_rig(engine_factory, tiny_models, tmp_path_factory.mktemp("rankfault"),
                   tensor_parallel_size=2) as r:
        yield r


@pytest.fixture(scope="module")
def cold_b(rig: Rig, engine_factory: EngineFactory) -> list[tuple[list[int], list[float]]]:
    """Greedy ids and logprobs of a cold TP=2 engine on B (no transfer backend)."""
    return cold_greedy(engine_factory, rig.models.B, tensor_parallel_size=2)


def _update_checked_on_every_rank(rig: Rig) -> list[tuple[list[int], list[float]]]:
    """A -> B through the trainer API; both ranks checked; 0 stale prefix hits; B's
    greedy answers (the engine is left on B, resumed)."""
    s = rig.session(rig.models.A)
    try:
        h = s.http
        block = int(h.server_info()["vllm_config"]["cache_config"]["block_size"])
        prompts = _prompts()
        for ids in prompts:  # cached under A
            h.generate(ids, max_tokens=2)
        r = s.update(rig.models.B, Provenance(str(rig.models.B), "tp-test", 1))
        assert r.version.label == "rc-1"
        check = s.transport.last_check
        assert check["passed"], check
        assert check["coverage_per_rank"] == [1.0, 1.0]
        assert sorted(rk["tp_rank"] for rk in check["ranks"]) == [0, 1]
        assert all(rk["compared"] == rk["model_params"] > 0 for rk in check["ranks"])
        m0 = h.metrics()
        hot = _greedy(h)
        stale = prefix_cache_delta(m0, h.metrics()).hits
        assert stale == 0, f"{stale} prefix tokens hit across the update (block {block})"
        return hot
    finally:
        s.close()


def test_a_tp2_update_is_checked_on_every_rank(rig: Rig) -> None:
    _update_checked_on_every_rank(rig)


@pytest.mark.slow  # a second TP=2 engine start (2-4 min on 2 cores): the slow lane
def test_a_tp2_update_equals_a_cold_tp2_start(
        rig: Rig, cold_b: list[tuple[list[int], list[float]]]) -> None:
    rig.install(rig.models.A)
    assert _update_checked_on_every_rank(rig) == cold_b  # greedy ids and logprobs, bit for bit


def test_the_other_ranks_slice_is_caught_on_that_rank_only(rig: Rig) -> None:
    rig.install(rig.models.A)
    rig.fault.write_text(f"other 1 {TARGET}")
    with VllmHTTP(rig.engine.base_url, timeout_s=120.0) as h, \
            contextlib.closing(GlooTransport(op_timeout_s=60)) as tr:
        h.pause(PauseMode.ABORT)
        tr.send(h.base_url, "wrong-slice", WeightSource.from_checkpoint(rig.models.B),
                timeout_s=120)
        chk = tr.validation_check(h.base_url)
        h.resume()
    assert not chk.passed
    ranks = {rk["tp_rank"]: rk for rk in tr.last_check["ranks"]}
    assert ranks[0]["passed"] and ranks[0]["n_mismatched"] == 0
    assert ranks[1]["mismatched"] == [TARGET]
    assert TARGET in chk.detail


def _refused(rig: Rig, s: EngineSession, fault: str) -> float:
    """An update A -> B with ``fault`` in rank 1 fails and publishes nothing; its seconds."""
    before = [v.label for v in s.controller.published]
    rig.fault.write_text(fault)
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed):
        s.update(rig.models.B, Provenance(str(rig.models.B), "tp-test", 1))
    took = time.monotonic() - t0
    assert [v.label for v in s.controller.published] == before
    return took


@pytest.mark.slow  # negative controls beyond the CI lane's wrong-slice case (1.5 min)
def test_a_skipped_shard_is_refused_and_nothing_is_published(rig: Rig) -> None:
    rig.install(rig.models.A)
    s = rig.session(rig.models.A)
    try:
        _refused(rig, s, f"skip 1 {TARGET}")
        assert s.controller.state is State.TAINTED
        ranks = {rk["tp_rank"]: rk for rk in s.transport.last_check["ranks"]}
        assert ranks[0]["passed"] and not ranks[1]["passed"]
        assert any(TARGET in u for u in ranks[1]["uncovered"]) or \
            TARGET in ranks[1]["mismatched"]
    finally:
        rig.fault.write_text("")
        s.close()


@pytest.mark.slow  # negative controls beyond the CI lane's wrong-slice case (1.5 min)
def test_a_rank_slow_to_join_meets_the_deadline_not_a_hang(rig: Rig) -> None:
    rig.install(rig.models.A)
    s = rig.session(rig.models.A, deadlines=Deadlines(transfer_s=20.0))
    s.transport.close()  # the next update connects again: rank 1 will be late
    try:
        took = _refused(rig, s, "slow 1 45")
        assert took < 20.0 + 30.0, f"{took:.0f} s for a 20 s transfer deadline"
    finally:
        rig.fault.write_text("")
        s.close()


@pytest.mark.slow  # negative controls beyond the CI lane's wrong-slice case (1.5 min)
def test_a_rank_killed_mid_transfer_is_classified_and_nothing_published(rig: Rig) -> None:
    # (The slow-join case's ranks give up their join within the 60 s op timeout; the
    # repair's pause waits for that.)
    rig.install(rig.models.A)
    s = rig.session(rig.models.A)
    try:
        took = _refused(rig, s, f"die 1 {TARGET}")
        assert took < 60.0 + 30.0, f"{took:.0f} s with a 60 s op timeout"
        assert s.controller.state is State.TAINTED
    finally:
        rig.fault.write_text("")
        s.close()
