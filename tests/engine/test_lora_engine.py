"""LoRA-adapter versions on a real vLLM (CPU build): one engine for the whole module.

The engine runs with ``--enable-lora`` and runtime adapter loading; the
session's HTTP client goes through a ``FaultProxy`` (everything passes
untouched unless a test injects a fault). Each adapter is PEFT rank 8 on
every projection of the tiny Llama, its B matrices random (std 0.05): it moves
the probe's log-probabilities by about 0.45 nats from the base's, two orders
of magnitude above the probe's tolerance.

Negative controls, each must be caught: the engine serving the base through a
"loaded" adapter (the files hold the untrained adapter: zeros), a load route
that answers 200 and loads nothing, a name the engine already holds, KV of one
adapter version reused by another (0 cross-version prefix hits; the in-place
reload that would reuse it is shown to), a bad adapter directory, a load
beyond the slot budget.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from helpers.gateway_rig import uvicorn_thread
from rolloutcore.core.adapters import AdapterConfig, AdapterState
from rolloutcore.core.records import RequestUpdate
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.wire import prefix_cache_delta
from rolloutcore.errors import BadInput, RequestRejected, UpdateFailed, UpdateRefused
from rolloutcore.session import EngineSession
from rolloutcore.testing.faultproxy import Fault, FaultProxy
from rolloutcore.testing.models import make_adapter
from rolloutcore.transports.gloo import GlooTransport

pytestmark = pytest.mark.engine

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

LORA_ARGS = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
PROMPT = [(7 * i + 3) % 250 + 1 for i in range(300)]   # > 2 KV blocks of 128


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    eng = engine_factory(tiny_models.A, extra_args=LORA_ARGS, env=LORA_ENV)
    proxy = FaultProxy(eng.base_url).start()
    direct = VllmHTTP(eng.base_url, timeout_s=120.0)
    tmp = tmp_path_factory.mktemp("lora")
    s = EngineSession(VllmHTTP(proxy.base_url, timeout_s=120.0), GlooTransport(), engine=eng,
                      journal_path=tmp / "journal.jsonl")
    try:
        s.bootstrap(tiny_models.A, Provenance("A", "tests", 0))
        s.enable_adapters(store=tmp / "store",
                          config=AdapterConfig(max_loaded=4, max_staleness=1))
        yield {"session": s, "proxy": proxy, "engine": eng, "tmp": tmp,
               "base": tiny_models.A, "direct": direct}
    finally:
        s.close()   # stops the engine
        proxy.stop()
        direct.close()
        engine_factory.stop(eng)


_step = iter(range(1, 10_000))


def _update(s: EngineSession, adapter: Any, **kw: Any) -> Any:
    return s.update_adapter(adapter, Provenance("lora", "tests", next(_step)), **kw)


def _listed(s: EngineSession) -> set[str]:
    return {n for n, p in s.http.models().items() if p}


def test_adapter_update_is_verified_published_and_journaled(rig: dict[str, Any]) -> None:
    s: EngineSession = rig["session"]
    assert s.adapters is not None
    res = _update(s, make_adapter(rig["base"], 1))
    v = res.version
    assert s.adapters.current == v and v.base == s.controller.committed.label
    assert v.name.startswith(f"rcl-{v.generation}-{v.content_digest[:16]}")
    checks = {c.name: c for c in res.checks}
    assert set(checks) == {"listed", "content", "adapter-probe", "base-probe"}
    assert all(c.passed for c in checks.values())
    assert checks["adapter-probe"].max_abs_diff < checks["adapter-probe"].tolerance
    assert v.name in _listed(s)
    s.journal.sync()
    recs = [json.loads(line) for line in (rig["tmp"] / "journal.jsonl").read_text().splitlines()]
    mine = [r["data"] for r in recs if r["kind"] == "adapter" and r["data"]["name"] == v.name]
    assert [m["after"] for m in mine] == ["loading", "verifying", "published"]
    assert all(m["content_digest"] == v.content_digest for m in mine)
    assert any("adapter-probe" in e for e in mine[-1]["evidence"])
    # The base lifecycle never left READY: no drain, no pause, no update of the base.
    assert not any(r["kind"] == RequestUpdate.KIND for r in recs)


@pytest.mark.slow  # about 95 s on the shared 2-core machine: the traffic runs across updates
def test_no_drain_nothing_mixed_and_old_adapters_retired(rig: dict[str, Any]) -> None:
    """Requests keep running on adapter N while N+1 is loaded, verified and published
    beside them; new requests get N+1; N is unloaded once outside max_staleness and
    nothing bound to it runs.

    And a negative control the engine itself supplies: vLLM 0.32's CPU LoRA kernels
    give a base request batched with adapter requests the last slot's adapter, so the
    base probe (``required``) refuses an update made beside adapter traffic; with
    ``when_idle`` the base probe is skipped then, and the evidence says so.
    """
    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None
    old = _update(s, make_adapter(rig["base"], 2)).version
    b = m.admit("long-on-old")
    assert b.model == old.name and b.base.version == s.controller.committed
    gens: list[Any] = []
    stop = threading.Event()

    def traffic() -> None:   # one bound rollout, generating until told to stop
        while not stop.is_set():
            gens.append(s.http.generate(PROMPT[:40], max_tokens=64, ignore_eos=True,
                                        model=b.model, timeout_s=300))

    # The trainer-side work (digest, reference) is done before the traffic starts.
    first = m.prepare(make_adapter(rig["base"], 3), Provenance("lora", "tests", 100))
    th = threading.Thread(target=traffic)
    th.start()
    try:
        while not gens:
            time.sleep(0.05)
        with pytest.raises(UpdateFailed, match="base-probe") as exc:
            m.apply(first)
        assert "adapter requests in flight" in str(exc.value)
        assert m.current == old and first.version.name not in _listed(s)
        m.base_probe = "when_idle"
        res = m.update(make_adapter(rig["base"], 3), Provenance("lora", "tests", 101))
        new = res.version
        n_before_publish = len(gens)
        assert not res.base_verified and "not run" in res.notes[0]
        assert m.view.bound.get(old.name) == 1 and m.current == new
        nb = m.admit("new-request")
        assert nb.model == new.name
        m.complete("new-request")
        while len(gens) < n_before_publish + 1:   # traffic went on across the publish
            time.sleep(0.05)
    finally:
        stop.set()
        th.join(300)
        m.base_probe = "required"
    assert th.is_alive() is False and len(gens) >= 2
    # Every token of every request on the old adapter was computed by it: scored
    # through it they match the engine's own log-probabilities, through the new one not.
    for g in (gens[0], gens[-1]):
        seq = PROMPT[:40] + list(g.token_ids)
        diffs = {}
        for name in (old.name, new.name):
            lp = s.http.score(seq, model=name)[40:]
            diffs[name] = max(abs(a - x) for a, x in zip(lp, g.logprobs or (), strict=True)
                              if a is not None)
        assert diffs[old.name] < 0.05 < diffs[new.name], diffs
    # Retirement: one superseded adapter is kept (max_staleness=1), older ones go once free.
    third = _update(s, make_adapter(rig["base"], 4)).version
    assert m.view.states[old.name] is AdapterState.STANDBY   # still bound: kept
    m.complete("long-on-old")
    assert m.view.states[old.name] is AdapterState.RETIRED
    assert old.name not in _listed(s) and new.name in _listed(s)
    assert m.current == third and not Path(old.path).exists()


def test_silent_noop_load_is_caught(rig: dict[str, Any]) -> None:
    """Two ways an engine ends up serving the base under an adapter's name, both refused."""
    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None
    current = m.current
    listed = _listed(s)
    refused_before = {n for n, st in m.view.states.items() if st is AdapterState.REFUSED}
    # (1) The files hold the untrained adapter (PEFT's zero B: the base), the trainer's
    # model the trained one (OpenPipe/ART #661; verl #7495's adapter that never arrived).
    trained = make_adapter(rig["base"], 5)
    stale_dir = rig["tmp"] / "stale"
    make_adapter(rig["base"], 5, std=0.0).save_pretrained(stale_dir)
    with pytest.raises(UpdateFailed, match="adapter-probe") as exc:
        _update(s, stale_dir, reference=trained)
    assert exc.value.classification == "no_mutation"
    assert m.current == current and _listed(s) == listed
    # (2) The load route answers 200 and loads nothing.
    rig["proxy"].inject("/v1/load_lora_adapter", Fault.swallow(), times=1)
    with pytest.raises(UpdateFailed, match="does not list"):
        _update(s, make_adapter(rig["base"], 6))
    assert m.current == current and _listed(s) == listed
    refused = {n for n, st in m.view.states.items() if st is AdapterState.REFUSED}
    assert len(refused - refused_before) == 2


def test_reused_name_is_refused(rig: dict[str, Any]) -> None:
    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None
    current = m.current
    assert current is not None
    # vLLM itself refuses a name it holds (without load_inplace, which we never send).
    with pytest.raises(RequestRejected, match="400"):
        s.http.load_lora_adapter(current.name, current.path)
    # A name someone else loaded on the engine (another controller) is never reused,
    # even when it is exactly the one this manager would pick: refused before the load.
    adapter = make_adapter(rig["base"], 7)
    prepared = m.prepare(adapter, Provenance("lora", "tests", 900))
    rig["direct"].load_lora_adapter(prepared.version.name, current.path)
    n_loads = rig["proxy"].requests("/v1/load_lora_adapter")
    with pytest.raises(UpdateRefused, match="used before"):
        m.apply(prepared)
    assert rig["proxy"].requests("/v1/load_lora_adapter") == n_loads   # nothing sent
    assert m.current == current
    rig["direct"].unload_lora_adapter(prepared.version.name)


def test_no_kv_reuse_across_adapter_versions(rig: dict[str, Any]) -> None:
    """Distinct names and paths per version: 0 prefix-cache hits across versions.

    The control's own negative: an in-place reload under one name (what a
    name-per-run scheme does) does hit the old version's blocks.
    """
    s: EngineSession = rig["session"]
    direct: VllmHTTP = rig["direct"]
    a = _update(s, make_adapter(rig["base"], 8)).version

    def hits(model: str) -> float:
        before = direct.metrics()
        direct.generate(PROMPT, max_tokens=1, model=model)
        return prefix_cache_delta(before, direct.metrics()).hits

    hits(a.name)
    assert hits(a.name) > 0            # the cache works through an adapter
    b = _update(s, make_adapter(rig["base"], 9)).version
    assert hits(b.name) == 0           # the next version never sees a's blocks
    # The negative: the same name reloaded in place with other weights reuses them.
    other = rig["tmp"] / "inplace"
    make_adapter(rig["base"], 10).save_pretrained(other)
    direct.load_lora_adapter("inplace-run", str(other))
    hits("inplace-run")
    make_adapter(rig["base"], 11).save_pretrained(other)
    r = httpx.post(f"{direct.base_url}/v1/load_lora_adapter",
                   json={"lora_name": "inplace-run", "lora_path": str(other),
                         "load_inplace": True}, timeout=60)
    assert r.status_code == 200, r.text
    assert hits("inplace-run") > 0     # stale KV of the previous weights under that name
    direct.unload_lora_adapter("inplace-run")


def test_bad_adapter_and_budget_refused_with_no_state_change(rig: dict[str, Any]) -> None:
    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None

    def state() -> Any:
        return (m.view.current, dict(m.view.states), _listed(s),
                rig["proxy"].requests("/v1/load_lora_adapter"), m.table.next_generation)

    before = state()
    empty = rig["tmp"] / "empty"
    empty.mkdir()
    for bad, match in ((empty, "adapter_config"), (rig["tmp"] / "missing", "does not exist"),
                       (42, "PEFT model or an adapter directory")):
        with pytest.raises(BadInput, match=match):
            _update(s, bad)
        assert state() == before
    big = peft.get_peft_model(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(rig["base"]),
        peft.LoraConfig(r=16, target_modules=["q_proj"]))
    with pytest.raises(BadInput, match="max-lora-rank 8"):
        _update(s, big)
    assert state() == before
    # The slot budget: bind a request to each of three versions, so that with the
    # current one four are loaded; the next load is refused before anything is sent.
    for i in range(3):
        m.admit(f"pin-{i}")
        _update(s, make_adapter(rig["base"], 12 + i))
    assert len(m.table.loaded()) == 4, m.view
    full = state()
    with pytest.raises(UpdateRefused, match="budget is 4"):
        _update(s, make_adapter(rig["base"], 15))
    assert state() == full
    for i in range(3):
        m.complete(f"pin-{i}")
    _update(s, make_adapter(rig["base"], 15))   # fits once they are released and retired
    assert len(m.table.loaded()) == 2, m.view   # the current one and max_staleness=1


def test_gateway_routes_policy_to_the_current_adapter(rig: dict[str, Any]) -> None:
    from rolloutcore.service import ServiceConfig, create_app

    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None
    cur = m.current
    assert cur is not None
    app = create_app(s.runner, ServiceConfig(upstream_url=rig["engine"].base_url,
                                             control_token="t" * 32),
                     adapters=m)
    body = {"model": "policy", "prompt": PROMPT[:20], "max_tokens": 4, "temperature": 0}
    with uvicorn_thread(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        info = r.json()["rolloutcore"]
        assert info["adapter"] == cur.name and info["adapter_digest"] == cur.content_digest
        assert r.headers["x-rolloutcore-adapter"] == cur.name
        assert r.json()["model"] == cur.name     # vLLM served it through the adapter
        nxt = _update(s, make_adapter(rig["base"], 16)).version
        r2 = c.post("/v1/completions", json=body)
        assert r2.json()["rolloutcore"]["adapter"] == nxt.name
        assert m.view.bound == {}                 # both released by the data plane
        r3 = c.post("/v1/completions", json={**body, "model": nxt.name})
        assert r3.status_code == 400 and "ask for model 'policy'" in r3.text
        r4 = c.post("/v1/completions", json={**body, "prompt_logprobs": 0})
        assert r4.status_code == 400 and "prompt log-probabilities" in r4.text
        # The trainer protocol: the trainer saves the adapter, the gateway publishes it.
        auth = {"authorization": "Bearer " + "t" * 32}
        saved = rig["tmp"] / "via-gateway"
        make_adapter(rig["base"], 17).save_pretrained(saved)
        prov = {"checkpoint": "lora", "trainer_run": "tests", "step": 700}
        assert c.post("/control/adapters", json={"adapter_dir": str(saved),
                                                 "provenance": prov}).status_code == 401
        bad = c.post("/control/adapters", headers=auth,
                     json={"adapter_dir": str(rig["tmp"] / "nowhere"), "provenance": prov})
        assert bad.status_code == 400 and "does not exist" in bad.text
        assert m.current == nxt
        pub = c.post("/control/adapters", headers=auth,
                     json={"adapter_dir": str(saved), "provenance": prov})
        assert pub.status_code == 200, pub.text
        name = pub.json()["version"]["name"]
        assert m.current is not None and m.current.name == name
        assert c.get("/control/adapters", headers=auth).json()["current"]["name"] == name
        r5 = c.post("/v1/completions", json=body)
        assert r5.json()["rolloutcore"]["adapter"] == name


def test_full_update_of_the_base_under_adapters(rig: dict[str, Any],
                                                tiny_models: TinyModels) -> None:
    """A full update of the base on the LoRA engine publishes (the transfer sees through
    vLLM's LoRA wrappers); adapters verified on the old base are then refused admission
    until an adapter is verified on the new one."""
    from rolloutcore.errors import AdmissionRefused

    s: EngineSession = rig["session"]
    m = s.adapters
    assert m is not None and m.current is not None
    old_base = s.controller.committed
    res = s.update(tiny_models.B, Provenance("B", "tests", 500))
    assert res.version.generation == old_base.generation + 1
    with pytest.raises(AdmissionRefused, match="verified on base"):
        m.admit("on-stale-adapter")
    assert m.view.bound == {} and not s.controller.active
    m.set_base(tiny_models.B)
    new = _update(s, make_adapter(tiny_models.B, 20)).version
    assert new.base == res.version.label
    b = m.admit("on-new-base")
    assert b.base.version == res.version and b.model == new.name
    m.complete("on-new-base")
