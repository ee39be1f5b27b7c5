"""The one fake of vLLM passes the exported conformance checks (the real engine passes
the same ones in tests/engine/test_conformance_engine.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from rolloutcore.engine.http import VllmHTTP
from rolloutcore.testing import FakeVllm, conformance
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights


@pytest.fixture
def fake() -> FakeVllm:
    return FakeVllm(FakeEngine(FakeWeights.from_seed(1), token_delay_s=0.0))


def factory(fake: FakeVllm) -> Callable[[], VllmHTTP]:
    return lambda: VllmHTTP("http://fake-vllm", transport=fake.transport())


@pytest.mark.parametrize("check", [
    conformance.check_error_shapes, conformance.check_pause_resume,
    conformance.check_cache_reset, conformance.check_labels_after_finish,
    conformance.check_weight_routes])
def test_fake_passes(fake: FakeVllm, check: Callable[[Callable[[], VllmHTTP]], None]) -> None:
    check(factory(fake))


def test_fake_passes_lora(fake: FakeVllm, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    conformance.check_lora(factory(fake), tmp_path)
    assert fake.loras == {}


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
