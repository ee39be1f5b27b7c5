"""A fan-out transport over simulated engines: the fleet's fast tests.

``FakeFanout`` does to several ``FakeEngine``s what ``transports.fanout.GlooFanout``
does to several vLLMs: every member starts, every tensor is written once to
all of them (one "broadcast"), then each finishes with its own label; it
answers with the same ``FanoutResult`` per engine. ``die_during`` kills one
member halfway through the broadcast: the round then breaks for everyone, and
each survivor's open session is closed (``closed=True``), as the real one
does, so that a per-engine resend is safe.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.errors import BadInput, RolloutCoreError, TransferError
from rolloutcore.testing.fake import FakeAdapter, FakeWeights
from rolloutcore.transports.fanout import FanoutResult

__all__ = ["FakeFanout"]


class FakeFanout:
    """``url -> FakeAdapter``; ``rounds`` counts the broadcasts that ran."""

    def __init__(self, adapters: Mapping[str, FakeAdapter]) -> None:
        if not adapters:
            raise BadInput("a fan-out needs engines")
        self.adapters = dict(adapters)
        self.rounds = 0
        self.broadcasts = 0          # tensors written once to every member
        self.die_during: str | None = None
        self.invalidated = 0

    def send_all(self, targets: Sequence[tuple[str, str]], source: object, *,
                 timeout_s: float) -> dict[str, FanoutResult]:
        if not isinstance(source, FakeWeights):
            raise BadInput("the fake fan-out sends FakeWeights")
        t0 = time.monotonic()
        labels = dict(targets)
        engines = {u: self.adapters[u].engine for u in labels}
        out: dict[str, FanoutResult] = {}
        started: list[str] = []
        for u, e in engines.items():
            try:
                e.start_update()
                started.append(u)
            except RolloutCoreError as exc:
                out[u] = FanoutResult(u, labels[u], error=TransferError(
                    "transfer", f"start failed: {exc}", mutation_started=False))
        if out:
            for u in started:
                engines[u].finish_update(engines[u].label)
                out[u] = FanoutResult(u, labels[u], error=TransferError(
                    "transfer", "fan-out not run", mutation_started=False), closed=True)
            return out
        self.rounds += 1
        items = sorted(source.tensors.items())
        for i, (name, data) in enumerate(items):
            if self.die_during is not None and i >= len(items) // 2:
                dead, self.die_during = self.die_during, None
                engines[dead].kill()
                for u, e in engines.items():
                    if u == dead:
                        out[u] = FanoutResult(u, labels[u], error=TransferError(
                            "transfer", "engine died mid-broadcast"), sent=True)
                    else:
                        e.finish_update(e.label)  # close the broken session, label kept
                        out[u] = FanoutResult(u, labels[u], error=TransferError(
                            "transfer", f"broadcast broke: {dead} died"), sent=True,
                            closed=True)
                return out
            for e in engines.values():
                e.load(name, data)
            self.broadcasts += 1
        for u, e in engines.items():
            e.finish_update(labels[u])
            out[u] = FanoutResult(u, labels[u], evidence=TransferEvidence(
                completed=True, mutation_started=True, backend="fake-fanout",
                tensors=len(items), bytes=sum(len(d) for _, d in items),
                finish_label=labels[u], elapsed_s=time.monotonic() - t0))
        return out

    def invalidate(self) -> None:
        self.invalidated += 1

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass
