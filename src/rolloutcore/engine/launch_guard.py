"""The engine we talk to is the engine we launched, and it never outlives us.

What ``ManagedEngine`` relies on, apart from its launch arguments:

* **Who listens on the port** (``listener_problem``). A launch chooses a free
  port, releases it and hands it to vLLM on a world-readable command line; for
  the seconds vLLM imports, any local process can bind it, answer ``/health``
  and relay to an engine of its own. Before the launch counts as started (and
  before anything is sent to it but ``/health``), every socket listening on
  that port must be held by a process of the launched process's session:
  ``/proc/net/tcp{,6}`` names each listening socket's inode, ``/proc/PID/fd``
  of the session's processes holds it or not. A port held by anyone else is a
  squatter, named by its uid, and the launch fails (and takes another port).
* **The tether** (``Tether``). The engine runs in its own session (so that
  ``stop()`` can kill its whole group), which also means a parent killed -9
  (or by a signal it does not handle) left it running. Beside the engine a
  tiny ``sh`` watches a pipe whose only writer is this process: when this
  process ends, however it ends, the kernel closes the pipe and the watcher
  kills the engine's group. ``release()`` (a normal stop) disarms it first.
  The pipe's write end is not inherited by ``exec``'d children; a ``fork``
  without ``exec`` keeps it open until that child ends too.
* **An exit is noticed at once** (``watch_exit``): the launched process's end
  is an event (a pidfd), not something a health check finds later through
  whoever holds the port by then.

Linux only, as the engine's process handling already is; where ``/proc`` is
missing the listener check says so rather than passing silently.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

__all__ = ["Tether", "listener_problem", "listening_inodes", "session_sockets", "watch_exit"]

_LISTEN = "0A"
# Ignores the signals a terminal or a group kill sends: only the pipe's end (or our
# SIGKILL at release) ends it; then the engine's group is killed if it still runs.
_WATCH = ('trap "" INT TERM HUP QUIT; cat >/dev/null; '
          'kill -0 "-$1" 2>/dev/null && kill -9 "-$1" 2>/dev/null; exit 0')


def listening_inodes(port: int) -> dict[int, int] | None:
    """The sockets listening on TCP ``port`` (any address, v4 and v6): inode -> uid;
    None when ``/proc/net`` cannot be read."""
    out: dict[int, int] = {}
    found = False
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        found = True
        for line in lines:
            f = line.split()
            if len(f) < 10 or f[3] != _LISTEN:
                continue
            with contextlib.suppress(ValueError):
                if int(f[1].rsplit(":", 1)[1], 16) == port:
                    out[int(f[9])] = int(f[7])
    return out if found else None


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid pgrp session ...": comm may hold spaces and parentheses
        rest = stat.rsplit(")", 1)[-1].split()
        with contextlib.suppress(ValueError, IndexError):
            if int(rest[3]) == sid:
                pids.append(int(d))
    return pids


def session_sockets(sid: int) -> set[int]:
    """The inodes of every socket a process of session ``sid`` holds open."""
    inodes: set[int] = set()
    for pid in _session_pids(sid):
        fd_dir = f"/proc/{pid}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"{fd_dir}/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    return inodes


def listener_problem(port: int, sid: int) -> str | None:
    """Why the engine on ``port`` is not provably the one launched as session ``sid``
    (the launched process's pid: it runs in its own session), or None when every
    socket listening on the port is held by that session."""
    listening = listening_inodes(port)
    if listening is None:
        return (f"cannot tell who listens on port {port}: neither /proc/net/tcp nor "
                "/proc/net/tcp6 can be read")
    if not listening:
        return f"nothing listens on port {port}, yet it answered"
    ours = session_sockets(sid)
    others = sorted({uid for ino, uid in listening.items() if ino not in ours})
    if others:
        who = ", ".join(f"uid {u}" for u in others)
        return (f"port {port} is also held by a process outside the launched engine "
                f"(session {sid}) owned by {who}: not the engine that was launched")
    return None


class Tether:
    """A watcher that kills process group ``pgid`` when this process ends (any way)."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        r, w = os.pipe()  # both ends non-inheritable (PEP 446); ``r`` goes to stdin
        try:
            self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
                ["/bin/sh", "-c", _WATCH, "rolloutcore-tether", str(pgid)], stdin=r,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        self._w: int | None = w

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def release(self) -> None:
        """Disarm: the engine is being stopped by its owner. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        w, self._w = self._w, None
        if w is not None:
            with contextlib.suppress(OSError):
                os.close(w)


def watch_exit(pid: int, callback: Callable[[], None], *, name: str) -> bool:
    """Call ``callback()`` (from a daemon thread) as soon as process ``pid`` has exited.

    Through a pidfd, so the process is not reaped (its owner's ``Popen`` still
    reads its status). False where pidfds are missing (then nothing is called).
    """
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return False

    def wait() -> None:
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        callback()

    threading.Thread(target=wait, name=name, daemon=True).start()
    return True
