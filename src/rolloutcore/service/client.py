"""The trainer's side of the gateway's update protocol, in one call.

::

    with RolloutCoreClient("http://127.0.0.1:8100", token, transport=GlooTransport()) as rc:
        result = rc.update(model, Provenance("ckpt-step-42", "run-7", 42), owner="trainer-0")
        print(result.published)          # WeightVersion of the new policy

``update`` declares the identity of what it will send (manifest digest,
content digest, provenance), asks the gateway to begin (the gateway drains
its rollouts and pauses vLLM, then grants a lease), moves the weights
straight into vLLM through vLLM's weight-transfer path with a
``WeightTransport``, reports the transport's evidence, and returns once the
gateway has invalidated caches, validated, resumed and committed (or raises
``UpdateFailed`` with the gateway's classification).

Failures are always reported, never left to the lease: a transport error is
sent as a failure of the matching kind (``refused`` when the transport proves
nothing reached the engine, so the engine goes back to service on the old
weights); only a trainer that dies outright leaves the lease to expire.

Every HTTP call has a timeout. ``begin`` waits for the drain, so its timeout
must be longer than the gateway's drain deadline; a report whose answer is
lost is recovered by polling the update's status.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from rolloutcore.core.evidence import TransferEvidence
from rolloutcore.core.lifecycle import FailureKind
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.errors import (
    BadInput,
    EffectTimeout,
    EngineUnavailable,
    RolloutCoreError,
    TransferError,
    UpdateFailed,
    UpdateRefused,
)

__all__ = ["RolloutCoreClient", "TransferFn", "UpdateGrant", "UpdateResult", "identity_of"]


@dataclass(frozen=True)
class UpdateGrant:
    """What a begin granted: the update, its target label, the lease, the transport's needs."""

    update_id: int
    target: WeightVersion
    identity_digest: str
    lease_s: float
    lease_deadline_unix: float
    engine_url: str
    model: str | None
    transport: Mapping[str, Any]
    raw: Mapping[str, Any] = field(repr=False)

    @property
    def expires_in_s(self) -> float:
        return self.lease_deadline_unix - time.time()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UpdateGrant:
        try:
            return cls(int(d["update_id"]), WeightVersion.from_dict(d["target"]),
                       str(d["identity_digest"]), float(d["lease"]["seconds"]),
                       float(d["lease"]["deadline_unix"]), str(d["engine"]["base_url"]),
                       d["engine"].get("model"), dict(d.get("transport") or {}), dict(d))
        except (KeyError, TypeError, ValueError) as exc:
            raise RolloutCoreError(f"the gateway's begin answer is malformed: {d!r}") from exc


@dataclass(frozen=True)
class UpdateResult:
    """How an update ended, as the gateway decided it."""

    update_id: int
    status: str                       # published | failed | expired | open | reporting
    published: WeightVersion | None
    state: str
    classification: str | None = None
    phase: str | None = None
    reason: str | None = None
    identity: Mapping[str, Any] | None = None
    phases: Mapping[str, float] = field(default_factory=dict)
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @property
    def final(self) -> bool:
        return self.status in ("published", "failed", "expired")

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> UpdateResult:
        res = d.get("result") or {}
        pub = res.get("published")
        return cls(int(d["update_id"]), str(d.get("status", res.get("status", "unknown"))),
                   None if pub is None else WeightVersion.from_dict(pub),
                   str(res.get("state", d.get("state", "unknown"))),
                   res.get("classification"), res.get("phase"), res.get("reason"),
                   res.get("identity"), dict(res.get("phases") or {}), dict(d))

    def raise_for_failure(self) -> UpdateResult:
        if self.status != "published":
            exc = UpdateFailed(self.phase or "transfer", self.classification or "ambiguous",
                               self.state, self.reason or self.status)
            exc.outcome = self
            raise exc
        return self


#: A transfer the caller performs itself: (grant, source) -> the transport's evidence.
TransferFn = Callable[[UpdateGrant, Any], TransferEvidence]


def identity_of(source: Any, provenance: Provenance) -> WeightIdentity:
    """The identity a source declares: its manifest, its content digest, the provenance.

    Works for a ``WeightSource`` (``manifest()``, ``content_digest()``) and for
    anything exposing ``manifest`` and ``digest`` attributes (the fake weights).
    """
    if not isinstance(provenance, Provenance):
        raise BadInput("provenance must be a Provenance")
    man = getattr(source, "manifest", None)
    manifest = man() if callable(man) else man
    if not isinstance(manifest, ParameterManifest):
        raise BadInput("source must be a WeightSource or expose a ParameterManifest")
    cd = getattr(source, "content_digest", None)
    content = cd() if callable(cd) else getattr(source, "digest", None)
    if content is not None and not isinstance(content, str):
        raise BadInput("the source's content digest must be a hex string")
    return WeightIdentity.declare(manifest, provenance, content)


def _failure_kind(exc: BaseException) -> FailureKind:
    if isinstance(exc, EffectTimeout):
        return FailureKind.TIMEOUT
    if isinstance(exc, (TransferError, EngineUnavailable)) and not exc.mutation_started:
        return FailureKind.REFUSED
    return FailureKind.ERROR


class RolloutCoreClient:
    """A synchronous client of the gateway's control API (httpx, a timeout on every call)."""

    def __init__(self, base_url: str, token: str, *, transport: Any = None,
                 timeout_s: float = 30.0, begin_timeout_s: float = 600.0,
                 report_timeout_s: float = 600.0, transfer_timeout_s: float = 600.0,
                 connect_timeout_s: float = 120.0,
                 http_transport: httpx.BaseTransport | None = None) -> None:
        if not isinstance(token, str) or not token:
            raise BadInput("token must be a non-empty string")
        for name, v in (("timeout_s", timeout_s), ("begin_timeout_s", begin_timeout_s),
                        ("report_timeout_s", report_timeout_s),
                        ("transfer_timeout_s", transfer_timeout_s),
                        ("connect_timeout_s", connect_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    v > 0 and math.isfinite(v)):
                raise BadInput(f"{name} must be a positive number, got {v!r}")
        self.transport = transport
        self._timeout_s = float(timeout_s)
        self._begin_timeout_s = float(begin_timeout_s)
        self._report_timeout_s = float(report_timeout_s)
        self._transfer_timeout_s = float(transfer_timeout_s)
        self._connect_timeout_s = float(connect_timeout_s)
        self._connected_to: str | None = None
        self._http = httpx.Client(base_url=base_url.rstrip("/"), transport=http_transport,
                                  headers={"authorization": f"Bearer {token}"},
                                  timeout=self._timeout_s)

    # ------------------------------------------------------------ plumbing
    def _call(self, method: str, path: str, *, body: Any = None,
              timeout_s: float | None = None) -> tuple[int, Any]:
        try:
            r = self._http.request(method, path, json=body,
                                   timeout=timeout_s or self._timeout_s)
        except httpx.TimeoutException as exc:
            raise EffectTimeout(f"{method} {path}", timeout_s or self._timeout_s) from exc
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"{method} {path}", f"gateway unreachable: {exc!r}",
                                    mutation_started=False) from exc
        try:
            data = r.json()
        except ValueError:
            data = {"error": r.text[:500]}
        if r.status_code in (401, 403):
            raise BadInput(f"the gateway refused the token ({r.status_code}): "
                           f"{data.get('error') if isinstance(data, dict) else data}")
        return r.status_code, data

    def status(self) -> dict[str, Any]:
        code, data = self._call("GET", "/control/status")
        if code != 200:
            raise RolloutCoreError(f"status: HTTP {code}: {data}")
        return dict(data)

    # ------------------------------------------------------------ protocol steps
    def begin(self, identity: WeightIdentity, *, owner: str, label: str | None = None,
              min_verification: VerificationLevel | str = VerificationLevel.DECLARED,
              lease_s: float | None = None,
              source_manifest_digest: str | None = None) -> UpdateGrant:
        """Ask the gateway to drain and quiesce; returns the grant (raises when refused)."""
        if not isinstance(identity, WeightIdentity):
            raise BadInput("identity must be a WeightIdentity")
        level = (min_verification if isinstance(min_verification, VerificationLevel)
                 else VerificationLevel.parse(min_verification))
        body: dict[str, Any] = {
            "identity": {"manifest_digest": identity.manifest_digest,
                         "provenance": identity.provenance.to_dict(),
                         "content_digest": identity.content_digest},
            "owner": owner, "min_verification": level.wire}
        if label is not None:
            body["label"] = label
        if lease_s is not None:
            body["lease_s"] = lease_s
        if source_manifest_digest is not None:
            body["source_manifest_digest"] = source_manifest_digest
        code, data = self._call("POST", "/control/updates", body=body,
                                timeout_s=self._begin_timeout_s)
        if code == 201:
            return UpdateGrant.from_json(data)
        msg = data.get("error") if isinstance(data, dict) else data
        if code == 409:
            raise UpdateRefused(f"begin refused: {msg}")
        if code == 503 and isinstance(data, dict):
            raise UpdateFailed(str(data.get("phase", "drain")),
                               str(data.get("classification", "no_mutation")),
                               str(data.get("state", "unknown")), str(msg))
        raise BadInput(f"begin: HTTP {code}: {msg}")

    def _report(self, update_id: int, body: dict[str, Any]) -> UpdateResult:
        try:
            code, data = self._call("POST", f"/control/updates/{update_id}/transfer", body=body,
                                    timeout_s=self._report_timeout_s)
        except EffectTimeout:
            # The report may have been taken; the update's record says how it ended.
            return self.wait(update_id, self._report_timeout_s)
        if code in (200, 409, 410) and isinstance(data, dict) and "update_id" in data:
            res = UpdateResult.from_json(data)
            return res if res.final else self.wait(update_id, self._report_timeout_s)
        raise BadInput(f"report: HTTP {code}: {data}")

    def report(self, update_id: int, evidence: TransferEvidence) -> UpdateResult:
        """Report the transfer's evidence; returns once the gateway published or classified."""
        if not isinstance(evidence, TransferEvidence):
            raise BadInput("evidence must be a TransferEvidence")
        ev = {"completed": evidence.completed, "mutation_started": evidence.mutation_started,
              "backend": evidence.backend, "tensors": evidence.tensors,
              "bytes": evidence.bytes, "finish_label": evidence.finish_label,
              "error": evidence.error, "elapsed_s": evidence.elapsed_s,
              "unverified": list(evidence.unverified)[:32]}
        return self._report(update_id, {"transfer": ev})

    def report_failure(self, update_id: int, kind: FailureKind | str,
                       reason: str) -> UpdateResult:
        k = FailureKind(kind)
        if k is FailureKind.BAD_EVIDENCE:
            raise BadInput("bad_evidence is the gateway's verdict, not a trainer's report")
        return self._report(update_id, {"failure": {"kind": k.value,
                                                    "reason": (reason or k.value)[:4000]}})

    def get_update(self, update_id: int) -> UpdateResult:
        code, data = self._call("GET", f"/control/updates/{update_id}")
        if code != 200:
            raise BadInput(f"update {update_id}: HTTP {code}: {data}")
        return UpdateResult.from_json(data)

    def wait(self, update_id: int, timeout_s: float, poll_s: float = 0.2) -> UpdateResult:
        """Poll until the update is published, failed or expired (bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.get_update(update_id)
            if res.final:
                return res
            if time.monotonic() >= deadline:
                raise EffectTimeout(f"wait for update {update_id}", timeout_s)
            time.sleep(poll_s)

    # ------------------------------------------------------------ the one call
    def update(self, source: Any, provenance: Provenance, *, owner: str = "trainer",
               label: str | None = None,
               min_verification: VerificationLevel | str = VerificationLevel.DECLARED,
               lease_s: float | None = None, transfer: TransferFn | None = None,
               identity: WeightIdentity | None = None) -> UpdateResult:
        """Begin, transfer, report, wait for the commit. Raises ``UpdateFailed`` on failure.

        ``transfer`` replaces the default (``self.transport`` into the granted
        engine URL) when the caller moves the weights itself.
        """
        ident = identity or identity_of(source, provenance)
        if transfer is None and self.transport is None:
            raise BadInput("no weight transport: pass transport= to the client or transfer=")
        grant = self.begin(ident, owner=owner, label=label, min_verification=min_verification,
                           lease_s=lease_s)
        try:
            ev = (transfer or self._transfer)(grant, source)
        except BaseException as exc:
            # Report what we know at once; the lease is for trainers that cannot.
            try:
                res = self.report_failure(grant.update_id, _failure_kind(exc),
                                          f"{type(exc).__name__}: {exc}")
            except RolloutCoreError as rep_exc:
                exc.add_note(f"reporting the failure to the gateway failed too: {rep_exc}")
                raise exc from None
            if isinstance(exc, Exception):
                failed = UpdateFailed(res.phase or "transfer", res.classification or "ambiguous",
                                      res.state, f"{type(exc).__name__}: {exc}")
                failed.outcome = res
                raise failed from exc
            raise
        return self.report(grant.update_id, ev).raise_for_failure()

    def _transfer(self, grant: UpdateGrant, source: Any) -> TransferEvidence:
        t = self.transport
        want = grant.transport.get("backend")
        if want is not None and getattr(t, "backend", None) != want:
            raise TransferError("transfer", f"the engine expects transport backend {want!r}, "
                                f"this client has {getattr(t, 'backend', None)!r}",
                                mutation_started=False)
        left = grant.expires_in_s
        if left <= 0:
            raise TransferError("transfer", "the lease expired before the transfer started",
                                mutation_started=False)
        if self._connected_to != grant.engine_url:
            t.connect(grant.engine_url, timeout_s=min(self._connect_timeout_s, left))
            self._connected_to = grant.engine_url
        left = grant.expires_in_s
        ev = t.send(grant.engine_url, grant.target.label, source,
                    timeout_s=max(0.001, min(self._transfer_timeout_s, left)))
        if not isinstance(ev, TransferEvidence):
            raise TransferError("transfer", f"transport returned {type(ev).__name__}")
        return ev

    def close(self) -> None:
        try:
            if self.transport is not None and self._connected_to is not None:
                self.transport.close()
        finally:
            self._connected_to = None
            self._http.close()

    def __enter__(self) -> RolloutCoreClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
