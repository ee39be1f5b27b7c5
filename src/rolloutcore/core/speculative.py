"""Which engines decode with a draft that holds weights, and why their target-only updates
are refused.

An engine started with vLLM's ``--speculative-config`` names its method in
``/server_info`` (``vllm_config.speculative_config.method``). Where the draft
has weights (a draft model, an EAGLE head, MTP layers...), an update that
writes the target alone leaves the draft on the old policy: no output token
shows it, acceptance falls to about 0. Every entry point that can update such
an engine refuses a target-only update before anything changes (the session
and the adapters' preflight, the gateway's begin, the fleet's update).
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["WEIGHTLESS_METHODS", "engine_draft", "engine_draft_of", "engine_draft_refusal"]

#: Speculative methods whose drafts hold no weights (n-gram and suffix lookup in the
#: prompt): a target-only update leaves nothing of theirs on the old policy.
WEIGHTLESS_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})


def engine_draft(vllm_config: object) -> str | None:
    """The speculative method of an engine whose draft holds weights, read from its
    ``/server_info`` ``vllm_config`` (``speculative_config.method``); ``None`` when it
    decodes without a draft or with a weightless one. A speculative config that cannot
    be read is taken as a draft (``"unknown"``): refusing is the safe side."""
    if not isinstance(vllm_config, Mapping):
        return None
    sc = vllm_config.get("speculative_config")
    if not sc:
        return None
    m = sc.get("method") if isinstance(sc, Mapping) else None
    if m in WEIGHTLESS_METHODS:
        return None
    return m if isinstance(m, str) and m else "unknown"


def engine_draft_of(adapter: object) -> str | None:
    """``engine_draft`` as an engine adapter read it at bootstrap (``draft_method``)."""
    m = getattr(adapter, "draft_method", None)
    return m if isinstance(m, str) and m else None


def engine_draft_refusal(method: str, *, remote: bool = False) -> str:
    """Why a target-only update of an engine drafting with ``method`` is refused."""
    how = ("updates through the trainer protocol and a fleet's carry the target only "
           "(drafted ones are not built there): update this engine with DraftedSession"
           if remote
           else "send the draft's weights with the target's (DraftedSession, draft_weights=...)")
    return (f"this engine decodes speculatively with a draft (method {method}) whose weights "
            "a target-only update would leave on the old policy (acceptance falls to about "
            f"0); refused, nothing was changed: {how}")
