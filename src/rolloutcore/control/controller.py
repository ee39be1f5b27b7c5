"""The lifecycle controller: the engine's machine (``core.lifecycle``) in its shell.

``LifecycleController`` is what every caller holds (the runner, the data
plane, the fleet): each of its decisions is one call of the pure
``Lifecycle`` under the shell's lock (``control.shell``), its records
delivered to the listeners (the journal, the metrics) after the lock is
released, durable before a decision that waits returns. Queries a hot path
makes (``state``, ``committed``, ``identity``, ``load``) read the snapshot
the shell published after the last decision, without locking. See
``core.lifecycle`` for what is decided and why.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from rolloutcore.control.shell import Listener, Shell, Sink
from rolloutcore.core import evidence as ev
from rolloutcore.core.lifecycle import Lifecycle
from rolloutcore.core.lifecycle_state import (
    Completion,
    ControllerConfig,
    SleepTicket,
    UpdateTicket,
    verification_of,
)
from rolloutcore.core.records import (
    FailureKind,
    JournalRecord,
    Record,
    State,
    Step,
    UpdateMode,
    Verdict,
)
from rolloutcore.core.versions import Binding, VerificationLevel, WeightIdentity, WeightVersion

__all__ = ["ControllerView", "LifecycleController", "Listener", "Sink"]


@dataclass(frozen=True, slots=True)
class ControllerView:
    """What the shell publishes after every decision: read without the lock."""

    state: State
    committed: WeightVersion | None
    identity: WeightIdentity | None
    failed_closed: str | None
    load: int                      # rollouts bound


def _view(m: Lifecycle) -> ControllerView:
    # While a commit is unrecorded the shell shows the view before it; a commit whose
    # record never reached the journal (its sync failed) is never shown.
    committed, identity = m.on_record
    return ControllerView(m.state, committed, identity, m.failed_closed, m.active_count)


class LifecycleController:
    """The sans-I/O lifecycle of one engine, thread-safe (see the module docstring).

    ``clock`` is the only time source (``wait_idle``, transition durations,
    binding times): inject a fake one to test timing without sleeping.
    """

    def __init__(self, *, config: ControllerConfig | None = None,
                 required_caches: tuple[ev.CacheKind, ...] = tuple(ev.CacheKind),
                 clock: Callable[[], float] = time.monotonic,
                 listener: Listener | None = None,
                 _machine: Lifecycle | None = None) -> None:
        m = _machine or Lifecycle(config=config, required_caches=required_caches,
                                  now=clock())
        self._shell: Shell[Lifecycle, ControllerView] = Shell(m, _view, clock=clock,
                                                              listener=listener)
        self._m = m

    # ---------------------------------------------------------------- snapshot reads
    @property
    def view(self) -> ControllerView:
        """The snapshot after the last decision (no lock)."""
        return self._shell.view

    @property
    def state(self) -> State:
        return self._shell.view.state

    @property
    def committed(self) -> WeightVersion | None:
        return self._shell.view.committed

    @property
    def identity(self) -> WeightIdentity | None:
        return self._shell.view.identity

    @property
    def failed_closed(self) -> str | None:
        """Why the controller refuses every step (a record could not be delivered), or None."""
        return self._shell.view.failed_closed

    @property
    def load(self) -> int:
        """Rollouts bound now (the snapshot's count)."""
        return self._shell.view.load

    # ---------------------------------------------------------------- locked reads
    @property
    def published(self) -> tuple[WeightVersion, ...]:
        return self._shell.read(lambda: self._m.published)

    @property
    def active(self) -> Mapping[str, Binding]:
        return self._shell.read(lambda: self._m.active)

    @property
    def current_ticket(self) -> UpdateTicket | None:
        return self._shell.read(lambda: self._m.current_ticket)

    @property
    def current_sleep(self) -> SleepTicket | None:
        """The sleep in progress (DOZING to the wake's publish or taint), or None."""
        return self._shell.read(lambda: self._m.current_sleep)

    @property
    def pending_resets(self) -> frozenset[ev.CacheKind]:
        return self._shell.read(lambda: self._m.pending_resets)

    @property
    def update_mode(self) -> UpdateMode:
        return self._m.config.update_mode

    @property
    def max_staleness(self) -> int | None:
        return self._m.config.max_staleness

    @property
    def config(self) -> ControllerConfig:
        return self._m.config

    def serving_version(self, rollout_id: str) -> WeightVersion | None:
        """The version a bound rollout's next tokens come from (None: not bound)."""
        return self._shell.read(self._m.serving_version, rollout_id)

    def over_bound(self, rollout_id: str) -> bool:
        """Whether an update ended this rollout for exceeding ``max_staleness`` (recently)."""
        return self._shell.read(self._m.over_bound, rollout_id)

    @property
    def stale_rollouts(self) -> int:
        """Bound rollouts admitted under a version older than the committed one."""
        return self._shell.read(lambda: self._m.stale_rollouts)

    @property
    def sweep_due(self) -> bool:
        """A prefix reset deferred by a keep-mode update is still to be done."""
        return self._shell.read(lambda: self._m.sweep_due)

    def history(self) -> list[dict[str, Any]]:
        """Transitions with the time spent in the state that was left."""
        return self._shell.read(self._m.history)

    def snapshot(self) -> dict[str, Any]:
        return self._shell.read(self._m.snapshot)

    def wake_target(self, owner: str, identity: WeightIdentity | None = None, *,
                    label: str | None = None) -> ev.UpdateTarget:
        """What ``request_wake`` would install (changes nothing)."""
        return self._shell.read(self._m.wake_target, owner, identity, label=label)

    def recovery_target(self) -> WeightVersion:
        """The version a recovery would publish (its label must be set on the new engine)."""
        return self._shell.read(self._m.recovery_target)

    #: The level a set of validations reached (``core.lifecycle.verification_of``).
    _verification = staticmethod(verification_of)

    # ---------------------------------------------------------------- listeners
    def add_listener(self, listener: Listener) -> None:
        """Listeners see every record, in order, outside the lock (``control.shell``)."""
        self._shell.add_listener(listener)

    def fail_closed(self, reason: str) -> None:
        """Refuse every further step: something the records go to failed (the journal)."""
        self._shell.fail_closed(reason)

    def on_recorded(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once a published version's commit record is on record (or
        was lost): admissions refused while it was being recorded may be retried."""
        self._shell.on_recorded(callback)

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until no rollout is bound (or the timeout, on the injected clock)."""
        return self._shell.wait_for(lambda m: m.active_count == 0, timeout_s)

    # ---------------------------------------------------------------- decisions
    def bootstrap(self, ev: ev.BootstrapEvidence, identity: WeightIdentity,
                  label: str | None = None, *,
                  validations: Iterable[ev.ValidationEvidence] = (),
                  min_verification: VerificationLevel = VerificationLevel.DECLARED,
                  ) -> Verdict:
        return self._shell.run(self._m.bootstrap, ev, identity, label,
                               validations=validations, min_verification=min_verification)

    def admit(self, rollout_id: str, expect: WeightVersion | None = None) -> Binding:
        """Bind a rollout to the committed version (``expect``: the version it was
        routed for; another one refuses, retryably)."""
        return self._shell.run(self._m.admit, rollout_id, expect, wait=False)

    def complete(self, rollout_id: str) -> Completion:
        return self._shell.run(self._m.complete, rollout_id, wait=False)

    def abort_rollouts(self, ticket: UpdateTicket, rollout_ids: Iterable[str],
                       reason: str) -> list[Completion]:
        return self._shell.run(self._m.abort_rollouts, ticket, rollout_ids, reason)

    def request_update(self, target_identity: WeightIdentity, owner: str, *,
                       label: str | None = None,
                       min_verification: VerificationLevel = VerificationLevel.DECLARED,
                       ) -> UpdateTicket:
        return self._shell.run(self._m.request_update, target_identity, owner, label=label,
                               min_verification=min_verification)

    def _inside(self, step: Callable[..., Verdict], ticket: UpdateTicket, evidence: object
                ) -> Verdict:
        """A step inside an update, group-committed (``Shell.run(durable=False)``): a
        restart reads a journal that ends at any of them as one that ends at the
        decision before it (the update in flight fails ``restart``: TAINTED), so they
        reach the file with the next decision that syncs (begin_update, the publish),
        or within the journal's ``defer_s``. A verdict that refuses is a decision:
        synced at once."""
        v: Verdict = self._shell.run(step, ticket, evidence, durable=False)
        if not v.accepted:
            self._shell.run(_nothing)
        return v

    def drained(self, ticket: UpdateTicket, ev: ev.DrainEvidence) -> Verdict:
        return self._inside(self._m.drained, ticket, ev)

    def preflighted(self, ticket: UpdateTicket, ev: ev.PreflightEvidence) -> Verdict:
        # Durable: its begin_update burns the target's label before it can reach the engine.
        return self._shell.run(self._m.preflighted, ticket, ev)

    def transferred(self, ticket: UpdateTicket, ev: ev.TransferEvidence) -> Verdict:
        return self._inside(self._m.transferred, ticket, ev)

    def invalidated(self, ticket: UpdateTicket, ev: ev.CacheResetEvidence) -> Verdict:
        return self._inside(self._m.invalidated, ticket, ev)

    def validated(self, ticket: UpdateTicket, ev: ev.ValidationEvidence) -> Verdict:
        return self._inside(self._m.validated, ticket, ev)

    def resumed(self, ticket: UpdateTicket, ev: ev.ResumeEvidence,
                live: ev.ValidationEvidence | None = None) -> Verdict:
        return self._shell.run(self._m.resumed, ticket, ev, live)

    def fail(self, ticket: UpdateTicket | SleepTicket | None, step: Step, kind: FailureKind,
             reason: str) -> Verdict:
        return self._shell.run(self._m.fail, ticket, step, kind, reason)

    def swept(self, ev: ev.CacheResetEvidence) -> bool:
        return self._shell.run(self._m.swept, ev)

    def request_sleep(self, owner: str, level: int = 2) -> SleepTicket:
        return self._shell.run(self._m.request_sleep, owner, level)

    def slept(self, ticket: SleepTicket, ev: ev.SleepEvidence) -> Verdict:
        return self._shell.run(self._m.slept, ticket, ev)

    def request_wake(self, sleep: SleepTicket, owner: str,
                     identity: WeightIdentity | None = None, *, label: str | None = None,
                     min_verification: VerificationLevel = VerificationLevel.ENGINE_CHECKSUM,
                     preflight: ev.PreflightEvidence | None = None) -> UpdateTicket:
        return self._shell.run(self._m.request_wake, sleep, owner, identity, label=label,
                               min_verification=min_verification, preflight=preflight)

    def woke(self, ticket: UpdateTicket, ev: ev.WakeEvidence) -> Verdict:
        return self._shell.run(self._m.woke, ticket, ev)

    def begin_recovery(self, owner: str) -> None:
        self._shell.run(self._m.begin_recovery, owner)

    def recovered(self, ev: ev.RecoveryEvidence) -> Verdict:
        return self._shell.run(self._m.recovered, ev)

    # ---------------------------------------------------------------- crash restore
    @classmethod
    def restore(cls, records: Iterable[Record | JournalRecord], *,
                config: ControllerConfig | None = None,
                required_caches: tuple[ev.CacheKind, ...] = tuple(ev.CacheKind),
                clock: Callable[[], float] = time.monotonic,
                listener: Listener | None = None) -> LifecycleController:
        """Rebuild a controller by replaying the records of its journal.

        The replay (``Lifecycle.replay``) checks every record against the
        tables; the restored controller then fails an update, recovery or
        sleep that was in flight (``Step.RESTART``: TAINTED) and releases the
        rollouts the dead process had bound, unattributable
        (``Lifecycle.restored``), and records that with ``listener``.
        """
        m = Lifecycle(config=config, required_caches=required_caches, now=clock())
        m.replay(records)
        c = cls(clock=clock, _machine=m)
        if listener is not None:
            c.add_listener(listener)
        c._shell.run(m.restored)
        return c


def _nothing() -> None:
    """A decision of nothing: ``Shell.run`` of it syncs what is pending."""
