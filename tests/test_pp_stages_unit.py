"""Pipeline stages (issue 30): each stage writes its own layers, every tensor exactly once.

Pure parts, no engine: ``rank_checksums.stage_coverage`` (the stages' reports
together must write every tensor of the round exactly once, per
tensor-parallel rank), its place in ``compare_ranks``/``compare_declared``/
``to_check``, the reports' new fields and their bad input, and the receiver's
split of a round (``ModelIndex.owned_elsewhere``: the names a layer of another
stage holds, by vLLM's ``get_pp_missing_layer_names`` prefixes).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rolloutcore.transports.gloo import GlooUpdateInfo, _Subset
from rolloutcore.transports.model_index import ModelIndex, check_against_model
from rolloutcore.transports.rank_checksums import (
    ParamWrite,
    RankReport,
    checksum_of,
    compare_declared,
    compare_ranks,
    decode,
    encode,
    stage_coverage,
    to_check,
)

NAMES = ["embed.weight", "layers.0.w", "layers.1.w", "head.weight"]
STAGE0 = ("embed.weight", "layers.0.w")
STAGE1 = ("layers.1.w", "head.weight")


def _rep(worker: int, pp: int, wrote: tuple[str, ...], skipped: tuple[str, ...], *,
         tp_rank: int = 0, tp: int = 1, pp_size: int = 2, params: tuple[ParamWrite, ...] = (),
         nonce: str = "n") -> RankReport:
    return RankReport(worker, tp_rank, tp, params, max(1, len(params)), 0.0, nonce, pp,
                      pp_size, wrote, skipped)


def _stages() -> list[RankReport]:
    return [_rep(0, 0, STAGE0, STAGE1), _rep(1, 1, STAGE1, STAGE0)]


def test_two_stages_that_partition_the_round_pass_with_full_coverage() -> None:
    res = stage_coverage(_stages(), NAMES)
    assert res["passed"], res
    assert res["tensors"] == 4 and res["n_unwritten"] == res["n_written_twice"] == 0
    assert [(s["pp_rank"], s["wrote"], s["skipped"], s["coverage"])
            for s in res["per_stage"]] == [(0, 2, 2, 1.0), (1, 2, 2, 1.0)]
    # One stage (no pipeline): every rank writes every tensor.
    one = [_rep(0, 0, tuple(NAMES), (), pp_size=1)]
    assert stage_coverage(one, NAMES)["passed"]


@pytest.mark.parametrize(("reports", "needle", "unwritten", "twice"), [
    # a tensor stage 0 holds, taken for stage 1's: no stage wrote it
    ([_rep(0, 0, ("embed.weight",), ("layers.0.w", *STAGE1)), _rep(1, 1, STAGE1, STAGE0)],
     "no stage of tensor-parallel rank 0 wrote 1 tensor(s) (layers.0.w)", ["layers.0.w"], []),
    # both stages wrote one tensor
    ([_rep(0, 0, (*STAGE0, "layers.1.w"), ("head.weight",)), _rep(1, 1, STAGE1, STAGE0)],
     "written by more than one stage", [], ["layers.1.w"]),
    # a stage that does not account for a tensor of the round
    ([_rep(0, 0, STAGE0, ("layers.1.w",)), _rep(1, 1, STAGE1, STAGE0)],
     "worker 0 neither wrote nor skipped 1 tensor(s) (head.weight)", [], []),
    # a stage that accounts for a tensor the round did not send
    ([_rep(0, 0, STAGE0, (*STAGE1, "ghost")), _rep(1, 1, STAGE1, STAGE0)],
     "accounts for 1 tensor(s) the round did not send (ghost)", [], []),
    # one stage's report only: what the other holds, nobody wrote
    ([_rep(0, 0, STAGE0, STAGE1)], "no stage of tensor-parallel rank 0 wrote 2", STAGE1, []),
    # nothing at all
    ([], "", [], []),
])
def test_a_tensor_not_written_exactly_once_fails(reports: list[RankReport], needle: str,
                                                 unwritten: Any, twice: list[str]) -> None:
    res = stage_coverage(reports, NAMES)
    assert not res["passed"], res
    assert needle in "; ".join(res["problems"])
    assert res["unwritten"] == sorted(unwritten) and res["written_twice"] == twice


def test_each_tensor_parallel_rank_is_covered_by_its_own_stages() -> None:
    """TP=2 x PP=2: rank 1's stages must write every tensor too; rank 0's writes do not
    cover rank 1's slices."""
    good = [_rep(0, 0, STAGE0, STAGE1, tp_rank=0, tp=2), _rep(1, 0, STAGE0, STAGE1, tp_rank=1,
            tp=2), _rep(2, 1, STAGE1, STAGE0, tp_rank=0, tp=2),
            _rep(3, 1, STAGE1, STAGE0, tp_rank=1, tp=2)]
    assert stage_coverage(good, NAMES)["passed"]
    bad = list(good)
    bad[3] = _rep(3, 1, ("layers.1.w",), ("head.weight", *STAGE0), tp_rank=1, tp=2)
    res = stage_coverage(bad, NAMES)
    assert not res["passed"] and res["unwritten"] == ["head.weight"]
    assert "tensor-parallel rank 1" in res["problems"][0]
    per = {(s["pp_rank"], s["tp_rank"]): s["coverage"] for s in res["per_stage"]}
    assert per[(1, 1)] == 0.5 and per[(1, 0)] == 1.0


def _written(name: str, t: torch.Tensor) -> ParamWrite:
    return ParamWrite(name, tuple(t.shape), "float32", "whole", checksum_of(t), ((name, ()),))


def test_the_trainers_check_requires_the_stages_to_cover_the_round() -> None:
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(3, 2, generator=g) for n in NAMES}

    def reps(disown: bool = False) -> list[tuple[int, RankReport]]:
        s0 = ("embed.weight",) if disown else STAGE0
        sk0 = (*STAGE1, "layers.0.w") if disown else STAGE1
        return [(1, _rep(0, 0, s0, sk0, params=tuple(_written(n, t[n]) for n in s0))),
                (2, _rep(1, 1, STAGE1, STAGE0, params=tuple(_written(n, t[n]) for n in STAGE1)))]

    ok = compare_ranks(reps(), t, nonce="n", names=NAMES)
    assert ok["passed"] and ok["coverage_per_rank"] == [1.0, 1.0], ok
    assert ok["stages"]["passed"] and ok["missing_pp_ranks"] == []
    # Every stage's checksums match what it wrote; the tensor no stage wrote fails it.
    bad = compare_ranks(reps(disown=True), t, nonce="n", names=NAMES)
    assert all(r["passed"] for r in bad["ranks"]) and not bad["passed"]
    chk = to_check(bad)
    assert not chk.passed and "no stage of tensor-parallel rank 0 wrote" in chk.detail
    # The tensor no stage wrote counts against each stage (which one holds it, only the
    # stage that skipped it could say): 1 of 2 and 2 of 3.
    assert "coverage_per_stage=[0/0:0.500, 1/0:0.667]" in chk.detail
    assert chk.coverage == 0.5
    assert to_check(ok).coverage == 1.0
    # Without names (the check as before), the same reports pass: the names are the check.
    assert compare_ranks(reps(disown=True), t, nonce="n")["passed"]
    # A stage that sent no report at all.
    one = compare_ranks(reps()[:1], t, nonce="n", names=NAMES)
    assert not one["passed"] and one["missing_pp_ranks"] == [1]
    assert "no report from pipeline stages [1]" in to_check(one).detail
    # A stage's report naming the wrong stage for its worker.
    forged = [(1, _rep(0, 1, STAGE0, STAGE1)), reps()[1]]
    res = compare_ranks(forged, t, nonce="n", names=NAMES)
    assert "reports pipeline stage 1 of 2" in "; ".join(res["ranks"][0]["problems"])


def test_the_gateway_checks_the_stages_from_the_workers_own_reports() -> None:
    g = torch.Generator().manual_seed(1)
    t = {n: torch.randn(3, 2, generator=g) for n in NAMES}

    def worker(w: int, wrote: tuple[str, ...], skipped: tuple[str, ...]) -> RankReport:
        return _rep(w, w, wrote, skipped, params=tuple(_written(n, t[n]) for n in wrote))

    def decl(reps: list[RankReport]) -> dict[int, dict[str, int | None]]:
        return {r.worker_rank: {p.name: p.value for p in r.params} for r in reps}

    good = [worker(0, STAGE0, STAGE1), worker(1, STAGE1, STAGE0)]
    res = compare_declared(list(enumerate(good)), decl(good), nonce="n")
    assert res["passed"] and res["stages"]["passed"], res
    bad = [worker(0, ("embed.weight",), ("layers.0.w", *STAGE1)), worker(1, STAGE1, STAGE0)]
    res = compare_declared(list(enumerate(bad)), decl(bad), nonce="n")
    assert not res["passed"] and res["stages"]["unwritten"] == ["layers.0.w"]
    # Reports that account for no tensors (an engine without stages, as before): no
    # stage check, the per-rank comparison alone.
    plain = [RankReport(0, 0, 1, (_written("a", t["embed.weight"]),), 1, 0.0, "n")]
    res = compare_declared([(0, plain[0])], decl(plain), nonce="n")
    assert res["passed"] and "stages" not in res


def test_reports_carry_their_stage_and_refuse_malformed_fields() -> None:
    rep = _rep(1, 1, STAGE1, STAGE0)
    assert decode(encode(rep)) == rep
    old = {"worker_rank": 0, "tp_rank": 0, "tp_size": 1, "params": [], "model_params": 1}
    legacy = RankReport.from_dict(old)
    assert (legacy.pp_rank, legacy.pp_size, legacy.wrote, legacy.skipped) == (0, 1, (), ())
    for bad, msg in (({"pp_rank": 2, "pp_size": 2}, "outside pp_size"),
                     ({"pp_size": -1}, "pp_size must be"),
                     ({"pp_rank": True}, "pp_rank must be"),
                     ({"wrote": "a"}, "wrote must be a list"),
                     ({"skipped": [""]}, "skipped must be a list"),
                     ({"wrote": ["a", "a"]}, "listed twice in wrote"),
                     ({"wrote": ["a"], "skipped": ["a"]}, "both written and skipped")):
        with pytest.raises(ValueError, match=msg):
            RankReport.from_dict({**old, **bad})


# ------------------------------------------------------------------ the receiver's split


class _Lin(torch.nn.Module):
    def __init__(self, *shape: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(*shape), requires_grad=False)


class _Missing(torch.nn.Module):
    """Stands in for vLLM's ``PPMissingLayer``: no parameters."""


class _Stage0(torch.nn.Module):
    """Stage 0 of a 12-layer model: embedding and layers 0..9 here; layers 10, 11 and the
    head on stage 1."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = _Lin(5, 2)
        self.layers = torch.nn.ModuleList(
            [_Lin(2, 2) for _ in range(10)] + [_Missing(), _Missing()])
        self.head = _Missing()


ELSEWHERE = ["layers.10.", "layers.11.", "head."]


def test_a_stage_skips_exactly_the_names_another_stage_holds() -> None:
    m = _Stage0()
    names = ["embed.weight", "layers.1.weight", "layers.10.weight", "layers.11.weight",
             "head.weight", "layers.0.weight"]
    index = ModelIndex(m, elsewhere=ELSEWHERE)
    mine, other = index.split(names)
    assert mine == ["embed.weight", "layers.1.weight", "layers.0.weight"]
    # "layers.1." does not take layers 10 and 11 (vLLM's prefixes end with a dot).
    assert other == ["layers.10.weight", "layers.11.weight", "head.weight"]
    info = GlooUpdateInfo(names, ["float32"] * 6, [[5, 2]] + [[2, 2]] * 5)
    sub = _Subset.of(info, set(mine))
    assert sub.names == mine and sub.shapes == [[5, 2], [2, 2], [2, 2]]
    assert check_against_model(sub, index) == set(mine)
    # Without the split (the receiver as before), the first foreign name is refused.
    with pytest.raises(ValueError, match=r"layers\.10\.weight: not a parameter of this model"):
        check_against_model(info, index)
    # A name no stage holds is not another stage's: still refused here.
    assert index.split(["nowhere.weight"]) == (["nowhere.weight"], [])
    with pytest.raises(ValueError, match="not a parameter"):
        check_against_model(GlooUpdateInfo(["nowhere.weight"], ["float32"], [[1]]), index)
    # No pipeline: nothing is another stage's.
    assert ModelIndex(m).split(names) == (names, [])


def test_the_models_renaming_applies_before_the_stage_split() -> None:
    class Mapper:
        @staticmethod
        def _map_name(name: str) -> str | None:
            return None if name.startswith("drop.") else name.replace("hf.", "", 1)

    m = _Stage0()
    m.hf_to_vllm_mapper = Mapper()  # type: ignore[assignment]
    index = ModelIndex(m, elsewhere=ELSEWHERE)
    assert index.split(["hf.head.weight", "hf.layers.2.weight", "drop.head.weight"]) == (
        ["hf.layers.2.weight", "drop.head.weight"], ["hf.head.weight"])


def test_the_updates_status_carries_each_stage() -> None:
    """``worker_shards`` (the gateway's update status) keeps each rank's stage and the
    stage check, trimmed."""
    from types import SimpleNamespace

    from rolloutcore.service.control_sent import worker_shards

    g = torch.Generator().manual_seed(2)
    t = {n: torch.randn(3, 2, generator=g) for n in NAMES}
    reps = [_rep(w, w, wrote, skipped, params=tuple(_written(n, t[n]) for n in wrote))
            for w, wrote, skipped in ((0, ("embed.weight",), ("layers.0.w", *STAGE1)),
                                      (1, STAGE1, STAGE0))]
    decl = {r.worker_rank: {p.name: p.value for p in r.params} for r in reps}
    res = compare_declared(list(enumerate(reps)), decl, nonce="n")
    out = worker_shards(SimpleNamespace(last_rank_result=res))
    assert out is not None and not out["passed"]
    assert [(r["pp_rank"], r["pp_size"]) for r in out["ranks"]] == [(0, 2), (1, 2)]
    assert out["stages"]["unwritten"] == ["layers.0.w"] and not out["stages"]["passed"]
    assert len(out["stages"]["per_stage"]) == 2 and out["missing_pp_ranks"] == []
    assert worker_shards(SimpleNamespace()) is None
