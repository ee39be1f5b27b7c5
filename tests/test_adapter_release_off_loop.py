"""A LoRA unload never runs on the gateway's event loop (#47, symptom 7).

When a request bound to a retired adapter version ended, the data plane's
release (``Target.on_release``, on the event loop) unloaded the adapter there:
blocking calls to the engine (up to 2 x 60 s) and a journal sync, while
``/health`` and every stream waited; a client chooses when its long request
ends. And an exception there skipped the base binding's release. The engine
is ``testing.peft_scorer.peft_vllm`` (the real tiny model through PEFT) under a
real ``AdapterManager`` and the gateway's ``AdapterEngine`` admission.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from fleettools import fake_fleet
from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import rig
from helpers.needs import installed
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.adapters import AdapterConfig, AdapterState
from rolloutcore.core.versions import Provenance
from rolloutcore.service.admission import AdapterEngine, Target
from rolloutcore.service.proxy import FinishedRequest

installed("peft")
MATRIX = PromiseRows("tests/test_adapter_release_off_loop.py",
                     engines="FakeVllm (the tiny model through PEFT) under the real "
                             "AdapterManager and the gateway's admission")
_fault_matrix = MATRIX.fixture()
UNLOAD_S = 0.6  # twice the release's bound (0.3 s): a release that waited for it fails


@pytest.fixture
def manager(tmp_path: Path, one_torch_thread: None) -> Any:
    from rolloutcore.testing.models import make_adapter, make_checkpoint
    from rolloutcore.testing.peft_scorer import peft_vllm

    base = make_checkpoint(tmp_path / "base", 0)
    dirs = []
    for seed in (1, 2):
        make_adapter(base, seed, rank=4).save_pretrained(tmp_path / f"a{seed}")
        dirs.append(tmp_path / f"a{seed}")
    f = fake_fleet(1)
    rep = f.coord.replicas["r0"]
    fake, engine = peft_vllm(base)
    m = AdapterManager(engine, rep.controller, base_model=base, store=tmp_path / "store",
                       config=AdapterConfig(max_loaded=3, max_staleness=0),
                       listener=rep.journal.listener, max_rank=8)
    try:
        yield m, engine, dirs, fake
    finally:
        m.close()
        f.coord.close()


def test_the_release_of_a_retired_adapter_returns_before_its_slow_unload(manager: Any) -> None:
    m, engine, (a1, a2), fake = manager
    first = m.update(a1, Provenance("adapter", "tests", 1)).version
    admission = AdapterEngine(m, "http://127.0.0.1:9")
    _, target = admission.try_admit("long", True)
    assert target.model == first.name
    m.update(a2, Provenance("adapter", "tests", 2))  # ``first`` superseded, still bound
    real = engine.unload_lora_adapter

    def slow(name: str, **kw: Any) -> None:
        time.sleep(UNLOAD_S)
        real(name, **kw)

    engine.unload_lora_adapter = slow
    assert target.on_release is not None
    t0 = time.monotonic()
    target.on_release("long")          # what the data plane calls, on its event loop
    took = time.monotonic() - t0
    assert took < 0.3, f"the release waited {took:.2f}s on the engine"
    assert m.wait_swept(30)
    assert first.name not in fake.loras           # unloaded, off the loop
    assert m.view.states[first.name] is AdapterState.RETIRED
    MATRIX.row("lora_release_on_loop",
               f"a request bound to a retired adapter ends while the engine's unload takes "
               f"{UNLOAD_S:g}s", f"the data plane's release returned in {took * 1000:.0f} ms; "
               "the unload ran on the sweeper thread", "READY",
               published_unvalidated=0, records_lost=0, part="off the loop")


@pytest.mark.anyio
async def test_a_failing_adapter_release_still_releases_the_base_binding() -> None:
    async with rig() as r:
        def broken(rid: str) -> None:
            raise RuntimeError("adapter release failed")

        binding = r.controller.admit("r-1")
        fin = FinishedRequest("/v1/completions", binding, {}, 200, "complete",
                              target=Target("", r.controller, on_release=broken))
        r.gateway.data._release(fin)   # logged, not raised into the request's ending
        assert "r-1" not in r.controller.active
        assert fin.committed == binding.version
    MATRIX.row("lora_release_on_loop", "the adapter's release raises when a request ends",
               "the base binding is released all the same (no drain held up)", "READY",
               published_unvalidated=0, records_lost=0, part="release in a finally")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def test_an_adapter_refused_for_the_budget_can_be_sent_again_once_it_fits(
        tmp_path: Path, one_torch_thread: None) -> None:
    """Refused before the table took it (every slot pinned), nothing changed: not even
    the store, so the same adapter sent again once a slot is free is published (its
    name, generation and digest, are the same; the store never reuses a directory)."""
    from rolloutcore.errors import UpdateRefused
    from rolloutcore.testing.models import make_adapter, make_checkpoint
    from rolloutcore.testing.peft_scorer import peft_vllm

    base = make_checkpoint(tmp_path / "base", 0)
    dirs = []
    for seed in (1, 2, 3):
        make_adapter(base, seed, rank=4).save_pretrained(tmp_path / f"a{seed}")
        dirs.append(tmp_path / f"a{seed}")
    f = fake_fleet(1)
    rep = f.coord.replicas["r0"]
    _, engine = peft_vllm(base)
    store = tmp_path / "store"
    m = AdapterManager(engine, rep.controller, base_model=base, store=store,
                       config=AdapterConfig(max_loaded=2, max_staleness=0),
                       listener=rep.journal.listener, max_rank=8)
    try:
        m.update(dirs[0], Provenance("adapter", "tests", 1))
        _, target = AdapterEngine(m, "http://127.0.0.1:9").try_admit("long", True)
        m.update(dirs[1], Provenance("adapter", "tests", 2))  # the first stays, bound
        held = sorted(p.name for p in store.iterdir())
        with pytest.raises(UpdateRefused, match="does not fit"):
            m.update(dirs[2], Provenance("adapter", "tests", 3))
        assert sorted(p.name for p in store.iterdir()) == held
        assert target.on_release is not None
        target.on_release("long")
        assert m.wait_swept(30)
        third = m.update(dirs[2], Provenance("adapter", "tests", 3)).version
        assert m.current == third and (store / third.name).is_dir()
    finally:
        m.close()
        f.coord.close()
