"""vLLM plugin entry point: registers RolloutCore's weight-transfer backends.

Declared in pyproject under ``vllm.general_plugins``, so vLLM calls
``register()`` in every process it starts (API server, engine core,
workers), sometimes more than once. It therefore must be idempotent and
cheap: it registers the backend by module path, and vLLM imports the module
only in the process that creates the engine (the worker).

A name that is already taken by someone else's backend is a real conflict
and raises, naming both: vLLM would otherwise route our configuration to a
foreign engine.
"""

from __future__ import annotations

__all__ = ["BACKENDS", "register"]

# name -> (module, class) of each engine half RolloutCore provides
BACKENDS: dict[str, tuple[str, str]] = {
    "rolloutcore_gloo": ("rolloutcore.transports.gloo", "GlooWeightTransferEngine"),
}


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    registry = WeightTransferEngineFactory._registry
    for name, (module, cls_name) in BACKENDS.items():
        loader = registry.get(name)
        if loader is None:
            WeightTransferEngineFactory.register_engine(name, module, cls_name)
            continue
        # Already registered: ours (a second call, or a reloaded module) is fine.
        # Resolving the loader imports its module; for ours that is cheap and
        # needs no vLLM engine state.
        existing = loader()
        where = (getattr(existing, "__module__", "?"), getattr(existing, "__name__", "?"))
        if where != (module, cls_name):
            raise RuntimeError(
                f"weight transfer backend {name!r} is already registered to "
                f"{where[0]}.{where[1]}; RolloutCore's {module}.{cls_name} cannot take it")
