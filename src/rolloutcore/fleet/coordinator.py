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
import threading
import time
from collections.abc import Callable

from rolloutcore.core.lifecycle import State
from rolloutcore.core.pool import IN_POOL, FleetVersion, Outcome, ReplicaEvent, ReplicaState
from rolloutcore.core.versions import VerificationLevel, WeightIdentity
from rolloutcore.errors import (
    BadInput,
    InvalidTransition,
    JournalError,
    RolloutCoreError,
    UpdateFailed,
)
from rolloutcore.fleet.members import Member, check_fleet_label
from rolloutcore.fleet.model import FleetWeights
from rolloutcore.fleet.updates import FleetUpdates

__all__ = ["FleetCoordinator"]

E, S = ReplicaEvent, ReplicaState


class FleetCoordinator(FleetUpdates):
    """Runs fleet updates over ``replicas`` and keeps the pool; see the module docstring.

    The replicas, their pool and its queries are ``FleetMembers``' (``fleet.members``),
    the updates ``FleetUpdates``' (``fleet.updates``); here are the bootstrap, the
    supervision and the teardown.
    """

    # ------------------------------------------------------------------ bootstrap
    def bootstrap(self, identity: WeightIdentity, *, weights: FleetWeights | None = None,
                  label: str = "fleet-0") -> FleetVersion:
        """Take every replica over on ``identity`` (fleet version 0, ``label``), verified.

        Each runner takes its engine over as ``serve --upstream`` does
        (``take_over``: awake, not paused, its label and ``weights.probe``, to
        ``weights.min_verification``). A replica that cannot be verified joins FENCED, with
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
        check_fleet_label(label)
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

        def one(m: Member) -> str | None:
            r = m.replica
            if restoring and r.controller.state is State.UNINITIALIZED:
                # Its engine versions would start again at rc-0: labels the journal's
                # trajectories already name, for other weights.
                return ("the pool's journal is restored but this replica has no journal of "
                        "its own: its engine versions cannot continue")
            try:
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

        def check(m: Member) -> None:
            why = self._check_one(m)
            # Fenced from its own check's thread: a slow check elsewhere delays nothing.
            if why is not None:
                self._move(m, E.TAINTED, generation=None, reason=why, only_from=S.SERVING)

        self._each(check, serving)
        if cfg.heal:
            for m in members:
                if self._shell.view.entry(m.replica.name).state is S.FENCED and not m.busy:
                    self._heal(m)

    def _check_one(self, m: Member) -> str | None:
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

    def _heal(self, m: Member) -> None:
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

    def _heal_thread(self, m: Member, target: FleetVersion) -> None:
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
