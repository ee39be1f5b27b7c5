"""The H200 harness's service-path phase, run on the CPU (fake engine), and the gateway's
comparison of a transport's checksum of what it sent.

``diagnostics/gpu/h200_8b_ipc.py`` times the hot transition through a gateway
and ``RolloutCoreClient`` over rc_cuda_ipc on the H200 (``service_phase``);
here the same function drives a gateway over the fake engine, so its
structure (a gateway runner whose adapter holds no transport, the client's
expectations, bare cycles interleaved, the summary) is exercised before the
lead runs it on the device. ``compare_sent`` is the gateway side of the
rc_cuda_ipc comparison; the engine's answers are stood in by a mock transport.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.gateway_rig import TOKEN, make_parts, remote_transfer, serve_fake
from helpers.vllm_fake import vllm
from rolloutcore.core.evidence import PauseMode, TransferEvidence
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.sent import check_sent_scheme, compare_sent
from rolloutcore.errors import BadInput
from rolloutcore.service import ServiceConfig
from rolloutcore.service.client import RolloutCoreClient, _sent_checksum
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake import FakeAdapter, FakeWeights
from rolloutcore.transports.cuda_ipc.wire import names_digest

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200_8b_ipc.py"


def _load() -> Any:
    torch = pytest.importorskip("torch")
    assert torch is not None
    name = "rc_h200_8b_ipc_harness"
    spec = importlib.util.spec_from_file_location(name, HARNESS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


class _Transport:
    backend = "fake"

    def __init__(self, ad: FakeAdapter) -> None:
        self.ad = ad
        self.connects = 0

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        self.connects += 1

    def send(self, base_url: str, label: str, source: Any, *,
             timeout_s: float) -> TransferEvidence:
        return remote_transfer(self.ad, source, label)

    def close(self) -> None:
        pass


def test_the_service_phase_times_verified_gateway_updates_against_bare_cycles() -> None:
    h = _load()
    eng, ad, c, r, j, fake = make_parts()
    cfg = ServiceConfig(upstream_url=serve_fake(fake), control_token=TOKEN,
                        health_interval_s=0, transport={"backend": "fake"})
    tr = _Transport(ad)
    bare_calls: list[int] = []

    def prepare(seed: int) -> tuple[Any, ...]:
        w = FakeWeights.from_seed(seed, step=seed)
        return w, w.identity(), w.provenance, w.policy_probe(), "probe"

    def bare() -> float:
        bare_calls.append(1)
        return 0.01

    out = h.service_phase(
        r, cfg, lambda url: RolloutCoreClient(url, TOKEN, transport=tr,
                                              connected_to=cfg.upstream_url),
        prepare, itertools.cycle([1, 2]), 4, bare)
    assert out["reps"] == 4 and len(out["runs"]) == 4 and len(bare_calls) == 4
    assert out["verification"] == ["probe"]
    assert [x["published"]["label"] for x in out["runs"]] == ["rc-1", "rc-2", "rc-3", "rc-4"]
    assert out["service_s"] > 0 and out["service_over_bare"] == pytest.approx(
        out["service_s"] / 0.01)
    assert all(x["protocol_overhead_s"] <= x["service_s"] for x in out["runs"])
    assert tr.connects == 0  # connected_to: the handshake is not repeated
    # Then three untimed updates with generation clients on the gateway: the timed runs
    # above had none; every 503 a client saw is the gateway's own, none the engine's.
    assert c.committed is not None and c.committed.label == "rc-7"
    seen = out["clients_during_updates"]
    assert seen["pause_503_seen_by_clients"] == 0
    assert not [k for k in seen["statuses"] if "engine_paused" in k]
    assert sum(seen["statuses"].values()) >= 1


def _rpc_answer(values: list[int | None], names: list[str], uncovered: int = 0
                ) -> Callable[[httpx.Request], httpx.Response]:
    """``/collective_rpc`` as rc_cuda_ipc's checksum RPC answers it: each worker's hash."""
    def rpc(req: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(req.content)
        assert body["method"] == "rc_cuda_ipc_checksum"
        return httpx.Response(200, json={"results": [
            {"values": values, "names_digest": names_digest(names),
             "n_uncovered": uncovered}]})
    return rpc


def _rpc_engine(values: list[int | None], names: list[str], uncovered: int = 0
                ) -> VllmHTTP:
    """The one fake of vLLM answering the checksum RPC; it is sent nothing else."""
    fake = vllm(overrides={Routes.COLLECTIVE_RPC: _rpc_answer(values, names, uncovered)})
    fake.before = _only_rpc
    return VllmHTTP("http://e.test", transport=fake.transport())


def _only_rpc(req: httpx.Request) -> None:
    assert req.url.path == Routes.COLLECTIVE_RPC, req.url.path


def test_the_gateway_compares_what_was_sent_with_what_the_workers_hash() -> None:
    names = ["a", "b", "c"]
    sent = {"scheme": "rc_cuda_ipc/block", "names": names, "values": [1, 2, 3]}
    check_sent_scheme(sent)
    ok = compare_sent(_rpc_engine([1, 2, 3], names), sent)
    assert ok.passed and ok.coverage == 1.0 and ok.level is VerificationLevel.ENGINE_CHECKSUM
    bad = compare_sent(_rpc_engine([1, 9, 3], names), sent)
    assert not bad.passed and "mismatched=1" in bad.detail
    other = compare_sent(_rpc_engine([1, 2, 3], ["x"] * 3), sent)
    assert not other.passed and other.coverage == 0.0
    partial = compare_sent(_rpc_engine([1, 2, None], names), sent)
    assert not partial.passed
    short = compare_sent(_rpc_engine([1, 2, 3], names, 2), sent)
    assert not short.passed and "uncovered_params=2" in short.detail


@pytest.mark.parametrize("bad", [
    {"scheme": "md5", "names": ["a"], "values": [1]},
    {"scheme": "rc_cuda_ipc/block", "names": ["a", "a"], "values": [1, 2]},
    {"scheme": "rc_cuda_ipc/block", "names": ["a"], "values": [1, 2]},
    {"scheme": "rc_cuda_ipc/block", "names": ["a"], "values": [-1]},
    {"scheme": "rc_cuda_ipc/block", "names": [], "values": []},
    {"scheme": "rc_cuda_ipc/block", "names": ["a"]},
])
def test_a_malformed_sent_checksum_is_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(BadInput):
        check_sent_scheme(bad)


def test_the_client_reports_the_transports_checksum_of_what_it_sent() -> None:
    class Ipc:
        backend = "rc_cuda_ipc"
        compute_checksum = True

        def __init__(self, values: list[int]) -> None:
            self.last_sent_names = ("a", "b")
            self.last_sent_checksum = values

    assert _sent_checksum(Ipc([5, -1])) == {"scheme": "rc_cuda_ipc/block",
                                            "names": ["a", "b"], "values": [5, None]}
    assert _sent_checksum(Ipc([5])) is None


def _paused_engine(values: list[int], names: list[str]) -> FakeVllm:
    """The one fake of vLLM, paused, with rc_cuda_ipc's checksum RPC."""
    fake = vllm(only=(Routes.HEALTH, Routes.IS_PAUSED, Routes.RESET_PREFIX),
                overrides={Routes.COLLECTIVE_RPC: _rpc_answer(values, names)})
    fake.engine.pause(PauseMode.WAIT)
    return fake


def _target() -> Any:
    from rolloutcore.core.evidence import UpdateTarget
    from rolloutcore.core.versions import (
        ParameterManifest,
        Provenance,
        WeightIdentity,
        WeightVersion,
    )

    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, "rc-1", "e0"),
                        WeightIdentity.declare(m, Provenance("c")), "test")


@pytest.mark.parametrize("early", [True, False])
@pytest.mark.parametrize("engine_values", [[1, 2, 3], [1, 9, 3]])
def test_the_sent_checksum_is_read_from_the_workers_while_the_cache_resets(
        early: bool, engine_values: list[int]) -> None:
    from rolloutcore.core.evidence import CacheKind
    from rolloutcore.engine.port import VllmAdapter

    names = ["a", "b", "c"]
    eng = _paused_engine(engine_values, names)
    a = VllmAdapter(VllmHTTP("http://e.test", transport=eng.transport()),
                    engine_epoch="e0", early_transport_check=early)
    a.http.capabilities()
    a.expect(probes=None, reference_checksums=None)
    a.expect_sent({"scheme": "rc_cuda_ipc/block", "names": names, "values": [1, 2, 3]})
    if early:  # the read was started at the report: let it land before the reset
        assert a._early_sent is not None
        a._early_sent[1].result(timeout=10)
    a.reset_cache(CacheKind.PREFIX)
    ev = a.validate(_target(), live=False)
    assert ev is not None and ev.paused is True
    check = next(c for c in ev.checks if c.name == "sent_block_checksum")
    assert check.passed is (engine_values == [1, 2, 3])
    # One read of the workers' hash either way: before the reset when started at the
    # report, after it otherwise.
    paths = [p for _, p in eng.received]  # in the order they came
    assert paths.count("/collective_rpc") == 1
    rpc, reset = paths.index("/collective_rpc"), paths.index("/reset_prefix_cache")
    assert (rpc < reset) is early
    # A later validation does not reuse this report's reading.
    assert a._early_sent is None


def test_a_sent_checksum_the_gateway_checked_is_not_checked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's sent checksum is checked once on the event loop (``check_sent``, a 422
    with the lease open); ``expect_sent`` in the worker thread does not repeat it for that
    object, and still refuses any other one."""
    import rolloutcore.engine.port as port_mod
    from rolloutcore.engine.port import VllmAdapter

    calls: list[object] = []

    def counted(sent: Any) -> None:
        calls.append(sent)
        check_sent_scheme(sent)

    monkeypatch.setattr(port_mod, "check_sent_scheme", counted)
    a = VllmAdapter(VllmHTTP("http://e.test", transport=httpx.MockTransport(
        lambda r: httpx.Response(404))), engine_epoch="e0", early_transport_check=False)
    sent = {"scheme": "rc_cuda_ipc/block", "names": ["a", "b"], "values": [1, None]}
    a.check_sent(sent)
    a.expect_sent(sent)
    assert calls == [sent]
    # another object (or the same one a second time) is checked: the memo is spent
    bad = {"scheme": "rc_cuda_ipc/block", "names": ["a", "a"], "values": [1, 2]}
    with pytest.raises(BadInput):
        a.expect_sent(bad)
    a.expect_sent(sent)
    assert calls == [sent, bad, sent]
    a.check_sent(sent)
    with pytest.raises(BadInput):
        a.expect_sent(bad)
