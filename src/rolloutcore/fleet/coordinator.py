"""The fleet coordinator: N engines, each under its own unchanged controller, as one policy.

Each replica is what ``EngineSession`` is for one engine: an adapter, a
controller, a runner and a journal of its own. The coordinator sits above
them and adds what only a fleet has:

* the fleet's **published versions** (``FleetVersion``: a fleet generation,
  its label and its ``WeightIdentity``) and which version each replica
  holds; the router (``fleet.routing``) reads that through ``view()``;
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
    a published version. Admission reopens only after that decision, so no
    request is answered by a version other than the one it was admitted
    under: a replica's drain waits for its own bound rollouts, and nothing is
    admitted between ``fleet_closed`` and the decision;
  - ``rolling``: waves of per-engine updates, each wave taken out of the pool
    only while at least ``min_serving`` replicas stay in it; the new version
    is published when the first wave passes, so two versions serve during
    the roll and every answer says which;
* **supervision** (``supervise_once``, or the supervisor thread): a replica
  whose engine taints, dies or restarts leaves the pool at once; it is
  recovered on its own (its ``Recoverer``: a replacement process on a known
  checkpoint, verified), and rejoins only after it was verified on the
  fleet's current version (recovered on it, or updated onto it with the
  retained weights).

The coordinator's journal (``fleet.records``) records updates, waves,
per-replica outcomes and every pool state change; each engine keeps its own.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.control.runner import UpdateOutcome
from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.versions import WeightIdentity, generation_of
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
    FleetVersion,
    FleetWeights,
    Replica,
)
from rolloutcore.fleet.records import (
    FleetAbandon,
    FleetBootstrap,
    FleetClosed,
    FleetJournal,
    FleetPublish,
    FleetUpdateBegin,
    ReplicaOutcome,
    ReplicaStateChange,
    WaveBegin,
    WaveEnd,
)
from rolloutcore.fleet.routing import FleetView, ReplicaView
from rolloutcore.fleet.rules import (
    IN_POOL,
    Outcome,
    ReplicaEvent,
    ReplicaState,
    Strategy,
    decide_synchronous,
    next_state,
    plan_waves,
)

__all__ = [
    "FanoutTransport",
    "FleetConfig",
    "FleetCoordinator",
    "FleetUpdateFailed",
    "FleetUpdateResult",
    "FleetVersion",
    "FleetWeights",
    "Replica",
    "TRANSFERS",
]

E, S = ReplicaEvent, ReplicaState


@dataclass
class _Member:
    replica: Replica
    state: ReplicaState = ReplicaState.JOINING
    generation: int | None = None   # the fleet version its engine holds (verified)
    busy: bool = False              # a recovery or rejoin runs on it
    reason: str = ""
    issued: set[str] = field(default_factory=set)
    suspect: bool = False
    rebind: bool = False            # recovered, but not yet rebound to the new process


def _outcome_of(uf: UpdateFailed) -> Outcome:
    return Outcome.NO_MUTATION if uf.classification == "no_mutation" and \
        uf.state == State.READY.value else Outcome.AMBIGUOUS


class FleetCoordinator:
    """Runs fleet updates over ``replicas`` and keeps the pool; see the module docstring.

    ``fanout``: a ``FanoutTransport`` over the replicas' ``fanout_url``s
    (synchronous updates then broadcast once). ``journal_path``: the
    coordinator's own journal (memory only without one).
    """

    def __init__(self, replicas: Sequence[Replica], *, config: FleetConfig | None = None,
                 fanout: FanoutTransport | None = None,
                 journal_path: str | None = None) -> None:
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
        self.journal = FleetJournal(journal_path)
        self._members: dict[str, _Member] = {r.name: _Member(r) for r in replicas}
        self._order = list(names)
        self._lock = threading.RLock()
        self._update_lock = threading.Lock()
        self._versions: list[FleetVersion] = []
        self._payloads: dict[int, FleetWeights] = {}
        self._closed: str | None = None
        self._update_id = 0
        self._running: dict[str, Any] | None = None
        self._listeners: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._heals: dict[str, threading.Thread] = {}
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(names)),
                                        thread_name_prefix="rc-fleet")

    # ------------------------------------------------------------------ queries
    @property
    def replicas(self) -> dict[str, Replica]:
        return {n: m.replica for n, m in self._members.items()}

    @property
    def versions(self) -> tuple[FleetVersion, ...]:
        with self._lock:
            return tuple(self._versions)

    @property
    def newest(self) -> FleetVersion | None:
        with self._lock:
            return self._versions[-1] if self._versions else None

    def state_of(self, name: str) -> ReplicaState:
        with self._lock:
            return self._member(name).state

    def generation_of(self, name: str) -> int | None:
        with self._lock:
            return self._member(name).generation

    def serving(self) -> list[str]:
        """The replicas in the pool now (what the router may choose from)."""
        with self._lock:
            return [n for n in self._order if self._in_pool(self._members[n])]

    def _in_pool(self, m: _Member) -> bool:
        return m.state in IN_POOL and m.generation is not None and \
            m.replica.controller.state is State.READY

    def view(self) -> FleetView:
        """What the router needs, in one consistent read."""
        with self._lock:
            reps = tuple(ReplicaView(n, self._in_pool(m), m.generation,
                                     len(m.replica.controller.active))
                         for n, m in ((n, self._members[n]) for n in self._order)
                         if m.state is not S.REMOVED)
            newest = self._versions[-1].generation if self._versions else None
            labels = {v.label: v.generation for v in self._versions}
            return FleetView(reps, newest, labels, self._closed, self.config.retry_after_s)

    def status(self) -> dict[str, Any]:
        with self._lock:
            reps = []
            served: dict[str, int] = {}
            for n in self._order:
                m = self._members[n]
                c = m.replica.controller
                committed = c.committed
                ver = self._version(m.generation)
                if self._in_pool(m) and ver is not None:
                    served[ver.label] = served.get(ver.label, 0) + 1
                reps.append({
                    "name": n, "url": m.replica.url, "state": m.state.value,
                    "in_pool": self._in_pool(m), "fleet_generation": m.generation,
                    "fleet_label": None if ver is None else ver.label,
                    "engine_state": c.state.value,
                    "engine_version": None if committed is None else committed.to_dict(),
                    "load": len(c.active), "reason": m.reason, "busy": m.busy})
            return {
                "replicas": reps,
                "serving": sum(1 for r in reps if r["in_pool"]),
                "newest": None if not self._versions else self._versions[-1].to_dict(),
                "published": [v.to_dict() for v in self._versions],
                "versions_served": served,
                "admission_closed": self._closed,
                "update": None if self._running is None else dict(self._running),
            }

    def _member(self, name: str) -> _Member:
        m = self._members.get(name)
        if m is None:
            raise BadInput(f"no replica named {name!r} in this fleet")
        return m

    def _version(self, gen: int | None) -> FleetVersion | None:
        if gen is None:
            return None
        for v in self._versions:
            if v.generation == gen:
                return v
        return None

    def on_change(self, callback: Callable[[], None]) -> None:
        """Called (from any thread) whenever the pool or the versions change."""
        self._listeners.append(callback)

    # ------------------------------------------------------------------ state changes
    def _move(self, m: _Member, event: ReplicaEvent, *, generation: int | str | None = "keep",
              reason: str = "") -> None:
        with self._lock:
            before = m.state
            after = next_state(before, event)
            m.state = after
            if generation != "keep":
                assert generation is None or isinstance(generation, int)
                m.generation = generation
            m.reason = reason
            committed = m.replica.controller.committed
            rec = ReplicaStateChange(m.replica.name, before.value, after.value, event.value,
                                     m.generation, None if committed is None
                                     else committed.label, reason[:500])
        self._write(rec)
        self._changed()

    def _changed(self) -> None:
        for cb in list(self._listeners):
            with contextlib.suppress(Exception):
                cb()

    def _write(self, rec: Any) -> None:
        try:
            self.journal.write(rec)
        except JournalError:
            # The coordinator cannot record what it would decide: no more updates.
            with self._lock:
                self._closed = self._closed or "the fleet journal failed"
            raise

    # ------------------------------------------------------------------ bootstrap
    def bootstrap(self, identity: WeightIdentity, *, weights: FleetWeights | None = None,
                  label: str = "fleet-0", bootstrapped: bool = False) -> FleetVersion:
        """Take every replica over on ``identity`` (fleet version 0, ``label``).

        Each runner is bootstrapped (unless ``bootstrapped``: done already);
        a replica that fails stays fenced. ``weights`` is retained for rejoins.
        """
        _check_fleet_label(label)
        if not isinstance(identity, WeightIdentity):
            raise BadInput("identity must be a WeightIdentity")
        with self._lock:
            if self._versions:
                raise BadInput("the fleet is already bootstrapped")
        members = list(self._members.values())

        def one(m: _Member) -> str | None:
            try:
                if not bootstrapped:
                    m.replica.runner.bootstrap(identity)
                c = m.replica.controller
                if c.state is not State.READY or c.identity is None or \
                        not c.identity.same_weights(identity):
                    return f"engine {c.state.value}, not READY on the fleet's identity"
            except RolloutCoreError as exc:
                return str(exc)
            return None

        problems = list(self._pool.map(one, members))
        version = FleetVersion(0, label, identity, None)
        with self._lock:
            self._versions.append(version)
            if weights is not None:
                self._payloads[0] = weights
        self._write(FleetBootstrap(0, label, identity.digest,
                                   tuple(m.replica.name for m in members)))
        for m, p in zip(members, problems, strict=True):
            if p is None:
                self._move(m, E.BOOTSTRAPPED, generation=0)
            else:
                self._move(m, E.FAILED, generation=None, reason=p)
        return version

    # ------------------------------------------------------------------ updates
    def update(self, weights: FleetWeights, *, strategy: Strategy | str = Strategy.SYNCHRONOUS,
               label: str | None = None, owner: str = "trainer", quorum: int | None = None,
               min_serving: int | None = None, wave_size: int | None = None,
               transfer: str | None = None) -> FleetUpdateResult:
        """Install ``weights`` across the fleet; returns the result or raises.

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
        cfg = FleetConfig(quorum=self.config.quorum if quorum is None else quorum,
                          min_serving=(self.config.min_serving if min_serving is None
                                       else min_serving),
                          wave_size=self.config.wave_size if wave_size is None else wave_size,
                          transfer=tr)
        if not self._update_lock.acquire(blocking=False):
            raise UpdateRefused("a fleet update is already running; one at a time")
        try:
            with self._lock:
                if not self._versions:
                    raise UpdateRefused("bootstrap the fleet first")
                if self._closed is not None and self._running is None:
                    raise UpdateRefused(f"the fleet refuses updates: {self._closed}")
                gen = self._versions[-1].generation + 1
                fleet_label = label if label is not None else f"fleet-{gen}"
                _check_fleet_label(fleet_label)
                if any(v.label == fleet_label for v in self._versions):
                    raise BadInput(f"fleet label {fleet_label!r} was already published")
                self._update_id += 1
                uid = self._update_id
            if strat is Strategy.SYNCHRONOUS:
                return self._synchronous(uid, gen, fleet_label, weights, owner, cfg)
            return self._rolling(uid, gen, fleet_label, weights, owner, cfg)
        finally:
            with self._lock:
                self._running = None
            self._update_lock.release()
            self._changed()
            self._wake.set()

    def _ready_members(self) -> list[_Member]:
        """Replicas an update may take: in the pool, or fenced with a READY engine."""
        with self._lock:
            return [m for m in (self._members[n] for n in self._order)
                    if not m.busy and m.replica.controller.state is State.READY
                    and (m.state in IN_POOL or m.state is S.FENCED)]

    def _label_for(self, m: _Member, base: str) -> str:
        """The engine's own target label: the fleet's, suffixed when this engine used it."""
        used = m.issued | {v.label for v in m.replica.controller.published}
        label, k = base, 0
        while label in used:
            k += 1
            label = f"{base}.{k}"
        m.issued.add(label)
        return label

    def _synchronous(self, uid: int, gen: int, label: str, weights: FleetWeights, owner: str,
                     cfg: FleetConfig) -> FleetUpdateResult:
        t0 = time.monotonic()
        members = self._ready_members()
        quorum = cfg.quorum if cfg.quorum is not None else len(members)
        if not members:
            raise UpdateRefused("no replica is ready for an update")
        if quorum > len(members):
            raise UpdateRefused(f"quorum {quorum} exceeds the {len(members)} ready replicas")
        use_fanout = (cfg.transfer == "fanout" and self.fanout is not None
                      and weights.source is not None and len(members) > 1
                      and all(m.replica.fanout_url for m in members))
        transfer = "fanout" if use_fanout else "per-engine"
        names = tuple(m.replica.name for m in members)
        res = FleetUpdateResult(uid, Strategy.SYNCHRONOUS, label, None, waves=[names],
                                transfer=transfer)
        with self._lock:
            self._closed = f"synchronous update {uid} to {label}"
            self._running = {"update_id": uid, "strategy": "synchronous", "label": label,
                             "replicas": list(names)}
        self._changed()
        try:
            self._write(FleetUpdateBegin(uid, "synchronous", gen, label, weights.identity.digest,
                                         names, quorum, None, transfer))
            for m in members:
                self._move(m, E.SELECTED)
            outs, failed = self._open_all(members, weights, label, owner, res)
            self._write(FleetClosed(uid, names))
            opened = [m for m in members if m.replica.name in outs]
            tt = time.monotonic()
            if use_fanout and len(opened) > 1:
                self._fanout_transfer(opened, outs, weights, res, failed)
            else:
                self._per_engine_transfer(opened, outs, res, failed, parallel=False)
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
                self._write(ReplicaOutcome(uid, 1, n, res.outcomes[n].value,
                                           c.committed.label if c.committed else None,
                                           c.state.value, transfer, time.monotonic() - t0,
                                           res.reasons.get(n, "")[:500]))
            if dec.publish:
                version = self._publish(uid, gen, label, weights, members, dec.serving)
                res.published = version
            else:
                self._write(FleetAbandon(uid, dec.reason))
            for m in members:
                n = m.replica.name
                if n in dec.serving:
                    self._move(m, E.PASSED, generation=gen)
                elif n in dec.kept:
                    self._move(m, E.KEPT, reason=res.reasons.get(n, ""))
                elif n in dec.withheld:
                    self._move(m, E.WITHHELD, generation=None,
                               reason=f"verified on {label}, which the fleet did not publish")
                else:
                    self._move(m, E.TAINTED, generation=None, reason=res.reasons.get(n, ""))
        finally:
            with self._lock:
                self._closed = None
            self._changed()
        res.seconds = time.monotonic() - t0
        if res.published is None:
            raise FleetUpdateFailed(res)
        return res

    def _publish(self, uid: int, gen: int, label: str, weights: FleetWeights,
                 members: Sequence[_Member], passed: Sequence[str]) -> FleetVersion:
        first = next(m for m in members if m.replica.name in passed)
        ident = first.replica.controller.identity or weights.identity
        version = FleetVersion(gen, label, ident, uid)
        with self._lock:
            self._versions.append(version)
            self._payloads[gen] = weights
            # Keep the weights of the newest version (rejoins) and the one before it
            # (replicas withheld by a later abandoned update go back there).
            for g in [g for g in self._payloads if g < gen - 1]:
                del self._payloads[g]
        self._write(FleetPublish(uid, gen, label, weights.identity.digest, tuple(passed)))
        return version

    # -- the per-replica phases, run in parallel ------------------------------------------
    def _open_all(self, members: Sequence[_Member], weights: FleetWeights, label: str,
                  owner: str, res: FleetUpdateResult,
                  ) -> tuple[dict[str, UpdateOutcome], dict[str, UpdateFailed]]:
        outs: dict[str, UpdateOutcome] = {}
        failed: dict[str, UpdateFailed] = {}

        def one(m: _Member) -> UpdateOutcome | UpdateFailed:
            r = m.replica
            try:
                r.stage(weights.payload)
                return r.runner.open_update(weights.identity, owner=owner,
                                            label=self._label_for(m, label),
                                            min_verification=weights.min_verification)
            except UpdateFailed as uf:
                return uf
            except (UpdateRefused, BadInput) as exc:
                return UpdateFailed("request", "no_mutation", r.controller.state.value,
                                    str(exc))

        for m, got in zip(members, self._pool.map(one, members), strict=True):
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
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["ev"] = adapter.transfer(out.ticket.target)
            except BaseException as exc:  # handed back below
                box["err"] = exc

        th = threading.Thread(target=work, name=f"rc-fleet-send-{r.name}", daemon=True)
        th.start()
        deadline = r.runner.deadlines.transfer_s
        th.join(deadline)
        if th.is_alive():
            with contextlib.suppress(Exception):
                adapter.cancel(Step.TRANSFER)
            th.join(r.runner.deadlines.cancel_grace_s)
            return EffectTimeout("transfer", deadline)
        if self.fanout is not None:
            self.fanout.invalidate()  # this engine now holds a per-engine group
        if "err" in box:
            err = box["err"]
            return err if isinstance(err, Exception) else EffectError("transfer", repr(err))
        ev = box["ev"]
        return ev if isinstance(ev, TransferEvidence) else EffectError(
            "transfer", f"adapter returned {type(ev).__name__}")

    def _per_engine_transfer(self, members: Sequence[_Member], outs: Mapping[str, UpdateOutcome],
                             res: FleetUpdateResult, failed: dict[str, UpdateFailed], *,
                             parallel: bool) -> None:
        def one(m: _Member) -> None:
            out = outs[m.replica.name]
            self._report(m, out, self._send_one(m, out), failed)

        if parallel:
            list(self._pool.map(one, members))
        else:
            for m in members:
                one(m)

    def _fanout_transfer(self, members: Sequence[_Member], outs: Mapping[str, UpdateOutcome],
                         weights: FleetWeights, res: FleetUpdateResult,
                         failed: dict[str, UpdateFailed]) -> None:
        fan = self.fanout
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
                self._report(m, out, r.evidence, failed)
            elif r is not None and r.closed:
                resend.append(m)   # the fallback: a fresh per-engine round
            else:
                err = (r.error if r is not None and r.error is not None else
                       box.get("err") or EffectTimeout("transfer", self.config.transfer_s))
                self._report(m, out, err, failed)
        if resend:
            res.transfer = "fanout+resend"
            fan.invalidate()
            self._per_engine_transfer(resend, outs, res, failed, parallel=True)

    def _close_all(self, members: Sequence[_Member], outs: Mapping[str, UpdateOutcome],
                   res: FleetUpdateResult, failed: dict[str, UpdateFailed]) -> None:
        def one(m: _Member) -> UpdateFailed | None:
            try:
                m.replica.runner.close_update(outs[m.replica.name])
            except UpdateFailed as uf:
                return uf
            return None

        for m, uf in zip(members, self._pool.map(one, members), strict=True):
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
        with self._lock:
            serving_now = len([m for m in self._members.values() if self._in_pool(m)])
        n_all = len([m for m in self._members.values() if m.state is not S.REMOVED])
        min_serving = cfg.min_serving if cfg.min_serving is not None else max(0, n_all - 1)
        # Fenced replicas go first: they serve no one, so moving them costs no capacity.
        members.sort(key=lambda m: (m.state in IN_POOL, self._order.index(m.replica.name)))
        fenced_first = [m for m in members if m.state is S.FENCED]
        pooled = [m for m in members if m.state in IN_POOL]
        waves = [tuple(m.replica.name for m in fenced_first)] if fenced_first else []
        waves += plan_waves([m.replica.name for m in pooled], serving=serving_now,
                            min_serving=min_serving, wave_size=cfg.wave_size)
        res = FleetUpdateResult(uid, Strategy.ROLLING, label, None, waves=waves,
                                transfer="per-engine")
        with self._lock:
            self._running = {"update_id": uid, "strategy": "rolling", "label": label,
                             "waves": [list(w) for w in waves], "wave": 0,
                             "min_serving": min_serving}
        self._write(FleetUpdateBegin(uid, "rolling", gen, label, weights.identity.digest,
                                     tuple(m.replica.name for m in members), None, min_serving,
                                     "per-engine"))
        published: FleetVersion | None = None
        for wi, wave in enumerate(waves, 1):
            wm = [self._members[n] for n in wave]
            wm = [m for m in wm if not m.busy and m.replica.controller.state is State.READY
                  and m.state in (S.SERVING, S.FENCED)]
            if not wm:
                continue
            if not self._wait_room(wm, min_serving, cfg):
                res.decision = (f"wave {wi} would leave fewer than {min_serving} replicas "
                                f"serving for {self.config.wave_wait_s:g}s: the roll stops")
                for m in [self._members[n] for w in waves[wi - 1:] for n in w]:
                    res.outcomes.setdefault(m.replica.name, Outcome.SKIPPED)
                break
            with self._lock:
                assert self._running is not None
                self._running["wave"] = wi
                for m in wm:
                    self._move(m, E.SELECTED)
                serving = len([m for m in self._members.values() if self._in_pool(m)])
            self._write(WaveBegin(uid, wi, tuple(m.replica.name for m in wm), serving))
            tw = time.monotonic()
            got = list(self._pool.map(lambda m: self._run_one(m, weights, label, owner), wm))
            passed = [m for m, (o, _) in zip(wm, got, strict=True) if o is Outcome.PASSED]
            if passed and published is None:
                published = self._publish(uid, gen, label, weights, wm,
                                          [m.replica.name for m in passed])
                res.published = published
            for m, (o, why) in zip(wm, got, strict=True):
                n = m.replica.name
                res.outcomes[n] = o
                if why:
                    res.reasons[n] = why
                c = m.replica.controller
                self._write(ReplicaOutcome(uid, wi, n, o.value,
                                           c.committed.label if c.committed else None,
                                           c.state.value, "per-engine", time.monotonic() - tw,
                                           why[:500]))
                if o is Outcome.PASSED and published is not None:
                    self._move(m, E.PASSED, generation=gen)
                elif o is Outcome.PASSED:  # unreachable: a pass publishes
                    self._move(m, E.WITHHELD, generation=None)
                elif o is Outcome.NO_MUTATION:
                    self._move(m, E.KEPT, reason=why)
                else:
                    self._move(m, E.TAINTED, generation=None, reason=why)
            self._write(WaveEnd(uid, wi, tuple(m.replica.name for m in passed),
                                tuple(m.replica.name for m in wm if m not in passed),
                                time.monotonic() - tw))
            if published is None:
                res.decision = f"the first wave ({', '.join(wave)}) passed nowhere: stopped"
                self._write(FleetAbandon(uid, res.decision))
                break
        if published is not None and not res.decision:
            res.decision = (f"{sum(o is Outcome.PASSED for o in res.outcomes.values())} of "
                            f"{len(res.outcomes)} replicas on {label}")
        res.seconds = time.monotonic() - t0
        if published is None:
            if not res.decision:
                res.decision = "no wave ran"
            raise FleetUpdateFailed(res)
        return res

    def _wait_room(self, wave: Sequence[_Member], min_serving: int, cfg: FleetConfig) -> bool:
        """True once taking ``wave`` out of the pool leaves ``min_serving`` serving."""
        deadline = time.monotonic() + self.config.wave_wait_s
        while True:
            with self._lock:
                left = [m for m in self._members.values()
                        if self._in_pool(m) and m not in wave]
                if len(left) >= min_serving:
                    return True
            if time.monotonic() >= deadline or self._stop.is_set():
                return False
            self._wake.wait(0.2)
            self._wake.clear()

    # ------------------------------------------------------------------ supervision
    def suspect(self, name: str) -> None:
        """The data plane could not reach ``name``: check it now rather than at the next tick."""
        with self._lock:
            self._member(name).suspect = True
        self._wake.set()

    def supervise_once(self) -> None:
        """One round: fence what taints, recover what is tainted, rejoin what is fenced."""
        cfg = self.config
        with self._lock:
            members = [self._members[n] for n in self._order]
        for m in members:
            c = m.replica.controller
            if m.state in IN_POOL and not m.busy:
                if c.state is State.READY:
                    try:
                        v = m.replica.runner.check_serving(
                            timeout_s=cfg.health_timeout_s,
                            failures_to_taint=1 if m.suspect else cfg.health_failures)
                    except RolloutCoreError:
                        v = None
                    m.suspect = False
                    if v is not None:
                        self._move(m, E.TAINTED, generation=None,
                                   reason="; ".join(v.problems)[:500])
                elif c.state is State.TAINTED:
                    self._move(m, E.TAINTED, generation=None, reason="engine tainted")
        if cfg.heal:
            for m in members:
                if m.state is S.FENCED and not m.busy:
                    self._heal(m)

    def _heal(self, m: _Member) -> None:
        """Start the recovery or rejoin of a fenced replica (in its own thread).

        A READY engine already verified on the newest version (its recovery
        loaded that very checkpoint) rejoins at once; a READY one on other
        weights is updated onto the newest version with its retained weights
        (without them it stays fenced until the next update takes it); a
        TAINTED one is recovered first, if it has a recoverer.
        """
        c = m.replica.controller
        with self._lock:
            if not self._versions or m.busy or self._stop.is_set():
                return
            newest = self._versions[-1]
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
            with self._lock:
                newest = self._versions[-1]
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
        """Run ``supervise_once`` every ``health_interval_s`` (and at once on ``suspect``)."""
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
                if m.state is not S.REMOVED:
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
