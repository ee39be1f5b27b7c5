"""Fleet LoRA-adapter versions, continued: the fleet gateway, a new base, restarts, room
and a publish that breaks off (the fixtures and the engines of test_fleet_adapters.py).

A file of its own so that ``--dist loadfile`` can run it beside the first half: the
two are the fast lane's longest file together (each replica computes through PEFT).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import test_fleet_adapters as first
from fleettools import fake_fleet
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.adapters import AdapterState
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import AdmissionRefused, UpdateFailed, UpdateRefused
from rolloutcore.fleet.adapters import FleetAdapterFailed, FleetAdapters
from rolloutcore.testing.peft_scorer import peft_vllm
from test_fleet_adapters import _prov, _state

# The first half's fixtures, found by pytest by name here (module-scoped ones are made
# once per file).
base = first.base
adapters = first.adapters
rig = first.rig


# --------------------------------------------------------------------------- the gateway

def test_the_fleet_gateway_publishes_and_routes_policy_to_the_fleets_adapter(
        rig: dict[str, Any], adapters: dict[int, Path], tmp_path: Path) -> None:
    """POST/GET /control/adapters on the fleet gateway; ``model: policy`` sent as the
    current adapter's name to an eligible replica, the answer naming the adapter."""
    import anyio
    import httpx

    from fleettools import served
    from helpers.asgi_stream import lifespan
    from helpers.gateway_rig import TOKEN
    from rolloutcore.fleet.adapter_gateway import create_lora_fleet_app
    from rolloutcore.service import ServiceConfig

    f, fa = rig["fleet"], rig["fa"]
    auth = {"authorization": f"Bearer {TOKEN}"}
    gen = {"model": "policy", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}}

    async def main() -> None:
        with served(f) as fakes:
            for n, fk in fakes.items():
                fk.loras = rig["engines"][n].loras  # one engine: the adapters loaded
            app = create_lora_fleet_app(f.coord, ServiceConfig(
                upstream_url="http://127.0.0.1:1", control_token=TOKEN), fa, supervise=False)
            async with lifespan(app), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app), base_url="http://fleet.test",
                    timeout=120) as c:
                # Before any adapter: policy is the base's.
                r = await c.post("/inference/v1/generate", json=gen)
                assert r.status_code == 200 and "x-rolloutcore-adapter" not in r.headers
                for body, code in (({"adapter_dir": str(adapters[1])}, 400),
                                   ({"adapter_dir": str(tmp_path), "provenance": {
                                       "checkpoint": "x"}}, 400)):
                    r = await c.post("/control/adapters", json=body, headers=auth)
                    assert r.status_code == code, r.text
                assert (await c.post("/control/adapters", json={})).status_code == 401
                assert fa.current is None
                r = await c.post("/control/adapters", headers=auth, json={
                    "adapter_dir": str(adapters[1]),
                    "provenance": {"checkpoint": "a1", "step": 1}})
                assert r.status_code == 200, r.text
                name = r.json()["version"]["name"]
                assert set(r.json()["replicas"]) == {"r0", "r1"}
                got = (await c.get("/control/adapters", headers=auth)).json()
                assert got["current"]["name"] == name
                seen = set()
                for _ in range(4):
                    r = await c.post("/inference/v1/generate", json=gen)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-rolloutcore-adapter"] == name
                    assert r.json()["rolloutcore"]["adapter"] == name
                    rep = r.headers["x-rolloutcore-replica"]
                    assert fakes[rep].bodies[-1]["model"] == name
                    seen.add(rep)
                assert seen == {"r0", "r1"}
                assert all(not m.view.bound for m in fa.managers.values())  # released
                # Refused: naming the version, prompt logprobs, base requests beside it.
                for body in ({**gen, "model": name},
                             {**gen, "sampling_params": {"max_tokens": 2,
                                                         "prompt_logprobs": 1}},
                             {**gen, "model": "other"}):
                    r = await c.post("/inference/v1/generate", json=body)
                    assert r.status_code == 400, r.text
                # A replica tainted for adapters takes no policy request.
                fa._tainted["r0"] = "test"
                for _ in range(3):
                    r = await c.post("/inference/v1/generate", json=gen)
                    assert r.headers["x-rolloutcore-replica"] == "r1"
                fa._tainted["r1"] = "test"
                r = await c.post("/inference/v1/generate", json=gen)
                assert r.status_code == 503, r.text

    anyio.run(main)


def test_after_a_full_update_of_the_base_the_adapter_needs_a_new_version(
        rig: dict[str, Any], adapters: dict[int, Path], base: Path) -> None:
    """An adapter verified on the old base serves no request on the new one (admission
    refuses it: the trainer's policy was old base + adapter); a new adapter update, or
    ``rebase`` (the same files verified on the new base, a new name), brings it back."""
    from fleettools import weights

    f, fa = rig["fleet"], rig["fa"]
    first = fa.update(adapters[1], _prov(1)).version
    f.coord.update(weights(1))
    assert not fa.eligible("r0") and not fa.eligible("r1")
    with pytest.raises(AdmissionRefused, match="verified on base"):
        fa.managers["r0"].admit("x")
    with pytest.raises(UpdateRefused, match="set_base"):
        fa.update(adapters[2], _prov(9))
    res = fa.rebase(_prov(2), base_model=base)
    again = res.version
    assert again.content_digest == first.content_digest and again.name != first.name
    assert fa.eligible("r0") and fa.eligible("r1")
    labels = {n: f.coord.replicas[n].controller.committed.label for n in fa.managers}
    assert {n: m.current.base for n, m in fa.managers.items()  # type: ignore[union-attr]
            } == labels


def test_a_restarted_gateway_restores_names_and_republishes_the_journals_adapter(
        base: Path, adapters: dict[int, Path], tmp_path: Path) -> None:
    """The journal's adapter records: names never reused, generations continue; the
    new engine holds nothing, so nothing is claimed until the journal's adapter is
    loaded and verified again under a new name (``serve --lora --journal``)."""
    from rolloutcore.control.journal import Journal, read_journal
    from rolloutcore.core.adapters import AdapterChange
    from rolloutcore.service.serve import _restore_adapters

    f = fake_fleet(1)
    rep = f.coord.replicas["r0"]
    try:
        jpath = tmp_path / "j.jsonl"
        j = Journal(jpath)
        m1 = AdapterManager(peft_vllm(base)[1], rep.controller, base_model=base,
                            store=tmp_path / "store", listener=j.listener, max_rank=8)
        m1.update(adapters[1], _prov(1))
        second = m1.update(adapters[2], _prov(7)).version
        j.close()
        fake2, eng2 = peft_vllm(base)              # the restarted engine holds nothing
        j2 = Journal(jpath)
        m2 = AdapterManager(eng2, rep.controller, base_model=base,
                            store=tmp_path / "store", listener=j2.listener, max_rank=8)
        _restore_adapters(m2, str(jpath))
        now = m2.current
        assert now is not None and now.name != second.name
        assert now.content_digest == second.content_digest
        assert now.generation == second.generation + 1
        assert set(fake2.loras) == {now.name}
        assert m2.is_adapter(second.name)           # an old name stays refused
        j2.close()
        recs = [r.record for r in read_journal(jpath) if isinstance(r.record, AdapterChange)]
        pub = [r for r in recs if r.name == now.name and str(r.after) == "published"]
        assert pub and any("'step': 7" in e for e in pub[0].evidence)
        # The files gone: nothing claimed, policy is the base's until a new adapter.
        import shutil

        shutil.rmtree(now.path)
        m3 = AdapterManager(peft_vllm(base)[1], rep.controller, base_model=base,
                            store=tmp_path / "store3", max_rank=8)
        _restore_adapters(m3, str(jpath))
        assert m3.current is None and m3.is_adapter(now.name)
    finally:
        f.coord.close()


def test_a_restarted_fleet_restores_names_and_the_adapter_all_replicas_published(
        rig: dict[str, Any], adapters: dict[int, Path], base: Path, tmp_path: Path) -> None:
    from rolloutcore.core.adapters import AdapterChange

    f, fa = rig["fleet"], rig["fa"]
    fa.update(adapters[1], _prov(1))
    last = fa.update(adapters[2], _prov(2)).version
    changes = {n: [r.record for r in rep.journal.records
                   if isinstance(r.record, AdapterChange)]
               for n, rep in f.coord.replicas.items()}
    f2 = fake_fleet(2)
    try:
        engines = {n: peft_vllm(base)[1] for n in f2.coord.replicas}
        fa2 = FleetAdapters(f2.coord, lambda rep: AdapterManager(
            engines[rep.name], rep.controller, base_model=base,
            store=tmp_path / "s2" / rep.name, max_rank=8), base_model=base)
        was = fa2.restore(changes)
        assert was is not None and was.name == last.name
        assert fa2.current is None and not any(fa2.eligible(n) for n in fa2.managers)
        again = fa2.update(Path(was.path), _prov(3)).version
        assert again.content_digest == last.content_digest
        assert again.generation > last.generation
        assert all(m.is_adapter(last.name) for m in fa2.managers.values())
        # Replicas that disagree (one never published it): nothing to republish.
        assert FleetAdapters(f2.coord, lambda rep: AdapterManager(
            engines[rep.name], rep.controller, base_model=base,
            store=tmp_path / "s3" / rep.name, max_rank=8), base_model=base).restore(
            {"r0": changes["r0"], "r1": []}) is None
    finally:
        f2.coord.close()


def _lora_calls(fake: Any) -> list[tuple[str, str]]:
    return [c for c in fake.received if c[1] in (Routes.LOAD_LORA, Routes.UNLOAD_LORA)]


def test_a_replica_without_room_refuses_before_anything_is_loaded_anywhere(
        rig: dict[str, Any], adapters: dict[int, Path]) -> None:
    """The budget (3 loaded) is checked on every replica before any load: on r1 two
    superseded adapters are held by running requests, so a fourth would not fit there."""
    fa: FleetAdapters = rig["fa"]
    r1 = fa.managers["r1"]
    fa.update(adapters[1], _prov(1))
    fa.update(adapters[2], _prov(2))
    r1.admit("on-2")
    fa.update(adapters[3], _prov(3))
    r1.admit("on-3")
    fa.update(adapters[1], _prov(4))        # same files, a new version: a new name
    before = _state(fa)
    loads = {n: _lora_calls(e) for n, e in rig["engines"].items()}
    with pytest.raises(UpdateRefused, match="does not fit on r1") as exc:
        fa.update(adapters[2], _prov(5))
    assert "r0:" not in str(exc.value)       # r0 had room
    assert _state(fa) == before
    assert {n: _lora_calls(e) for n, e in rig["engines"].items()} == loads
    r1.complete("on-2")
    r1.complete("on-3")
    assert fa.update(adapters[2], _prov(6)).version.replicas == ("r0", "r1")


def test_a_publish_that_breaks_off_mid_loop_leaves_no_replica_answering_for_it(
        rig: dict[str, Any], adapters: dict[int, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """#47 symptom 11: the publish on r1 raises after r0 published: the fleet keeps its
    adapter, r1's verified copy is unloaded, r0 (which holds the new one) takes no policy
    request until an adapter update passes on it."""
    fa: FleetAdapters = rig["fa"]
    first = fa.update(adapters[1], _prov(1)).version

    def broken(*a: Any, **kw: Any) -> Any:
        raise UpdateFailed("publish", "no_mutation", "READY", "the replica's loop broke")

    monkeypatch.setattr(fa.managers["r1"], "publish", broken)
    with pytest.raises(FleetAdapterFailed) as exc:
        fa.update(adapters[2], _prov(2))
    err = exc.value
    assert err.classification == "ambiguous" and "tainted" in err.outcomes["r0"]
    assert fa.current == first
    assert fa.managers["r0"].current is not None and fa.managers["r0"].current.name == err.name
    assert not fa.eligible("r0") and fa.status()["replicas"]["r0"]["tainted"]
    assert fa.managers["r1"].view.states[err.name] is AdapterState.REFUSED
    assert err.name not in rig["engines"]["r1"].loras and fa.eligible("r1")
    monkeypatch.undo()
    nxt = fa.update(adapters[3], _prov(3)).version
    assert fa.current == nxt and fa.eligible("r0") and fa.eligible("r1")
