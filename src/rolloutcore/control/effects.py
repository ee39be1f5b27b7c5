"""The runner's effect workers: daemon threads reused from one effect to the next.

``LifecycleRunner._effect`` runs each adapter effect in a worker thread and
supervises it with the step's deadline (the runner module says why). This
module owns only the threads: which one runs a job, and when an idle one
exits. It knows nothing of steps, deadlines or adapters; the runner waits on
each job's ``done`` lock with the deadline and cancels through the adapter.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable

__all__ = ["WORKERS", "EffectWorkers", "Job"]

#: How often a wait for a job wakes to run a pending Ctrl-C's handler.
_INTERRUPT_POLL_S = 0.1


class Job:
    """One effect handed to a worker: its function, its result, and a lock released
    when it is done (created held; the supervisor waits on it with the deadline)."""

    __slots__ = ("done", "error", "fn", "name", "value")

    def __init__(self, name: str, fn: Callable[[], object]) -> None:
        self.name = name
        self.fn = fn
        self.value: object = None
        self.error: BaseException | None = None
        self.done = threading.Lock()
        self.done.acquire()

    def wait(self, timeout_s: float) -> bool:
        """Whether the job finished within ``timeout_s`` (interruptible, as a join is).

        The wait wakes every ``_INTERRUPT_POLL_S``: CPython runs a signal's Python
        handler only between bytecodes, so a Ctrl-C due just before the lock blocked
        would otherwise be raised only at the deadline (a 30 s transfer's, under load)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return self.done.acquire(blocking=False)
            if self.done.acquire(timeout=min(left, _INTERRUPT_POLL_S)):
                return True


class EffectWorkers:
    """Daemon threads that run the runners' effects, reused from one effect to the next.

    Starting a thread per effect cost 7 thread starts per transition (about
    0.45 ms on the H200 host, several ms on a loaded 2-core machine), on the
    critical path. A worker takes one job at a time; an idle one is reused,
    else a new one is started, so an effect never waits for a worker. A worker
    whose effect overran its deadline stays with that effect until it unwinds
    (it is not handed anything else meanwhile), exactly as the thread per
    effect was left to unwind. At most ``keep`` workers wait idle, each for at
    most ``idle_s``; the rest exit. Shared by every runner in the process.
    """

    def __init__(self, keep: int = 8, idle_s: float = 60.0) -> None:
        self._keep = keep
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job]] = []
        self._serial = 0

    def after_fork(self) -> None:
        """In a forked child the workers do not exist: forget them."""
        self._lock = threading.Lock()
        self._idle = []

    def submit(self, name: str, fn: Callable[[], object]) -> Job:
        job = Job(name, fn)
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
            self._serial += 1
            serial = self._serial
        if inbox is None:
            inbox = queue.SimpleQueue()
            inbox.put(job)
            threading.Thread(target=self._work, args=(inbox,), daemon=True,
                             name=f"rolloutcore-effects-{serial}").start()
        else:
            inbox.put(job)
        return job

    def _work(self, inbox: queue.SimpleQueue[Job]) -> None:
        me = threading.current_thread()
        while True:
            try:
                job = inbox.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody picked this worker: leave
                        self._idle.remove(inbox)
                        return
                job = inbox.get()  # picked meanwhile: its job is on the way
            me.name = f"rolloutcore-{job.name}"
            try:
                job.value = job.fn()
            except BaseException as exc:  # handed to the supervising thread
                job.error = exc
            job.fn = _done  # drop the closure (and what it holds) now
            job.done.release()
            del job
            me.name = "rolloutcore-effects-idle"
            with self._lock:
                if len(self._idle) >= self._keep:
                    return
                self._idle.append(inbox)


def _done() -> None:
    return None


WORKERS = EffectWorkers()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=WORKERS.after_fork)
