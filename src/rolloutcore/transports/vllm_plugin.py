"""vLLM plugin entry point: installs RolloutCore's weight-transfer backends into vLLM.

Declared in pyproject under ``vllm.general_plugins``, so vLLM calls
``register()`` in every process it starts (API server, engine core,
workers), sometimes more than once. It must therefore be cheap and
idempotent: it registers every backend of ``registry.ENGINE_BACKENDS`` by
module path (nothing is imported until a worker creates that engine), and
the policy for a name already taken is the registry's (the same loader: a
no-op; another class: ``BackendConflict``).

It also applies one host setting, only where the engine's environment asks
for it: ``ROLLOUTCORE_VLLM_IDLE_SPIN_S`` (seconds, 0.01 to 60). vLLM's
shared-memory message queues (``shm_broadcast.SpinCondition``: engine core
to worker and back) keep a reader spinning on ``sched_yield`` for one second
after every message before it sleeps on its socket; that second is not a
setting of vLLM's. One engine on a host of idle cores loses nothing to it;
several engines on fewer cores than their processes (a CPU fleet on one
host) spend their cores spinning while their neighbours wait. Measured on 2
cores, 2 CPU engines: N one-engine transitions at once took 2.06 s with
vLLM's second and 0.66 s without (one alone 0.47-0.50 s), see docs/fleet.md.
The floor is not 0: the spin is also what catches the second message of a
burst, whose wake-up the writer's socket may drop (high-water mark 1), and
with no spin at all one request took 10 s (two of the reader's 5 s
rechecks). Under load the shorter spin costs the same way, less often: two
CPU engines on 2 cores behind the fleet gateway, six unpaced clients
(``benchmarks/idle_spin.py``, ``results/idle-spin.json``), 0.1 s served 1.54x
the requests with a p99 of 0.64 s against 1.71 s and updated 1.5-2.2x faster,
but 3 answers took over 5 s (none with vLLM's 1 s). Nothing sets it any more:
it is the operator's choice, made knowing that trade. A vLLM whose
``SpinCondition`` has no ``busy_loop_s`` default leaves the setting
unapplied, with a warning.

``rolloutcore.transports.cuda_ipc.engine.register`` is this same function,
kept at that path for installs whose entry points still name it.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Mapping

from rolloutcore.errors import BadInput
from rolloutcore.transports.registry import install_into_vllm

__all__ = ["IDLE_SPIN_ENV", "apply_idle_spin", "parse_idle_spin", "register"]

IDLE_SPIN_ENV = "ROLLOUTCORE_VLLM_IDLE_SPIN_S"
_MIN_SPIN_S = 0.01
_MAX_SPIN_S = 60.0

log = logging.getLogger(__name__)


def register() -> None:
    """Entry point of ``vllm.general_plugins``."""
    install_into_vllm()
    apply_idle_spin()


def parse_idle_spin(raw: str | None) -> float | None:
    """The seconds ``raw`` names, ``None`` when unset or empty; ``BadInput`` when bad."""
    if raw is None or not raw.strip():
        return None
    try:
        s = float(raw)
    except ValueError:
        raise BadInput(f"{IDLE_SPIN_ENV} must be a number of seconds, got {raw!r}") from None
    if not math.isfinite(s) or not _MIN_SPIN_S <= s <= _MAX_SPIN_S:
        raise BadInput(f"{IDLE_SPIN_ENV} must be in [{_MIN_SPIN_S:g}, {_MAX_SPIN_S:g}] "
                         f"seconds, got {raw!r}")
    return s


def apply_idle_spin(environ: Mapping[str, str] | None = None,
                    spin_condition: type | None = None) -> float | None:
    """Make ``SpinCondition``'s default ``busy_loop_s`` the environment's value.

    Returns the value applied, or ``None`` (not asked for, a bad value, or a
    vLLM without that default: each logged, vLLM's own default kept). Applying
    it again is a no-op. ``spin_condition`` is the class to change (tests);
    by default vLLM's, imported only when the setting is present.
    """
    env = os.environ if environ is None else environ
    try:
        s = parse_idle_spin(env.get(IDLE_SPIN_ENV))
    except BadInput as exc:
        log.warning("%s; vLLM's default kept", exc)
        return None
    if s is None:
        return None
    cls = spin_condition
    if cls is None:
        try:
            from vllm.distributed.device_communicators import shm_broadcast
        except Exception as exc:  # no vLLM here, or one without that module
            log.warning("%s not applied: %s", IDLE_SPIN_ENV, exc)
            return None
        cls = getattr(shm_broadcast, "SpinCondition", None)
    init = getattr(cls, "__init__", None)
    try:
        params = list(inspect.signature(init).parameters.values()) if callable(init) else []
    except (TypeError, ValueError):
        params = []
    with_default = [p for p in params if p.default is not inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY)]
    defaults = getattr(init, "__defaults__", None)
    names = [p.name for p in with_default]
    if "busy_loop_s" not in names or defaults is None or len(defaults) != len(names):
        log.warning("%s not applied: this vLLM's SpinCondition has no busy_loop_s default",
                    IDLE_SPIN_ENV)
        return None
    new = list(defaults)
    new[names.index("busy_loop_s")] = s
    init.__defaults__ = tuple(new)  # type: ignore[union-attr]
    return s
