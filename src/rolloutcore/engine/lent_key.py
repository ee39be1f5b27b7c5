"""Lending a launched engine's route key for one lease, and taking it back (#47).

The engine half is the guard's ``engine_key.LENT_KEY`` route; this is the
launcher's half, called by the gateway when it grants an update (``lend``) and
when the lease ends (``revoke``). Both go out with this process's own key
(``engine_key.headers_for``: a launcher's key wins over a lent one), under a
deadline, their failures in the tree (``engine.errors.request``).
"""

from __future__ import annotations

from rolloutcore.engine.errors import request
from rolloutcore.errors import BadInput
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import LENT_KEY, MAX_LEND_S

__all__ = ["lend", "revoke"]


def lend(url: str, seconds: float, *, timeout_s: float = 10.0) -> str | None:
    """Lend a fresh key for ``seconds`` on the engine at ``url`` (it replaces any key
    lent before) and return it; None where this process holds no key of that engine
    (it did not launch it: nothing is guarded). An ``EffectError`` if the engine did
    not take it (then no key is lent)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not 0 < seconds <= MAX_LEND_S:
        raise BadInput(f"a key is lent for 0 < seconds <= {MAX_LEND_S:g}, not {seconds!r}")
    if not engine_key.owns(url):
        return None
    key = engine_key.new_key()
    request("PUT", url.rstrip("/") + LENT_KEY, step="route key lend", timeout_s=timeout_s,
            json_body={"key": key, "seconds": float(seconds)}, mutation_started=False)
    return key


def revoke(url: str, *, timeout_s: float = 10.0) -> None:
    """Take back the key lent on the engine at ``url`` (nothing where this process
    holds no key of it); an ``EffectError`` if the engine did not answer that it did."""
    if engine_key.owns(url):
        request("DELETE", url.rstrip("/") + LENT_KEY, step="route key revoke",
                timeout_s=timeout_s, mutation_started=False)
