"""What vLLM's answers are parsed into: typed, once, at the edge.

``VllmHTTP`` returns these; nothing past it reads vLLM's JSON.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.media import ImageRef
from rolloutcore.core.strict import check_int, check_obj, check_str, exact_keys
from rolloutcore.errors import BadInput

__all__ = [
    "logprob_token_id",
    "PREFIX_HITS",
    "PREFIX_QUERIES",
    "Completion",
    "Generation",
    "GenerationChunk",
    "MetricsSnapshot",
    "PrefixCacheDelta",
    "VersionSpan",
    "WeightInfo",
    "WeightOps",
    "prefix_cache_delta",
]

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"


@dataclass(frozen=True)
class WeightInfo:
    """The engine's weight-version label; ``None`` where it has none (vLLM 0.26)."""

    label: str | None
    label_supported: bool


#: vLLM's weight-transfer operations that write weights (``init`` and
#: ``shutdown`` set up or tear down a transfer group and write none).
WRITE_OPERATIONS = ("start", "start_draft", "update", "finish")


@dataclass(frozen=True)
class WeightOps:
    """vLLM's own count of its weight-transfer operations (``/metrics``), per operation.

    ``vllm:rl_weight_update_operation_duration_seconds_count`` counts each
    finished ``/start_weight_update``, ``/update_weights`` and
    ``/finish_weight_update`` of the process; ``..._operations_in_flight``
    those still running. Whoever calls them, the engine counts them: two
    snapshots that agree, with nothing in flight, prove no weight update ran
    between them. ``awake`` is the sleep-state gauge (``None``: not shown).
    """

    done: Mapping[str, float]
    in_flight: Mapping[str, float]
    awake: bool | None = None

    def writes_since(self, before: WeightOps) -> tuple[str, ...]:
        """What wrote weights between ``before`` and this snapshot, in words."""
        out = []
        for op in WRITE_OPERATIONS:
            n = self.done.get(op, 0.0) - before.done.get(op, 0.0)
            if n:
                out.append(f"{n:g} /{_ROUTE_OF.get(op, op)} call(s)")
            if self.in_flight.get(op, 0.0) > 0:
                out.append(f"a /{_ROUTE_OF.get(op, op)} call in flight")
        return tuple(out)


_ROUTE_OF = {"start": "start_weight_update", "start_draft": "start_draft_weight_update",
             "update": "update_weights", "finish": "finish_weight_update"}


@dataclass(frozen=True)
class VersionSpan:
    """vLLM's ``WeightVersionSpan``: output tokens ``[start, end)`` sampled under ``version``.

    The one span type: what the engine's answers are parsed into, and the
    ``weight_versions`` of a trajectory record (``provenance.trajectory``).
    """

    version: str
    start: int
    end: int

    def __post_init__(self) -> None:
        check_str("weight_versions.version", self.version)
        check_int("weight_versions.start", self.start)
        check_int("weight_versions.end", self.end)
        if self.end < self.start:
            raise BadInput(f"weight_versions: span {self.version!r} ends ({self.end}) "
                           f"before it starts ({self.start})")

    def __len__(self) -> int:
        return self.end - self.start

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "start": self.start, "end": self.end}

    @classmethod
    def parse(cls, raw: Iterable[Mapping[str, Any]] | None) -> tuple[VersionSpan, ...] | None:
        """A choice's ``weight_versions`` as vLLM writes it (a list, or null where the
        engine reports no spans); a malformed one raises ``KeyError``/``TypeError``/
        ``ValueError``/``BadInput``, which the caller names."""
        if raw is None:
            return None
        return tuple(cls(str(s["version"]), int(s["start"]), int(s["end"])) for s in raw)

    @classmethod
    def from_dict(cls, d: object, note: str = "") -> VersionSpan:
        m = check_obj("weight_versions[]", d)
        exact_keys("weight_versions[]", m, ("version", "start", "end"), note=note)
        return cls(m["version"], m["start"], m["end"])


@dataclass(frozen=True)
class Generation:
    """One choice of ``/inference/v1/generate``.

    ``logprobs`` are the sampled tokens' logprobs (``None`` if not asked);
    ``weight_versions`` is ``None`` when the engine does not report spans;
    ``media`` describes the images sent with the prompt (for its trajectory).
    """

    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    weight_versions: tuple[VersionSpan, ...] | None
    media: tuple[ImageRef, ...] = ()

    def versions(self) -> frozenset[str]:
        """The labels that sampled at least one output token."""
        return frozenset(s.version for s in self.weight_versions or () if s.end > s.start)


@dataclass(frozen=True)
class GenerationChunk:
    """One event of a streamed ``/inference/v1/generate`` (choice 0), as it was read.

    ``read_at`` is ``time.monotonic()`` when the event was parsed: a stream
    read in order gives the order in which its tokens reached the client,
    which is what an engine without per-token labels lets one derive
    versions from. ``weight_versions`` come only with the last event, and
    only from an engine that reports them (vLLM 0.32). vLLM 0.26 sends no
    event for an abort: its stream just ends (``finish_reason`` stays
    ``None`` on every event). ``cached_tokens`` is the prompt's prefix-cache
    hits, in the final usage event (``--enable-prompt-tokens-details``).
    """

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...] | None
    finish_reason: str | None
    weight_versions: tuple[VersionSpan, ...] | None
    read_at: float
    cached_tokens: int | None = None


@dataclass(frozen=True)
class Completion:
    """One choice of ``/v1/completions``."""

    text: str
    token_ids: tuple[int, ...] | None
    logprobs: tuple[float | None, ...] | None
    finish_reason: str | None


@dataclass(frozen=True)
class MetricsSnapshot:
    """Prometheus samples of one ``/metrics`` scrape, summed over label sets.

    Histogram buckets and summary quantiles are left out (their sum over
    labels means nothing); counters and gauges are kept by sample name, so
    ``values["vllm:prefix_cache_hits_total"]`` is the engine-wide total.
    """

    values: Mapping[str, float]
    taken_at: float

    def get(self, name: str) -> float | None:
        return self.values.get(name)


@dataclass(frozen=True)
class PrefixCacheDelta:
    """Prefix-cache tokens queried and hit between two scrapes (after minus before)."""

    queries: float
    hits: float


def prefix_cache_delta(before: MetricsSnapshot, after: MetricsSnapshot) -> PrefixCacheDelta:
    """Prefix-cache queries and hits between two scrapes of one engine incarnation."""
    out = []
    for name in (PREFIX_QUERIES, PREFIX_HITS):
        a, b = after.get(name), before.get(name)
        if a is None or b is None:
            raise BadInput(f"metric {name} missing from a snapshot "
                           "(is prefix caching enabled?)")
        if a < b:
            raise BadInput(f"{name} went down ({b} -> {a}): the snapshots come from "
                           "different engine incarnations")
        out.append(a - b)
    return PrefixCacheDelta(queries=out[0], hits=out[1])


_TOKEN_ID = re.compile(r"token_id:(\d+)")


def logprob_token_id(entry: Mapping[str, Any]) -> int:
    """The token id of one ``logprobs.content`` (or ``top_logprobs``) entry: its
    ``token_id`` (vLLM 0.32), else its ``token`` written ``"token_id:N"`` (vLLM 0.26
    with ``--skip-tokenizer-init``, whose entries have no ``token_id``). ``BadInput``
    (a ``ValueError``) or ``KeyError`` for anything else."""
    tid = entry.get("token_id")
    if tid is not None:
        if isinstance(tid, bool) or not isinstance(tid, int):
            raise BadInput(f"token_id {tid!r} is not an int")
        return tid
    m = _TOKEN_ID.fullmatch(str(entry["token"]))
    if m is None:
        raise BadInput(f"logprob entry has no token_id and its token {entry['token']!r} is "
                       f"not 'token_id:N'")
    return int(m.group(1))
