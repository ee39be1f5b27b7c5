"""What the engine half of ``rolloutcore_gloo`` accepts from an ``init_info``.

The rendezvous a worker is told to join (address, port, the group's shape, how
long it may block) comes in a request body; where it may connect and how long
it may wait are the engine operator's (``ReceiverPolicy``, from the workers'
environment), checked before the worker connects anywhere (``check_init_info``).
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass

from rolloutcore.core.strict import check_int

__all__ = ["MAX_TIMEOUT_ENV", "MAX_WORLD_SIZE", "PEERS_ENV", "GlooInitInfo",
           "ReceiverPolicy", "check_init_info"]

#: The largest group an engine joins (trainer + engine workers): gloo connects every
#: pair of ranks at init, so a forged size would make the engine wait on peers that
#: never come.
MAX_WORLD_SIZE = 1024

PEERS_ENV = "ROLLOUTCORE_GLOO_PEERS"
MAX_TIMEOUT_ENV = "ROLLOUTCORE_GLOO_MAX_TIMEOUT_S"
_DEFAULT_MAX_TIMEOUT_S = 300.0


@dataclass
class GlooInitInfo:
    """Engine-side init info: where the trainer's TCPStore is, and the group's shape."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if not isinstance(self.master_address, str) or not self.master_address:
            raise ValueError("master_address must be a non-empty string")
        for name in ("master_port", "rank_offset", "world_size"):
            check_int(name, getattr(self, name))  # BadInput: a ValueError, as the rest
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port out of range: {self.master_port}")
        if not 0 < self.rank_offset < self.world_size:
            raise ValueError("need 0 < rank_offset < world_size")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)) \
                or not 0 < self.timeout_s <= 86400:
            raise ValueError(f"timeout_s must be in (0, 86400], got {self.timeout_s!r}")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ReceiverPolicy:
    """What the engine half accepts from an ``init_info``, set by the engine's operator.

    ``peers``: networks besides loopback the engine may connect to for the
    rendezvous; ``max_timeout_s``: the longest any rendezvous or broadcast may
    block a worker. Read from the environment of the engine's workers
    (``from_env``), never from a request.
    """

    peers: tuple[Network, ...] = ()
    max_timeout_s: float = _DEFAULT_MAX_TIMEOUT_S

    def __post_init__(self) -> None:
        t = self.max_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 86400:
            raise ValueError(f"max_timeout_s must be in (0, 86400], got {t!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ReceiverPolicy:
        e = os.environ if env is None else env
        peers: list[Network] = []
        for item in e.get(PEERS_ENV, "").split(","):
            if item.strip():
                try:
                    peers.append(ipaddress.ip_network(item.strip(), strict=False))
                except ValueError as exc:
                    raise ValueError(f"{PEERS_ENV}: {item.strip()!r} is not an IP address "
                                     "or network") from exc
        raw = e.get(MAX_TIMEOUT_ENV, "").strip()
        try:
            t = float(raw) if raw else _DEFAULT_MAX_TIMEOUT_S
        except ValueError as exc:
            raise ValueError(f"{MAX_TIMEOUT_ENV} must be a number of seconds, "
                             f"got {raw!r}") from exc
        return cls(tuple(peers), t)

    def allows(self, address: str) -> bool:
        if address == "localhost":
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return ip.is_loopback or any(ip.version == n.version and ip in n for n in self.peers)


def check_init_info(info: GlooInitInfo, policy: ReceiverPolicy) -> None:
    """Refuse an ``init_info`` the engine must not act on, before it connects anywhere.

    A hostname is refused (what it resolves to can change between this check
    and the connect); so is an address outside loopback and the policy's
    peers, a timeout above the policy's cap, a world beyond ``MAX_WORLD_SIZE``.
    """
    if not policy.allows(info.master_address):
        raise ValueError(
            f"master_address {info.master_address!r} refused: this engine joins a "
            f"rendezvous only on loopback or an address in {PEERS_ENV} "
            f"({', '.join(map(str, policy.peers)) or 'unset'}); give an IP address")
    if info.timeout_s > policy.max_timeout_s:
        raise ValueError(f"timeout_s {info.timeout_s} exceeds this engine's cap of "
                         f"{policy.max_timeout_s} s ({MAX_TIMEOUT_ENV})")
    if info.world_size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {info.world_size} exceeds {MAX_WORLD_SIZE}")
