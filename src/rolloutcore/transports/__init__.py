"""Trainer-side weight transports into a running vLLM, through vLLM's own path.

``gloo`` is the CPU backend (this package also provides its engine half, a
vLLM plugin); ``nccl`` and ``ipc`` drive vLLM's built-in trainer engines.
``base`` holds the protocol and the deadline/abort plumbing they share.
"""

from .base import HTTPError, TransportBase, WeightTransport, preflight
from .gloo import BACKEND as GLOO_BACKEND
from .gloo import GlooTransport

__all__ = [
    "GLOO_BACKEND",
    "GlooTransport",
    "HTTPError",
    "TransportBase",
    "WeightTransport",
    "preflight",
]
