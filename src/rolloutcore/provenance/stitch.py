"""Stitching a rollout's engine requests into one sample, and checking a stitched sample.

A rollout an asynchronous update carried is one sample made of one or more
engine requests (``token_versions.Segment``): one in ``keep`` mode (the
request was frozen and continued), one more per update in ``recompute``
mode (aborted at the pause, resubmitted as prompt + output so far under
the new version). ``stitch`` puts the requests' tokens, behaviour logprobs
and versions together; ``check_versions`` is what the audit asks of the
result, from the record alone (and the journal's commits, when given):

* the per-token versions agree with the engine's own spans where it gave
  them, and each segment prefilled exactly the prompt plus the output
  before it (a stitch that lost or repeated tokens cannot pass);
* no token was produced with a prefix-cache entry of another version: each
  segment carries the version salt of the version it was submitted under
  (``core.cache_salt``), and outside ``keep`` no span attended to KV of
  another version;
* no token is older than the bound: at completion, the oldest token's
  version is at most ``max_staleness`` published versions behind ("mixed
  within the bound" is fine; beyond it is a finding).

Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from rolloutcore.core.cache_salt import salt_label
from rolloutcore.core.records import UpdateMode
from rolloutcore.errors import BadInput
from rolloutcore.provenance.token_versions import Segment, TokenSpan, TokenVersions

__all__ = ["SegmentRun", "Stitched", "VersionIssue", "check_versions", "stitch"]


class VersionIssue(enum.StrEnum):
    BEYOND_BOUND = "beyond-staleness-bound"   # a token older than max_staleness versions
    BAD_STITCH = "bad-stitch"                 # segments do not add up to the sample
    ENGINE_DISAGREES = "engine-spans-disagree"  # recorded versions != the engine's spans
    SALT_MISMATCH = "salt-mismatch"           # a segment's salt names another version
    UNSALTED = "unsalted-async"               # asynchronous, without a version salt
    KV_CROSS_VERSION = "kv-cross-version"     # outside keep: KV of another version used
    FIRST_SEGMENT = "first-segment-not-bound"  # the first request is not the binding's


@dataclass(frozen=True)
class SegmentRun:
    """One engine request as the client saw it, before stitching.

    ``token_versions`` are (generation, label) per output token as derived
    from the stream; ``engine_spans`` the engine's own ``(label, start,
    end)`` spans over this request's output (``None``: it gave none).
    """

    label: str
    cache_salt: str | None
    prefill_tokens: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    token_versions: tuple[tuple[int, str], ...]
    engine_spans: tuple[tuple[str, int, int], ...] | None
    finish_reason: str | None

    def __post_init__(self) -> None:
        if len(self.token_versions) != len(self.token_ids):
            raise BadInput("a segment needs one derived version per token")
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise BadInput("a segment needs one logprob per token")


@dataclass(frozen=True)
class Stitched:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    #: The engine's spans over the whole output, offset per segment (None: any lacked).
    engine_spans: tuple[tuple[str, int, int], ...] | None
    versions: TokenVersions
    #: The versions derived from the stream (== ``versions.spans`` when the
    #: source is the stream; compared with the engine's otherwise).
    derived: tuple[TokenSpan, ...]
    finish_reason: str | None


def _runs(per_token: Sequence[tuple[int, str]], start: int, kv_of: dict[str, list[str]],
          mode: UpdateMode, seg_label: str) -> list[TokenSpan]:
    out: list[TokenSpan] = []
    i = 0
    while i < len(per_token):
        j = i
        while j < len(per_token) and per_token[j] == per_token[i]:
            j += 1
        gen, label = per_token[i]
        if mode is UpdateMode.KEEP:
            seen = kv_of.setdefault(seg_label, [seg_label])
            if label not in seen:
                seen.append(label)
            kv = tuple(seen)
        else:
            kv = (label,)
        out.append(TokenSpan(gen, label, start + i, start + j, kv))
        i = j
    return out


def _merge(spans: Iterable[TokenSpan]) -> tuple[TokenSpan, ...]:
    out: list[TokenSpan] = []
    for s in spans:
        if out and (out[-1].generation, out[-1].label, out[-1].kv) == (
                s.generation, s.label, s.kv) and out[-1].end == s.start:
            prev = out.pop()
            s = TokenSpan(s.generation, s.label, prev.start, s.end, s.kv)
        out.append(s)
    return tuple(out)


def stitch(mode: UpdateMode, runs: Sequence[SegmentRun], generation_of: Mapping[str, int], *,
           max_staleness: int | None, completed_generation: int) -> Stitched:
    """The sample of ``runs`` (in order): tokens, behaviour logprobs, per-token versions.

    With the engine's spans on every segment they are the record's versions
    (``source: engine``; ``generation_of`` maps their labels to published
    generations); otherwise the stream's derivation is (``source: stream``).
    """
    if not runs:
        raise BadInput("stitch needs at least one segment")
    mode = UpdateMode(mode)
    engine = all(r.engine_spans is not None for r in runs)
    toks: list[int] = []
    lps: list[float] | None = [] if all(r.logprobs is not None for r in runs) else None
    eng: list[tuple[str, int, int]] = []
    derived: list[TokenSpan] = []
    recorded: list[TokenSpan] = []
    segments: list[Segment] = []
    kv_derived: dict[str, list[str]] = {}
    kv_engine: dict[str, list[str]] = {}
    for r in runs:
        start = len(toks)
        toks += r.token_ids
        if lps is not None:
            assert r.logprobs is not None
            lps += r.logprobs
        derived += _runs(r.token_versions, start, kv_derived, mode, r.label)
        if engine:
            assert r.engine_spans is not None
            per_token: list[tuple[int, str]] = []
            for label, a, b in r.engine_spans:
                if label not in generation_of:
                    raise BadInput(f"the engine labelled tokens {label!r}, which was never "
                                   "published")
                eng.append((label, start + a, start + b))
                per_token += [(generation_of[label], label)] * (b - a)
            if len(per_token) != len(r.token_ids):
                raise BadInput("the engine's spans do not cover its output")
            recorded += _runs(per_token, start, kv_engine, mode, r.label)
        segments.append(Segment(start, len(toks), r.label, r.cache_salt, r.prefill_tokens))
    spans = _merge(recorded if engine else derived)
    versions = TokenVersions(mode, "engine" if engine else "stream", spans, tuple(segments),
                             max_staleness, completed_generation)
    return Stitched(tuple(toks), None if lps is None else tuple(lps),
                    tuple(eng) if engine else None, versions, _merge(derived),
                    runs[-1].finish_reason)


def check_versions(v: TokenVersions, *, prompt_tokens: int, bound_label: str,
                   engine_spans: Sequence[tuple[str, int, int]] | None,
                   max_staleness: int | None = None,
                   published: Iterable[int] | None = None) -> list[tuple[VersionIssue, str]]:
    """What the audit finds wrong with one sample's per-token versions (empty: nothing).

    ``engine_spans``: the engine's spans over the output (the sample's
    ``completion.weight_versions``), if any; ``max_staleness`` overrides the
    recorded bound; ``published``: every published generation (from the
    journal), to count staleness in published versions rather than in
    generations (which may skip a burnt label).
    """
    out: list[tuple[VersionIssue, str]] = []
    segs = v.segments
    if segs[0].label != bound_label:
        out.append((VersionIssue.FIRST_SEGMENT, f"first request under {segs[0].label}, "
                    f"bound to {bound_label}"))
    for i, seg in enumerate(segs):
        want = prompt_tokens + seg.start
        if seg.prefill_tokens != want:
            out.append((VersionIssue.BAD_STITCH, f"segment {i} prefilled "
                        f"{seg.prefill_tokens} tokens, prompt + output before it is {want}"))
        if seg.cache_salt is None:
            if v.mode is not UpdateMode.STRICT:
                out.append((VersionIssue.UNSALTED, f"segment {i} ({seg.label}) carried no "
                            "version salt: cross-version prefix reuse not excluded"))
        elif salt_label(seg.cache_salt) != seg.label[:80]:
            out.append((VersionIssue.SALT_MISMATCH, f"segment {i} submitted under "
                        f"{seg.label} carried salt {seg.cache_salt!r}"))
    if v.mode is not UpdateMode.KEEP:
        for s in v.spans:
            if s.kv != (s.label,):
                out.append((VersionIssue.KV_CROSS_VERSION, f"{v.mode.value}: tokens "
                            f"[{s.start}, {s.end}) of {s.label} attended to KV of "
                            f"{', '.join(s.kv)}"))
    if v.mode is UpdateMode.RECOMPUTE:
        for i, seg in enumerate(segs):
            gens = {sp.generation for sp in v.spans if sp.start < seg.end and sp.end > seg.start}
            if len(gens) > 1:
                out.append((VersionIssue.BAD_STITCH, f"recompute segment {i} spans "
                            f"generations {sorted(gens)}: a segment is one version"))
    if engine_spans is not None:
        per_token = [lab for lab, a, b in engine_spans for _ in range(a, b)]
        mine = [s.label for s in v.spans for _ in range(s.start, s.end)]
        if per_token != mine:
            diff = next((i for i, (a, b) in enumerate(zip(per_token, mine, strict=False))
                         if a != b), min(len(per_token), len(mine)))
            out.append((VersionIssue.ENGINE_DISAGREES, f"from token {diff}: engine "
                        f"{per_token[diff:diff + 1]}, recorded {mine[diff:diff + 1]}"))
    k = v.max_staleness if max_staleness is None else max_staleness
    if k is not None and any(len(s) for s in v.spans):
        oldest = min(s.generation for s in v.spans if len(s))
        if published is None:
            age = v.completed_generation - oldest
            how = "generations"
        else:
            age = sum(1 for g in set(published) if oldest < g <= v.completed_generation)
            how = "published versions"
        if age > k:
            out.append((VersionIssue.BEYOND_BOUND, f"oldest token of generation {oldest} is "
                        f"{age} {how} behind the version at completion "
                        f"({v.completed_generation}); max_staleness {k}"))
    return out
