"""RolloutCore: verified live policy updates for RL rollouts served by vLLM.

The pure core (``lifecycle``, ``evidence``, ``versions``, ``errors``) imports
only the standard library; engine effects live behind ``port.LifecycleAdapter``.
"""

from rolloutcore.core.lifecycle import (
    Binding,
    Classification,
    Completion,
    ControllerConfig,
    FailureKind,
    LifecycleController,
    State,
    Step,
    UpdateTicket,
    Verdict,
)
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

__version__ = "0.1.0"

__all__ = [
    "AdmissionRefused",
    "BadInput",
    "Binding",
    "Classification",
    "Completion",
    "ControllerConfig",
    "EffectError",
    "EffectTimeout",
    "EngineUnavailable",
    "EvidenceRejected",
    "FailureKind",
    "InvalidTransition",
    "JournalError",
    "LifecycleController",
    "ParamSpec",
    "ParameterManifest",
    "Provenance",
    "RolloutCoreError",
    "State",
    "Step",
    "TransferError",
    "UpdateFailed",
    "UpdateRefused",
    "UpdateTicket",
    "Verdict",
    "VerificationLevel",
    "WeightIdentity",
    "WeightVersion",
    "__version__",
]
