"""vLLM's LoRA routes on the gateway: an unmodified client's loads become adapter versions.

Under the native routes' base URL (``/rc/<token>``, ``service.native``: the
token is the secret, a wrong one is answered 404) a gateway started with
``serve --lora`` answers vLLM's runtime LoRA routes with vLLM's own shapes:

``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"?}``
    publishes the directory as an adapter version through the engine's
    ``control.adapters.AdapterManager.update`` (checked, digested, loaded
    under its own never-reused name, listed, probed through it and the base
    beside it, journaled) and makes ``lora_name`` its name: requests for
    ``lora_name`` (or the gateway's public model) are bound to it and their
    answers labelled with it (``service.admission.AdapterEngine``). A name
    loaded before needs ``load_inplace`` (vLLM's rule): the new version
    supersedes it, and requests bound to the old one finish on it. 200 with
    vLLM's plain text, and ``x-rolloutcore-adapter`` naming the version.
``POST /v1/unload_lora_adapter`` ``{"lora_name"}``
    withdraws every version loaded under the name (``AdapterManager.withdraw``):
    no new request gets one; each is unloaded from the engine once the
    requests bound to it end. 200 with vLLM's plain text.

One adapter version serves at a time (RolloutCore's guarantee: every answer
from the version the gateway bound it to). A load under another name
supersedes the current one; a request for the superseded name is refused
(400), never answered by another version; its unload retires it.

Errors in vLLM's shape (``{"error": {"message", "type", "param", "code"}}``),
never a 5xx, and nothing changed on any of them: 400 for a bad body or a
name vLLM would refuse, 404 for an unknown name or a missing directory, 409
while a weight round or another update is open and when verification
refused the adapter (the previous one keeps serving), 504 when the engine
did not answer in time.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio

from rolloutcore.core.adapters import NAME_PREFIX, AdapterState
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import (
    BadInput,
    EffectTimeout,
    RolloutCoreError,
    UpdateFailed,
    UpdateRefused,
)
from rolloutcore.service.admission import AdapterEngine
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.native import NativeRefusal
from rolloutcore.service.wire import Receive, Scope, Send, body_or_answer, send_json

__all__ = ["LORA_ROUTES", "NativeLora", "refuse_lora"]

#: vLLM's runtime LoRA routes, as the gateway answers them under ``/rc/<token>``.
LORA_ROUTES = frozenset({Routes.LOAD_LORA, Routes.UNLOAD_LORA})
_MAX_NAME = 256
_GOING = frozenset({AdapterState.UNLOADING, AdapterState.RETIRED, AdapterState.FENCED})
_MAX_PATH = 4096


class _Refusal(NativeRefusal):
    """A LoRA route's 4xx or 504: vLLM's error, with the body field it names."""

    def __init__(self, status: int, message: str, kind: str, param: str | None = None
                 ) -> None:
        super().__init__(status, message, kind)
        self.param = param


def _error(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse``, as its ``model_dump()`` writes it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


async def refuse_lora(send: Send, why: str) -> None:
    """The answer of a gateway that does not serve these routes (no ``--lora``, a fleet):
    404, as vLLM without runtime LoRA updating, with the reason."""
    await send_json(send, 404, _error(404, why, "NotFoundError"))


class NativeLora:
    """ASGI app of ``LORA_ROUTES`` (the path already stripped of ``/rc/<token>``).

    ``admission``: the gateway's ``AdapterEngine`` (its adapters, its client names);
    ``round_open``: why no adapter may change now (a native weight round is open),
    or None."""

    def __init__(self, admission: AdapterEngine, config: ServiceConfig,
                 round_open: Callable[[], str | None]) -> None:
        if not isinstance(admission, AdapterEngine):
            raise BadInput("admission must be the gateway's AdapterEngine")
        self.admission = admission
        self.adapters = admission.adapters
        self.names = admission.names
        self.config = config
        self.round_open = round_open
        self.loads = 0
        #: The path each name was last loaded from (its ``/v1/models`` card's root).
        self.paths: dict[str, str] = {}
        self._lock = asyncio.Lock()

    async def __call__(self, route: str, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["method"] != "POST":
            await send_json(send, 405, _error(405, "Method Not Allowed", "Method Not Allowed"),
                            [(b"allow", b"POST")])
            return
        hdrs = dict(scope.get("headers") or [])
        raw = await body_or_answer(receive, send, self.config.max_body_bytes,
                                   hdrs.get(b"content-length"))
        if isinstance(raw, int):
            return
        try:
            ctype = hdrs.get(b"content-type", b"").decode("latin-1").split(";")[0]
            if ctype.strip().lower() != "application/json":
                raise _Refusal(400, "1 validation error:\n  Unsupported Media Type: Only "
                               "'application/json' is allowed", "Bad Request")
            body = _object(raw)
            if route == Routes.LOAD_LORA:
                text, headers = await self.load(body)
            else:
                text, headers = await self.unload(body)
        except _Refusal as r:
            await send_json(send, r.status, _error(r.status, r.message, r.kind, r.param))
            return
        data = text.encode()
        # vLLM answers ``Response(content=text)``: the text, no media type.
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(data)).encode()), *headers]})
        await send({"type": "http.response.body", "body": data, "more_body": False})

    async def models(self, relay: Callable[[str, str, Mapping[str, str], Any],
                                           Awaitable[tuple[int, Any]]], send: Send) -> None:
        """``GET /v1/models`` under the native base URL: vLLM's listing, and the card of the
        name a client loaded (vLLM lists its adapters by the names they were loaded as;
        a client may look for its own)."""
        try:
            status, body = await relay("GET", Routes.MODELS, {}, None)
        except NativeRefusal as r:
            status, body = r.status, _error(r.status, r.message, r.kind)
        name = self.names.current
        data = body.get("data") if status == 200 and isinstance(body, dict) else None
        if name is not None and isinstance(data, list):
            base = next((m for m in data if isinstance(m, dict) and m.get("parent") is None
                         and "id" in m), None)
            if base is not None:
                body = {**body, "data": [*data, {**base, "id": name,
                                                 "root": self.paths.get(name),
                                                 "parent": base["id"]}]}
        await send_json(send, status, body)

    # ------------------------------------------------------------ routes
    async def load(self, body: dict[str, Any]) -> tuple[str, list[tuple[bytes, bytes]]]:
        name = _text(body, "lora_name", _MAX_NAME)
        path = _text(body, "lora_path", _MAX_PATH)
        inplace = _flag(body, "load_inplace")
        if _flag(body, "is_3d_lora_weight"):
            raise _Refusal(400, "is_3d_lora_weight adapters are not served by this gateway "
                           "(its references are PEFT's 2-D LoRA weights)", "InvalidUserInput",
                           "body.is_3d_lora_weight")
        if not name or not path:
            raise _Refusal(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           "InvalidUserInput")
        adm = self.admission
        if name in (adm.public_model, self.config.model) or name.startswith(
                NAME_PREFIX + "-") or self.adapters.is_adapter(name):
            raise _Refusal(400, f"The lora adapter '{name}' conflicts with a served base "
                           f"model." if name in (adm.public_model, self.config.model) else
                           f"The lora adapter '{name}' conflicts with the gateway's adapter "
                           f"version names ({NAME_PREFIX}-<generation>-<digest>).",
                           "InvalidUserInput")
        async with self._lock:
            if not inplace and name in self.names.loaded:
                raise _Refusal(400, f"The lora adapter '{name}' has already been loaded. If "
                               "you want to load the adapter in place, set 'load_inplace' "
                               "to True.", "InvalidUserInput")
            self._no_round()
            if not Path(path).exists():
                raise _Refusal(404, f"Loading lora {name} failed: No adapter found for "
                               f"{path}", "NotFoundError")
            prov = Provenance(path, f"vllm-lora:{name}", self.loads + 1)
            try:
                res = await anyio.to_thread.run_sync(
                    lambda: self.adapters.update(Path(path), prov))
            except BaseException as exc:
                raise _refusal_of(exc, f"adapter {name!r} not loaded") from exc
            self.loads += 1
            v = res.version
            self.names.loaded.setdefault(name, []).append(v.name)
            self.names.current = name
            self.paths[name] = path
        return (f"Success: LoRA adapter '{name}' added successfully.",
                [(b"x-rolloutcore-adapter", v.name.encode()),
                 (b"x-rolloutcore-adapter-digest", v.content_digest.encode())])

    async def unload(self, body: dict[str, Any]) -> tuple[str, list[tuple[bytes, bytes]]]:
        name = _text(body, "lora_name", _MAX_NAME)
        lid = body.get("lora_int_id")
        if lid is not None and (isinstance(lid, bool) or not isinstance(lid, int)):
            raise _Refusal(400, "1 validation error:\n  body.lora_int_id: Input should be a "
                           "valid integer", "Bad Request", "body.lora_int_id")
        if not name:
            raise _Refusal(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           "InvalidUserInput")
        async with self._lock:
            versions = self.names.loaded.get(name)
            if versions is None:
                raise _Refusal(404, f"The lora adapter '{name}' cannot be found.",
                               "NotFoundError")
            self._no_round()
            # Every version loaded under the name (an in-place load superseded the
            # others): each retires once the requests bound to it end. One already
            # retired by the existing rule (max_staleness) only loses the name.
            states = self.adapters.view.states
            live = [v for v in versions
                    if states.get(v) in (AdapterState.PUBLISHED, AdapterState.STANDBY)]
            why = f"unloaded by the client (vLLM /v1/unload_lora_adapter {name!r})"
            try:
                await anyio.to_thread.run_sync(lambda: self._withdraw(live, why))
            except BaseException as exc:
                raise _refusal_of(exc, f"adapter {name!r} not unloaded") from exc
            del self.names.loaded[name]
            self.paths.pop(name, None)
            if self.names.current == name:
                self.names.current = None
        return f"Success: LoRA adapter '{name}' removed successfully.", [
            (b"x-rolloutcore-adapter", versions[-1].encode())]

    def _withdraw(self, versions: list[str], why: str) -> None:
        for v in versions:
            try:
                self.adapters.withdraw(v, why)
            except UpdateRefused:
                # retired by the sweep meanwhile (superseded, nothing bound): gone already
                if self.adapters.view.states.get(v) not in _GOING:
                    raise

    def _no_round(self) -> None:
        why = self.round_open()
        if why is not None:
            raise _Refusal(409, f"{why}: adapters change between weight rounds; nothing "
                           "was changed", "Conflict")


def _refusal_of(exc: BaseException, what: str) -> _Refusal:
    """An update's exception as the route's answer (never a 5xx)."""
    if isinstance(exc, BadInput):
        return _Refusal(400, f"{what}: {exc}", "InvalidUserInput")
    if isinstance(exc, UpdateRefused):
        return _Refusal(409, f"{what}: {exc}", "Conflict")
    if isinstance(exc, UpdateFailed):
        return _Refusal(409, f"{what}: {exc} ({exc.classification}); the previous adapter "
                        f"keeps serving", "Conflict")
    if isinstance(exc, EffectTimeout):
        return _Refusal(504, f"{what}: the engine did not answer in time: {exc}",
                        "GatewayTimeout")
    if isinstance(exc, RolloutCoreError):
        return _Refusal(409, f"{what}: {exc}", "Conflict")
    if isinstance(exc, Exception):
        return _Refusal(409, f"{what}: {type(exc).__name__}: {exc}", "Conflict")
    raise exc   # cancellation and the like are not answers


def _object(raw: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise _Refusal(400, f"1 validation error:\n  body: JSON decode error: {exc}",
                       "Bad Request", "body") from exc
    if not isinstance(obj, dict):
        raise _Refusal(400, "1 validation error:\n  body: Input should be a valid "
                       "dictionary or object", "Bad Request", "body")
    return obj


def _text(body: dict[str, Any], key: str, limit: int) -> str:
    v = body.get(key)
    if not isinstance(v, str):
        raise _Refusal(400, f"1 validation error:\n  body.{key}: "
                       f"{'Field required' if v is None else 'Input should be a valid string'}",
                       "Bad Request", f"body.{key}")
    if len(v) > limit or any(ord(c) < 32 for c in v):
        raise _Refusal(400, f"{key}: at most {limit} printable characters", "InvalidUserInput",
                       f"body.{key}")
    return v


def _flag(body: dict[str, Any], key: str) -> bool:
    v = body.get(key, False)
    if not isinstance(v, bool):
        raise _Refusal(400, f"1 validation error:\n  body.{key}: Input should be a valid "
                       "boolean", "Bad Request", f"body.{key}")
    return v
