"""``/weight_checker`` checksums as the adapter sees them: the one comparison, re-exported.

The comparison itself (a zero-byte hash is never a match; coverage always
reported) lives in ``rolloutcore.verification.checksums``; the adapter and
its callers import these names from here for convenience.
"""

from __future__ import annotations

from rolloutcore.verification.checksums import (
    EMPTY_SHA256,
    ChecksumComparison,
    WeightChecksums,
    compare_checksums,
    strip_rank,
)

__all__ = [
    "EMPTY_SHA256",
    "ChecksumComparison",
    "WeightChecksums",
    "compare_checksums",
    "strip_rank",
]
