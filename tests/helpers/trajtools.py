"""Builders for trajectory records and a deterministic toy sampler.

The toy sampler stands in for an engine's sampler only where no engine is
involved (offline audit and recorder tests): it draws tokens by inverse CDF
from a Zipf-like distribution with a ``random.Random`` stream, so the same
stream state gives the same tokens, exactly like a seeded torch generator.
``ToyEngine`` reproduces seed 002's collision mechanism: requests without a
seed draw from the engine's *global* stream, which every engine resets to the
same value.
"""

from __future__ import annotations

import bisect
import itertools
import random
import time
from collections.abc import Sequence

from rolloutcore.core.versions import (
    Binding,
    ParameterManifest,
    Provenance,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.provenance.seeds import SEED_DERIVATION, derive_seed
from rolloutcore.provenance.trajectory import (
    SEED_EXTERNAL,
    SEED_NONE,
    EngineIdentity,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    group_id_for,
)

__all__ = [
    "EPOCH",
    "IDENTITY",
    "ToyEngine",
    "make_group",
    "make_sample",
    "toy_generate",
    "version",
]

EPOCH = "epoch-a"
IDENTITY = WeightIdentity.declare(
    ParameterManifest.from_items([("model.embed_tokens.weight", (259, 128), "bfloat16")]),
    Provenance("ckpt-a", "trainer-1", 0))
ENGINE = EngineIdentity("0.32.0", "tiny-llama", {"dtype": "bfloat16", "max_model_len": 512,
                                                 "logprobs_mode": "raw_logprobs"},
                        "http://127.0.0.1:8000")

VOCAB = 256
EOS = 0
_WEIGHTS = [1.0 / (t ** 1.1) for t in range(1, VOCAB)]
_CDF = list(itertools.accumulate(_WEIGHTS))
_TOTAL = _CDF[-1]


def version(generation: int, epoch: str = EPOCH) -> WeightVersion:
    return WeightVersion(generation, f"rc-{generation}", epoch)


def toy_generate(rng: random.Random, prompt: Sequence[int], max_tokens: int = 48,
                 *, short: bool = False) -> tuple[list[int], list[float], str]:
    """Tokens, sampled-token logprobs and finish reason; a pure function of ``rng``'s state.

    ``short`` prompts model a confident short answer (<= 4 tokens, one answer
    90% of the time), so identical short siblings occur as in the baseline.
    """
    shift = sum(prompt) % (VOCAB - 1)
    if short:
        if rng.random() < 0.9:
            toks = [1 + shift % 200, 7, 1 + (shift * 3) % 200]
            return toks, [-0.1] * len(toks), "stop"
        toks = [1 + int(rng.random() * 254) for _ in range(4)]
        return toks, [-3.0] * len(toks), "stop"
    toks: list[int] = []
    lps: list[float] = []
    while len(toks) < max_tokens:
        if len(toks) >= 24 and rng.random() < 0.05:
            return toks, lps, "stop"
        i = bisect.bisect_left(_CDF, rng.random() * _TOTAL)
        i = min(i, VOCAB - 2)
        toks.append(1 + (i + shift) % (VOCAB - 1))
        lps.append(-0.5 - i / 64)
    return toks, lps, "length"


class ToyEngine:
    """An engine whose unseeded requests share its global stream (seed 002's mechanism)."""

    def __init__(self, global_seed: int = 0) -> None:
        self._global = random.Random(global_seed)

    def generate(self, prompt: Sequence[int], seed: int | None, *, short: bool = False
                 ) -> tuple[list[int], list[float], str]:
        rng = self._global if seed is None else random.Random(seed)
        return toy_generate(rng, prompt, short=short)


def make_sample(*, run: str = "run-a", step: int = 3, prompt_index: int = 0,
                group_size: int = 1, sample_index: int = 0,
                prompt: Sequence[int] = (5, 6, 7), tokens: Sequence[int] = (9, 10, 11),
                logprobs: Sequence[float] | None = None, seed: int | None = None,
                derivation: str | None = None, temperature: float = 1.0,
                spans: Sequence[tuple[str, int, int]] | str | None = "bound",
                bound: WeightVersion | None = None, rollout_id: str | None = None,
                finish_reason: str = "stop", t0: float | None = None) -> TrajectorySample:
    """One valid sample; ``spans="bound"`` labels every token with the bound version."""
    bound = bound or version(1)
    if derivation is None:
        derivation = SEED_NONE if seed is None else SEED_EXTERNAL
    if spans == "bound":
        span_objs: tuple[VersionSpan, ...] | None = (VersionSpan(bound.label, 0, len(tokens)),)
    elif spans is None or isinstance(spans, str):
        span_objs = None
    else:
        span_objs = tuple(VersionSpan(v, a, b) for v, a, b in spans)
    wall = time.time() if t0 is None else t0
    mono = time.monotonic() if t0 is None else t0
    gid = group_id_for(run, step, prompt_index)
    return TrajectorySample(
        run=run, step=step, group_id=gid, prompt_index=prompt_index, group_size=group_size,
        sample_index=sample_index, prompt=Prompt(tuple(prompt)),
        sampling=SamplingSpec(temperature, 1.0, -1, 48, seed, derivation, {"logprobs": 0}),
        completion=SampledCompletion(tuple(tokens), finish_reason,
                                     None if logprobs is None else tuple(logprobs), None,
                                     span_objs),
        binding=Binding(bound, IDENTITY, rollout_id),
        engine=ENGINE,
        timestamps=Timestamps(wall, mono, wall + 0.25, mono + 0.25))


def make_group(*, run: str = "run-a", step: int = 3, prompt_index: int = 0, n: int = 4,
               seed_mode: str = "derived", engines: Sequence[ToyEngine] | None = None,
               short: bool = False, temperature: float = 1.0,
               bound: WeightVersion | None = None, t0: float | None = None
               ) -> TrajectoryGroup:
    """A group generated with the toy sampler.

    ``seed_mode``: ``derived`` (``derive_seed`` per sample), ``none`` (unseeded,
    engine global streams), ``same`` (every sibling gets the same seed, like
    verl's ``full_determinism``), ``wrong`` (claims ``derive_seed`` but is not).
    Sibling ``i`` goes to ``engines[i % len(engines)]``, as a DP router spreads
    a group.
    """
    engines = engines or [ToyEngine(0)]
    gid = group_id_for(run, step, prompt_index)
    prompt = [1 + (prompt_index * 7 + j) % 250 for j in range(12)]
    samples = []
    for i in range(n):
        if seed_mode == "derived":
            seed, deriv = derive_seed(run, step, gid, i), SEED_DERIVATION
        elif seed_mode == "none":
            seed, deriv = None, SEED_NONE
        elif seed_mode == "same":
            seed, deriv = 1234, SEED_EXTERNAL
        elif seed_mode == "wrong":
            seed, deriv = derive_seed(run, step, gid, i) + 1, SEED_DERIVATION
        else:
            raise ValueError(seed_mode)
        toks, lps, fin = engines[i % len(engines)].generate(prompt, seed, short=short)
        samples.append(make_sample(run=run, step=step, prompt_index=prompt_index,
                                   group_size=n, sample_index=i, prompt=prompt, tokens=toks,
                                   logprobs=lps, seed=seed, derivation=deriv,
                                   temperature=temperature, bound=bound,
                                   finish_reason=fin, t0=t0))
    return TrajectoryGroup(tuple(samples))
