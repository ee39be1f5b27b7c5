"""The fleet coordinator: N engines, each under its own unchanged controller, as one policy.

Each replica is what ``EngineSession`` is for one engine: an adapter, a
controller, a runner and a journal of its own. The coordinator sits above
them and drives the fleet's own machine, the replica pool
(``core.pool.ReplicaTable``), in the same shell every machine runs in
(``control.shell``): its decisions are made under the shell's lock, its
records go to the one journal format (``control.journal.Journal``) after the
lock is released, and the router reads the pool's published snapshot
without taking any lock (``view``). It adds what only a fleet has:

* **one takeover per replica**: each engine joins fleet version 0 only
  through the same verified takeover as ``serve --upstream``
  (``runner.take_over``: awake, not paused, its label, the probe of the
  declared checkpoint, to the fleet's verification floor); one that cannot
  be verified stays out of the pool;
* **updates across replicas**, driven through each runner's two-phase form
  (``open_update`` -> the transfer -> ``report_transfer`` -> ``close_update``),
  so every engine still goes through its own whole verified transition:

  - ``synchronous``: admission closes fleet-wide (the router answers 503),
    every ready replica drains and pauses, receives the same weights (one
    fan-out broadcast, or per-engine sends), invalidates, validates and
    resumes; the fleet version is published only when at least ``quorum``
    (default: all) passed; the others are fenced (tainted: recovered;
    untouched: kept on the old version). Below the quorum nothing is
    published, and replicas that passed are withheld until they are back on
    a published version;
  - ``rolling``: waves of per-engine updates, each wave taken out of the pool
    only while at least ``min_serving`` replicas stay in it; the new version
    is published when the first wave passes, so two versions serve during
    the roll and every answer says which (the router admits on a replica
    only at the engine version it routed for);

  whatever goes wrong inside an update (an exception, a journal that
  failed), no replica is left in it: every one that is still UPDATING when
  the update ends is decided from its engine (its open transition
  classified from the engine's own write counters, then kept, withheld or
  fenced);
* **supervision** (``supervise_once``, or the supervisor thread): every
  replica's health is checked at once (concurrently); one whose engine
  taints, dies, restarts, refuses connections or whose controller failed
  closed leaves the pool; it is recovered on its own (its ``Recoverer``: a
  replacement process on a known checkpoint, verified), and rejoins only
  after it was verified on the fleet's current version (recovered on it, or
  updated onto it with the retained weights).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rolloutcore.control.journal import Journal, read_journal
from rolloutcore.control.port import ExpectationTaker
from rolloutcore.control.runner import UpdateOutcome
from rolloutcore.control.shell import Shell
from rolloutcore.core.evidence import PreflightEvidence, TransferEvidence
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.pool import (
    IN_POOL,
    FleetAbandon,
    FleetUpdateBegin,
    FleetVersion,
    Outcome,
    PoolView,
    ReplicaEvent,
    ReplicaOutcome,
    ReplicaState,
    ReplicaTable,
    Strategy,
    WaveBegin,
    WaveEnd,
    decide_synchronous,
    plan_waves,
)
from rolloutcore.core.records import Record, Taint, Transition
from rolloutcore.core.speculative import engine_draft_of, engine_draft_refusal
from rolloutcore.core.versions import VerificationLevel, WeightIdentity, generation_of
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    InvalidTransition,
    JournalError,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.fleet.model import (
    TRANSFERS,
    FanoutTransport,
    FleetConfig,
    FleetUpdateFailed,
    FleetUpdateResult,
    FleetWeights,
    Replica,
)
from rolloutcore.fleet.routing import FleetView, ReplicaView

__all__ = ["FleetCoordinator"]

E, S = ReplicaEvent, ReplicaState
_KEEP: Any = object()
#: Events that put a replica in the pool on the engine version its controller serves.
_ENTERS = frozenset({E.BOOTSTRAPPED, E.PASSED, E.REJOINED})


@dataclass
class _Member:
    """Working memory of one replica (not durable: the pool's table holds that)."""

    replica: Replica
    busy: bool = False              # a recovery or rejoin runs on it
    issued: set[str] = field(default_factory=set)
    suspect: bool = False           # the data plane saw its engine refuse a connection
    rebind: bool = False            # recovered, but not yet rebound to the new process
    out: UpdateOutcome | None = None  # its part of the fleet update running now


T = TypeVar("T")


def _outcome_of(uf: UpdateFailed) -> Outcome:
    return Outcome.NO_MUTATION if uf.classification == "no_mutation" and \
        uf.state == State.READY.value else Outcome.AMBIGUOUS


class FleetCoordinator:
    """Runs fleet updates over ``replicas`` and keeps the pool; see the module docstring.

    ``fanout``: a ``FanoutTransport`` over the replicas' ``fanout_url``s
    (synchronous updates then broadcast once). ``journal_path``: the pool's
    journal (the one journal format; memory only without one), ``journal_keep``
    how many of its records memory holds (``None``: all).
    """

    def __init__(self, replicas: Sequence[Replica], *, config: FleetConfig | None = None,
                 fanout: FanoutTransport | None = None, journal_path: str | None = None,
                 journal_keep: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(replicas, (str, bytes)) or not replicas:
            raise BadInput("a fleet needs at least one replica")
        names = [r.name for r in replicas if isinstance(r, Replica)]
        if len(names) != len(replicas):
            raise BadInput("replicas must be Replica objects")
        if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
            raise BadInput(f"replica names must be distinct non-empty strings: {names}")
        if fanout is not None and not isinstance(fanout, FanoutTransport):
            raise BadInput("fanout must implement send_all/invalidate/abort")
        self.config = config or FleetConfig()
        self.fanout = fanout
        self.journal = Journal(journal_path, keep=journal_keep)
        # A journal that holds records is a previous gateway's: its versions are
        # replayed (labels never repeat), and ``bootstrap`` restores onto them.
        earlier = (read_journal(journal_path) if journal_path is not None
                   and os.path.exists(journal_path) and os.path.getsize(journal_path)
                   else [])
        try:
            self._table = ReplicaTable.replay(earlier, names, now=clock())
        except BadInput:
            self.journal.close()
            raise
        self._shell: Shell[ReplicaTable, PoolView] = Shell(
            self._table, ReplicaTable.view, clock=clock, listener=self.journal.listener)
        self._members: dict[str, _Member] = {r.name: _Member(r) for r in replicas}
        self._order = list(names)
        self._mem = threading.Lock()    # working memory (busy flags); nothing waits under it
        self._update_lock = threading.Lock()  # one update at a time
        self._payloads: dict[int, FleetWeights] = {}
        self._update_id = self._table.last_update_id
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._heals: dict[str, threading.Thread] = {}
        self._restored = False
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(names)),
                                        thread_name_prefix="rc-fleet")
        for r in replicas:
            r.controller.add_listener(self._engine_record)

    # ------------------------------------------------------------------ queries
    @property
    def replicas(self) -> dict[str, Replica]:
        return {n: m.replica for n, m in self._members.items()}

    @property
    def pool(self) -> PoolView:
        """The pool as its last decision left it (read without any lock)."""
        return self._shell.view

    @property
    def versions(self) -> tuple[FleetVersion, ...]:
        return self._shell.view.versions

    @property
    def newest(self) -> FleetVersion | None:
        return self._shell.view.newest

    @property
    def failed_closed(self) -> str | None:
        return self._shell.view.failed_closed

    def state_of(self, name: str) -> ReplicaState:
        return self._shell.view.entry(name).state

    def generation_of(self, name: str) -> int | None:
        return self._shell.view.entry(name).generation

    def serving(self) -> list[str]:
        """The replicas the router may choose from now."""
        return [r.name for r in self.view().replicas if r.in_pool]

    def view(self) -> FleetView:
        """What the router needs, from published snapshots only (no lock is taken).

        A replica is routable when the pool has it SERVING a fleet version and
        its controller is READY, not failed closed, on exactly the engine
        version it entered the pool with.
        """
        pool = self._shell.view
        reps: list[ReplicaView] = []
        for e in pool.replicas:
            if e.state is S.REMOVED:
                continue
            c = self._members[e.name].replica.controller.view
            ok = (e.in_pool and c.state is State.READY and c.failed_closed is None
                  and c.committed is not None and c.committed == e.engine_version)
            reps.append(ReplicaView(e.name, ok, e.generation, c.load, e.engine_version))
        closed = pool.closed
        if pool.failed_closed is not None:
            closed = f"the fleet failed closed ({pool.failed_closed})"
        return FleetView(tuple(reps), None if pool.newest is None else pool.newest.generation,
                         {v.label: v.generation for v in pool.versions}, closed,
                         self.config.retry_after_s)

    def status(self) -> dict[str, Any]:
        pool = self._shell.view
        routable = {r.name: r.in_pool for r in self.view().replicas}
        reps = []
        served: dict[str, int] = {}
        for e in pool.replicas:
            m = self._members[e.name]
            c = m.replica.controller.view
            ver = pool.version(e.generation)
            if routable.get(e.name) and ver is not None:
                served[ver.label] = served.get(ver.label, 0) + 1
            reps.append({
                "name": e.name, "url": m.replica.url, "state": e.state.value,
                "in_pool": bool(routable.get(e.name)), "fleet_generation": e.generation,
                "fleet_label": None if ver is None else ver.label,
                "engine_state": c.state.value,
                "engine_version": None if c.committed is None else c.committed.to_dict(),
                "engine_failed_closed": c.failed_closed,
                "load": c.load, "reason": e.reason, "busy": m.busy})
        return {
            "replicas": reps,
            "serving": sum(1 for r in reps if r["in_pool"]),
            "newest": None if pool.newest is None else pool.newest.to_dict(),
            "published": [v.to_dict() for v in pool.versions],
            "versions_served": served,
            "admission_closed": pool.closed,
            "failed_closed": pool.failed_closed,
            "update": None if pool.update is None else dict(pool.update),
        }

    def _each(self, fn: Callable[[_Member], T], members: Sequence[_Member]) -> list[T]:
        """``fn`` on every member at once, every one run to its end before anything is
        raised: a replica whose part failed unexpectedly never leaves another one's
        still running behind the update's end (its transition would stay open)."""
        futures = [self._pool.submit(fn, m) for m in members]
        out: list[T] = []
        err: BaseException | None = None
        for f in futures:
            try:
                out.append(f.result())
            except BaseException as exc:  # raised below, once all have ended
                err = err or exc
        if err is not None:
            raise err
        return out

    def _member(self, name: str) -> _Member:
        m = self._members.get(name)
        if m is None:
            raise BadInput(f"no replica named {name!r} in this fleet")
        return m

    def on_change(self, callback: Callable[[], None]) -> None:
        """Called (from any thread, never under a lock) when the pool or an engine changes:
        after every decision of the pool, and every transition of a replica's engine."""
        self._shell.watch(callback)

        def listener(rec: Record) -> None:
            if type(rec) is Transition:
                with contextlib.suppress(Exception):  # a watcher cannot break an engine
                    callback()

        for m in self._members.values():
            m.replica.controller.add_listener(listener)

    def _engine_record(self, rec: Record) -> None:
        """A replica's own record: a taint (or its controller failing) wakes the supervisor."""
        if type(rec) is Taint or (type(rec) is Transition and rec.after is State.TAINTED):
            self._wake.set()

    # ------------------------------------------------------------------ the pool's decisions
    def _move(self, m: _Member, event: ReplicaEvent, *, generation: Any = _KEEP,
              reason: str = "", only_from: ReplicaState | None = None) -> None:
        """One replica's pool event, recorded; the engine version it serves, when it enters.

        A journal that fails here does not stop the move (it is applied, the
        pool fails closed and refuses what comes next): a replica must always
        be able to leave an update.
        """
        kw: dict[str, Any] = {"reason": reason, "only_from": only_from}
        if generation is not _KEEP:
            kw["generation"] = generation
            if generation is None:
                kw["engine_version"] = None
        if event in _ENTERS:
            kw["engine_version"] = m.replica.controller.committed
        # Applied in memory even when the journal failed; the pool is failed closed then.
        with contextlib.suppress(JournalError):
            self._shell.run(self._table.move, m.replica.name, event, **kw)
        self._wake.set()

    def _record(self, fn: Callable[..., None], *args: Any) -> None:
        """A record of the running update (its outcome may not become durable: the pool
        then fails closed and the update decides nothing more)."""
        with contextlib.suppress(JournalError):
            self._shell.run(fn, *args)

    # ------------------------------------------------------------------ bootstrap
    def bootstrap(self, identity: WeightIdentity, *, weights: FleetWeights | None = None,
                  label: str = "fleet-0", bootstrapped: bool = False) -> FleetVersion:
        """Take every replica over on ``identity`` (fleet version 0, ``label``), verified.

        Each runner takes its engine over as ``serve --upstream`` does
        (``take_over``: awake, not paused, its label and ``weights.probe``, to
        ``weights.min_verification``), unless ``bootstrapped`` (done already:
        only checked). A replica that cannot be verified joins FENCED, with
        the reason. ``weights`` is retained for rejoins.

        On a restored pool (the journal held a previous gateway's records) it
        is the restart, as ``serve --journal`` restarts one gateway: each
        replica's controller, restored from its own journal, takes its new
        engine over through ``replica.adopt`` (the journal's engine is gone:
        the new one is accepted as its replacement, fresh from the
        checkpoint, verified like a recovery, on a new engine version), and
        the replicas serve the newest fleet version if they were verified to
        hold its weights, else a new fleet version for what they hold
        (``label``, or the next ``fleet-<generation>``): ``FleetRestore``.
        """
        _check_fleet_label(label)
        if not isinstance(identity, WeightIdentity):
            raise BadInput("identity must be a WeightIdentity")
        if weights is not None and not isinstance(weights, FleetWeights):
            raise BadInput("weights must be FleetWeights")
        level = weights.min_verification if weights is not None else VerificationLevel.DECLARED
        probe = weights.probe if weights is not None else None
        restoring = self._table.replayed > 0
        if self._shell.view.newest is not None and (not restoring or self._restored):
            raise BadInput("the fleet is already bootstrapped")
        members = [self._members[n] for n in self._order]

        def one(m: _Member) -> str | None:
            r = m.replica
            if restoring and r.controller.state is State.UNINITIALIZED:
                # Its engine versions would start again at rc-0: labels the journal's
                # trajectories already name, for other weights.
                return ("the pool's journal is restored but this replica has no journal of "
                        "its own: its engine versions cannot continue")
            try:
                if not bootstrapped:
                    r.runner.take_over(identity, probes=probe, min_verification=level,
                                       recoverer=r.adopt)
                c = r.controller
                ident = c.identity
                if c.state is not State.READY or ident is None or \
                        not ident.same_weights(identity):
                    return f"engine {c.state.value}, not READY on the fleet's identity"
                if ident.verification < level:
                    return (f"the takeover reached {ident.verification.wire}, the fleet "
                            f"requires {level.wire}")
            except RolloutCoreError as exc:
                return f"takeover refused: {exc}"
            return None

        problems = self._each(one, members)
        # The version is the weights as the takeovers verified them (the first that did).
        verified = next((m.replica.controller.identity for m, p in zip(
            members, problems, strict=True) if p is None), None) or identity
        if restoring:
            newest = self._shell.view.newest
            assert newest is not None
            version = newest
            if not verified.same_weights(newest.identity):
                gen = newest.generation + 1
                used = {v.label for v in self._shell.view.versions}
                version = FleetVersion(gen, label if label not in used else f"fleet-{gen}",
                                       verified, None)
            self._shell.run(self._table.restore, version)
            self._restored = True
        else:
            version = FleetVersion(0, label, verified, None)
            self._shell.run(self._table.bootstrap, version)
        if weights is not None:
            self._payloads[version.generation] = weights
        for m, p in zip(members, problems, strict=True):
            if p is None:
                self._move(m, E.BOOTSTRAPPED, generation=version.generation)
            else:
                self._move(m, E.FAILED, generation=None, reason=p)
        return version

    # ------------------------------------------------------------------ updates
    def update(self, weights: FleetWeights, *, strategy: Strategy | str = Strategy.SYNCHRONOUS,
               label: str | None = None, owner: str = "trainer", quorum: int | None = None,
               min_serving: int | None = None, wave_size: int | None = None,
               transfer: str | None = None,
               fanout: FanoutTransport | None = None) -> FleetUpdateResult:
        """Install ``weights`` across the fleet; returns the result or raises.

        ``fanout``: this synchronous update's transfer, whatever the fleet's own
        is: every replica opened takes part in it, never a per-engine send (a
        trainer that sends the weights itself through the gateway,
        ``fleet.native``). ``weights.payload`` ``None``: nothing is staged (each
        replica's adapter expects only what it checks without a reference) and
        the weights are not retained (a fenced replica rejoins with the next
        update, not with these).

        Bad input and updates that cannot keep their promises (a quorum above
        the ready replicas, a wave that would break ``min_serving``) are
        refused before anything changes (``BadInput`` / ``UpdateRefused``);
        ``FleetUpdateFailed`` when the update ran and published nothing.
        """
        if not isinstance(weights, FleetWeights):
            raise BadInput("weights must be FleetWeights")
        try:
            strat = Strategy(strategy)
        except ValueError:
            raise BadInput(f"strategy must be one of {[s.value for s in Strategy]}, "
                           f"got {strategy!r}") from None
        tr = transfer or self.config.transfer
        if tr not in TRANSFERS:
            raise BadInput(f"transfer must be one of {TRANSFERS}, got {tr!r}")
        if not isinstance(owner, str) or not owner:
            raise BadInput("owner must be a non-empty string")
        if fanout is not None and (not isinstance(fanout, FanoutTransport)
                                   or strat is not Strategy.SYNCHRONOUS):
            raise BadInput("an update's own fanout is a FanoutTransport of a synchronous "
                           "update (a rolling update runs per-engine rounds)")
        cfg = FleetConfig(quorum=self.config.quorum if quorum is None else quorum,
                          min_serving=(self.config.min_serving if min_serving is None
                                       else min_serving),
                          wave_size=self.config.wave_size if wave_size is None else wave_size,
                          transfer=tr)
        if not self._update_lock.acquire(blocking=False):
            raise UpdateRefused("a fleet update is already running; one at a time")
        try:
            pool = self._shell.view
            if pool.failed_closed is not None:
                raise UpdateRefused(f"the fleet refuses updates: it failed closed "
                                    f"({pool.failed_closed})")
            if pool.newest is None:
                raise UpdateRefused("bootstrap the fleet first")
            for name, rep in self.replicas.items():
                draft = engine_draft_of(rep.runner.adapter)
                if draft is not None:   # the fan-out and per-engine sends carry the target
                    raise UpdateRefused(f"replica {name}: "
                                        + engine_draft_refusal(draft, remote=True))
            gen = pool.newest.generation + 1
            fleet_label = label if label is not None else f"fleet-{gen}"
            _check_fleet_label(fleet_label)
            if any(v.label == fleet_label for v in pool.versions):
                raise BadInput(f"fleet label {fleet_label!r} was already published")
            self._update_id += 1
            uid = self._update_id
            if strat is Strategy.SYNCHRONOUS:
                return self._synchronous(uid, gen, fleet_label, weights, owner, cfg, fanout)
            return self._rolling(uid, gen, fleet_label, weights, owner, cfg)
        finally:
            self._update_lock.release()
            self._wake.set()

    def ready(self) -> list[str]:
        """The replicas a synchronous update would take now, in order."""
        return [m.replica.name for m in self._ready_members()]

    def _ready_members(self) -> list[_Member]:
        """Replicas an update may take: in the pool, or fenced with a READY engine."""
        pool = self._shell.view
        with self._mem:
            return [m for m in (self._members[n] for n in self._order)
                    if not m.busy and m.replica.controller.state is State.READY
                    and pool.entry(m.replica.name).state in (S.SERVING, S.FENCED)
                    and m.replica.controller.failed_closed is None]

    def _label_for(self, m: _Member, base: str) -> str:
        """The engine's own target label: the fleet's, suffixed when this engine used it."""
        used = m.issued | {v.label for v in m.replica.controller.published}
        label, k = base, 0
        while label in used:
            k += 1
            label = f"{base}.{k}"
        m.issued.add(label)
        return label

    def _begin(self, rec: FleetUpdateBegin) -> None:
        self._shell.run(self._table.begin_update, rec)

    def _end(self, uid: int, members: Sequence[_Member], res: FleetUpdateResult,
             published: FleetVersion | None) -> None:
        """However the update went, no replica stays in it: each still UPDATING is decided
        from its engine, then the update ends (admission reopens)."""
        for m in members:
            out, m.out = m.out, None
            r = m.replica
            c = r.controller
            if out is not None and c.current_ticket == out.ticket:
                # Its transition is still open (the update broke off between the begin
                # and the report): classified from the engine's own write counters.
                with contextlib.suppress(UpdateFailed, RolloutCoreError):
                    r.runner.expire_lease(out, f"fleet update {uid} ended before this "
                                               "engine's transfer was reported")
            if self._shell.view.entry(r.name).state is not S.UPDATING:
                continue
            e = self._shell.view.entry(r.name)
            why = res.reasons.get(r.name) or "the fleet update broke off"
            if c.state is State.READY and c.committed == e.engine_version and \
                    e.generation is not None:
                self._move(m, E.KEPT, reason=why)
            elif c.state is State.READY and published is not None and \
                    c.identity is not None and c.identity.same_weights(published.identity):
                self._move(m, E.PASSED, generation=published.generation)
            elif c.state is State.READY:
                self._move(m, E.WITHHELD, generation=None,
                           reason=f"holds weights the fleet did not publish ({why})")
            else:
                self._move(m, E.TAINTED, generation=None, reason=why)
        with contextlib.suppress(InvalidTransition):
            self._record(self._table.end_update, uid)

    def _synchronous(self, uid: int, gen: int, label: str, weights: FleetWeights, owner: str,
                     cfg: FleetConfig, own: FanoutTransport | None = None
                     ) -> FleetUpdateResult:
        t0 = time.monotonic()
        members = self._ready_members()
        quorum = cfg.quorum if cfg.quorum is not None else len(members)
        if not members:
            raise UpdateRefused("no replica is ready for an update")
        if quorum > len(members):
            raise UpdateRefused(f"quorum {quorum} exceeds the {len(members)} ready replicas")
        use_fanout = own is not None or (
            cfg.transfer == "fanout" and self.fanout is not None
            and weights.source is not None and len(members) > 1
            and all(m.replica.fanout_url for m in members))
        transfer = "fanout" if use_fanout else "per-engine"
        names = tuple(m.replica.name for m in members)
        res = FleetUpdateResult(uid, Strategy.SYNCHRONOUS, label, None, waves=[names],
                                transfer=transfer)
        self._begin(FleetUpdateBegin(uid, Strategy.SYNCHRONOUS, gen, label,
                                     weights.identity.digest, names, quorum, None, transfer))
        published: FleetVersion | None = None
        try:
            self._record(self._table.close_admission, uid,
                         f"synchronous update {uid} to {label}")
            for m in members:
                self._move(m, E.SELECTED)
            outs, failed = self._open_all(members, weights, label, owner)
            self._record(self._table.closed, uid, names)
            opened = [m for m in members if m.replica.name in outs]
            tt = time.monotonic()
            if own is not None:
                if opened:
                    self._fanout_transfer(opened, outs, weights, res, failed, own)
            elif use_fanout and len(opened) > 1:
                self._fanout_transfer(opened, outs, weights, res, failed)
            else:
                self._per_engine_transfer(opened, outs, failed, parallel=False)
            res.transfer_s = time.monotonic() - tt
            self._close_all([m for m in opened if m.replica.name not in failed], outs, res,
                            failed)
            for n, uf in failed.items():
                res.outcomes[n] = _outcome_of(uf)
                res.reasons[n] = uf.reason
            dec = decide_synchronous(res.outcomes, quorum)
            res.decision = dec.reason
            for m in members:
                n = m.replica.name
                c = m.replica.controller
                self._record(self._table.note, ReplicaOutcome(
                    uid, 1, n, res.outcomes[n], c.committed.label if c.committed else None,
                    c.state, transfer, time.monotonic() - t0, res.reasons.get(n, "")[:500]))
            if dec.publish and self._shell.view.failed_closed is None:
                published = self._publish(uid, gen, label, weights, members, dec.serving)
                res.published = published
            else:
                if dec.publish:
                    res.decision = f"the fleet failed closed ({self.failed_closed})"
                self._record(self._table.note, FleetAbandon(uid, res.decision))
            for m in members:
                n = m.replica.name
                if published is not None and n in dec.serving:
                    self._move(m, E.PASSED, generation=gen)
                elif n in dec.kept:
                    self._end_one_kept(m, res.reasons.get(n, ""))
                elif n in dec.withheld or n in dec.serving:
                    self._move(m, E.WITHHELD, generation=None,
                               reason=f"verified on {label}, which the fleet did not publish")
                else:
                    self._move(m, E.TAINTED, generation=None, reason=res.reasons.get(n, ""))
        except RolloutCoreError as exc:
            res.decision = res.decision or f"the update broke off: {exc}"
            res.reasons.setdefault("fleet", str(exc))
        finally:
            self._end(uid, members, res, published)
        res.seconds = time.monotonic() - t0
        if res.published is None:
            raise FleetUpdateFailed(res)
        return res

    def _end_one_kept(self, m: _Member, why: str) -> None:
        """Untouched by the update: back in the pool on its old version, or fenced as it
        was before (a fenced replica the update took but never changed)."""
        if self._shell.view.entry(m.replica.name).generation is not None:
            self._move(m, E.KEPT, reason=why)
        else:
            self._move(m, E.WITHHELD, generation=None, reason=f"still off the pool: {why}")

    def _publish(self, uid: int, gen: int, label: str, weights: FleetWeights,
                 members: Sequence[_Member], passed: Sequence[str]) -> FleetVersion:
        first = next(m for m in members if m.replica.name in passed)
        ident = first.replica.controller.identity or weights.identity
        version = FleetVersion(gen, label, ident, uid)
        self._shell.run(self._table.publish, version, tuple(passed))
        if weights.payload is not None:
            self._payloads[gen] = weights
        # Keep the weights of the newest version (rejoins) and the one before it
        # (replicas withheld by a later abandoned update go back there).
        for g in [g for g in self._payloads if g < gen - 1]:
            del self._payloads[g]
        return version

    # -- the per-replica phases, run in parallel ------------------------------------------
    def _open_all(self, members: Sequence[_Member], weights: FleetWeights, label: str,
                  owner: str) -> tuple[dict[str, UpdateOutcome], dict[str, UpdateFailed]]:
        outs: dict[str, UpdateOutcome] = {}
        failed: dict[str, UpdateFailed] = {}

        def one(m: _Member) -> UpdateOutcome | UpdateFailed:
            r = m.replica
            pre = None
            try:
                if weights.payload is not None:
                    r.stage(weights.payload)
                else:   # a remote sender's round: its preflight is the identity it declared
                    pre = PreflightEvidence(source_manifest_digest=weights.identity.manifest_digest,
                                            source_provenance=weights.identity.provenance)
                    if isinstance(r.runner.adapter, ExpectationTaker):
                        r.runner.adapter.expect(probes=None, reference_checksums=None)
                        r.runner.adapter.expect_sent(None)
                m.out = r.runner.open_update(weights.identity, owner=owner,
                                             label=self._label_for(m, label), preflight=pre,
                                             min_verification=weights.min_verification)
                return m.out
            except UpdateFailed as uf:
                return uf
            except (UpdateRefused, BadInput) as exc:
                return UpdateFailed("request", "no_mutation", r.controller.state.value,
                                    str(exc))

        for m, got in zip(members, self._each(one, members), strict=True):
            if isinstance(got, UpdateFailed):
                failed[m.replica.name] = got
            else:
                outs[m.replica.name] = got
        return outs, failed

    def _report(self, m: _Member, out: UpdateOutcome, ev: TransferEvidence | BaseException,
                failed: dict[str, UpdateFailed]) -> None:
        runner = m.replica.runner
        try:
            if isinstance(ev, TransferEvidence):
                runner.report_transfer(out, ev)
            else:
                runner.report_transfer_failure(out, FailureKind.of(ev), str(ev))
        except UpdateFailed as uf:
            failed[m.replica.name] = uf

    def _send_one(self, m: _Member, out: UpdateOutcome) -> TransferEvidence | BaseException:
        """A per-engine send through the replica's own adapter, under its deadline."""
        r = m.replica
        adapter = r.runner.adapter
        try:
            ev = r.runner._effect(Step.TRANSFER.value,
                                  lambda: adapter.transfer(out.ticket.target),
                                  r.runner.deadlines.transfer_s, None)
        except EffectError as exc:
            return exc
        finally:
            if self.fanout is not None:
                self.fanout.invalidate()  # this engine now holds a per-engine group
        return ev if isinstance(ev, TransferEvidence) else EffectError(
            "transfer", f"adapter returned {type(ev).__name__}")

    def _per_engine_transfer(self, members: Sequence[_Member],
                             outs: Mapping[str, UpdateOutcome],
                             failed: dict[str, UpdateFailed], *, parallel: bool) -> None:
        def one(m: _Member) -> None:
            out = outs[m.replica.name]
            self._report(m, out, self._send_one(m, out), failed)

        if parallel:
            self._each(one, members)
        else:
            for m in members:
                one(m)

    def _fanout_transfer(self, members: Sequence[_Member], outs: Mapping[str, UpdateOutcome],
                         weights: FleetWeights, res: FleetUpdateResult,
                         failed: dict[str, UpdateFailed],
                         own: FanoutTransport | None = None) -> None:
        fan = own or self.fanout
        assert fan is not None
        by_url = {m.replica.fanout_url: m for m in members}
        targets = [(str(m.replica.fanout_url), outs[m.replica.name].ticket.target.version.label)
                   for m in members]
        for m in members:
            if m.replica.on_fanout is not None:
                with contextlib.suppress(Exception):
                    m.replica.on_fanout()
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["r"] = fan.send_all(targets, weights.source,
                                        timeout_s=self.config.transfer_s)
            except BaseException as exc:  # handed back below
                box["err"] = exc

        th = threading.Thread(target=work, name="rc-fleet-fanout", daemon=True)
        th.start()
        th.join(self.config.transfer_s + 5.0)
        if th.is_alive():
            fan.abort()
            th.join(5.0)
        results: Mapping[str, Any] = box.get("r") or {}
        resend: list[_Member] = []
        for url, m in by_url.items():
            r = results.get(str(url))
            out = outs[m.replica.name]
            if r is not None and r.ok:
                self._adopt_round(m, fan, str(url))
                self._report(m, out, r.evidence, failed)
            elif r is not None and r.closed and own is None:
                resend.append(m)   # the fallback: a fresh per-engine round
            else:
                err = (r.error if r is not None and r.error is not None else
                       box.get("err") or EffectTimeout("transfer", self.config.transfer_s))
                self._report(m, out, err, failed)
        if resend and own is None:
            res.transfer = "fanout+resend"
            fan.invalidate()
            self._per_engine_transfer(resend, outs, failed, parallel=True)

    @staticmethod
    def _adopt_round(m: _Member, fan: Any, url: str) -> None:
        """The fan-out's record of what ``m``'s ranks wrote, to ``m``'s validation (a
        fan-out without per-rank reports, e.g. CUDA IPC's, has none to hand over)."""
        round_of = getattr(fan, "round_of", None)
        got = round_of(url) if callable(round_of) else None
        if got is not None and m.replica.on_round is not None:
            m.replica.on_round(*got)

    def _close_all(self, members: Sequence[_Member], outs: Mapping[str, UpdateOutcome],
                   res: FleetUpdateResult, failed: dict[str, UpdateFailed]) -> None:
        def one(m: _Member) -> UpdateFailed | None:
            try:
                m.replica.runner.close_update(outs[m.replica.name])
            except UpdateFailed as uf:
                return uf
            return None

        for m, uf in zip(members, self._each(one, members), strict=True):
            if uf is not None:
                failed[m.replica.name] = uf
            else:
                res.outcomes[m.replica.name] = Outcome.PASSED

    def _run_one(self, m: _Member, weights: FleetWeights, label: str,
                 owner: str) -> tuple[Outcome, str]:
        """A whole per-engine update on one replica (rolling waves, rejoins)."""
        r = m.replica
        try:
            r.stage(weights.payload)
            r.runner.run_update(weights.identity, owner=owner, label=self._label_for(m, label),
                                min_verification=weights.min_verification)
        except UpdateFailed as uf:
            return _outcome_of(uf), uf.reason
        except (UpdateRefused, BadInput) as exc:
            return Outcome.NO_MUTATION, str(exc)
        finally:
            if self.fanout is not None:
                self.fanout.invalidate()
        return Outcome.PASSED, ""

    # -- rolling ----------------------------------------------------------------------------
    def _rolling(self, uid: int, gen: int, label: str, weights: FleetWeights, owner: str,
                 cfg: FleetConfig) -> FleetUpdateResult:
        t0 = time.monotonic()
        members = self._ready_members()
        if not members:
            raise UpdateRefused("no replica is ready for an update")
        pool = self._shell.view
        serving_now = len(self.serving())
        n_all = len([e for e in pool.replicas if e.state is not S.REMOVED])
        min_serving = cfg.min_serving if cfg.min_serving is not None else max(0, n_all - 1)
        # Fenced replicas go first: they serve no one, so moving them costs no capacity.
        members.sort(key=lambda m: (pool.entry(m.replica.name).state in IN_POOL,
                                    self._order.index(m.replica.name)))
        fenced_first = [m for m in members if pool.entry(m.replica.name).state is S.FENCED]
        pooled = [m for m in members if pool.entry(m.replica.name).state in IN_POOL]
        waves = [tuple(m.replica.name for m in fenced_first)] if fenced_first else []
        waves += plan_waves([m.replica.name for m in pooled], serving=serving_now,
                            min_serving=min_serving, wave_size=cfg.wave_size)
        res = FleetUpdateResult(uid, Strategy.ROLLING, label, None, waves=waves,
                                transfer="per-engine")
        self._begin(FleetUpdateBegin(uid, Strategy.ROLLING, gen, label,
                                     weights.identity.digest,
                                     tuple(m.replica.name for m in members), None,
                                     min_serving, "per-engine"))
        published: FleetVersion | None = None
        taken: list[_Member] = []
        try:
            for wi, wave in enumerate(waves, 1):
                wm = [self._members[n] for n in wave]
                wm = [m for m in wm if not m.busy and m.replica.controller.state is State.READY
                      and self._shell.view.entry(m.replica.name).state in (S.SERVING, S.FENCED)]
                if not wm:
                    continue
                if not self._wait_room(wm, min_serving):
                    res.decision = (f"wave {wi} would leave fewer than {min_serving} "
                                    f"replicas serving for {self.config.wave_wait_s:g}s: the "
                                    "roll stops")
                    for m in [self._members[n] for w in waves[wi - 1:] for n in w]:
                        res.outcomes.setdefault(m.replica.name, Outcome.SKIPPED)
                    break
                taken += wm
                for m in wm:
                    self._move(m, E.SELECTED)
                self._record(self._table.wave, WaveBegin(uid, wi, tuple(
                    m.replica.name for m in wm), len(self.serving())))
                tw = time.monotonic()
                got = self._each(lambda m: self._run_one(m, weights, label, owner), wm)
                passed = [m for m, (o, _) in zip(wm, got, strict=True) if o is Outcome.PASSED]
                if passed and published is None and self.failed_closed is None:
                    published = self._publish(uid, gen, label, weights, wm,
                                              [m.replica.name for m in passed])
                    res.published = published
                for m, (o, why) in zip(wm, got, strict=True):
                    n = m.replica.name
                    res.outcomes[n] = o
                    if why:
                        res.reasons[n] = why
                    c = m.replica.controller
                    self._record(self._table.note, ReplicaOutcome(
                        uid, wi, n, o, c.committed.label if c.committed else None, c.state,
                        "per-engine", time.monotonic() - tw, why[:500]))
                    if o is Outcome.PASSED and published is not None:
                        self._move(m, E.PASSED, generation=gen)
                    elif o is Outcome.PASSED:
                        self._move(m, E.WITHHELD, generation=None,
                                   reason=f"verified on {label}, which the fleet could not "
                                   "publish")
                    elif o is Outcome.NO_MUTATION:
                        self._end_one_kept(m, why)
                    else:
                        self._move(m, E.TAINTED, generation=None, reason=why)
                self._record(self._table.note, WaveEnd(
                    uid, wi, tuple(m.replica.name for m in passed),
                    tuple(m.replica.name for m in wm if m not in passed),
                    time.monotonic() - tw))
                if published is None:
                    res.decision = (f"the first wave ({', '.join(wave)}) passed nowhere: "
                                    "stopped")
                    self._record(self._table.note, FleetAbandon(uid, res.decision))
                    break
        except RolloutCoreError as exc:
            res.decision = res.decision or f"the update broke off: {exc}"
            res.reasons.setdefault("fleet", str(exc))
        finally:
            self._end(uid, taken, res, published)
        if published is not None and not res.decision:
            res.decision = (f"{sum(o is Outcome.PASSED for o in res.outcomes.values())} of "
                            f"{len(res.outcomes)} replicas on {label}")
        res.seconds = time.monotonic() - t0
        if published is None:
            if not res.decision:
                res.decision = "no wave ran"
            raise FleetUpdateFailed(res)
        return res

    def _wait_room(self, wave: Sequence[_Member], min_serving: int) -> bool:
        """True once taking ``wave`` out of the pool leaves ``min_serving`` serving."""
        deadline = time.monotonic() + self.config.wave_wait_s
        names = {m.replica.name for m in wave}
        while True:
            if len([n for n in self.serving() if n not in names]) >= min_serving:
                return True
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            self._wake.wait(0.2)
            self._wake.clear()

    # ------------------------------------------------------------------ supervision
    def suspect(self, name: str) -> None:
        """The data plane saw ``name``'s engine refuse a connection: check it now, and one
        failed check fences it (no second chance: a refused connection is the engine's
        own signal that it is gone). A client's answer, whatever its size, is not one."""
        m = self._member(name)
        with self._mem:
            m.suspect = True
        self._wake.set()

    def supervise_once(self) -> None:
        """One round: fence what failed, recover what is tainted, rejoin what is fenced.

        Every serving replica is checked at once (concurrently), each within
        ``health_timeout_s``: one slow engine does not delay the others' checks.
        """
        cfg = self.config
        pool = self._shell.view
        members = [self._members[n] for n in self._order]
        serving = [m for m in members
                   if pool.entry(m.replica.name).state in IN_POOL and not m.busy]

        def check(m: _Member) -> None:
            why = self._check_one(m)
            # Fenced from its own check's thread: a slow check elsewhere delays nothing.
            if why is not None:
                self._move(m, E.TAINTED, generation=None, reason=why, only_from=S.SERVING)

        self._each(check, serving)
        if cfg.heal:
            for m in members:
                if self._shell.view.entry(m.replica.name).state is S.FENCED and not m.busy:
                    self._heal(m)

    def _check_one(self, m: _Member) -> str | None:
        """Why ``m`` must leave the pool now, or None (its health check, bounded)."""
        c = m.replica.controller
        if c.failed_closed is not None:
            return f"its controller failed closed ({c.failed_closed})"
        if c.state is State.TAINTED:
            return "engine tainted"
        if c.state is not State.READY:
            return None  # inside an update of its own: its effects classify failures
        with self._mem:
            suspect, m.suspect = m.suspect, False
        try:
            v = m.replica.runner.check_serving(
                timeout_s=self.config.health_timeout_s,
                failures_to_taint=1 if suspect else self.config.health_failures)
        except RolloutCoreError:
            return None
        return None if v is None else "; ".join(v.problems)[:500]

    def _heal(self, m: _Member) -> None:
        """Start the recovery or rejoin of a fenced replica (in its own thread).

        A READY engine already verified on the newest version (its recovery
        loaded that very checkpoint) rejoins at once; a READY one on other
        weights is updated onto the newest version with its retained weights
        (without them it stays fenced until the next update takes it); a
        TAINTED one is recovered first, if it has a recoverer.
        """
        c = m.replica.controller
        newest = self.newest
        if newest is None or self._stop.is_set() or c.failed_closed is not None:
            return
        with self._mem:
            if m.busy:
                return
            state = c.state
            ident = c.identity
            # A replica whose rebinding failed is still bound to the dead process:
            # it is rebound before anything else (never rejoined as it is).
            on_newest = (state is State.READY and ident is not None and not m.rebind
                         and ident.same_weights(newest.identity))
            if state is State.READY and not on_newest and not m.rebind and \
                    newest.generation not in self._payloads:
                return
            if state is State.TAINTED and m.replica.recoverer is None:
                return
            if state not in (State.READY, State.TAINTED):
                return
            m.busy = True
        if on_newest:
            try:
                self._move(m, E.REJOINED, generation=newest.generation,
                           reason="verified on the current version by its recovery")
            finally:
                m.busy = False
            return
        th = threading.Thread(target=self._heal_thread, args=(m, newest), daemon=True,
                              name=f"rc-fleet-heal-{m.replica.name}")
        self._heals[m.replica.name] = th
        th.start()

    def _heal_thread(self, m: _Member, target: FleetVersion) -> None:
        r = m.replica
        try:
            if r.controller.state is State.TAINTED or m.rebind:
                self._move(m, E.RECOVER)
                if r.controller.state is State.TAINTED:
                    assert r.recoverer is not None
                    try:
                        r.runner.recover(r.recoverer, owner="fleet")
                    except (UpdateFailed, RolloutCoreError) as exc:
                        self._move(m, E.FAILED, generation=None,
                                   reason=f"recovery: {exc}"[:500])
                        return
                    if self.fanout is not None:
                        self.fanout.invalidate()
                    m.rebind = r.on_recovered is not None
                if m.rebind and r.on_recovered is not None:
                    # The adapter still names the old process (its instance id, its
                    # group); until it is rebound nothing may be sent or served. A
                    # failure leaves the replica fenced, and the next round retries
                    # the rebinding (the engine is not restarted again).
                    try:
                        r.on_recovered()
                    except Exception as exc:
                        self._move(m, E.FAILED, generation=None,
                                   reason=f"rebinding to the new process: {exc!r}"[:500])
                        return
                m.rebind = False
                self._move(m, E.RECOVERED, generation=None,
                           reason=f"recovered on {r.controller.committed}")
                ident = r.controller.identity
                if ident is not None and ident.same_weights(target.identity):
                    self._move(m, E.REJOINED, generation=target.generation,
                               reason="verified on the current version by its recovery")
                    return
            newest = self.newest
            assert newest is not None
            weights = self._payloads.get(newest.generation)
            if weights is None:
                return
            self._move(m, E.REJOIN, reason=f"to {newest.label}")
            outcome, why = self._run_one(m, weights, newest.label, "fleet-rejoin")
            if outcome is Outcome.PASSED:
                self._move(m, E.REJOINED, generation=newest.generation)
            elif outcome is Outcome.AMBIGUOUS:
                self._move(m, E.TAINTED, generation=None, reason=why)
            else:
                self._move(m, E.FAILED, generation=None, reason=why)
        except (JournalError, InvalidTransition):
            # Closing: the journals are closed and the replica REMOVED under this
            # thread; what it was doing ends with the fleet.
            if not self._stop.is_set():
                raise
        finally:
            m.busy = False
            self._wake.set()

    def start_supervisor(self) -> None:
        """Run ``supervise_once`` every ``health_interval_s`` (and at once when woken)."""
        if self.config.health_interval_s <= 0 or self._supervisor is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                self._wake.wait(self.config.health_interval_s)
                self._wake.clear()
                if self._stop.is_set():
                    return
                with contextlib.suppress(Exception):
                    self.supervise_once()

        self._supervisor = threading.Thread(target=loop, name="rc-fleet-supervisor",
                                            daemon=True)
        self._supervisor.start()

    def wait_for(self, predicate: Callable[[], bool], timeout_s: float,
                 poll_s: float = 0.05) -> bool:
        """Block until ``predicate()`` (e.g. a replica back in the pool), bounded."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop supervising and close every replica (and the fan-out transport)."""
        self._stop.set()
        self._wake.set()
        if self._supervisor is not None:
            self._supervisor.join(10)
        errors: list[BaseException] = []
        if self.fanout is not None:
            with contextlib.suppress(Exception):
                close = getattr(self.fanout, "close", None)
                if callable(close):
                    close()
        for m in self._members.values():
            with contextlib.suppress(Exception):
                if self._shell.view.entry(m.replica.name).state is not S.REMOVED:
                    self._move(m, E.REMOVE)
            if m.replica.close is not None:
                try:
                    m.replica.close()
                except Exception as exc:  # keep closing the others
                    errors.append(exc)
        # A recovery still running ends once its engine is closed (its start fails):
        # waited for, bounded, before the journal closes under it.
        for th in list(self._heals.values()):
            th.join(30.0)
        self._pool.shutdown(wait=False)
        self.journal.close()
        if errors:
            raise errors[0]

    def __enter__(self) -> FleetCoordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_fleet_label(label: object) -> str:
    from rolloutcore.core.versions import check_label

    lab = check_label(label)
    if generation_of(lab) is not None:
        raise BadInput(f"fleet label {lab!r}: rc-N labels are the engines' own (recovery "
                       "uses them); give another, e.g. fleet-N")
    return lab
