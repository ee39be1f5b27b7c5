"""VllmHTTP and VllmAdapter against a real vLLM 0.32 server (CPU, tiny Llama).

One server for the whole module. Every engine state used here is made for
real: a request frozen by ``/pause?mode=keep`` holds KV blocks, and that is
what makes ``/reset_prefix_cache`` answer HTTP 200 with ``{"success": false}``.
Which pause caught a request running is decided by the engine's own answer
to that reset (see ``_freeze``), so nothing depends on timing.
"""

from __future__ import annotations

import itertools
import os
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.core.evidence import CacheKind, CacheResetEvidence, PauseMode, UpdateTarget
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.process import ManagedEngine, free_port, vllm_available
from rolloutcore.engine.wire import Generation, prefix_cache_delta
from rolloutcore.errors import (
    BadInput,
    EffectTimeout,
    EngineUnavailable,
    EngineUnreachable,
    UpdateFailed,
)
from rolloutcore.testing.models import VOCAB_SIZE
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import EMPTY_SHA256, compare_checksums

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

FUSED = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
LONG = 460  # output tokens of a "long" request (prompt 40, max_model_len 512)


@pytest.fixture(scope="module")
def engine(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[ManagedEngine]:
    """This module's server, on checkpoint A, with the gloo weight-transfer backend and
    the route guard (its key registered in this process: every client here sends it).

    Its steps are paced (``slowstep``: 4 ms of sleep in the worker per step),
    so that its API server keeps up and a pause sent while a request runs
    lands while it runs. Tests leave it resumed; only the last ones
    (transfers) change its weights.
    """
    import slowstep  # imports vLLM: only where the engine runs

    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    eng = engine_factory(tiny_models.A, extra_args=("--logits-processors", "slowstep:SlowStep"),
                         env={"PYTHONPATH": path, slowstep.ENV: "0.004"}, guard_routes=True)
    try:
        yield eng
    finally:
        engine_factory.stop(eng)


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(8) as p:
        yield p


@pytest.fixture()
def http(engine: ManagedEngine) -> Iterator[VllmHTTP]:
    h = VllmHTTP(engine.base_url, timeout_s=60.0)
    try:
        yield h
    finally:
        # Leave the shared engine serving, whatever a failed test left behind.
        try:
            if h.is_paused():
                h.resume()
        finally:
            h.close()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


def _freeze(http: VllmHTTP, pool: ThreadPoolExecutor,
            seed: int) -> tuple[list[Future[Generation]], CacheResetEvidence]:
    """Pause(keep) while requests hold KV blocks; proven by the engine refusing the reset.

    Four long generations are started; a moment later the engine is paused
    in place and asked for a prefix-cache reset, which says ``success:
    false`` exactly when blocks are held. If it succeeds (nothing ran yet),
    the engine is resumed and the same is tried a longer moment later, and a
    fresh batch is started once a batch has finished. Neither a metric nor
    an answer's arrival is trusted to say "running": in CI,
    ``vllm:num_requests_running`` read 0 while requests ran and pausing once
    it said otherwise missed 20 times in a row; and on an unpaced engine
    under load, ``/resume`` answered only after the whole batch had run.
    The engine is paced (see ``engine``): with two busy loops on the 2
    cores, every freeze of the module was caught at the first pause.
    """
    delays = [0.05 * 2 ** min(k, 5) for k in range(12)]  # 0.05 s .. 1.6 s
    tries = iter(delays)
    for batch in range(6):
        futs = [pool.submit(http.generate, _prompt(40, seed * 1000 + batch * 10 + k),
                            max_tokens=LONG, ignore_eos=True, logprobs=False)
                for k in range(4)]
        for delay in tries:
            time.sleep(delay)
            if all(f.done() for f in futs):
                break
            http.pause(PauseMode.KEEP)
            ev = http.reset_prefix_cache()
            if ev.engine_success is False:
                return futs, ev
            http.resume()
        else:
            break
        wait(futs, timeout=120)
    pytest.fail(f"no request was caught running ({len(delays)} tries, at most 6 batches)")


def _target(label: str, epoch: str = "e") -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (1,), "bfloat16")])
    return UpdateTarget(WeightVersion(1, label, epoch),
                        WeightIdentity.declare(m, Provenance("ckpt")), "test")


# --------------------------------------------------------------------------- reads


def test_capabilities_come_from_openapi(http: VllmHTTP, engine: ManagedEngine) -> None:
    caps = http.capabilities()
    for route in (Routes.PAUSE, Routes.RESUME, Routes.IS_PAUSED, Routes.RESET_PREFIX,
                  Routes.RESET_ENCODER, Routes.RESET_MM, Routes.WEIGHT_INFO,
                  Routes.WEIGHT_CHECKER, Routes.GENERATE, Routes.COMPLETIONS, Routes.METRICS):
        assert route in caps
    assert "/nonexistent" not in caps
    assert http.version() == "0.32.0"
    assert http.health() is True
    assert http.model() == engine.model_name
    assert http.weight_info().label_supported


def test_bootstrap_describes_the_engine(engine: ManagedEngine) -> None:
    with VllmAdapter.for_engine(engine) as a0:
        ev = a0.bootstrap()
    assert ev.healthy and not ev.problems(None)
    assert ev.engine_epoch == engine.epoch
    assert ev.label_supported and ev.observed_label is not None
    assert ev.engine_info["vllm_version"] == "0.32.0"
    assert ev.engine_info["model"] == engine.model_name
    assert ev.engine_info["weight_transfer_config"]["backend"] == "rolloutcore_gloo"
    assert Routes.GENERATE in ev.capabilities
    assert ev.unverified == ()
    # Without a launcher epoch the adapter takes the engine's own per-start id.
    with VllmAdapter(VllmHTTP(engine.base_url)) as a1, \
            VllmAdapter(VllmHTTP(engine.base_url)) as a2:
        e1, e2 = a1.bootstrap(), a2.bootstrap()
    assert e1.engine_epoch == e2.engine_epoch == f"vllm-{e1.engine_info['instance_id']}"
    assert a1.caches == tuple(CacheKind)


def test_generate_returns_tokens_logprobs_and_version_spans(http: VllmHTTP) -> None:
    prompt = _prompt(20, 1)
    g = http.generate(prompt, max_tokens=12)
    assert len(g.token_ids) == 12 and g.logprobs is not None and len(g.logprobs) == 12
    assert all(lp <= 0.0 for lp in g.logprobs)
    assert g.finish_reason == "length"
    assert g.weight_versions is not None
    spans = g.weight_versions
    assert spans[0].start == 0 and spans[-1].end == 12
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    assert g.versions() == {http.label()}
    # Greedy decoding is deterministic, and /v1/completions agrees with it.
    assert http.generate(prompt, max_tokens=12).token_ids == g.token_ids
    c = http.complete(prompt, max_tokens=12)
    assert c.token_ids == g.token_ids
    assert c.logprobs is not None
    assert [round(x or 0.0, 4) for x in c.logprobs] == [round(x, 4) for x in g.logprobs]


def test_score_agrees_with_the_sampled_logprobs(http: VllmHTTP) -> None:
    prompt = _prompt(30, 2)
    g = http.generate(prompt, max_tokens=8)
    assert g.logprobs is not None
    scored = http.score(prompt + list(g.token_ids))
    assert len(scored) == len(prompt) + 8 and scored[0] is None
    tail = scored[len(prompt):]
    assert all(x is not None for x in tail)
    assert max(abs((x or 0.0) - y) for x, y in zip(tail, g.logprobs, strict=True)) < 0.05


def test_bad_requests_are_bad_input_and_change_nothing(http: VllmHTTP) -> None:
    with pytest.raises(BadInput, match="HTTP 400"):
        http.generate([1, 2, VOCAB_SIZE + 5], max_tokens=2)
    with pytest.raises(BadInput):
        http.generate([], max_tokens=2)
    assert http.health()


def test_unreachable_engine_is_engine_unavailable() -> None:
    with VllmHTTP(f"http://127.0.0.1:{free_port()}", timeout_s=5) as h:
        with pytest.raises(EngineUnreachable) as ei:
            h.pause(PauseMode.WAIT)
        assert isinstance(ei.value, EngineUnavailable)
        assert isinstance(ei.value.__cause__, httpx.ConnectError)
        # The drain step moves no weights: its failure says so.
        with pytest.raises(EngineUnreachable) as ei:
            VllmAdapter(h).drain(PauseMode.WAIT)
        assert ei.value.mutation_started is False


# --------------------------------------------------------------------------- pause


def test_pause_keep_freezes_and_prefix_reset_reports_failure(
        http: VllmHTTP, pool: ThreadPoolExecutor) -> None:
    futs, ev = _freeze(http, pool, seed=1)
    # The engine refused the reset over HTTP 200; the evidence says so.
    assert ev.http_status == 200 and ev.engine_success is False
    assert any("success=false" in p for p in ev.problems(None))
    assert http.is_paused() is True
    # The other two resets answer an empty 200 whatever happened: no flag, stated.
    for ev2 in (http.reset_encoder_cache(), http.reset_mm_cache()):
        assert ev2.http_status == 200 and ev2.engine_success is None
        assert not ev2.problems(None)
        assert ev2.unverified and "no success flag" in ev2.unverified[0]
    wait(futs, timeout=0.5)
    assert not all(f.done() for f in futs), "a request frozen in place cannot finish"
    http.resume()
    for f in futs:
        g = f.result(60)
        assert g.finish_reason == "length" and len(g.token_ids) == LONG
    assert http.reset_prefix_cache().engine_success is True


def test_pause_wait_drains_the_engine(http: VllmHTTP, pool: ThreadPoolExecutor) -> None:
    futs, _ = _freeze(http, pool, seed=2)
    # Switching to wait lets the frozen requests run to completion before it
    # returns: afterwards no block is held, so the same reset now succeeds.
    http.pause(PauseMode.WAIT)
    assert http.is_paused() is True
    assert http.reset_prefix_cache().engine_success is True
    http.resume()
    assert http.is_paused() is False
    for f in futs:
        g = f.result(60)
        assert g.finish_reason == "length" and len(g.token_ids) == LONG


def test_reset_running_requests_makes_the_reset_succeed(
        http: VllmHTTP, pool: ThreadPoolExecutor) -> None:
    futs, _ = _freeze(http, pool, seed=3)
    ev = http.reset_prefix_cache(reset_running_requests=True)
    assert ev.http_status == 200 and ev.engine_success is True and not ev.problems(None)
    http.resume()
    # The preempted requests recompute their KV and still complete.
    for f in futs:
        g = f.result(60)
        assert g.finish_reason == "length" and len(g.token_ids) == LONG


def test_pause_abort_aborts_in_flight(http: VllmHTTP, pool: ThreadPoolExecutor) -> None:
    futs, _ = _freeze(http, pool, seed=4)  # frozen first: the abort cannot race completion
    http.pause(PauseMode.ABORT)
    gens = [f.result(30) for f in futs]
    aborted = [g for g in gens if g.finish_reason == "abort"]
    assert aborted and all(len(g.token_ids) < LONG for g in aborted)
    assert http.is_paused() is True
    assert http.reset_prefix_cache().engine_success is True
    http.resume()
    assert http.is_paused() is False


def test_requests_arriving_while_paused_are_held(http: VllmHTTP) -> None:
    http.pause(PauseMode.WAIT)
    got: dict[str, object] = {}
    th = threading.Thread(target=lambda: got.setdefault(
        "g", http.generate(_prompt(10, 3), max_tokens=4)))
    th.start()
    th.join(1.0)
    assert th.is_alive() and "g" not in got
    http.resume()
    th.join(30)
    assert "g" in got


def test_timeout_and_cancel_unblock_a_held_call(http: VllmHTTP) -> None:
    http.pause(PauseMode.WAIT)
    try:
        t0 = time.monotonic()
        with pytest.raises(EffectTimeout) as ei:
            http.generate(_prompt(10, 4), max_tokens=4, timeout_s=0.5)
        assert ei.value.deadline_s == 0.5 and time.monotonic() - t0 < 5
        # cancel_inflight() from another thread makes a call held by the engine return.
        err: list[BaseException] = []

        def held() -> None:
            try:
                http.generate(_prompt(10, 5), max_tokens=4, timeout_s=60)
            except BaseException as exc:
                err.append(exc)

        th = threading.Thread(target=held)
        th.start()
        th.join(0.5)
        assert th.is_alive()
        t1 = time.monotonic()
        assert http.cancel_inflight() >= 1
        th.join(5)
        assert not th.is_alive() and time.monotonic() - t1 < 5
        assert isinstance(err[0], EffectTimeout)
    finally:
        http.resume()
    assert http.generate(_prompt(10, 6), max_tokens=2).token_ids  # client still usable


# --------------------------------------------------------------------------- caches


def test_prefix_cache_hits_and_reset_from_metric_deltas(
        http: VllmHTTP, engine: ManagedEngine) -> None:
    block = int(http.server_info()["vllm_config"]["cache_config"]["block_size"])
    prompt = _prompt(300, 99)
    want = (len(prompt) - 1) // block * block
    assert want > 0

    def hits() -> tuple[float, float]:
        m0 = http.metrics()
        http.generate(prompt, max_tokens=4)
        d = prefix_cache_delta(m0, http.metrics())
        return d.queries, d.hits

    assert http.reset_prefix_cache().engine_success is True
    assert hits() == (len(prompt), 0)          # first sight of the prompt
    assert hits() == (len(prompt), want)       # repeated: whole blocks hit
    ev = http.reset_prefix_cache()
    assert ev.http_status == 200 and ev.engine_success is True
    assert hits() == (len(prompt), 0)          # after the reset: nothing left to hit
    assert hits() == (len(prompt), want)


# --------------------------------------------------------------------------- checksums


def test_weight_checker_coverage_counts_zero_byte_hashes_as_unverifiable(
        http: VllmHTTP) -> None:
    cs = http.weight_checksums()
    assert cs.total > 0
    assert all(k.startswith("dp0:pp0:") for k in cs.raw_keys.values())
    fused = {n for n in cs.digests if any(f in n for f in FUSED)}
    # Repacked (zero bytes hashed) where the CPU backend's GEMM path packs them (oneDNN /
    # AVX-512 hosts); kept and hashed for real elsewhere. Never counted as a match either way.
    assert fused and cs.unverifiable in (fused, set())
    assert "model.embed_tokens.weight" in cs.hashable
    assert 0 < cs.coverage <= 1 and (cs.coverage < 1) == bool(cs.unverifiable)

    same = compare_checksums(cs, cs.digests)  # the reference even says "e3b0..."
    assert same.passed
    assert set(same.unverifiable) == cs.unverifiable
    assert not set(same.matched) & cs.unverifiable
    assert same.coverage == pytest.approx(len(cs.hashable) / cs.total)

    wrong = dict(cs.digests)
    wrong["model.norm.weight"] = "0" * 64
    bad = compare_checksums(cs, wrong)
    assert not bad.passed and bad.mismatched == ("model.norm.weight",)
    assert not compare_checksums(cs, {"model.not_there": "0" * 64}).passed
    # A reference of fused layers only (all "zero bytes") verifies nothing: where the engine
    # hashes them too nothing is compared; where it hashes them for real, nothing matches.
    only_fused = compare_checksums(cs, {n: EMPTY_SHA256 for n in fused})
    assert not only_fused.passed and not only_fused.matched
    if cs.unverifiable:
        assert only_fused.compared == 0


# --------------------------------------------------------------------------- adapter


def test_adapter_drain_validate_resume(engine: ManagedEngine) -> None:
    with VllmAdapter.for_engine(engine) as a:
        boot = a.bootstrap()
        label = boot.observed_label
        assert label is not None
        d = a.drain(PauseMode.WAIT)
        assert d.paused and not d.problems(None)
        assert a.drain(PauseMode.KEEP).problems(None)  # strict mode refuses keep
        src = WeightSource.from_checkpoint(engine.model_dir)
        cs = a.http.weight_checksums()
        target = UpdateTarget(WeightVersion(1, label, boot.engine_epoch),
                              WeightIdentity.declare(src.manifest(), Provenance("A")), "t")

        # Preflight with nothing staged refuses before any mutation.
        assert a.preflight(target).problems(target)
        a.stage(src, provenance=Provenance("A"), reference_checksums=cs.digests)
        pf = a.preflight(target)
        assert pf.problems(target) == [] and pf.source_manifest_digest == src.manifest().digest
        other = UpdateTarget(target.version, WeightIdentity.declare(
            src.manifest(), Provenance("B")), "t")
        assert "provenance" in " ".join(a.preflight(other).problems(other))

        # The tiny Llama takes no multimodal input (its /server_info says so): the prefix
        # cache is reset, the encoder and multimodal caches are recorded as absent.
        for kind in a.caches:
            ev = a.reset_cache(kind)
            assert not ev.problems(target)
            if kind is CacheKind.PREFIX:
                assert ev.http_status == 200 and not ev.absent
            else:
                assert ev.http_status is None and "multimodal_config is null" in ev.absent

        v = a.validate(target, live=False)
        assert v is not None and v.paused is True and v.label_supported
        assert v.observed_label == label and v.problems(target) == []
        (chk,) = v.checks
        assert chk.passed and chk.coverage is not None and 0 < chk.coverage <= 1
        if chk.coverage < 1:  # a host whose CPU backend repacks the fused layers
            assert "unverifiable" in chk.detail
            assert any("zero bytes" in u for u in v.unverified)
        # A label the engine does not serve is caught.
        wrong = _target("rc-999")
        vw = a.validate(wrong, live=False)
        assert vw is not None and any("rc-999" in p for p in vw.problems(wrong))
        # A reference that disagrees fails the checksum check.
        bad = dict(cs.digests)
        bad["lm_head.weight"] = "1" * 64
        a.stage(src, reference_checksums=bad)
        vb = a.validate(target, live=False)
        assert vb is not None and any("engine_checksum" in p for p in vb.problems(target))
        assert a.validate(target, live=True) is None  # no probes configured

        r = a.resume()
        assert r.resumed and r.is_paused_after is False and not r.problems(target)


def test_adapter_fence_aborts_and_holds(engine: ManagedEngine, http: VllmHTTP,
                                        pool: ThreadPoolExecutor) -> None:
    futs, _ = _freeze(http, pool, seed=5)
    with VllmAdapter.for_engine(engine) as a:
        a.fence()
        assert any(f.result(30).finish_reason == "abort" for f in futs)
        assert http.is_paused() is True
    http.resume()


# --------------------------------------------------------------------------- transfers


def _identity(src: WeightSource, name: str) -> WeightIdentity:
    return WeightIdentity.declare(src.manifest(), Provenance(name), src.content_digest())


def test_runner_drives_hot_updates_through_the_adapter(
        engine: ManagedEngine, tiny_models: TinyModels, http: VllmHTTP) -> None:
    """A -> B -> A on one process through LifecycleRunner + VllmAdapter + gloo.

    The engine's own checksums of A, taken before anything moved, are the
    reference for the way back: the paused validation compares them, with
    the fused layers counted as unverifiable.
    """
    src_a = WeightSource.from_checkpoint(tiny_models.A)
    src_b = WeightSource.from_checkpoint(tiny_models.B)
    ref_a = http.weight_checksums().digests
    pid = engine.pid
    prompt = _prompt(300, 7)
    before = http.generate(prompt, max_tokens=8)

    with VllmAdapter.for_engine(engine, GlooTransport(op_timeout_s=30)) as a:
        ctl = LifecycleController()
        runner = LifecycleRunner(ctl, a)
        runner.bootstrap(_identity(src_a, "A"))
        assert a.transport is not None and a.transport.backend == "rolloutcore_gloo"

        a.stage(src_b, provenance=Provenance("B"))
        out = runner.run_update(_identity(src_b, "B"))
        assert out.published is not None and ctl.state is State.READY
        label_b = out.published.label
        assert http.label() == label_b and engine.pid == pid
        g = http.generate(prompt, max_tokens=8)
        assert g.versions() == {label_b}
        assert g.token_ids != before.token_ids
        # The prefix reset ran: the same 300-token prompt hits nothing the first time.
        m0 = http.metrics()
        a.http.generate(_prompt(300, 8), max_tokens=2)
        assert prefix_cache_delta(m0, http.metrics()).hits == 0

        a.stage(src_a, provenance=Provenance("A"), reference_checksums=ref_a)
        back = runner.run_update(_identity(src_a, "A"))
        assert back.published is not None and ctl.state is State.READY
        assert http.label() == back.published.label
        assert http.generate(prompt, max_tokens=8).token_ids == before.token_ids
        assert {"pause", "preflight", "transfer", "invalidate", "validate", "resume"} <= {
            p.phase for p in back.phases}
        assert http.is_paused() is False


def test_fast_pause_holds_a_request_that_reaches_the_engine_during_the_transfer(
        engine: ManagedEngine, tiny_models: TinyModels, http: VllmHTTP,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The adapter pauses this guarded engine through the guard's ``/rolloutcore/pause``
    (the engine core's own pause, without the fixed sleep of vLLM's ``/pause``), and the
    guarantee is the one vLLM's pause gives: a request sent straight to the engine while
    the weights move (through no admission at all) is held by the engine until the
    resume, and every token it gets is of the new weights: labelled with the published
    version, the same tokens as the same request after the publish."""
    def no_dev_pause(*_: object, **__: object) -> bool:
        raise AssertionError("a guarded engine is paused through /rolloutcore/pause")

    monkeypatch.setattr(VllmHTTP, "pause", no_dev_pause)
    src_a = WeightSource.from_checkpoint(tiny_models.A)
    src_b = WeightSource.from_checkpoint(tiny_models.B)
    prompt = _prompt(40, 11)
    got: dict[str, object] = {}

    class Racing(GlooTransport):
        def send(self, *a: object, **k: object) -> object:  # type: ignore[override]
            if "thread" in got:  # the way back to A: no race
                return super().send(*a, **k)  # type: ignore[arg-type]
            assert http.is_paused()
            th = threading.Thread(target=lambda: got.setdefault(
                "g", http.generate(prompt, max_tokens=12)))
            th.start()
            got["thread"] = th
            time.sleep(0.5)  # the request is at the engine before the weights move
            out = super().send(*a, **k)  # type: ignore[arg-type]
            got["held_through_transfer"] = th.is_alive()
            return out

    with VllmAdapter.for_engine(engine, Racing(op_timeout_s=30)) as a:
        runner = LifecycleRunner(LifecycleController(), a)
        label_a = http.label()
        runner.bootstrap(_identity(src_a, "A"))
        try:
            a.stage(src_b, provenance=Provenance("B"))
            out = runner.run_update(_identity(src_b, "B"))
            assert out.published is not None, out
            th = got["thread"]
            assert isinstance(th, threading.Thread)
            th.join(60)
            assert got["held_through_transfer"] is True
            g = got["g"]
            after = http.generate(prompt, max_tokens=12)
            assert g.versions() == {out.published.label} == after.versions()  # type: ignore[attr-defined]
            assert g.token_ids == after.token_ids  # type: ignore[attr-defined]
        finally:
            # Back to A for the module's later tests (through the same fast pause).
            a.stage(src_a, provenance=Provenance("A"))
            back = runner.run_update(_identity(src_a, "A"))
            assert back.published is not None and label_a is not None


def test_checksum_mismatch_taints_and_fences(engine: ManagedEngine, tiny_models: TinyModels,
                                             http: VllmHTTP) -> None:
    """B is sent while the reference says A: every endpoint succeeds, the checksums do not."""
    src_a = WeightSource.from_checkpoint(tiny_models.A)
    src_b = WeightSource.from_checkpoint(tiny_models.B)
    ref_a = http.weight_checksums().digests  # the engine serves A here (previous test)
    with VllmAdapter.for_engine(engine, GlooTransport(op_timeout_s=30)) as a:
        ctl = LifecycleController()
        runner = LifecycleRunner(ctl, a)
        runner.bootstrap(_identity(src_a, "A"))
        a.stage(src_b, provenance=Provenance("B"), reference_checksums=ref_a)
        with pytest.raises(UpdateFailed) as ei:
            runner.run_update(_identity(src_b, "B"))
        assert ei.value.phase == "validate" and ctl.state is State.TAINTED
        assert "engine_checksum" in ei.value.reason and "MISMATCH" in ei.value.reason
        assert http.is_paused() is True  # fenced: a tainted engine serves no one
