"""A remote trainer's transport checksum of what it sent, compared by the gateway.

Where the transport hashes what it sends (``rc_cuda_ipc``'s block checksum),
the trainer reports that checksum with its transfer; the gateway then asks
the engine's workers to hash what the last update wrote and compares the
two itself, through the one comparison (``verification.checksums.compare``),
while the engine is still paused. The trainer's word is only what it sent.

``rolloutcore_gloo/rank`` (issue 30, a tensor-parallel engine): the trainer
declares, per engine worker, the checksum each parameter that worker wrote
must hold, rebuilt from the tensors it broadcast (``rank_checksums.declare``),
under the round nonce the gateway issued in its grant. The gateway asks each
worker for its own report of the round (``/collective_rpc`` of
``gloo_report.METHOD``: the checksums taken as it loaded, the nonce it was
sent) and compares (``rank_checksums.compare_declared``). A report of another
round, a rank without one, a parameter declared or written on one side only:
each fails the check; the trainer never relays a rank's report.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.errors import BadInput, EffectError, RolloutCoreError
from rolloutcore.transports import gloo_report, rank_checksums
from rolloutcore.verification.checksums import HEX64

__all__ = ["SENT_SCHEMES", "check_sent_scheme", "compare_rank_reports",
           "compare_sent", "rank_reports_supported"]


#: Transport checksums a remote trainer may report of what it sent, and the engine
#: call that hashes the same tensors on the workers: the gateway asks the engine
#: and compares, so the comparison is not the trainer's word.
SENT_SCHEMES: Mapping[str, str] = {"rc_cuda_ipc/block": "rc_cuda_ipc_checksum",
                                   rank_checksums.SCHEME: gloo_report.METHOD}
_MAX_SENT = 1 << 16
#: The most engine workers a rank declaration may name (gloo's group bound).
MAX_RANKS = 1024


def _names_values(names: object, values: object, what: str) -> None:
    if not isinstance(names, list) or not 0 < len(names) <= _MAX_SENT or not all(
            isinstance(n, str) and 0 < len(n) <= 512 for n in names):
        raise BadInput(f"{what}: names must be 1..{_MAX_SENT} strings")
    if len(set(names)) != len(names):
        raise BadInput(f"{what}: duplicate names")
    if not isinstance(values, list) or len(values) != len(names) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63)
            for v in values):
        raise BadInput(f"{what}: one value per name, each a non-negative int or null")


def check_sent_scheme(sent: Mapping[str, Any]) -> None:
    """``BadInput`` unless ``sent`` is a known scheme, well formed: one value per name
    (per rank, for ``rolloutcore_gloo/rank``)."""
    if not isinstance(sent, Mapping) or "scheme" not in sent:
        raise BadInput("sent checksum: needs a 'scheme'")
    if sent["scheme"] not in SENT_SCHEMES:
        raise BadInput(f"sent checksum: unknown scheme {sent['scheme']!r} "
                       f"(known: {sorted(SENT_SCHEMES)})")
    if sent["scheme"] == rank_checksums.SCHEME:
        _check_rank_declaration(sent)
        return
    if set(sent) != {"scheme", "names", "values"}:
        raise BadInput("sent checksum: needs exactly 'scheme', 'names', 'values'")
    _names_values(sent["names"], sent["values"], "sent checksum")


def _check_rank_declaration(sent: Mapping[str, Any]) -> None:
    what = f"sent checksum {rank_checksums.SCHEME}"
    if set(sent) != {"scheme", "nonce", "manifest_digest", "content_digest", "ranks"}:
        raise BadInput(f"{what}: needs exactly 'scheme', 'nonce', 'manifest_digest', "
                       "'content_digest', 'ranks'")
    for k in ("manifest_digest", "content_digest"):
        if not isinstance(sent[k], str) or not HEX64.fullmatch(sent[k]):
            raise BadInput(f"{what}: {k} must be a sha256 hex digest (of what the round sent)")
    nonce = sent["nonce"]
    if not isinstance(nonce, str) or not 0 < len(nonce) <= 128:
        raise BadInput(f"{what}: nonce must be a string of 1..128 characters")
    ranks = sent["ranks"]
    if not isinstance(ranks, list) or not 0 < len(ranks) <= MAX_RANKS:
        raise BadInput(f"{what}: ranks must be a list of 1..{MAX_RANKS} declarations")
    seen: set[int] = set()
    for i, r in enumerate(ranks):
        if not isinstance(r, Mapping) or set(r) != {"worker_rank", "names", "values"}:
            raise BadInput(f"{what}: ranks[{i}] needs exactly 'worker_rank', 'names', "
                           "'values'")
        w = r["worker_rank"]
        if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w < MAX_RANKS:
            raise BadInput(f"{what}: ranks[{i}].worker_rank must be an int in "
                           f"[0, {MAX_RANKS})")
        if w in seen:
            raise BadInput(f"{what}: worker {w} is declared twice")
        seen.add(w)
        _names_values(r["names"], r["values"], f"{what}: ranks[{i}]")


def compare_sent(http: VllmHTTP, sent: Mapping[str, Any], timeout_s: float = 60.0, *,
                 record: Callable[[dict[str, Any]], None] | None = None) -> Check:
    """The engine's workers hash what the last update wrote; compared with what was sent
    (a ``sent`` that ``check_sent_scheme`` has already passed).

    For ``rc_cuda_ipc/block``: ``/collective_rpc rc_cuda_ipc_checksum`` on
    every worker (the block checksum of the slices the last update wrote),
    compared position by position through the one comparison
    (``verification.checksums.compare``). Passes only with every tensor
    compared, none mismatched, and every model parameter covered.
    ``record``: given the per-rank comparison of a ``rolloutcore_gloo/rank``
    declaration (``rank_checksums.compare_declared``'s result)."""
    if sent["scheme"] == rank_checksums.SCHEME:
        chk, result = compare_rank_reports(http, sent, timeout_s)
        if record is not None:
            record(result)
        return chk
    from rolloutcore.transports.cuda_ipc.wire import names_digest
    from rolloutcore.verification.checksums import compare

    names, values = list(sent["names"]), list(sent["values"])
    res = _worker_results(http, SENT_SCHEMES[sent["scheme"]], timeout_s, ["auto"])
    want = names_digest(names)
    mism: list[str] = []
    covered = len(names)
    uncovered = 0
    for w in res:
        theirs = w.get("values") if isinstance(w, dict) else None
        if not isinstance(w, dict) or w.get("names_digest") != want or not isinstance(
                theirs, list) or len(theirs) != len(names):
            mism.append("<the worker's last update is not the one reported>")
            covered = 0
            continue
        uncovered = max(uncovered, int(w.get("n_uncovered", 0) or 0))
        r = compare(dict(zip(names, theirs, strict=True)),
                    {n: v for n, v in zip(names, values, strict=True) if v is not None},
                    keyed_by="position")
        mism.extend(r.mismatched)
        covered = min(covered, r.compared)
    passed = not mism and covered == len(names) and not uncovered
    return Check("sent_block_checksum", passed,
                 f"workers' block checksum of the updated slices vs the trainer's checksum "
                 f"of what it sent, compared by the gateway; workers={len(res)} "
                 f"coverage={covered / len(names):.3f} mismatched={len(mism)} "
                 f"uncovered_params={uncovered}"
                 + (f" first mismatches: {mism[:3]}" if mism else ""),
                 coverage=covered / len(names), level=VerificationLevel.ENGINE_CHECKSUM)


def _worker_results(http: VllmHTTP, method: str, timeout_s: float,
                    args: list[str] | None = None) -> list[Any]:
    """Every engine worker's answer to ``method`` (``/collective_rpc``), or ``EffectError``."""
    body = http._post_json(Routes.COLLECTIVE_RPC, "validate",
                           {"method": method, "timeout": timeout_s,
                            **({} if args is None else {"args": args})}, timeout_s)
    res = body.get("results") if isinstance(body, dict) else None
    if not isinstance(res, list) or not res:
        raise EffectError("validate", f"{method}: no results from the engine's workers")
    return res


def _worker_reports(results: list[Any]) -> list[tuple[int, rank_checksums.RankReport | str]]:
    out: list[tuple[int, rank_checksums.RankReport | str]] = []
    for i, w in enumerate(results):
        rep = w.get("report") if isinstance(w, dict) else None
        if not isinstance(w, dict):
            out.append((i, "answered no object"))
        elif rep is None:
            out.append((i, f"no report ({str(w.get('reason') or 'none given')[:200]})"))
        else:
            try:
                out.append((i, rank_checksums.RankReport.from_dict(rep)))
            except ValueError as exc:
                out.append((i, f"its report is malformed: {exc}"))
    return out


def compare_rank_reports(http: VllmHTTP, sent: Mapping[str, Any], timeout_s: float = 60.0
                         ) -> tuple[Check, dict[str, Any]]:
    """Each engine worker's own report of the last round, asked by this process
    (``/collective_rpc``), against the trainer's per-rank declaration ``sent``;
    the ``Check`` (``worker_shard_checksum``) and the per-rank result."""
    res = _worker_results(http, gloo_report.METHOD, timeout_s)
    declared = {int(r["worker_rank"]): dict(zip(r["names"], r["values"], strict=True))
                for r in sent["ranks"]}
    result = rank_checksums.compare_declared(_worker_reports(res), declared,
                                             nonce=str(sent["nonce"]))
    chk = rank_checksums.to_check(result)
    return dataclasses.replace(chk, detail=(
        "each worker's own report, asked by the gateway, vs the trainer's declaration; "
        + chk.detail)), result


def rank_reports_supported(http: VllmHTTP, *, timeout_s: float = 30.0) -> bool:
    """Whether the engine's workers answer ``gloo_report.METHOD`` (a read: nothing
    changes). Asked only where the engine has a worker extension and
    ``/collective_rpc``; any failure is ``False``."""
    try:
        if Routes.COLLECTIVE_RPC not in http.capabilities():
            return False
        cfg = http.server_info(timeout_s=timeout_s).get("vllm_config")
        pc = cfg.get("parallel_config") if isinstance(cfg, dict) else None
        if isinstance(pc, dict) and not pc.get("worker_extension_cls"):
            return False
        body = http._post_json(Routes.COLLECTIVE_RPC, "rank_reports",
                               {"method": gloo_report.METHOD, "timeout": timeout_s},
                               timeout_s)
    except RolloutCoreError:
        return False
    res = body.get("results") if isinstance(body, dict) else None
    return isinstance(res, list) and bool(res) and all(
        isinstance(w, dict) and "report" in w for w in res)
