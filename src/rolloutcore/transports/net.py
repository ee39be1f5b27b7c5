"""Socket helpers the transports need, with no dependency beyond the standard library.

Kept this low so that a transport choosing a rendezvous port does not import
the process manager (``engine.process`` re-exports ``free_port`` for
its own callers).
"""

from __future__ import annotations

import socket

__all__ = ["free_port", "local_address_towards"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the caller retries if it is taken since)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def local_address_towards(host: str) -> str:
    """The local address the engine at ``host`` can reach us on (loopback stays loopback)."""
    if host in ("localhost", "127.0.0.1", "::1") or host.startswith("127."):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP connect sends nothing; it picks the route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
