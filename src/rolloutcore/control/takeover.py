"""The takeover of a running engine: what a new gateway declares, verified.

A gateway that starts over an engine (``rolloutcore serve --upstream``) must
not publish an identity nobody checked: the engine may have been updated,
left paused, or half-written by a controller that died. The takeover observes
the engine as an update's validations would and, depending on what the
journal of the previous gateway says, publishes, confirms, taints or recovers.
It drives the runner's effects and the controller's transitions; it lives
apart from the runner so that each file holds one concern.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from rolloutcore.control.outcomes import EffectHost
from rolloutcore.control.port import ExpectationTaker, Recoverer
from rolloutcore.core.evidence import BootstrapEvidence, UpdateTarget, ValidationEvidence
from rolloutcore.core.lifecycle import FailureKind, State, Step, Verdict
from rolloutcore.core.lifecycle_state import judge_takeover
from rolloutcore.core.versions import (
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
    generation_of,
    label_for,
)
from rolloutcore.errors import BadInput, EffectError, UpdateFailed

__all__ = ["TakeoverHost", "TakeoverRefused", "take_over"]

T = TypeVar("T")


class TakeoverHost(EffectHost, Protocol):
    """What the takeover drives: the runner's controller, adapter, deadlines and
    effects (the runner is one; the takeover does not import the runner)."""

    def _fence_quietly(self) -> None: ...
    def recover(self, recoverer: Recoverer, *, owner: str = "operator") -> Verdict: ...


class TakeoverRefused(UpdateFailed):
    """A takeover that could not verify the engine: nothing was published from it."""


def take_over(runner: TakeoverHost, identity: WeightIdentity, *, probes: object = None,
              reference_checksums: Mapping[str, str] | None = None,
              min_verification: VerificationLevel = VerificationLevel.DECLARED,
              recoverer: Callable[[str], Recoverer] | None = None) -> Verdict | None:
    """Take over a running engine that is declared to hold ``identity``, verified.

    What is declared is verified at least as an update would be: the
    engine must be awake and not paused (a paused engine may be one a
    dead controller left half-written), its label, the checksums against
    ``reference_checksums`` where it hashes, and the policy probe
    ``probes`` (computed from the declared checkpoint) must hold and
    reach ``min_verification``. What happens then depends on the
    controller (new, or restored from the previous gateway's journal):

    * new (UNINITIALIZED): the engine's current weights are published
      as the first version, with the level reached; anything that does
      not hold is refused (``TakeoverRefused``, ``no_mutation``) and
      nothing is published.
    * READY (the journal's last version): the same engine incarnation
      must still serve that version (same epoch, same label, ``identity``
      the journal's weights, the probe): it keeps serving it; otherwise
      the engine is tainted (``TakeoverRefused``, ``ambiguous``).
    * TAINTED (an update was in flight, or the engine was tainted): only a
      *replacement* engine (another epoch) freshly loaded from the
      declared checkpoint is accepted, through ``recoverer(previous
      epoch)``, verified like any recovery; the same tainted incarnation
      is refused.

    Returns the verdict that published, or ``None`` when a restored READY
    version was confirmed.
    """
    c, a = runner.controller, runner.adapter
    try:
        ev = runner._effect(Step.BOOTSTRAP.value, a.bootstrap, runner.deadlines.bootstrap_s,
                          None)
    except EffectError as exc:
        if c.state is State.UNINITIALIZED:
            v = c.fail(None, Step.BOOTSTRAP, FailureKind.of(exc), str(exc))
            raise TakeoverRefused("bootstrap", "no_mutation", v.after.value,
                                  str(exc)) from exc
        raise TakeoverRefused("takeover", "no_mutation", c.state.value,
                              f"the engine could not be described: {exc}") from exc
    if not isinstance(ev, BootstrapEvidence):
        raise EffectError("bootstrap", f"bootstrap returned {type(ev).__name__}")
    unfit = _unfit(ev)
    state = c.state
    if state is State.UNINITIALIZED:
        if unfit:
            v = c.fail(None, Step.BOOTSTRAP, FailureKind.REFUSED, "; ".join(unfit))
            raise TakeoverRefused("bootstrap", "no_mutation", v.after.value,
                                  "; ".join(unfit))
        label = ev.observed_label if ev.label_supported else None
        version = WeightVersion(generation_of(label) or 0, label or label_for(0),
                                ev.engine_epoch)
        target = UpdateTarget(version, identity, "takeover")
        # An engine written since it started holds weights no probe can resolve (a
        # near checkpoint deviates far below the engine's own noise): without the
        # journal that published them only content evidence adopts it, and its
        # probe never calibrates later updates (#47).
        updated = _written_since_start(ev)
        vals = _observe(runner, target, probes, reference_checksums,
                        calibrating=not updated)
        if updated and not _content_proven(vals):
            problems = [*updated, *(x for val in vals for x in val.problems(target))]
            v = c.fail(None, Step.BOOTSTRAP, FailureKind.REFUSED, "; ".join(problems))
            raise TakeoverRefused("bootstrap", "no_mutation", v.after.value,
                                  "; ".join(problems))
        v = c.bootstrap(ev, identity, label=label, validations=vals,
                        min_verification=min_verification)
        if not v.accepted:
            raise TakeoverRefused("bootstrap", "no_mutation", v.after.value,
                                  "; ".join(v.problems))
        return v
    committed, known = c.committed, c.identity
    if committed is None or known is None:
        raise TakeoverRefused("takeover", "no_mutation", state.value,
                              "the journal has no committed version")
    same_engine = ev.engine_epoch == committed.engine_epoch
    if state is State.READY:
        problems = list(unfit)
        if not same_engine:
            problems.append(f"the engine is another process than the journal's "
                            f"(epoch {committed.engine_epoch}, now {ev.engine_epoch}): "
                            "it restarted on its start checkpoint")
        if not _same_weights(identity, known):
            problems.append("the declared checkpoint is not the weights the journal "
                            f"last published ({committed.label}: "
                            f"{known.content_digest or known.manifest_digest}, declared "
                            f"{identity.content_digest or identity.manifest_digest})")
        if not problems:
            target = UpdateTarget(committed, known, "takeover")
            vals = _observe(runner, target, probes, reference_checksums)
            problems, _, _ = judge_takeover(problems, vals, target, min_verification)
        if not problems:
            runner._note("takeover_verified", version=committed.to_dict(),
                       checks=[x for val in vals for x in val.summary])
            return None
        try:
            c.fail(None, Step.SERVE, FailureKind.BAD_EVIDENCE,
                   "takeover: " + "; ".join(problems))
        finally:
            # The journal's own incarnation, whose weights are now unknown, is fenced.
            # Another process never served anything the journal published: it is the
            # candidate replacement, verified below as a recovery (paused, it could
            # not be).
            if same_engine:
                runner._fence_quietly()
        if same_engine:
            raise TakeoverRefused("takeover", "ambiguous", c.state.value,
                                  "; ".join(problems))
    # TAINTED now: only a replacement incarnation, fresh from the checkpoint.
    if c.state is not State.TAINTED:
        raise TakeoverRefused("takeover", "no_mutation", c.state.value,
                              f"cannot take over in {c.state.value}")
    if ev.engine_epoch in {v.engine_epoch for v in c.published} or unfit:
        raise TakeoverRefused(
            "takeover", "ambiguous", c.state.value,
            "; ".join(unfit) or "the journal left this engine TAINTED and it is still "
            "the same process: restart it from the declared checkpoint, then start "
            "again")
    if recoverer is None:
        raise TakeoverRefused("takeover", "ambiguous", c.state.value,
                              "the engine is TAINTED and no recoverer was given")
    try:
        v = runner.recover(recoverer(committed.engine_epoch), owner="takeover")
    except UpdateFailed as exc:
        raise TakeoverRefused("recover", exc.classification, exc.state,
                              exc.reason) from exc
    # The adapter describes the new incarnation (its process identity and the
    # weight counters the health watch compares with).
    with contextlib.suppress(EffectError):
        runner._effect(Step.BOOTSTRAP.value, a.bootstrap, runner.deadlines.bootstrap_s, None)
    return v


def _observe(runner: TakeoverHost, target: UpdateTarget, probes: object,
             reference_checksums: Mapping[str, str] | None, *, calibrating: bool = True
             ) -> list[ValidationEvidence]:
    """The engine observed as an update's validations would (paused checks, probes)."""
    a = runner.adapter
    if isinstance(a, ExpectationTaker):
        # The probe is of the checkpoint the engine is declared to hold: the
        # deviation it passes with is the engine's own noise (its calibration),
        # unless the engine was written since it started (``calibrating=False``).
        a.expect(probes=probes, reference_checksums=reference_checksums,
                 calibrating=calibrating)
    elif probes is not None or reference_checksums is not None:
        raise BadInput("this adapter cannot take expectations (ExpectationTaker)")
    out: list[ValidationEvidence] = []
    for live, deadline in ((False, runner.deadlines.validate_s),
                           (True, runner.deadlines.live_validate_s)):
        val = runner._effect("validate_live" if live else Step.VALIDATE.value,
                             lambda live=live: a.validate(  # type: ignore[misc]
                                 target, live=live), deadline, None)
        if val is not None:
            out.append(val)
    cal = getattr(a, "calibrations", None)
    if isinstance(cal, dict) and cal:
        runner._note("probe_calibration", calibrations={
            k: c.to_dict() for k, c in cal.items() if hasattr(c, "to_dict")})
    return out


def _unfit(ev: BootstrapEvidence) -> list[str]:
    """Why an engine must not be taken over as it is (paused, asleep), in words."""
    info = ev.engine_info
    out = []
    if info.get("paused") is True:
        out.append("the engine is paused: a controller may have died in the middle of an "
                   "update (its weights are unknown) or fenced it after a taint")
    if info.get("awake") is False:
        out.append("the engine is asleep: its weights are not loaded")
    return out


#: vLLM's weight-transfer operations that write weights (``engine.wire``).
_WRITES = ("start", "start_draft", "update", "finish")


def _written_since_start(ev: BootstrapEvidence) -> list[str]:
    """Evidence that the engine's weights changed after it started, in words: a label an
    earlier controller gave (``rc-N``, N >= 1; a fresh engine has its own) or the
    engine's own count of weight writes (vLLM's ``/metrics``)."""
    label = ev.observed_label if ev.label_supported else None
    gen = generation_of(label)
    if gen is not None and gen >= 1:
        return [f"the engine's weight-version label is {label!r}: it was updated after it "
                "started, and neither the journal that published that update nor content "
                "evidence (engine checksums covering every parameter) says it holds the "
                "declared checkpoint: start the gateway with that journal, or restart the "
                "engine from the checkpoint"]
    ops = ev.engine_info.get("weight_ops")
    if isinstance(ops, Mapping):
        writes = {op: n for op, n in ops.items() if op in _WRITES
                  and isinstance(n, (int, float)) and n > 0}
        if writes:
            return [f"the engine counts weight writes since it started ({writes}) and "
                    "neither a journal nor content evidence says what they wrote"]
    return []


def _content_proven(vals: list[ValidationEvidence]) -> bool:
    """Whether the engine's content was compared with the declared checkpoint's and held:
    a passed engine-checksum check covering every parameter, nothing left unverified."""
    return any(not val.unverified and any(
        ch.passed and ch.level is not None
        and ch.level >= VerificationLevel.ENGINE_CHECKSUM and ch.coverage == 1.0
        for ch in val.checks) for val in vals)


def _same_weights(declared: WeightIdentity, known: WeightIdentity) -> bool:
    """Whether a declared checkpoint is the weights a journal published (content first)."""
    if declared.manifest_digest != known.manifest_digest:
        return False
    if declared.content_digest is not None and known.content_digest is not None:
        return declared.content_digest == known.content_digest
    return True
