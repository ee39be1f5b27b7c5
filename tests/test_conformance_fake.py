"""The one fake of vLLM passes the exported conformance checks (the real engine passes
the same ones in tests/engine/test_conformance_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.errors import BadInput, EffectTimeout, RequestRejected
from rolloutcore.testing import FakeVllm, conformance
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights


@pytest.fixture
def fake() -> FakeVllm:
    return FakeVllm(FakeEngine(FakeWeights.from_seed(1), token_delay_s=0.0))


def factory(fake: FakeVllm) -> Callable[[], VllmHTTP]:
    return lambda: VllmHTTP("http://fake-vllm", transport=fake.transport())


@pytest.mark.parametrize("check", [  # every exported check, one by one
    getattr(conformance, n) for n in conformance.__all__ if n not in ("check_all", "check_lora")])
def test_fake_passes(fake: FakeVllm, check: Callable[..., None]) -> None:
    # The fake holds a paused request at once: a fifth of a second shows it held.
    check(factory(fake), **({"held_s": 0.2} if check is conformance.check_pause_resume else {}))


def test_a_pause_check_held_for_no_positive_time_is_refused(fake: FakeVllm) -> None:
    for bad in (0, -0.5, float("inf"), float("nan"), True, "0.5", None):
        with pytest.raises(BadInput, match="held_s"):
            conformance.check_pause_resume(factory(fake), held_s=bad)  # type: ignore[arg-type]
    assert not fake.engine.paused  # refused before anything was sent


def test_fake_passes_lora(fake: FakeVllm, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    conformance.check_lora(factory(fake), tmp_path)
    assert fake.loras == {}


def test_fake_passes_what_the_engine_lane_runs(fake: FakeVllm, tmp_path: Path) -> None:
    """The call tests/engine/test_conformance_engine.py makes against a real vLLM."""
    (tmp_path / "adapter_config.json").write_text("{}")
    conformance.check_all(factory(fake), adapter_dir=tmp_path, held_s=0.2)


def test_checks_catch_a_fake_that_differs(fake: FakeVllm) -> None:
    """A check that cannot fail is no check: break the fake, each check says so."""
    fake.engine.label = "stale"
    orig = fake._routes[("POST", "/update_weight_version")]
    fake._routes[("POST", "/update_weight_version")] = lambda r: httpx.Response(
        200, json={"success": True})
    with pytest.raises(AssertionError, match="weight_info"):
        conformance.check_labels_after_finish(factory(fake))
    fake._routes[("POST", "/update_weight_version")] = orig
    fake._routes[("POST", "/resume")] = lambda r: httpx.Response(200, json={"status": "resumed"})
    with pytest.raises(AssertionError, match="is_paused"):
        conformance.check_pause_resume(factory(fake))


def test_faults_and_down(fake: FakeVllm) -> None:
    from rolloutcore.errors import EngineUnavailable, EngineUnreachable

    c = factory(fake)()
    fake.fail("/v1/models", 503)
    with pytest.raises(EngineUnavailable):
        c.models()
    assert "fake-model" in c.models()   # one call only
    fake.down = True
    with pytest.raises(EngineUnreachable):
        c.health()
    with pytest.raises(Exception, match="does not serve"):
        fake.fail("/nowhere", 500)


def test_one_handler_serves_the_async_client(fake: FakeVllm) -> None:
    async def main() -> dict[str, object]:
        async with httpx.AsyncClient(base_url="http://fake-vllm",
                                     transport=fake.transport()) as ac:
            r = await ac.post("/inference/v1/generate", json={
                "model": "fake-model", "token_ids": [1, 2, 3],
                "sampling_params": {"max_tokens": 3}})
            return dict(r.json())
    body = asyncio.run(main())
    assert len(body["choices"][0]["token_ids"]) == 3  # type: ignore[index]


def test_over_the_socket_it_says_which_connection_each_request_came_on(fake: FakeVllm
                                                                       ) -> None:
    """``peers``: the client's address per request served over a socket; a pooled
    connection keeps its port, another connection has its own; the mock transport has
    no socket and records none."""
    from helpers.gateway_rig import uvicorn_thread

    factory(fake)().version()
    assert fake.peers == []
    with uvicorn_thread(fake, lifespan="off") as url:
        with httpx.Client(base_url=url) as one:
            assert one.get("/version").status_code == one.get("/health").status_code == 200
        with httpx.Client(base_url=url) as two:
            assert two.get("/version").status_code == 200
    a, b, c = fake.peers
    assert a == b != c and a[0] == c[0] == "127.0.0.1"


def test_weights_change_outputs(fake: FakeVllm) -> None:
    c = factory(fake)()
    a = c.generate(conformance.PROMPT, max_tokens=6, ignore_eos=True).token_ids
    fake.engine.start_update()
    name = next(iter(fake.engine.weight_bytes()))
    fake.engine.load(name, bytes(len(fake.engine.weight_bytes()[name])))
    fake.engine.finish_update("v2")
    c.reset_prefix_cache()
    b = c.generate(conformance.PROMPT, max_tokens=6, ignore_eos=True)
    assert b.token_ids != a and {s.version for s in b.weight_versions or ()} == {"v2"}


@pytest.mark.parametrize(("kw", "match"), [
    ({"model": ""}, "model"), ({"vocab_size": 3}, "vocab_size"),
    ({"vocab_size": True}, "vocab_size"), ({"max_model_len": 1}, "max_model_len"),
    ({"scorer": 42}, "scorer must be callable"),
    ({"scorer": "peft_scorer"}, "scorer must be callable"),
    ({"device": ""}, "device must be a non-empty string"),
    ({"device": 3}, "device must be a non-empty string"),
    ({"live": 1}, "live"), ({"event_delay_s": -1}, "event_delay_s"),
    ({"event_delay_s": True}, "event_delay_s"), ({"without": "/v1/models"}, "without"),
    ({"without": ("/nowhere",)}, "without")])
def test_a_fake_built_wrong_is_refused(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(BadInput, match=match):
        FakeVllm(FakeEngine(FakeWeights.from_seed(1), token_delay_s=0.0), **kw)


@pytest.mark.parametrize("status", [
    200, 399, 600, True, "500", 500.0, None, ValueError, httpx.HTTPStatusError,
    httpx.ReadTimeout("an instance, not its type")])
def test_a_fault_that_is_neither_an_http_error_nor_a_transport_error_is_refused(
        fake: FakeVllm, status: Any) -> None:
    c = factory(fake)()
    with pytest.raises(BadInput, match="status must be an HTTP error status"):
        fake.fail("/v1/models", status)
    assert "fake-model" in c.models()  # nothing was queued


def test_the_faults_it_takes(fake: FakeVllm) -> None:
    c = factory(fake)()
    fake.fail("/v1/models", 400)
    fake.fail("/v1/models", httpx.ReadTimeout, times=2)
    with pytest.raises(BadInput, match="times"):
        fake.fail("/v1/models", 500, times=0)
    with pytest.raises(RequestRejected, match="HTTP 400"):
        c.models()
    for _ in range(2):
        with pytest.raises(EffectTimeout):
            c.models()
    assert "fake-model" in c.models()


def test_an_override_answers_its_route_until_spent_and_serves_a_route_it_lacks(
        fake: FakeVllm) -> None:
    from rolloutcore.errors import EffectError, EngineUnavailable

    c = factory(fake)()
    fake.override(Routes.MODELS, lambda r: httpx.Response(200, json={"data": "x"}), times=2)
    for _ in range(2):
        with pytest.raises(EffectError):   # what its state never answers
            c.models()
    assert "fake-model" in c.models()       # spent: the fake's own answer again

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected", request=request)

    fake.override(Routes.RESUME, reset)     # every call
    for _ in range(2):
        with pytest.raises(EngineUnavailable, match="RemoteProtocolError"):
            c.resume()
    assert not fake.engine.paused and Routes.COLLECTIVE_RPC not in c.capabilities()
    fake.override(Routes.COLLECTIVE_RPC, lambda r: httpx.Response(200, json={"results": []}))
    assert Routes.COLLECTIVE_RPC in fake.paths
    assert Routes.COLLECTIVE_RPC in c.capabilities(refresh=True)
    fake.fail(Routes.MODELS, 503)           # a queued fault comes first
    fake.override(Routes.MODELS, lambda r: httpx.Response(200, json={"data": []}))
    with pytest.raises(EngineUnavailable, match="HTTP 503"):
        c.models()
    assert c.models() == {}
    for bad in (("v1/models", reset, None), ("/v1/models", "no", None),
                ("/v1/models", reset, 0), ("/v1/models", reset, True)):
        with pytest.raises(BadInput):
            fake.override(*bad)  # type: ignore[arg-type]


def test_version_metrics_and_the_0_26_sleep_answers(fake: FakeVllm) -> None:
    """``version`` is what ``/version`` says; ``/metrics`` counts each weight-update call
    that succeeded (the counter created by the first, as vLLM's) and says whether the
    engine is awake; ``empty_sleep_answers``: 0.26's bodiless ``/sleep``/``/wake_up``."""
    c = factory(fake)()
    assert c.version() == "fake"
    fake.version = "0.32.0"
    assert c.version() == "0.32.0"
    assert c.weight_ops().done == {} and c.weight_ops().awake is True
    with httpx.Client(base_url="http://fake-vllm", transport=fake.transport()) as raw:
        assert raw.post(Routes.START_UPDATE).status_code == 200
        assert raw.post(Routes.START_UPDATE).status_code == 500   # refused: not counted
        for _ in range(2):
            raw.post(Routes.UPDATE_WEIGHTS, json={"update_info": {"names": []}})
        raw.post(Routes.FINISH_UPDATE, json={"weight_version": "rc-9"})
    ops = c.weight_ops()
    assert dict(ops.done) == {"start": 1.0, "update": 2.0, "finish": 1.0}
    c.sleep(1)
    assert c.weight_ops().awake is False and c.wake_up() is True
    fake.empty_sleep_answers = True
    c.sleep(1)
    assert c.wake_up() is None and not fake.engine.asleep   # said nothing, woke
