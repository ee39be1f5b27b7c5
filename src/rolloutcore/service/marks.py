"""The headers that mark an answer its release made unattributable (``service.proxy``).

Apart from the proxy so that the proxy's module stays within the size the
layering test allows; ``service.proxy`` re-exports both names.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["ATTRIBUTABLE_HEADER", "UNATTRIBUTABLE_HEADER", "marks_headers"]

#: The headers of an answer its release made unattributable.
ATTRIBUTABLE_HEADER = "x-rolloutcore-attributable"
UNATTRIBUTABLE_HEADER = "x-rolloutcore-unattributable"


def marks_headers(marks: Mapping[str, Any]) -> list[tuple[bytes, bytes]]:
    """The two headers for an answer's unattributable marks (none for no marks)."""
    if not marks:
        return []
    why = str(marks["unattributable"]).encode("ascii", "replace")[:300]
    return [(ATTRIBUTABLE_HEADER.encode(), b"false"), (UNATTRIBUTABLE_HEADER.encode(), why)]
