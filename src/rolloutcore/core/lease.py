"""The trainer protocol's machine: each update's lease, from its grant to its one ending.

House rules, as ``core.lifecycle``'s: one table decides (``LEASE_TRANSITIONS``:
the one target of each legal (state, event); anything else is an
``InvalidTransition`` that changes nothing), nothing here locks, reads a
clock or does I/O, and the shell (``control.shell``, driven by
``service.control.UpdateManager``) runs it, delivers its records to the
journal after its lock is released and publishes a snapshot.

A begin grants a lease (OPEN). Exactly one of two things then decides the
update: the trainer's report (REPORTING: the runner validates, resumes and
publishes or classifies) or the lease running out (EXPIRING: the runner
classifies from the engine's own write counters). Each ends in one final
state, PUBLISHED, FAILED or EXPIRED, with its result; ``final`` says so, so a
reader that polls never mistakes the classification in progress for an
ending. One lease at a time is not final (the controller's single writer).

Standard library only.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rolloutcore.core.strict import check_int
from rolloutcore.core.vocab import Machine, Record, TypedRecord
from rolloutcore.errors import BadInput, InvalidTransition, UpdateRefused

__all__ = [
    "FINAL",
    "LEASE_RECORDS",
    "LEASE_TRANSITIONS",
    "Lease",
    "LeaseChange",
    "LeaseEvent",
    "LeaseState",
    "LeaseTable",
]


class LeaseState(enum.StrEnum):
    OPEN = "open"              # granted: the trainer transfers and reports before the deadline
    REPORTING = "reporting"    # its report is being validated (the runner's close)
    EXPIRING = "expiring"      # no report in time: classified from the engine's counters
    PUBLISHED = "published"
    FAILED = "failed"          # reported, and the update published nothing
    EXPIRED = "expired"        # classified without a report


class LeaseEvent(enum.StrEnum):
    REPORT = "report"          # the lease's holder reported (evidence or a failure)
    EXPIRE = "expire"          # the deadline passed, the begin's answer was lost, shutdown
    PUBLISHED = "published"
    FAILED = "failed"
    CLASSIFIED = "classified"  # the expiry's classification is in


L, LE = LeaseState, LeaseEvent

#: (state, event) -> the one state it leads to.
LEASE_TRANSITIONS: Mapping[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (L.OPEN, LE.REPORT): L.REPORTING,
    (L.OPEN, LE.EXPIRE): L.EXPIRING,
    (L.REPORTING, LE.PUBLISHED): L.PUBLISHED,
    (L.REPORTING, LE.FAILED): L.FAILED,
    (L.EXPIRING, LE.CLASSIFIED): L.EXPIRED,
}

#: The endings: a lease here has its result and changes no more.
FINAL = frozenset({L.PUBLISHED, L.FAILED, L.EXPIRED})


@dataclass(frozen=True)
class LeaseChange(TypedRecord):
    """A lease's state changed (``LEASE_TRANSITIONS``); ``granted`` is its first record."""

    KIND: ClassVar[str] = "lease"
    update_id: int
    before: LeaseState | None      # None: the grant
    after: LeaseState
    event: LeaseEvent | None
    owner: str
    reason: str = ""


LEASE_RECORDS: tuple[type[Record], ...] = (LeaseChange,)


@dataclass(frozen=True)
class Lease:
    """One lease as the table holds it (immutable: a change is a new ``Lease``)."""

    update_id: int
    owner: str
    state: LeaseState = L.OPEN
    result: Mapping[str, Any] | None = field(default=None, compare=False)

    @property
    def final(self) -> bool:
        return self.state in FINAL


class LeaseTable(Machine):
    """The leases of one gateway, sans I/O (see the module docstring).

    Final leases are kept until ``forget`` (whoever answers for them bounds
    how many); a lease that is not final cannot be forgotten.
    """

    def __init__(self, *, now: float = 0.0) -> None:
        super().__init__(now)
        self._leases: dict[int, Lease] = {}

    def view(self) -> Mapping[int, Lease]:
        return dict(self._leases)

    def get(self, update_id: int) -> Lease | None:
        return self._leases.get(update_id)

    @property
    def active(self) -> Lease | None:
        """The one lease that is not final, if any."""
        for lease in reversed(self._leases.values()):
            if not lease.final:
                return lease
        return None

    # ---------------------------------------------------------------- decisions
    def grant(self, update_id: int, owner: str) -> Lease:
        """A begin's lease (OPEN); refused while another is not final (one writer)."""
        check_int("update_id", update_id, 1)
        if update_id in self._leases:
            raise BadInput(f"update {update_id} already has a lease")
        busy = self.active
        if busy is not None:
            raise UpdateRefused(f"update {busy.update_id} by {busy.owner!r} holds the lease "
                                f"({busy.state.value}); one writer at a time")
        lease = self._leases[update_id] = Lease(update_id, owner)
        self._outbox.append(LeaseChange(update_id, None, L.OPEN, None, owner))
        return lease

    def forget(self, update_id: int) -> None:
        """Drop a final lease (nothing is recorded: its ending was)."""
        lease = self._leases.get(update_id)
        if lease is None:
            return
        if not lease.final:
            raise InvalidTransition("forget", lease.state.value, "the lease is not final")
        del self._leases[update_id]

    def move(self, update_id: int, event: LeaseEvent, *, reason: str = "",
             result: Mapping[str, Any] | None = None) -> Lease:
        """One event of a lease (``LEASE_TRANSITIONS``); an ending carries its ``result``."""
        lease = self._leases.get(update_id)
        if lease is None:
            raise BadInput(f"no lease for update {update_id}")
        after = LEASE_TRANSITIONS.get((lease.state, event))
        if after is None:
            raise InvalidTransition(event.value, lease.state.value, "not in LEASE_TRANSITIONS")
        if (after in FINAL) != (result is not None):
            raise BadInput(f"{after.value}: a lease ends with its result, and only then")
        new = self._leases[update_id] = Lease(update_id, lease.owner, after,
                                              None if result is None else dict(result))
        self._outbox.append(LeaseChange(update_id, lease.state, after, event, lease.owner,
                                        reason[:500]))
        return new
