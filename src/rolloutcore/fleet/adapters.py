"""LoRA-adapter versions across a fleet: verified on every replica, then published on all.

Each replica keeps its own ``control.adapters.AdapterManager`` (its own
adapter table, in its own shell, its records in its own journal): nothing
here decides what one engine's adapters may do. What the fleet adds is the
two-phase publication and the one name the gateway routes to:

1. **prepare once**: the adapter is checked and digested once
   (``AdapterSource``), named ``rcl-<generation>-<digest[:16]>`` with a
   generation above every replica's (so the name is new on all of them, never
   reused), and the trainer's reference of base + adapter is computed once;
   each replica gets its own copy of the files under its own store;
2. **verify everywhere**: every serving replica loads and verifies it at once
   (``AdapterManager.verify``: listed, probed through the adapter, the base
   probed beside it), each within the update's deadline; each leaves it
   VERIFYING, never routed to;
3. **publish only when all acknowledged**: if every one verified (and every
   base is still the one it was verified on) it is published on each, and
   then becomes the fleet's current adapter; otherwise it is published
   nowhere: each replica that loaded it unloads it (REFUSED), and one whose
   unload fails is FENCED for it and *tainted for adapters* (the fleet
   routes no ``policy`` request to it until a later adapter update passes on
   it). The previous adapter keeps serving everywhere.

The fleet's current adapter is ``current``. A replica serves ``policy``
requests (``eligible``) only when its own table's current adapter is that
one, verified on the base its engine serves now, and it is not tainted for
adapters. So:

* a replica outside the pool during an update (fenced, recovering) does not
  get the adapter and serves no ``policy`` request until the next adapter
  update passes on it;
* a replica whose engine was replaced (a recovery: a new process, which
  holds no adapter) serves no ``policy`` request until it has caught up: once
  it serves again (rejoined on the fleet's version) it gets a fresh manager
  for the new process (the names the old one used stay refused, except the
  fleet's current one: same name, same content digest, and a new process has
  no KV under it) and the current adapter is loaded and verified on it alone
  (``catch_up``, started by the pool's change in a thread of its own, bounded
  by ``deadline_s``), then published there; a failure leaves it ineligible
  (tainted for adapters where the unload failed), and the next adapter update
  takes it along as before. One catch-up or update at a time;
* after a full update of the base no replica is eligible until an adapter is
  verified on the new base (``rebase``: the current adapter's files verified
  again on the new base, as a new version).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.control.adapters import (
    ADAPTER_TOLERANCE,
    AdapterManager,
    AdapterResult,
    PreparedAdapter,
    VerifiedAdapter,
    check_probe_tolerance,
)
from rolloutcore.core.adapters import AdapterState, AdapterVersion, adapter_name
from rolloutcore.core.records import fields_dict
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, RolloutCoreError, UpdateFailed, UpdateRefused
from rolloutcore.fleet.model import Replica
from rolloutcore.service.adapter_answer import merged_checks
from rolloutcore.verification.adapters import AdapterSource, adapter_probe
from rolloutcore.verification.probe import ModelOrDir, PolicyProbe

if TYPE_CHECKING:
    import torch

    from rolloutcore.fleet.coordinator import FleetCoordinator

__all__ = ["FleetAdapterFailed", "FleetAdapterResult", "FleetAdapterVersion", "FleetAdapters"]


@dataclass(frozen=True)
class FleetAdapterVersion:
    """The fleet's published adapter: one name on every replica that acknowledged it."""

    generation: int
    name: str
    content_digest: str
    size_bytes: int
    replicas: tuple[str, ...]
    provenance: Provenance

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


@dataclass(frozen=True)
class FleetAdapterResult:
    """A fleet adapter version published: every member's own result (its acknowledgement).

    ``to_dict`` is the answer of ``POST /control/adapters`` on a fleet gateway: the
    one-engine answer's fields for the fleet (``service.adapter_answer``: the checks
    merged, ``acknowledged`` among them) plus ``members``, ``not_serving`` and each
    replica's own answer, so that one parser reads both."""

    version: FleetAdapterVersion
    replicas: Mapping[str, AdapterResult]
    phases: Mapping[str, float]
    #: The fleet's replicas outside the pool during the update (they did not get it).
    not_serving: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        reps = {n: r.to_dict() for n, r in sorted(self.replicas.items())}
        members = sorted(reps)
        acked = [n for n in members if n in self.version.replicas]
        ack = {"name": "acknowledged", "passed": acked == members and bool(members),
               "detail": f"verified and published on {', '.join(acked) or 'no replica'}: "
                         f"{len(acked)} of the {len(members)} serving replicas the update "
                         f"went to (not serving: {', '.join(self.not_serving) or 'none'})",
               "coverage": None, "max_abs_diff": None, "tolerance": None, "level": None}
        return {"version": self.version.to_dict(), "members": members,
                "not_serving": list(self.not_serving), "replicas": reps,
                "checks": [*merged_checks(reps), ack], "phases": dict(self.phases),
                "retired": sorted({x for r in reps.values() for x in r["retired"]}),
                "notes": [f"{n}: {x}" for n, r in reps.items() for x in r["notes"]],
                "base_verified": all(r["base_verified"] for r in reps.values())}


class FleetAdapterFailed(UpdateFailed):
    """The adapter was published nowhere; ``outcomes``: what each replica did with it."""

    def __init__(self, name: str, outcomes: Mapping[str, str], classification: str) -> None:
        self.name = name
        self.outcomes = dict(outcomes)
        super().__init__("fleet_adapter", classification, "READY",
                         f"adapter {name} published nowhere: " + "; ".join(
                             f"{n}: {o}" for n, o in sorted(self.outcomes.items())))

    def to_dict(self) -> dict[str, Any]:
        return {"error": str(self), "adapter": self.name, "replicas": self.outcomes,
                "phase": self.phase, "classification": self.classification}


ManagerFactory = Callable[[Replica], AdapterManager]


class FleetAdapters:
    """The adapter versions of a fleet (module docstring). Thread-safe.

    ``make_manager(replica)``: the ``AdapterManager`` of a replica's engine (called
    at start, and again for a replica whose engine was replaced). ``base_model``:
    the base the adapters apply to (for the reference computed once).
    ``deadline_s``: how long the verification on every replica may take.
    """

    def __init__(self, coordinator: FleetCoordinator, make_manager: ManagerFactory, *,
                 base_model: ModelOrDir,
                 deadline_s: float = 300.0, probe_tolerance: float = ADAPTER_TOLERANCE,
                 max_rank: int | None = None) -> None:
        from rolloutcore.fleet.coordinator import FleetCoordinator

        if not isinstance(coordinator, FleetCoordinator):
            raise BadInput("coordinator must be a FleetCoordinator")
        if not callable(make_manager):
            raise BadInput("make_manager must be a callable (replica -> AdapterManager)")
        if base_model is None:
            raise BadInput("base_model: the base checkpoint directory (or a HF causal LM)")
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or \
                not 0 < deadline_s < float("inf"):
            raise BadInput(f"deadline_s must be a positive number, got {deadline_s!r}")
        if max_rank is not None and (isinstance(max_rank, bool) or not isinstance(
                max_rank, int) or max_rank < 1):
            raise BadInput(f"max_rank must be an int >= 1, got {max_rank!r}")
        self.coordinator = coordinator
        self.base_model = base_model
        self.deadline_s = float(deadline_s)
        self.probe_tolerance = probe_tolerance
        self.max_rank = max_rank
        self._make = make_manager
        self._update = threading.Lock()     # one fleet adapter update at a time
        self._mem = threading.Lock()        # the fields below; nothing waits under it
        self.managers: dict[str, AdapterManager] = {}
        self._epochs: dict[str, str | None] = {}
        for name, rep in coordinator.replicas.items():
            m = make_manager(rep)
            if not isinstance(m, AdapterManager) or m.controller is not rep.controller:
                raise BadInput(f"make_manager({name}) must return the AdapterManager of that "
                               f"replica's controller")
            self.managers[name] = m
            self._epochs[name] = _epoch(rep)
        self._current: FleetAdapterVersion | None = None
        self._tainted: dict[str, str] = {}
        self._next = 1
        self._watchers: list[Callable[[], None]] = []
        #: the current version's reference (a catch-up verifies against the same one)
        self._probe: tuple[str, PolicyProbe] | None = None
        #: what the last catch-up of each replica ended with (``status``)
        self.caught_up: dict[str, str] = {}
        self._catching: set[str] = set()
        self._closed = False
        coordinator.on_change(self._pool_changed)

    # ------------------------------------------------------------------ reading
    @property
    def current(self) -> FleetAdapterVersion | None:
        return self._current

    def manager(self, name: str) -> AdapterManager:
        m = self.managers.get(name)
        if m is None:
            raise BadInput(f"no replica named {name!r} in this fleet")
        return m

    def eligible(self, name: str) -> bool:
        """Whether replica ``name`` may serve ``policy`` requests on the current adapter."""
        cur = self._current
        m = self.managers.get(name)
        if cur is None or m is None or name in self._tainted:
            return False
        v = m.view.current
        committed = self.coordinator.replicas[name].controller.view.committed
        return (v is not None and v.name == cur.name and committed is not None
                and v.base == committed.label)

    def is_adapter(self, model: str) -> bool:
        return any(m.is_adapter(model) for m in self.managers.values())

    def status(self) -> dict[str, Any]:
        cur = self._current
        reps = {}
        for n, m in self.managers.items():
            v = m.view
            reps[n] = {"current": None if v.current is None else v.current.to_dict(),
                       "states": {k: s.value for k, s in v.states.items()},
                       "bound": dict(v.bound), "eligible": self.eligible(n),
                       "tainted": self._tainted.get(n), "caught_up": self.caught_up.get(n)}
        newest = self.coordinator.pool.newest
        # The fleet's version the adapters apply to now (a trainer holds it: its identity).
        base = None if newest is None else {"generation": newest.generation,
                                            "label": newest.label,
                                            "identity": newest.identity.to_dict()}
        return {"current": None if cur is None else cur.to_dict(), "base": base,
                "replicas": reps}

    def watch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (never under a lock) after the fleet's current adapter changed."""
        self._watchers.append(fn)
        for m in self.managers.values():
            m.shell.watch(fn)

    # ------------------------------------------------------------------ update
    def update(self, adapter: ModelOrDir, provenance: Provenance, *,
               reference: torch.nn.Module | None = None,
               probe_tolerance: float | None = None) -> FleetAdapterResult:
        """Publish ``adapter`` (a PEFT model or an adapter directory) on every serving
        replica, or nowhere (``FleetAdapterFailed``; ``UpdateRefused``/``BadInput``:
        nothing changed). See the module docstring."""
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        tol = check_probe_tolerance(probe_tolerance, self.probe_tolerance)
        if not self._update.acquire(blocking=False):
            raise UpdateRefused("a fleet adapter update is running; one at a time")
        try:
            return self._run(adapter, provenance, reference, tol)
        finally:
            self._update.release()

    def rebase(self, provenance: Provenance, *, base_model: ModelOrDir | None = None
               ) -> FleetAdapterResult:
        """After a full update of the base: the current adapter's files verified again on
        the base every replica serves now, published as a new version (a new name:
        its KV and its probe are the new base's). ``base_model``: the new base's
        checkpoint (the references), default the one given before."""
        cur = self._current
        if cur is None:
            raise UpdateRefused("no adapter is published: nothing to rebase")
        if base_model is not None:
            self.set_base(base_model)
        src = self._kept_source(cur)
        if src is None:
            raise UpdateRefused(f"the files of {cur.name} are gone: publish the adapter again")
        return self.update(src, provenance)

    def restore(self, changes: Mapping[str, Any]) -> AdapterVersion | None:
        """The replicas' journals' adapter records (name -> its ``AdapterChange``s): every
        name stays refused on every replica, generations continue above them, and the
        adapter they had all published last is returned (``None`` if they disagree or
        had none): not claimed, since the engines may be new processes; the caller
        publishes its files again (``update``), verified, under a new name."""
        was: dict[str, AdapterVersion | None] = {}
        for n, ch in changes.items():
            was[n] = self.manager(n).restore(ch)
            gens = [c.generation for c in ch]
            if gens:
                self._next = max(self._next, max(gens) + 1)
        names = {w.name for w in was.values() if w is not None}
        if len(names) != 1 or any(w is None for w in was.values()):
            return None
        for w in was.values():
            if w is not None and (Path(w.path) / "adapter_config.json").is_file():
                src = AdapterSource.of(Path(w.path))
                if src.content_digest == w.content_digest:
                    return w
        return None

    def set_base(self, base_model: ModelOrDir) -> None:
        """The base every replica serves after a full update (the references' base)."""
        if base_model is None:
            raise BadInput("base_model must be a checkpoint directory or a HF causal LM")
        with self._update:
            self.base_model = base_model
            for m in self.managers.values():
                m.set_base(base_model)

    def _kept_source(self, cur: FleetAdapterVersion) -> Path | None:
        for n in cur.replicas:
            m = self.managers.get(n)
            if m is not None:
                p = m.store / cur.name
                if (p / "adapter_config.json").is_file():
                    return p
        return None

    def _run(self, adapter: ModelOrDir, provenance: Provenance,
             reference: torch.nn.Module | None, tol: float
             ) -> FleetAdapterResult:
        t0 = time.perf_counter()
        members = self._members()
        for n in members:
            self.managers[n].check_base()
        # -- prepare once: checked, digested, named, its reference computed
        src = AdapterSource.of(adapter, max_rank=self._max_rank())
        # The budget of every replica, before anything is written or loaded anywhere
        # (superseded adapters that may go are unloaded first, as each update does).
        full = {}
        for n in members:
            m = self.managers[n]
            m.sweep()
            why = m.shell.read(lambda m=m: m.table.fits(src.size_bytes))
            if why is not None:
                full[n] = why
        if full:
            raise UpdateRefused("the adapter does not fit on " + "; ".join(
                f"{n}: {w}" for n, w in sorted(full.items())) + "; nothing was loaded")
        gen = max(self._next, *(m.shell.read(lambda m=m: m.table.next_generation)
                                for m in self.managers.values()))
        name = adapter_name(gen, src.content_digest)
        paths: dict[str, Path] = {}
        try:
            for n in members:
                p = self.managers[n].store / name
                src.write(p)
                paths[n] = p
            probe = adapter_probe(self.base_model, paths[members[0]], reference=reference,
                                  tolerance=tol)
            probe_kept = (name, probe)
        except BaseException:
            for p in paths.values():
                shutil.rmtree(p, ignore_errors=True)
            raise
        self._next = gen + 1
        prep_s = time.perf_counter() - t0
        prepared = {}
        for n in members:
            base = self.coordinator.replicas[n].controller.committed
            if base is None:
                raise UpdateRefused(f"replica {n} has no committed base")
            prepared[n] = PreparedAdapter(AdapterVersion(
                gen, name, str(paths[n].resolve()), src.content_digest, base.label,
                src.size_bytes), src, provenance, probe, prep_s)
        # -- verify on every replica at once, each within the deadline
        t1 = time.perf_counter()
        deadline = time.monotonic() + self.deadline_s
        got: dict[str, VerifiedAdapter | BaseException] = {}
        with ThreadPoolExecutor(max_workers=len(members),
                                thread_name_prefix="rc-fleet-adapter") as pool:
            futs = {n: pool.submit(self.managers[n].verify, prepared[n], deadline=deadline)
                    for n in members}
            for n, f in futs.items():
                try:
                    got[n] = f.result()
                except BaseException as exc:   # each one's outcome, all of them awaited
                    got[n] = exc
        verify_s = time.perf_counter() - t1
        failed = {n: r for n, r in got.items() if not isinstance(r, VerifiedAdapter)}
        if not failed:
            # Every base still the one it was verified on, or nothing is published.
            for n in members:
                c = self.coordinator.replicas[n].controller.view.committed
                if c is None or c.label != prepared[n].version.base:
                    failed[n] = UpdateFailed("publish", "no_mutation", "READY",
                                             f"its base moved to {c} during the verification")
        if failed:
            self._abandon(name, got, failed, paths)
        # -- publish on each, then it is the fleet's
        results: dict[str, AdapterResult] = {}
        t2 = time.perf_counter()
        for i, n in enumerate(members):
            v = got[n]
            assert isinstance(v, VerifiedAdapter)
            try:
                results[n] = self.managers[n].publish(v)
            except BaseException as exc:
                self._broken_off(name, members[:i], members[i:], got, exc, paths)
            with self._mem:
                self._tainted.pop(n, None)
        fv = FleetAdapterVersion(gen, name, src.content_digest, src.size_bytes,
                                 tuple(members), provenance)
        with self._mem:
            self._current = fv
            self._probe = probe_kept
        for w in list(self._watchers):
            w()
        return FleetAdapterResult(fv, results, {
            "prepare": prep_s, "verify": verify_s, "publish": time.perf_counter() - t2,
            "total": time.perf_counter() - t0},
            tuple(sorted(n for n in self.managers if n not in members)))

    def _broken_off(self, name: str, published: list[str], rest: list[str],
                    got: Mapping[str, VerifiedAdapter | BaseException], exc: BaseException,
                    paths: Mapping[str, Path]) -> None:
        """The publish loop broke off at ``rest[0]`` (#47): the fleet keeps its current
        adapter; where the new one is still verifying it is unloaded (``_abandon``), and a
        replica that published it is tainted for adapters (it answers for an adapter the
        fleet does not route) until an adapter update passes on it."""
        why = f"the fleet's publish broke off at {rest[0]} ({type(exc).__name__}: {exc})"
        m = self.managers[rest[0]]
        if m.shell.read(lambda: m.table.state(name)) not in (
                AdapterState.VERIFYING, AdapterState.REFUSED, None):
            published = [*published, rest[0]]   # it moved before the failure
        with self._mem:
            for n in published:
                self._tainted[n] = (f"adapter {name} published here but not on the fleet "
                                    f"({why[:300]}): no policy request until an adapter "
                                    "update passes")
        left = {n: got[n] for n in rest if isinstance(got[n], VerifiedAdapter) and
                self.managers[n].shell.read(lambda n=n: self.managers[n].table.state(name))
                is AdapterState.VERIFYING}
        try:
            self._abandon(name, left, {rest[0]: exc}, paths)
        except FleetAdapterFailed as failed:
            outcomes = {**failed.outcomes, **{n: "published, then tainted for adapters (the "
                                              "fleet's publish broke off)" for n in published}}
            raise FleetAdapterFailed(name, outcomes, "ambiguous" if published
                                     else failed.classification) from exc
        except UpdateRefused as refused:
            raise FleetAdapterFailed(name, {n: "published, then tainted for adapters"
                                            for n in published} or {rest[0]: str(refused)},
                                     "ambiguous" if published else "no_mutation") from exc

    def _abandon(self, name: str, got: Mapping[str, VerifiedAdapter | BaseException],
                 failed: Mapping[str, BaseException], paths: Mapping[str, Path]) -> None:
        """Nothing published: unload it where it was verified; taint where that fails."""
        outcomes: dict[str, str] = {}
        why = "; ".join(f"{n}: {e}" for n, e in failed.items())[:800]
        fenced = False
        for n, r in got.items():
            if isinstance(r, VerifiedAdapter):
                st = self.managers[n].abandon(r, f"another replica failed it ({why})")
                outcomes[n] = f"verified, not published: {st}"
            else:
                st_now = self.managers[n].shell.read(lambda n=n: self.managers[n].table.state(
                    name))
                outcomes[n] = f"failed ({type(r).__name__}: {r})"[:600]
                if st_now is None:
                    outcomes[n] += " (nothing loaded)"
                st = "" if st_now is None else st_now.value
            if st == "fenced":
                fenced = True
                with self._mem:
                    self._tainted[n] = (f"adapter {name} could not be unloaded (fenced): "
                                        f"no policy request until an adapter update passes")
            elif st in ("refused", ""):
                shutil.rmtree(paths[n], ignore_errors=True)
        refusals = [e for e in failed.values() if isinstance(e, (UpdateRefused, BadInput))]
        if len(refusals) == len(got) and all(
                isinstance(r, BaseException) for r in got.values()):
            raise UpdateRefused(f"adapter {name} refused by every replica, nothing changed: "
                                + "; ".join(f"{n}: {o}" for n, o in sorted(outcomes.items())))
        raise FleetAdapterFailed(name, outcomes, "ambiguous" if fenced else "no_mutation")

    def _members(self) -> list[str]:
        """The serving replicas the update goes to (a replaced engine's manager renewed)."""
        serving = set(self.coordinator.serving())
        members = [n for n in self.managers if n in serving]
        if not members:
            raise UpdateRefused("no replica is serving: no adapter update now")
        for n in members:
            self._renew(n)
        return members

    def _renew(self, n: str, *, keep: str | None = None) -> bool:
        """A fresh manager for replica ``n`` if its engine is a new process (it holds no
        adapter); its table keeps refusing every name the old one used but ``keep``.
        Whether it was renewed."""
        rep = self.coordinator.replicas[n]
        ep = _epoch(rep)
        if ep == self._epochs.get(n):
            return False
        old = self.managers[n]
        new = self._make(rep)
        new.shell.run(new.table.note_loaded,
                      {k: "seen" for k in old.view.states if k != keep})
        for w in self._watchers:
            new.shell.watch(w)
        with self._mem:
            self.managers[n] = new
            self._epochs[n] = ep
            self._tainted.pop(n, None)
        return True

    # ------------------------------------------------------------------ catch-up
    def catch_up(self, name: str) -> str:
        """Give replica ``name`` the fleet's current adapter when its engine was replaced
        (module docstring): loaded and verified against the current version's
        reference on it alone, then published there. Returns what happened, in words
        ("published", or why nothing was done); ``BadInput`` for an unknown replica.
        Refused (words, nothing done) while a fleet adapter update runs."""
        if name not in self.managers:
            raise BadInput(f"no replica named {name!r} in this fleet")
        if not self._update.acquire(blocking=False):
            return "a fleet adapter update runs: it takes the serving replicas along"
        try:
            out = self._catch_up(name)
        finally:
            self._update.release()
        with self._mem:
            self.caught_up[name] = out
        if out == "published":
            for w in list(self._watchers):
                w()
        return out

    def _catch_up(self, name: str) -> str:
        cur, kept = self._current, self._probe
        if cur is None:
            return "no adapter is published"
        if name not in self.coordinator.serving():
            return "not serving"
        if self.eligible(name):
            return "already serves the current adapter"
        rep = self.coordinator.replicas[name]
        if _epoch(rep) == self._epochs.get(name):
            return ("the same engine process as before: the next adapter update gives it "
                    "one (a name is never reloaded into a process that held it)")
        base = rep.controller.committed
        if base is None:
            return "no committed base"
        src_path = self._kept_source(cur)
        if src_path is None:
            return f"the files of {cur.name} are gone: the next adapter update gives it one"
        src = AdapterSource.of(src_path, max_rank=self._max_rank())
        if src.content_digest != cur.content_digest:
            return f"the kept files of {cur.name} no longer have its digest: not loaded"
        self._renew(name, keep=cur.name)
        m = self.managers[name]
        m.check_base()
        probe = kept[1] if kept is not None and kept[0] == cur.name else adapter_probe(
            self.base_model, src_path, tolerance=self.probe_tolerance)
        path = m.store / cur.name
        if path.resolve() != src_path.resolve():
            src.write(path)
        prepared = PreparedAdapter(AdapterVersion(
            cur.generation, cur.name, str(path.resolve()), src.content_digest, base.label,
            src.size_bytes), src, cur.provenance, probe, 0.0)
        try:
            verified = m.verify(prepared, deadline=time.monotonic() + self.deadline_s)
            m.publish(verified)
        except (UpdateFailed, UpdateRefused, BadInput) as exc:
            if m.shell.read(lambda: m.table.state(cur.name)) is AdapterState.FENCED:
                with self._mem:
                    self._tainted[name] = (f"adapter {cur.name} could not be unloaded after "
                                           f"its catch-up failed (fenced): no policy request "
                                           f"until an adapter update passes")
            return f"failed ({type(exc).__name__}: {exc})"[:600]
        with self._mem:
            if self._current is cur:
                self._current = dataclasses.replace(
                    cur, replicas=tuple(sorted({*cur.replicas, name})))
        return "published"

    def _pool_changed(self) -> None:
        """The pool or an engine changed: a serving replica on a new process that does not
        serve the current adapter gets a catch-up, in a thread of its own."""
        if self._closed or self._current is None:
            return
        serving = set(self.coordinator.serving())
        for n in self.managers:
            if n not in serving or self.eligible(n) or n in self._tainted:
                continue
            if _epoch(self.coordinator.replicas[n]) == self._epochs.get(n):
                continue
            with self._mem:
                if n in self._catching:
                    continue
                self._catching.add(n)
            threading.Thread(target=self._catch_up_thread, args=(n,), daemon=True,
                             name=f"rc-adapter-catch-up-{n}").start()

    def _catch_up_thread(self, n: str) -> None:
        try:
            if not self._closed:
                self.catch_up(n)
        except Exception as exc:   # recorded; the replica stays ineligible
            with self._mem:
                self.caught_up[n] = f"failed ({type(exc).__name__}: {exc})"[:600]
        finally:
            with self._mem:
                self._catching.discard(n)

    def _max_rank(self) -> int | None:
        ranks = [m.max_rank for m in self.managers.values() if m.max_rank is not None]
        if self.max_rank is not None:
            ranks.append(self.max_rank)
        return min(ranks) if ranks else None

    def close(self) -> None:
        self._closed = True
        for m in self.managers.values():
            with contextlib.suppress(RolloutCoreError):
                m.close()


def _epoch(rep: Replica) -> str | None:
    c = rep.controller.view.committed
    return None if c is None else c.engine_epoch
