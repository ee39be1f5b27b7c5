"""An engine with a speculative-decoding draft, updated as one verified transaction.

``DraftedSession`` wraps an ``EngineSession`` whose engine was started with
a draft (``DraftSpec.engine_args``: vLLM's ``--speculative-config``,
method ``draft_model`` or ``eagle``) and whose transport is a ``DraftedGlooTransport``.
``update(weights, provenance, draft_weights=...)`` runs the one transition
the runner always runs (drain, preflight, transfer, cache reset, paused
validation, resume, live validation, publish), with:

* one transfer step that writes the draft, then the target, whose finish
  carries the label (``transports.drafted``);
* a paused validation that checks the workers' checksums of what both
  rounds wrote, the draft's against the trainer's draft read again;
* a live validation that runs the target's policy probe, as any update
  does, and ``AcceptanceProbe``: greedy generation with vLLM's acceptance
  counters read around it (``min_acceptance`` makes it a gate);
* one published version whose identity's content digest is
  ``policy_digest(target, draft, draft manifest)`` (``DraftedUpdateResult``
  carries both parts);
* or nothing published: a failure after the draft round started taints the
  engine, as any mutation does.

An update without draft weights is refused before anything changes
(``UpdateRefused``), here and in the wrapped ``EngineSession.update``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutcore.control.runner import Deadlines, UpdateOutcome
from rolloutcore.control.session import EngineSession, PreparedUpdate, identity_of
from rolloutcore.core.evidence import Check
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.core.vocab import State
from rolloutcore.errors import BadInput, UpdateRefused
from rolloutcore.transports.drafted import DRAFT_REFUSAL, DraftedGlooTransport, DraftedSource
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.acceptance import (
    AcceptanceProbe,
    AcceptanceSample,
    default_acceptance_prompts,
)
from rolloutcore.verification.image_probe import ProbeSuite
from rolloutcore.verification.probe import DEFAULT_TOLERANCE, PolicyProbe

__all__ = ["DraftSpec", "DraftedSession", "DraftedUpdateResult"]

_METHODS = frozenset({"draft_model", "eagle"})


@dataclass(frozen=True)
class DraftSpec:
    """The draft an engine decodes with: vLLM's ``--speculative-config``.

    ``draft_model``: a separate, smaller causal LM with the target's
    vocabulary. ``eagle``: an EAGLE-1 head (vLLM's ``EagleLlamaForCausalLM``:
    ``fc`` and one decoder layer, fed the target's hidden states, borrowing
    the target's embedding and output projection, which only the target's
    round writes). Other heads (EAGLE-3, MTP) are not covered: their loaders
    rename or drop names in ways the receiver does not know, and it refuses
    them before anything changes (docs/speculative-drafts.md).
    """

    model_dir: Path
    num_speculative_tokens: int = 3
    method: str = "draft_model"

    def __post_init__(self) -> None:
        d = Path(self.model_dir) if isinstance(self.model_dir, (str, os.PathLike)) else None
        if d is None or not (d / "config.json").is_file():
            raise BadInput(f"draft model_dir must be a checkpoint directory with a "
                           f"config.json, got {self.model_dir!r}")
        object.__setattr__(self, "model_dir", d.resolve())
        n = self.num_speculative_tokens
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 16:
            raise BadInput(f"num_speculative_tokens must be an int in 1..16, got {n!r}")
        if self.method not in _METHODS:
            raise BadInput(f"method must be one of {sorted(_METHODS)}, got {self.method!r}")

    def config(self) -> dict[str, Any]:
        return {"method": self.method, "model": str(self.model_dir),
                "num_speculative_tokens": self.num_speculative_tokens}

    def engine_args(self) -> list[str]:
        """The engine's extra command-line arguments."""
        return ["--speculative-config", json.dumps(self.config(), sort_keys=True)]


@dataclass
class DraftedUpdateResult:
    """One drafted update: the version, the identity of the pair, and the evidence."""

    version: WeightVersion
    identity: WeightIdentity
    #: ``DraftedSource.parts()``: both content digests, the draft's manifest, the pair's.
    digests: dict[str, str]
    acceptance_before: AcceptanceSample | None
    acceptance_after: AcceptanceSample | None
    outcome: UpdateOutcome
    #: The transition's phases (``UpdateOutcome.breakdown``) and the transfer's two rounds.
    phases: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version.to_dict(), "identity": self.identity.to_dict(),
                "digests": dict(self.digests),
                "acceptance_before": None if self.acceptance_before is None
                else self.acceptance_before.to_dict(),
                "acceptance_after": None if self.acceptance_after is None
                else self.acceptance_after.to_dict(),
                "phases": dict(self.phases)}


def _vocab_size(model_dir: Path | None) -> int:
    if model_dir is None:
        return 256
    try:
        v = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError):
        return 256
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 2 else 256


class DraftedSession:
    """An ``EngineSession`` whose engine decodes with a draft model (see the module doc).

    ``min_acceptance``: the acceptance rate the live validation requires
    (``None``: measured and recorded, not required). ``acceptance_prompts``
    and ``acceptance_tokens`` shape the measuring window.
    """

    def __init__(self, session: EngineSession, *, min_acceptance: float | None = None,
                 acceptance_prompts: Sequence[Sequence[int]] | None = None,
                 acceptance_tokens: int = 32) -> None:
        if not isinstance(session, EngineSession):
            raise BadInput("session must be an EngineSession")
        if not isinstance(session.transport, DraftedGlooTransport) or \
                not session.transport.require_draft:
            raise BadInput("a drafted session needs a DraftedGlooTransport with "
                           "require_draft=True (every update carries the draft)")
        model_dir = None if session.engine is None else Path(session.engine.model_dir)
        prompts = acceptance_prompts or default_acceptance_prompts(_vocab_size(model_dir))
        self.acceptance = AcceptanceProbe(prompts, max_tokens=acceptance_tokens,
                                          min_acceptance=min_acceptance)
        self.session = session
        self.transport: DraftedGlooTransport = session.transport

    @classmethod
    def launch(cls, model_dir: str | Path, draft: DraftSpec | str | Path, *,
               min_acceptance: float | None = None, op_timeout_s: float = 120.0,
               journal_path: str | os.PathLike[str] | None = None,
               deadlines: Deadlines | None = None, start_timeout_s: float = 300.0,
               engine_kwargs: Mapping[str, Any] | None = None,
               transport: DraftedGlooTransport | None = None) -> DraftedSession:
        """Start a managed vLLM on ``model_dir`` decoding with ``draft``."""
        spec = draft if isinstance(draft, DraftSpec) else DraftSpec(Path(draft))
        if transport is not None and not isinstance(transport, DraftedGlooTransport):
            raise BadInput("transport must be a DraftedGlooTransport")
        kw = dict(engine_kwargs or {})
        kw["extra_args"] = [*kw.get("extra_args", ()), *spec.engine_args()]
        tr = transport or DraftedGlooTransport(op_timeout_s=op_timeout_s)
        s = EngineSession.launch(model_dir, transport=tr, journal_path=journal_path,
                                 deadlines=deadlines, start_timeout_s=start_timeout_s,
                                 engine_kwargs=kw)
        try:
            return cls(s, min_acceptance=min_acceptance)
        except BaseException:
            s.close()
            raise

    # ------------------------------------------------------------------ take over
    def bootstrap(self, model_dir: str | Path, draft_dir: str | Path,
                  provenance: Provenance | None = None) -> WeightVersion:
        """Take over the engine serving ``model_dir`` with draft ``draft_dir``.

        Version 0's identity names both (``policy_digest``); it is published at
        probe level: the target's policy probe, and the acceptance window (a
        gate when ``min_acceptance`` is set).
        """
        src = DraftedSource(WeightSource.from_checkpoint(model_dir),
                            WeightSource.from_checkpoint(draft_dir))
        prov = provenance or Provenance(str(Path(model_dir).resolve()), "", 0)
        identity = identity_of(src, prov)
        probes = ProbeSuite([PolicyProbe.from_checkpoint(str(model_dir),
                                                         tolerance=DEFAULT_TOLERANCE),
                             self.acceptance])
        self.session.runner.take_over(identity, probes=probes,
                                      min_verification=VerificationLevel.PROBE)
        committed = self.session.controller.committed
        assert committed is not None
        return committed

    # ------------------------------------------------------------------ the call
    def update(self, weights: Any, provenance: Provenance, *, draft_weights: Any = None,
               label: str | None = None, probe: PolicyProbe | ProbeSuite | bool = True,
               probe_tolerance: float = DEFAULT_TOLERANCE, owner: str = "trainer",
               measure_before: bool = True) -> DraftedUpdateResult:
        """Install target ``weights`` and ``draft_weights`` as one version, or raise.

        ``UpdateRefused`` (nothing changed) without ``draft_weights``;
        ``UpdateFailed`` as ``EngineSession.update``. ``measure_before``: an
        acceptance window on the current policy first (read-only generation; only
        while the engine serves, READY).
        """
        prepared = self.prepare(weights, provenance, draft_weights=draft_weights,
                                probe=probe, probe_tolerance=probe_tolerance)
        return self.apply(prepared, label=label, owner=owner, measure_before=measure_before)

    def prepare(self, weights: Any, provenance: Provenance, *, draft_weights: Any = None,
                probe: PolicyProbe | ProbeSuite | bool = True,
                probe_tolerance: float = DEFAULT_TOLERANCE) -> PreparedUpdate:
        """Identity of the pair and the probes; touches no engine."""
        if draft_weights is None:
            raise UpdateRefused(DRAFT_REFUSAL)
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        if not isinstance(probe, (bool, PolicyProbe, ProbeSuite)):
            raise BadInput("probe must be a bool, a PolicyProbe or a ProbeSuite")
        src = DraftedSource(WeightSource.of(weights), WeightSource.of(draft_weights))
        # The target's probe exactly as a plain update computes it (no digest read here).
        target = self.session.prepare(weights, provenance, probe=probe,
                                      probe_tolerance=probe_tolerance, content_digest=False)
        probes = (None if target.probe is None
                  else ProbeSuite([target.probe, self.acceptance]))
        return PreparedUpdate(src, provenance, identity_of(src, provenance), probes, None)

    def apply(self, prepared: PreparedUpdate, *, label: str | None = None,
              owner: str = "trainer", measure_before: bool = True) -> DraftedUpdateResult:
        """Run the one transition for a prepared pair."""
        if not isinstance(prepared, PreparedUpdate) or \
                not isinstance(prepared.source, DraftedSource):
            raise UpdateRefused(DRAFT_REFUSAL)
        # A window on the serving policy (read-only); not on an engine that does not
        # serve (a tainted one stays paused: the requests would wait).
        serving = self.session.controller.state is State.READY
        before = (self.acceptance.measure(self.session.http) if measure_before and serving
                  else None)
        self.acceptance.last = None
        res = self.session.apply(prepared, label=label, owner=owner)
        after = self.acceptance.last
        phases = dict(res.outcome.breakdown())
        phases.update(self.transport.last_phases)
        return DraftedUpdateResult(res.version, res.identity, prepared.source.parts(),
                                   before, after, res.outcome, phases)

    # ------------------------------------------------------------------ watch
    def check_draft(self) -> Check:
        """An acceptance window now, judged (``min_acceptance``): a draft left on other
        weights than its target's shows here, while every output token looks right."""
        return self.acceptance.run(self.session.http)

    def close(self) -> None:
        self.session.close()

    def __enter__(self) -> DraftedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
