"""RolloutCore: verified live policy updates for RL rollouts served by vLLM.

The public names, in one place. The pure core (errors, the lifecycle, the
version and identity types) is imported here at once: it is standard
library only and cheap. Everything else (the trainer session, the vLLM
adapter and process, the transports, the service client, the journal and
the recorders) is imported on first use through the module ``__getattr__``,
so ``import rolloutcore`` never imports httpx, torch or vLLM and works
without any dependency installed; ``tests/test_exported_members.py`` pins
both the names and that promise.
"""

import importlib as _importlib
import typing as _typing

from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.lifecycle import (
    Binding,
    Classification,
    FailureKind,
    State,
    Step,
    UpdateMode,
    Verdict,
)
from rolloutcore.core.lifecycle_state import Completion, ControllerConfig, UpdateTicket
from rolloutcore.core.versions import (
    ParameterManifest,
    ParamSpec,
    Provenance,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.errors import (
    AdmissionRefused,
    BadInput,
    EffectError,
    EffectTimeout,
    EngineUnavailable,
    EvidenceRejected,
    InvalidTransition,
    JournalError,
    RolloutCoreError,
    TransferError,
    UpdateFailed,
    UpdateRefused,
)

if _typing.TYPE_CHECKING:
    from rolloutcore.control.async_modes import RolloutClient
    from rolloutcore.control.journal import Journal, read_journal
    from rolloutcore.control.runner import Deadlines, LifecycleRunner, UpdateOutcome
    from rolloutcore.engine.http import VllmHTTP
    from rolloutcore.engine.port import VllmAdapter
    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.engine.support import SupportVerdict
    from rolloutcore.provenance.recorder import TrajectoryRecorder
    from rolloutcore.service.client import RolloutCoreClient
    from rolloutcore.session import EngineSession
    from rolloutcore.transports import GlooTransport, IpcTransport, NcclTransport
    from rolloutcore.transports.cuda_ipc import CudaIpcTransport
    from rolloutcore.transports.source import WeightSource

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first access.
_LAZY: dict[str, str] = {
    "EngineSession": "rolloutcore.session",
    "RolloutClient": "rolloutcore.control.async_modes",
    "LifecycleRunner": "rolloutcore.control.runner",
    "Deadlines": "rolloutcore.control.runner",
    "UpdateOutcome": "rolloutcore.control.runner",
    "Journal": "rolloutcore.control.journal",
    "read_journal": "rolloutcore.control.journal",
    "VllmHTTP": "rolloutcore.engine.http",
    "VllmAdapter": "rolloutcore.engine.port",
    "ManagedEngine": "rolloutcore.engine.process",
    "SupportVerdict": "rolloutcore.engine.support",
    "RolloutCoreClient": "rolloutcore.service.client",
    "WeightSource": "rolloutcore.transports.source",
    "GlooTransport": "rolloutcore.transports.gloo",
    "NcclTransport": "rolloutcore.transports.nccl",
    "IpcTransport": "rolloutcore.transports.ipc",
    "CudaIpcTransport": "rolloutcore.transports.cuda_ipc",
    "TrajectoryRecorder": "rolloutcore.provenance.recorder",
}


def __getattr__(name: str) -> _typing.Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rolloutcore' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value   # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY.keys())


__all__ = [
    "AdmissionRefused",
    "BadInput",
    "Binding",
    "Classification",
    "Completion",
    "ControllerConfig",
    "CudaIpcTransport",
    "Deadlines",
    "EffectError",
    "EffectTimeout",
    "EngineSession",
    "EngineUnavailable",
    "EvidenceRejected",
    "FailureKind",
    "GlooTransport",
    "InvalidTransition",
    "IpcTransport",
    "Journal",
    "JournalError",
    "LifecycleController",
    "LifecycleRunner",
    "ManagedEngine",
    "NcclTransport",
    "ParamSpec",
    "ParameterManifest",
    "Provenance",
    "RolloutClient",
    "RolloutCoreClient",
    "RolloutCoreError",
    "State",
    "Step",
    "SupportVerdict",
    "TrajectoryRecorder",
    "TransferError",
    "UpdateFailed",
    "UpdateMode",
    "UpdateOutcome",
    "UpdateRefused",
    "UpdateTicket",
    "Verdict",
    "VerificationLevel",
    "VllmAdapter",
    "VllmHTTP",
    "WeightIdentity",
    "WeightSource",
    "WeightVersion",
    "__version__",
    "read_journal",
]
