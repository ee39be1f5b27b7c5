"""A transfer report's ``sent_checksum``: its bodies, and the rank declaration's rules.

Two schemes (``engine.sent.SENT_SCHEMES``), told apart by ``scheme``:
``rc_cuda_ipc/block`` (the transport's checksum of what it sent, by name) and
``rolloutcore_gloo/rank`` (issue 30: what the trainer declares each engine
worker of a tensor-parallel engine must hold, rebuilt from what it
broadcast). For the second, the gateway asks each worker for its own report
of the round and compares; the trainer never relays a rank's report. A
declaration must carry the round nonce of the update's grant (so an earlier
round's reports cannot pass for this one), and where the gateway's engine
answers its ranks' reports (``ServiceConfig.transport["rank_reports"]``) a
completed gloo transfer must carry one. Each refusal is a 422 with the lease
still open: the body changed nothing.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic import model_validator as _model_validator

from rolloutcore.core.versions import WeightIdentity
from rolloutcore.service.config import ServiceConfig
from rolloutcore.transports.rank_checksums import SCHEME as RANK_SCHEME

__all__ = ["RANK_SCHEME", "RankDeclarationBody", "RankSentBody", "SentChecksumBody",
           "check_rank_declaration", "worker_shards"]

_INT63 = 2**63 - 1
_Name = Annotated[str, StringConstraints(min_length=1, max_length=512)]
_Value = Annotated[int, Field(ge=0, le=_INT63)] | None
_Hex64 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class SentChecksumBody(_Strict):
    """The transport's checksum of what it sent (``engine.sent.SENT_SCHEMES``)."""

    scheme: Literal["rc_cuda_ipc/block"]
    names: Annotated[list[_Name], Field(min_length=1, max_length=1 << 16)]
    values: Annotated[list[_Value], Field(min_length=1, max_length=1 << 16)]

    @_model_validator(mode="after")
    def _one_value_per_name(self) -> SentChecksumBody:
        # Refused here, at the edge (422, the lease still open): a body the gateway
        # cannot use never leaves the update half-reported.
        if len(set(self.names)) != len(self.names):
            raise ValueError("sent_checksum.names repeat a name")
        if len(self.values) != len(self.names):
            raise ValueError("sent_checksum needs one value per name")
        return self


class RankDeclarationBody(_Strict):
    """What the trainer declares one engine worker wrote: each parameter's checksum, rebuilt
    from the tensors it broadcast (``rank_checksums.declare``; null: not rebuildable)."""

    worker_rank: Annotated[int, Field(ge=0, lt=1024)]
    names: Annotated[list[_Name], Field(min_length=1, max_length=1 << 16)]
    values: Annotated[list[_Value], Field(min_length=1, max_length=1 << 16)]

    @_model_validator(mode="after")
    def _one_value_per_name(self) -> RankDeclarationBody:
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"worker {self.worker_rank}: names repeat a name")
        if len(self.values) != len(self.names):
            raise ValueError(f"worker {self.worker_rank}: needs one value per name")
        return self


class RankSentBody(_Strict):
    """A tensor-parallel gloo round's per-rank declaration: the gateway asks each worker
    for its own report and compares, under ``nonce``, the round nonce of the grant."""

    scheme: Literal["rolloutcore_gloo/rank"]
    nonce: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    #: What the round sent, as an identity records it (``Round.digests``): the
    #: checkpoint this declaration stands for, compared with the one the update claims.
    manifest_digest: _Hex64
    content_digest: _Hex64
    ranks: Annotated[list[RankDeclarationBody], Field(min_length=1, max_length=1024)]

    @_model_validator(mode="after")
    def _each_worker_once(self) -> RankSentBody:
        workers = [r.worker_rank for r in self.ranks]
        if len(set(workers)) != len(workers):
            raise ValueError("sent_checksum.ranks declare a worker twice")
        return self


def check_rank_declaration(config: ServiceConfig, round_nonce: str,
                           sent: Mapping[str, Any] | None, *, completed: bool,
                           backend: str, claimed: WeightIdentity | None = None,
                           source_manifest: str | None = None) -> str | None:
    """Why a transfer report's ``sent`` cannot be used for the update whose grant issued
    ``round_nonce`` (a 422, the lease still open), or None.

    ``claimed``: the identity the update claims; a declaration stands for what its round
    sent (``manifest_digest``, ``content_digest``), which must be that checkpoint: its
    manifest (``source_manifest``, the begin's, by default the identity's) and, where
    the identity names one, its content (#47: a round that sent one tensor, or every
    tensor of another checkpoint, cannot stand for the one claimed)."""
    ranked = bool(config.transport.get("rank_reports"))
    if sent is not None and sent.get("scheme") == RANK_SCHEME:
        if not ranked:
            return ("this gateway's engine does not answer its ranks' reports "
                    f"({RANK_SCHEME} cannot be compared here)")
        if not hmac.compare_digest(str(sent.get("nonce")).encode(), round_nonce.encode()):
            return (f"sent_checksum {RANK_SCHEME}: the nonce is not this update's round "
                    "nonce (the grant's round_nonce): the declaration is of another round")
        if claimed is None:
            return None
        want = source_manifest or claimed.manifest_digest
        if sent.get("manifest_digest") != want:
            return (f"sent_checksum {RANK_SCHEME}: the round sent tensors of manifest "
                    f"{str(sent.get('manifest_digest'))[:12]}, the update claims manifest "
                    f"{want[:12]}: the declaration is not of the claimed checkpoint")
        if claimed.content_digest is not None and \
                sent.get("content_digest") != claimed.content_digest:
            return (f"sent_checksum {RANK_SCHEME}: the round sent content "
                    f"{str(sent.get('content_digest'))[:12]}, the update claims content "
                    f"{claimed.content_digest[:12]}: the declaration is not of the claimed "
                    "checkpoint")
        return None
    if ranked and completed and backend == "rolloutcore_gloo":
        return (f"this engine's ranks are checked by the gateway: a completed "
                f"rolloutcore_gloo transfer reports sent_checksum {{scheme: "
                f"{RANK_SCHEME!r}, nonce: the grant's round_nonce, ranks: "
                "GlooTransport.declared_checksums()}")
    return None


_KEEP = ("worker_rank", "tp_rank", "tp_size", "pp_rank", "pp_size", "compared", "model_params",
         "coverage",
         "n_mismatched", "mismatched", "n_uncovered", "problems", "passed")


def worker_shards(adapter: Any) -> dict[str, Any] | None:
    """The per-rank comparison of the report's rank declaration (the adapter's
    ``last_rank_result``), trimmed for the update's status; None without one."""
    r = getattr(adapter, "last_rank_result", None)
    if not isinstance(r, Mapping):
        return None
    out = {"passed": bool(r.get("passed")),
           "coverage_per_rank": [float(c) for c in r.get("coverage_per_rank") or []],
           "missing_tp_ranks": list(r.get("missing_tp_ranks") or []),
           "missing_pp_ranks": list(r.get("missing_pp_ranks") or []),
           "problems": list(r.get("problems") or [])[:5],
           "ranks": [{k: (v[:5] if isinstance(v, list) else v) for k, v in rk.items()
                      if k in _KEEP} for rk in r.get("ranks") or []]}
    st = r.get("stages")
    if isinstance(st, Mapping):  # every tensor written by exactly one pipeline stage
        out["stages"] = {k: (v[:5] if isinstance(v, list) and k != "per_stage" else v)
                         for k, v in st.items()}
    return out
