"""Open and close vLLM's checkpoint-format reload, whichever vLLM the worker runs.

vLLM 0.26-0.33 expose ``initialize_layerwise_reload(model)`` and
``finalize_layerwise_reload(model, model_config)``. vLLM 0.34 adds
``start_reload(model)`` / ``finish_reload(model, model_config, device)``: they
pick the reload mode (``VLLM_RELOAD_MODE=layerwise|direct``) and set the
process-wide ``weight_update_active()`` flag that replaced 0.32's
``mtp_validation.disable_mtp_completeness_check`` (a model that checks its
checkpoint for completeness skips the check while an update is active, since
one ``load_weights`` call then holds a part of the checkpoint). Calling the old
pair on 0.34 would leave the flag unset, and an MTP or draft model would refuse
the partial load with the reload open.

Direct mode writes every tensor in place as it arrives, with "no rollback": a
round that breaks off leaves the weights half old and half new, and a finish
that fails cannot be retried. RolloutCore's guarantees rest on a round that can
fail without having changed what the engine serves until its finish (the
layerwise reload restores nothing either, but it stages each layer and
re-processes it whole); so a worker in direct mode refuses to open a round at
all (``DirectReloadRefused``, before any tensor moves), and the trainer sees the
refusal as a failed start: nothing was written.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

from rolloutcore.errors import TransferError

__all__ = ["DirectReloadRefused", "ReloadApi", "reload_api"]


class DirectReloadRefused(TransferError):
    """The worker runs vLLM's direct (in-place, no rollback) reload mode: nothing moved."""

    def __init__(self, reason: str) -> None:
        super().__init__("transfer", reason, mutation_started=False)


class ReloadApi:
    """The reload entry points of the vLLM this worker imported.

    ``open(model)`` begins a reload, ``close(model, model_config, device)``
    completes it, ``mtp_ok()`` is a context manager under which a model's
    completeness check lets one ``load_weights`` call hold part of the
    checkpoint (0.32's context manager; a no-op where ``start_reload`` set
    vLLM 0.34's flag already). ``generation`` names which API was found.
    """

    def __init__(self, module: Any) -> None:
        self._m = module
        self.generation = "start_reload" if hasattr(module, "start_reload") else "layerwise"

    def direct_mode(self) -> bool:
        """Whether vLLM would reload in place (0.34's ``VLLM_RELOAD_MODE=direct``)."""
        if self.generation != "start_reload":
            return False
        direct = importlib.import_module(self._m.__name__ + ".direct")
        return bool(direct.direct_reload_enabled())

    def open(self, model: Any) -> None:
        if self.generation == "start_reload":
            if self.direct_mode():
                raise DirectReloadRefused(
                    "VLLM_RELOAD_MODE=direct writes weights in place with no rollback: "
                    "RolloutCore refuses to open an update round in it (unset it, or set "
                    "VLLM_RELOAD_MODE=layerwise)")
            self._m.start_reload(model)
        else:
            self._m.initialize_layerwise_reload(model)

    def close(self, model: Any, model_config: Any, device: Any) -> None:
        if self.generation == "start_reload":
            self._m.finish_reload(model, model_config, device)
        else:
            self._m.finalize_layerwise_reload(model, model_config)

    @contextlib.contextmanager
    def mtp_ok(self) -> Iterator[None]:
        if self.generation == "start_reload":
            yield  # start_reload set weight_update_active(): models check it
            return
        try:
            mtp = importlib.import_module("vllm.model_executor.model_loader.mtp_validation")
        except ImportError:  # a vLLM with neither: nothing to disable
            yield
            return
        with mtp.disable_mtp_completeness_check():
            yield


def reload_api() -> ReloadApi:
    """The reload API of the vLLM importable here (imports vLLM)."""
    return ReloadApi(importlib.import_module("vllm.model_executor.model_loader.reload"))
