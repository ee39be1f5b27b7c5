"""The per-rank write check (``transports.rank_checksums``) without an engine.

Each rank's slice is built here the way vLLM's loaders build it, written out
independently in the test (``_vllm_like_load``: the QKV, merged-column,
column, row and vocabulary loaders' arithmetic applied to a fresh tensor),
and must hash like ``expected``'s reconstruction; every kind of wrong write
(another rank's slice, a stale shard, swapped q/k, a shifted vocabulary
range, a forged rank) must fail.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from rolloutcore.engine.process import ManagedEngine, tp_thread_binding
from rolloutcore.errors import BadInput
from rolloutcore.testing.models import make_checkpoint
from rolloutcore.transports.rank_checksums import (
    ParamWrite,
    RankReport,
    checksum_of,
    compare_ranks,
    decode,
    encode,
    expected,
    to_check,
)

H, HEADS, KV, HS = 16, 4, 2, 4          # hidden, q heads, kv heads, head size
INTER, VOCAB, PADDED = 24, 250, 256


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {"q": r(HEADS * HS, H), "k": r(KV * HS, H), "v": r(KV * HS, H),
            "gate": r(INTER, H), "up": r(INTER, H), "down": r(H, INTER),
            "col": r(32, H), "emb": r(VOCAB, H), "norm": r(H)}


def _vllm_like_load(kind: str, t: dict[str, torch.Tensor], rank: int, tp: int
                    ) -> torch.Tensor:
    """What rank ``rank`` of ``tp`` holds, following vLLM 0.32's loader code."""
    if kind == "qkv":
        heads, kv = HEADS // tp, max(1, KV // tp)
        reps = max(1, tp // KV)
        out = torch.empty((heads + 2 * kv) * HS, H, dtype=torch.bfloat16)
        out[: heads * HS] = t["q"][rank * heads * HS:(rank + 1) * heads * HS]
        kr = rank // reps
        out[heads * HS:(heads + kv) * HS] = t["k"][kr * kv * HS:(kr + 1) * kv * HS]
        out[(heads + kv) * HS:] = t["v"][kr * kv * HS:(kr + 1) * kv * HS]
        return out
    if kind == "merged":
        n = INTER // tp
        return torch.cat([t["gate"][rank * n:(rank + 1) * n], t["up"][rank * n:(rank + 1) * n]])
    if kind == "row":
        n = INTER // tp
        return t["down"][:, rank * n:(rank + 1) * n].clone()
    if kind == "column":
        n = 32 // tp
        return t["col"][rank * n:(rank + 1) * n].clone()
    if kind == "vocab":
        per = PADDED // tp
        start, end = rank * per, min(VOCAB, (rank + 1) * per)
        out = torch.zeros(per, H, dtype=torch.bfloat16)
        out[: end - start] = t["emb"][start:end]
        return out
    return t["norm"].clone()


def _write(kind: str, rank: int, tp: int, value: torch.Tensor | None) -> ParamWrite:
    heads, kv = HEADS // tp, max(1, KV // tp)
    geo: dict[str, Any] = {"output_dim": 0, "input_dim": 1}
    if kind == "qkv":
        srcs: tuple[tuple[str, tuple[int, ...]], ...] = (("q", (0,)), ("k", (1,)), ("v", (2,)))
        geo["qkv"] = (heads, kv, HS, HS, max(1, tp // KV))
        shape: tuple[int, ...] = ((heads + 2 * kv) * HS, H)
    elif kind == "merged":
        srcs, geo["output_sizes"] = (("gate", (0,)), ("up", (1,))), (INTER, INTER)
        shape = (2 * INTER // tp, H)
    elif kind == "row":
        srcs, shape = (("down", ()),), (H, INTER // tp)
    elif kind == "column":
        srcs, shape = (("col", ()),), (32 // tp, H)
    elif kind == "vocab":
        per = PADDED // tp
        srcs, shape = (("emb", ()),), (per, H)
        geo["vocab"] = (rank * per, min(VOCAB, (rank + 1) * per))
        geo["input_dim"] = None
    else:
        srcs, shape = (("norm", ()),), (H,)
        geo = {}
    return ParamWrite(f"p.{kind}", shape, "bfloat16", kind,
                      None if value is None else checksum_of(value), srcs,
                      tp=(rank, tp) if kind != "whole" else None, **geo)


KINDS = ("qkv", "merged", "row", "column", "vocab", "whole")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_each_ranks_slice_as_vllm_loads_it_matches_the_reconstruction(kind: str, tp: int
                                                                      ) -> None:
    t = _full()
    for rank in range(tp):
        p = _write(kind, rank, tp, _vllm_like_load(kind, t, rank, tp))
        want = expected(p, t, rank, tp)
        assert isinstance(want, torch.Tensor), want
        assert checksum_of(want) == p.value, (kind, rank, tp)


@pytest.mark.parametrize("kind", ["qkv", "merged", "row", "column", "vocab"])
def test_the_other_ranks_slice_fails(kind: str) -> None:
    t = _full()
    p = _write(kind, 1, 2, _vllm_like_load(kind, t, 0, 2))  # rank 1 holds rank 0's slice
    rep = RankReport(1, 1, 2, (p,), 1)
    res = compare_ranks([(2, rep)], t)
    assert not res["passed"] and res["ranks"][0]["mismatched"] == [p.name]


def test_swapped_q_and_k_and_a_stale_shard_fail() -> None:
    t = _full()
    swapped = dict(t, q=t["k"].repeat(2, 1), k=t["q"][: KV * HS])
    p = _write("qkv", 0, 1, _vllm_like_load("qkv", swapped, 0, 1))
    assert checksum_of(expected(p, t, 0, 1)) != p.value  # type: ignore[arg-type]
    stale = {k: v + 1 for k, v in t.items()}
    p2 = _write("row", 1, 2, _vllm_like_load("row", stale, 1, 2))
    assert not compare_ranks([(2, RankReport(1, 1, 2, (p2,), 1))], t)["passed"]


def test_a_report_must_be_its_ranks_own_and_of_this_round() -> None:
    t = _full()
    good = _write("row", 1, 2, _vllm_like_load("row", t, 1, 2))
    ok = compare_ranks([(1, RankReport(0, 0, 2, (_write("row", 0, 2, _vllm_like_load(
        "row", t, 0, 2)),), 1, nonce="n1")), (2, RankReport(1, 1, 2, (good,), 1, nonce="n1"))],
        t, nonce="n1")
    assert ok["passed"] and ok["coverage_per_rank"] == [1.0, 1.0]
    assert to_check(ok).passed and to_check(ok).coverage == 1.0
    # group rank 1 sending worker 1's report; a report of another round; a missing rank
    assert not compare_ranks([(1, RankReport(1, 1, 2, (good,), 1))], t)["passed"]
    assert not compare_ranks([(2, RankReport(1, 1, 2, (good,), 1, nonce="old"))], t,
                             nonce="n1")["passed"]
    one = compare_ranks([(2, RankReport(1, 1, 2, (good,), 1))], t)
    assert one["missing_tp_ranks"] == [0] and not one["passed"]


def test_what_cannot_be_rebuilt_is_uncovered_never_a_match() -> None:
    t = _full()
    p = _write("row", 0, 1, _vllm_like_load("row", t, 0, 1))
    for bad in (ParamWrite("x", (H,), "bfloat16", "other", 1, (("norm", ()),)),
                ParamWrite("y", (H,), "bfloat16", "whole", None, (("norm", ()),)),
                ParamWrite("z", (H,), "bfloat16", "whole", 1, (("absent", ()),)),
                ParamWrite("w", (H + 1,), "bfloat16", "whole", 1, (("norm", ()),))):
        res = compare_ranks([(1, RankReport(0, 0, 1, (p, bad), 3))], t)
        rk = res["ranks"][0]
        assert not res["passed"] and rk["n_uncovered"] == 1 and rk["compared"] == 1
        assert rk["coverage"] == pytest.approx(1 / 3)
    assert not to_check(compare_ranks([], t)).passed


def test_reports_round_trip_and_malformed_ones_are_refused() -> None:
    t = _full()
    rep = RankReport(1, 1, 2, (_write("qkv", 1, 2, _vllm_like_load("qkv", t, 1, 2)),
                              _write("vocab", 1, 2, _vllm_like_load("vocab", t, 1, 2))),
                     9, 0.01, "abc")
    assert decode(encode(rep)) == rep
    for raw in (b"", b"[]", b"{", b'{"worker_rank": -1}',
                encode(RankReport(0, 3, 2, (), 1)),
                encode(rep).replace(b'"qkv"', b'"sideways"', 1),
                encode(rep).replace(b'"shape":[', b'"shape":[-1,', 1),
                b'{"worker_rank":0,"tp_rank":0,"tp_size":1,"model_params":1,"params":'
                b'[{"name":"a","kind":"whole","dtype":"x","value":1,"sources":[],"shape":[]},'
                b'{"name":"a","kind":"whole","dtype":"x","value":1,"sources":[],"shape":[]}]}'):
        with pytest.raises(ValueError):
            decode(raw)


def test_odd_byte_counts_hash_and_differ() -> None:
    a = torch.arange(7, dtype=torch.bfloat16)
    b = a.clone()
    b[-1] = 100
    assert checksum_of(a) != checksum_of(b)
    assert checksum_of(a) == checksum_of(a.clone())


def test_tp_thread_binding() -> None:
    assert tp_thread_binding(2, cpus=[0, 1]) == {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert tp_thread_binding(2, cpus=range(8)) == {"VLLM_CPU_OMP_THREADS_BIND": "0-3|4-7"}
    assert tp_thread_binding(2, cpus=[0, 2, 4, 6]) == {"VLLM_CPU_OMP_THREADS_BIND": "0,2|4,6"}
    assert tp_thread_binding(1, cpus=[0]) == {}
    assert tp_thread_binding(2, {"VLLM_CPU_OMP_THREADS_BIND": "5|6"}, cpus=[0]) == {}
    with pytest.raises(BadInput, match="needs at least 2 CPU cores"):
        tp_thread_binding(2, cpus=[3])


def test_a_tp_engine_command_and_bad_degrees(tmp_path: Any) -> None:
    ck = make_checkpoint(tmp_path / "m", 1)
    e = ManagedEngine(ck, tensor_parallel_size=1, port=1)
    assert "--tensor-parallel-size" not in e.command()
    for bad in (0, -1, True, 2.0, "2", 65):
        with pytest.raises(BadInput):
            ManagedEngine(ck, tensor_parallel_size=bad)


def test_the_trainers_threads_keep_off_the_cores_the_ranks_are_pinned_to(
        tmp_path: Any) -> None:
    from rolloutcore.engine.process import bound_cpus, threads_beside, torch_threads

    assert bound_cpus("0|1") == {0, 1}
    assert bound_cpus("0-3|4-7") == set(range(8))
    assert bound_cpus("0,2|4,6") == {0, 2, 4, 6}
    for unknown in (None, "", "auto", "nobind", "1-0", "-1", "a|b"):
        assert bound_cpus(unknown) is None, unknown
    assert threads_beside("0|1", [0, 1]) == 1           # every core taken: one thread
    assert threads_beside("0-3|4-7", range(16)) == 8    # the eight cores left
    assert threads_beside("auto", range(16)) == 1       # vLLM binds the node: all of them
    assert threads_beside("0", [0, 1, 2]) == 2
    lane = torch.get_num_threads()
    torch.set_num_threads(2)  # whatever the lane's own: the block's one thread differs
    try:
        before = torch.get_num_threads()
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        with torch_threads(None):
            assert torch.get_num_threads() == before
        with pytest.raises(RuntimeError), torch_threads(1):
            raise RuntimeError("restored on the way out too")
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(lane)
    (tmp_path / "config.json").write_text("{}")
    cpus = sorted(os.sched_getaffinity(0))
    eng = ManagedEngine(tmp_path, port=1, env={"VLLM_CPU_OMP_THREADS_BIND": str(cpus[0])})
    if not torch.cuda.is_available():
        assert eng.threads_beside() == max(1, len(cpus) - 1)


def test_a_fanout_round_adopted_by_a_replica_checks_that_replicas_ranks() -> None:
    """A fleet's fan-out hands each replica what *its* ranks reported
    (``GlooTransport.adopt_round``): the replica's own validation then checks them
    like after a per-engine round; a wrong slice fails; bad input keeps nothing."""
    from rolloutcore.transports.gloo import GlooTransport

    t = {"down": _full()["down"]}  # the round sent one row-parallel tensor
    url = "http://127.0.0.1:9"

    def report(rank: int, value: torch.Tensor, nonce: str = "n1") -> RankReport:
        return RankReport(rank, rank, 2, (_write("row", rank, 2, value),), 1, nonce=nonce,
                          wrote=("down",))

    good = [(r + 1, report(r, _vllm_like_load("row", t, r, 2))) for r in range(2)]
    tr = GlooTransport(op_timeout_s=5)
    nothing = tr.validation_check(url)
    assert nothing.passed and nothing.level is None
    for bad in ((url, "", t, good), (url, "n1", {}, good),
                (url, "n1", t, [(2, good[0][1]), (3, good[1][1])]),
                ("ftp://x", "n1", t, good)):
        with pytest.raises(BadInput):
            tr.adopt_round(*bad)  # type: ignore[arg-type]
        assert tr.validation_check(url).level is None  # nothing kept
    tr.adopt_round(url, "n1", t, good)
    chk = tr.validation_check(url)
    assert chk.passed and chk.coverage == 1.0, chk.detail
    assert [r["coverage"] for r in tr.last_check["ranks"]] == [1.0, 1.0]
    # Rank 1 wrote rank 0's slice: that replica fails.
    other = [good[0], (2, report(1, _vllm_like_load("row", t, 0, 2)))]
    tr.adopt_round(url, "n1", t, other)
    assert not tr.validation_check(url).passed
    # A report of another round (its nonce) does not vouch for this one.
    tr.adopt_round(url, "n2", t, good)
    assert not tr.validation_check(url).passed
    tr.forget_round(url)
    assert tr.validation_check(url).level is None
