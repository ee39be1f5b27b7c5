"""Real-engine draft support: a drafted transport whose draft round a test can break.

``FaultyDraftTransport`` runs real transfers, with two faults a test can arm:
the draft round sends other weights than the pair declares (``wire``: a draft
left on old weights), or its source breaks after ``break_after`` tensors (a
draft round failing mid-way). ``drafted_session`` puts one in front of an
engine started with a draft.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rolloutcore.core.versions import Provenance, VerificationLevel
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import ManagedEngine
from rolloutcore.session import DraftedSession, EngineSession
from rolloutcore.transports.drafted import DraftedGlooTransport, DraftedSource
from rolloutcore.transports.source import WeightSource

__all__ = ["FaultyDraftTransport", "assert_one_version", "drafted_session", "prov"]


class FaultyDraftTransport(DraftedGlooTransport):
    """Real transfers, with two faults a test can arm (see the module doc)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.wire: WeightSource | None = None
        self.break_after: int | None = None

    def draft_wire_source(self, source: DraftedSource) -> WeightSource:
        src = self.wire or source.draft
        n = self.break_after
        if n is None:
            return src
        entries = [(p.name, tuple(p.shape), p.dtype) for p in src.manifest().params]

        def load() -> Iterator[tuple[str, Any]]:
            for i, item in enumerate(src.named_tensors()):
                if i == n:
                    raise RuntimeError(f"trainer died after {n} draft tensors")
                yield item

        return WeightSource(entries, load, "a draft that breaks mid-way")


def prov(step: int, run: str = "draft-engine-test") -> Provenance:
    return Provenance("tiny", run, step)


def drafted_session(eng: ManagedEngine, journal: Path, *,
                    min_acceptance: float | None) -> tuple[DraftedSession, FaultyDraftTransport]:
    tr = FaultyDraftTransport(op_timeout_s=20.0)
    s = EngineSession(VllmHTTP(eng.base_url), tr, engine=eng, journal_path=journal)
    return DraftedSession(s, min_acceptance=min_acceptance), tr


def assert_one_version(ds: DraftedSession, tr: FaultyDraftTransport, eng: ManagedEngine,
                       r: Any, want: str) -> None:
    """A drafted update published as one version with the pair's digest ``want``, at
    probe level, under the engine's label; both rounds checked on the workers."""
    assert r.identity.content_digest == want
    assert ds.session.controller.identity is not None
    assert ds.session.controller.identity.content_digest == want
    assert r.identity.verification == VerificationLevel.PROBE
    assert ds.session.http.weight_info().label == r.version.label
    chk = tr.validation_check(eng.base_url)
    assert chk.passed and chk.level == VerificationLevel.ENGINE_CHECKSUM, chk
    assert "draft: rank 0/1" in chk.detail and chk.coverage == 1.0
