"""What an update is checked against: the adapter's optional checks and what it staged.

``VllmAdapter`` (``engine.port``) takes these from a caller: a transport that can check
what it installed, a probe set, and the declared reference checksums, staged with the
update's source (in process) or its expectations (a remote trainer sends).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rolloutcore.core.evidence import Check, UpdateTarget
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import checksum_map

__all__ = ["CheckingTransport", "ProbeSet", "Staged", "expectations"]


@runtime_checkable
class CheckingTransport(Protocol):
    """A transport that can check what it installed (e.g. rc_cuda_ipc's block checksum
    of the updated slices, computed on the workers): an optional capability."""

    def validation_check(self, base_url: str) -> Check:
        ...


@runtime_checkable
class ProbeSet(Protocol):
    """Behavioural validation (issue 9): run fixed probes, compare with expectations.

    Provided by another module; the adapter calls it after resume with
    admission still closed and records the returned check.
    """

    def run(self, http: VllmHTTP, target: UpdateTarget) -> Check:
        ...


@dataclass
class Staged:
    """What ``VllmAdapter.stage`` or ``expect`` declared for the next update."""

    source: WeightSource | None     # None: a remote trainer sends (``expect``)
    provenance: Provenance | None
    reference_checksums: Mapping[str, str] | None
    probes: ProbeSet | None
    manifest_digest: str
    #: A remote trainer's transport checksum of what it sent (``expect_sent``).
    sent: Mapping[str, Any] | None = None
    #: The probe is of the checkpoint the engine was started on (a takeover):
    #: its deviation becomes the engine's calibration.
    calibrating: bool = False


def expectations(probes: ProbeSet | None, reference_checksums: Mapping[str, str] | None
                 ) -> tuple[dict[str, str] | None, ProbeSet | None]:
    """What ``stage`` and ``expect`` compare with, checked: (checksums, probes)."""
    if probes is not None and not isinstance(probes, ProbeSet):
        raise BadInput("probes must implement ProbeSet.run(http, target) -> Check")
    return (None if reference_checksums is None
            else checksum_map("reference_checksums", reference_checksums)), probes
