"""Builders shared by the core tests: good evidence for each step, drive_to(state), whole()."""

from __future__ import annotations

from typing import Any

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    Check,
    DrainEvidence,
    PauseMode,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    SleepEvidence,
    TransferEvidence,
    ValidationEvidence,
    WakeEvidence,
    WakeTags,
)
from rolloutcore.core.lifecycle import FailureKind, State, Step
from rolloutcore.core.lifecycle_state import SleepTicket, UpdateTicket
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
)

MANIFEST = ParameterManifest.from_items([("w", (2, 2), "bfloat16"), ("b", (2,), "bfloat16")])


def ident(step: int = 0, ckpt: str = "ckpt") -> WeightIdentity:
    return WeightIdentity.declare(MANIFEST, Provenance(ckpt, "run", step))


def boot_ev(epoch: str = "e0") -> BootstrapEvidence:
    return BootstrapEvidence(engine_epoch=epoch, healthy=True, observed_label="default",
                             label_supported=True)


def drain_ev() -> DrainEvidence:
    return DrainEvidence(paused=True, mode=PauseMode.WAIT, engine_in_flight=0)


def preflight_ev(t: UpdateTicket) -> PreflightEvidence:
    return PreflightEvidence(source_manifest_digest=t.target.identity.manifest_digest,
                             source_provenance=t.target.identity.provenance)


def transfer_ev(t: UpdateTicket) -> TransferEvidence:
    return TransferEvidence(completed=True, mutation_started=True, backend="test", tensors=2,
                            bytes=12, finish_label=t.target.version.label)


def reset_ev(kind: CacheKind = CacheKind.PREFIX, ok: bool | None = True) -> CacheResetEvidence:
    return CacheResetEvidence(cache=kind, http_status=200, engine_success=ok)


def validation_ev(t: UpdateTicket, label: str | None = None) -> ValidationEvidence:
    return ValidationEvidence(observed_label=label or t.target.version.label,
                              label_supported=True, paused=True)


def resume_ev() -> ResumeEvidence:
    return ResumeEvidence(resumed=True, is_paused_after=False)


def recovery_ev(c: LifecycleController, epoch: str = "e-new") -> RecoveryEvidence:
    label = c.recovery_target().label
    return RecoveryEvidence(engine_epoch=epoch, identity=ident(99, "recovery"), healthy=True,
                            validation=ValidationEvidence(observed_label=label,
                                                          label_supported=True, paused=True))


def sleep_ev(level: int = 2) -> SleepEvidence:
    return SleepEvidence(level=level, is_sleeping_after=True, paused_after=True,
                         memory_before={"used_bytes": 100}, memory_after={"used_bytes": 10})


def wake_ev(tags: WakeTags = WakeTags.WEIGHTS) -> WakeEvidence:
    return WakeEvidence(tags=tags, fully_awake=tags is not WakeTags.WEIGHTS, paused_after=True)


def full_check(passed: bool = True, coverage: float = 1.0) -> Check:
    """The check a wake's paused validation needs: every engine parameter, by checksum."""
    return Check("engine-parameters", passed, coverage=coverage,
                 level=VerificationLevel.ENGINE_CHECKSUM)


def wake_validation_ev(t: UpdateTicket, **kw: object) -> ValidationEvidence:
    return ValidationEvidence(observed_label=t.target.version.label, label_supported=True,
                              paused=True, checks=(full_check(**kw),))  # type: ignore[arg-type]


def request_wake_update(c: LifecycleController, ckpt: str = "next", step: int = 1
                        ) -> UpdateTicket:
    """A colocated update of the sleeping engine, its preflight holding."""
    sl = c.current_sleep
    assert sl is not None
    target = c.wake_target("trainer", ident(step, ckpt))
    pf = PreflightEvidence(source_manifest_digest=target.identity.manifest_digest,
                           source_provenance=target.identity.provenance)
    return c.request_wake(sl, "trainer", ident(step, ckpt), preflight=pf)


def new_controller(journal: Journal | None = None) -> LifecycleController:
    return LifecycleController(listener=journal.listener if journal else None)


def drive_to(state: State, journal: Journal | None = None
             ) -> tuple[LifecycleController, UpdateTicket | SleepTicket | None]:
    """A controller in ``state`` through the normal path (taint via a transfer error).

    The colocated states come from a level-2 sleep: DOZING and SLEEPING hand back
    the sleep's ticket, WAKING and WARMING the colocated update's.
    """
    c = new_controller(journal)
    if state is State.UNINITIALIZED:
        return c, None
    c.bootstrap(boot_ev(), ident(0))
    if state is State.READY:
        return c, None
    if state in (State.DOZING, State.SLEEPING, State.WAKING, State.WARMING):
        sl = c.request_sleep("trainer", 2)
        if state is State.DOZING:
            return c, sl
        c.slept(sl, sleep_ev())
        if state is State.SLEEPING:
            return c, sl
        t = request_wake_update(c)
        c.woke(t, wake_ev())
        if state is State.WAKING:
            return c, t
        c.transferred(t, transfer_ev(t))
        return c, t
    t = c.request_update(ident(1, "next"), "trainer")
    if state is State.DRAINING:
        return c, t
    c.drained(t, drain_ev())
    if state is State.QUIESCED:
        return c, t
    c.preflighted(t, preflight_ev(t))
    if state is State.UPDATING:
        return c, t
    if state in (State.TAINTED, State.RECOVERING):
        c.fail(t, Step.TRANSFER, FailureKind.ERROR, "collective broke")
        if state is State.RECOVERING:
            c.begin_recovery("operator")
        return c, t
    c.transferred(t, transfer_ev(t))
    if state is State.INVALIDATING:
        return c, t
    for k in CacheKind:
        c.invalidated(t, reset_ev(k))
    if state is State.VALIDATING:
        return c, t
    c.validated(t, validation_ev(t))
    assert state is State.RESUMING
    return c, t


def whole(c: LifecycleController) -> dict[str, Any]:
    """Everything observable about a controller: its snapshot, the bindings (ids and
    versions), the caches still to reset, the next fresh label (what burnt labels
    and generations imply), and how many transitions it made."""
    return {**c.snapshot(),
            "active": {rid: b.version.to_dict() for rid, b in c.active.items()},
            "pending_resets": sorted(k.value for k in c.pending_resets),
            "next_label": c.recovery_target().label,
            "ticket": None if c.current_ticket is None else c.current_ticket.update_id,
            "transitions": len(c.history())}
