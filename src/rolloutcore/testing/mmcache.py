"""Measuring vLLM's encoder and multimodal caches across a policy transition.

vLLM keeps two caches keyed by an image's content hash, not by the weights:

* the **encoder cache** (engine core and worker): the vision tower's output
  embedding of an image. It is weight-dependent: after an update that
  changes the vision tower, a hit serves the *old* policy's embedding;
* the **multimodal processor cache** (API server and engine core): the
  preprocessed inputs (pixel values). It is weight-independent, so a hit
  there cannot change an answer, but it is reuse across the boundary all
  the same, and RolloutCore resets it too.

Neither has a hit counter for the encoder cache in vLLM 0.32's ``/metrics``;
the processor cache has ``vllm:mm_cache_queries_total`` and
``vllm:mm_cache_hits_total``. Encoder runs are read from the engine's own
log instead: with ``--enable-logging-iteration-details`` every scheduler
step logs a line ``Iteration(N): ...`` that ends in ``encoder inputs: K``
when the step ran the encoder on K items. An image request whose steps ran
the encoder on nothing was served from the encoder cache: that is a hit.

:func:`mm_cache_experiment` runs the whole measurement on one engine that
was cold-started on the *new* policy B (so its first answer is the cold
reference): a RolloutCore update to A, a negative control driven outside
RolloutCore back to B with the encoder and multimodal resets skipped (the
prefix cache is reset, as a text-only fix would), then RolloutCore updates
A -> B. The engine test and ``benchmarks/mm_cache.py`` both use it.
"""

from __future__ import annotations

import base64
import io
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutcore.core.evidence import PauseMode
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.errors import request
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import EffectError
from rolloutcore.transports.source import WeightSource

__all__ = [
    "ITERATION_LOG_FLAG",
    "MM_HITS",
    "MM_QUERIES",
    "EncoderLog",
    "ExperimentResult",
    "ImageAnswer",
    "Observation",
    "image_chat",
    "make_image_png",
    "mm_cache_experiment",
    "observe",
    "png_data_url",
]

#: The vLLM flag that makes the engine log its encoder runs per step.
ITERATION_LOG_FLAG = "--enable-logging-iteration-details"
MM_QUERIES = "vllm:mm_cache_queries_total"
MM_HITS = "vllm:mm_cache_hits_total"

_ITER = re.compile(r"Iteration\(\d+\):")
_ENC = re.compile(r"encoder inputs: (\d+), encoder output embeddings: (\d+)")


def make_image_png(seed: int, size: tuple[int, int] = (50, 40)) -> bytes:
    """A PNG of random pixels from ``seed``: a test image no cache has seen (needs Pillow)."""
    import numpy as np
    from PIL import Image

    w, h = size
    px = (np.random.default_rng(seed).random((h, w, 3)) * 255).astype("uint8")
    buf = io.BytesIO()
    Image.fromarray(px).save(buf, format="PNG")
    return buf.getvalue()


def png_data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class EncoderLog:
    """Encoder runs counted from a vLLM log written with ``ITERATION_LOG_FLAG``.

    ``mark()`` before a request, ``since(mark, steps)`` after it: the steps
    are logged by the API server's output loop, possibly just after the
    answer was sent, so ``since`` waits (bounded) until ``steps`` iteration
    lines have appeared after the mark.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def mark(self) -> int:
        return self.path.stat().st_size

    def since(self, mark: int, steps: int, *, timeout_s: float = 30.0) -> tuple[int, int, int]:
        """(encoder inputs, encoder output embeddings, iteration lines) logged after ``mark``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with open(self.path, "rb") as f:
                f.seek(mark)
                text = f.read().decode("utf-8", "replace")
            lines = [ln for ln in text.splitlines() if _ITER.search(ln)]
            if len(lines) >= steps or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        if not lines:
            raise EffectError("encoder_log", f"no iteration lines in {self.path}: was the "
                              f"engine started with {ITERATION_LOG_FLAG}?",
                              mutation_started=False)
        inputs = embeds = 0
        for ln in lines:
            m = _ENC.search(ln)
            if m:
                inputs += int(m.group(1))
                embeds += int(m.group(2))
        return inputs, embeds, len(lines)


@dataclass(frozen=True)
class ImageAnswer:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


def image_chat(base_url: str, model: str, image_url: str, *, text: str = "what is this?",
               max_tokens: int = 8, timeout_s: float = 120.0) -> ImageAnswer:
    """One greedy ``/v1/chat/completions`` with an ``image_url`` part: tokens and logprobs."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
            "return_token_ids": True,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": image_url}}]}]}
    r = request("POST", f"{base_url}{Routes.CHAT}", step="chat", timeout_s=timeout_s,
                json_body=body, mutation_started=False)  # a non-2xx raises (engine.errors)
    ch = r.json()["choices"][0]
    ids = tuple(int(t) for t in ch["token_ids"])
    lps = tuple(float(c["logprob"]) for c in ch["logprobs"]["content"])
    if len(ids) != len(lps):
        raise EffectError("chat", f"{len(lps)} logprobs for {len(ids)} tokens",
                          mutation_started=False)
    return ImageAnswer(ids, lps)


@dataclass(frozen=True)
class Observation:
    """One image request and what the engine's caches did for it."""

    answer: ImageAnswer
    encoder_inputs: int      # encoder runs the request's steps logged
    encoder_hits: int        # images sent minus encoder runs: served from the encoder cache
    mm_queries: float        # processor-cache lookups (vLLM's /metrics delta)
    mm_hits: float

    def to_dict(self) -> dict[str, Any]:
        return {"token_ids": list(self.answer.token_ids),
                "logprobs": list(self.answer.logprobs),
                "encoder_inputs": self.encoder_inputs, "encoder_hits": self.encoder_hits,
                "mm_cache_queries": self.mm_queries, "mm_cache_hits": self.mm_hits}


def observe(http: VllmHTTP, log: EncoderLog, model: str, image_url: str, *,
            max_tokens: int = 8) -> Observation:
    """Ask about one image and read both caches' counters around the request."""
    m0 = http.metrics()
    mark = log.mark()
    ans = image_chat(http.base_url, model, image_url, max_tokens=max_tokens)
    inputs, _, _ = log.since(mark, len(ans.token_ids))
    m1 = http.metrics()

    def d(name: str) -> float:
        a, b = m0.get(name), m1.get(name)
        if a is None or b is None:
            raise EffectError("metrics", f"{name} missing from /metrics",
                              mutation_started=False)
        return b - a

    return Observation(ans, inputs, max(0, 1 - inputs), d(MM_QUERIES), d(MM_HITS))


@dataclass
class ExperimentResult:
    cold: Observation
    warm: Observation
    after_rc_to_a: Observation
    negative_control: Observation
    rc_to_b: Observation
    phases_s: dict[str, float]
    reset_evidence: list[dict[str, Any]] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        cold, neg, hot = self.cold.answer, self.negative_control.answer, self.rc_to_b.answer
        return {
            "stale_encoder_hits_negative_control": self.negative_control.encoder_hits,
            "stale_mm_cache_hits_negative_control": self.negative_control.mm_hits,
            "tokens_differ_negative_control": neg.token_ids != cold.token_ids,
            "negative_control_equals_old_policy":
                neg == self.after_rc_to_a.answer,
            "stale_encoder_hits_rolloutcore": self.rc_to_b.encoder_hits,
            "stale_mm_cache_hits_rolloutcore": self.rc_to_b.mm_hits,
            "identical_to_cold": hot.token_ids == cold.token_ids
                                 and hot.logprobs == cold.logprobs,
            "policies_differ_on_the_image": self.after_rc_to_a.answer.token_ids
                                            != cold.token_ids,
            "warm_encoder_hits": self.warm.encoder_hits,
        }


def mm_cache_experiment(session: Any, log: EncoderLog, a_dir: Path, b_dir: Path,
                        image_url: str, *, provenance: Callable[[str, int], Provenance],
                        update_kwargs: Callable[[str], Mapping[str, Any]] | None = None,
                        ) -> ExperimentResult:
    """The measurement of the module docstring; ``session`` must be serving ``b_dir`` cold.

    ``provenance(name, step)`` makes the ``Provenance`` of each RolloutCore
    update to checkpoint ``name`` ("A" or "B"); ``update_kwargs(name)`` adds
    keyword arguments to its ``session.update`` (e.g. ``probe``,
    ``reference_checksums``). Leaves the engine on B, committed by RolloutCore.
    """
    h: VllmHTTP = session.http
    model = h.model()

    def kw(name: str) -> dict[str, Any]:
        return dict(update_kwargs(name)) if update_kwargs is not None else {}

    cold = observe(h, log, model, image_url)
    warm = observe(h, log, model, image_url)
    session.update(a_dir, provenance("A", 1), **kw("A"))
    on_a = observe(h, log, model, image_url)
    # Negative control, outside RolloutCore: B's weights under the running
    # engine, the prefix cache reset (as a text-only fix would), the encoder
    # and multimodal caches left alone.
    h.pause(PauseMode.WAIT, clear_cache=False)
    session.transport.send(h.base_url, "rogue-B", WeightSource.from_checkpoint(b_dir),
                           timeout_s=120)
    h.resume()
    ev = h.reset_prefix_cache()
    if ev.engine_success is not True:
        raise EffectError("negative_control", f"prefix reset failed: {ev}",
                          mutation_started=True)
    neg = observe(h, log, model, image_url)
    # Through RolloutCore: back to A (the encoder cache then holds A's
    # embedding of the image), then A -> B, the transition measured.
    session.update(a_dir, provenance("A", 2), **kw("A"))
    observe(h, log, model, image_url)
    n0 = len(session.journal.records)
    res = session.update(b_dir, provenance("B", 3), **kw("B"))
    hot = observe(h, log, model, image_url)
    resets = [{k: r.data["evidence"][k] for k in ("cache", "engine_success", "unverified")}
              for r in session.journal.records[n0:]
              if r.kind == "evidence" and r.data.get("event") == "invalidated"]
    return ExperimentResult(cold, warm, on_a, neg, hot, res.outcome.breakdown(), resets)
