"""A policy with a speculative-decoding draft: two sets of weights, one transfer.

An engine started with ``--speculative-config '{"method": "draft_model",
"model": DIR, ...}'`` decodes with two models: the target (whose tokens are
served) and a draft that proposes tokens for the target to accept. A
trainer that moves the target and not the draft leaves the draft on the old
policy: every token is still the target's, so no output shows it, but
acceptance falls to about zero and throughput with it (vime #351,
vllm-ascend #13209). Both must move together, and be checked together.

* ``DraftedSource``: the trainer's target and draft as one ``WeightSource``.
  Its tensors and manifest are the target's (what the engine's model
  receives and what every existing check compares); its
  ``content_digest()`` is ``policy_digest`` over both, so the
  ``WeightIdentity`` a version publishes names both, and a preflight
  against that identity fails for any other pair.
* ``DraftedGlooTransport``: ``rolloutcore_gloo`` that sends a
  ``DraftedSource`` as two rounds inside the one transfer step: the draft
  first (``/start_draft_weight_update``; its finish sets no weight version),
  then the target, whose finish carries the label. The label thus moves only
  once both are in. Any failure after the draft round's start is a mutation
  (the engine is tainted, nothing is published). A source without a draft
  is refused before anything is sent (``require_draft``, the default).
  ``validation_check`` is the workers' checksums of what each round wrote,
  the target's against what was sent and the draft's against the draft
  source read again (so that a draft round that put other weights on the
  wire is caught), combined into one check (``combine_checks``).
* ``refusal(transport, source)``: why a transport refuses a source up front
  (``EngineSession.apply`` asks before it drains anything).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import Check, TransferEvidence
from rolloutcore.core.speculative import (
    WEIGHTLESS_METHODS,
    engine_draft,
    engine_draft_of,
    engine_draft_refusal,
)
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = ["DRAFT_REFUSAL", "WEIGHTLESS_METHODS", "DraftedGlooTransport", "DraftedSource",
           "combine_checks", "engine_draft", "engine_draft_of", "engine_draft_refusal",
           "policy_digest", "refusal"]

DRAFT_REFUSAL = ("this engine decodes speculatively with a draft model, and the update "
                 "carries no draft weights: a target-only update would leave the draft on "
                 "the old policy (acceptance falls to about 0); refused, nothing was changed. "
                 "Send the draft's weights with the target's (draft_weights=...)")

_HEX = frozenset("0123456789abcdef")


def _check_hex(name: str, v: object) -> str:
    if not isinstance(v, str) or len(v) != 64 or not set(v) <= _HEX:
        raise BadInput(f"{name} must be a sha256 hex digest, got {v!r}")
    return v


def policy_digest(target_content: str, draft_content: str, draft_manifest: str) -> str:
    """The content digest of a (target, draft) pair: sha256 over both contents and
    the draft's manifest (the target's manifest is the identity's own)."""
    body = {"target": _check_hex("target_content", target_content),
            "draft": _check_hex("draft_content", draft_content),
            "draft_manifest": _check_hex("draft_manifest", draft_manifest)}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


class DraftedSource(WeightSource):
    """The target's tensors and manifest, and a draft beside them; one content digest.

    Iterating gives the target's tensors (what the engine's target model
    receives); ``draft`` is the draft model's source. ``content_digest()``
    is ``policy_digest(target, draft, draft manifest)``.
    """

    def __init__(self, target: WeightSource, draft: WeightSource) -> None:
        if not isinstance(target, WeightSource) or isinstance(target, DraftedSource):
            raise BadInput("target must be a plain WeightSource")
        if not isinstance(draft, WeightSource) or isinstance(draft, DraftedSource):
            raise BadInput("draft must be a plain WeightSource")
        if target is draft:
            raise BadInput("target and draft must be two sources (the same object was "
                           "given twice)")
        entries = [(p.name, tuple(p.shape), p.dtype) for p in target.manifest().params]

        def load() -> Iterator[tuple[str, torch.Tensor]]:
            return target.named_tensors()

        super().__init__(entries, load, f"{target.description} with draft {draft.description}")
        self.target = target
        self.draft = draft
        self._parts: dict[str, str] | None = None

    def content_digest(self) -> str:
        """Read again on every call (a module or state dict may change between calls),
        as ``WeightSource.content_digest``; ``parts()`` reports the last one."""
        t, d, m = self.target.content_digest(), self.draft.content_digest(), \
            self.draft.manifest().digest
        self._parts = {"target_content_digest": t, "draft_content_digest": d,
                       "draft_manifest_digest": m, "content_digest": policy_digest(t, d, m)}
        return self._parts["content_digest"]

    def parts(self) -> dict[str, str]:
        """Both digests and the draft's manifest, as the last ``content_digest()`` read
        them (read now if none did): what a version's identity stands for."""
        if self._parts is None:
            self.content_digest()
        assert self._parts is not None
        return dict(self._parts)

    def __repr__(self) -> str:
        return f"DraftedSource(target={self.target!r}, draft={self.draft!r})"


def combine_checks(target: Check, draft: Check) -> Check:
    """One check for both models: passes when both pass; its level and coverage are the
    weaker of the two (a draft checked at no level leaves the pair at no level)."""
    if not isinstance(target, Check) or not isinstance(draft, Check):
        raise BadInput("target and draft must be Checks")
    level = (None if target.level is None or draft.level is None
             else min(target.level, draft.level))
    covs = [c.coverage for c in (target, draft)]
    coverage = None if None in covs else min(c for c in covs if c is not None)
    return Check(target.name, target.passed and draft.passed,
                 f"target: {target.detail}; draft: {draft.detail}",
                 coverage=coverage, level=level)


def refusal(transport: object, source: WeightSource,
            draft_method: str | None = None) -> str | None:
    """Why ``transport`` refuses to send ``source`` at all (``None``: it does not).

    ``draft_method``: the engine's own draft (``engine_draft``), whatever the
    transport. Asked before an update drains the engine, so that a refusal
    changes nothing.
    """
    drafted = isinstance(source, DraftedSource)
    if isinstance(transport, DraftedGlooTransport) and transport.require_draft and \
            not drafted:
        return DRAFT_REFUSAL
    if draft_method is not None and not drafted:
        return engine_draft_refusal(draft_method)
    if drafted and not isinstance(transport, DraftedGlooTransport):
        return ("a target and draft pair needs a DraftedGlooTransport: this transport "
                "would send the target's tensors only; refused, nothing was changed")
    return None


class DraftedGlooTransport(GlooTransport):
    """``rolloutcore_gloo`` for an engine with a draft model: target and draft in one step.

    ``require_draft`` (default True): a source that is not a ``DraftedSource``
    is refused (``TransferError``, no mutation) before anything is sent.
    ``last_phases``: the seconds of the last drafted send's two rounds.
    """

    def __init__(self, *, op_timeout_s: float = 120.0, require_draft: bool = True) -> None:
        super().__init__(op_timeout_s=op_timeout_s)
        if not isinstance(require_draft, bool):
            raise BadInput("require_draft must be a bool")
        self.require_draft = require_draft
        self.last_phases: dict[str, float] = {}
        self._drafted: dict[str, DraftedSource] = {}  # engine URL -> the last pair sent

    def draft_wire_source(self, source: DraftedSource) -> WeightSource:
        """What the draft round puts on the wire: ``source.draft``.

        The seam where a test models a draft left on old weights (a subclass
        that returns them): ``validation_check`` must then fail.
        """
        return source.draft

    def send(self, base_url: str, target_label: str, source: WeightSource, *,
             timeout_s: float, expected_manifest_digest: str | None = None,
             nonce: str | None = None, draft: bool = False) -> TransferEvidence:
        """A ``DraftedSource``: the draft round, then the target round (which carries the
        label), each within ``timeout_s``. Anything else: refused when ``require_draft``,
        else one round as ``GlooTransport.send``."""
        if draft or not isinstance(source, DraftedSource):
            if not draft:
                self._drafted.pop(base_url.rstrip("/"), None)
            if not draft and self.require_draft:
                raise TransferError("transfer", DRAFT_REFUSAL, mutation_started=False)
            return super().send(base_url, target_label, source, timeout_s=timeout_s,
                                expected_manifest_digest=expected_manifest_digest,
                                nonce=nonce, draft=draft)
        self._drafted.pop(base_url.rstrip("/"), None)
        self.last_phases = {}
        t0 = time.monotonic()
        ev_d = super().send(base_url, target_label, self.draft_wire_source(source),
                            timeout_s=timeout_s, draft=True)
        t1 = time.monotonic()
        try:
            ev_t = super().send(base_url, target_label, source.target, timeout_s=timeout_s,
                                expected_manifest_digest=expected_manifest_digest,
                                nonce=nonce)
        except Exception as exc:
            if isinstance(exc, TransferError) and exc.mutation_started:
                raise
            # The target round failed or was refused, but the draft is already written.
            why = exc if isinstance(exc, TransferError) else f"{type(exc).__name__}: {exc}"
            raise TransferError("transfer", f"the draft was written, then the target round "
                                f"failed: {why}", mutation_started=True) from exc
        t2 = time.monotonic()
        self.last_phases = {"draft_transfer_s": t1 - t0, "target_transfer_s": t2 - t1}
        self._drafted[base_url.rstrip("/")] = source
        return TransferEvidence(completed=True, mutation_started=True, backend=self.backend,
                                tensors=ev_d.tensors + ev_t.tensors,
                                bytes=ev_d.bytes + ev_t.bytes, finish_label=ev_t.finish_label,
                                elapsed_s=t2 - t0)

    def validation_check(self, base_url: str, *,
                         reference: Mapping[str, torch.Tensor] | None = None,
                         draft: bool = False) -> Check:
        """After a drafted send: the target's rank check and the draft's, combined; the
        draft's reference is the draft source read again (not what the round sent)."""
        if draft:
            return super().validation_check(base_url, reference=reference, draft=True)
        chk = super().validation_check(base_url, reference=reference)
        pair = self._drafted.get(base_url.rstrip("/"))
        if pair is None:
            return chk
        ref: dict[str, Any] = dict(pair.draft.named_tensors())
        return combine_checks(chk, super().validation_check(base_url, reference=ref,
                                                            draft=True))

    def __repr__(self) -> str:
        return (f"DraftedGlooTransport(connected_to={self.connected_to!r}, "
                f"require_draft={self.require_draft})")
