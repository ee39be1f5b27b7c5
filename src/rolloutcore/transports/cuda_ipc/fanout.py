"""One trainer buffer into N engines on one GPU: the fleet's fan-out for ``rc_cuda_ipc``.

With ``rc_cuda_ipc`` every engine's workers map the trainer's one shared
buffer (one IPC handle, created once) and copy out of it themselves. A fleet
update therefore needs no broadcast: the weights are staged **once** (the
trainer's adopted ``PackedWeights`` as is, or one staging copy), the
trainer's block checksum of what is sent is computed **once**, and each
engine's own update session (``start`` / ``update_weights`` / ``finish``)
runs at the same time as the others', through the replica's own
``CudaIpcTransport``. Each replica's validation then compares its workers'
checksum (written into that transport's own result slot) with the shared
trainer checksum, exactly as for one engine: the fan-out changes where the
bytes are staged and hashed, never what is checked.

``CudaIpcFanout`` is the fleet coordinator's ``FanoutTransport``
(``fleet.model``): ``send_all`` returns one ``FanoutResult`` per engine, and
a result never claims more than that engine's own session answered. There
is no group to rebuild after a per-engine send (``invalidate`` does
nothing) and no broken collective to close, so ``closed`` is never set: an
engine whose session failed is classified by its own error
(``mutation_started``), and a stuck session is aborted at the round's
deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports.base import check_targets, check_timeout, check_url
from rolloutcore.transports.fanout import FanoutResult

__all__ = ["CudaIpcFanout"]


class CudaIpcFanout:
    """``FanoutTransport`` over the replicas' own per-engine ``CudaIpcTransport``s.

    ``transports``: engine URL -> the transport that replica's adapter uses
    (its result slot and sent checksum are what that replica's validation
    reads, so the fan-out must drive the same object).
    """

    def __init__(self, transports: Mapping[str, Any]) -> None:
        if not isinstance(transports, Mapping) or len(transports) < 1:
            raise BadInput("transports must map engine URLs to their transports")
        tr: dict[str, Any] = {}
        for url, t in transports.items():
            u = check_url(url)
            if u in tr:
                raise BadInput(f"engine {u} given twice")
            for attr in ("send", "abort", "precompute_checksum"):
                if not callable(getattr(t, attr, None)):
                    raise BadInput(f"the transport of {u} has no {attr}()")
            tr[u] = t
        if len({id(t) for t in tr.values()}) != len(tr):
            raise BadInput("each engine needs its own transport (its result slot)")
        self.transports = tr
        self.last_stage_s = 0.0
        self.last_checksum_s = 0.0
        self.last_round_s = 0.0
        self._lock = threading.Lock()
        self._pre: tuple[Any, list[int]] | None = None

    @property
    def members(self) -> tuple[str, ...]:
        return tuple(self.transports)

    def precompute(self, packed: Any) -> float:
        """Hash ``packed`` once now (while the engines serve) for the next round.

        The next ``send_all`` of this buffer hands the values to every
        transport instead of hashing per engine. Returns the seconds it took.
        """
        first = next(iter(self.transports.values()))
        t = time.monotonic()
        values = packed.checksum(first.checksum_impl)
        self.last_checksum_s = time.monotonic() - t
        with self._lock:
            self._pre = (packed, values)
        return self.last_checksum_s

    def send_all(self, targets: Sequence[tuple[str, str]], source: Any, *,
                 timeout_s: float) -> dict[str, FanoutResult]:
        """Every target's own session at once, out of one staged buffer; url -> result."""
        budget = check_timeout(timeout_s)
        labels = check_targets(targets)
        for url in labels:
            if url not in self.transports:
                raise BadInput(f"{url} is not one of this fan-out's engines")
        t0 = time.monotonic()
        urls = list(labels)
        first = self.transports[urls[0]]
        try:
            packed = first.stage(source)   # one staging (none for an adopted buffer)
        except (BadInput, TransferError):
            raise
        except Exception as exc:  # a source that cannot be staged: nothing was sent
            raise BadInput(f"the source cannot be staged: {type(exc).__name__}: {exc}") \
                from exc
        self.last_stage_s = time.monotonic() - t0
        with self._lock:
            pre, self._pre = self._pre, None
        if pre is None or pre[0] is not packed:
            t = time.monotonic()
            values = packed.checksum(first.checksum_impl)
            self.last_checksum_s = time.monotonic() - t
        else:
            values = pre[1]
        for u in urls:
            self.transports[u].precompute_checksum(packed, values=values)
        box: dict[str, FanoutResult] = {}

        def one(url: str) -> None:
            try:
                ev = self.transports[url].send(url, labels[url], packed, timeout_s=budget)
                box[url] = FanoutResult(url, labels[url], evidence=ev, sent=True)
            except TransferError as exc:
                box[url] = FanoutResult(url, labels[url], error=exc,
                                        sent=exc.mutation_started)
            except Exception as exc:  # an unexpected failure: its weights may have changed
                box[url] = FanoutResult(url, labels[url], error=TransferError(
                    "transfer", f"{type(exc).__name__}: {exc}", mutation_started=True),
                    sent=True)

        threads = [threading.Thread(target=one, args=(u,), name=f"rc-ipc-fanout-{i}",
                                    daemon=True) for i, u in enumerate(urls)]
        for th in threads:
            th.start()
        deadline = t0 + budget
        for th in threads:
            th.join(max(0.0, deadline - time.monotonic()))
        late = [u for u in urls if u not in box]
        for u in late:
            self.transports[u].abort()
        for th in threads:
            th.join(5.0)
        for u in urls:
            if u not in box:
                box[u] = FanoutResult(u, labels[u], error=TransferError(
                    "transfer", f"no answer within the round's {budget:g} s deadline "
                    "(aborted)", mutation_started=True), sent=True)
        self.last_round_s = time.monotonic() - t0
        return {u: box[u] for u in urls}

    def invalidate(self) -> None:
        """Nothing to rebuild: every engine keeps its own mapping of the one buffer."""

    def abort(self) -> None:
        for t in self.transports.values():
            t.abort()

    def close(self) -> None:
        """The transports belong to their replicas, which close them."""

    def __repr__(self) -> str:
        return f"CudaIpcFanout({len(self.transports)} engines)"
