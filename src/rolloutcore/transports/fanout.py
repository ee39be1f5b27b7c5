"""One weight transfer to N engines: a single gloo group, every tensor broadcast once.

Sending the same weights to N replicas one engine at a time costs N
transfers. ``GlooFanout`` puts the trainer (rank 0) and the workers of every
engine in *one* ``rolloutcore_gloo`` group, so each tensor goes out in one
broadcast that every engine receives, and then finishes each engine with its
*own* target label (``/finish_weight_update``: the target-aware finish, per
engine, since each engine's controller names its own target).

The engine half needs nothing new: ``GlooInitInfo`` already carries a
``rank_offset`` (as vLLM's NCCL engine does), so engine ``i`` joins at
``1 + sum(world sizes of engines before i)`` of a world of ``1 + sum of all``.

A broadcast needs every member. So the round is all-or-repair:

* a member that cannot join the group (its ``/get_world_size`` fails: it
  died, or does not answer) keeps the group from being made; nothing was
  posted to the others, which are reported ``closed`` (free for a
  per-engine round) and the caller sends to them one engine at a time;
* a member whose ``/start_weight_update`` fails keeps the broadcast from
  running at all; nothing was sent to anyone (``sent=False``), and the
  caller sends to the others one engine at a time (``GlooTransport``);
* a member that dies mid-broadcast breaks the collective for everyone. The
  survivors' workers leave the broken ``update_weights`` on their op
  timeout with vLLM's layerwise reload still open and partly written. Each
  survivor is then *closed*: ``/start_weight_update`` + ``/finish_weight_update``
  without a label (finalises the broken reload; the engine stays paused, its
  label unchanged, and it serves nothing until its controller says so), so
  that a fresh per-engine round reloads every layer from scratch
  (``closed=True`` in its result). A fresh round into a reload left open
  would skip the layers the broken round had completed, and partly-written
  ones would be processed half empty.

Every round carries a nonce, so every rank of every engine reports at its finish
what it wrote (``rank_checksums``, as in a per-engine round): the reports are
received per engine, beside that engine's finish, and kept as that engine's
round (``round_of``), so each replica's own validation checks *its* ranks'
writes (``GlooTransport.adopt_round``), a tensor-parallel engine's every rank.
An engine whose reports do not arrive by the deadline has failed the round.

Whatever happens, a result never claims more than it saw: an engine counts as
transferred only when the whole broadcast went out *and* its own
``update_weights`` and ``finish_weight_update`` answered 200. The engine's
validation (checksums, probe) still decides whether the weights are right.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.engine.weight_sync import HttpWeightSync
from rolloutcore.errors import BadInput, TransferError
from rolloutcore.transports import rank_checksums
from rolloutcore.transports.base import (
    check_targets,
    check_timeout,
    check_url,
    local_address_towards,
    preflight,
    remaining,
    run_side,
    world_size_of,
)
from rolloutcore.transports.gloo import (
    BACKEND,
    GlooInitInfo,
    GlooSender,
    GlooUpdateInfo,
    _trainer_store,
    abandon,
)
from rolloutcore.transports.gloo_rounds import Round, receive_reports
from rolloutcore.transports.source import WeightSource

__all__ = ["FanoutResult", "GlooFanout"]


@dataclass(frozen=True)
class FanoutResult:
    """What one engine of a fan-out round ended with.

    ``evidence`` when it received the whole round and finished with its
    label; otherwise ``error`` (its ``mutation_started`` says whether its
    weights may have changed), with ``sent`` (any tensor went out) and
    ``closed`` (a broken reload was finalised, so a fresh per-engine round
    is safe: every layer will be reloaded from scratch).
    """

    url: str
    label: str
    evidence: TransferEvidence | None = None
    error: TransferError | None = None
    sent: bool = False
    closed: bool = False

    @property
    def ok(self) -> bool:
        return self.evidence is not None


class _JoinFailed(TransferError):
    """The group could not be made because of ``failed`` (url -> its error); nothing
    was posted to any other member."""

    def __init__(self, failed: Mapping[str, TransferError]) -> None:
        self.failed = dict(failed)
        first = next(iter(self.failed.values()))
        super().__init__("transfer", f"{', '.join(sorted(self.failed))} could not join the "
                         f"fan-out group: {first}", mutation_started=False)


@dataclass
class _Group:
    urls: tuple[str, ...]
    store: Any
    group: Any
    world_size: int
    #: url -> (its first rank in the group, its world size)
    ranks: dict[str, tuple[int, int]] = field(default_factory=dict)


class GlooFanout(GlooSender):
    """Trainer end of one ``rolloutcore_gloo`` group over several engines.

    ``send_all`` makes the group (no weights change) when it is not exactly
    its engines, then runs one round to every member and returns one ``FanoutResult`` per
    engine, never raising for an engine's failure (bad input raises
    ``BadInput`` before anything is sent). The group is kept for the next
    round until ``invalidate`` (a per-engine send replaced an engine's
    group), ``abort`` or ``close``.
    """

    backend = BACKEND

    def __init__(self, *, op_timeout_s: float = 60.0, close_timeout_s: float = 30.0) -> None:
        super().__init__()
        self.op_timeout_s = check_timeout(op_timeout_s, "op_timeout_s")
        self.close_timeout_s = check_timeout(close_timeout_s, "close_timeout_s")
        self._g: _Group | None = None
        self.last_connect_s: float | None = None
        self._rounds: dict[str, Round] = {}  # engine URL -> its last finished round

    @property
    def members(self) -> tuple[str, ...]:
        return () if self._g is None else self._g.urls

    # -- connect ----------------------------------------------------------------

    def _connect_all(self, urls: tuple[str, ...], deadline: float) -> None:
        self.invalidate()
        t0 = time.monotonic()
        hosts = {urlsplit(u).hostname or "127.0.0.1" for u in urls}
        addrs = {local_address_towards(h) for h in hosts}
        if len(addrs) != 1:
            raise TransferError("transfer", f"no one trainer address reaches every engine "
                                f"({sorted(addrs)}): use per-engine sends",
                                mutation_started=False)
        addr = addrs.pop()
        f_ws = [run_side(lambda u=u: HttpWeightSync(u).get_world_size(  # type: ignore[misc]
            timeout_s=remaining(deadline)), "world-size") for u in urls]
        try:
            self.wait(f_ws, deadline, "get_world_size", mutation_started=False)
        except TransferError as exc:
            # Which members failed (the others answered, or would have): until here
            # nothing was posted to anyone. Each failed one's own error names it.
            for f in f_ws:
                with contextlib.suppress(Exception):
                    f.exception(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            failed: dict[str, TransferError] = {}
            for u, f in zip(urls, f_ws, strict=True):
                err = f.exception() if f.done() else None
                if err is not None:
                    failed[u] = self.classify(err, "get_world_size", False)
            if not failed or len(failed) == len(urls):
                raise
            raise _JoinFailed(failed) from exc
        sizes = [world_size_of(f.result(), u) for u, f in zip(urls, f_ws, strict=True)]
        world = 1 + sum(sizes)
        store = _trainer_store(addr, world, remaining(deadline))
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        infos = [GlooInitInfo(addr, int(store.port), off, world, self.op_timeout_s)
                 for off in offsets]
        f_init = [run_side(lambda u=u, i=i: HttpWeightSync(  # type: ignore[misc]
            u).init_weight_transfer_engine(asdict(i), timeout_s=remaining(deadline)), "init")
            for u, i in zip(urls, infos, strict=True)]
        group = self.rendezvous(store, world, addr, f_init, deadline)
        self._g = _Group(urls, store, group, world,
                         {u: (off, n) for u, off, n in zip(urls, offsets, sizes, strict=True)})
        self.last_connect_s = time.monotonic() - t0

    # -- send -------------------------------------------------------------------

    def send_all(self, targets: Sequence[tuple[str, str]], source: WeightSource, *,
                 timeout_s: float, expected_manifest_digest: str | None = None,
                 ) -> dict[str, FanoutResult]:
        """One round to every ``(url, label)``: start all, broadcast once, finish each.

        Connects (or reconnects) when the group is not exactly these engines.
        Returns a result per engine; see the module docstring for how a
        failure of one engine is reported for each of the others.
        """
        labels = check_targets(targets)
        urls = tuple(labels)
        t = check_timeout(timeout_s)
        try:
            preflight(source, expected_manifest_digest)   # BadInput for anything else
        except TransferError as exc:
            return {u: FanoutResult(u, labels[u], error=exc) for u in urls}
        t0 = time.monotonic()
        deadline = t0 + t
        self._enter()
        try:
            if self._g is None or set(self._g.urls) != set(urls):
                try:
                    self._connect_all(urls, deadline)
                except _JoinFailed as exc:
                    # The members that answered were never asked for anything: a
                    # per-engine round to each is safe (``closed``).
                    return {u: FanoutResult(u, labels[u], error=exc.failed[u])
                            if u in exc.failed else FanoutResult(u, labels[u], error=exc,
                                                                 closed=True)
                            for u in urls}
                except TransferError as exc:
                    return {u: FanoutResult(u, labels[u], error=exc) for u in urls}
            assert self._g is not None
            return self._round(self._g, labels, source, t0, deadline)
        finally:
            self._busy = False

    def _round(self, g: _Group, labels: Mapping[str, str], source: WeightSource, t0: float,
               deadline: float) -> dict[str, FanoutResult]:
        nonce = secrets.token_hex(8)
        info = dataclasses.replace(GlooUpdateInfo.of(source), nonce=nonce)
        for u in g.urls:
            self._rounds.pop(u, None)
        urls = g.urls
        started = {u: run_side(lambda u=u: HttpWeightSync(u).start_weight_update(  # type: ignore[misc]
            timeout_s=remaining(deadline)), "start") for u in urls}
        failed: dict[str, TransferError] = {}
        for u, f in started.items():
            try:
                self.wait([f], deadline, "start_weight_update", mutation_started=True,
                          refusal_is_safe=True)
            except TransferError as exc:
                failed[u] = exc
        if failed:
            # A broadcast needs every member: none is run, nothing is sent to anyone.
            # The members that did start hold an empty session; it is closed so a
            # per-engine round can start.
            self._drop()
            out = {u: FanoutResult(u, labels[u], error=e) for u, e in failed.items()}
            for u in urls:
                if u not in failed:
                    closed = self._close_session(u)
                    out[u] = FanoutResult(u, labels[u], error=TransferError(
                        "transfer", f"fan-out not run: {', '.join(sorted(failed))} did not "
                        "start", mutation_started=not closed), closed=closed)
            return out
        f_http = {u: run_side(lambda u=u: HttpWeightSync(u).update_weights(  # type: ignore[misc]
            asdict(info), timeout_s=remaining(deadline)), "update") for u in urls}
        f_send = run_side(lambda: self.broadcast(g.group, source), "broadcast")
        send_error: TransferError | None = None
        sent: dict[str, Any] = {}
        try:
            self.wait([f_send], deadline, "broadcast", mutation_started=True)
            sent = f_send.result()
        except TransferError as exc:
            send_error = exc
            self._drop()
        results: dict[str, FanoutResult] = {}
        # Every member's update_weights answer (a broken broadcast: on its op timeout).
        wait_until = min(deadline, time.monotonic() + self.op_timeout_s + 10.0)
        for u in urls:
            try:
                self.wait([f_http[u]], wait_until, "update_weights", mutation_started=True)
            except TransferError as exc:
                results[u] = FanoutResult(u, labels[u], error=exc, sent=True)
        if send_error is not None:
            for u in urls:
                if u not in results:
                    results[u] = FanoutResult(u, labels[u], error=send_error, sent=True)
        f_fin = {u: run_side(lambda u=u: HttpWeightSync(u).finish_weight_update(  # type: ignore[misc]
            labels[u], timeout_s=remaining(deadline)), "finish")
            for u in urls if u not in results}
        # Every rank of each finishing engine reports what it wrote, over the group,
        # while its finish runs: received per engine (one silent engine does not hold
        # up the others' reports).
        f_rep = {u: run_side(lambda u=u: receive_reports(  # type: ignore[misc]
            g.group, range(g.ranks[u][0], g.ranks[u][0] + g.ranks[u][1])), "reports")
            for u in f_fin}
        broken = False
        for u, f in f_fin.items():
            try:
                self.wait([f, f_rep[u]], deadline, "finish_weight_update",
                          mutation_started=True)
            except TransferError as exc:
                results[u] = FanoutResult(u, labels[u], error=exc, sent=True)
                broken = True  # a report may still be pending in the group
            else:
                off = g.ranks[u][0]
                self._rounds[u] = Round(nonce, sent, [(r - off + 1, rep)
                                                       for r, rep in f_rep[u].result()],
                                      source)
                results[u] = FanoutResult(u, labels[u], evidence=TransferEvidence(
                    completed=True, mutation_started=True, backend=BACKEND,
                    tensors=len(info.names), bytes=source.nbytes, finish_label=labels[u],
                    elapsed_s=time.monotonic() - t0,
                    unverified=(f"one broadcast to {len(urls)} engines",)))
        if broken:
            self._drop()
        for u, r in list(results.items()):
            if r.error is not None and u not in f_fin:
                # update_weights failed: close the broken reload for a fresh round.
                results[u] = FanoutResult(u, r.label, error=r.error, sent=True,
                                          closed=self._close_session(u))
        return results

    def round_of(self, url: str) -> tuple[str, dict[str, Any],
                                          list[tuple[int, rank_checksums.RankReport]]] | None:
        """What the last round wrote on ``url``'s ranks: (nonce, tensors as sent, reports
        numbered from 1 within the engine), for its replica's transport
        (``GlooTransport.adopt_round``); None when that engine did not finish it."""
        rnd = self._rounds.get(url)
        return None if rnd is None else (rnd.nonce, rnd.sent, list(rnd.reports))

    def _close_session(self, url: str) -> bool:
        """Finalise whatever reload a failed round left open on ``url``; True when done.

        vLLM ends its worker's session when ``update_weights`` raises, but the
        gloo engine half keeps its layerwise reload open; a start + finish
        (no label: the engine's label is not changed) closes it.
        """
        t = self.close_timeout_s
        sync = HttpWeightSync(url)
        try:
            f = run_side(lambda: sync.start_weight_update(timeout_s=t), "close-start")
            self.wait([f], time.monotonic() + t + 1, "close start", mutation_started=True)
            f = run_side(lambda: sync.finish_weight_update(timeout_s=t), "close-finish")
            self.wait([f], time.monotonic() + t + 1, "close finish", mutation_started=True)
        except TransferError:
            return False
        return True

    # -- teardown ---------------------------------------------------------------

    def invalidate(self) -> None:
        """Forget the group (an engine joined another one since): the next round reconnects."""
        self._drop()

    def _drop(self) -> None:
        g, self._g = self._g, None
        abandon(g)  # a collective may still be pending in it

    def abort(self) -> None:
        super().abort()
        g, self._g = self._g, None
        abandon(g, abort=True)

    def close(self) -> None:
        self._drop()

    def __repr__(self) -> str:
        return f"GlooFanout(members={list(self.members)!r})"


def _check_urls(urls: Sequence[str]) -> tuple[str, ...]:
    if isinstance(urls, str) or not isinstance(urls, Sequence) or not urls:
        raise BadInput("urls must be a non-empty sequence of engine URLs")
    clean = tuple(check_url(u) for u in urls)
    if len(set(clean)) != len(clean):
        raise BadInput(f"an engine appears twice: {list(clean)}")
    return clean

