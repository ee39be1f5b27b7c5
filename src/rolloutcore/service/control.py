"""The trainer protocol: a two-phase update across processes, under a lease.

::

    trainer                         gateway (this module)                 vLLM
    POST /control/updates   ---->   check the expectations and the floor,
      {identity, owner,             runner.open_update: close admission,
       expect: {probe, ...}}        drain bound rollouts, pause, preflight
                            <----   201 {update_id, target label, lease
                                         (its secret), engine URL, transport}
    transfer through vLLM's weight-transfer path  ----------------------> /start_weight_update
                                                                           /update_weights
                                                                           /finish_weight_update
    POST /control/updates/{id}/transfer       (X-RolloutCore-Lease: secret)
      {transfer: TransferEvidence} or {failure: {kind, reason}}
                            ---->   runner.report_transfer + close_update:
                                    invalidate caches, validate while
                                    paused (label, checksums), resume, run
                                    the probe with admission still closed,
                                    publish (or classify)
                            <----   200 {status: published | failed, ...}

**Verification through the protocol.** The trainer computes what only it
can, from the very tensors it sends: the policy probe's expected greedy
continuations and their log-probabilities (``expect.probe``), optionally
reference checksums of the engine's parameters (``expect.engine_checksums``),
and, where its transport hashes what it sent, that checksum (in the report).
The gateway checks them at the edge (sizes, token ids within the served
vocabulary, finite log-probabilities, a tolerance no larger than its own
cap) before anything drains, then runs the comparisons itself, as the
in-process runner does: a miss taints. ``min_verification`` is a **floor**
(``ServiceConfig.min_verification``, ``serve --min-verification``; by default
the highest level the engine can reach): a begin that asks for less, or that
cannot reach it with what it sent, is refused with a 422 and nothing changes.

The begin grants a **lease** that belongs to the trainer that took it: a
secret in the begin's answer that every later call of that update presents
(``X-RolloutCore-Lease``); update ids are random, so an id from before a
gateway restart names nothing. Its deadline is a duration on the gateway's
monotonic clock (``expires_in_s``), never a wall-clock instant compared
across hosts. If no report arrives in time (the trainer died, hung or
overran) the service classifies the update from the engine: when the
engine's own weight-operation counters prove nothing was sent since the
drain, the update ends with no mutation (back to service on the old
version); otherwise it is a TIMEOUT of the transfer, ambiguous, TAINTED and
fenced, nothing published. A report that arrives later is answered 410 with
that classification. Report and expiry are serialized per update, so exactly
one of them decides: each lease is a row of the lease machine
(``core.lease``: OPEN, then REPORTING or EXPIRING, then one final state with
its result), run in the shell every machine runs in, its changes recorded
in the engine's journal; a reader polling an update waits for ``final``.
A begin whose answer could not be delivered (the trainer disconnected
while it drained) is classified the same way at once, and a begin retried
with the same ``begin_key`` gets the same grant back.

Request bodies are validated by strict pydantic models (no type coercion,
no unknown fields, bounded strings and numbers); the same models produce
the OpenAPI document served at ``/openapi.json``, which the property-based
tests fuzz.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic import model_validator as _model_validator

from rolloutcore.control.port import ExpectationTaker, WriteObserver
from rolloutcore.control.runner import LifecycleRunner, UpdateOutcome
from rolloutcore.control.shell import Shell
from rolloutcore.core.evidence import PreflightEvidence, TransferEvidence
from rolloutcore.core.lease import Lease, LeaseEvent, LeaseState, LeaseTable
from rolloutcore.core.lifecycle import FailureKind
from rolloutcore.core.speculative import engine_draft_of, engine_draft_refusal
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.engine import lent_key
from rolloutcore.errors import BadInput, RolloutCoreError, UpdateFailed, UpdateRefused
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.control_sent import (
    RANK_SCHEME,
    RankDeclarationBody,
    RankSentBody,
    SentChecksumBody,
    check_rank_declaration,
    worker_shards,
)
from rolloutcore.service.metrics import ServiceMetrics
from rolloutcore.verification.probe import WIRE_LIMITS, PolicyProbe

__all__ = [
    "LEASE_HEADER",
    "BeginBody",
    "ExpectBody",
    "FailureBody",
    "IdentityBody",
    "ProbeBody",
    "ProbeCaseBody",
    "ProvenanceBody",
    "RankDeclarationBody",
    "RankSentBody",
    "ReportBody",
    "SentChecksumBody",
    "TransferBody",
    "UpdateManager",
    "parse_body",
]

_HEX64 = r"^[0-9a-f]{64}$"
_LABEL = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_INT63 = 2**63 - 1

Hex64 = Annotated[str, StringConstraints(pattern=_HEX64)]
Label = Annotated[str, StringConstraints(pattern=_LABEL)]
Level = Literal["declared", "manifest", "engine-checksum", "probe"]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
LogProb = Annotated[float, Field(allow_inf_nan=False, ge=-1e6, le=1.0)]

#: The header that carries an update's lease secret on every call after its begin.
LEASE_HEADER = "x-rolloutcore-lease"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ProvenanceBody(_Strict):
    """What the trainer declares the weights to be."""

    checkpoint: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    trainer_run: Annotated[str, StringConstraints(max_length=512)] = ""
    step: Annotated[int, Field(ge=0, le=_INT63)] = 0


class IdentityBody(_Strict):
    """The target weights: manifest digest, provenance, optional content digest."""

    manifest_digest: Hex64
    provenance: ProvenanceBody
    content_digest: Hex64 | None = None

    def to_identity(self) -> WeightIdentity:
        p = self.provenance
        return WeightIdentity(self.manifest_digest,
                              Provenance(p.checkpoint, p.trainer_run, p.step),
                              self.content_digest)


class ProbeCaseBody(_Strict):
    """One probe: a prompt, the trainer's greedy continuation, its log-probabilities."""

    prompt: Annotated[list[TokenId], Field(min_length=1, max_length=WIRE_LIMITS["prompt"])]
    continuation: Annotated[list[TokenId],
                            Field(min_length=1, max_length=WIRE_LIMITS["continuation"])]
    logprobs: Annotated[list[LogProb],
                        Field(min_length=1, max_length=WIRE_LIMITS["continuation"])]


class ProbeBody(_Strict):
    """``PolicyProbe.to_wire()``: computed by the trainer from the tensors it sends."""

    cases: Annotated[list[ProbeCaseBody], Field(min_length=1, max_length=WIRE_LIMITS["cases"])]
    tolerance: Annotated[float, Field(gt=0, le=10.0, allow_inf_nan=False)]
    name: Annotated[str, StringConstraints(min_length=1,
                                           max_length=WIRE_LIMITS["name"])] = "policy-probe"

    def to_probe(self, config: ServiceConfig) -> PolicyProbe:
        """The semantic checks (lengths agree, ids in the vocabulary, the tolerance cap)."""
        return PolicyProbe.from_wire(
            {"name": self.name, "tolerance": self.tolerance,
             "cases": [c.model_dump() for c in self.cases]},
            vocab_size=config.vocab_size, max_tolerance=config.max_probe_tolerance,
            max_model_len=config.max_model_len)


class ExpectBody(_Strict):
    """What the trainer computed from what it sends; the gateway compares (module doc)."""

    probe: ProbeBody | None = None
    #: ``/weight_checker``-style sha256 per engine parameter (a cold load's reference).
    engine_checksums: Annotated[dict[Annotated[str, StringConstraints(min_length=1,
                                                                      max_length=512)],
                                     Hex64], Field(min_length=1, max_length=1 << 16)] | None \
        = None
    #: The report will carry the transport's checksum of what it sent (``sent_checksum``).
    transport_checksum: bool = False


class BeginBody(_Strict):
    """Ask to begin an update: the service drains, quiesces and grants a lease."""

    identity: IdentityBody
    owner: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    label: Label | None = None
    #: At least the gateway's floor; absent: the floor.
    min_verification: Level | None = None
    expect: ExpectBody | None = None
    lease_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None
    #: Digest of the manifest the trainer will actually send (defaults to the identity's).
    source_manifest_digest: Hex64 | None = None
    #: The trainer's key for this begin: the same begin sent again (its answer was
    #: lost) gets the same grant back while the update is open.
    begin_key: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{16,128}$")] | None \
        = None


class TransferBody(_Strict):
    """The trainer's ``TransferEvidence``, field for field (plus what it sent, hashed)."""

    completed: bool
    mutation_started: bool
    backend: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    tensors: Annotated[int, Field(ge=0, le=10**9)] = 0
    bytes: Annotated[int, Field(ge=0, le=_INT63)] = 0
    finish_label: Label | None = None
    error: Annotated[str, StringConstraints(max_length=4000)] | None = None
    elapsed_s: Annotated[float, Field(ge=0, le=1e7, allow_inf_nan=False)] = 0.0
    unverified: Annotated[list[Annotated[str, StringConstraints(max_length=500)]],
                          Field(max_length=32)] = []
    sent_checksum: Annotated[SentChecksumBody | RankSentBody,
                             Field(discriminator="scheme")] | None = None

    def to_evidence(self) -> TransferEvidence:
        return TransferEvidence(completed=self.completed, mutation_started=self.mutation_started,
                                backend=self.backend, tensors=self.tensors, bytes=self.bytes,
                                finish_label=self.finish_label, error=self.error,
                                elapsed_s=self.elapsed_s, unverified=tuple(self.unverified))


class FailureBody(_Strict):
    """The transfer failed on the trainer's side; ``kind`` decides the classification."""

    kind: Literal["refused", "error", "timeout", "died"]
    reason: Annotated[str, StringConstraints(min_length=1, max_length=4000)]


class ReportBody(_Strict):
    """Exactly one of ``transfer`` (evidence) or ``failure``."""

    transfer: TransferBody | None = None
    failure: FailureBody | None = None

    @_model_validator(mode="after")
    def _one(self) -> ReportBody:
        if (self.transfer is None) == (self.failure is None):
            raise ValueError("give exactly one of 'transfer' or 'failure'")
        return self


def parse_body(model: type[BaseModel], raw: bytes) -> tuple[int, Any]:
    """(0, model instance) or (HTTP status, error body): 400 bad JSON, 422 bad fields."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return 400, {"error": "malformed JSON", "detail": str(exc)}
    try:
        return 0, model.model_validate(obj)
    except ValidationError as exc:
        return 422, {"error": "invalid request body",
                     "detail": json.loads(exc.json(include_url=False, include_input=False))}


# ---------------------------------------------------------------------- updates

@dataclass
class _Update:
    update_id: int
    owner: str
    target: WeightVersion
    identity_digest: str
    out: UpdateOutcome
    lease_s: float
    deadline_mono: float
    deadline_wall: float
    secret: str = field(repr=False, default="")
    begin_key: str | None = None
    verification: VerificationLevel = VerificationLevel.DECLARED
    #: The nonce of this update's transfer round (in the grant): a rank's report of the
    #: round must carry it, so a report of an earlier round is not taken for this one.
    round_nonce: str = field(repr=False, default="")
    #: The manifest digest of what the trainer said it sends (the begin's).
    source_manifest: str = ""
    #: The engine's key lent to the trainer for this lease (an engine this gateway
    #: launched), taken back when the lease ends.
    route_key: str | None = field(repr=False, default=None)
    #: The lease machine's shell: this update's lease is its row ``update_id``.
    leases: Shell[LeaseTable, Mapping[int, Lease]] | None = field(default=None, repr=False)
    timer: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def lease(self) -> Lease:
        assert self.leases is not None
        return self.leases.view[self.update_id]

    @property
    def state(self) -> LeaseState:
        return self.lease.state

    @property
    def result(self) -> dict[str, Any] | None:
        r = self.lease.result
        return None if r is None else dict(r)

    def move(self, event: LeaseEvent, *, reason: str = "",
             result: Mapping[str, Any] | None = None) -> None:
        """This lease's event, decided by ``core.lease.LEASE_TRANSITIONS`` (on the loop:
        its record is written by the journal's thread, not waited for here)."""
        assert self.leases is not None
        self.leases.run(self.leases.machine.move, self.update_id, event, reason=reason,
                        result=result, wait=False)

    def describe(self) -> dict[str, Any]:
        """What anyone with the control token may see (never the lease secret)."""
        left = max(0.0, self.deadline_mono - time.monotonic())
        lease = self.lease
        return {"update_id": self.update_id, "journal_update_id": self.out.ticket.update_id,
                "owner": self.owner, "status": lease.state.value, "final": lease.final,
                "target": self.target.to_dict(), "identity_digest": self.identity_digest,
                "min_verification": self.verification.wire,
                "lease": {"seconds": self.lease_s, "deadline_unix": self.deadline_wall,
                          "expires_in_s": left if lease.state is LeaseState.OPEN else 0.0},
                "result": None if lease.result is None else dict(lease.result)}

    def owns(self, presented: str | None) -> bool:
        return presented is not None and hmac.compare_digest(
            presented.encode("utf-8", "replace"), self.secret.encode())


@dataclass(frozen=True)
class _Checked:
    level: VerificationLevel
    probe: PolicyProbe | None
    reference: dict[str, str] | None


def _new_update_id() -> int:
    """Random and positive, below 2**53 (a JSON number every client reads exactly): an id
    from before a gateway restart names nothing after it."""
    return secrets.randbelow(2**53 - 2) + 1


class UpdateManager:
    """Begin, report, lease expiry. One update at a time (the controller's single writer)."""

    def __init__(self, runner: LifecycleRunner, config: ServiceConfig,
                 metrics: ServiceMetrics) -> None:
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self._updates: OrderedDict[int, _Update] = OrderedDict()
        self._opening = False
        #: The route-key lend and take-back of an engine this gateway launched, over one
        #: kept-alive connection (closed in ``aclose``).
        self.lender = lent_key.Lender(config.upstream_url)
        #: The lease machine, its changes recorded in the engine's journal.
        self.leases: Shell[LeaseTable, Mapping[int, Lease]] = Shell(
            LeaseTable(), LeaseTable.view, listener=runner.emit)
        metrics.set_floor(config.floor)

    def verification(self) -> dict[str, Any]:
        """The floor, what this engine can reach, and what the committed version reached."""
        ident = self.runner.controller.identity
        return {"floor": self.config.floor.wire,
                "reachable": self.config.reachable_verification.wire,
                "committed": None if ident is None else ident.verification.wire,
                "evidence": [] if ident is None else list(ident.evidence),
                # The probe tolerance the takeover calibrated on this engine (by probe
                # kind; verification.probe.Calibration), or {} before one did.
                "probe_calibration": {
                    k: c.to_dict() for k, c in dict(
                        getattr(self.runner.adapter, "calibrations", None) or {}).items()
                    if hasattr(c, "to_dict")}}

    @property
    def open_update(self) -> _Update | None:
        """The update whose lease is not final (at most one: a single writer)."""
        for u in reversed(self._updates.values()):
            if not u.lease.final:
                return u
        return None

    def _owned(self, update_id: int, lease: str | None) -> _Update | tuple[int, dict[str, Any]]:
        """The update whose lease secret ``lease`` is, else the 404 or 403 that refuses."""
        u = self._updates.get(update_id)
        if u is None:
            return 404, {"error": f"no update {update_id}"}
        return u if u.owns(lease) else (403, _NOT_YOURS)

    def get(self, update_id: int, lease: str | None = None) -> tuple[int, dict[str, Any]]:
        u = self._owned(update_id, lease)
        return u if isinstance(u, tuple) else (200, u.describe())

    def _check_begin(self, body: BeginBody) -> tuple[int, dict[str, Any]] | _Checked:
        """The floor and the expectations, before anything drains (422 with the reason)."""
        cfg = self.config
        floor = cfg.floor
        want = floor if body.min_verification is None else VerificationLevel.parse(
            body.min_verification)

        def refused(error: str) -> tuple[int, dict[str, Any]]:
            return 422, {"error": error, "floor": floor.wire, "requested": want.wire}

        if want < floor:
            return refused(f"min_verification {want.wire!r} is below this gateway's floor "
                           f"{floor.wire!r} (rolloutcore serve --min-verification); ask for "
                           "at least the floor, or send nothing to get it")
        if want > cfg.reachable_verification:
            return refused(f"min_verification {want.wire!r} cannot be reached on this engine "
                           f"(at most {cfg.reachable_verification.wire!r})")
        ex = body.expect
        probe: PolicyProbe | None = None
        if ex is not None and ex.probe is not None:
            try:
                probe = ex.probe.to_probe(cfg)
            except BadInput as exc:
                return 422, {"error": f"invalid probe expectations: {exc}",
                             "floor": floor.wire}
        ref = None if ex is None or ex.engine_checksums is None else dict(ex.engine_checksums)
        if want >= VerificationLevel.PROBE and probe is None:
            return refused(f"min_verification {want.wire!r} needs the policy probe's "
                           "expectations (expect.probe: PolicyProbe.to_wire() of the weights "
                           "you send)")
        if want is VerificationLevel.ENGINE_CHECKSUM and ref is None and probe is None and (
                ex is None or not ex.transport_checksum):
            return refused("min_verification 'engine-checksum' needs reference checksums "
                           "(expect.engine_checksums) or the transport's checksum of what it "
                           "sends (expect.transport_checksum)")
        if (probe is not None or ref is not None) and not isinstance(
                self.runner.adapter, ExpectationTaker):
            return 422, {"error": "this gateway's engine adapter cannot compare expectations"}
        return _Checked(want, probe, ref)

    # ------------------------------------------------------------ begin
    async def begin(self, body: BeginBody,
                    disconnected: Callable[[], Awaitable[bool]] | None = None
                    ) -> tuple[int, dict[str, Any]]:
        """Check, drain, grant. ``disconnected`` tells whether the trainer is still there
        to read the answer: a grant nobody received is classified at once."""
        cfg = self.config
        busy = self.open_update

        def conflict(error: str) -> tuple[int, dict[str, Any]]:
            return 409, {"error": error, "state": self.runner.controller.state.value}

        if busy is not None and body.begin_key is not None and busy.begin_key == \
                body.begin_key and busy.owner == body.owner and \
                busy.state is LeaseState.OPEN:
            # The same begin again: its answer was lost. The same grant, once more.
            return 200, self._grant(busy)
        if self._opening or busy is not None:
            who = f"update {busy.update_id} by {busy.owner!r}" if busy else "another begin"
            return conflict(f"{who} is in progress; one writer at a time")
        broken = self.runner.controller.failed_closed
        if broken is not None:
            # Before the body's own checks: no begin, however well formed, can run
            # until the controller is restored, and the trainer should hear that.
            return conflict(f"the controller failed closed ({broken}): no update can begin "
                            "until it is restored")
        draft = engine_draft_of(self.runner.adapter)
        if draft is not None:
            # The trainer's transfer carries the target only: refused before the drain.
            return conflict(engine_draft_refusal(draft, remote=True))
        try:
            identity = body.identity.to_identity()
        except BadInput as exc:
            return 422, {"error": str(exc)}
        if body.source_manifest_digest not in (None, identity.manifest_digest):
            # The identity preflight compares exactly these two: it would refuse the update
            # only after draining and pausing the engine (a 503). Refused here instead.
            return 422, {"error": "source_manifest_digest differs from "
                                  "identity.manifest_digest: the identity preflight would "
                                  "refuse this update (nothing was drained)"}
        checked = self._check_begin(body)
        if not isinstance(checked, _Checked):
            return checked
        level, probe, ref = checked.level, checked.probe, checked.reference
        pre = PreflightEvidence(
            source_manifest_digest=body.source_manifest_digest or identity.manifest_digest,
            source_provenance=identity.provenance)
        lease_s = min(body.lease_s or cfg.lease_s, cfg.max_lease_s)
        self._opening = True
        adapter = self.runner.adapter

        def open_() -> tuple[UpdateOutcome, str | None]:
            if isinstance(adapter, ExpectationTaker):
                # Each begin replaces what the last one staged (None clears it).
                adapter.expect(probes=probe, reference_checksums=ref)
                adapter.expect_sent(None)
            # An engine this gateway launched lends the trainer a key of its own, for
            # the lease only (never the launcher's: it would outlive the lease). Lent
            # beside the drain: the key is shown to nobody until the grant.
            lent_at = time.monotonic()
            lending = self.lender.start_lend(lease_s)
            try:
                out = self.runner.open_update(identity, owner=body.owner, label=body.label,
                                              min_verification=level, preflight=pre)
            except BaseException:
                self._unlend(lending)  # no update opened: the key is taken back
                raise
            try:
                key = lending.result()
                if key is not None and time.monotonic() - lent_at > min(0.05, lease_s / 100):
                    # A slow drain ate into the key's seconds on the engine: lent again
                    # (it replaces the first, never shown), so it ends with the lease.
                    key = self.lender.lend(lease_s)
                return out, key
            except RolloutCoreError as exc:  # nothing was sent: no_mutation, resumed
                self.runner.report_transfer_failure(
                    out, FailureKind.REFUSED, f"the engine did not lend a route key for "
                    f"the lease: {exc}")
                raise  # pragma: no cover - report_transfer_failure raises UpdateFailed

        try:
            out, route_key = await anyio.to_thread.run_sync(open_)
        except (UpdateRefused, BadInput) as exc:
            return conflict(str(exc))
        except UpdateFailed as exc:
            result = _failure(exc)
            self._observe(result["classification"], exc.outcome)
            return 503, {"error": f"the update could not begin: {exc}", **result}
        finally:
            self._opening = False
        t = out.ticket
        now_m, now_w = time.monotonic(), time.time()
        uid = _new_update_id()
        while uid in self._updates:
            uid = _new_update_id()
        self.leases.run(self.leases.machine.grant, uid, body.owner, wait=False)
        upd = _Update(uid, body.owner, t.target.version, identity.digest, out, lease_s,
                      now_m + lease_s, now_w + lease_s, secrets.token_urlsafe(32),
                      body.begin_key, level, secrets.token_hex(16), pre.source_manifest_digest,
                      route_key, self.leases)
        self._updates[uid] = upd
        while len(self._updates) > cfg.remember_updates:
            oldest = next(iter(self._updates.values()))
            if not oldest.lease.final:
                break
            self._updates.popitem(last=False)
            self.leases.run(self.leases.machine.forget, oldest.update_id, wait=False)
        upd.timer = asyncio.get_running_loop().create_task(self._lease_timer(upd))
        if disconnected is not None and await disconnected():
            # Nobody holds this grant: classified now (from the engine's own counters),
            # not when the lease runs out.
            async with upd.lock:
                await self._expire_locked(upd, "the begin's answer could not be delivered "
                                          "(the trainer disconnected while it drained)")
        return 201, self._grant(upd)

    def _grant(self, upd: _Update) -> dict[str, Any]:
        """The begin's answer: the only place the lease secret (and the engine's route key,
        when this gateway launched the engine) is ever shown."""
        cfg = self.config
        d = upd.describe()
        d["lease"] = {**d["lease"], "secret": upd.secret, "header": LEASE_HEADER}
        engine: dict[str, Any] = {"base_url": cfg.advertised_engine_url, "model": cfg.model}
        if upd.route_key is not None:
            # An engine this gateway launched closes its weight routes to every client
            # without a key; the trainer granted an update is lent one for its lease.
            engine["route_key"] = upd.route_key
        return {**d, "state": upd.out.state.value, "engine": engine,
                "transport": dict(cfg.transport), "round_nonce": upd.round_nonce,
                "report": f"/control/updates/{upd.update_id}/transfer"}

    # ------------------------------------------------------------ report
    async def report(self, update_id: int, body: ReportBody,
                     lease: str | None = None) -> tuple[int, dict[str, Any]]:
        upd = self._owned(update_id, lease)
        if isinstance(upd, tuple):
            return upd
        ev: TransferEvidence | None = None
        sent: dict[str, Any] | None = None
        if body.transfer is not None:
            try:
                ev = body.transfer.to_evidence()
            except BadInput as exc:
                return 422, {"error": str(exc)}
            if body.transfer.sent_checksum is not None:
                sent = body.transfer.sent_checksum.model_dump()
                if not isinstance(self.runner.adapter, ExpectationTaker):
                    return 422, {"error": "this gateway cannot compare a sent checksum"}
                try:
                    self.runner.adapter.check_sent(sent)
                except BadInput as exc:
                    return 422, {"error": f"this gateway cannot use the sent checksum: {exc}"}
            refused = check_rank_declaration(self.config, upd.round_nonce, sent,
                                             completed=body.transfer.completed,
                                             backend=body.transfer.backend,
                                             claimed=upd.out.ticket.target.identity,
                                             source_manifest=upd.source_manifest)
            if refused is not None:
                return 422, {"error": refused}
        async with upd.lock:
            if upd.state is LeaseState.OPEN and time.monotonic() > upd.deadline_mono:
                await self._expire_locked(upd, "lease expired before the report arrived")
            if upd.state in (LeaseState.EXPIRING, LeaseState.EXPIRED):
                await upd.done.wait()
                return 410, {"error": "the lease expired; the update was classified without "
                             "this report", **upd.describe()}
            if upd.state is not LeaseState.OPEN:
                return 409, {"error": f"update {update_id} was already reported",
                             **upd.describe()}
            upd.move(LeaseEvent.REPORT)
            if upd.timer is not None:
                upd.timer.cancel()
        out = upd.out

        adapter = self.runner.adapter

        def work() -> dict[str, Any]:
            try:
                kept = self._take_back(upd)
                if kept is not None:  # the trainer could still write while it is checked
                    self.runner.report_transfer_failure(out, FailureKind.ERROR, kept)
                if ev is not None:
                    if isinstance(adapter, ExpectationTaker):
                        adapter.expect_sent(sent)
                    self.runner.report_transfer(out, ev)
                    self.runner.close_update(out)
                else:
                    assert body.failure is not None
                    kind, reason = FailureKind(body.failure.kind), body.failure.reason
                    if kind is FailureKind.REFUSED and isinstance(adapter, WriteObserver):
                        # 'refused' says nothing was sent; where the engine's own counters
                        # say otherwise the weights may be anything: not no_mutation.
                        writes = adapter.writes_since_drain(timeout_s=5.0)
                        if writes:
                            kind = FailureKind.BAD_EVIDENCE
                            reason = (f"{reason}; reported as refused, but the engine counted "
                                      f"{', '.join(writes)} since the drain")
                    self.runner.report_transfer_failure(out, kind, reason)
            except UpdateFailed as exc:
                return _failure(exc)
            except Exception as exc:
                # Nothing the runner classified (an adapter's check outside its phases):
                # the update still ends decided, from the engine's own counters, as an
                # expired lease would (no_mutation and back in service, or TAINTED).
                try:
                    self.runner.expire_lease(out, f"the report could not be handled: "
                                                  f"{type(exc).__name__}: {exc}")
                except UpdateFailed as uf:
                    return _failure(uf)
                raise  # pragma: no cover - expire_lease always ends in UpdateFailed
            c = self.runner.controller
            assert out.published is not None
            ident = c.identity
            return {"status": "published", "published": out.published.to_dict(),
                    "identity": None if ident is None else ident.to_dict(),
                    "verification": None if ident is None else {
                        "level": ident.verification.wire, "required": upd.verification.wire,
                        "evidence": list(ident.evidence)}}

        result = await anyio.to_thread.run_sync(work)
        shards = worker_shards(adapter) if sent is not None and \
            sent.get("scheme") == RANK_SCHEME else None
        if shards is not None:
            result["worker_shards"] = shards
        result.update(state=out.state.value, phases=out.breakdown())
        upd.move(LeaseEvent.PUBLISHED if result["status"] == "published" else LeaseEvent.FAILED,
                 result=result)
        upd.done.set()
        self._observe("published" if result["status"] == "published"
                      else result["classification"], out)
        return 200, upd.describe()

    # ------------------------------------------------------------ lease
    async def _lease_timer(self, upd: _Update) -> None:
        await asyncio.sleep(max(0.0, upd.deadline_mono - time.monotonic()))
        async with upd.lock:
            await self._expire_locked(
                upd, f"lease of {upd.lease_s:g}s expired without a report "
                "(trainer vanished or overran)")

    async def _expire_locked(self, upd: _Update, reason: str) -> None:
        if upd.state is not LeaseState.OPEN:
            return
        # EXPIRED only once classified: a status reader never sees an expired
        # update without its result (the fence after a taint takes a moment).
        upd.move(LeaseEvent.EXPIRE, reason=reason)
        out = upd.out

        def work() -> dict[str, Any]:
            kept = self._take_back(upd)
            try:
                self.runner.expire_lease(out, reason if kept is None else f"{reason}; {kept}")
            except UpdateFailed as exc:
                return _failure(exc)
            return {"status": "failed", "classification": "unknown",  # pragma: no cover
                    "state": self.runner.controller.state.value, "reason": reason}

        # Shielded: a cancelled caller must not leave the update half-classified.
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(work)
        result.update(status="expired", state=out.state.value, phases=out.breakdown())
        upd.move(LeaseEvent.CLASSIFIED, result=result)
        upd.done.set()
        self.metrics.leases_expired.inc()
        self._observe("lease_expired", out)

    def _unlend(self, lending: Future[str | None]) -> None:
        """A begin that opened no update: a key lent beside its drain is taken back (it
        was shown to nobody; the engine also drops it at its seconds)."""
        try:
            if lending.result() is not None:
                self.lender.revoke()
        except RolloutCoreError:
            pass

    def _take_back(self, upd: _Update) -> str | None:
        """The lease ended (its report, its expiry): the key lent for it is taken back
        from the engine (which also drops it at the lease's deadline by itself); why
        it could not be, or None."""
        if upd.route_key is None:
            return None
        try:
            self.lender.revoke()
        except RolloutCoreError as exc:
            return (f"the route key lent for the lease could not be taken back ({exc}): "
                    "it stays valid on the engine until the lease's deadline")
        upd.route_key = None
        return None

    async def aclose(self, wait_s: float = 120.0) -> None:
        """On shutdown no update stays half-done: an open lease is expired now (classified
        from the engine), and one being reported or expired is waited for, bounded by
        ``wait_s`` (the runner's own deadlines end it well before); then the lender's
        kept-alive connection is closed."""
        for upd in list(self._updates.values()):
            if upd.timer is not None:
                upd.timer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await upd.timer
            if upd.state in (LeaseState.REPORTING, LeaseState.EXPIRING):
                with anyio.move_on_after(wait_s):
                    await upd.done.wait()
                continue
            async with upd.lock:
                await self._expire_locked(upd, "service shut down during the lease")
        # Every lease has ended: the lender's thread and connection go with the gateway
        # (off the loop: a lend in flight ends within its deadline).
        await anyio.to_thread.run_sync(self.lender.close)

    def _observe(self, outcome: str, out: object) -> None:
        phases = out.breakdown() if isinstance(out, UpdateOutcome) else {}
        self.metrics.observe_update(outcome, phases)


_NOT_YOURS = {"error": "this update's lease belongs to the trainer that began it: present "
              f"its secret (the begin's lease.secret) in {LEASE_HEADER}"}


def _failure(exc: UpdateFailed) -> dict[str, Any]:
    return {"status": "failed", "classification": exc.classification, "state": exc.state,
            "phase": exc.phase, "reason": exc.reason}
