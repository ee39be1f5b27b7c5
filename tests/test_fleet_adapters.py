"""Fleet LoRA-adapter versions (``fleet.adapters``): verified on every replica, then published.

Each replica is a fake fleet's replica (its own controller and journal) whose
LoRA routes are answered by the one fake with ``testing.peft_scorer``: the real tiny
model in float32, each adapter applied through PEFT from the directory it was
loaded from. The probes compare those computations with the reference, so a
fault shows up the way it would on vLLM: an adapter that computes the base, a
load that loads nothing, an unload that hangs.

The fleet gateway, a new base, restarts, room and a broken-off publish are in
test_fleet_adapters_restart.py (with these fixtures): one file was the fast lane's
longest, held by one worker under ``--dist loadfile``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from fleettools import fake_fleet
from helpers.needs import installed
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.adapters import AdapterConfig, AdapterState
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import AdmissionRefused, BadInput, UpdateRefused
from rolloutcore.fleet.adapters import FleetAdapterFailed, FleetAdapters
from rolloutcore.testing.peft_scorer import peft_vllm

installed("peft")
# Two replicas verify at once, each computing in this process.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rolloutcore.testing.models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("base") / "ck", 0)


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Saved adapter directories by seed (written once for the module)."""
    from rolloutcore.testing.models import make_adapter

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for seed in (1, 2, 3):
        make_adapter(base, seed, rank=4).save_pretrained(root / f"a{seed}")
        out[seed] = root / f"a{seed}"
    return out


@pytest.fixture
def rig(base: Path, tmp_path: Path) -> Iterator[dict[str, Any]]:
    f = fake_fleet(2)
    engines, clients = {}, {}   # each replica: the one fake, and its client
    for n in f.coord.replicas:
        engines[n], clients[n] = peft_vllm(base)

    def make(rep: Any) -> AdapterManager:
        return AdapterManager(clients[rep.name], rep.controller, base_model=base,
                              store=tmp_path / rep.name / rep.controller.committed.label,
                              config=AdapterConfig(max_loaded=3, max_staleness=1),
                              listener=rep.journal.listener, max_rank=8)

    fa = FleetAdapters(f.coord, make, base_model=base, deadline_s=120)
    try:
        yield {"fleet": f, "fa": fa, "engines": engines}
    finally:
        f.coord.close()


def _prov(step: int) -> Provenance:
    return Provenance("adapter", "tests", step)


def _state(fa: FleetAdapters) -> Any:
    return (fa.current, {n: (m.view.current, dict(m.view.states))
                         for n, m in fa.managers.items()})


def test_published_on_every_replica_once_all_verified(rig: dict[str, Any],
                                                      adapters: dict[int, Path]) -> None:
    fa: FleetAdapters = rig["fa"]
    res = fa.update(adapters[1], _prov(1))
    v = res.version
    assert fa.current == v and set(v.replicas) == {"r0", "r1"}
    for n, m in fa.managers.items():
        assert m.current is not None and m.current.name == v.name
        assert {c.name for c in res.replicas[n].checks} == {"listed", "content",
                                                            "adapter-probe", "base-probe"}
        assert v.name in rig["engines"][n].loras
        assert fa.eligible(n)
    # Each replica read its own copy of the files; the fleet's name is new everywhere.
    paths = {rig["engines"][n].loras[v.name] for n in fa.managers}
    assert len(paths) == 2
    second = fa.update(adapters[2], _prov(2)).version
    assert second.generation > v.generation and second.name != v.name
    for m in fa.managers.values():
        assert m.view.states[v.name] is AdapterState.STANDBY


def test_one_replica_failing_verification_publishes_nothing_anywhere(
        rig: dict[str, Any], adapters: dict[int, Path]) -> None:
    """Negative control: on r1 the adapter load silently computes the base."""
    fa: FleetAdapters = rig["fa"]
    first = fa.update(adapters[1], _prov(1)).version
    before = _state(fa)
    rig["engines"]["r1"].base_under_name = 1
    with pytest.raises(FleetAdapterFailed, match="adapter-probe") as exc:
        fa.update(adapters[2], _prov(2))
    err = exc.value
    assert err.classification == "no_mutation"
    assert "verified, not published: refused" in err.outcomes["r0"]
    # Nothing published anywhere, the verified copy on r0 unloaded, the old one serves.
    assert fa.current == first
    for n, m in fa.managers.items():
        assert m.current == before[1][n][0]
        assert m.view.states[err.name] is AdapterState.REFUSED
        assert set(rig["engines"][n].loras) == {first.name}
        assert fa.eligible(n)
    # The next update gets a new name and passes on both.
    nxt = fa.update(adapters[2], _prov(3)).version
    assert nxt.name != err.name and fa.current == nxt


def test_a_load_that_loads_nothing_and_a_failed_unload(rig: dict[str, Any],
                                                       adapters: dict[int, Path]) -> None:
    fa: FleetAdapters = rig["fa"]
    first = fa.update(adapters[1], _prov(1)).version
    # r0's load answers and loads nothing (not listed); r1's unload of the verified copy
    # hangs: it stays fenced there, and r1 takes no policy request until a later update.
    rig["engines"]["r0"].swallow_loads = 1
    rig["engines"]["r1"].fail(Routes.UNLOAD_LORA, httpx.ReadTimeout)
    with pytest.raises(FleetAdapterFailed, match="does not list") as exc:
        fa.update(adapters[2], _prov(2))
    assert exc.value.classification == "ambiguous"
    assert fa.managers["r1"].view.states[exc.value.name] is AdapterState.FENCED
    assert fa.current == first and fa.eligible("r0") and not fa.eligible("r1")
    assert fa.status()["replicas"]["r1"]["tainted"]
    # The slot budget (3) holds: the fenced one counts. A later update passes on both
    # and clears the taint.
    nxt = fa.update(adapters[3], _prov(3)).version
    assert fa.current == nxt and fa.eligible("r1") and fa.eligible("r0")


def test_bad_input_and_refusals_change_nothing(rig: dict[str, Any], tmp_path: Path,
                                               adapters: dict[int, Path]) -> None:
    fa: FleetAdapters = rig["fa"]
    fa.update(adapters[1], _prov(1))
    before = _state(fa)
    (tmp_path / "empty").mkdir()
    for bad, exc_t in ((tmp_path / "empty", BadInput), (tmp_path / "nope", BadInput),
                       (42, BadInput)):
        with pytest.raises(exc_t):
            fa.update(bad, _prov(2))
    with pytest.raises(BadInput, match="provenance"):
        fa.update(adapters[2], "step 2")  # type: ignore[arg-type]
    # Every replica refuses the load (a 4xx): nothing loaded anywhere, nothing published.
    for e in rig["engines"].values():
        e.fail(Routes.LOAD_LORA, 400)
    with pytest.raises(FleetAdapterFailed, match="refused"):
        fa.update(adapters[2], _prov(2))
    assert fa.current == before[0]
    assert {n: m.view.current for n, m in fa.managers.items()} == {
        n: c for n, (c, _) in before[1].items()}
    for n, e in rig["engines"].items():
        assert set(e.loras) == {before[1][n][0].name}
    with pytest.raises(BadInput):
        FleetAdapters(rig["fleet"].coord, lambda r: None, base_model="x")  # type: ignore
    with pytest.raises(BadInput, match="deadline_s"):
        FleetAdapters(rig["fleet"].coord, lambda r: None, base_model="x", deadline_s=0)


def _kill_and_recover(f: Any, engines: dict[str, Any], name: str) -> str | None:
    epoch = f.coord.replicas[name].controller.committed.engine_epoch
    f.engine(name).kill()
    engines[name].loras.clear()   # the new process holds no adapter
    f.coord.suspect(name)
    f.coord.supervise_once()
    assert name not in f.coord.serving()
    assert f.coord.wait_for(lambda: name in f.coord.serving(), 20)
    assert f.coord.replicas[name].controller.committed.engine_epoch != epoch
    return epoch


def test_a_recovered_replica_catches_up_on_the_current_adapter(
        rig: dict[str, Any], adapters: dict[int, Path]) -> None:
    """Its new engine holds no adapter: once it serves again the fleet's current adapter
    is loaded and verified on it alone (same name: same content, a new process with no
    KV under it) and published there; every other name the old process used stays
    refused, and the next update takes it along."""
    import time

    f, fa = rig["fleet"], rig["fa"]
    first = fa.update(adapters[1], _prov(1)).version
    old_mgr = fa.managers["r1"]
    engines = rig["engines"]
    _kill_and_recover(f, engines, "r1")
    deadline = time.monotonic() + 120
    while not fa.eligible("r1") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fa.eligible("r1") and fa.caught_up["r1"] == "published", fa.status()
    m = fa.managers["r1"]
    assert m is not old_mgr and m.current is not None and m.current.name == first.name
    checks = m.view.states
    assert checks[first.name] is AdapterState.PUBLISHED
    assert set(engines["r1"].loras) == {first.name}
    assert engines["r1"].loras[first.name].startswith(str(m.store))   # its own copy
    assert fa.current is not None and set(fa.current.replicas) == {"r0", "r1"}
    assert fa.status()["replicas"]["r1"]["caught_up"] == "published"
    m.admit("after-catch-up")
    m.complete("after-catch-up")
    # Nothing more to do: a second catch-up says so and changes nothing.
    assert fa.catch_up("r1") == "already serves the current adapter"
    with pytest.raises(BadInput):
        fa.catch_up("nope")
    nxt = fa.update(adapters[2], _prov(2)).version
    assert fa.eligible("r1") and set(engines["r1"].loras) >= {nxt.name}


def test_a_catch_up_that_fails_verification_leaves_the_replica_out(
        rig: dict[str, Any], adapters: dict[int, Path]) -> None:
    """The new engine swallows the load (answers 200, loads nothing): the catch-up's
    verification refuses it, the replica serves no ``policy`` request, and the next
    update (which loads properly) takes it along under a new name."""
    f, fa = rig["fleet"], rig["fa"]
    engines = rig["engines"]
    first = fa.update(adapters[1], _prov(1)).version
    engines["r1"].swallow_loads = 1
    _kill_and_recover(f, engines, "r1")
    assert f.coord.wait_for(lambda: fa.caught_up.get("r1", "").startswith("failed"), 120), \
        fa.status()
    assert not fa.eligible("r1") and fa.eligible("r0")
    assert first.name not in engines["r1"].loras
    with pytest.raises(AdmissionRefused):
        fa.managers["r1"].admit("x")
    # A catch-up of a replica that is not on a new process does nothing.
    assert fa.catch_up("r0") == "already serves the current adapter"
    nxt = fa.update(adapters[2], _prov(2)).version
    assert fa.eligible("r1") and nxt.name in engines["r1"].loras


def test_one_update_at_a_time_and_no_serving_replica(rig: dict[str, Any],
                                                     adapters: dict[int, Path]) -> None:
    fa: FleetAdapters = rig["fa"]
    assert fa._update.acquire()
    try:
        with pytest.raises(UpdateRefused, match="one at a time"):
            fa.update(adapters[1], _prov(1))
    finally:
        fa._update.release()
    assert fa.current is None
