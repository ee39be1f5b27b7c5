"""Trainer-side weight transports into a running vLLM, through vLLM's own path.

``gloo`` is the CPU backend (this package also provides its engine half, a
vLLM plugin); ``nccl`` and ``ipc`` drive vLLM's built-in trainer engines
(``driver`` holds their shared guards). ``base`` holds the protocol and the
deadline/abort plumbing they all share.
"""

from rolloutcore.transports.base import TransportBase, WeightTransport, preflight
from rolloutcore.transports.driver import DeviceGuard, TargetAwareSyncClient, VllmTrainerTransport
from rolloutcore.transports.gloo import BACKEND as GLOO_BACKEND
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.ipc import IpcTransport
from rolloutcore.transports.nccl import NcclTransport

__all__ = [
    "GLOO_BACKEND",
    "DeviceGuard",
    "GlooTransport",
    "IpcTransport",
    "NcclTransport",
    "TargetAwareSyncClient",
    "TransportBase",
    "VllmTrainerTransport",
    "WeightTransport",
    "preflight",
]
