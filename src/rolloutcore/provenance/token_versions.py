"""Per-token versions of one sample: which weights sampled each token, over which KV.

Trajectory schema version 3 (issue 20) adds ``completion.versions`` to a
sample that an asynchronous update may have carried across versions. It
answers, per output token, three questions the binding alone cannot once a
rollout spans an update:

* **which weights sampled it**: ``spans``, contiguous over the output, each
  naming a published generation and its label. With vLLM 0.32 they come
  from the engine's own ``weight_versions`` spans (``source: engine``); on
  an engine without them (vLLM 0.26) they are derived from the stream and
  the update's resume instant (``source: stream``);
* **which weights computed the KV it attended to**: each span's ``kv``. In
  ``keep`` mode a kept request's later tokens attend to KV its earlier
  tokens (and its prompt) left under the old version: ``kv`` names both.
  In ``recompute`` mode each resubmission recomputed the KV under its own
  version: ``kv`` is that version alone;
* **which engine requests produced it**: ``segments``, one per request sent
  to the engine (one in ``keep`` and ``strict``; one more per update in
  ``recompute``), each with the version it was submitted under, the
  ``cache_salt`` it carried (so the audit can check that no prefix-cache
  entry of another version could be reused) and how many tokens it
  prefilled (for ``recompute``: prompt + the output so far).

The sample's ``completion.logprobs`` are the behaviour logprobs of every
token, as each segment's engine sampled it. Checks that need the whole
sample (spans and segments cover the output) run in ``SampledCompletion``;
the audit's cross-checks are ``provenance.stitch.check_versions``.

Standard library only.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutcore.core.records import UpdateMode, fields_dict, fields_from_dict
from rolloutcore.core.strict import check_int, check_obj, check_str, exact_keys, fail
from rolloutcore.errors import BadInput

__all__ = ["SOURCES", "Segment", "TokenSpan", "TokenVersions", "check_cover"]

#: Where the spans came from: the engine's own labels, or the stream and the
#: resume instant (an engine without per-token labels).
SOURCES = frozenset({"engine", "stream"})
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _label(where: str, x: object) -> str:
    check_str(where, x)
    assert isinstance(x, str)
    if not _LABEL_RE.fullmatch(x):
        raise fail(where, f"must be a version label, got {x!r}")
    return x


@dataclass(frozen=True)
class TokenSpan:
    """Output tokens ``[start, end)`` sampled by generation ``generation`` (``label``)."""

    generation: int
    label: str
    start: int
    end: int
    #: Labels of the weights that computed the KV these tokens attended to.
    kv: tuple[str, ...]

    def __post_init__(self) -> None:
        check_int("versions.spans.generation", self.generation)
        _label("versions.spans.label", self.label)
        check_int("versions.spans.start", self.start)
        check_int("versions.spans.end", self.end)
        if self.end < self.start:
            raise BadInput(f"versions.spans: {self.label} ends ({self.end}) before it "
                           f"starts ({self.start})")
        if isinstance(self.kv, (str, bytes)) or not isinstance(self.kv, Iterable):
            raise BadInput("versions.spans.kv must be a list of labels")
        kv = tuple(_label("versions.spans.kv[]", k) for k in self.kv)
        if self.label not in kv:
            raise BadInput(f"versions.spans.kv must include the span's own label "
                           f"{self.label!r}, got {list(kv)}")
        object.__setattr__(self, "kv", kv)

    def __len__(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> TokenSpan:
        m = check_obj("versions.spans[]", d)
        exact_keys("versions.spans[]", m, ("generation", "label", "start", "end", "kv"))
        kv = m["kv"]
        if not isinstance(kv, (list, tuple)):
            raise BadInput("versions.spans.kv must be a list")
        return cls(m["generation"], m["label"], m["start"], m["end"], tuple(kv))


@dataclass(frozen=True)
class Segment:
    """One engine request of the sample: it produced output tokens ``[start, end)``."""

    start: int
    end: int
    #: The version it was submitted under (its cache salt's).
    label: str
    cache_salt: str | None
    #: Tokens it prefilled: the prompt, plus the output so far for a resubmission.
    prefill_tokens: int

    def __post_init__(self) -> None:
        check_int("versions.segments.start", self.start)
        check_int("versions.segments.end", self.end)
        if self.end < self.start:
            raise BadInput("versions.segments: a segment ends before it starts")
        _label("versions.segments.label", self.label)
        if self.cache_salt is not None:
            check_str("versions.segments.cache_salt", self.cache_salt)
        check_int("versions.segments.prefill_tokens", self.prefill_tokens)

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> Segment:
        return fields_from_dict(cls, "versions.segments[]", d)


class _Span(Protocol):
    @property
    def start(self) -> int: ...
    @property
    def end(self) -> int: ...


def check_cover(where: str, parts: Sequence[_Span], n: int) -> None:
    """Contiguous parts covering exactly ``[0, n)`` (an empty output may have none)."""
    if not parts:
        if n:
            raise BadInput(f"{where} is empty but there are {n} output tokens")
        return
    if parts[0].start != 0:
        raise BadInput(f"{where} must start at token 0, starts at {parts[0].start}")
    for a, b in itertools.pairwise(parts):
        if a.end != b.start:
            raise BadInput(f"{where} not contiguous: one ends at {a.end}, the next starts "
                           f"at {b.start}")
    if parts[-1].end != n:
        raise BadInput(f"{where} end at {parts[-1].end}, but there are {n} output tokens")


@dataclass(frozen=True)
class TokenVersions:
    """``completion.versions``: per-token versions, the update mode, the engine requests."""

    mode: UpdateMode
    source: str
    spans: tuple[TokenSpan, ...]
    segments: tuple[Segment, ...]
    #: The controller's bound when the rollout ran (None: unbounded).
    max_staleness: int | None
    #: The committed generation when the rollout completed.
    completed_generation: int

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "mode", UpdateMode(self.mode))
        except ValueError as exc:
            raise BadInput(f"versions.mode must be one of "
                           f"{[m.value for m in UpdateMode]}, got {self.mode!r}") from exc
        if self.source not in SOURCES:
            raise BadInput(f"versions.source must be one of {sorted(SOURCES)}, "
                           f"got {self.source!r}")
        for name, typ in (("spans", TokenSpan), ("segments", Segment)):
            xs = getattr(self, name)
            if isinstance(xs, (str, bytes)) or not isinstance(xs, Iterable):
                raise BadInput(f"versions.{name} must be a list")
            xs = tuple(xs)
            if not all(isinstance(x, typ) for x in xs):
                raise BadInput(f"versions.{name} must hold {typ.__name__} only")
            object.__setattr__(self, name, xs)
        if not self.segments:
            raise BadInput("versions.segments: at least one engine request produced it")
        if self.max_staleness is not None:
            check_int("versions.max_staleness", self.max_staleness)
        check_int("versions.completed_generation", self.completed_generation)
        gens = [s.generation for s in self.spans]
        if gens != sorted(gens):
            raise BadInput("versions.spans: generations must not go back")
        if gens and gens[-1] > self.completed_generation:
            raise BadInput("versions.spans: a token is newer than the version committed "
                           "when the rollout completed")

    def check_length(self, n: int) -> None:
        check_cover("versions.spans", self.spans, n)
        check_cover("versions.segments", self.segments, n)

    @property
    def generations(self) -> tuple[int, ...]:
        """Distinct generations that sampled at least one token, oldest first."""
        return tuple(dict.fromkeys(s.generation for s in self.spans if len(s)))

    @property
    def recomputed_tokens(self) -> int:
        """Tokens prefilled again by resubmissions (every segment after the first)."""
        return sum(s.prefill_tokens for s in self.segments[1:])

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> TokenVersions:
        m = check_obj("versions", d)
        exact_keys("versions", m, ("mode", "source", "spans", "segments", "max_staleness",
                                   "completed_generation"))
        for k in ("spans", "segments"):
            if not isinstance(m[k], (list, tuple)):
                raise BadInput(f"versions.{k} must be a list")
        return cls(m["mode"], m["source"], tuple(TokenSpan.from_dict(x) for x in m["spans"]),
                   tuple(Segment.from_dict(x) for x in m["segments"]), m["max_staleness"],
                   m["completed_generation"])
