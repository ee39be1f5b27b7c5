"""One engine's native rounds (``service.native``): the runner's update, vLLM over HTTP.

A round is ``runner.open_update`` -> the trainer's start/update/finish
forwarded to the engine -> ``report_transfer`` + ``close_update`` (the
caches reset and checked, validated while paused, resumed, published), the
same two-phase form the trainer protocol and the fleet coordinator use. A
failure goes through the failure policy (``report_transfer_failure``); a
round that outlives its deadline is expired as a lease is
(``expire_lease``: classified from the engine's own write counters).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlencode

import anyio

from rolloutcore.control.port import ExpectationTaker
from rolloutcore.control.runner import LifecycleRunner, UpdateOutcome
from rolloutcore.core.evidence import Check, PreflightEvidence, TransferEvidence
from rolloutcore.core.lifecycle import FailureKind, State
from rolloutcore.core.records import Note
from rolloutcore.core.versions import Provenance, VerificationLevel, WeightIdentity
from rolloutcore.engine.client import AsyncEngineClient
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.upstream import UpstreamPool
from rolloutcore.errors import BadInput, EffectError, EffectTimeout, UpdateFailed, UpdateRefused
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.native import NATIVE_LEVEL, Failed, Manifest, NativeRefusal
from rolloutcore.transports import engine_key

__all__ = ["EngineRounds", "native_identity", "record_round", "relay_call"]


def native_identity(seq: int, after: Any) -> WeightIdentity:
    """The identity of a round whose trainer declares nothing: unique per round."""
    seed = json.dumps({"native_round": seq, "after": after}, sort_keys=True,
                      default=str).encode()
    return WeightIdentity(hashlib.sha256(seed).hexdigest(),
                          Provenance(f"native:{NATIVE_LEVEL}", "native", seq))


def record_round(runner: LifecycleRunner, written: Manifest, note: Note) -> None:
    """What the gateway checked of a round (``service.native``), handed to the engine's
    validation and journal before its transfer is reported: one engine's round and each
    replica of a fleet's (``fleet.native``) alike.

    Every name written once, the last round's all covered: names, dtypes and shapes
    only, so it establishes nothing above declared. On a vLLM with no label (0.26) and
    no reference it is the only check the round has; the adapter reports it with the
    next paused validation (``VllmAdapter.add_round_check``), which without it is
    refused ("no evidence at all")."""
    add = getattr(runner.adapter, "add_round_check", None)
    if callable(add) and written:
        add(Check("native_manifest", True, f"{len(written)} parameters, each written once "
                  "by the sender's /update_weights calls, covering the last round's "
                  "(names, dtypes, shapes; values not checked)",
                  level=VerificationLevel.DECLARED))
    runner.emit(note)


def failed_result(exc: UpdateFailed) -> dict[str, Any]:
    return {"status": "failed", "classification": exc.classification, "reason": exc.reason}


async def relay_call(client: AsyncEngineClient | UpstreamPool, url: str, method: str,
                     route: str, query: Mapping[str, str], body: Any, timeout_s: float
                     ) -> tuple[int, Any]:
    """One call to vLLM; ``NativeRefusal`` 504 when it did not answer in time, 409 when
    it could not be reached; vLLM's own status and body otherwise.

    ``body``: JSON to encode, or ``bytes`` forwarded as they came (a sender's body the
    gateway read but did not change). ``client``: one engine's keep-alive pool
    (``UpstreamPool``, the lean client: ``EngineRounds``) or an ``AsyncEngineClient``."""
    try:
        if isinstance(client, UpstreamPool):
            path = f"{route}?{urlencode(query)}" if query else route
            raw = body if isinstance(body, bytes) else \
                b"" if body is None else json.dumps(body).encode()
            status, got = await client.exchange(method, path, raw, timeout_s=timeout_s)
        else:
            json_body, headers = body, engine_key.headers_for(url)
            if isinstance(body, bytes):
                json_body, headers = None, {**headers, "content-type": "application/json"}
            resp = await client.request(
                method, route, step="native", timeout_s=timeout_s,
                params=dict(query) or None, json_body=json_body,
                content=body if isinstance(body, bytes) else None, headers=headers,
                check_status=False, mutation_started=False)
            status, got = resp.status_code, resp.content
    except EffectTimeout as exc:
        raise NativeRefusal(504, f"vLLM did not answer {route} in time: "
                            f"{exc.__cause__ or exc!r}", "UpstreamTimeout") from exc
    except EffectError as exc:
        raise NativeRefusal(409, f"vLLM unreachable on {route}: {exc.__cause__ or exc!r}",
                            "UpstreamError") from exc
    with contextlib.suppress(ValueError, UnicodeDecodeError, RecursionError):
        return status, json.loads(got)
    return status, {"text": got[:300].decode("utf-8", "replace")}


async def forward_step(client: AsyncEngineClient | UpstreamPool, url: str, route: str,
                       body: Any,
                       timeout_s: float, who: str = "") -> Failed | None:
    """A round's start/update/finish to one engine: None, or what failed (named)."""
    try:
        status, answer = await relay_call(client, url, "POST", route, {}, body, timeout_s)
    except NativeRefusal as r:
        return Failed(r.status, f"{who}{route}: {r.message}", timeout=r.status == 504)
    if status < 400:
        return None
    return Failed(409 if status >= 500 else status,
                  f"{who}vLLM answered {route} with {status}: {json.dumps(answer)[:300]}")


class EngineRounds:
    """``RoundBackend`` of one engine's gateway (its runner, its upstream)."""

    def __init__(self, runner: LifecycleRunner, config: ServiceConfig) -> None:
        self.runner = runner
        self.config = config
        self.floor = config.floor
        self._pool: UpstreamPool | None = None

    # ------------------------------------------------------------ reading
    def health(self) -> str | None:
        c = self.runner.controller
        ok = c.failed_closed is None and c.state.value not in (
            "TAINTED", "UNINITIALIZED", "RECOVERING")
        return None if ok else f"state {c.state.value}"

    def paused(self) -> bool:
        return self.runner.controller.state is not State.READY

    def weight_version(self) -> str | None:
        com = self.runner.controller.snapshot()["committed"]
        return None if com is None else com.get("label")

    @property
    def client(self) -> UpstreamPool:
        """The relay's own keep-alive connections to the engine (the data plane's lean
        client, not its pool: no request can queue a round's call behind it), made in
        the loop it serves on first use. Every call bounds itself (``exchange``); the
        silence allowed while an answer is awaited is the longest call's (an update's
        answer comes once its broadcast is over, up to ``lease_s``)."""
        cfg = self.config
        if self._pool is None:
            longest = max(cfg.lease_s, cfg.upstream_read_s)
            self._pool = UpstreamPool(cfg.upstream_url, max_connections=4,
                                      connect_s=cfg.upstream_connect_s, pool_s=longest,
                                      read_s=longest, keepalive_s=cfg.upstream_keepalive_s)
        return self._pool

    async def relay(self, method: str, route: str, query: Mapping[str, str],
                    body: Any) -> tuple[int, Any]:
        status, answer = await relay_call(self.client, self.config.upstream_url, method,
                                          route, query, body, self.config.upstream_read_s)
        return (409 if status >= 500 else status), answer

    async def init(self, body: dict[str, Any]) -> tuple[int, Any]:
        status, answer = await relay_call(self.client, self.config.upstream_url, "POST",
                                          Routes.INIT_TRANSFER, {}, body, self.config.lease_s)
        return (409 if status >= 500 else status), answer

    # ------------------------------------------------------------ the round
    async def open(self, seq: int) -> tuple[UpdateOutcome, str]:
        c = self.runner.controller
        if c.failed_closed is not None:
            raise NativeRefusal(409, f"the controller failed closed ({c.failed_closed})")
        ident = native_identity(seq, c.snapshot()["committed"])
        pre = PreflightEvidence(source_manifest_digest=ident.manifest_digest,
                                source_provenance=ident.provenance)
        adapter = self.runner.adapter

        def open_() -> UpdateOutcome:
            if isinstance(adapter, ExpectationTaker):
                adapter.expect(probes=None, reference_checksums=None)
                adapter.expect_sent(None)
            return self.runner.open_update(ident, owner="native", preflight=pre,
                                           min_verification=VerificationLevel.DECLARED)

        try:
            out = await anyio.to_thread.run_sync(open_)
        except (UpdateRefused, BadInput) as exc:
            raise NativeRefusal(409, str(exc)) from exc
        except UpdateFailed as exc:
            raise NativeRefusal(409, f"the round could not open: {exc}") from exc
        return out, out.ticket.target.version.label

    async def send(self, handle: UpdateOutcome, route: str,
                   body: dict[str, Any] | bytes | None) -> Failed | None:
        return await forward_step(self.client, self.config.upstream_url, route, body,
                                  self.config.lease_s)

    async def close(self, handle: UpdateOutcome, written: Manifest, note: dict[str, Any]
                    ) -> dict[str, Any]:
        out = handle
        label = out.ticket.target.version.label
        ev = TransferEvidence(completed=bool(written), mutation_started=True,
                              backend="native", tensors=len(written), finish_label=label,
                              error=None if written else "no tensor was written")
        rec = Note("native_round", {**note, "label": label,
                                    "update_id": out.ticket.update_id})

        def work() -> None:
            record_round(self.runner, written, rec)
            self.runner.report_transfer(out, ev)
            self.runner.close_update(out)

        try:
            await anyio.to_thread.run_sync(work)
        except UpdateFailed as exc:
            return failed_result(exc)
        return {"status": "published", "label": label, "verification": NATIVE_LEVEL,
                "tensors": len(written)}

    async def fail(self, handle: UpdateOutcome, kind: FailureKind, reason: str
                   ) -> dict[str, Any]:
        def work() -> None:
            self.runner.report_transfer_failure(handle, kind, reason)

        try:
            await anyio.to_thread.run_sync(work)
        except UpdateFailed as exc:
            return failed_result(exc)
        return {"status": "failed", "classification": None, "reason": reason}

    async def expire(self, handle: UpdateOutcome, reason: str, writes: int
                     ) -> dict[str, Any]:
        def work() -> None:
            self.runner.expire_lease(handle, reason)

        with anyio.CancelScope(shield=True):
            try:
                await anyio.to_thread.run_sync(work)
            except UpdateFailed as exc:
                return {**failed_result(exc), "status": "expired"}
        return {"status": "expired", "classification": None, "reason": reason}

    async def aclose(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.aclose()
