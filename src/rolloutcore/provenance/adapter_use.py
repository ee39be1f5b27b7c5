"""A sample's LoRA adapter (trajectory schema 5), and what the audit checks of it.

The binding names the base version (the engine's weights, which an adapter does
not change); ``AdapterUse`` names the adapter on top. ``adapter_problems`` is the
audit's check of one against the journal's published adapter versions.

Standard library only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.records import fields_dict, fields_from_dict
from rolloutcore.core.strict import HEX64, check_str, fail

__all__ = ["AdapterUse", "adapter_problems", "publications_to_dict"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")   # vLLM's LoRA names
_LABEL_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,255}$")


@dataclass(frozen=True)
class AdapterUse:
    """The LoRA-adapter version a sample was generated through.

    ``name`` is what the request sent as its model; ``generation``;
    ``content_digest`` the sha256 of its tensors and config
    (``verification.adapters``); ``base`` the label of the base version it was
    verified on (``TrajectorySample`` requires the binding's).
    """

    name: str
    generation: int
    content_digest: str
    base: str

    def __post_init__(self) -> None:
        for where, x, pat in (("adapter.name", self.name, _NAME_RE),
                              ("adapter.content_digest", self.content_digest, HEX64),
                              ("adapter.base", self.base, _LABEL_RE)):
            check_str(where, x)
            if not pat.fullmatch(x):
                raise fail(where, f"must match {pat.pattern}, got {x!r}")
        g = self.generation
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise fail("adapter.generation", f"must be an int >= 1, got {g!r}")

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)

    @classmethod
    def from_dict(cls, d: object) -> AdapterUse:
        return fields_from_dict(cls, "adapter", d)


def adapter_problems(a: AdapterUse,
                     published: Mapping[str, AbstractSet[tuple[int, str, str]]]
                     ) -> list[tuple[str, str]]:
    """(issue, detail) for an adapter the journal did not publish as recorded.

    ``published``: name -> every (generation, content digest, base label) the
    journal's ``adapter`` records published (verified) it as: one per engine, so
    a fleet's sample matches the publication on its own replica's base label.
    """
    pubs = published.get(a.name)
    if not pubs:
        return [("unpublished-adapter", f"adapter {a.name} was never published in the "
                 "journal")]
    if (a.generation, a.content_digest, a.base) not in pubs:
        seen = "; ".join(f"generation {g}, sha256 {d[:16]}, on {b}" for g, d, b in sorted(pubs))
        return [("adapter-mismatch",
                 f"adapter {a.name} was published as {seen}; the sample says generation "
                 f"{a.generation}, sha256 {a.content_digest[:16]}, on {a.base}")]
    return []


def publications_to_dict(published: Mapping[str, AbstractSet[tuple[int, str, str]]]
                         ) -> dict[str, Any]:
    """``published`` as JSON: per name one object, or a list of them where a fleet's
    replicas published it on several base labels."""
    def one(p: tuple[int, str, str]) -> dict[str, Any]:
        return {"generation": p[0], "content_digest": p[1], "base": p[2]}

    return {n: one(next(iter(ps))) if len(ps) == 1 else [one(p) for p in sorted(ps)]
            for n, ps in published.items()}
