"""A real vLLM (CPU build) loads LoRA adapters from its own store, uploaded by the trainer.

An engine on another node cannot read the trainer's adapter directory, and
vLLM's ``/v1/load_lora_adapter`` takes a path. The engine here is launched
with RolloutCore's route key and the adapter store middleware
(``transports.adapter_store``); the session's ``AdapterManager(upload=True)``
uploads each version's files, the engine digests them as the trainer did and
seals them under its own store, and the load names that path: what vLLM
lists as the adapter's root is the engine's copy, not the trainer's. A
retired version's files leave the store with it. One engine start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.core.adapters import AdapterConfig
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import vllm_available
from rolloutcore.session import EngineSession
from rolloutcore.testing.models import make_adapter
from rolloutcore.transports import engine_key
from rolloutcore.transports.adapter_store import ENV_DIR, MIDDLEWARE
from rolloutcore.transports.gloo import GlooTransport

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
             "--middleware", MIDDLEWARE]


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("upload")
    engine_store = tmp / "engine-store"
    eng = engine_factory(tiny_models.A, extra_args=LORA_ARGS, guard_routes=True,
                         env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
                              ENV_DIR: str(engine_store)})
    s = EngineSession(VllmHTTP(eng.base_url, timeout_s=120.0), GlooTransport(), engine=eng,
                      journal_path=tmp / "journal.jsonl")
    try:
        s.bootstrap(tiny_models.A, Provenance("A", "tests", 0))
        s.enable_adapters(store=tmp / "trainer-store", upload=True,
                          config=AdapterConfig(max_loaded=3, max_staleness=0))
        yield {"session": s, "engine": eng, "base": tiny_models.A,
               "engine_store": engine_store, "trainer_store": tmp / "trainer-store"}
    finally:
        s.close()
        engine_factory.stop(eng)


def _roots(url: str) -> dict[str, str]:
    r = httpx.get(f"{url}/v1/models", timeout=30, headers=engine_key.headers_for(url))
    r.raise_for_status()
    return {m["id"]: m.get("root") for m in r.json()["data"] if m.get("parent")}


def test_adapters_are_loaded_from_the_engines_own_store(rig: dict[str, Any]) -> None:
    s: EngineSession = rig["session"]
    store: Path = rig["engine_store"]
    first = s.update_adapter(make_adapter(rig["base"], 1), Provenance("lora", "t", 1))
    v1 = first.version
    assert all(c.passed for c in first.checks), first.checks
    roots = _roots(rig["engine"].base_url)
    # vLLM names the engine's copy as the adapter's root, not the trainer's directory.
    assert Path(roots[v1.name]).resolve() == (store / v1.name).resolve()
    assert Path(v1.path).resolve().is_relative_to(Path(rig["trainer_store"]).resolve())
    assert (store / v1.name / "adapter_model.safetensors").is_file()
    # The next version retires the first (max_staleness 0): its files leave the store.
    second = s.update_adapter(make_adapter(rig["base"], 2), Provenance("lora", "t", 2))
    assert second.version.name in _roots(rig["engine"].base_url)
    assert s.adapters is not None and s.adapters.current == second.version
    s.update_adapter(make_adapter(rig["base"], 3), Provenance("lora", "t", 3))
    assert v1.name not in _roots(rig["engine"].base_url)
    assert not (store / v1.name).exists()
    # Nothing was left half-uploaded.
    assert list((store / ".staging").iterdir()) == []
