"""``/weight_checker`` checksums and their comparison with a reference.

Moved unchanged out of the adapter module; the one rule it keeps: a
checksum of zero bytes proves nothing. vLLM's CPU backend repacks the fused
linear layers; ``/weight_checker`` then hashes them to the sha256 of the
empty string. Those parameters are *unverifiable*, never matches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput

__all__ = [
    "EMPTY_SHA256",
    "ChecksumComparison",
    "WeightChecksums",
    "compare_checksums",
]

#: sha256 of zero bytes: what ``/weight_checker`` reports for a parameter it
#: could not read (repacked CPU weights). Never a match.
EMPTY_SHA256 = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


@dataclass(frozen=True)
class WeightChecksums:
    """``/weight_checker`` checksums keyed by parameter name, rank prefix stripped.

    ``raw_keys`` maps each name back to the engine's key
    (``dp0:pp0:pcp0:tp0:<name>``). With several ranks a name can repeat, so
    such names keep their full key.
    """

    digests: Mapping[str, str]
    raw_keys: Mapping[str, str]

    @property
    def total(self) -> int:
        return len(self.digests)

    @property
    def unverifiable(self) -> frozenset[str]:
        """Parameters the engine hashed as zero bytes: their content cannot be checked."""
        return frozenset(n for n, d in self.digests.items() if d == EMPTY_SHA256)

    @property
    def hashable(self) -> frozenset[str]:
        return frozenset(n for n, d in self.digests.items() if d != EMPTY_SHA256)

    @property
    def coverage(self) -> float:
        """Fraction of parameters whose content the engine could hash at all."""
        return 0.0 if not self.digests else len(self.hashable) / len(self.digests)


@dataclass(frozen=True)
class ChecksumComparison:
    """Engine checksums against a reference map. Unverifiable never counts as matched."""

    total: int
    matched: tuple[str, ...]
    mismatched: tuple[str, ...]
    unverifiable: tuple[str, ...]
    no_reference: tuple[str, ...]
    missing_in_engine: tuple[str, ...]

    @property
    def compared(self) -> int:
        return len(self.matched) + len(self.mismatched)

    @property
    def coverage(self) -> float:
        """Fraction of the engine's parameters whose content was actually compared."""
        return 0.0 if self.total == 0 else self.compared / self.total

    @property
    def passed(self) -> bool:
        return not self.mismatched and not self.missing_in_engine and self.compared > 0

    def detail(self) -> str:
        parts = [f"{len(self.matched)}/{self.total} matched",
                 f"{len(self.unverifiable)} unverifiable (zero-byte hash)"]
        if self.no_reference:
            parts.append(f"{len(self.no_reference)} without reference")
        if self.mismatched:
            parts.append("MISMATCH: " + ", ".join(self.mismatched[:8])
                         + (" ..." if len(self.mismatched) > 8 else ""))
        if self.missing_in_engine:
            parts.append("missing in engine: " + ", ".join(self.missing_in_engine[:8]))
        if self.compared == 0:
            parts.append("nothing compared")
        return "; ".join(parts)

    def to_check(self, name: str = "engine_checksum") -> Check:
        return Check(name=name, passed=self.passed, detail=self.detail(),
                     coverage=self.coverage, level=VerificationLevel.ENGINE_CHECKSUM)


_RANK_PREFIX = re.compile(r"^(?:[a-z]+\d+:)+")


def _strip_rank(key: str) -> str:
    """``"dp0:pp0:pcp0:tp0:model.x.weight"`` -> ``"model.x.weight"``."""
    return _RANK_PREFIX.sub("", key, count=1)


def compare_checksums(engine: WeightChecksums, reference: Mapping[str, str]) -> ChecksumComparison:
    """Compare engine checksums with a reference keyed by parameter name (or raw key).

    A parameter the engine hashed as zero bytes is unverifiable whatever the
    reference says; a reference entry the engine does not have is a failure.
    """
    if not isinstance(reference, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in reference.items()):
        raise BadInput("reference checksums must be a mapping of str to str")
    by_raw = {raw: name for name, raw in engine.raw_keys.items()}
    ref: dict[str, str] = {}
    missing: list[str] = []
    for k, v in reference.items():
        name = k if k in engine.digests else by_raw.get(k)
        if name is None:
            missing.append(k)
        else:
            ref[name] = v.lower()
    matched, mismatched, unverifiable, no_ref = [], [], [], []
    for name, digest in sorted(engine.digests.items()):
        if digest == EMPTY_SHA256:
            unverifiable.append(name)
        elif name not in ref:
            no_ref.append(name)
        elif ref[name] == digest:
            matched.append(name)
        else:
            mismatched.append(name)
    return ChecksumComparison(engine.total, tuple(matched), tuple(mismatched),
                              tuple(unverifiable), tuple(no_ref), tuple(sorted(missing)))
