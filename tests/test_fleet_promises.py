"""The fleet keeps every promise the single gateway keeps (issue 28), on fake engines.

Each test is one symptom a hostile review found on the fleet that was built
beside the single-engine path; each fails on that code and passes on one
control plane (``core.pool`` in ``control.shell``, the one data plane with a
router in front). The replicas are FakeEngines under their own controllers,
each behind a ``FakeVllm`` on a loopback port; the gateway is the real fleet
app, driven in process (``httpx.ASGITransport``, or ``helpers.asgi_drive``
for a hostile client).

With ``ROLLOUTCORE_FAULT_MATRIX=path`` each case's row is merged into that
fault matrix (``results/fault-matrix.json``; the same rows the real-engine
modules write; ``helpers.fault_matrix``), with ``engine: fake`` and the command
that produced it.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import anyio
import pytest

from fleettools import FakeFleet, fake_fleet, fleet_client, weights
from helpers.asgi_drive import Drive
from helpers.fault_matrix import PromiseRows
from helpers.gateway_rig import TOKEN
from rolloutcore.control.journal import Journal
from rolloutcore.core.evidence import PauseMode
from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import FleetVersion, ReplicaState, ReplicaStateChange
from rolloutcore.core.records import Admit
from rolloutcore.errors import JournalError
from rolloutcore.fleet import FleetConfig, FleetUpdateFailed
from rolloutcore.fleet.gateway import (
    FLEET_LABEL_HEADER,
    FLEET_VERSION_HEADER,
    REPLICA_HEADER,
    FleetAdmission,
)
from rolloutcore.fleet.routing import Policy
from rolloutcore.service.proxy import VERSION_HEADER
from rolloutcore.testing.fake import FakeAdapter, FakeWeights

pytestmark = pytest.mark.anyio
S = ReplicaState
GEN = "/inference/v1/generate"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


MATRIX = PromiseRows(
    "tests/test_fleet_promises.py",
    engines="FakeEngine replicas, each behind a FakeVllm on loopback HTTP; the real fleet "
            "gateway and coordinator",
    # Each case asserts these (none published unvalidated, none lost, none mislabeled).
    within_deadline=True, published_unvalidated=0, records_lost=0, mislabeled_answers=0,
    fleet=True)
_fault_matrix = MATRIX.fixture()
#: One fault-matrix row of a fleet case.
row = MATRIX.row


def gen(n: int = 4, **extra: Any) -> dict[str, Any]:
    return {"token_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": n}, **extra}


def _base(label: str) -> str:
    """A replica's engine label is its fleet label, suffixed when it used that label."""
    return label.split(".")[0]


def labelled(r: Any) -> bool:
    """The answer's fleet version, its engine version and vLLM's own spans agree."""
    spans = {s["version"] for s in r.json()["choices"][0]["weight_versions"]}
    return spans == {r.headers[VERSION_HEADER]} and (
        _base(r.headers[VERSION_HEADER]) == r.headers[FLEET_LABEL_HEADER]
        or (r.headers[FLEET_VERSION_HEADER] == "0"
            and r.headers[VERSION_HEADER] == "default"))


# --------------------------------------------------------------------------- 1. takeover

def test_an_engine_the_takeover_cannot_verify_never_joins_the_pool() -> None:
    """A paused engine holding other weights (label rc-3) is refused, as ``serve`` would."""
    other = FakeWeights.from_seed(3, step=3)

    def tamper(adapters: dict[str, FakeAdapter]) -> None:
        e = adapters["r1"].engine
        e.restart(other)
        e.label = "rc-3"
        e.pause(PauseMode.ABORT)

    f = fake_fleet(3, before_bootstrap=tamper)
    assert f.coord.state_of("r1") is S.FENCED and "r1" not in f.coord.serving()
    assert "paused" in f.coord.pool.entry("r1").reason
    assert f.coord.serving() == ["r0", "r2"]
    assert f.coord.replicas["r1"].controller.state is State.UNINITIALIZED
    for n in ("r0", "r2"):
        ident = f.coord.replicas[n].controller.identity
        assert ident is not None and ident.verification.wire == "probe"
    row("fleet_unverified_bootstrap", "a replica's engine is paused and holds other weights "
        "(label rc-3) when the fleet takes it over", "takeover refused (no_mutation)",
        "FENCED (UNINITIALIZED engine)", serving=f.coord.serving(),
        reason=f.coord.pool.entry("r1").reason[:200])


def test_an_engine_on_other_weights_is_refused_by_the_probe() -> None:
    """Not paused, label plausible, weights wrong: the policy probe of the checkpoint says so."""
    def swap(adapters: dict[str, FakeAdapter]) -> None:
        adapters["r2"].engine.restart(FakeWeights.from_seed(5, step=5))

    f = fake_fleet(3, before_bootstrap=swap)
    assert f.coord.state_of("r2") is S.FENCED
    assert "probe" in f.coord.pool.entry("r2").reason


# --------------------------------------------------------------------------- 2. one step

def test_a_stale_choice_is_never_bound_at_another_version() -> None:
    """The router chose r0 at fleet version 0; before the binding, r0 moved to version 1.
    The binding is refused at the old version and the request goes elsewhere."""
    f = fake_fleet(2)
    adm = FleetAdmission(f.coord, Policy.parse("any"))
    stale = f.coord.view()
    f.coord.update(weights(1), strategy="rolling", min_serving=1)
    f.coord.update(weights(2), strategy="rolling", min_serving=1)   # both engines moved
    real = f.coord.view
    calls = {"n": 0}

    def first_stale() -> Any:
        calls["n"] += 1
        return stale if calls["n"] == 1 else real()

    f.coord.view = first_stale  # type: ignore[method-assign]
    b, t = adm.try_admit("r-stale", (Policy.parse("any"), None))
    assert calls["n"] == 2                        # the stale choice refused, chosen again
    assert t.info["fleet_version"] == 2 and b.version.label.startswith("fleet-2")
    assert b.version == f.coord.replicas[t.name].controller.committed


async def test_no_answer_is_labelled_with_another_version_under_rolling_updates() -> None:
    """Back-to-back rolling updates, a queue, clients of every policy: every answer's fleet
    version, engine version and spans agree (the review counted 15 of 5,943 that did not)."""
    async with fleet_client(3, queue_max=64, queue_wait_s=20) as (f, client, fakes):
        stop = threading.Event()
        done: list[int] = []

        def roll() -> None:
            seed = 1
            while not stop.is_set() and seed < 7:
                f.coord.update(weights(seed), strategy="rolling", min_serving=1)
                done.append(seed)
                seed += 1

        th = threading.Thread(target=roll, daemon=True)
        th.start()
        answers: list[Any] = []

        async def one(policy: str) -> None:
            while not stop.is_set():
                r = await client.post(GEN, json=gen(3), headers={"x-rolloutcore-policy":
                                                                 policy})
                answers.append(r)
                await anyio.sleep(0)

        async with anyio.create_task_group() as tg:
            for p in ("any", "latest", "any", "max-staleness:1", "any", "latest"):
                tg.start_soon(one, p)
            await anyio.to_thread.run_sync(th.join, 60)
            stop.set()
        assert done == [1, 2, 3, 4, 5, 6]
        ok = [r for r in answers if r.status_code == 200]
        assert len(ok) > 30
        mislabeled = [r.headers for r in ok if not labelled(r)]
        assert mislabeled == []
        assert {r.status_code for r in answers} <= {200, 503}
        row("fleet_route_admit_race", "back-to-back rolling updates (6) under 6 clients of "
            "every policy, with a queue of 64", "answers routed and bound in one step",
            "SERVING", answers=len(answers), answered_200=len(ok),
            mislabeled_answers=len(mislabeled))


# --------------------------------------------------------------------------- 3. deadlines

async def test_a_body_that_never_ends_is_408_and_the_bound_holds() -> None:
    async with fleet_client(2, client_body_s=0.3, max_concurrent_requests=2) as (f, c, _):
        gw = c._transport.app.state.fleet  # type: ignore[attr-defined]
        app = c._transport.app  # type: ignore[attr-defined]
        stuck = [Drive(app, GEN, gen(), stall_body=True, body_parts=2) for _ in range(2)]
        for d in stuck:
            d.start()
        with anyio.fail_after(10):
            while gw.data.in_progress < 2:
                await anyio.sleep(0.005)
        over = await c.post(GEN, json=gen())
        assert over.status_code == 503 and over.headers["retry-after"] == "1"
        with anyio.fail_after(10):
            for d in stuck:
                assert d.task is not None
                await d.task
        assert [d.status for d in stuck] == [408, 408]
        assert (await c.post(GEN, json=gen())).status_code == 200
        assert all(not rep.controller.active for rep in f.coord.replicas.values())
        row("fleet_slow_body", "two request bodies that never finish arriving, at "
            "max_concurrent_requests=2", "408 at client_body_s (0.3 s); the third 503 "
            "Retry-After", "SERVING", deadline_s=0.3, statuses=[d.status for d in stuck])


async def test_a_client_that_stops_reading_is_cut_and_released() -> None:
    async with fleet_client(2, client_send_s=0.3) as (f, c, fakes):
        for fk in fakes.values():
            fk.event_delay_s = 0.01
        app = c._transport.app  # type: ignore[attr-defined]
        d = Drive(app, GEN, {**gen(200), "stream": True}, block_after=2)
        d.start()
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task
        assert all(not rep.controller.active for rep in f.coord.replicas.values())
        ends = [x.record for j in f.journals.values() for x in j.records
                if x.kind == "complete"]
        assert len(ends) == 1


# --------------------------------------------------------------------------- 4. failed closed

async def test_a_failed_closed_replica_leaves_the_pool_at_once() -> None:
    async with fleet_client(3) as (f, client, _):
        f.coord.replicas["r0"].controller.fail_closed("its journal's disk is full")
        rs = await asyncio.gather(*[client.post(GEN, json=gen()) for _ in range(10)])
        assert [r.status_code for r in rs] == [200] * 10
        assert "r0" not in {r.headers[REPLICA_HEADER] for r in rs}
        f.coord.supervise_once()
        assert f.coord.state_of("r0") is S.FENCED
        assert "failed closed" in f.coord.pool.entry("r0").reason
        row("fleet_failed_closed_replica", "one replica's controller fails closed (its "
            "journal's disk is full); 10 concurrent requests",
            "out of the routing at once, FENCED at the next round", "FENCED",
            answered_by_it=0, answered_200=10)


# --------------------------------------------------------------------------- 5. suspicion

async def test_an_answer_too_large_never_makes_a_replica_suspect() -> None:
    async with fleet_client(2, max_response_bytes=64) as (f, client, _):
        r = await client.post(GEN, json=gen(40), headers={"x-rolloutcore-group": "big"})
        assert r.status_code == 502
        name = r.headers[REPLICA_HEADER]
        ad = f.adapters[name]
        slow = {"n": 0}
        real = ad.observe_health

        def one_slow_check(**kw: Any) -> Any:   # one slow /health, as under load
            slow["n"] += 1
            if slow["n"] == 1:
                raise TimeoutError("health check overran")
            return real(**kw)

        ad.observe_health = one_slow_check  # type: ignore[method-assign]
        f.coord.supervise_once()
        assert slow["n"] == 1 and f.coord.state_of(name) is S.SERVING
        row("fleet_client_induced_suspicion", "a non-streamed answer over max_response_bytes "
            "(502), then one slow /health", "the client's answer is no engine signal: "
            "health_failures (2) still needed", "SERVING")


# --------------------------------------------------------------------------- 7. dead engine

async def test_a_dead_engine_loses_its_traffic_and_is_fenced_in_one_round() -> None:
    """Its requests fail in milliseconds, so by load alone it always looks best."""
    async with fleet_client(3) as (f, client, fakes):
        import httpx

        dead = f.coord.replicas["r2"]
        dead.url = "http://127.0.0.1:9"        # nothing listens: connections are refused
        gw = client._transport.app.state.fleet  # type: ignore[attr-defined]
        gw.data.upstreams["r2"] = type(gw.data.upstreams["r0"])(
            "http://127.0.0.1:9", max_connections=4, connect_s=1, pool_s=1, read_s=1,
            keepalive_s=1)
        f.adapters["r2"].engine.kill()
        statuses = []
        for _ in range(20):
            r = await client.post(GEN, json=gen())
            statuses.append((r.status_code, r.headers.get(REPLICA_HEADER)))
        bad = [s for s in statuses if s[0] != 200]
        assert len(bad) <= 2 and all(n == "r2" for _, n in bad), statuses
        assert f.coord._members["r2"].suspect            # its refusal was reported
        f.coord.supervise_once()
        assert f.coord.state_of("r2") is not S.SERVING
        row("fleet_dead_engine_keeps_traffic", "one replica's engine refuses connections "
            "(dead); 20 requests", "routing by recent success, fenced in one round",
            "FENCED", answered_by_dead=0, failed_requests=len(bad))
        assert isinstance(client, httpx.AsyncClient)


def test_health_checks_run_at_once_so_a_slow_one_delays_no_other() -> None:
    """r0's check hangs until r2 (dead) is found; checked one after another, it would wait
    for r0's whole check first (the review saw 5 s per engine)."""
    f = fake_fleet(3)
    f.adapters["r2"].engine.kill()
    seen = threading.Event()
    real = f.adapters["r0"].observe_health
    waited: dict[str, bool] = {}

    def slow(**kw: Any) -> Any:
        waited["r2 fenced first"] = seen.wait(5.0)
        return real(**kw)

    f.adapters["r0"].observe_health = slow  # type: ignore[method-assign]
    journal = f.coord.journal
    orig = journal.write

    def spy(rec: Any, **kw: Any) -> Any:
        if isinstance(rec, ReplicaStateChange) and rec.replica == "r2":
            seen.set()
        return orig(rec, **kw)

    journal.write = spy  # type: ignore[method-assign]
    f.coord.config = FleetConfig(health_interval_s=0, health_failures=1, heal=False)
    f.adapters["r2"].observe_health = lambda **kw: (_ for _ in ()).throw(  # type: ignore
        TimeoutError("dead"))
    f.coord.supervise_once()
    assert f.coord.state_of("r2") is S.FENCED
    assert waited == {"r2 fenced first": True}


# --------------------------------------------------------------------------- 9. no stranding

def test_a_journal_that_fails_inside_an_update_strands_no_replica() -> None:
    f = fake_fleet(3)
    j = f.coord.journal
    orig = j.write
    count = {"n": 0}

    def failing(rec: Any, **kw: Any) -> Any:
        if isinstance(rec, ReplicaStateChange) and rec.event == "selected":
            count["n"] += 1
            if count["n"] == 2:                 # between selecting and recording outcomes
                raise JournalError("cannot write: no space left on device")
        return orig(rec, **kw)

    j.write = failing  # type: ignore[method-assign]
    with pytest.raises(FleetUpdateFailed):
        f.coord.update(weights(1))
    states = {n: f.coord.state_of(n) for n in f.adapters}
    assert S.UPDATING not in states.values(), states
    st = f.coord.status()
    assert st["failed_closed"] and "no space" in st["failed_closed"]
    assert st["update"] is None and st["serving"] == 0     # fail closed: nothing routed
    for rep in f.coord.replicas.values():                   # no engine left half-way
        assert rep.controller.state in (State.READY, State.TAINTED)
        assert rep.controller.current_ticket is None
    row("fleet_journal_fails_mid_update", "the pool's journal write fails between selecting "
        "the replicas and recording their outcomes", "update ended, every replica decided "
        "from its engine; the fleet fails closed", "FENCED/SERVING, none UPDATING",
        replicas={n: v.value for n, v in states.items()}, failed_closed=st["failed_closed"])


def test_an_exception_inside_an_update_strands_no_replica() -> None:
    f = fake_fleet(3)
    rep = f.coord.replicas["r1"]
    real = rep.stage

    def broken(payload: Any) -> None:
        raise RuntimeError("a bug in a stage hook")

    rep.stage = broken
    with pytest.raises(RuntimeError):
        f.coord.update(weights(1))
    rep.stage = real
    assert S.UPDATING not in {f.coord.state_of(n) for n in f.adapters}
    for r in f.coord.replicas.values():
        assert r.controller.state is State.READY and r.controller.current_ticket is None
    assert f.coord.serving() == ["r0", "r2"] or set(f.coord.serving()) == {"r0", "r1", "r2"}
    f.coord.update(weights(1))                             # the next update goes through
    assert f.coord.newest is not None and f.coord.newest.label == "fleet-1"


# --------------------------------------------------------------------------- 10. hostile input

async def test_deep_json_is_a_400_on_the_data_and_the_update_routes() -> None:
    deep = b"[" * 50_000 + b"]" * 50_000
    async with fleet_client(2) as (f, client, _):
        for path, headers in ((GEN, {}), ("/control/fleet/updates", AUTH)):
            r = await client.post(path, content=b'{"x": ' + deep + b"}",
                                  headers={"content-type": "application/json", **headers})
            assert r.status_code == 400, (path, r.status_code, r.text[:200])
        assert not [x for j in f.journals.values() for x in j.records
                    if isinstance(x.record, Admit)]
        row("fleet_deep_json", "a 50,000-deep JSON body on the data route and on POST "
            "/control/fleet/updates", "400 on both, nothing admitted or started", "SERVING")


@pytest.mark.parametrize("header", ["x-rolloutcore-group", "x-rolloutcore-rollout-id"])
async def test_an_id_with_a_trailing_newline_is_refused(header: str) -> None:
    async with fleet_client(2) as (f, client, _):
        r = await client.post(GEN, content=json.dumps(gen()).encode(), headers={
            "content-type": "application/json"}, extensions={})
        assert r.status_code == 200
        raw = [(b"content-type", b"application/json"), (header.encode(), b"g-1\n")]
        app = client._transport.app  # type: ignore[attr-defined]
        d = Drive(app, GEN, gen())
        d.headers += raw[1:]
        d.start()
        with anyio.fail_after(10):
            assert d.task is not None
            await d.task
        assert d.status == 400


async def test_one_rollout_id_is_bound_once_fleet_wide() -> None:
    async with fleet_client(2) as (f, client, fakes):
        for fk in fakes.values():
            fk.event_delay_s = 0.05
        h = {"x-rolloutcore-rollout-id": "same-id"}
        rs = await asyncio.gather(*[client.post(GEN, json={**gen(8), "stream": True},
                                                headers=h) for _ in range(2)])
        assert sorted(r.status_code for r in rs) == [200, 409]
        admits = [x.record for j in f.journals.values() for x in j.records
                  if isinstance(x.record, Admit) and x.record.rollout_id == "same-id"]
        assert len(admits) == 1


def test_a_fleet_version_is_published_only_on_its_predecessor() -> None:
    f = fake_fleet(1)
    v = FleetVersion(5, "fleet-5", weights(5).identity, 7)
    with pytest.raises(Exception, match=r"not the one running|does not follow"):
        f.coord._shell.run(f.coord._table.publish, v, ("r0",))


def test_the_pool_journal_is_the_one_journal_format(tmp_path: Any) -> None:
    """Written by ``control.journal.Journal`` (a torn last line is repaired on reopen)."""
    path = tmp_path / "fleet.jsonl"
    f = fake_fleet(2)
    j = Journal(path)
    for r in f.coord.journal.records:
        j.write(r.record)
    j.close()
    with open(path, "a", encoding="utf-8") as fh:
        fh.write('{"v": 4, "seq": 99, "kind": "replica_st')   # a crash mid-write
    j2 = Journal(path)
    assert j2.repaired_bytes > 0
    j2.close()


def _fleet(f: FakeFleet) -> Any:
    return f.coord


# --------------------------------------------------------------------------- 6. --record

async def test_a_fleet_records_every_answered_sample_and_the_audit_checks_each(
        tmp_path: Any) -> None:
    from rolloutcore.core.versions import EngineIdentity
    from rolloutcore.provenance.audit import PurityIssue, audit_file
    from rolloutcore.provenance.recorder import read_groups
    from rolloutcore.service.recording import GatewayRecorder

    jd = tmp_path / "journals"
    jd.mkdir()
    f = fake_fleet(3, journal_dir=jd)
    engines = {n: EngineIdentity("fake", "policy", {}, f"http://fake-{n}.test")
               for n in f.adapters}
    rec = GatewayRecorder(tmp_path / "traj.jsonl", engines["r0"], engines=engines)
    answered: list[Any] = []
    async with fleet_client(fleet=f, on_finished=rec) as (_, client, fakes):
        for step in range(3):
            for i in range(4):
                r = await client.post(GEN, json=gen(3), headers={
                    "x-rolloutcore-run": "run-1", "x-rolloutcore-step": str(step),
                    "x-rolloutcore-prompt-index": str(i), "x-rolloutcore-policy": "any"})
                assert r.status_code == 200 and labelled(r)
                answered.append(r)
            f.coord.update(weights(step + 1), strategy="rolling", min_serving=2)
        assert rec.flush(10)
    rec.close()
    f.coord.close()
    samples = [s for g in read_groups(tmp_path / "traj.jsonl") for s in g.samples]
    assert len(samples) == len(answered) == 12
    by_rid = {r.headers["x-rolloutcore-rollout-id"]: r for r in answered}
    for s in samples:
        r = by_rid[s.binding.rollout_id or ""]
        assert s.fleet is not None and s.schema_version == 4
        assert (s.fleet.replica, str(s.fleet.fleet_version), s.fleet.fleet_label) == (
            r.headers[REPLICA_HEADER], r.headers[FLEET_VERSION_HEADER],
            r.headers[FLEET_LABEL_HEADER])
        assert s.engine == engines[s.fleet.replica]
    report = audit_file(tmp_path / "traj.jsonl", jd)
    assert report.purity.ok, report.purity.format_table()
    assert report.purity.journal is not None and report.purity.journal.is_fleet
    assert sum(c["samples"] for c in report.purity.replicas.values()) == 12
    # The check can fail: a sample that claims another fleet version is caught.
    import dataclasses

    from rolloutcore.provenance.audit import audit_purity

    bad = dataclasses.replace(samples[0], fleet=dataclasses.replace(
        samples[0].fleet, fleet_version=samples[0].fleet.fleet_version + 1))  # type: ignore
    found = audit_purity([bad], report.purity.journal)
    assert {x.issue for x in found.findings} == {PurityIssue.FLEET_MISMATCH}


def test_the_token_file_is_never_written_through_a_link(tmp_path: Any) -> None:
    """``--token-out`` pointed at a symbolic link: refused before any engine starts."""
    import os

    from rolloutcore.fleet.serve import FleetServeOptions, _check
    from rolloutcore.service.serve import write_token_file

    target = tmp_path / "elsewhere"
    link = tmp_path / "token"
    link.symlink_to(target)
    with pytest.raises(Exception, match="symbolic link"):
        _check(FleetServeOptions(token_out=str(link), token="t" * 20))
    ok = tmp_path / "ok-token"
    write_token_file(ok, "t" * 20)
    assert oct(os.stat(ok).st_mode & 0o777) == "0o600" and not target.exists()
    row("fleet_token_file", "--token-out names a symbolic link", "refused before anything "
        "starts; the file is written 0600, never through a link", "not started")
