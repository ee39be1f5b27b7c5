"""A remote trainer's transport checksum of what it sent, compared by the gateway.

Where the transport hashes what it sends (``rc_cuda_ipc``'s block checksum),
the trainer reports that checksum with its transfer; the gateway then asks
the engine's workers to hash what the last update wrote and compares the
two itself, through the one comparison (``verification.checksums.compare``),
while the engine is still paused. The trainer's word is only what it sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rolloutcore.adapters.vllm.http import VllmHTTP
from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EffectError

__all__ = ["SENT_SCHEMES", "check_sent", "check_sent_scheme", "compare_sent"]


#: Transport checksums a remote trainer may report of what it sent, and the engine
#: call that hashes the same tensors on the workers: the gateway asks the engine
#: and compares, so the comparison is not the trainer's word.
SENT_SCHEMES: Mapping[str, str] = {"rc_cuda_ipc/block": "rc_cuda_ipc_checksum"}
_MAX_SENT = 1 << 16


def check_sent_scheme(sent: Mapping[str, Any]) -> None:
    """``BadInput`` unless ``sent`` is a known scheme with one value per name."""
    if not isinstance(sent, Mapping) or set(sent) != {"scheme", "names", "values"}:
        raise BadInput("sent checksum: needs exactly 'scheme', 'names', 'values'")
    if sent["scheme"] not in SENT_SCHEMES:
        raise BadInput(f"sent checksum: unknown scheme {sent['scheme']!r} "
                       f"(known: {sorted(SENT_SCHEMES)})")
    names, values = sent["names"], sent["values"]
    if not isinstance(names, list) or not 0 < len(names) <= _MAX_SENT or not all(
            isinstance(n, str) and 0 < len(n) <= 512 for n in names):
        raise BadInput(f"sent checksum: names must be 1..{_MAX_SENT} strings")
    if len(set(names)) != len(names):
        raise BadInput("sent checksum: duplicate names")
    if not isinstance(values, list) or len(values) != len(names) or not all(
            v is None or (isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 63)
            for v in values):
        raise BadInput("sent checksum: one value per name, each a non-negative int or null")


def check_sent(http: VllmHTTP, sent: Mapping[str, Any], *, timeout_s: float = 60.0) -> Check:
    """The engine's workers hash what the last update wrote; compared with what was sent.

    For ``rc_cuda_ipc/block``: ``/collective_rpc rc_cuda_ipc_checksum`` on
    every worker (the block checksum of the slices the last update wrote),
    compared position by position through the one comparison
    (``verification.checksums.compare``). Passes only with every tensor
    compared, none mismatched, and every model parameter covered.
    """
    check_sent_scheme(sent)
    return compare_sent(http, sent, timeout_s)


def compare_sent(http: VllmHTTP, sent: Mapping[str, Any], timeout_s: float = 60.0) -> Check:
    """``check_sent`` of a ``sent`` that ``check_sent_scheme`` has already passed."""
    from rolloutcore.transports.cuda_ipc.wire import names_digest
    from rolloutcore.verification.checksums import compare

    names, values = list(sent["names"]), list(sent["values"])
    method = SENT_SCHEMES[sent["scheme"]]
    body = http._post_json("/collective_rpc", "validate",
                           {"method": method, "args": ["auto"], "timeout": timeout_s},
                           timeout_s)
    res = body.get("results") if isinstance(body, dict) else None
    if not isinstance(res, list) or not res:
        raise EffectError("validate", f"{method}: no results from the engine's workers")
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
