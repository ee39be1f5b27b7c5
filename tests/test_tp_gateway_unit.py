"""Every rank checked through the gateway (issue 30), without an engine.

The trainer declares what each engine worker must hold
(``rank_checksums.declare``); the gateway asks the workers for their own
reports (``/collective_rpc``, here a mock engine) and compares
(``compare_declared``) under the grant's round nonce. A report of another
round, a rank without one, a value or a parameter on one side only: each
fails. A malformed declaration is refused at the edge (``BadInput``, a 422
with the lease still open), and the client then decides the update.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from pydantic import ValidationError

from helpers.fault_matrix import PromiseRows
from helpers.vllm_fake import answer, vllm
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.engine.sent import (
    SENT_SCHEMES,
    check_sent_scheme,
    compare_rank_reports,
    compare_sent,
    rank_reports_supported,
)
from rolloutcore.errors import BadInput, RolloutCoreError
from rolloutcore.service.client import UpdateGrant, _declares_ranks
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.control import ReportBody
from rolloutcore.service.control_sent import check_rank_declaration, worker_shards
from rolloutcore.transports import gloo_report
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.rank_checksums import (
    SCHEME,
    ParamWrite,
    RankReport,
    checksum_of,
    compare_declared,
    declare,
    expected,
    to_check,
)
from rolloutcore.transports.source import WeightSource

NONCE = "0123456789abcdef0123456789abcdef"
MATRIX = PromiseRows("tests/test_tp_gateway_unit.py",
                     engines="the gateway's per-rank comparison (compare_declared, to_check) "
                             "over two ranks' reports as vLLM's workers write them")
_fault_matrix = MATRIX.fixture()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"col": torch.randn(8, 4, generator=g), "row": torch.randn(4, 8, generator=g),
            "norm": torch.randn(4, generator=g)}


def _write(kind: str, rank: int, t: dict[str, torch.Tensor], *, wrong: bool = False
           ) -> ParamWrite:
    """Rank ``rank`` of 2's write of ``kind``, hashed as loaded (``wrong``: rank 0's slice)."""
    src = {"column": "col", "row": "row", "whole": "norm"}[kind]
    geo: dict[str, Any] = {"output_dim": 0, "input_dim": 1} if kind != "whole" else {}
    shape = {"column": (4, 4), "row": (4, 4), "whole": (4,)}[kind]
    def at(r: int) -> ParamWrite:
        return ParamWrite(f"m.{kind}", shape, "float32", kind, None, ((src, ()),),
                          tp=(r, 2) if kind != "whole" else None, **geo)

    p = at(rank)
    held = expected(at(0) if wrong else p, t, 0 if wrong else rank, 2)
    assert isinstance(held, torch.Tensor)
    return ParamWrite(p.name, p.shape, p.dtype, p.kind, checksum_of(held), p.sources,
                      p.output_dim, p.input_dim, tp=p.tp)


def _reports(t: dict[str, torch.Tensor], *, nonce: str = NONCE, wrong_rank: int | None = None
             ) -> list[RankReport]:
    return [RankReport(w, w, 2, tuple(_write(k, w, t, wrong=w == wrong_rank and k == "row")
                                      for k in ("column", "row", "whole")), 3, 0.01, nonce)
            for w in range(2)]


def _digests(t: dict[str, torch.Tensor]) -> dict[str, str]:
    src = WeightSource.from_state_dict(t)
    return {"manifest_digest": src.manifest().digest, "content_digest": src.content_digest()}


def _declared(t: dict[str, torch.Tensor]) -> dict[str, Any]:
    ranks = declare([(w + 1, r) for w, r in enumerate(_reports(t))], t)
    return {"scheme": SCHEME, "nonce": NONCE, **_digests(t), "ranks": ranks}


def _as_map(sent: dict[str, Any]) -> dict[int, dict[str, int | None]]:
    return {r["worker_rank"]: dict(zip(r["names"], r["values"], strict=True))
            for r in sent["ranks"]}


# ------------------------------------------------------------------ comparison

def test_a_declaration_equal_to_every_ranks_own_report_passes_with_full_coverage() -> None:
    t = _tensors()
    res = compare_declared(list(enumerate(_reports(t))), _as_map(_declared(t)), nonce=NONCE)
    assert res["passed"] and res["coverage_per_rank"] == [1.0, 1.0]
    chk = to_check(res)
    assert chk.passed and chk.coverage == 1.0 and chk.name == "worker_shard_checksum"
    assert "coverage_per_rank=[1.000, 1.000]" in chk.detail


def test_a_round_that_wrote_one_parameter_of_each_rank_is_not_published() -> None:
    """#47, symptom 3: a trainer that declares a new checkpoint but sends one tensor (the
    norm) got it published at coverage 0.067: each rank's one write matched what was
    declared. Every rank must write every parameter it holds (coverage 1.0)."""
    t = _tensors()
    partial = [RankReport(r.worker_rank, r.tp_rank, r.tp_size,
                          tuple(p for p in r.params if p.kind == "whole"), r.model_params,
                          r.elapsed_s, r.nonce) for r in _reports(t)]
    decl = {w: {p.name: p.value for p in r.params} for w, r in enumerate(partial)}
    res = compare_declared(list(enumerate(partial)), decl, nonce=NONCE)
    assert not res["passed"]
    assert res["coverage_per_rank"] == pytest.approx([1 / 3, 1 / 3])
    chk = to_check(res)
    assert not chk.passed and chk.coverage < 1.0
    assert "wrote 1 of the 3 parameters it holds" in chk.detail
    MATRIX.row("tp_partial_round", "a trainer declares a new checkpoint but sends one tensor "
               "(the norm) to a TP=2 engine; each rank's one write matches the declaration",
               "worker_shard_checksum fails (coverage 0.333 per rank: every parameter a rank "
               "holds must be written): not published", "the update fails (not published)",
               part="one-tensor", published_unvalidated=0, records_lost=0)


def test_the_other_ranks_slice_fails_on_that_rank_only() -> None:
    t = _tensors()
    res = compare_declared(list(enumerate(_reports(t, wrong_rank=1))), _as_map(_declared(t)),
                           nonce=NONCE)
    ranks = {r["tp_rank"]: r for r in res["ranks"]}
    assert not res["passed"] and ranks[0]["passed"]
    assert ranks[1]["mismatched"] == ["m.row"]


def test_a_report_of_another_round_is_not_taken_for_this_one() -> None:
    t = _tensors()
    res = compare_declared(list(enumerate(_reports(t, nonce="an-earlier-round"))),
                           _as_map(_declared(t)), nonce=NONCE)
    assert not res["passed"]
    assert all(any("not of this one" in p for p in r["problems"]) for r in res["ranks"])


@pytest.mark.parametrize("case", ["no report", "undeclared worker", "ghost worker",
                                  "extra param", "missing param", "null value",
                                  "forged worker"])
def test_anything_on_one_side_only_fails(case: str) -> None:
    t = _tensors()
    reps: list[tuple[int, RankReport | str]] = list(enumerate(_reports(t)))
    decl = _as_map(_declared(t))
    if case == "no report":
        reps[1] = (1, "no report (no gloo round has finished)")
    elif case == "undeclared worker":
        del decl[1]
    elif case == "ghost worker":
        decl[2] = dict(decl[1])
    elif case == "extra param":
        decl[0]["m.other"] = 5
    elif case == "missing param":
        del decl[0]["m.row"]
    elif case == "null value":
        decl[0]["m.row"] = None
    else:  # worker 1's answer claims worker 0's place
        rep = reps[1][1]
        assert isinstance(rep, RankReport)
        reps[1] = (1, RankReport(0, 0, 2, rep.params, 3, 0.0, NONCE))
    res = compare_declared(reps, decl, nonce=NONCE)
    assert not res["passed"], case
    assert not to_check(res).passed


def test_the_trainer_declares_from_what_it_broadcast() -> None:
    t = _tensors()
    tr = GlooTransport()
    from rolloutcore.transports.gloo_rounds import Round

    assert tr.declared_checksums("http://e.test") is None
    tr._rounds["http://e.test"] = Round(NONCE, t, [(w + 1, r)
                                                    for w, r in enumerate(_reports(t))])
    d = tr.declared_checksums("http://e.test")
    assert d == _declared(t)
    check_sent_scheme(d)
    assert ReportBody.model_validate({"transfer": {
        "completed": True, "mutation_started": True, "backend": "rolloutcore_gloo",
        "sent_checksum": d}}).transfer is not None


# ------------------------------------------------------------------ the gateway asks

def _engine(answers: list[Any], seen: list[dict[str, Any]] | None = None,
            extension: str | None = "rankfault.RankFault") -> VllmHTTP:
    """The one fake of vLLM serving ``/collective_rpc`` (each worker's answer in
    ``answers``; ``seen``: the bodies it is sent) and a ``/server_info`` naming the
    workers' extension."""
    def rpc(req: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(json.loads(req.content))
        return httpx.Response(200, json={"results": answers})

    fake = vllm(only=(Routes.HEALTH, Routes.SERVER_INFO), overrides={
        Routes.SERVER_INFO: answer(200, {"vllm_config": {"parallel_config": {
            "worker_extension_cls": extension or ""}}}),
        Routes.COLLECTIVE_RPC: rpc})
    return VllmHTTP("http://e.test", transport=fake.transport())


def test_the_gateway_asks_each_worker_itself_and_compares() -> None:
    t = _tensors()
    seen: list[dict[str, Any]] = []
    answers = [{"worker_rank": i, "report": r.to_dict()} for i, r in enumerate(_reports(t))]
    chk, res = compare_rank_reports(_engine(answers, seen), _declared(t))
    assert chk.passed and res["coverage_per_rank"] == [1.0, 1.0]
    assert seen == [{"method": gloo_report.METHOD, "timeout": 60.0}]
    assert SENT_SCHEMES[SCHEME] == gloo_report.METHOD
    got: list[dict[str, Any]] = []
    assert compare_sent(_engine(answers), _declared(t), record=got.append).passed
    assert got and got[0]["passed"]
    shards = worker_shards(type("A", (), {"last_rank_result": got[0]})())
    assert shards is not None and shards["coverage_per_rank"] == [1.0, 1.0]
    assert [r["tp_rank"] for r in shards["ranks"]] == [0, 1]


@pytest.mark.parametrize("answer", [None, "text", {"report": None, "reason": "none yet"},
                                    {"report": {"worker_rank": "x"}}, {"report": []}])
def test_a_worker_without_a_usable_report_fails_the_check_not_the_gateway(answer: Any
                                                                         ) -> None:
    t = _tensors()
    good = {"report": _reports(t)[0].to_dict()}
    chk, res = compare_rank_reports(_engine([good, answer]), _declared(t))
    assert not chk.passed and res["ranks"][0]["passed"] and not res["ranks"][1]["passed"]


def test_whether_the_workers_answer_their_reports_is_asked_without_changing_anything(
        ) -> None:
    assert rank_reports_supported(_engine([{"report": None, "reason": "none"}] * 2))
    assert not rank_reports_supported(_engine([{"report": None}], extension=None))
    assert not rank_reports_supported(_engine(["Method not implemented"]))
    assert not rank_reports_supported(_engine([]))


# ------------------------------------------------------------------ the edge

def _bad(d: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {**d, **over}


@pytest.mark.parametrize("mutate", [
    lambda d: _bad(d, nonce=""),
    lambda d: _bad(d, nonce=7),
    lambda d: _bad(d, nonce="n" * 129),
    lambda d: _bad(d, ranks=[]),
    lambda d: _bad(d, ranks="all"),
    lambda d: _bad(d, ranks=[d["ranks"][0], d["ranks"][0]]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "worker_rank": -1}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "worker_rank": True}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "values": [1]}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "values": [1, 2, -3]}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "values": [1, 2, 2**63]}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "names": ["a", "a", "b"]}]),
    lambda d: _bad(d, ranks=[{**d["ranks"][0], "extra": 1}]),
    lambda d: _bad(d, extra=1),
    lambda d: {k: v for k, v in d.items() if k != "nonce"},
    lambda d: {k: v for k, v in d.items() if k != "content_digest"},
    lambda d: _bad(d, manifest_digest="A" * 64),
    lambda d: _bad(d, content_digest=None),
], ids=lambda f: "")
def test_a_malformed_declaration_is_refused_at_the_edge(mutate: Any) -> None:
    bad = mutate(_declared(_tensors()))
    with pytest.raises(BadInput):
        check_sent_scheme(bad)
    with pytest.raises(ValidationError):
        ReportBody.model_validate({"transfer": {
            "completed": True, "mutation_started": True, "backend": "rolloutcore_gloo",
            "sent_checksum": bad}})


def _cfg(rank_reports: bool) -> ServiceConfig:
    tr: dict[str, Any] = {"backend": "rolloutcore_gloo"}
    if rank_reports:
        tr["rank_reports"] = True
    return ServiceConfig(upstream_url="http://e.test", control_token="t" * 32, transport=tr)


def test_the_gateway_takes_a_declaration_only_of_its_grants_round() -> None:
    d = _declared(_tensors())
    ok = dict(completed=True, backend="rolloutcore_gloo")
    assert check_rank_declaration(_cfg(True), NONCE, d, **ok) is None  # type: ignore[arg-type]
    other = check_rank_declaration(_cfg(True), "f" * 32, d, **ok)  # type: ignore[arg-type]
    assert other is not None and "round nonce" in other
    none = check_rank_declaration(_cfg(True), NONCE, None, **ok)  # type: ignore[arg-type]
    assert none is not None and "declared_checksums" in none
    here = check_rank_declaration(_cfg(False), NONCE, d, **ok)  # type: ignore[arg-type]
    assert here is not None and "does not answer" in here
    # An engine whose ranks are not reported, or a transfer that did not complete: as before.
    assert check_rank_declaration(_cfg(False), NONCE, None, **ok) is None  # type: ignore[arg-type]
    assert check_rank_declaration(_cfg(True), NONCE, None, completed=False,
                                  backend="rolloutcore_gloo") is None


def test_a_declaration_stands_only_for_the_checkpoint_its_round_sent() -> None:
    """#47, symptom 3: the update claims a checkpoint (its identity: manifest and content);
    the declaration names what its round sent (``Round.digests``). A round that sent one
    tensor of it, or every tensor of another checkpoint, is refused (a 422, the lease
    open): the ranks' own checks would pass, each rank wrote what was declared."""
    from rolloutcore.core.versions import Provenance, WeightIdentity

    t = _tensors()
    other = {k: v + 1e-3 for k, v in t.items()}  # the same names and shapes, one step on
    claimed = WeightIdentity.declare(WeightSource.from_state_dict(t).manifest(),
                                     Provenance("ckpt-A1", "run", 1),
                                     WeightSource.from_state_dict(t).content_digest())
    ok = dict(completed=True, backend="rolloutcore_gloo", claimed=claimed)
    assert check_rank_declaration(_cfg(True), NONCE, _declared(t), **ok) is None  # type: ignore[arg-type]
    one = {**_declared(t), **_digests({"norm": t["norm"]})}
    why = check_rank_declaration(_cfg(True), NONCE, one, **ok)  # type: ignore[arg-type]
    assert why is not None and "manifest" in why and "not of the claimed" in why
    wrong = {**_declared(other), "nonce": NONCE}
    why = check_rank_declaration(_cfg(True), NONCE, wrong, **ok)  # type: ignore[arg-type]
    assert why is not None and "content" in why and "not of the claimed" in why
    # An identity without a content digest claims names, shapes and dtypes only.
    bare = WeightIdentity(claimed.manifest_digest, claimed.provenance)
    assert check_rank_declaration(_cfg(True), NONCE, wrong, completed=True,
                                  backend="rolloutcore_gloo", claimed=bare) is None
    why = check_rank_declaration(_cfg(True), NONCE, one, completed=True,
                                 backend="rolloutcore_gloo", claimed=bare)
    assert why is not None and "manifest" in why
    # What the trainer declares is what identity_of computes of the source it sent.
    tr = GlooTransport()
    from rolloutcore.service.client import identity_of
    from rolloutcore.transports.gloo_rounds import Round

    src = WeightSource.from_state_dict(t)
    tr._rounds["http://e.test"] = Round(NONCE, t, [(w + 1, r) for w, r in enumerate(
        _reports(t))], src)
    d = tr.declared_checksums("http://e.test")
    assert d is not None
    ident = identity_of(src, Provenance("ckpt-A1", "run", 1))
    assert (d["manifest_digest"], d["content_digest"]) == (ident.manifest_digest,
                                                             ident.content_digest)
    MATRIX.row("tp_partial_round", "a declaration whose round sent one tensor of the claimed "
               "checkpoint, or every tensor of another, reported for an update claiming it",
               "refused at the report (422, the lease open): the declaration's manifest or "
               "content digest is not the claimed identity's", "the update fails (not published)",
               part="other-checkpoint", published_unvalidated=0, records_lost=0)


def _grant(**extra: Any) -> dict[str, Any]:
    return {"update_id": 5, "identity_digest": "d" * 64,
            "target": {"generation": 1, "label": "rc-1", "engine_epoch": "e0"},
            "lease": {"seconds": 60, "deadline_unix": 0.0, "expires_in_s": 60, "secret": "s"},
            "engine": {"base_url": "http://e.test"},
            "transport": {"backend": "rolloutcore_gloo", "rank_reports": True}, **extra}


def test_the_client_sends_the_round_under_the_grants_nonce() -> None:
    g = UpdateGrant.from_json(_grant(round_nonce=NONCE))
    assert g.round_nonce == NONCE and g.ranks_checked
    assert not UpdateGrant.from_json(_grant()).ranks_checked
    with pytest.raises(RolloutCoreError, match="malformed"):
        UpdateGrant.from_json(_grant(round_nonce=""))
    assert _declares_ranks(GlooTransport())
    with pytest.raises(BadInput):
        GlooTransport().send("http://127.0.0.1:1", "rc-1", None, timeout_s=1,  # type: ignore[arg-type]
                             nonce="")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="TP=2 needs 2 cores")
def test_a_launched_tp_gloo_engine_answers_its_ranks_reports(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    def cmd(tp: int, **kw: Any) -> list[str]:
        return ManagedEngine(tmp_path, port=1, tensor_parallel_size=tp, **kw).command()

    two = cmd(2)
    assert two[two.index("--worker-extension-cls") + 1] == gloo_report.WORKER_EXTENSION
    assert "--worker-extension-cls" not in cmd(1)
    own = cmd(2, extra_args=("--worker-extension-cls", "rankfault.RankFault"))
    assert own.count("--worker-extension-cls") == 1
    assert "--worker-extension-cls" not in cmd(2, backend=None)


# ------------------------------------------------------------------ the gateway, in process

def test_a_report_the_gateway_cannot_use_is_a_422_then_the_update_is_decided() -> None:
    """Where the engine reports its ranks, a completed gloo transfer without a declaration,
    or with one of another round or of another checkpoint than the update's, is a 422 with
    the lease still open and nothing changed; the trainer's failure report then decides the
    update (TAINTED: weights were written)."""
    import anyio

    from helpers.gateway_rig import AUTH, begin_body, lease, remote_transfer, rig, transfer_body
    from rolloutcore.core.lifecycle import State
    from rolloutcore.testing.fake import FakeWeights

    w = FakeWeights.from_seed(1, step=1)

    async def run() -> None:
        async with rig(transport={"backend": "rolloutcore_gloo", "rank_reports": True}) as r:
            r.adapter.stage(w)
            resp = await r.client.post("/control/updates", json=begin_body(w), headers=AUTH)
            assert resp.status_code == 201, resp.text
            g = resp.json()
            assert isinstance(g["round_nonce"], str) and len(g["round_nonce"]) == 32
            url = f"/control/updates/{g['update_id']}/transfer"
            ev = transfer_body(remote_transfer(r.adapter, w, g["target"]["label"]))["transfer"]
            ev["backend"] = "rolloutcore_gloo"
            r.adapter.check_sent = lambda sent: None  # a gateway that can compare ranks
            decl = {**_declared(_tensors()), "nonce": "f" * 32}
            before = r.controller.snapshot()
            other = {**decl, "nonce": g["round_nonce"]}  # this round, another checkpoint
            for body in ({"transfer": ev}, {"transfer": {**ev, "sent_checksum": decl}},
                         {"transfer": {**ev, "sent_checksum": {**decl, "ranks": []}}},
                         {"transfer": {**ev, "sent_checksum": other}}):
                resp = await r.client.post(url, json=body, headers=lease(g))
                assert resp.status_code == 422, resp.text
                info = (await r.client.get(f"/control/updates/{g['update_id']}",
                                           headers=lease(g))).json()
                assert info["status"] == "open" and not info["final"]
                assert r.controller.snapshot() == before
            done = await r.client.post(url, json={"failure": {
                "kind": "error", "reason": "the gateway refused the transfer report"}},
                headers=lease(g))
            assert done.status_code == 200 and done.json()["final"]
            assert r.controller.state is State.TAINTED

    anyio.run(run)
