"""The trainer's side of the gateway's update protocol, in one call.

::

    with RolloutCoreClient("http://127.0.0.1:8100", token, transport=GlooTransport()) as rc:
        result = rc.update(model, Provenance("ckpt-step-42", "run-7", 42), owner="trainer-0")
        print(result.published)          # WeightVersion of the new policy

``update`` declares the identity of what it will send (manifest digest,
content digest, provenance) and computes, from the very weights it sends,
the policy probe's expectations (``PolicyProbe``: the greedy continuation of
fixed prompts and its log-probabilities), as ``EngineSession.update`` does
in process. It asks the gateway to begin with them (the gateway checks them,
drains its rollouts and pauses vLLM, then grants a lease), moves the weights
straight into vLLM through vLLM's weight-transfer path with a
``WeightTransport``, reports the transport's evidence (and, where the
transport hashes what it sent, that checksum), and returns once the gateway
has invalidated caches, validated while paused, resumed, run the probe with
admission still closed and committed (or raises ``UpdateFailed`` with the
gateway's classification). ``result.verification`` is the level reached.

The lease is the caller's: its secret (from the begin's answer) goes with
every later call of the update, and its deadline is kept on this process's
monotonic clock from the duration the gateway granted, so a clock that
disagrees with the gateway's changes nothing. The transport's handshake
with the engine is done before the begin, outside the engine's pause.

Failures are always reported, never left to the lease: a transport error is
sent as a failure of the matching kind (``refused`` when the transport proves
nothing reached the engine, so the engine goes back to service on the old
weights); only a trainer that dies outright leaves the lease to expire.

Every HTTP call has a timeout. ``begin`` waits for the drain, so its timeout
must be longer than the gateway's drain deadline; a begin whose connection
breaks is sent again with the same ``begin_key`` (the gateway answers the
same grant, or classifies the one nobody received); a report whose answer is
lost is recovered by reading the update's status.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
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
from rolloutcore.engine.client import EngineClient
from rolloutcore.errors import (
    BadInput,
    EffectTimeout,
    EngineUnavailable,
    RolloutCoreError,
    TransferError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.service.adapter_answer import PublishedAdapter, parse_adapter_answer
from rolloutcore.transports import engine_key

__all__ = ["RolloutCoreClient", "TransferFn", "UpdateGrant", "UpdateResult", "identity_of",
           "probe_for"]

#: The header of the lease secret (``rolloutcore.service.control.LEASE_HEADER``).
LEASE_HEADER = "x-rolloutcore-lease"


@dataclass(frozen=True)
class UpdateGrant:
    """What a begin granted: the update, its target label, the lease, the transport's needs."""

    update_id: int
    target: WeightVersion
    identity_digest: str
    lease_s: float
    #: For people: the gateway's wall clock. Never compared with this host's.
    lease_deadline_unix: float
    engine_url: str
    model: str | None
    transport: Mapping[str, Any]
    raw: Mapping[str, Any] = field(repr=False)
    #: The lease's secret: every later call of this update presents it.
    lease_secret: str = field(default="", repr=False)
    #: The lease's end on *this* process's monotonic clock: the granted duration
    #: counted from when the begin was sent (so never later than the gateway's).
    deadline_mono: float = 0.0
    #: The engine's route key lent for this lease when the gateway launched it
    #: (``transports.engine_key``): its weight routes refuse a transfer without it.
    route_key: str | None = field(default=None, repr=False)
    #: The nonce of this update's transfer round: a gloo round sent with it has every
    #: rank's report checked by the gateway (``GlooTransport.declared_checksums``).
    round_nonce: str | None = field(default=None, repr=False)

    @property
    def ranks_checked(self) -> bool:
        """The gateway compares each engine rank's own report with the trainer's
        declaration (``transport.rank_reports``), under ``round_nonce``."""
        return bool(self.transport.get("rank_reports")) and self.round_nonce is not None

    @property
    def expires_in_s(self) -> float:
        return self.deadline_mono - time.monotonic()

    @classmethod
    def from_json(cls, d: Mapping[str, Any], sent_mono: float | None = None) -> UpdateGrant:
        try:
            lease = d["lease"]
            left = float(lease["expires_in_s"])
            if not math.isfinite(left) or left < 0:
                raise BadInput(f"expires_in_s {left!r}")
            start = time.monotonic() if sent_mono is None else sent_mono
            return cls(int(d["update_id"]), WeightVersion.from_dict(d["target"]),
                       str(d["identity_digest"]), float(lease["seconds"]),
                       float(lease["deadline_unix"]), str(d["engine"]["base_url"]),
                       d["engine"].get("model"), dict(d.get("transport") or {}), dict(d),
                       str(lease.get("secret") or ""), start + left,
                       _route_key(d["engine"].get("route_key")),
                       _round_nonce(d.get("round_nonce")))
        except (KeyError, TypeError, ValueError, BadInput) as exc:
            raise RolloutCoreError(f"the gateway's begin answer is malformed: {d!r}") from exc


def _route_key(v: object) -> str | None:
    if v is None:
        return None
    try:
        return engine_key.check_key(v)
    except ValueError as exc:
        raise BadInput(f"route_key: {exc}") from None


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
    #: This client's own clock (seconds), set by ``update``: ``begin`` and ``report``
    #: are the two round trips (the gateway's work inside them included),
    #: ``transfer`` the transport's send, ``total`` the whole call.
    client_s: Mapping[str, float] = field(default_factory=dict)

    @property
    def final(self) -> bool:
        return self.status in ("published", "failed", "expired")

    @property
    def verification(self) -> str | None:
        """The verification level the published version reached (``None``: not published)."""
        v = (self.raw.get("result") or {}).get("verification")
        return None if not isinstance(v, Mapping) else str(v.get("level"))

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


def probe_for(weights: Any, *, tolerance: float | None = None) -> Any:
    """The policy probe a trainer computes from what it sends (``PolicyProbe``).

    ``weights``: a checkpoint directory, a ``WeightSource`` read from one, a
    HF causal LM module, or anything with a ``policy_probe()`` method.
    Anything else has no model to run: pass a ``PolicyProbe`` you computed
    (``PolicyProbe.from_model``) instead.
    """
    from rolloutcore.verification.probe import DEFAULT_TOLERANCE, PolicyProbe, default_prompts

    tol = DEFAULT_TOLERANCE if tolerance is None else tolerance
    own = getattr(weights, "policy_probe", None)
    if callable(own):  # a source that computes its own (the fake weights)
        return own()
    path: str | None = None
    if isinstance(weights, (str, Path)):
        path = str(weights)
    else:
        desc = getattr(weights, "description", None)
        if isinstance(desc, str) and desc.startswith("checkpoint "):
            path = desc.removeprefix("checkpoint ")
    if path is not None:
        return PolicyProbe.from_checkpoint(path, tolerance=tol)
    if hasattr(weights, "config") and hasattr(weights, "forward"):
        vocab = int(weights.config.vocab_size)
        return PolicyProbe.from_model(weights, default_prompts(vocab), tolerance=tol)
    raise BadInput(f"cannot compute a policy probe from {type(weights).__name__}: pass "
                   "probe=PolicyProbe.from_model(model, prompts) (or probe=False where the "
                   "gateway's floor allows)")


def _round_nonce(v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not 0 < len(v) <= 128:
        raise BadInput(f"round_nonce {v!r} is not a string of 1..128 characters")
    return v


def _declares_ranks(transport: Any) -> bool:
    """A gloo transport that can declare what each engine rank must hold."""
    return (getattr(transport, "backend", None) == "rolloutcore_gloo"
            and callable(getattr(transport, "declared_checksums", None)))


def _hashes_what_it_sends(transport: Any) -> bool:
    """A transport that checksums what it sent (rc_cuda_ipc, ``compute_checksum``)."""
    return (getattr(transport, "backend", None) == "rc_cuda_ipc"
            and bool(getattr(transport, "compute_checksum", False)))


def _sent_checksum(transport: Any) -> dict[str, Any] | None:
    """The transport's checksum of the last send, for the gateway to compare (or None)."""
    names = tuple(getattr(transport, "last_sent_names", ()) or ())
    values = list(getattr(transport, "last_sent_checksum", ()) or ())
    if not names or len(values) != len(names):
        return None
    return {"scheme": "rc_cuda_ipc/block", "names": list(names),
            "values": [None if v is None or v < 0 else int(v) for v in values]}


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
                 http_transport: httpx.BaseTransport | None = None,
                 connected_to: str | None = None) -> None:
        """``connected_to``: the engine URL ``transport`` is already connected to (its
        handshake is not repeated); otherwise the first update connects it."""
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
        if connected_to is not None and (not isinstance(connected_to, str) or not connected_to):
            raise BadInput("connected_to must be an engine URL or None")
        self._connected_to: str | None = connected_to
        self._secrets: dict[int, str] = {}
        # One keep-alive connection to the gateway, reused by every call.
        self._http = EngineClient(base_url, transport=http_transport,
                                  headers={"authorization": f"Bearer {token}"},
                                  timeout_s=self._timeout_s)

    # ------------------------------------------------------------ plumbing
    def _call(self, method: str, path: str, *, body: Any = None,
              timeout_s: float | None = None,
              headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        # the one map (engine.errors): a timeout EffectTimeout, no gateway EngineUnreachable
        r = self._http.request(method, path, step=f"{method} {path}", json_body=body,
                               headers=headers, timeout_s=timeout_s or self._timeout_s,
                               check_status=False, mutation_started=False,
                               what=f"{method} {path} (gateway)")
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

    # ------------------------------------------------------------ adapter versions
    def update_adapter(self, adapter_dir: str | Path, provenance: Provenance, *,
                       base_dir: str | Path | None = None,
                       probe_tolerance: float | None = None,
                       timeout_s: float = 600.0) -> PublishedAdapter:
        """Publish the LoRA adapter saved in ``adapter_dir`` (``save_pretrained``, where
        the gateway can read it) as the next adapter version: the gateway (one engine or
        a fleet) checks, digests, loads and verifies it before anything is routed to it.

        Returns the published version with every engine's acknowledgement (its path,
        base, checks and phases; ``acks[""]`` for a gateway over one engine, one per
        replica for a fleet: ``service.adapter_answer``). A 200 that does not say one
        version published on every engine it went to (a replica missing or failed, the
        replicas naming different versions, a check not passed, a field malformed) is
        an ``UpdateFailed``, ambiguous: nothing is taken as published. Refused here,
        nothing sent, when the directory holds no
        ``adapter_config.json`` or ``provenance`` is not a ``Provenance``;
        ``BadInput`` for the gateway's 400 (a bad adapter), ``UpdateRefused`` for
        its refusal (nothing changed), ``UpdateFailed`` when it was not published
        (the previous adapter keeps serving). ``base_dir``: after a full update of
        the base, the new base's checkpoint (the gateway's references of base +
        adapter are computed from it; without it such an update is refused).
        ``probe_tolerance``: the tolerance (nats) of the gateway's probe through the
        adapter, as a trainer declares a full update's (default the gateway's; at
        most 0.05).
        """
        if isinstance(adapter_dir, bool) or not isinstance(adapter_dir, (str, Path)) or \
                not str(adapter_dir):
            raise BadInput(f"adapter_dir must be a directory path, got {adapter_dir!r}")
        d = Path(adapter_dir)
        if not (d / "adapter_config.json").is_file():
            raise BadInput(f"adapter_dir {d}: no adapter_config.json (save the PEFT model "
                           f"with save_pretrained first)")
        if not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not (
                timeout_s > 0 and math.isfinite(timeout_s)):
            raise BadInput(f"timeout_s must be a positive number, got {timeout_s!r}")
        body: dict[str, Any] = {"adapter_dir": str(d.resolve()),
                                "provenance": {"checkpoint": provenance.checkpoint,
                                               "trainer_run": provenance.trainer_run,
                                               "step": provenance.step}}
        if probe_tolerance is not None:
            from rolloutcore.control.adapters import check_probe_tolerance

            body["probe_tolerance"] = check_probe_tolerance(probe_tolerance, 0.0)
        if base_dir is not None:
            if isinstance(base_dir, bool) or not isinstance(base_dir, (str, Path)) or \
                    not (Path(base_dir) / "config.json").is_file():
                raise BadInput(f"base_dir must be a checkpoint directory, got {base_dir!r}")
            body["base_dir"] = str(Path(base_dir).resolve())
        code, data = self._call("POST", "/control/adapters", body=body, timeout_s=timeout_s)
        if code == 200:
            try:
                return parse_adapter_answer(data)
            except (BadInput, RecursionError) as exc:
                raise UpdateFailed("adapter", "ambiguous", "unknown",
                                   f"the gateway answered 200 to the adapter update, but not "
                                   f"with one version published on every engine it went to "
                                   f"({exc}): not taken as published") from exc
        err = data.get("error") if isinstance(data, dict) else data
        if code == 400:
            raise BadInput(f"the gateway refused the adapter: {err}")
        if code == 404:
            raise BadInput("this gateway serves no adapters (start it with serve --lora)")
        if code == 409 and isinstance(data, dict) and data.get("refused"):
            raise UpdateRefused(f"adapter update refused: {err}")
        if code == 409 and isinstance(data, dict):
            raise UpdateFailed(str(data.get("phase") or "adapter"),
                               str(data.get("classification") or "ambiguous"), "READY",
                               f"adapter not published: {err}")
        raise RolloutCoreError(f"update_adapter: HTTP {code}: {err}")

    def adapters(self) -> dict[str, Any]:
        """``GET /control/adapters``: the current adapter version and every version's state."""
        code, data = self._call("GET", "/control/adapters")
        if code == 404:
            raise BadInput("this gateway serves no adapters (start it with serve --lora)")
        if code != 200 or not isinstance(data, dict):
            raise RolloutCoreError(f"adapters: HTTP {code}: {data}")
        return dict(data)

    # ------------------------------------------------------------ protocol steps
    def begin(self, identity: WeightIdentity, *, owner: str, label: str | None = None,
              min_verification: VerificationLevel | str | None = None,
              lease_s: float | None = None,
              source_manifest_digest: str | None = None, probe: Any = None,
              engine_checksums: Mapping[str, str] | None = None,
              transport_checksum: bool = False, begin_key: str | None = None,
              retries: int = 2) -> UpdateGrant:
        """Ask the gateway to drain and quiesce; returns the grant (raises when refused).

        ``probe`` (a ``PolicyProbe``) and ``engine_checksums`` are what the
        gateway will compare the engine with; ``min_verification`` defaults
        to the gateway's floor. A begin whose connection breaks is sent again
        (``retries`` times) with the same ``begin_key``.
        """
        if not isinstance(identity, WeightIdentity):
            raise BadInput("identity must be a WeightIdentity")
        body: dict[str, Any] = {
            "identity": {"manifest_digest": identity.manifest_digest,
                         "provenance": identity.provenance.to_dict(),
                         "content_digest": identity.content_digest},
            "owner": owner, "begin_key": begin_key or secrets.token_urlsafe(24)}
        if min_verification is not None:
            level = (min_verification if isinstance(min_verification, VerificationLevel)
                     else VerificationLevel.parse(min_verification))
            body["min_verification"] = level.wire
        expect: dict[str, Any] = {}
        if probe is not None:
            wire = getattr(probe, "to_wire", None)
            if not callable(wire):
                raise BadInput("probe must be a PolicyProbe (or None)")
            expect["probe"] = wire()
        if engine_checksums is not None:
            expect["engine_checksums"] = dict(engine_checksums)
        if transport_checksum:
            expect["transport_checksum"] = True
        given = {"expect": expect or None, "label": label, "lease_s": lease_s,
                 "source_manifest_digest": source_manifest_digest}
        body.update({k: v for k, v in given.items() if v is not None})
        for attempt in range(retries + 1):
            sent = time.monotonic()
            try:
                code, data = self._call("POST", "/control/updates", body=body,
                                        timeout_s=self._begin_timeout_s)
            except EngineUnavailable:
                # The answer (if any) was lost with the connection: the same key gets
                # the same grant while it is open; a grant nobody received was
                # classified by the gateway from the engine.
                if attempt == retries:
                    raise
                continue
            break
        if code in (200, 201):
            grant = UpdateGrant.from_json(data, sent)
            if grant.route_key is not None:
                # The engine's weight routes answer this process's transports for this
                # lease (a transfer= of the caller's too): the key is lent for it
                # (transports.engine_key) and ends with it.
                engine_key.register(grant.engine_url, grant.route_key, lent=True)
            return grant
        msg = data.get("error") if isinstance(data, dict) else data
        if code == 409:
            raise UpdateRefused(f"begin refused: {msg}")
        if code == 422:
            raise BadInput(f"begin refused (422): {msg}")
        if code == 503 and isinstance(data, dict):
            raise UpdateFailed(str(data.get("phase", "drain")),
                               str(data.get("classification", "no_mutation")),
                               str(data.get("state", "unknown")), str(msg))
        raise BadInput(f"begin: HTTP {code}: {msg}")

    def _lease(self, grant: UpdateGrant | int) -> tuple[int, dict[str, str]]:
        if isinstance(grant, UpdateGrant):
            self._secrets[grant.update_id] = grant.lease_secret
            return grant.update_id, {LEASE_HEADER: grant.lease_secret}
        secret = self._secrets.get(grant)
        return grant, {} if secret is None else {LEASE_HEADER: secret}

    def _report(self, grant: UpdateGrant | int, body: dict[str, Any]) -> UpdateResult:
        update_id, headers = self._lease(grant)
        try:
            code, data = self._call("POST", f"/control/updates/{update_id}/transfer", body=body,
                                    timeout_s=self._report_timeout_s, headers=headers)
        except (EffectTimeout, EngineUnavailable):
            # The report may have been taken; the update's record says how it ended.
            return self.wait(grant, self._report_timeout_s)
        if code in (200, 409, 410) and isinstance(data, dict) and "update_id" in data:
            res = UpdateResult.from_json(data)
            return res if res.final else self.wait(grant, self._report_timeout_s)
        raise BadInput(f"report: HTTP {code}: {data}")

    def report(self, grant: UpdateGrant | int, evidence: TransferEvidence, *,
               sent_checksum: Mapping[str, Any] | None = None) -> UpdateResult:
        """Report the transfer's evidence; returns once the gateway published or classified.

        The gateway answers only once it has validated, resumed and committed
        (or classified): one call, no polling.
        """
        if not isinstance(evidence, TransferEvidence):
            raise BadInput("evidence must be a TransferEvidence")
        ev: dict[str, Any] = {
            "completed": evidence.completed, "mutation_started": evidence.mutation_started,
            "backend": evidence.backend, "tensors": evidence.tensors,
            "bytes": evidence.bytes, "finish_label": evidence.finish_label,
            "error": evidence.error, "elapsed_s": evidence.elapsed_s,
            "unverified": list(evidence.unverified)[:32]}
        if sent_checksum is not None:
            ev["sent_checksum"] = dict(sent_checksum)
        return self._report(grant, {"transfer": ev})

    def report_failure(self, grant: UpdateGrant | int, kind: FailureKind | str,
                       reason: str) -> UpdateResult:
        k = FailureKind(kind)
        if k is FailureKind.BAD_EVIDENCE:
            raise BadInput("bad_evidence is the gateway's verdict, not a trainer's report")
        return self._report(grant, {"failure": {"kind": k.value,
                                                "reason": (reason or k.value)[:4000]}})

    def get_update(self, grant: UpdateGrant | int) -> UpdateResult:
        update_id, headers = self._lease(grant)
        code, data = self._call("GET", f"/control/updates/{update_id}", headers=headers)
        if code != 200:
            raise BadInput(f"update {update_id}: HTTP {code}: {data}")
        return UpdateResult.from_json(data)

    def wait(self, grant: UpdateGrant | int, timeout_s: float,
             poll_s: float = 0.2) -> UpdateResult:
        """Poll until the update is published, failed or expired (bounded).

        Only for a report whose answer was lost: the report itself answers
        with the final result.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.get_update(grant)
            if res.final:
                return res
            if time.monotonic() >= deadline:
                update_id = grant.update_id if isinstance(grant, UpdateGrant) else grant
                raise EffectTimeout(f"wait for update {update_id}", timeout_s)
            time.sleep(poll_s)

    # ------------------------------------------------------------ the one call
    def update(self, source: Any, provenance: Provenance, *, owner: str = "trainer",
               label: str | None = None,
               min_verification: VerificationLevel | str | None = None,
               lease_s: float | None = None, transfer: TransferFn | None = None,
               identity: WeightIdentity | None = None, probe: Any = True,
               probe_tolerance: float | None = None,
               engine_checksums: Mapping[str, str] | None = None) -> UpdateResult:
        """Begin, transfer, report, wait for the commit. Raises ``UpdateFailed`` on failure.

        ``probe=True`` computes the policy probe from ``source`` (``probe_for``:
        a checkpoint directory, a ``WeightSource`` read from one, a HF
        module), as ``EngineSession.update`` does; a ``PolicyProbe`` is used as
        given; ``False`` sends none (the gateway refuses that when its floor is
        ``probe``). ``transfer`` replaces the default (``self.transport`` into
        the granted engine URL) when the caller moves the weights itself.
        """
        if isinstance(source, (str, Path)):
            from rolloutcore.transports.source import WeightSource

            source = WeightSource.from_checkpoint(source)
        ident = identity or identity_of(source, provenance)
        if transfer is None and self.transport is None:
            raise BadInput("no weight transport: pass transport= to the client or transfer=")
        pset = (probe_for(source, tolerance=probe_tolerance) if probe is True
                else None if probe is False or probe is None else probe)
        hashes = transfer is None and _hashes_what_it_sends(self.transport)
        ranks = transfer is None and _declares_ranks(self.transport)
        if transfer is None:
            self._preconnect()
        t0 = time.monotonic()
        grant = self.begin(ident, owner=owner, label=label, min_verification=min_verification,
                           lease_s=lease_s, probe=pset, engine_checksums=engine_checksums,
                           transport_checksum=hashes or ranks)
        t1 = time.monotonic()
        try:
            ev = (transfer or self._transfer)(grant, source)
        except BaseException as exc:
            # Report what we know at once; the lease is for trainers that cannot.
            try:
                res = self.report_failure(grant, _failure_kind(exc),
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
        t2 = time.monotonic()
        sent = _sent_checksum(self.transport) if hashes else None
        if ranks and grant.ranks_checked:
            assert self.transport is not None
            sent = self.transport.declared_checksums(grant.engine_url)
        try:
            res = self.report(grant, ev, sent_checksum=sent)
        except BadInput as exc:
            # The gateway refused this report (a 4xx; its lease is still open): the
            # update is decided now, as a failed transfer, not left paused to its lease.
            try:
                res = self.report_failure(grant, FailureKind.ERROR,
                                          f"the gateway refused the transfer report: {exc}")
            except RolloutCoreError as rep_exc:
                exc.add_note(f"reporting the failure to the gateway failed too: {rep_exc}")
                raise
            failed = UpdateFailed(res.phase or "transfer", res.classification or "ambiguous",
                                  res.state, f"the gateway refused the transfer report: {exc}")
            failed.outcome = res
            raise failed from exc
        t3 = time.monotonic()
        res = dataclasses.replace(res, client_s={"begin": t1 - t0, "transfer": t2 - t1,
                                                 "report": t3 - t2, "total": t3 - t0})
        return res.raise_for_failure()

    def _preconnect(self) -> None:
        """The transport's handshake with the engine before the begin: it changes no
        weights, so it need not be paid inside the engine's pause (once per engine)."""
        t = self.transport
        if t is None or self._connected_to is not None:
            return
        try:
            engine = self.status().get("engine", {})
        except RolloutCoreError:
            return  # the begin will say what is wrong
        url = engine.get("base_url") if isinstance(engine, dict) else None
        if isinstance(url, str) and url:
            if engine.get("route_guard") and not engine_key.owns(url):
                # An engine the gateway launched refuses a client without its route
                # key, which is lent with each grant: connected inside that lease.
                return
            t.connect(url, timeout_s=self._connect_timeout_s)
            self._connected_to = url

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
        extra: dict[str, Any] = {}
        if grant.ranks_checked and _declares_ranks(t):
            extra["nonce"] = grant.round_nonce  # every rank's report is of this round
        ev = t.send(grant.engine_url, grant.target.label, source,
                    timeout_s=max(0.001, min(self._transfer_timeout_s, left)), **extra)
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
