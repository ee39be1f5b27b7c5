"""Per-sample sampling seeds that no two engines, replicas or siblings share.

Why this exists (seed 002, section 1): every vLLM data-parallel engine resets
its global RNG to the same seed after warm-up, so requests sent *without* a
seed draw from identical streams, and the n-th request on every engine samples
the same tokens. When the siblings of a GRPO group are spread over engines,
groups collapse to a few distinct answers (64-70 distinct out of 256 seen in
the field). A seed carried by the request itself sidesteps the global stream
entirely: vLLM builds a per-request ``torch.Generator`` seeded with it, so the
tokens depend on the request, never on which engine or replica served it or
on how many requests that engine saw before.

The seed of a sample is a pure function of *what* the sample is
(run, step, group, sample index), never of *where* it ran:

    seed = int.from_bytes(sha256(canonical)[:8], "big") >> 1

where ``canonical`` is the UTF-8 of the compact JSON array
``["rolloutcore-seed-v1", run, step, group, sample]`` (``json.dumps`` with
``separators=(",", ":")`` and ``ensure_ascii=True``), e.g.
``["rolloutcore-seed-v1","run-a",3,"run-a:s3:p17",2]``. The result is a
63-bit non-negative integer, so it fits a signed int64 everywhere (torch,
numpy, vLLM), and ``seed + i`` for vLLM's own ``n > 1`` child seeds still
fits ``torch.Generator.manual_seed``. Two distinct inputs collide with
probability about 2**-63 per pair.

Rules for callers:

* send one request per sample (``n=1``) with ``seed=derive_seed(...)`` and
  record ``seed_derivation=SEED_DERIVATION``; the audit recomputes it;
* never reuse a seed across siblings (verl's ``full_determinism`` does: don't);
* greedy decoding (temperature 0) ignores the seed, so identical siblings
  under greedy are expected and say nothing about the RNG.

Changing this function changes every seed: bump ``SEED_DERIVATION``.

Standard library only.
"""

from __future__ import annotations

import hashlib
import json

from rolloutcore.core.strict import check_int, check_str

__all__ = ["SEED_BITS", "SEED_DERIVATION", "derive_seed", "seed_encoding"]

SEED_DERIVATION = "rolloutcore-seed-v1"
SEED_BITS = 63


def seed_encoding(run: str, step: int, group: str, sample: int) -> bytes:
    """The exact bytes that are hashed; public so other languages can check it."""
    fields = [SEED_DERIVATION, check_str("run", run), check_int("step", step),
              check_str("group", group), check_int("sample", sample)]
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def derive_seed(run: str, step: int, group: str, sample: int) -> int:
    """The 63-bit sampling seed of sample ``sample`` of group ``group``."""
    digest = hashlib.sha256(seed_encoding(run, step, group, sample)).digest()
    return int.from_bytes(digest[:8], "big") >> (64 - SEED_BITS)
