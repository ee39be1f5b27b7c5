"""Recoverers without a vLLM: bad input, and recoveries that fail and are classified.

A recovery that cannot happen (no operator signal, an unreachable engine, an
engine that is not a new incarnation, a recovery that overruns its deadline)
must leave the controller TAINTED within its deadline, with a journal the
invariant checker accepts. Real replacements of a real engine are in
tests/engine/test_faults_engine.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from coretools import drive_to
from helpers.needs import installed
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import Deadlines, LifecycleRunner
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.lifecycle import State
from rolloutcore.core.versions import ParameterManifest, Provenance, WeightIdentity, WeightVersion
from rolloutcore.engine.process import free_port
from rolloutcore.engine.recovery import ManagedRecoverer, OperatorRecoverer
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, UpdateFailed
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.testing.fake_vllm import FakeVllm
from rolloutcore.testing.models import make_checkpoint
from rolloutcore.transports.source import WeightSource

pytest.importorskip("torch")
installed("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("rec") / "A", 1)


def tainted(recover_s: float = 5.0) -> tuple[LifecycleController, LifecycleRunner, Journal]:
    j = Journal()
    c, _ = drive_to(State.TAINTED, j)
    r = LifecycleRunner(c, FakeAdapter(FakeEngine(FakeWeights.from_seed(0))),
                        Deadlines(recover_s=recover_s, cancel_grace_s=1.0), record=j.write)
    return c, r, j


def test_bad_input(ckpt: Path, tmp_path: Path) -> None:
    with pytest.raises(BadInput, match="ManagedEngine"):
        ManagedRecoverer("not an engine", ckpt)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match=r"config\.json"):
        OperatorRecoverer("http://127.0.0.1:1", tmp_path, signal=tmp_path / "go", wait_s=1)
    with pytest.raises(BadInput, match="URL"):
        OperatorRecoverer("127.0.0.1:1", ckpt, signal=tmp_path / "go", wait_s=1)
    with pytest.raises(BadInput, match="wait_s"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=tmp_path / "go", wait_s=0)
    with pytest.raises(BadInput, match="signal"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal="", wait_s=1)
    other = WeightIdentity.declare(ParameterManifest.from_items([("w", (1,), "bfloat16")]),
                                   Provenance("x"))
    with pytest.raises(BadInput, match="manifest"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=tmp_path / "go", wait_s=1,
                          identity=other)
    with pytest.raises(BadInput, match="reference"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=tmp_path / "go", wait_s=1,
                          reference={})
    rec = OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=tmp_path / "go", wait_s=1,
                            probe=False)
    src = WeightSource.from_checkpoint(ckpt)
    assert rec.identity.manifest_digest == src.manifest().digest
    assert rec.identity.content_digest == src.content_digest()
    with pytest.raises(BadInput):
        rec.replace_engine("rc-1")  # type: ignore[arg-type]


def test_no_operator_signal_is_a_failed_recovery_within_its_deadline(
        ckpt: Path, tmp_path: Path) -> None:
    c, r, j = tainted()
    committed = c.committed
    rec = OperatorRecoverer(f"http://127.0.0.1:{free_port()}", ckpt, signal=tmp_path / "go",
                            wait_s=0.2, poll_s=0.05, probe=False)
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed) as ei:
        r.recover(rec)
    assert time.monotonic() - t0 < 0.2 + 1.0
    assert ei.value.phase == "recover" and ei.value.classification == "ambiguous"
    assert c.state is State.TAINTED and c.committed == committed
    assert "deadline" in ei.value.reason
    assert check_journal(j.records) == []


def test_signal_without_a_reachable_engine_fails_and_consumes_the_signal(
        ckpt: Path, tmp_path: Path) -> None:
    c, r, j = tainted()
    sig = tmp_path / "replaced"
    sig.write_text("new engine is up")
    rec = OperatorRecoverer(f"http://127.0.0.1:{free_port()}", ckpt, signal=sig, wait_s=2,
                            poll_s=0.05, health_s=0.2, probe=False)
    with pytest.raises(UpdateFailed):
        r.recover(rec)
    assert not sig.exists()  # one signal, one recovery attempt
    assert c.state is State.TAINTED
    assert rec.last is not None and rec.last.wait_s < 1.0
    assert check_journal(j.records) == []


def test_watchdog_cancels_a_recovery_that_overruns(ckpt: Path, tmp_path: Path) -> None:
    c, r, j = tainted(recover_s=0.2)
    calls: list[float] = []

    def never() -> bool:
        calls.append(time.monotonic())
        return False

    rec = OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=never, wait_s=60, poll_s=0.05,
                            probe=False)
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed):
        r.recover(rec)
    assert time.monotonic() - t0 < 0.2 + 1.0 + 0.5
    n = len(calls)
    time.sleep(0.2)                 # four polls' worth
    assert len(calls) <= n + 1  # the cancelled wait stopped polling
    assert c.state is State.TAINTED and check_journal(j.records) == []


def fake_vllm(instance_id: str, label: str | None = None) -> FakeVllm:
    """The one fake of vLLM as the replaced (or not) engine: ``instance_id`` its
    incarnation, ``label`` its weight version (None: vLLM 0.26, no label routes and no
    ``/weight_checker``)."""
    eng = FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0)
    eng.epoch = instance_id
    if label is None:
        return FakeVllm(eng, without=(Routes.WEIGHT_INFO, Routes.UPDATE_WEIGHT_VERSION,
                                      Routes.WEIGHT_CHECKER))
    eng.label = label
    return FakeVllm(eng)


@pytest.fixture()
def not_replaced() -> tuple[FakeVllm, str]:
    return fake_vllm("abc", "default"), "http://replaced-engine"


def test_an_engine_that_was_not_replaced_is_refused(
        ckpt: Path, not_replaced: tuple[FakeVllm, str]) -> None:
    srv, url = not_replaced
    flag = threading.Event()
    flag.set()
    rec = OperatorRecoverer(url, ckpt, signal=flag.is_set, wait_s=2, previous_epoch="vllm-abc",
                            probe=False, transport=srv.transport())
    c, r, j = tainted()
    with pytest.raises(UpdateFailed, match="not replaced"):
        r.recover(rec)
    srv.engine.epoch, srv.engine.label = "def", "rc-7"  # a new incarnation, updated since
    with pytest.raises(UpdateFailed, match="rc-7"):
        r.recover(rec)
    assert c.state is State.TAINTED and check_journal(j.records) == []
    assert c.recovery_target() == WeightVersion(2, "rc-2", "e0")


REFERENCE = {"model.embed_tokens.weight": "11", "model.norm.weight": "22"}


@pytest.mark.parametrize("reader, want", [
    (None, "no evidence at all"),
    (lambda url: dict(REFERENCE), None),
    (lambda url: {**REFERENCE, "model.norm.weight": "23"}, "engine_checksum failed"),
    (lambda url: {"model.embed_tokens.weight": "11"}, "engine_checksum failed"),
    (lambda url: {}, "could not read"),
    (lambda url: (_ for _ in ()).throw(ConnectionError("cut")), "could not read"),
])
def test_a_replacement_without_version_labels_needs_its_checksums(
        ckpt: Path, reader: object, want: str | None) -> None:
    """The H200 finding (2026-12-03): on vLLM 0.26 a recovery without a probe or
    checksums has no evidence at all, and is refused (three times, then the fleet
    removed the replica). The workers' own checksums against a cold engine's are
    evidence; a wrong, partial or failed reading is not."""
    srv = fake_vllm("new-incarnation")
    flag = threading.Event()
    flag.set()
    c, r, j = tainted()
    committed = c.committed
    url = "http://replacement-engine"
    seen: list[str] = []

    def read(u: str) -> object:
        seen.append(u)
        return reader(u)  # type: ignore[operator]

    rec = OperatorRecoverer(url, ckpt, signal=flag.is_set, wait_s=2,
                            previous_epoch="vllm-old", probe=False,
                            reference=None if reader is None else REFERENCE,
                            read_checksums=None if reader is None else read,  # type: ignore[arg-type]
                            transport=srv.transport())
    if want is None:
        r.recover(rec)
        assert c.state is State.READY and seen == [url]
        assert c.committed is not None and c.committed != committed
    else:
        with pytest.raises(UpdateFailed, match=want):
            r.recover(rec)
        assert c.state is State.TAINTED and c.committed == committed
    assert check_journal(j.records) == []


def test_read_checksums_needs_a_reference_taken_the_same_way(ckpt: Path) -> None:
    with pytest.raises(BadInput, match="read_checksums"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=lambda: True, wait_s=1,
                          probe=False, read_checksums=lambda url: {})
    with pytest.raises(BadInput, match="read_checksums"):
        OperatorRecoverer("http://127.0.0.1:1", ckpt, signal=lambda: True, wait_s=1,
                          probe=False, reference=REFERENCE,
                          read_checksums="not callable")  # type: ignore[arg-type]
