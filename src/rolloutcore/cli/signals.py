"""SIGTERM and SIGHUP end a command as Ctrl-C does.

A command (``train``, ``serve``, ``live-update``) ends cleanly on Ctrl-C: an
update in progress ended decided, the engine stopped, the journal's
``interrupted`` record and the report written. An orchestrator, a service
manager or a closed terminal sends SIGTERM or SIGHUP instead, whose default
is to die at once with all of that undone. ``as_ctrl_c()`` makes both do
what SIGINT does *now*: whatever handler SIGINT has at that moment runs
(Python's ``KeyboardInterrupt``, a ``deferred_interrupts`` section that notes
the press and finishes first, uvicorn's graceful shutdown while a gateway
serves). A disposition someone chose (``nohup``'s ignored SIGHUP, a
handler installed before) is left alone. Main thread only, as signals are.

The engine a command launched never outlives it either way: its tether
(``engine.launch_guard``) covers the deaths no handler sees (-9).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["TERMINATING", "as_ctrl_c"]

#: The signals that end a command as Ctrl-C does.
TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _like_sigint(signum: int, frame: FrameType | None) -> None:
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    elif handler != signal.SIG_IGN:
        signal.default_int_handler(signal.SIGINT, frame)  # KeyboardInterrupt


@contextlib.contextmanager
def as_ctrl_c() -> Iterator[list[int]]:
    """Inside, SIGTERM and SIGHUP act as SIGINT where they have their default disposition
    (restored on the way out); yields the signals changed (none outside the main thread)."""
    changed: list[int] = []
    if threading.current_thread() is threading.main_thread():
        for sig in TERMINATING:
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _like_sigint)
                changed.append(int(sig))
    try:
        yield changed
    finally:
        for num in changed:
            signal.signal(num, signal.SIG_DFL)
