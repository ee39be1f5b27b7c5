"""Trainer-side weight transports into a running vLLM, through vLLM's own path.

``gloo`` is the CPU backend (this package also provides its engine half, a
vLLM plugin); ``nccl`` and ``ipc`` drive vLLM's built-in trainer engines
(``driver`` holds their shared guards); ``cuda_ipc`` is the no-pickle CUDA
IPC backend, both halves. ``base`` holds the protocol and the deadline/abort
plumbing they all share, ``net`` the socket helpers. ``registry`` says which
class answers to which backend name on each side, and installs the engine
halves into vLLM (``vllm_plugin``, the entry point). ``compat`` holds the
stand-ins for what vLLM 0.26 lacks.
"""

from rolloutcore.transports.base import TransportBase, WeightTransport, preflight
from rolloutcore.transports.driver import DeviceGuard, TargetAwareSyncClient, VllmTrainerTransport
from rolloutcore.transports.gloo import BACKEND as GLOO_BACKEND
from rolloutcore.transports.gloo import GlooTransport
from rolloutcore.transports.ipc import IpcTransport
from rolloutcore.transports.nccl import NcclTransport
from rolloutcore.transports.registry import (
    ENGINE_BACKENDS,
    TRAINER_TRANSPORTS,
    BackendConflict,
    trainer_transport,
)

__all__ = [
    "ENGINE_BACKENDS",
    "GLOO_BACKEND",
    "TRAINER_TRANSPORTS",
    "BackendConflict",
    "DeviceGuard",
    "GlooTransport",
    "IpcTransport",
    "NcclTransport",
    "TargetAwareSyncClient",
    "TransportBase",
    "VllmTrainerTransport",
    "WeightTransport",
    "preflight",
    "trainer_transport",
]
