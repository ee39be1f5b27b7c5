"""What an adapter update of one engine yields (``control.adapters.AdapterManager``).

``PreparedAdapter`` (``prepare``), ``VerifiedAdapter`` (``verify``),
``AdapterResult`` (``publish``/``update``), and a request's ``RolloutBinding``
to (base version, adapter version). Values only: no I/O, no locks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.adapters import AdapterBinding, AdapterVersion
from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import Binding, Provenance
from rolloutcore.verification.adapters import AdapterSource
from rolloutcore.verification.probe import PolicyProbe, ProbeResult

__all__ = ["AdapterResult", "PreparedAdapter", "RolloutBinding", "VerifiedAdapter"]


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter version ready to load: checked, digested, written, its reference computed."""

    version: AdapterVersion
    source: AdapterSource
    provenance: Provenance
    probe: PolicyProbe
    prepare_s: float
    #: How far the adapter's reference lies from the base's on the probe's tokens;
    #: computed when the tolerance is above ``MAX_TOLERANCE`` (``DISCRIMINATION``).
    effect: ProbeResult | None = None


@dataclass(frozen=True)
class AdapterResult:
    """A published adapter version, the checks that published it and the time of each phase."""

    version: AdapterVersion
    checks: tuple[Check, ...]
    phases: Mapping[str, float]
    retired: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def base_verified(self) -> bool:
        """Whether the base was probed beside the new adapter (``when_idle`` may skip it)."""
        return any(c.name == "base-probe" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version.to_dict(),
                "checks": [c.to_dict() for c in self.checks],
                "phases": dict(self.phases), "retired": list(self.retired),
                "notes": list(self.notes), "base_verified": self.base_verified}


@dataclass(frozen=True)
class RolloutBinding:
    """A request bound to (base version, adapter version); ``model`` is the name to send."""

    base: Binding
    adapter: AdapterBinding

    @property
    def model(self) -> str:
        return self.adapter.adapter.name

    def to_dict(self) -> dict[str, Any]:
        return {"base": self.base.version.to_dict(), "base_identity": self.base.identity.digest,
                **self.adapter.to_dict()}


@dataclass(frozen=True)
class VerifiedAdapter:
    """An adapter version loaded and verified on one engine, not yet published
    (``AdapterManager.verify``; then ``publish`` or ``abandon``)."""

    prepared: PreparedAdapter
    checks: tuple[Check, ...]
    notes: tuple[str, ...]
    phases: Mapping[str, float]
    retired: tuple[str, ...]
    verify_s: float

    @property
    def version(self) -> AdapterVersion:
        return self.prepared.version
