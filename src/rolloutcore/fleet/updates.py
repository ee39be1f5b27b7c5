"""Fleet updates: every replica through its own verified transition, as one policy.

``FleetUpdates`` adds the updates to ``fleet.members.FleetMembers``:
``synchronous`` (admission closed fleet-wide; the same weights to every ready
replica, by one fan-out broadcast or by per-engine sends; published at the
quorum) and ``rolling`` (waves taken out of the pool only while
``min_serving`` replicas stay in it). Each replica goes through its runner's
two-phase form (``open_update`` -> the transfer -> ``report_transfer`` ->
``close_update``); whatever goes wrong, no replica is left in an update. The
module docstring of ``fleet.coordinator`` says what each strategy promises.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rolloutcore.control.port import ExpectationTaker
from rolloutcore.control.runner import UpdateOutcome
from rolloutcore.core.evidence import PreflightEvidence, TransferEvidence
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.pool import (
    IN_POOL,
    FleetAbandon,
    FleetUpdateBegin,
    FleetVersion,
    Outcome,
    ReplicaEvent,
    ReplicaOutcome,
    ReplicaState,
    Strategy,
    WaveBegin,
    WaveEnd,
    decide_synchronous,
    plan_waves,
)
from rolloutcore.core.speculative import engine_draft_of, engine_draft_refusal
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    InvalidTransition,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.fleet.members import FleetMembers, Member, check_fleet_label
from rolloutcore.fleet.model import (
    TRANSFERS,
    FanoutTransport,
    FleetConfig,
    FleetUpdateFailed,
    FleetUpdateResult,
    FleetWeights,
)

__all__ = ["FleetUpdates"]

E, S = ReplicaEvent, ReplicaState


def _outcome_of(uf: UpdateFailed) -> Outcome:
    return Outcome.NO_MUTATION if uf.classification == "no_mutation" and \
        uf.state == State.READY.value else Outcome.AMBIGUOUS


class FleetUpdates(FleetMembers):
    """The fleet's updates over its members (see the module docstring)."""

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
            check_fleet_label(fleet_label)
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

    def _ready_members(self) -> list[Member]:
        """Replicas an update may take: in the pool, or fenced with a READY engine."""
        pool = self._shell.view
        with self._mem:
            return [m for m in (self._members[n] for n in self._order)
                    if not m.busy and m.replica.controller.state is State.READY
                    and pool.entry(m.replica.name).state in (S.SERVING, S.FENCED)
                    and m.replica.controller.failed_closed is None]

    def _label_for(self, m: Member, base: str) -> str:
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

    def _end(self, uid: int, members: Sequence[Member], res: FleetUpdateResult,
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

    def _end_one_kept(self, m: Member, why: str) -> None:
        """Untouched by the update: back in the pool on its old version, or fenced as it
        was before (a fenced replica the update took but never changed)."""
        if self._shell.view.entry(m.replica.name).generation is not None:
            self._move(m, E.KEPT, reason=why)
        else:
            self._move(m, E.WITHHELD, generation=None, reason=f"still off the pool: {why}")

    def _publish(self, uid: int, gen: int, label: str, weights: FleetWeights,
                 members: Sequence[Member], passed: Sequence[str]) -> FleetVersion:
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
    def _open_all(self, members: Sequence[Member], weights: FleetWeights, label: str,
                  owner: str) -> tuple[dict[str, UpdateOutcome], dict[str, UpdateFailed]]:
        outs: dict[str, UpdateOutcome] = {}
        failed: dict[str, UpdateFailed] = {}

        def one(m: Member) -> UpdateOutcome | UpdateFailed:
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

    def _report(self, m: Member, out: UpdateOutcome, ev: TransferEvidence | BaseException,
                failed: dict[str, UpdateFailed]) -> None:
        runner = m.replica.runner
        try:
            if isinstance(ev, TransferEvidence):
                runner.report_transfer(out, ev)
            else:
                runner.report_transfer_failure(out, FailureKind.of(ev), str(ev))
        except UpdateFailed as uf:
            failed[m.replica.name] = uf

    def _send_one(self, m: Member, out: UpdateOutcome) -> TransferEvidence | BaseException:
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

    def _per_engine_transfer(self, members: Sequence[Member],
                             outs: Mapping[str, UpdateOutcome],
                             failed: dict[str, UpdateFailed], *, parallel: bool) -> None:
        def one(m: Member) -> None:
            out = outs[m.replica.name]
            self._report(m, out, self._send_one(m, out), failed)

        if parallel:
            self._each(one, members)
        else:
            for m in members:
                one(m)

    def _fanout_transfer(self, members: Sequence[Member], outs: Mapping[str, UpdateOutcome],
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
        resend: list[Member] = []
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
    def _adopt_round(m: Member, fan: FanoutTransport, url: str) -> None:
        """The fan-out's record of what ``m``'s ranks wrote, to ``m``'s validation (a
        fan-out without per-rank reports, e.g. CUDA IPC's, has none to hand over)."""
        round_of = getattr(fan, "round_of", None)
        got = round_of(url) if callable(round_of) else None
        if got is not None and m.replica.on_round is not None:
            m.replica.on_round(*got)

    def _close_all(self, members: Sequence[Member], outs: Mapping[str, UpdateOutcome],
                   res: FleetUpdateResult, failed: dict[str, UpdateFailed]) -> None:
        def one(m: Member) -> UpdateFailed | None:
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

    def _run_one(self, m: Member, weights: FleetWeights, label: str,
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
        taken: list[Member] = []
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

    def _wait_room(self, wave: Sequence[Member], min_serving: int) -> bool:
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
