"""What a ``rolloutcore_gloo`` round leaves for validation: each engine rank's write report.

At its finish every engine rank sends the trainer (group rank 0), over the
round's own group, the size and then the encoded ``rank_checksums.RankReport``
of what it wrote. ``receive_reports`` takes them, rank by rank; a ``Round``
keeps them with the round's nonce and the tensors as sent, for the paused
validation (``GlooTransport.validation_check``). A per-engine round
(``GlooTransport``) and a fleet's fan-out (``GlooFanout``, per engine) both
use them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rolloutcore.errors import TransferError
from rolloutcore.transports import rank_checksums
from rolloutcore.transports.source import WeightSource

if TYPE_CHECKING:
    import torch

__all__ = ["MAX_REPORT_BYTES", "Round", "receive_reports"]

#: The largest write report an engine rank may announce (names and checksums of
#: every parameter it wrote: ~300 bytes each).
MAX_REPORT_BYTES = 64 << 20


@dataclass
class Round:
    """One finished round to one engine: its nonce, the tensors as sent, and each
    engine rank's report (group rank counted from 1 within the engine)."""

    nonce: str
    sent: dict[str, torch.Tensor]
    reports: list[tuple[int, rank_checksums.RankReport]]
    #: The source the round sent whole (a checkpoint on disk: its digest is kept).
    source: WeightSource | None = None

    def digests(self) -> tuple[str, str]:
        """(manifest digest, content digest) of what the round sent, as a
        ``WeightIdentity`` of it records them: the checkpoint a declaration of the
        round stands for (#47). A checkpoint's digest is the one its identity
        already computed; anything else is hashed from the tensors as sent."""
        src = self.source
        if src is None or not src.immutable:
            src = WeightSource.from_state_dict(self.sent, description="the round's tensors")
        return src.manifest().digest, src.content_digest()


def receive_reports(group: Any, ranks: range) -> list[tuple[int, rank_checksums.RankReport]]:
    """The write report of every engine rank in ``ranks`` (group ranks), in order."""
    import torch

    out = []
    for rank in ranks:
        n = torch.zeros(1, dtype=torch.int64)
        group.recv([n], rank, rank_checksums.REPORT_TAG).wait()
        size = int(n.item())
        if not 0 < size <= MAX_REPORT_BYTES:
            raise TransferError("transfer", f"engine rank {rank} announced a write report "
                                f"of {size} bytes", mutation_started=True)
        buf = torch.empty(size, dtype=torch.uint8)
        group.recv([buf], rank, rank_checksums.REPORT_TAG).wait()
        try:
            out.append((rank, rank_checksums.decode(buf.numpy().tobytes())))
        except ValueError as exc:
            raise TransferError("transfer", f"engine rank {rank}'s write report: {exc}",
                                mutation_started=True) from exc
    return out
