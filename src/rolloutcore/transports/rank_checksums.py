"""What every engine rank wrote, checked against the trainer's full tensors.

vLLM's ``/weight_checker`` hashes the parameters as the kernels hold them
after loading. On the CPU build the linear layers' GEMM repacks the weight
and the parameter keeps no bytes (it hashes as zero bytes), and with tensor
parallelism each rank holds only its slice. So the engine half of
``rolloutcore_gloo`` takes its own evidence while it loads:

* each rank block-checksums (``cuda_ipc.checksum.block_checksum``) every
  parameter the round wrote *as loaded*: after vLLM's weight loaders placed
  the received tensors, before the layer's quant method repacks them;
* it reports, per parameter, what it is (the layer's kind and the tensor
  parallel geometry vLLM's loaders use: rank, degree, fused shard sizes,
  attention heads, the vocabulary range) and which checkpoint tensors
  (with shard ids) the round placed on it, and sends the report to the
  trainer over the transfer's own group at finish (``encode`` / ``decode``);
* the trainer computes the same parameter from the full tensors it sent
  (``expected``: the rules of vLLM's column, row, merged-column, QKV and
  vocabulary-parallel loaders, written out here, not called) and compares
  the checksums (``compare_ranks``), one coverage per rank.

What the trainer cannot reconstruct (a layer kind not listed, a shape that
does not follow) is not compared: it lowers that rank's coverage and is
named, it is never counted as a match. A rank's report must come from the
group rank that worker holds: a report claiming another tensor-parallel rank
fails the check.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import Check
from rolloutcore.core.records import fields_dict
from rolloutcore.core.versions import VerificationLevel

if TYPE_CHECKING:
    import torch

__all__ = [
    "KINDS",
    "REPORT_TAG",
    "SCHEME",
    "ParamWrite",
    "RankReport",
    "checksum_of",
    "compare_declared",
    "compare_ranks",
    "stage_coverage",
    "declare",
    "decode",
    "encode",
    "expected",
    "to_check",
]

#: The sent-checksum scheme of a trainer's per-rank declaration, compared by a gateway
#: with the ranks' own reports (``engine.sent.SENT_SCHEMES``).
SCHEME = "rolloutcore_gloo/rank"
#: The p2p tag the engine ranks send their report with (length, then bytes).
REPORT_TAG = 7311
#: Layer kinds, as the engine half classifies vLLM's layers.
#: ``other``: a vLLM parallel layer whose placement is not written out here (never
#: compared: it lowers the rank's coverage).
KINDS = frozenset({"column", "row", "merged", "qkv", "vocab", "whole", "other"})
_MAX_REPORT = 64 << 20


@dataclass(frozen=True)
class ParamWrite:
    """One parameter a rank wrote: its checksum as loaded and how vLLM placed it.

    ``sources``: (checkpoint name, shard ids) placed on it this round, ``()``
    for a whole-parameter write. ``qkv``: (heads, kv heads, head size, v
    head size, kv head replicas) of this rank; ``vocab``: the (start, end)
    rows of the checkpoint's vocabulary this rank holds; ``output_sizes``:
    the whole (unsharded) sizes of a fused parameter's parts; ``tp``: the
    layer's own (rank, degree), where it differs from the worker's (a layer
    built with tensor parallelism disabled holds everything). ``value`` None:
    the rank could not hash it.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    value: int | None
    sources: tuple[tuple[str, tuple[int, ...]], ...]
    output_dim: int | None = None
    input_dim: int | None = None
    output_sizes: tuple[int, ...] = ()
    qkv: tuple[int, int, int, int, int] | None = None
    vocab: tuple[int, int] | None = None
    tp: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> ParamWrite:
        if not isinstance(d, Mapping):
            raise ValueError("a parameter entry must be an object")
        name, kind = d.get("name"), d.get("kind")
        if not isinstance(name, str) or not name:
            raise ValueError("parameter name must be a non-empty string")
        if kind not in KINDS:
            raise ValueError(f"{name}: kind {kind!r} is not one of {sorted(KINDS)}")
        value = d.get("value")
        if value is not None and (not _is_int(value) or value < 0):
            raise ValueError(f"{name}: value must be an int >= 0 or null")
        dtype = d.get("dtype")
        if not isinstance(dtype, str) or not dtype:
            raise ValueError(f"{name}: dtype must be a string")
        srcs = d.get("sources")
        if not isinstance(srcs, list):
            raise ValueError(f"{name}: sources must be a list")
        sources = []
        for s in srcs:
            if not (isinstance(s, list) and len(s) == 2 and isinstance(s[0], str)):
                raise ValueError(f"{name}: a source is [name, [shard ids]]")
            sources.append((s[0], _ints(s[1], f"{name}: shard ids")))
        qkv, vocab, tp = d.get("qkv"), d.get("vocab"), d.get("tp")
        return cls(name, _ints(d.get("shape"), f"{name}: shape"), dtype, str(kind), value,
                   tuple(sources), _opt_int(d.get("output_dim"), name),
                   _opt_int(d.get("input_dim"), name),
                   _ints(d.get("output_sizes", []), f"{name}: output_sizes"),
                   None if qkv is None else _fixed(qkv, 5, f"{name}: qkv"),
                   None if vocab is None else _fixed(vocab, 2, f"{name}: vocab"),
                   None if tp is None else _fixed(tp, 2, f"{name}: tp"))


@dataclass(frozen=True)
class RankReport:
    """What one engine worker wrote in a round, as it sends it at finish.

    ``wrote``/``skipped``: the round's checkpoint tensors this worker loaded, and
    those it left to another pipeline stage (vLLM's ``is_pp_missing_parameter``:
    the layer is not on this stage). Across the stages of one tensor-parallel
    rank, every tensor of the round must be written exactly once
    (``stage_coverage``).
    """

    worker_rank: int
    tp_rank: int
    tp_size: int
    params: tuple[ParamWrite, ...]
    model_params: int          # distinct parameters of this rank's model
    elapsed_s: float = 0.0
    nonce: str = ""
    pp_rank: int = 0
    pp_size: int = 1
    wrote: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> RankReport:
        if not isinstance(d, Mapping):
            raise ValueError("a rank report must be an object")
        ints: dict[str, int] = {}
        for k, default in (("worker_rank", None), ("tp_rank", None), ("tp_size", None),
                           ("model_params", None), ("pp_rank", 0), ("pp_size", 1)):
            v = d.get(k, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{k} must be an int >= 0, got {v!r}")
            ints[k] = v
        if not 0 <= ints["tp_rank"] < max(1, ints["tp_size"]):
            raise ValueError(f"tp_rank {ints['tp_rank']} outside tp_size {ints['tp_size']}")
        if not 0 <= ints["pp_rank"] < max(1, ints["pp_size"]):
            raise ValueError(f"pp_rank {ints['pp_rank']} outside pp_size {ints['pp_size']}")
        params = d.get("params")
        if not isinstance(params, list):
            raise ValueError("params must be a list")
        ps = tuple(ParamWrite.from_dict(p) for p in params)
        if len({p.name for p in ps}) != len(ps):
            raise ValueError("a parameter is reported twice")
        names: dict[str, tuple[str, ...]] = {}
        for k in ("wrote", "skipped"):
            v = d.get(k, [])
            if not isinstance(v, list) or not all(isinstance(n, str) and n for n in v):
                raise ValueError(f"{k} must be a list of tensor names")
            if len(set(v)) != len(v):
                raise ValueError(f"a tensor is listed twice in {k}")
            names[k] = tuple(v)
        both = set(names["wrote"]) & set(names["skipped"])
        if both:
            raise ValueError(f"{sorted(both)[0]} is both written and skipped")
        el = d.get("elapsed_s", 0.0)
        return cls(ints["worker_rank"], ints["tp_rank"], ints["tp_size"], ps,
                   ints["model_params"], float(el) if isinstance(el, (int, float)) else 0.0,
                   str(d.get("nonce") or ""), ints["pp_rank"], ints["pp_size"],
                   names["wrote"], names["skipped"])


def encode(report: RankReport) -> bytes:
    return json.dumps(report.to_dict(), separators=(",", ":")).encode()


def decode(raw: bytes) -> RankReport:
    """A report from its bytes; ``ValueError`` for anything malformed."""
    if len(raw) > _MAX_REPORT:
        raise ValueError(f"report of {len(raw)} bytes exceeds {_MAX_REPORT}")
    try:
        d = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"report is not JSON: {exc}") from exc
    return RankReport.from_dict(d)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: object, what: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(x) and x >= 0 for x in v):
        raise ValueError(f"{what} must be a list of ints >= 0")
    return tuple(int(x) for x in v)


def _opt_int(v: object, name: str) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 8:
        raise ValueError(f"{name}: a dimension must be an int in [0, 8)")
    return v


def _fixed(v: object, n: int, what: str) -> Any:
    t = _ints(v, what)
    if len(t) != n:
        raise ValueError(f"{what} must hold {n} ints")
    return t


# ------------------------------------------------------------------ expectation


def checksum_of(t: torch.Tensor) -> int:
    """``block_checksum`` of ``t``'s bytes in logical order, zero-padded to whole words
    (an odd count of 16-bit values is still hashed)."""
    import torch

    from rolloutcore.transports.cuda_ipc.checksum import block_checksum

    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if b.numel() % 4:
        b = torch.cat([b, b.new_zeros(4 - b.numel() % 4)])
    return block_checksum([b])[0]


def _dtype(name: str) -> torch.dtype:
    import torch

    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _qkv_rows(p: ParamWrite, i: int, tp_rank: int) -> tuple[int, int, int]:
    """Part ``i`` (q, k, v) of a QKV parameter on this rank: (offset in the parameter,
    size, start in the checkpoint tensor) along the output dimension, as vLLM's
    ``QKVParallelLinear.weight_loader`` places it (kv heads replicated over ranks
    when there are fewer of them than ranks)."""
    assert p.qkv is not None
    heads, kv_heads, hs, vhs, replicas = p.qkv
    kv_rank = tp_rank // max(1, replicas)
    if i == 0:
        return 0, heads * hs, tp_rank * heads * hs
    if i == 1:
        return heads * hs, kv_heads * hs, kv_rank * kv_heads * hs
    return (heads + kv_heads) * hs, kv_heads * vhs, kv_rank * kv_heads * vhs


def _merged_rows(p: ParamWrite, i: int, tp_rank: int, tp_size: int) -> tuple[int, int, int]:
    """The same for part ``i`` of a merged column (``MergedColumnParallelLinear``)."""
    size = p.output_sizes[i] // tp_size
    offset = sum(p.output_sizes[:i]) // tp_size
    return offset, size, tp_rank * size


def expected(p: ParamWrite, tensors: Mapping[str, torch.Tensor], tp_rank: int,
             tp_size: int) -> torch.Tensor | str:
    """The parameter ``p`` as rank ``tp_rank`` of ``tp_size`` must hold it after the
    round, built from the full checkpoint ``tensors``; a string says why it cannot be."""
    import torch

    if p.kind == "other":
        return "a parallel layer whose placement is not modelled"
    if p.tp is not None:
        tp_rank, tp_size = p.tp
        if not 0 <= tp_rank < max(1, tp_size):
            return f"layer rank {tp_rank} outside its degree {tp_size}"
        tp_size = max(1, tp_size)
    try:
        dt = _dtype(p.dtype)
    except ValueError as exc:
        return str(exc)
    if not p.sources:
        return "no checkpoint tensor placed on it"
    for src, _ in p.sources:
        if src not in tensors:
            return f"{src} was not sent"
    out = torch.zeros(p.shape, dtype=dt)
    odim = 0 if p.output_dim is None else p.output_dim
    try:
        if p.kind in ("merged", "qkv"):
            n_parts = 3 if p.kind == "qkv" else len(p.output_sizes)
            if p.kind == "qkv" and p.qkv is None:
                return "qkv geometry missing"
            if p.kind == "merged" and n_parts < 2:
                return "merged geometry missing"
            for src, parts in p.sources:
                full = tensors[src]
                ids = parts or tuple(range(n_parts))
                # A tensor holding several parts holds them whole, one after the other.
                pieces = _split_whole(p, full, ids, tp_size, odim) if len(ids) > 1 else [full]
                for i, piece in zip(ids, pieces, strict=True):
                    if p.kind == "qkv":
                        off, size, start = _qkv_rows(p, i, tp_rank)
                    else:
                        off, size, start = _merged_rows(p, i, tp_rank, tp_size)
                    out.narrow(odim, off, size).copy_(piece.narrow(odim, start, size))
            return out
        if len(p.sources) != 1 or p.sources[0][1]:
            return f"{len(p.sources)} tensors placed on an unfused parameter"
        full = tensors[p.sources[0][0]]
        if p.kind == "vocab" and p.output_dim is not None:
            if p.vocab is None:
                return "vocabulary range missing"
            start, end = p.vocab
            rows = full.narrow(p.output_dim, start, end - start)
            out.narrow(p.output_dim, 0, end - start).copy_(rows)
            return out
        if p.kind == "column" and p.output_dim is not None and tp_size > 1:
            n = p.shape[p.output_dim]
            out.copy_(full.narrow(p.output_dim, tp_rank * n, n))
            return out
        if p.kind == "row" and p.input_dim is not None and tp_size > 1:
            n = p.shape[p.input_dim]
            out.copy_(full.narrow(p.input_dim, tp_rank * n, n))
            return out
        if tuple(full.shape) != p.shape:
            return f"checkpoint shape {list(full.shape)} is not the parameter's {list(p.shape)}"
        out.copy_(full)
        return out
    except (RuntimeError, IndexError, ValueError) as exc:
        return f"does not follow vLLM's placement: {exc}"


def _tsplit(t: torch.Tensor, sizes: Sequence[int], dim: int) -> tuple[torch.Tensor, ...]:
    import torch

    return tuple(torch.split(t, list(sizes), dim=dim))


def _split_whole(p: ParamWrite, full: torch.Tensor, ids: Sequence[int], tp_size: int,
                 odim: int) -> list[torch.Tensor]:
    if p.kind == "qkv":
        assert p.qkv is not None
        heads, kv_heads, hs, vhs, replicas = p.qkv
        total_kv = max(1, kv_heads * tp_size // max(1, replicas))
        whole = [heads * tp_size * hs, total_kv * hs, total_kv * vhs]
    else:
        whole = list(p.output_sizes)
    sizes = [whole[i] for i in ids]
    return list(_tsplit(full, sizes, odim))


# ------------------------------------------------------------------ comparison


def _rank_row(group_rank: int, rep: RankReport, want: Callable[[ParamWrite], int | str],
              problems: list[str]) -> dict[str, Any]:
    """One rank's comparison: ``want(p)`` is the checksum ``p`` must have, or why it has
    none; ``problems`` (the report is not this rank's, not this round's) fail it, as
    does a rank that did not write every parameter it holds (coverage below 1.0): the
    parameters it left keep the previous version's values, which no probe can be
    relied on to tell from the new one's (#47)."""
    if rep.model_params > len(rep.params):
        problems = [*problems, f"worker {rep.worker_rank} wrote {len(rep.params)} of the "
                    f"{rep.model_params} parameters it holds: a round writes every one"]
    compared = 0
    mismatched: list[str] = []
    uncovered: list[str] = []
    for p in rep.params:
        if p.value is None:
            uncovered.append(f"{p.name}: the rank could not hash it")
            continue
        w = want(p)
        if isinstance(w, str):
            uncovered.append(f"{p.name}: {w}")
            continue
        compared += 1
        if w != p.value:
            mismatched.append(p.name)
    denom = max(rep.model_params, len(rep.params), 1)
    return {"group_rank": group_rank, "worker_rank": rep.worker_rank,
            "tp_rank": rep.tp_rank, "tp_size": rep.tp_size,
            "pp_rank": rep.pp_rank, "pp_size": rep.pp_size,
            "written": len(rep.params), "compared": compared,
            "model_params": rep.model_params,
            "coverage": compared / denom,
            "mismatched": mismatched[:20], "n_mismatched": len(mismatched),
            "uncovered": uncovered[:20], "n_uncovered": len(uncovered),
            "problems": problems, "engine_s": rep.elapsed_s,
            "passed": not problems and not mismatched and not uncovered
            and compared == len(rep.params) and compared > 0}


def _identity_problems(group_rank: int, rep: RankReport, rank_offset: int,
                       nonce: str | None) -> list[str]:
    problems: list[str] = []
    if rep.worker_rank != group_rank - rank_offset:
        problems.append(f"group rank {group_rank} sent the report of worker "
                        f"{rep.worker_rank}")
    if rep.tp_size > 0 and rep.tp_rank != rep.worker_rank % rep.tp_size:
        problems.append(f"worker {rep.worker_rank} reports tensor-parallel rank "
                        f"{rep.tp_rank} of {rep.tp_size}")
    if rep.pp_size > 1 and rep.pp_rank != rep.worker_rank // max(1, rep.tp_size):
        problems.append(f"worker {rep.worker_rank} reports pipeline stage {rep.pp_rank} "
                        f"of {rep.pp_size}")
    if nonce is not None and rep.nonce != nonce:
        problems.append(f"report of round {rep.nonce!r}, not of this one ({nonce!r})")
    return problems


def _result(ranks: list[dict[str, Any]], extra_problems: Sequence[str] = (),
            stages: Mapping[str, Any] | None = None) -> dict[str, Any]:
    tp = {r["tp_rank"] for r in ranks}
    tp_size = max((r["tp_size"] for r in ranks), default=0)
    missing = sorted(set(range(tp_size)) - tp)
    pp = {r.get("pp_rank", 0) for r in ranks}
    pp_size = max((r.get("pp_size", 1) for r in ranks), default=0)
    missing_pp = sorted(set(range(pp_size)) - pp)
    out = {"ranks": ranks, "coverage_per_rank": [r["coverage"] for r in ranks],
           "missing_tp_ranks": missing, "missing_pp_ranks": missing_pp,
           "problems": list(extra_problems),
           "passed": bool(ranks) and not missing and not missing_pp and not extra_problems
           and all(r["passed"] for r in ranks)}
    if stages is not None:
        out["stages"] = dict(stages)
        out["passed"] = out["passed"] and bool(stages["passed"])
    return out


def stage_coverage(reports: Sequence[RankReport], names: Sequence[str] | None = None
                   ) -> dict[str, Any]:
    """Every checkpoint tensor of the round written by exactly one pipeline stage.

    ``names``: the round's tensors (the trainer's; ``None``: those the reports
    name, as a gateway knows them). For each tensor-parallel rank, the stages'
    ``wrote`` lists must partition ``names``: a tensor no stage wrote (every
    stage skipped it, or none listed it) or two stages wrote fails, as does a
    report that accounts for a tensor the round did not send, or leaves one of
    the round's tensors neither written nor skipped. At one stage (no pipeline)
    every rank writes every tensor. ``per_stage``: per (stage, tensor-parallel
    rank), tensors written, skipped, and ``coverage`` = written / the tensors
    no other stage wrote (1.0 when the stage wrote all it owns).
    """
    if names is None:
        every: list[str] = []
        for r in reports:
            every += [*r.wrote, *r.skipped]
        names = list(dict.fromkeys(every))
    want = list(dict.fromkeys(names))
    wanted = set(want)
    problems: list[str] = []
    per: list[dict[str, Any]] = []
    by_tp: dict[int, list[RankReport]] = {}
    for r in reports:
        by_tp.setdefault(r.tp_rank, []).append(r)
        beyond = sorted((set(r.wrote) | set(r.skipped)) - wanted)
        unaccounted = sorted(wanted - set(r.wrote) - set(r.skipped))
        if beyond:
            problems.append(f"worker {r.worker_rank} accounts for {len(beyond)} tensor(s) "
                            f"the round did not send ({', '.join(beyond[:3])})")
        if unaccounted:
            problems.append(f"worker {r.worker_rank} neither wrote nor skipped "
                            f"{len(unaccounted)} tensor(s) ({', '.join(unaccounted[:3])})")
    unwritten: list[str] = []
    twice: list[str] = []
    for tp_rank, reps in sorted(by_tp.items()):
        writers: dict[str, list[int]] = {n: [] for n in want}
        for r in reps:
            for n in r.wrote:
                if n in writers:
                    writers[n].append(r.pp_rank)
        none = [n for n, w in writers.items() if not w]
        many = [f"{n} (stages {sorted(w)})" for n, w in writers.items() if len(w) > 1]
        if none:
            problems.append(f"no stage of tensor-parallel rank {tp_rank} wrote "
                            f"{len(none)} tensor(s) ({', '.join(none[:3])})")
        if many:
            problems.append(f"{len(many)} tensor(s) written by more than one stage of "
                            f"tensor-parallel rank {tp_rank}: {', '.join(many[:3])}")
        unwritten += none
        twice += [n for n, w in writers.items() if len(w) > 1]
        for r in sorted(reps, key=lambda r: r.pp_rank):
            others = {n for o in reps if o is not r for n in o.wrote}
            owned = [n for n in want if n not in others]
            mine = [n for n in owned if n in set(r.wrote)]
            per.append({"worker_rank": r.worker_rank, "pp_rank": r.pp_rank,
                        "tp_rank": tp_rank, "wrote": len(r.wrote),
                        "skipped": len(r.skipped),
                        "coverage": len(mine) / len(owned) if owned else 0.0})
    return {"tensors": len(want), "per_stage": per,
            "unwritten": sorted(set(unwritten))[:20], "n_unwritten": len(set(unwritten)),
            "written_twice": sorted(set(twice))[:20], "n_written_twice": len(set(twice)),
            "problems": problems,
            "passed": bool(reports) and bool(want) and not problems}


def _rebuilt(p: ParamWrite, tensors: Mapping[str, torch.Tensor], rep: RankReport) -> int | str:
    """The checksum ``p`` must have on ``rep``'s rank, rebuilt from ``tensors`` (or why
    it cannot be)."""
    t = expected(p, tensors, rep.tp_rank, max(1, rep.tp_size))
    return t if isinstance(t, str) else checksum_of(t)


def compare_ranks(reports: Sequence[tuple[int, RankReport]],
                  tensors: Mapping[str, torch.Tensor], *, rank_offset: int = 1,
                  nonce: str | None = None, names: Sequence[str] | None = None
                  ) -> dict[str, Any]:
    """Every rank's checksums against the trainer's, per rank.

    ``reports``: (group rank that sent it, report). A rank passes when its
    report is its own (the worker rank its group rank implies, the nonce
    of this round), every parameter it wrote could be
    reconstructed and equals the trainer's checksum. ``coverage_per_rank``:
    compared parameters over the rank's distinct model parameters.
    ``names``: the round's tensors; given, the stages' reports must together
    write each exactly once per tensor-parallel rank (``stage_coverage``, in
    ``stages``).
    """
    ranks = [_rank_row(group_rank, rep, functools.partial(_rebuilt, tensors=tensors, rep=rep),
                       _identity_problems(group_rank, rep, rank_offset, nonce))
             for group_rank, rep in reports]
    stages = None if names is None else stage_coverage([r for _, r in reports], names)
    return _result(ranks, stages=stages)


# ------------------------------------------------------------------ through a gateway
#
# A gateway cannot rebuild the slices (it has no tensors) and must not take the ranks'
# reports from the trainer (the trainer could write them). So the two halves come from
# the two parties: the trainer declares, per engine worker, the checksum each parameter
# the worker wrote must have, rebuilt from the tensors it broadcast (``declare``); the
# gateway asks the engine's workers for their own reports (``/collective_rpc`` of
# ``gloo_report.METHOD``) and compares them with the declaration
# (``compare_declared``), under the round nonce the gateway issued for the update.


def declare(reports: Sequence[tuple[int, RankReport]], tensors: Mapping[str, torch.Tensor],
            *, rank_offset: int = 1) -> list[dict[str, Any]]:
    """The trainer's declaration, per engine worker: ``{"worker_rank", "names",
    "values"}``, each value the checksum of ``expected()`` from ``tensors`` (``None``
    where the slice cannot be rebuilt: the gateway counts it as not compared)."""
    out: list[dict[str, Any]] = []
    for group_rank, rep in sorted(reports, key=lambda r: r[0]):
        names: list[str] = []
        values: list[int | None] = []
        for p in rep.params:
            v = _rebuilt(p, tensors, rep)
            names.append(p.name)
            values.append(None if isinstance(v, str) else v)
        out.append({"worker_rank": group_rank - rank_offset, "names": names,
                    "values": values})
    return out


def compare_declared(reports: Sequence[tuple[int, RankReport | str]],
                     declared: Mapping[int, Mapping[str, int | None]], *,
                     nonce: str) -> dict[str, Any]:
    """The workers' own reports against the trainer's declaration, per rank.

    ``reports``: (worker index, the report that worker answered, or why it has none:
    a rank without a report fails). ``declared``: worker rank -> parameter -> the
    checksum the trainer says it must hold. A rank passes when its report is its
    own and of round ``nonce``, every parameter it wrote is declared with a value
    and equal, and the trainer declares nothing that rank did not write.
    """
    ranks: list[dict[str, Any]] = []
    extra: list[str] = []
    for worker, rep in reports:
        if isinstance(rep, str):
            ranks.append({"group_rank": worker, "worker_rank": worker, "tp_rank": -1,
                          "tp_size": 0, "written": 0, "compared": 0, "model_params": 0,
                          "coverage": 0.0, "mismatched": [], "n_mismatched": 0,
                          "uncovered": [], "n_uncovered": 0,
                          "problems": [f"worker {worker}: {rep}"], "engine_s": 0.0,
                          "passed": False})
            continue
        mine = declared.get(rep.worker_rank, {})
        problems = _identity_problems(worker, rep, 0, nonce)
        if rep.worker_rank not in declared:
            problems.append(f"the trainer declared nothing for worker {rep.worker_rank}")
        written = {p.name for p in rep.params}
        beyond = sorted(set(mine) - written)
        if beyond:
            problems.append(f"the trainer declares {len(beyond)} parameter(s) worker "
                            f"{rep.worker_rank} did not write ({', '.join(beyond[:3])})")

        def want(p: ParamWrite, mine: Mapping[str, int | None] = mine) -> int | str:
            if p.name not in mine:
                return "not in the trainer's declaration"
            v = mine[p.name]
            return "the trainer could not rebuild it" if v is None else v

        ranks.append(_rank_row(worker, rep, want, problems))
    workers = {w for w, _ in reports}
    ghosts = sorted(set(declared) - workers)
    if ghosts:
        extra.append(f"the trainer declares workers {ghosts} this engine does not have")
    own = [r for _, r in reports if not isinstance(r, str)]
    # Workers that account for the round's tensors (every rolloutcore_gloo worker of
    # this version; always at more than one pipeline stage): each tensor they name
    # written by exactly one stage.
    stages = stage_coverage(own) if any(
        r.wrote or r.skipped or r.pp_size > 1 for r in own) else None
    return _result(ranks, extra, stages)


def to_check(result: Mapping[str, Any]) -> Check:
    """The comparison as the paused validation's ``Check`` (``ENGINE_CHECKSUM`` level)."""
    ranks = result.get("ranks") or []
    bits = []
    for r in ranks:
        s = (f"rank {r['tp_rank']}/{r['tp_size']}: {r['compared']}/{r['model_params']} "
             f"compared, {r['n_mismatched']} differ")
        if r["mismatched"]:
            s += f" ({', '.join(r['mismatched'][:3])})"
        if r["n_uncovered"]:
            s += f", {r['n_uncovered']} not reconstructible ({r['uncovered'][0]})"
        if r["problems"]:
            s += f", {'; '.join(r['problems'])}"
        bits.append(s)
    if result.get("missing_tp_ranks"):
        bits.append(f"no report from tensor-parallel ranks {result['missing_tp_ranks']}")
    if result.get("missing_pp_ranks"):
        bits.append(f"no report from pipeline stages {result['missing_pp_ranks']}")
    stages = result.get("stages")
    if isinstance(stages, Mapping):
        bits.extend(stages.get("problems") or [])
        per = stages.get("per_stage") or []
        if any(s.get("pp_rank", 0) for s in per):
            bits.append("coverage_per_stage=[" + ", ".join(
                f"{s['pp_rank']}/{s['tp_rank']}:{float(s['coverage']):.3f}" for s in per)
                + "]")
    bits.extend(result.get("problems") or [])
    cov = [float(c) for c in result.get("coverage_per_rank") or []]
    if cov:
        bits.append("coverage_per_rank=[" + ", ".join(f"{c:.3f}" for c in cov) + "]")
    # A tensor no stage wrote lowers the coverage too (every stage's share of it).
    low = cov + ([float(s["coverage"]) for s in stages.get("per_stage") or []]
                 if isinstance(stages, Mapping) else [])
    return Check("worker_shard_checksum", bool(result.get("passed")),
                 detail="; ".join(bits) or "no rank reported",
                 coverage=min(low) if cov else 0.0, level=VerificationLevel.ENGINE_CHECKSUM)
