"""Asynchronous update modes through the gateway, against a real vLLM (CPU): issue 29.

One paced engine (``slowstep``: 15 ms per step, so 460-token rollouts outlast
an update) on checkpoint A; per mode a gateway process
(``rolloutcore serve --upstream ... --update-mode MODE --journal --record``)
takes it over at probe level; streaming rollouts through the gateway's
``/inference/v1/generate`` while a real trainer (``RolloutCoreClient`` +
``GlooTransport``) updates A -> B through the trainer protocol.

Checked from what the clients received and what the gateway wrote:

* ``keep``: the update is granted while the rollouts are bound (no drain),
  every rollout crosses it, and its per-token versions in the body field
  equal vLLM's own ``weight_versions`` spans (and the stream's derivation
  agrees with them); the header names the admission version;
* ``recompute``: every rollout is aborted by the pause and resubmitted by the
  gateway, the client sees one answer of the full length with one finish,
  the spans cover the whole output, the second segment was salted by the
  new version, and its first token is what the new weights generate for
  prompt + output so far (asked again, afterwards, of the same engine);
* ``engine_recompute`` (vLLM's ``pause(keep, clear_cache=true)``): one request
  per rollout, and its tokens after the update are the new weights' continuation
  of prompt + output so far;
* ``keep`` with ``--max-staleness 0``: the rollouts end at the pause with an
  ``OverStalenessBound`` event, recorded unattributable;
* the trajectories the gateway recorded audit clean against its journal
  (per-token versions, salts, the stitch), and the journals check.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels, gateway_process
from rolloutcore.control.journal import read_journal
from rolloutcore.core.cache_salt import salt_label
from rolloutcore.core.invariants import check_journal
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.provenance.audit import audit_file
from rolloutcore.provenance.recorder import read_groups
from rolloutcore.service.client import RolloutCoreClient, probe_for
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

TOKEN = "engine-async-token-0123456789abcdef"
LONG = 460
PROMPTS = [[(7 * i + 3 * j) % 250 + 1 for j in range(40)] for i in range(3)]


@pytest.fixture(scope="module")
def engine(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[ManagedEngine]:
    import slowstep

    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    eng = engine_factory(tiny_models.A, extra_args=(
        "--logits-processors", "slowstep:SlowStep", "--enforce-eager"),
        env={"PYTHONPATH": path, slowstep.ENV: "0.015"})
    try:
        yield eng
    finally:
        engine_factory.stop(eng)


class Serving:
    """What the module's engine holds, and the journal of the gateway that put it there:
    each case's gateway restarts on the previous case's journal (a gateway without it
    may not adopt an engine an earlier update wrote, #47)."""

    name = "A"
    journal: Path | None = None
    before = 0   # records of earlier cases in this case's journal


def _records(journal: Path) -> list[Any]:
    """This case's journal records (the earlier cases' come first in the file)."""
    return read_journal(journal)[Serving.before:]


def _events(text: str) -> list[Any]:
    out: list[Any] = []
    for ev in text.split("\n\n"):
        ev = ev.strip()
        if ev.startswith("data:"):
            p = ev[5:].strip()
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def _run(engine: ManagedEngine, models: TinyModels, work: Path, mode: str,
         extra: tuple[str, ...] = ()) -> tuple[list[dict[str, Any]], Any, Path, Path]:
    """Three bound streams, one update A <-> B while they run: the answers, the result."""
    token_file = work / "token"
    token_file.write_text(TOKEN + "\n")
    journal, traj = work / "journal.jsonl", work / "traj.jsonl"
    if Serving.journal is not None:
        shutil.copyfile(Serving.journal, journal)
    Serving.before = len(read_journal(journal)) if journal.exists() else 0
    Serving.journal = journal
    start = models.A if Serving.name == "A" else models.B
    target, tname = (models.B, "B") if Serving.name == "A" else (models.A, "A")
    answers: list[dict[str, Any]] = [{} for _ in PROMPTS]
    progress = [0] * len(PROMPTS)
    with gateway_process(engine.base_url, start, token_file, work / "gw.log",
                         ["--update-mode", mode, "--journal", str(journal),
                          "--record", str(traj), *extra]) as (url, _proc):
        def client(i: int) -> None:
            body = {"token_ids": PROMPTS[i], "stream": True,
                    "sampling_params": {"max_tokens": LONG, "temperature": 0.0,
                                        "ignore_eos": True, "logprobs": 0}}
            hdrs = {"x-rolloutcore-run": f"async-{mode}", "x-rolloutcore-step": "0",
                    "x-rolloutcore-prompt-index": str(i)}
            text = []
            with httpx.stream("POST", f"{url}/inference/v1/generate", json=body,
                              headers=hdrs, timeout=300) as resp:
                answers[i]["status"] = resp.status_code
                answers[i]["version"] = resp.headers.get("x-rolloutcore-version")
                for line in resp.iter_lines():
                    text.append(line)
                    if '"token_ids"' in line:
                        progress[i] += 1
            answers[i]["events"] = _events("\n\n".join(text))

        # The trainer's own preparation (its probe of the target, its transport's handshake
        # with the engine) comes first, so that the update lands while the rollouts run.
        rc = RolloutCoreClient(url, TOKEN, transport=GlooTransport(), begin_timeout_s=300,
                               report_timeout_s=300)
        probe = probe_for(WeightSource.from_checkpoint(target))
        rc._preconnect()
        threads = [threading.Thread(target=client, args=(i,), daemon=True)
                   for i in range(len(PROMPTS))]
        for th in threads:
            th.start()
        deadline = time.monotonic() + 120
        while min(progress) < 20:
            assert time.monotonic() < deadline, f"rollouts did not start: {progress}"
            time.sleep(0.02)
        with rc:
            res = rc.update(WeightSource.from_checkpoint(target),
                            Provenance(str(target), "engine-test", 1), owner="engine-test",
                            probe=probe)
        Serving.name = tname
        for th in threads:
            th.join(300)
            assert not th.is_alive()
        status = httpx.get(f"{url}/control/status",
                           headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()
    assert check_journal(read_journal(journal)) == []
    assert status["state"] == "READY"
    return answers, res, journal, traj


def _tokens(evs: list[Any]) -> list[int]:
    return [t for e in evs if isinstance(e, dict) for c in e.get("choices") or ()
            for t in c.get("token_ids") or ()]


def _last_word(evs: list[Any]) -> dict[str, Any]:
    return next(e["rolloutcore"] for e in reversed(evs) if isinstance(e, dict)
                and "rolloutcore" in e and "token_versions" in e["rolloutcore"])


def _engine_spans(evs: list[Any]) -> list[tuple[str, int, int]]:
    wv = next(c["weight_versions"] for e in evs if isinstance(e, dict)
              for c in e.get("choices") or () if c.get("weight_versions"))
    return [(s["version"], s["start"], s["end"]) for s in wv]


def _audit(journal: Path, traj: Path, n: int) -> None:
    groups = list(read_groups(traj))
    assert len(groups) == n
    report = audit_file(traj, journal)
    assert report.purity.ok, report.purity.format_table()
    assert report.purity.unattributable == 0


def test_keep_through_the_gateway_labels_every_token_as_vllm_does(
        engine: ManagedEngine, tiny_models: TinyModels, tmp_path: Path) -> None:
    answers, res, journal, traj = _run(engine, tiny_models, tmp_path, "keep")
    assert res.status == "published" and res.published is not None
    new = res.published.label
    recs = _records(journal)
    carry = [r for r in recs if r.kind == "carry"]
    assert carry and len(carry[0].data["carried"]) == len(PROMPTS)  # bound, not drained
    for a in answers:
        evs = a["events"]
        assert a["status"] == 200 and evs[-1] == "[DONE]"
        assert len(_tokens(evs)) == LONG
        info = _last_word(evs)
        spans = [(s["label"], s["start"], s["end"]) for s in info["token_versions"]["spans"]]
        assert [s[0] for s in spans] == [a["version"], new]      # crossed the update
        assert spans == _engine_spans(evs)                         # vLLM's own spans
        assert info["derived_agrees"] is True
        assert info["token_versions"]["source"] == "engine"
        assert info.get("attributable", True) is True and info["staleness"] == 1
    _audit(journal, traj, len(PROMPTS))


def test_recompute_through_the_gateway_resubmits_under_the_new_version(
        engine: ManagedEngine, tiny_models: TinyModels, tmp_path: Path) -> None:
    answers, res, journal, traj = _run(engine, tiny_models, tmp_path, "recompute")
    assert res.status == "published" and res.published is not None
    new = res.published.label
    for i, a in enumerate(answers):
        evs = a["events"]
        assert a["status"] == 200 and evs[-1] == "[DONE]"
        toks = _tokens(evs)
        assert len(toks) == LONG
        finishes = [c.get("finish_reason") for e in evs if isinstance(e, dict)
                    for c in e.get("choices") or () if c.get("finish_reason")]
        assert finishes == ["length"]                       # one answer, one end
        info = _last_word(evs)
        tv = info["token_versions"]
        spans = [(s["label"], s["start"], s["end"]) for s in tv["spans"]]
        assert [s[0] for s in spans] == [a["version"], new]
        assert spans == _engine_spans(evs)                  # rewritten over the whole output
        segs = tv["segments"]
        assert len(segs) == 2 and salt_label(segs[1]["cache_salt"]) == new
        cut = spans[0][2]
        assert segs[1]["prefill_tokens"] == len(PROMPTS[i]) + cut
        # The resubmission's first token is the new weights' answer to prompt + prefix.
        again = httpx.post(f"{engine.base_url}/inference/v1/generate", json={
            "token_ids": PROMPTS[i] + toks[:cut],
            "sampling_params": {"max_tokens": 1, "temperature": 0.0, "ignore_eos": True}},
            timeout=60).json()
        assert again["choices"][0]["token_ids"] == [toks[cut]]
    _audit(journal, traj, len(PROMPTS))


def test_engine_recompute_through_the_gateway_recomputes_inside_vllm(
        engine: ManagedEngine, tiny_models: TinyModels, tmp_path: Path) -> None:
    """vLLM's own keep-with-recompute (``pause(keep, clear_cache=true)``): one engine
    request per rollout, and after the update its tokens are what the new weights
    generate from prompt + output so far (asked again, afterwards, of the same engine)."""
    answers, res, journal, traj = _run(engine, tiny_models, tmp_path, "engine_recompute")
    assert res.status == "published" and res.published is not None
    new = res.published.label
    for i, a in enumerate(answers):
        evs = a["events"]
        assert a["status"] == 200 and evs[-1] == "[DONE]"
        toks = _tokens(evs)
        assert len(toks) == LONG
        info = _last_word(evs)
        tv = info["token_versions"]
        spans = [(s["label"], s["start"], s["end"]) for s in tv["spans"]]
        assert [s[0] for s in spans] == [a["version"], new]
        assert spans == _engine_spans(evs) and info["derived_agrees"] is True
        assert [s["kv"] for s in tv["spans"]] == [[a["version"]], [new]]
        assert len(tv["segments"]) == 1
        cut = spans[0][2]
        again = httpx.post(f"{engine.base_url}/inference/v1/generate", json={
            "token_ids": PROMPTS[i] + toks[:cut],
            "sampling_params": {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}},
            timeout=60).json()
        assert again["choices"][0]["token_ids"] == toks[cut:cut + 8]
    drains = [r.data["evidence"] for r in _records(journal) if r.kind == "evidence"
              and r.data["evidence"].get("type") == "DrainEvidence"]
    assert drains and drains[-1]["cleared"] is True, drains[-1:]
    _audit(journal, traj, len(PROMPTS))


def test_the_staleness_bound_ends_kept_streams_at_the_pause(
        engine: ManagedEngine, tiny_models: TinyModels, tmp_path: Path) -> None:
    answers, res, journal, traj = _run(engine, tiny_models, tmp_path, "keep",
                                       ("--max-staleness", "0"))
    assert res.status == "published"
    for a in answers:
        evs = a["events"]
        assert evs[-1] == "[DONE]"
        err = evs[-2]["error"]
        assert err["type"] == "OverStalenessBound", evs[-3:]
        assert len(_tokens(evs)) < LONG
    recs = _records(journal)
    ends = [r for r in recs if r.kind == "complete"]
    assert len(ends) == len(PROMPTS) and not any(r.data["attributable"] for r in ends)
    carry = [r for r in recs if r.kind == "carry"]
    assert len(carry[0].data["over_bound"]) == len(PROMPTS)
