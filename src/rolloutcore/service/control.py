"""The trainer protocol: a two-phase update across processes, under a lease.

::

    trainer                         gateway (this module)                 vLLM
    POST /control/updates   ---->   runner.open_update: close admission,
      {identity, owner, ...}        drain bound rollouts, pause, preflight
                            <----   201 {update_id, target label, lease,
                                         engine URL, transport config}
    transfer through vLLM's weight-transfer path  ----------------------> /start_weight_update
                                                                           /update_weights
                                                                           /finish_weight_update
    POST /control/updates/{id}/transfer
      {transfer: TransferEvidence} or {failure: {kind, reason}}
                            ---->   runner.report_transfer + close_update:
                                    invalidate caches, validate while
                                    paused, resume, publish (or classify)
                            <----   200 {status: published | failed, ...}

The begin grants a **lease**: if no report arrives before its deadline (the
trainer died, hung or overran) the service itself reports a TIMEOUT failure
of the transfer step. The failure policy classifies that as ambiguous (a
mutation may have started), so the engine is TAINTED and fenced and nothing
is published; a report that arrives later is answered 410 with that
classification. Report and expiry are serialized per update, so exactly one
of them decides.

Request bodies are validated by strict pydantic models (no type coercion,
no unknown fields, bounded strings and numbers); the same models produce
the OpenAPI document served at ``/openapi.json``, which the property-based
tests fuzz.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic import model_validator as _model_validator
from pydantic.json_schema import models_json_schema

from rolloutcore.control.runner import LifecycleRunner, UpdateOutcome
from rolloutcore.core.evidence import PreflightEvidence, TransferEvidence
from rolloutcore.core.lifecycle import FailureKind
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity, WeightVersion
from rolloutcore.errors import BadInput, UpdateFailed, UpdateRefused
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.metrics import ServiceMetrics

__all__ = [
    "BeginBody",
    "FailureBody",
    "IdentityBody",
    "ProvenanceBody",
    "ReportBody",
    "TransferBody",
    "UpdateManager",
    "openapi_document",
    "parse_body",
]

_HEX64 = r"^[0-9a-f]{64}$"
_LABEL = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_INT63 = 2**63 - 1

Hex64 = Annotated[str, StringConstraints(pattern=_HEX64)]
Label = Annotated[str, StringConstraints(pattern=_LABEL)]


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


class BeginBody(_Strict):
    """Ask to begin an update: the service drains, quiesces and grants a lease."""

    identity: IdentityBody
    owner: Annotated[str, StringConstraints(min_length=1, max_length=128)]
    label: Label | None = None
    min_verification: Literal["declared", "manifest", "engine-checksum", "probe"] = "declared"
    lease_s: Annotated[float, Field(gt=0, le=86400, allow_inf_nan=False)] | None = None
    #: Digest of the manifest the trainer will actually send (defaults to the identity's).
    source_manifest_digest: Hex64 | None = None


class TransferBody(_Strict):
    """The trainer's ``TransferEvidence``, field for field."""

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


def parse_body(model: type[_Strict], raw: bytes) -> tuple[int, Any]:
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
    status: str = "open"            # open | reporting | published | failed | expiring | expired
    result: dict[str, Any] | None = None
    timer: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def describe(self) -> dict[str, Any]:
        left = max(0.0, self.deadline_mono - time.monotonic())
        return {"update_id": self.update_id, "owner": self.owner, "status": self.status,
                "target": self.target.to_dict(), "identity_digest": self.identity_digest,
                "lease": {"seconds": self.lease_s, "deadline_unix": self.deadline_wall,
                          "expires_in_s": left if self.status == "open" else 0.0},
                "result": self.result}


class UpdateManager:
    """Begin, report, lease expiry. One update at a time (the controller's single writer)."""

    def __init__(self, runner: LifecycleRunner, config: ServiceConfig,
                 metrics: ServiceMetrics) -> None:
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self._updates: OrderedDict[int, _Update] = OrderedDict()
        self._opening = False

    @property
    def open_update(self) -> _Update | None:
        for u in reversed(self._updates.values()):
            if u.status in ("open", "reporting", "expiring"):
                return u
        return None

    def get(self, update_id: int) -> dict[str, Any] | None:
        u = self._updates.get(update_id)
        return None if u is None else u.describe()

    # ------------------------------------------------------------ begin
    async def begin(self, body: BeginBody) -> tuple[int, dict[str, Any]]:
        cfg = self.config
        busy = self.open_update
        if self._opening or busy is not None:
            who = f"update {busy.update_id} by {busy.owner!r}" if busy else "another begin"
            return 409, {"error": f"{who} is in progress; one writer at a time",
                         "state": self.runner.controller.state.value}
        try:
            identity = body.identity.to_identity()
            level = VerificationLevel.parse(body.min_verification)
        except BadInput as exc:
            return 422, {"error": str(exc)}
        pre = PreflightEvidence(
            source_manifest_digest=body.source_manifest_digest or identity.manifest_digest,
            source_provenance=identity.provenance)
        lease_s = min(body.lease_s or cfg.lease_s, cfg.max_lease_s)
        self._opening = True
        try:
            out = await anyio.to_thread.run_sync(
                lambda: self.runner.open_update(identity, owner=body.owner, label=body.label,
                                                min_verification=level, preflight=pre))
        except UpdateRefused as exc:
            return 409, {"error": str(exc), "state": self.runner.controller.state.value}
        except BadInput as exc:
            return 409, {"error": str(exc), "state": self.runner.controller.state.value}
        except UpdateFailed as exc:
            result = _failure(exc)
            self._observe(result["classification"], exc.outcome)
            return 503, {"error": f"the update could not begin: {exc}", **result}
        finally:
            self._opening = False
        t = out.ticket
        now_m, now_w = time.monotonic(), time.time()
        upd = _Update(t.update_id, body.owner, t.target.version, identity.digest, out, lease_s,
                      now_m + lease_s, now_w + lease_s)
        self._updates[t.update_id] = upd
        while len(self._updates) > cfg.remember_updates:
            oldest = next(iter(self._updates.values()))
            if oldest.status in ("open", "reporting", "expiring"):
                break
            self._updates.popitem(last=False)
        upd.timer = asyncio.get_running_loop().create_task(self._lease_timer(upd))
        return 201, {**upd.describe(), "state": out.state.value,
                     "engine": {"base_url": cfg.advertised_engine_url, "model": cfg.model},
                     "transport": dict(cfg.transport),
                     "report": f"/control/updates/{t.update_id}/transfer"}

    # ------------------------------------------------------------ report
    async def report(self, update_id: int, body: ReportBody) -> tuple[int, dict[str, Any]]:
        upd = self._updates.get(update_id)
        if upd is None:
            return 404, {"error": f"no update {update_id}"}
        ev: TransferEvidence | None = None
        if body.transfer is not None:
            try:
                ev = body.transfer.to_evidence()
            except BadInput as exc:
                return 422, {"error": str(exc)}
        async with upd.lock:
            if upd.status == "open" and time.monotonic() > upd.deadline_mono:
                await self._expire_locked(upd, "lease expired before the report arrived")
            if upd.status == "expired":
                await upd.done.wait()
                return 410, {"error": "the lease expired; the update was classified without "
                             "this report", **upd.describe()}
            if upd.status != "open":
                return 409, {"error": f"update {update_id} was already reported",
                             **upd.describe()}
            upd.status = "reporting"
            if upd.timer is not None:
                upd.timer.cancel()
        out = upd.out

        def work() -> dict[str, Any]:
            try:
                if ev is not None:
                    self.runner.report_transfer(out, ev)
                    self.runner.close_update(out)
                else:
                    assert body.failure is not None
                    self.runner.report_transfer_failure(out, FailureKind(body.failure.kind),
                                                        body.failure.reason)
            except UpdateFailed as exc:
                return _failure(exc)
            c = self.runner.controller
            assert out.published is not None
            ident = c.identity
            return {"status": "published", "published": out.published.to_dict(),
                    "identity": None if ident is None else ident.to_dict()}

        result = await anyio.to_thread.run_sync(work)
        result.update(state=out.state.value, phases=out.breakdown())
        upd.result = result
        upd.status = result["status"]
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
        if upd.status != "open":
            return
        # "expired" only once classified: a status reader never sees an expired
        # update without its result (the fence after a taint takes a moment).
        upd.status = "expiring"
        out = upd.out

        def work() -> dict[str, Any]:
            try:
                self.runner.report_transfer_failure(out, FailureKind.TIMEOUT, reason)
            except UpdateFailed as exc:
                return _failure(exc)
            return {"status": "failed", "classification": "unknown",  # pragma: no cover
                    "state": self.runner.controller.state.value, "reason": reason}

        # Shielded: a cancelled caller must not leave the update half-classified.
        with anyio.CancelScope(shield=True):
            result = await anyio.to_thread.run_sync(work)
        result.update(status="expired", state=out.state.value, phases=out.breakdown())
        upd.result = result
        upd.status = "expired"
        upd.done.set()
        self.metrics.leases_expired.inc()
        self._observe("lease_expired", out)

    async def aclose(self) -> None:
        """On shutdown an open lease is expired now: nothing may stay half-updated."""
        for upd in list(self._updates.values()):
            if upd.timer is not None:
                upd.timer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await upd.timer
            async with upd.lock:
                await self._expire_locked(upd, "service shut down during the lease")

    def _observe(self, outcome: str, out: object) -> None:
        phases = out.breakdown() if isinstance(out, UpdateOutcome) else {}
        self.metrics.observe_update(outcome, phases)


def _failure(exc: UpdateFailed) -> dict[str, Any]:
    return {"status": "failed", "classification": exc.classification, "state": exc.state,
            "phase": exc.phase, "reason": exc.reason}


# ---------------------------------------------------------------------- OpenAPI

def openapi_document(title: str = "RolloutCore gateway: control API",
                     version: str = "1") -> dict[str, Any]:
    """The control API as OpenAPI 3.1, from the same models that validate requests."""
    _, defs = models_json_schema(
        [(m, "validation") for m in (BeginBody, ReportBody)],
        ref_template="#/components/schemas/{model}")
    schemas = defs.get("$defs", {})

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    obj = {"type": "object"}

    def resp(*codes: int, ok: int = 200) -> dict[str, Any]:
        out: dict[str, Any] = {str(ok): {"description": "ok",
                                         "content": {"application/json": {"schema": obj}}}}
        for c in codes:
            out[str(c)] = {"description": _REASONS.get(c, "error"),
                           "content": {"application/json": {"schema": obj}}}
        return out

    auth_errors = (401, 403)
    uid = {"name": "update_id", "in": "path", "required": True,
           "schema": {"type": "integer", "minimum": 1, "maximum": _INT63}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
        "paths": {
            "/control/updates": {"post": {
                "operationId": "beginUpdate",
                "summary": "Begin an update: drain, quiesce, grant a lease",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref("BeginBody")}}},
                "responses": resp(400, *auth_errors, 409, 413, 415, 422, 503, ok=201),
            }},
            "/control/updates/{update_id}": {"get": {
                "operationId": "getUpdate",
                "summary": "An update's lease and result",
                "parameters": [uid],
                "responses": resp(*auth_errors, 404),
            }},
            "/control/updates/{update_id}/transfer": {"post": {
                "operationId": "reportTransfer",
                "summary": "Report the transfer (evidence or failure); the service commits",
                "parameters": [uid],
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": ref("ReportBody")}}},
                "responses": resp(400, *auth_errors, 404, 409, 410, 413, 415, 422),
            }},
            "/control/status": {"get": {
                "operationId": "status",
                "summary": "State, committed version and identity, rollouts, transitions",
                "responses": resp(*auth_errors),
            }},
        },
    }


_REASONS = {400: "malformed JSON", 401: "missing bearer token", 403: "wrong token",
            404: "no such update", 409: "conflict (another update, or already reported)",
            410: "the lease expired", 413: "body too large", 415: "not JSON",
            422: "invalid fields", 503: "the update could not begin"}
