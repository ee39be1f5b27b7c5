"""A fleet of two real vLLM servers behind the fleet gateway (CPU, tiny Llama).

One module-scoped fleet (two engines started on A, a third cold-started on B
for the reference and stopped at once, all three in parallel) serves every
test here, in order:

* a synchronous update to B under continuous client load: every answer's
  version equals its vLLM ``weight_versions`` spans and its binding; nothing
  is admitted on any replica between ``fleet_closed`` and ``fleet_publish``;
  one fan-out broadcast reached both engines, which then reproduce the
  cold-started B bit for bit (greedy tokens, logprobs, engine checksums);
* a rolling update back to A with ``min_serving`` = 1: the serving count
  sampled from ``/control/status`` never drops below it, two versions serve
  at once, ``any`` never fails, ``latest`` and ``max-staleness:0`` get only
  the newest version or a 503, ``pinned:`` only its version, then 410;
* bad routing input: a clear 4xx, nothing admitted anywhere.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fleettools_engine import Load, Sampler, greedy

from enginetools import TinyModels
from helpers.gateway_rig import TOKEN, uvicorn_thread
from rolloutcore.core.pool import FleetClosed, FleetPublish
from rolloutcore.core.records import Admit
from rolloutcore.core.versions import EngineIdentity
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.fleet import FleetConfig, FleetCoordinator
from rolloutcore.fleet.gateway import (
    FLEET_LABEL_HEADER,
    FLEET_VERSION_HEADER,
    REPLICA_HEADER,
    create_fleet_app,
)
from rolloutcore.fleet.placement import (
    build_fleet,
    cpu_binding,
    prepare_checkpoint,
    start_all,
)
from rolloutcore.service import ServiceConfig
from rolloutcore.service.proxy import BODY_FIELD, VERSION_HEADER
from rolloutcore.service.recording import GatewayRecorder
from rolloutcore.transports.net import free_port

# Three vLLM servers per module on a 2-core host: the slow lane (scripts/test.sh --slow).
pytestmark = [
    pytest.mark.engine,
    pytest.mark.slow,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

AUTH = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class Fleet:
    coord: FleetCoordinator
    engines: list[ManagedEngine]
    url: str
    ref_b: list[tuple[list[int], list[float]]]
    models: TinyModels
    recorder: GatewayRecorder
    trajectories: Path
    journals: Path


@pytest.fixture(scope="module")
def fleet(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    logs = tmp_path_factory.mktemp("fleet-logs")
    # Each engine's worker on its own core (vLLM's CPU default puts them all on one).
    engines = [ManagedEngine(tiny_models.A, port=free_port(), log_dir=logs / f"e{i}",
                             startup_timeout_s=600, env=cpu_binding(i, 2)) for i in range(2)]
    ref = ManagedEngine(tiny_models.B, backend=None, log_dir=logs / "ref", startup_timeout_s=600,
                        env=cpu_binding(1, 2))
    everything = [*engines, ref]
    coord = None
    try:
        start_all({"e0": engines[0].start, "e1": engines[1].start, "ref": ref.start},
                  progress=True, timeout_s=660)
        ref_b = greedy(ref.base_url)
        ref.stop()
        journals = tmp_path_factory.mktemp("fleet-journals")
        coord = build_fleet(engines, checkpoint=tiny_models.A, op_timeout_s=30,
                            config=FleetConfig(health_interval_s=0.5), journal_dir=journals)
        traj = tmp_path_factory.mktemp("fleet-record") / "trajectories.jsonl"
        ids = {n: EngineIdentity("0.32.0", "policy", {}, str(r.url))
               for n, r in coord.replicas.items()}
        recorder = GatewayRecorder(traj, ids["e0"], engines=ids)
        app = create_fleet_app(coord, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                                    control_token=TOKEN),
                               on_finished=recorder)
        with uvicorn_thread(app) as url:
            yield Fleet(coord, engines, url, ref_b, tiny_models, recorder, traj, journals)
        recorder.close()
    finally:
        if coord is not None:
            with contextlib.suppress(Exception):
                coord.close()
        for e in everything:
            e.stop()


#: Every answer of the recorded load tests, by rollout id (the record test compares).
ANSWERED: dict[str, Any] = {}


def _admits(coord: FleetCoordinator) -> list[tuple[str, float]]:
    out = []
    for name, rep in coord.replicas.items():
        out += [(name, r.t_mono) for r in rep.journal.records if isinstance(r.record, Admit)]
    return out


def _check_answer(a: Any) -> str:
    """The version an answer says it was made by, checked four ways; returns it.

    vLLM's own per-token spans, the engine version header and body field, and the
    fleet's: the fleet version and replica the answer names are those the pool
    had the replica serve that engine version as (its label is the fleet label,
    suffixed when the engine had used it, or vLLM's ``default`` for version 0).
    """
    label = a.headers[VERSION_HEADER.lower()]
    spans = a.body["choices"][0]["weight_versions"]
    assert spans and {s["version"] for s in spans} == {label}, (spans, label)
    info = a.body[BODY_FIELD]
    assert info["version"] == label
    assert str(info["fleet_version"]) == a.headers[FLEET_VERSION_HEADER]
    assert info["replica"] == a.headers[REPLICA_HEADER]
    fleet_label = a.headers[FLEET_LABEL_HEADER]
    assert info["fleet_label"] == fleet_label
    assert label.split(".")[0] == fleet_label or (fleet_label == "fleet-0"
                                                  and label == "default"), (label, fleet_label)
    ANSWERED[info["rollout_id"]] = a
    return str(label)


def test_synchronous_update_under_load_publishes_b_everywhere(fleet: Fleet) -> None:
    before = greedy(fleet.engines[0].base_url)
    assert before != fleet.ref_b                      # A and B really differ
    wb = prepare_checkpoint(fleet.models.B)
    with Load(fleet.url, ["any", "any", "latest"], record="sync") as load:
        time.sleep(1.5)
        res = fleet.coord.update(wb, strategy="synchronous")
        time.sleep(1.5)
    assert not load.errors
    assert res.published is not None and res.published.label == "fleet-1"
    assert res.transfer == "fanout" and res.outcomes == {"e0": "passed", "e1": "passed"}
    ok = [a for a in load.answers if a.status == 200]
    assert {a.status for a in load.answers} <= {200, 503}
    labels = {}
    for a in ok:
        label = _check_answer(a)
        labels[a.headers[FLEET_VERSION_HEADER]] = labels.get(
            a.headers[FLEET_VERSION_HEADER], set()) | {label}
    assert labels == {"0": {"default"}, "1": {"fleet-1"}}, labels
    assert [a for a in load.answers if a.status == 503], "the transition closed admission"
    assert all(a.headers.get("retry-after") for a in load.answers if a.status == 503)
    # Nothing admitted anywhere between the fleet closing and the publish.
    j = fleet.coord.journal.records
    closed = next(r.t_mono for r in j if isinstance(r.record, FleetClosed))
    published = next(r.t_mono for r in j if isinstance(r.record, FleetPublish))
    during = [(n, t) for n, t in _admits(fleet.coord) if closed <= t <= published]
    assert not during, during
    # Each replica computes what a cold start on B computes, bit for bit.
    for e in fleet.engines:
        assert greedy(e.base_url) == fleet.ref_b
    sums = []
    for e in fleet.engines:
        with VllmHTTP(e.base_url) as h:
            sums.append(h.weight_checksums())
    assert sums[0].digests == sums[1].digests
    assert sums[0].total > len(sums[0].unverifiable) > 0 or sums[0].total > 0
    st = httpx.get(f"{fleet.url}/control/status", headers=AUTH).json()
    assert st["versions_served"] == {"fleet-1": 2}
    assert {r["engine_version"]["label"] for r in st["replicas"]} == {"fleet-1"}


def test_rolling_update_keeps_min_serving_and_routes_by_policy(fleet: Fleet) -> None:
    assert fleet.coord.newest is not None and fleet.coord.newest.label == "fleet-1"
    wa = prepare_checkpoint(fleet.models.A)
    with Sampler(fleet.url, TOKEN) as s, Load(fleet.url, [
            "any", "any", "latest", "max-staleness:0", "pinned:fleet-1"], pause_s=0.02,
            record="roll") as load:
        time.sleep(1.0)
        t_roll = time.monotonic()
        res = fleet.coord.update(wa, strategy="rolling", min_serving=1, label="fleet-2")
        t_end = time.monotonic()
        time.sleep(1.0)
    assert not load.errors
    assert res.waves == [("e0",), ("e1",)] and res.published is not None
    assert s.samples and min(st["serving"] for _, st in s.samples) >= 1
    # Two versions serve during the roll: with two replicas and waves of one, the old
    # one answers while the first wave updates and the new one while the second does
    # (the waves follow each other at once, so the two rarely serve in the same instant).
    assert {lbl for t, st in s.samples if t_roll <= t <= t_end
            for lbl in st["versions_served"]} == {"fleet-1", "fleet-2"}
    anys = load.of("any")
    assert anys and all(a.status == 200 for a in anys), [a.status for a in anys]
    assert {a.headers[FLEET_VERSION_HEADER] for a in anys
            if t_roll <= a.sent <= t_end} == {"1", "2"}
    for a in anys:
        _check_answer(a)
    pub2 = next(r.t_mono for r in fleet.coord.journal.records
                if isinstance(r.record, FleetPublish) and r.record.generation == 2)
    for pol in ("latest", "max-staleness:0"):
        got = load.of(pol)
        assert got and {a.status for a in got} <= {200, 503}
        for a in got:
            if a.status == 200:
                _check_answer(a)
                gen = int(a.headers[FLEET_VERSION_HEADER])
                # newest is 1 until pub2, 2 after: an answer routed in between may be either
                assert gen in (1, 2)
                if a.sent > pub2:
                    assert gen == 2, (pol, a.sent - pub2)
                if a.done < pub2:
                    assert gen == 1, (pol, a.done - pub2)
    pinned = load.of("pinned:fleet-1")
    for a in pinned:
        if a.status == 200:
            _check_answer(a)
    assert {a.status for a in pinned} <= {200, 503, 410}
    assert all(a.headers[FLEET_VERSION_HEADER] == "1" for a in pinned if a.status == 200)
    assert [a for a in pinned if a.status == 200]
    gone = httpx.post(f"{fleet.url}/inference/v1/generate", timeout=60, headers={
        "x-rolloutcore-policy": "pinned:fleet-1"}, json={
        "model": "policy", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert gone.status_code == 410
    for e in fleet.engines:
        assert greedy(e.base_url) != fleet.ref_b
    assert {a.headers[REPLICA_HEADER] for a in anys} == {"e0", "e1"}


def test_every_answered_sample_is_recorded_and_the_audit_passes(fleet: Fleet) -> None:
    """``--record`` through the fleet: the two updates' answers, one sample each, each
    with its replica, engine version and fleet version, and the audit of the file against
    the fleet's journals (the pool's and each engine's) finds nothing."""
    from rolloutcore.provenance.audit import audit_file
    from rolloutcore.provenance.recorder import read_groups

    assert fleet.recorder.flush(60)
    samples = {s.binding.rollout_id: s for g in read_groups(fleet.trajectories)
               for s in g.samples}
    assert len(ANSWERED) > 50
    assert set(samples) == set(ANSWERED), (len(samples), len(ANSWERED))
    for rid, s in samples.items():
        a = ANSWERED[rid]
        assert s.fleet is not None and s.attribution.attributable
        assert (s.fleet.replica, str(s.fleet.fleet_version), s.fleet.fleet_label) == (
            a.headers[REPLICA_HEADER], a.headers[FLEET_VERSION_HEADER],
            a.headers[FLEET_LABEL_HEADER])
        assert s.binding.version.label == a.headers[VERSION_HEADER.lower()]
        assert s.completion.span_versions == (s.binding.version.label,)
    report = audit_file(fleet.trajectories, fleet.journals)
    assert report.purity.ok, report.purity.format_table()
    assert report.purity.unattributable == 0
    assert set(report.purity.replicas) == {"e0", "e1"}
    st = fleet.recorder.stats()["counts"]
    assert st.get("committed") == len(samples) and not st.get("failed")


@pytest.mark.parametrize("headers,status", [
    ({"x-rolloutcore-policy": "fastest"}, 400),
    ({"x-rolloutcore-policy": "pinned:never-published"}, 404),
    ({"x-rolloutcore-policy": "min-version:99"}, 409),
    ({"x-rolloutcore-policy": "max-staleness:-1"}, 400),
    ({"x-rolloutcore-group": "two words"}, 400),
])
def test_bad_routing_input_is_a_4xx_and_nothing_is_routed(fleet: Fleet,
                                                          headers: dict[str, str],
                                                          status: int) -> None:
    n = len(_admits(fleet.coord))
    r = httpx.post(f"{fleet.url}/inference/v1/generate", headers=headers, timeout=60, json={
        "model": "policy", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert len(_admits(fleet.coord)) == n
    metrics = httpx.get(f"{fleet.url}/metrics").text
    assert f'rolloutcore_route_refused_total{{status="{status}"}}' in metrics


def test_status_and_metrics_name_each_replica(fleet: Fleet) -> None:
    st = httpx.get(f"{fleet.url}/control/status", headers=AUTH).json()
    assert [r["name"] for r in st["replicas"]] == ["e0", "e1"]
    assert all(r["state"] == "SERVING" and r["engine_state"] == "READY" for r in st["replicas"])
    m = httpx.get(f"{fleet.url}/metrics").text
    newest = st["newest"]["generation"]
    assert f"rolloutcore_fleet_newest_generation {float(newest)}" in m
    assert 'rolloutcore_fleet_replica_active_rollouts{replica="e0"}' in m
    assert httpx.get(f"{fleet.url}/v1/models").status_code == 200   # passed through
    assert Path(fleet.models.A).is_dir()


def test_a_restarted_fleet_adopts_its_new_engines_and_continues_its_versions(
        fleet: Fleet) -> None:
    """Last in the module: the gateway goes, its engines with it; a new gateway on the same
    journal directory and two new engine processes (on A) continue the fleet."""
    from rolloutcore.control.journal import read_journal
    from rolloutcore.core.invariants import check_journal
    from rolloutcore.core.pool import FleetRestore

    before = fleet.coord.status()
    newest = fleet.coord.newest
    assert newest is not None
    labels = {n: [r.data["version"]["label"] for r in
                  read_journal(fleet.journals / f"{n}.journal.jsonl") if r.kind == "commit"]
              for n in ("e0", "e1")}
    epochs = [e.epoch for e in fleet.engines]
    fleet.coord.close()
    start_all({f"e{i}": e.restart for i, e in enumerate(fleet.engines)}, progress=True,
              timeout_s=660)
    assert [e.epoch for e in fleet.engines] != epochs
    coord = build_fleet(fleet.engines, checkpoint=fleet.models.A, op_timeout_s=30,
                        config=FleetConfig(health_interval_s=0), journal_dir=fleet.journals)
    try:
        (rest,) = coord.journal.of(FleetRestore)
        # the rolling update went back to A: the new engines hold the newest version's weights
        assert not rest.new and rest.generation == newest.generation, rest
        assert [v.label for v in coord.versions] == [v["label"] for v in before["published"]]
        assert sorted(coord.serving()) == ["e0", "e1"]
        for i, n in enumerate(("e0", "e1")):
            c = coord.replicas[n].controller
            recs = read_journal(fleet.journals / f"{n}.journal.jsonl")
            after = [r.data["version"]["label"] for r in recs if r.kind == "commit"]
            assert after[:len(labels[n])] == labels[n] and len(set(after)) == len(after)
            assert c.committed is not None and c.committed.label == after[-1]
            assert c.identity is not None and c.identity.verification.wire == "probe"
            with VllmHTTP(fleet.engines[i].base_url) as h:
                assert h.label() == c.committed.label
            assert check_journal(recs) == []
    finally:
        coord.close()
