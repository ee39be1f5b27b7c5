"""vLLM plugin entry point: installs RolloutCore's weight-transfer backends into vLLM.

Declared in pyproject under ``vllm.general_plugins``, so vLLM calls
``register()`` in every process it starts (API server, engine core,
workers), sometimes more than once. It must therefore be cheap and
idempotent: it registers every backend of ``registry.ENGINE_BACKENDS`` by
module path (nothing is imported until a worker creates that engine), and
the policy for a name already taken is the registry's (the same loader: a
no-op; another class: ``BackendConflict``).

``rolloutcore.transports.cuda_ipc.engine.register`` is this same function,
kept at that path for installs whose entry points still name it.
"""

from __future__ import annotations

from rolloutcore.transports.registry import install_into_vllm

__all__ = ["register"]


def register() -> None:
    """Entry point of ``vllm.general_plugins``."""
    install_into_vllm()
