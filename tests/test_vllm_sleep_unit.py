"""VllmAdapter's sleep mode against the HTTP behaviour of a CUDA vLLM (issue 21).

vLLM's CPU build has no sleep mode (tests/engine/test_sleep_cpu.py shows the
refusal on a real CPU server), so the answers of a sleeping CUDA engine are
played here by the one fake of vLLM (``rolloutcore.testing.FakeVllm``, its
``FakeEngine`` sleeping and waking), as two vLLM releases give them, read
from their sources: 0.32 answers ``/sleep`` and ``/wake_up`` with a status
and keeps its scheduler paused until everything is awake (then resumes it);
0.26 answers empty bodies and resumes its scheduler on any wake (the partial
wake bug, vLLM #44395). Both count a paused scheduler as ``is_sleeping``.
The transport is a stand-in with rc_cuda_ipc's worker view (every
parameter's checksum, the workers' memory, the drop of stale state): what
is checked is what the adapter sends, refuses and concludes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from helpers.vllm_fake import Handler, answer, sent, vllm
from rolloutcore.core.evidence import (
    CacheKind,
    Check,
    PauseMode,
    TransferEvidence,
    UpdateTarget,
    WakeTags,
)
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.sleep import SleepAwareTransport
from rolloutcore.errors import BadInput, EffectError, EngineRefused, TransferError
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake_engine import FakeEngine

BASE = "http://engine.test"
#: What the engine serves: no weight label (the transport's checks are the evidence).
ROUTES = frozenset({
    Routes.HEALTH, Routes.VERSION, Routes.SERVER_INFO, Routes.MODELS, Routes.PAUSE,
    Routes.RESUME, Routes.IS_PAUSED, Routes.IS_SLEEPING, Routes.SLEEP, Routes.WAKE_UP,
    Routes.RESET_PREFIX, Routes.RESET_ENCODER, Routes.RESET_MM, Routes.START_UPDATE,
    Routes.UPDATE_WEIGHTS, Routes.FINISH_UPDATE})


def _info(sleep_mode: bool | None) -> Handler:
    """``/server_info`` of an engine started for rc_cuda_ipc, with ``--enable-sleep-mode``
    as ``sleep_mode`` says (``None``: not shown)."""
    mc = {} if sleep_mode is None else {"enable_sleep_mode": sleep_mode}
    return answer(200, {"vllm_config": {
        "model_config": mc, "weight_transfer_config": {"backend": "rc_cuda_ipc"}}})


def sleepy_engine(release: str = "0.32", sleep_mode: bool | None = True,
                  seen: list[httpx.Request] | None = None) -> FakeVllm:
    """The one fake of vLLM with sleep mode, as 0.32 or 0.26 answer it (0.26: empty
    bodies, its scheduler resumed on any wake); ``seen``: every request, in order."""
    e = vllm(version=f"{release}.0", only=ROUTES, seen=seen, overrides={
        Routes.SERVER_INFO: _info(sleep_mode)})
    if release == "0.26":
        e.empty_sleep_answers, e.engine.wake_resumes = True, "always"
    return e


class WorkerTransport:
    """rc_cuda_ipc's worker-facing surface, with the engine's parameters in a dict."""

    backend = "rc_cuda_ipc"

    def __init__(self) -> None:
        self.params = {f"p{i}": 100 + i for i in range(4)}
        self.sent: dict[str, int] = {}
        self.calls: list[str] = []
        self.skip: set[str] = set()
        self.last: Check | None = None
        self.engine: FakeEngine | None = None

    def engine_config(self) -> dict[str, Any]:
        return {"backend": self.backend}

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        self.calls.append("connect")

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float) -> TransferEvidence:
        self.calls.append("send")
        self.sent = {n: 200 + i for i, n in enumerate(self.params)}
        self.params.update({n: v for n, v in self.sent.items() if n not in self.skip})
        return TransferEvidence(completed=True, mutation_started=True, backend=self.backend,
                                tensors=len(self.sent), bytes=8)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass

    def validation_check(self, base_url: str) -> Check:
        ok = all(self.params[n] == v for n, v in self.sent.items())
        unc = len(self.skip)
        self.last = Check("engine_parameters", ok and unc == 0,
                          coverage=(len(self.params) - unc) / len(self.params),
                          level=VerificationLevel.ENGINE_CHECKSUM)
        return Check("worker_block_checksum", ok and unc == 0, coverage=1.0,
                     level=VerificationLevel.ENGINE_CHECKSUM)

    def after_wake(self, base_url: str) -> Mapping[str, Any]:
        self.calls.append("after_wake")
        return {"workers": [{"dropped": ["prefetched checksum"], "params_moved": False}]}

    def param_checksums(self, base_url: str) -> Mapping[str, int]:
        self.calls.append("param_checksums")
        return dict(self.params)

    def engine_memory(self, base_url: str) -> Mapping[str, Any]:
        self.calls.append("engine_memory")
        asleep = self.engine.asleep if self.engine is not None else set()
        used = 1 + (0 if "weights" in asleep else 16) + (0 if "kv_cache" in asleep else 53)
        return {"used_bytes": used << 30, "free_bytes": (140 - used) << 30,
                "total_bytes": 140 << 30, "source": "test workers"}

    def engine_parameter_check(self) -> Check | None:
        return self.last


def target(label: str = "rc-1") -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, label, "e0"), WeightIdentity.declare(m, Provenance("c")),
                        "test")


def rig(release: str = "0.32", sleep_mode: bool | None = True
        ) -> tuple[VllmAdapter, FakeVllm, WorkerTransport, list[httpx.Request]]:
    import torch

    from rolloutcore.transports.source import WeightSource

    seen: list[httpx.Request] = []
    e = sleepy_engine(release, sleep_mode, seen)
    tr = WorkerTransport()
    tr.engine = e.engine
    assert isinstance(tr, SleepAwareTransport)
    h = VllmHTTP(BASE, transport=e.transport())
    a = VllmAdapter(h, tr, engine_epoch="e0")  # type: ignore[arg-type]
    a._connected = True  # the handshake is the transport's business, not tested here
    a._sleep_mode = sleep_mode
    a.stage(WeightSource.from_state_dict({"w": torch.ones(2)}))
    return a, e, tr, seen


def test_sleep_sends_level_and_wait_then_reads_what_the_engine_says() -> None:
    a, e, tr, seen = rig()
    ev = a.sleep(2, reference=False)
    req = next(r for r in seen if r.url.path == Routes.SLEEP)
    assert req.method == "POST" and dict(req.url.params) == {"level": "2", "mode": "wait"}
    assert ev.level == 2 and ev.is_sleeping_after is True and ev.paused_after is True
    assert ev.problems(None) == [] and ev.reference_params == 0
    assert ev.memory_before["used_bytes"] == 70 << 30 and ev.memory_before["source"]
    assert ev.memory_after["used_bytes"] == 1 << 30 and ev.freed_bytes == 69 << 30
    assert a.asleep == 2 and "param_checksums" not in tr.calls


def test_an_engine_without_sleep_mode_is_refused_before_any_sleep_call() -> None:
    a, e, tr, seen = rig(sleep_mode=False)
    with pytest.raises(EngineRefused, match="enable-sleep-mode") as ex:
        a.sleep(2, reference=True)
    assert ex.value.mutation_started is False
    assert sent(e, Routes.SLEEP) == 0 and tr.calls == [] and a.asleep is None
    # Not known from bootstrap: asked of /server_info before anything is sent.
    a2, e2, _, _ = rig(sleep_mode=None)
    e2.override(Routes.SERVER_INFO, _info(False))
    with pytest.raises(EngineRefused):
        a2.sleep(1, reference=False)
    assert sent(e2, Routes.SERVER_INFO) == 1 and sent(e2, Routes.SLEEP) == 0
    with pytest.raises(BadInput):
        a.sleep(0, reference=False)


@pytest.mark.parametrize("release", ["0.32", "0.26"])
def test_the_colocated_wake_keeps_the_scheduler_paused_on_both_releases(release: str) -> None:
    a, e, tr, seen = rig(release)
    a.sleep(2, reference=False)
    w = a.wake(WakeTags.WEIGHTS)
    assert w.fully_awake is False and w.paused_after is True and e.engine.paused
    assert w.memory_after["used_bytes"] == 17 << 30
    assert w.repaused is (release == "0.26")  # 0.26 resumed its scheduler on a partial wake
    assert w.problems(None) == [] and "after_wake" in tr.calls
    ev = a.transfer(target())
    assert ev.completed and tr.calls.count("send") == 1
    # The check of what was written starts now; the paused state is read only after the
    # KV cache wakes (vLLM resumes the scheduler then, and the wake pauses it again).
    assert a._early is not None and a._early[2] is None
    k = a.wake(WakeTags.KV_CACHE)
    assert k.fully_awake is True and k.paused_after is True and k.repaused and e.engine.paused
    assert any("directly" in u for u in k.unverified)
    assert tr.calls.count("after_wake") == 1  # the KV cache holds no transport state
    assert a.reset_cache(CacheKind.PREFIX).engine_success is True
    val = a.validate(target(), live=False)
    assert val is not None and val.paused is True
    names = [c.name for c in val.checks]
    assert names == ["worker_block_checksum", "engine_parameters"]
    assert all(c.passed for c in val.checks) and val.checks[1].coverage == 1.0
    a.resume()
    assert a.asleep is None and not e.engine.paused


def test_nothing_reaches_a_sleeping_engine_but_the_wake() -> None:
    a, e, tr, seen = rig()
    a.sleep(2, reference=False)
    n = len(seen)
    with pytest.raises(TransferError, match="asleep") as ex:
        a.transfer(target())
    assert ex.value.mutation_started is False and "send" not in tr.calls
    with pytest.raises(EffectError, match="asleep") as ex2:
        a.drain(PauseMode.WAIT)
    assert ex2.value.mutation_started is False
    with pytest.raises(EffectError, match="asleep"):
        a.reset_cache(CacheKind.PREFIX)
    with pytest.raises(EngineRefused, match="already asleep"):
        a.sleep(2, reference=False)
    assert len(seen) == n, "a refused call reached the engine"
    a.wake(WakeTags.WEIGHTS)
    with pytest.raises(EffectError, match="kv_cache"):  # the KV cache is still asleep
        a.reset_cache(CacheKind.PREFIX)


def test_a_restore_compares_every_parameter_with_its_checksum_from_before_the_sleep() -> None:
    a, e, tr, seen = rig()
    ev = a.sleep(1, reference=True)
    assert ev.reference_params == 4 and tr.calls.index("param_checksums") < len(tr.calls)
    a.wake(WakeTags.ALL)
    val = a.validate(target(), live=False)
    assert val is not None and len(val.checks) == 1
    chk = val.checks[0]
    assert chk.name == "engine-parameters" and chk.passed and chk.coverage == 1.0
    assert "before the sleep" in chk.detail
    # Weights that came back different (a level-2 sleep, a bad offload) fail it.
    a2, _, tr2, _ = rig()
    a2.sleep(2, reference=True)
    tr2.params = {n: 0 for n in tr2.params}  # what a level-2 wake brings back
    a2.wake(WakeTags.ALL)
    bad = a2.validate(target(), live=False)
    assert bad is not None and not bad.checks[0].passed and bad.checks[0].coverage == 1.0
    assert bad.checks[0].detail.count("MISMATCHED") == 1
    # ...and without a reference there is nothing to compare with.
    a3, _, _, _ = rig()
    a3.sleep(2, reference=False)
    a3.wake(WakeTags.ALL)
    none = a3.validate(target(), live=False)
    assert none is not None and not none.checks[0].passed and none.checks[0].coverage == 0.0


def test_one_parameter_left_unwritten_shows_in_the_whole_parameter_check() -> None:
    a, e, tr, seen = rig()
    a.sleep(2, reference=False)
    a.wake(WakeTags.WEIGHTS)
    tr.skip = {"p3"}
    a.transfer(target())
    a.wake(WakeTags.KV_CACHE)
    val = a.validate(target(), live=False)
    assert val is not None
    whole = next(c for c in val.checks if c.name == "engine_parameters")
    assert not whole.passed and whole.coverage == 0.75


def test_wake_tags_are_checked_and_sent_as_vllm_reads_them() -> None:
    a, e, tr, seen = rig()
    with pytest.raises(BadInput):
        a.wake("weights")  # type: ignore[arg-type]
    h = a.http
    with pytest.raises(BadInput):
        h.wake_up("weights")  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        h.wake_up(["scheduling"])
    with pytest.raises(BadInput):
        h.sleep(3)
    a.sleep(2, reference=False)
    a.wake(WakeTags.WEIGHTS)
    a.transfer(target())
    a.wake(WakeTags.KV_CACHE)
    wakes = [r for r in seen if r.url.path == Routes.WAKE_UP]
    assert [r.url.params.get_list("tags") for r in wakes] == [["weights"], ["kv_cache"]]
    a.resume()
    a.sleep(1, reference=False)
    a.wake(WakeTags.ALL)
    assert [r for r in seen if r.url.path == Routes.WAKE_UP][-1].url.params \
        .get_list("tags") == []


def test_a_sleep_the_engine_refuses_left_it_untouched_and_a_500_did_not() -> None:
    a, e, tr, seen = rig()
    h = VllmHTTP(BASE, transport=vllm(overrides={
        Routes.SLEEP: answer(400, {"detail": "bad level"})}).transport())
    a2 = VllmAdapter(h, engine_epoch="e0")
    a2._sleep_mode = True
    with pytest.raises(EngineRefused) as ex:
        a2.sleep(2, reference=False)
    assert ex.value.mutation_started is False and a2.asleep is None
    h5 = VllmHTTP(BASE, transport=vllm(overrides={
        Routes.SLEEP: answer(500, {"error": "boom"})}).transport())
    a5 = VllmAdapter(h5, engine_epoch="e0")
    a5._sleep_mode = True
    with pytest.raises(EffectError) as ex5:
        a5.sleep(2, reference=False)
    assert ex5.value.mutation_started is True  # the memory is in an unknown state


def test_the_session_api_in_a_training_loop() -> None:
    """EngineSession.sleep / wake_and_update / wake, as a colocated training loop calls them."""
    import torch

    from rolloutcore.core.lifecycle import State
    from rolloutcore.errors import UpdateRefused
    from rolloutcore.session import EngineSession

    e = sleepy_engine()
    tr = WorkerTransport()
    tr.engine = e.engine
    session = EngineSession(VllmHTTP(BASE, transport=e.transport()), tr,
                            engine_epoch="e0")
    session.vllm._connected = True
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    session.runner.bootstrap(WeightIdentity.declare(m, Provenance("ckpt/step-0")))
    c = session.controller
    with pytest.raises(UpdateRefused, match="not asleep"):
        session.wake_and_update({"w": torch.ones(2)}, Provenance("s1", "run", 1), probe=False)
    for step in (1, 2):
        rep = session.sleep(2)
        assert rep.level == 2 and rep.freed_bytes == 69 << 30 and session.asleep == 2
        assert rep.free_bytes == 139 << 30
        with pytest.raises(UpdateRefused, match="level 2"):
            session.wake()  # those weights are gone
        with pytest.raises(UpdateRefused, match="asleep"):
            session.update({"w": torch.ones(2)}, Provenance("x", "run", 9), probe=False)
        assert c.state is State.SLEEPING and "send" not in tr.calls[-3:]
        res = session.wake_and_update({"w": torch.full((2,), float(step))},
                                      Provenance(f"s{step}", "run", step), probe=False)
        assert res.version.label == f"rc-{step}" and c.state is State.READY
        assert res.identity.verification >= VerificationLevel.ENGINE_CHECKSUM
        assert session.asleep is None and not e.engine.paused and not e.engine.asleep
    session.sleep(1)
    assert session.wake() == c.committed and c.state is State.READY
    assert [v.label for v in c.published] == ["rc-0", "rc-1", "rc-2"]
    session.close()
