"""What a vLLM the user started must offer ``serve --upstream``, checked at start.

The recipe is ``docs/own-vllm.md``. The version and the required routes (dev
mode) are ``engine.support``'s to judge; this module adds what only a
running engine's ``/server_info`` tells: the weight-transfer backend it was
started with (none, or another than ``--transport-backend``, would leave the
first update waiting on a handshake the engine never joins), and the optional
pieces whose absence lowers what an update can verify (named, not refused).
It reads answers handed to it and calls nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rolloutcore.engine.routes import Routes
from rolloutcore.errors import EngineUnavailable

__all__ = ["RECIPE", "check_upstream"]

RECIPE = "docs/own-vllm.md"


def check_upstream(server_info: Mapping[str, Any] | None, capabilities: frozenset[str],
                   backend: str) -> list[str]:
    """Warnings about what the engine lacks; ``EngineUnavailable`` naming what it must have.

    ``server_info``: the engine's ``/server_info`` answer (``None`` when it has
    none: nothing more can be checked, and that is a warning).
    """
    want = json.dumps({"backend": backend})
    warnings: list[str] = []
    if server_info is None:
        warnings.append("no /server_info: the engine's weight-transfer backend cannot be "
                        f"checked (start it with --weight-transfer-config '{want}'; {RECIPE})")
    else:
        cfg = server_info.get("vllm_config")
        wt = cfg.get("weight_transfer_config") if isinstance(cfg, Mapping) else None
        got = wt.get("backend") if isinstance(wt, Mapping) else None
        if got != backend:
            started = ("without a weight-transfer backend" if got is None
                       else f"with the weight-transfer backend {got!r}")
            raise EngineUnavailable(
                "serve", f"the engine at the upstream URL was started {started}, and the "
                f"gateway's is {backend!r}: start vLLM with --weight-transfer-config "
                f"'{want}' (rolloutcore installed in its Python, for the plugin that registers "
                f"the backend), or give serve --transport-backend {got or 'BACKEND'} ({RECIPE})",
                mutation_started=False)
    if Routes.GENERATE not in capabilities:
        warnings.append("no /inference/v1/generate (vLLM's --enable-scale-out): no per-token "
                        "weight versions and no policy probe, so updates verify less "
                        f"({RECIPE})")
    return warnings
