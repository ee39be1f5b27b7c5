"""The real vLLM client against a real CPU vLLM passes the conformance checks the fake
passes (tests/test_conformance_fake.py): one engine start for the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.testing import conformance
from rolloutcore.testing.models import make_adapter

pytestmark = pytest.mark.engine

LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


@pytest.fixture(scope="module")
def engine(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[ManagedEngine]:
    eng = engine_factory(tiny_models.A, extra_args=LORA_ARGS, env=LORA_ENV)
    try:
        yield eng
    finally:
        engine_factory.stop(eng)


def test_real_vllm_passes_the_conformance_checks(engine: ManagedEngine, tiny_models: TinyModels,
                                                 tmp_path: Path) -> None:
    pytest.importorskip("peft")
    adapter = tmp_path / "lora"
    make_adapter(tiny_models.A, 1).save_pretrained(str(adapter))
    conformance.check_all(lambda: VllmHTTP(engine.base_url, timeout_s=120.0),
                          adapter_dir=adapter)
