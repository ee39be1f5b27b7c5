"""Speculative decoding's acceptance rate, read from vLLM's own counters.

An engine that decodes speculatively counts, in ``/metrics``, the tokens its
draft proposed (``vllm:spec_decode_num_draft_tokens_total``) and those the
target accepted (``vllm:spec_decode_num_accepted_tokens_total``). Their
difference across a window of greedy generation is the acceptance rate of
that window: what a draft left on old weights destroys (vime #351,
vllm-ascend #13209: about 0 % after a target-only update), while every
output token stays the target's, so nothing else in the output shows it.

``AcceptanceProbe`` generates greedily on fixed prompts between two scrapes
and reports the rate as a ``Check``; with ``min_acceptance`` set it fails
below it (a draft made to follow its target, e.g. a copy or a truncation of
it, should be accepted most of the time). Counters are engine-wide: requests
that other clients run inside the window count too, so the probe runs while
RolloutCore's admission is closed (the live validation).

It needs only ``metrics()`` and ``generate()`` of its client (``VllmHTTP``
has both): this layer does no I/O of its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import Check, UpdateTarget
from rolloutcore.core.records import fields_dict
from rolloutcore.core.strict import check_int
from rolloutcore.errors import BadInput

if TYPE_CHECKING:
    from rolloutcore.engine.http import VllmHTTP

__all__ = ["ACCEPTED", "DRAFTED", "AcceptanceProbe", "AcceptanceSample", "acceptance_between",
           "default_acceptance_prompts"]

DRAFTED = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"


@dataclass(frozen=True)
class AcceptanceSample:
    """Draft tokens proposed and accepted between two scrapes of one engine."""

    drafted: float
    accepted: float

    def __post_init__(self) -> None:
        for name in ("drafted", "accepted"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                    or v < 0:
                raise BadInput(f"{name} must be a finite number >= 0, got {v!r}")
        if self.accepted > self.drafted:
            raise BadInput(f"accepted ({self.accepted}) exceeds drafted ({self.drafted})")

    @property
    def rate(self) -> float | None:
        """accepted / drafted; ``None`` when nothing was drafted (no evidence either way)."""
        return None if self.drafted == 0 else self.accepted / self.drafted

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self, rate=self.rate)


def acceptance_between(before: Mapping[str, float], after: Mapping[str, float]
                       ) -> AcceptanceSample:
    """The window's sample from two ``/metrics`` scrapes (values by sample name).

    ``BadInput`` when the engine does not count speculative tokens (no draft)
    or a counter went down (the scrapes come from different engine processes).
    A counter absent before but present after started at zero: vLLM creates
    the spec-decode counters with the engine, so that happens only at start.
    """
    if not isinstance(before, Mapping) or not isinstance(after, Mapping):
        raise BadInput("before and after must be mappings of metric name to value")
    out: list[float] = []
    for name in (DRAFTED, ACCEPTED):
        a = after.get(name)
        if a is None:
            raise BadInput(f"metric {name} missing: the engine decodes no speculative tokens "
                           "(started without --speculative-config?)")
        b = before.get(name, 0.0)
        if a < b:
            raise BadInput(f"{name} went down ({b} -> {a}): the scrapes come from "
                           "different engine processes")
        out.append(float(a) - float(b))
    return AcceptanceSample(drafted=out[0], accepted=out[1])


def default_acceptance_prompts(vocab_size: int, n: int = 4, length: int = 12
                               ) -> list[list[int]]:
    """Fixed token prompts below ``vocab_size`` (deterministic, no RNG state touched)."""
    check_int("vocab_size", vocab_size, 2)
    check_int("n", n, 1, 64)
    check_int("length", length, 1, 512)
    top = min(vocab_size, 256)  # byte-level ids of the tiny tokenizer; any model has them
    return [[(7 + 31 * i + 13 * j * (i + 1)) % top for j in range(length)] for i in range(n)]


class AcceptanceProbe:
    """Greedy generation between two scrapes: the draft's acceptance rate as a ``Check``.

    ``min_acceptance`` ``None`` records the rate and passes (a draft that is
    not meant to track its target has no expected rate); a number in (0, 1]
    fails a window below it, or one in which nothing was drafted.
    """

    name = "draft-acceptance"

    def __init__(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 32,
                 min_acceptance: float | None = None, timeout_s: float = 120.0) -> None:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or \
                not prompts:
            raise BadInput("prompts must be a non-empty sequence of token-id sequences")
        ps: list[tuple[int, ...]] = []
        for i, p in enumerate(prompts):
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence) or not p or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
                raise BadInput(f"prompts[{i}] must be a non-empty sequence of ints >= 0")
            ps.append(tuple(p))
        check_int("max_tokens", max_tokens, 1, 4096)
        if min_acceptance is not None and (
                isinstance(min_acceptance, bool) or not isinstance(min_acceptance, (int, float))
                or not 0 < min_acceptance <= 1):
            raise BadInput(f"min_acceptance must be in (0, 1] or None, got {min_acceptance!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not timeout_s > 0:
            raise BadInput(f"timeout_s must be > 0, got {timeout_s!r}")
        self.prompts = tuple(ps)
        self.max_tokens = max_tokens
        self.min_acceptance = None if min_acceptance is None else float(min_acceptance)
        self.timeout_s = float(timeout_s)
        #: The last window's sample (``run`` or ``measure``).
        self.last: AcceptanceSample | None = None

    def measure(self, http: VllmHTTP) -> AcceptanceSample:
        """Scrape, generate greedily on every prompt, scrape: the window's sample."""
        before = http.metrics(timeout_s=self.timeout_s).values
        for p in self.prompts:
            http.generate(list(p), max_tokens=self.max_tokens, temperature=0.0,
                          logprobs=False, ignore_eos=True, timeout_s=self.timeout_s)
        after = http.metrics(timeout_s=self.timeout_s).values
        self.last = acceptance_between(before, after)
        return self.last

    def judge(self, sample: AcceptanceSample) -> Check:
        rate = sample.rate
        desc = (f"{sample.accepted:g} of {sample.drafted:g} draft tokens accepted"
                + ("" if rate is None else f" (rate {rate:.3f})"))
        if self.min_acceptance is None:
            return Check(self.name, True, f"{desc}; recorded (no min_acceptance)")
        if rate is None:
            return Check(self.name, False, f"{desc}: nothing drafted, no evidence of the "
                         "draft's weights", tolerance=self.min_acceptance)
        ok = rate >= self.min_acceptance
        return Check(self.name, ok, f"{desc}; min_acceptance {self.min_acceptance:g}"
                     + ("" if ok else ": the draft does not propose what the target "
                        "decodes (left on other weights?)"),
                     tolerance=self.min_acceptance)

    def run(self, http: VllmHTTP, target: UpdateTarget | None = None) -> Check:
        """``ProbeSet.run``: measure a window and judge it."""
        return self.judge(self.measure(http))

    def __repr__(self) -> str:
        return (f"AcceptanceProbe({len(self.prompts)} prompts, max_tokens={self.max_tokens}, "
                f"min_acceptance={self.min_acceptance})")
