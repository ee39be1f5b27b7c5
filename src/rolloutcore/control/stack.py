"""``wire``: the one place the engine stack is put together (issue 45, prime-rl's ``wire()``).

The engine stack is a controller (over its journal), the runner that drives
one engine through a port (``control.port.LifecycleAdapter``: ``VllmAdapter``
for vLLM, ``FakeAdapter`` for the simulated engine) and, for a launched
engine, the hook that taints at once when its process exits. The session
(``rolloutcore.session``), ``rolloutcore serve`` (``service.serve``), fleet
placement (``fleet.placement``) and the demo (``cli.demo``) all call
``wire``; nothing else constructs a ``LifecycleRunner`` in ``src/``
(``tests/test_layering.py``). ``wire`` takes the port already built, so
this module knows no engine (``control`` imports nothing from ``engine``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal, open_controller
from rolloutcore.control.port import LifecycleAdapter
from rolloutcore.control.runner import Deadlines, DrainPolicy, LifecycleRunner
from rolloutcore.core.lifecycle_state import ControllerConfig
from rolloutcore.errors import BadInput

__all__ = ["Stack", "wire"]


@dataclass(frozen=True)
class Stack:
    """What ``wire`` built: the controller, its journal (None: none kept), the runner."""

    controller: LifecycleController
    journal: Journal | None
    runner: LifecycleRunner


def wire(port: LifecycleAdapter, *, controller: LifecycleController | None = None,
         journal: Journal | None = None,
         journal_path: str | os.PathLike[str] | None = None, restore: bool = False,
         journal_keep: int | None = None, controller_config: ControllerConfig | None = None,
         controller_kw: dict[str, Any] | None = None, deadlines: Deadlines | None = None,
         drain_policy: DrainPolicy = DrainPolicy.ABORT, engine: object = None) -> Stack:
    """The engine stack over ``port``.

    The controller: ``controller`` as given (with its ``journal``, if any), or
    one restored from the journal at ``journal_path`` (``restore=True``:
    ``open_controller``), or a new one listening to a new journal at
    ``journal_path`` (None: in memory). ``engine``: a launched engine's
    handle; its exit taints the runner at once (#47).
    """
    if controller is not None and (journal_path is not None or restore):
        raise BadInput("wire takes a controller or a journal path to build one, not both")
    if controller is None:
        kw = dict(controller_kw or {})
        if controller_config is not None:
            kw["config"] = controller_config
        if restore:
            controller, journal = open_controller(journal_path, keep=journal_keep, **kw)
        else:
            journal = Journal(journal_path) if journal is None else journal
            controller = LifecycleController(listener=journal.listener, **kw)
    runner = LifecycleRunner(controller, port, deadlines,
                             record=None if journal is None else journal.defer,
                             drain_policy=drain_policy)
    exits = getattr(engine, "on_exit", None)
    if isinstance(exits, list):  # a launched engine's exit taints at once (#47)
        exits.append(runner.engine_exited)
    return Stack(controller, journal, runner)
