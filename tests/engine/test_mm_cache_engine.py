"""The encoder and multimodal cache boundary, on a real vision-language vLLM (CPU).

One engine, cold-started on B (a tiny Idefics3: ``rolloutcore.testing.vlm``),
so that its first answer about the test image is the cold reference of B and
its checksums are B's cold-loaded reference. A and B share every text weight
and differ only in the vision tower and connector: any difference in their
answers about the same image comes through the image embedding.

* negative control (outside RolloutCore, encoder and multimodal resets
  skipped, the prefix cache reset): the engine reuses the old policy's
  embedding (its own log shows no encoder run for the request; /metrics
  shows a processor-cache hit) and answers exactly as the old policy, not
  as a cold engine on the new weights;
* through RolloutCore: the encoder runs, no processor-cache hit, and the
  answer is bit-identical (greedy tokens and logprobs) to the cold engine;
* the transports carry the vision tower: after A -> B every vision
  parameter the engine can hash matches B's cold-loaded reference;
* every RolloutCore update is validated by text and image probes
  (``verification.image_probe``); an encoder reset that silently does
  nothing (an empty 200, what vLLM answers whatever happened) leaves the
  probe images' old embeddings in the cache, and the image probe catches
  it: TAINTED, nothing published;
* the gateway (its own process) takes images on chat and generate, binds
  them like any rollout, answers as the engine does, records each image's
  digest in the trajectory and refuses a malformed image before admission;
* a cache reset that reports failure is handled like a failed prefix reset:
  once, retried and published (and still no stale embedding); always, the
  update fails closed (TAINTED, nothing admitted).

Encoder hits are read from vLLM's log (``--enable-logging-iteration-details``:
"encoder inputs: K" per scheduler step): vLLM 0.32 has no encoder-cache
counter in /metrics. The processor cache's counters are vLLM's
``vllm:mm_cache_{queries,hits}_total``.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, gateway_process
from rolloutcore.control.journal import read_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.engine.verify import take_reference, verify_engine
from rolloutcore.errors import AdmissionRefused, UpdateFailed
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.session import EngineSession
from rolloutcore.testing.faultproxy import Fault, FaultProxy
from rolloutcore.testing.mmcache import (
    ITERATION_LOG_FLAG,
    EncoderLog,
    ExperimentResult,
    Observation,
    make_image_png,
    mm_cache_experiment,
    observe,
    png_data_url,
)
from rolloutcore.testing.vlm import IMAGE_TOKEN_ID, is_vision_param, make_vlm_pair
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import EMPTY_SHA256, ReferenceChecksums
from rolloutcore.verification.image_probe import ProbeSuite, vlm_probe

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

IMAGE = png_data_url(make_image_png(7))
GW_TOKEN = "mm-engine-test-token-0123456789"


@dataclass
class Rig:
    engine: ManagedEngine
    session: EngineSession
    proxy: FaultProxy
    log: EncoderLog
    a: Path
    b: Path
    cold_b: ReferenceChecksums
    model: str
    probes: dict[str, ProbeSuite]
    step: int = 10

    def prov(self, name: str, step: int | None = None) -> Provenance:
        if step is None:
            self.step += 1
            step = self.step
        return Provenance(name, "mm-cache-test", step)

    def kwargs(self, name: str) -> dict[str, Any]:
        kw: dict[str, Any] = {"probe": self.probes[name]}
        if name == "B":
            kw["reference_checksums"] = self.cold_b.checksums
        return kw

    def update(self, name: str) -> Any:
        ckpt = self.a if name == "A" else self.b
        return self.session.update(ckpt, self.prov(name), **self.kwargs(name))

    def ask(self) -> Observation:
        return observe(self.session.http, self.log, self.model, IMAGE)


@pytest.fixture(scope="module")
def vlm(engine_factory: EngineFactory, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[Path, Path, Path, ManagedEngine, ManagedEngine]]:
    """The VLM pair's root, A and B, and two engines cold-started on B at once: the
    module's, and one no test touches until the gateway test takes it."""
    root = tmp_path_factory.mktemp("vlm")
    a, b = make_vlm_pair(root)
    kw = {"extra_args": ["--enforce-eager", ITERATION_LOG_FLAG]}
    eng, fresh = engine_factory.together((b, kw), (b, kw))
    try:
        yield root, a, b, eng, fresh
    finally:
        engine_factory.stop(fresh)
        engine_factory.stop(eng)


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory,
        vlm: tuple[Path, Path, Path, ManagedEngine, ManagedEngine]) -> Iterator[Rig]:
    root, a, b, eng, _ = vlm
    probes = {"A": vlm_probe(a), "B": vlm_probe(b)}
    proxy = FaultProxy(eng.base_url).start()
    s = EngineSession(VllmHTTP(proxy.base_url, timeout_s=120.0), GlooTransport(op_timeout_s=60),
                      engine=eng, journal_path=root / "journal.jsonl")
    try:
        # Nothing has touched this engine yet: what it holds is vLLM's cold load of B.
        cold_b = take_reference(
            s.http, WeightSource.from_checkpoint(b).content_digest(), origin="cold-load",
            source=str(b))
        s.bootstrap(b, Provenance("B", "mm-cache-test", 0))
        r = Rig(eng, s, proxy, EncoderLog(eng.log_path), a, b, cold_b, s.http.model(), probes)
        yield r
        r.session.journal.close()
    finally:
        try:
            s.transport.close()
            s.http.close()
            s.journal.close()
            proxy.stop()
        finally:
            engine_factory.stop(eng)


@pytest.fixture(scope="module")
def experiment(rig: Rig) -> ExperimentResult:
    """The whole measurement, once: its first request is B's cold answer about the image."""
    return mm_cache_experiment(rig.session, rig.log, rig.a, rig.b, IMAGE,
                               provenance=rig.prov, update_kwargs=rig.kwargs)


@pytest.fixture(scope="module")
def cold(experiment: ExperimentResult) -> Observation:
    return experiment.cold


def test_stale_embedding_without_the_reset_and_none_through_rolloutcore(
        experiment: ExperimentResult, capsys: pytest.CaptureFixture[str]) -> None:
    res = experiment
    s = res.summary()
    # The cache is real: the same image again skips the encoder.
    assert res.cold.encoder_inputs == 1 and res.warm.encoder_hits == 1
    assert res.warm.answer == res.cold.answer
    # The control has power: A and B answer differently about the image.
    assert s["policies_differ_on_the_image"]
    # A RolloutCore update (B -> A) ran the encoder afresh.
    assert res.after_rc_to_a.encoder_inputs == 1 and res.after_rc_to_a.mm_hits == 0
    # Negative control: B's weights, the old (A) embedding served, A's answer.
    assert res.negative_control.encoder_hits == 1, "negative control: no stale encoder hit"
    assert res.negative_control.mm_hits == 1
    assert res.negative_control.answer == res.after_rc_to_a.answer
    assert s["tokens_differ_negative_control"], "the stale embedding must change the tokens"
    # Through RolloutCore (A -> B): no reuse, bit-identical to the cold engine on B.
    assert res.rc_to_b.encoder_inputs == 1 and res.rc_to_b.encoder_hits == 0
    assert res.rc_to_b.mm_queries == 1 and res.rc_to_b.mm_hits == 0
    assert res.rc_to_b.answer.token_ids == res.cold.answer.token_ids
    assert res.rc_to_b.answer.logprobs == res.cold.answer.logprobs
    assert s["identical_to_cold"]
    assert {r["cache"] for r in res.reset_evidence} == {"prefix", "encoder", "multimodal"}
    with capsys.disabled():
        print(f"\nmm cache: {s}\nphases (ms): "
              + ", ".join(f"{k}={v * 1000:.1f}" for k, v in res.phases_s.items()))


def test_the_vision_tower_travels_and_checksums_cover_it(
        rig: Rig, cold: Observation, capsys: pytest.CaptureFixture[str]) -> None:
    s = rig.session
    rig.update("A")
    cs = s.http.weight_checksums()
    on_a = {cs.raw_keys[n]: d for n, d in cs.digests.items()}
    res = rig.update("B")
    assert res.identity.verification is VerificationLevel.PROBE
    assert any(e.startswith("engine_checksum=pass") for e in res.identity.evidence)
    report = verify_engine(s.http, rig.cold_b)
    assert report.passed and not report.missing_in_engine and not report.missing_in_reference
    names = {k: k.rsplit(":", 1)[1] for k in rig.cold_b.checksums}
    vision = {k for k, n in names.items() if is_vision_param(n)}
    hashable = {k for k in vision if rig.cold_b.checksums[k] != EMPTY_SHA256}
    assert vision and hashable
    assert hashable <= set(report.matched)
    # Every hashable vision parameter held A's bytes before and B's after: it travelled.
    assert all(on_a[k] != rig.cold_b.checksums[k] for k in hashable)
    text = {k for k in names if k not in vision and rig.cold_b.checksums[k] != EMPTY_SHA256}
    assert all(on_a[k] == rig.cold_b.checksums[k] for k in text)  # A and B share them
    sent = {n for n, _ in WeightSource.from_checkpoint(rig.b).named_tensors()}
    assert rig.ask().answer == cold.answer
    with capsys.disabled():
        print(f"\nvision params: sent {sum(map(is_vision_param, sent))} of {len(sent)} "
              f"tensors; engine {len(vision)} of {len(names)} params, hashable "
              f"{len(hashable)}, matched {len(hashable & set(report.matched))}; "
              f"overall coverage {report.coverage:.3f}")


def test_images_through_the_gateway_are_bound_recorded_and_checked(
        rig: Rig, cold: Observation, engine_factory: EngineFactory, tmp_path: Path,
        vlm: tuple[Path, Path, Path, ManagedEngine, ManagedEngine]) -> None:
    """The gateway (own process) in front of a VLM engine: chat and generate with images.

    Its own engine, cold on B: the module's engine was updated by the session, and a
    gateway without that journal may not adopt an updated engine (#47 symptom 2; the CPU
    engine cannot hash its fused layers, so checksums cannot cover every parameter).
    B's cold-load checksums are still given, as content evidence the fresh engine passes."""
    token_file = tmp_path / "token"
    token_file.write_text(GW_TOKEN + "\n")
    traj, journal = tmp_path / "traj.jsonl", tmp_path / "journal.jsonl"
    ref = tmp_path / "b.checksums.json"
    ref.write_text(json.dumps(rig.cold_b.to_dict()))
    png = make_image_png(7)
    fresh = vlm[4]  # started with the module's engine, untouched until now
    try:
        _images_through(fresh, rig, cold, token_file, traj, journal, ref, png, tmp_path)
    finally:
        engine_factory.stop(fresh)


def _images_through(fresh: ManagedEngine, rig: Rig, cold: Observation, token_file: Path,
                    traj: Path, journal: Path, ref: Path, png: bytes, tmp_path: Path) -> None:
    with gateway_process(fresh.base_url, rig.b, token_file, tmp_path / "gw.log",
                         ["--journal", str(journal), "--trajectories", str(traj),
                          "--takeover-checksums", str(ref)]) as (url, _):
        with httpx.Client(base_url=url, timeout=120) as c:
            chat = c.post("/v1/chat/completions", json={
                "model": rig.model, "max_tokens": 8, "temperature": 0, "logprobs": True,
                "return_token_ids": True, "messages": [{"role": "user", "content": [
                    {"type": "text", "text": "what is this?"},
                    {"type": "image_url", "image_url": {"url": IMAGE}}]}]})
            assert chat.status_code == 200, chat.text
            assert chat.headers["x-rolloutcore-version"] == chat.json()["rolloutcore"]["version"]
            # The gateway forwards the image untouched: the engine's answer, as if direct.
            assert tuple(chat.json()["choices"][0]["token_ids"]) == cold.answer.token_ids
            ids = [ord(ch) for ch in "user: "] + [IMAGE_TOKEN_ID] + [ord(ch) for ch in "hi"]
            gen = c.post("/inference/v1/generate", headers={
                "x-rolloutcore-run": "mm", "x-rolloutcore-step": "0",
                "x-rolloutcore-prompt-index": "0"}, json={
                "model": rig.model, "token_ids": ids,
                "content_parts": [{"type": "image_url", "url": IMAGE}],
                "sampling_params": {"max_tokens": 4, "temperature": 0, "logprobs": 0}})
            assert gen.status_code == 200, gen.text
            label = gen.json()["rolloutcore"]["version"]
            direct = VllmHTTP(fresh.base_url)
            try:
                engine_label = direct.label()
            finally:
                direct.close()
            assert {sp["version"] for sp in gen.json()["choices"][0]["weight_versions"]} == {
                engine_label}
            bad = c.post("/v1/chat/completions", json={
                "model": rig.model, "max_tokens": 2, "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": png_data_url(b"GIF89a")}}]}]})
            assert bad.status_code == 400 and "malformed image/gif" in bad.text
        deadline = time.monotonic() + 30
        while not traj.exists() or not list(read_groups(traj)):
            assert time.monotonic() < deadline, "the generate request was not recorded"
            time.sleep(0.1)
    (group,) = list(read_groups(traj))
    (sample,) = group.samples
    (media,) = sample.prompt.media
    assert media.digest == hashlib.sha256(png).hexdigest() and media.mime == "image/png"
    assert sample.binding.version.label == label and sample.schema_version == 2
    admits = [r for r in read_journal(journal, live=True) if r.kind == "admit"]
    assert len(admits) == 2  # chat and generate; the bad image was never admitted


def test_an_encoder_reset_that_fails_once_is_retried_and_leaves_nothing_stale(
        rig: Rig, cold: Observation) -> None:
    rig.update("A")
    assert rig.ask().encoder_inputs == 1  # A's embedding of the image is cached now
    rig.proxy.reset()
    rig.proxy.inject("/reset_encoder_cache", Fault.engine_failure(), times=1)
    n0 = len(rig.session.journal.records)
    res = rig.update("B")
    hits = rig.proxy.hits
    rig.proxy.reset()
    assert hits and res.version is not None and rig.session.controller.state is State.READY
    failed = [r for r in rig.session.journal.records[n0:] if r.kind == "evidence"
              and r.data.get("event") == "invalidated"
              and r.data["evidence"]["cache"] == "encoder"]
    assert [r.data["evidence"]["engine_success"] for r in failed][:1] == [False]
    obs = rig.ask()
    assert obs.encoder_inputs == 1 and obs.answer == cold.answer


def test_a_silent_encoder_reset_is_caught_by_the_image_probe(rig: Rig) -> None:
    """Leaves the controller TAINTED (the next test takes over with a new one)."""
    rig.update("A")  # its live validation ran the probe images: A's embeddings are cached
    c = rig.session.controller
    before = c.published
    rig.proxy.reset()
    rig.proxy.inject("/reset_encoder_cache", Fault.swallow())
    try:
        with pytest.raises(UpdateFailed) as ei:
            rig.update("B")
    finally:
        swallowed = len(rig.proxy.hits)
        rig.proxy.reset()
    assert swallowed >= 1
    assert ei.value.classification == "ambiguous"
    assert c.state is State.TAINTED and c.published == before
    text, image = rig.probes["B"].last
    assert text.passed, "the text path is B's: only the image path can tell"
    assert not image.passed and image.max_abs_diff is not None
    assert image.tolerance is not None and image.max_abs_diff > 10 * image.tolerance
    with pytest.raises(AdmissionRefused):
        c.admit("after-silent-reset")


def test_an_mm_reset_that_always_fails_fails_closed(rig: Rig) -> None:
    """Last in the module: it leaves the controller TAINTED."""
    # A new controller takes over the engine after the previous test's taint.
    old = rig.session
    rig.session = EngineSession(old.http, old.transport, engine=rig.engine,
                                journal_path=Path(str(old.journal.path) + ".2"))
    # Declared, not taken over: the engine is still fenced (paused) by that taint, which
    # the verified takeover refuses; the test only needs a controller over it.
    rig.session.bootstrap(rig.b, Provenance("B", "mm-cache-test", 99), probe=False)
    rig.update("A")
    rig.proxy.reset()
    rig.proxy.inject("/reset_mm_cache", Fault.engine_failure())
    try:
        with pytest.raises(UpdateFailed) as ei:
            rig.update("B")
    finally:
        hits = len(rig.proxy.hits)
        rig.proxy.reset()
    assert hits >= 2  # retried before giving up
    c = rig.session.controller
    assert ei.value.classification == "ambiguous" and c.state is State.TAINTED
    with pytest.raises(AdmissionRefused):
        c.admit("after-mm-reset-failure")
