"""LoRA-adapter files uploaded into an engine's own store (both halves; issue 32).

vLLM's ``/v1/load_lora_adapter`` reads a *path on the engine's filesystem*.
An engine on another node (a Ray actor elsewhere, a Kubernetes pod) cannot
read the trainer's directory, and vLLM has no route that takes the files. So
a RolloutCore-launched engine can carry a store (``ManagedEngine(
adapter_store=True)``): ``AdapterStore``, an ASGI middleware vLLM adds to its
API server (``--middleware``, as ``engine_key.RouteGuard``), answers three
routes under ``PREFIX`` and passes everything else through:

* ``PUT /rolloutcore/adapters/{name}/{file}``: one of the adapter's two files
  (``adapter_config.json``, ``adapter_model.safetensors``), streamed into a
  staging directory of the store;
* ``POST /rolloutcore/adapters/{name}/seal`` with ``{"content_digest": D}``:
  the store digests what it received exactly as the trainer digested what it
  sent (``verification.adapters.AdapterSource``); only a match becomes
  ``{store}/{name}``, whose path is the answer (``{"path": ...}``), and which
  the load then names. A mismatch is a 422 and the staging is removed: the
  engine never loads bytes other than those the trainer digested;
* ``DELETE /rolloutcore/adapters/{name}``: the directory removed (after the
  adapter was unloaded).

Every route needs the engine's route key (``engine_key.HEADER``); an engine
without one answers 403 to all three (uploads are off, not open). A name is
an adapter name (``[A-Za-z0-9][A-Za-z0-9._-]{0,127}``), a file one of the
two: nothing outside the store is ever written. A file over
``max_bytes`` (``ENV_MAX``, default 4 GiB) is 413 (by its declared length
before a byte is read, or as it arrives); a disk that fills is 507; a client
that disconnects mid-file leaves nothing behind. Files are written off the
API server's event loop (its requests keep being served).

The store is one directory per API server process (``ENV_DIR``, else a new
temporary one): an engine run with ``--api-server-count`` above 1 needs
``ENV_DIR`` set, so that a file and its seal meet whichever process answers.
Names are never reused (``core.adapters.adapter_name``); a name uploaded but
never sealed stays staged until its ``DELETE``.

The trainer half: ``upload_adapter(base_url, name, directory, digest)`` and
``delete_adapter`` (``control.adapters.AdapterManager(upload=True)`` calls
them before each load and after each unload).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import json
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import IO, Any

from rolloutcore.core.strict import HEX64
from rolloutcore.errors import BadInput, EffectError, RolloutCoreError
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import Receive, Scope, Send

__all__ = ["ENV_DIR", "ENV_MAX", "FILES", "MIDDLEWARE", "PREFIX", "AdapterStore",
           "delete_adapter", "upload_adapter"]

PREFIX = "/rolloutcore/adapters/"
MIDDLEWARE = "rolloutcore.transports.adapter_store.AdapterStore"
#: The store's directory on the engine's host (default: a new temporary directory).
ENV_DIR = "ROLLOUTCORE_ADAPTER_STORE"
#: The largest file the store takes, in bytes.
ENV_MAX = "ROLLOUTCORE_ADAPTER_MAX_BYTES"
DEFAULT_MAX_BYTES = 4 << 30
#: The files of a PEFT LoRA adapter directory (``verification.adapters``).
FILES = ("adapter_config.json", "adapter_model.safetensors")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})


class _Answer(RolloutCoreError):
    """The store's refusal of one request: answered with ``status``, never raised out."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AdapterStore:
    """ASGI middleware for vLLM's API server: the adapter store's routes (module doc)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        raw = os.environ.get(engine_key.ENV)
        self._key = engine_key.check_key(raw).encode() if raw else None
        root = os.environ.get(ENV_DIR)
        self.root = Path(root) if root else Path(tempfile.mkdtemp(prefix="rc-adapter-store-"))
        self.root.mkdir(parents=True, exist_ok=True)
        mx = os.environ.get(ENV_MAX)
        try:
            self.max_bytes = int(mx) if mx else DEFAULT_MAX_BYTES
        except ValueError:
            raise BadInput(f"AdapterStore: {ENV_MAX} must be an int, got {mx!r}") from None
        if self.max_bytes < 1:
            raise BadInput(f"AdapterStore: {ENV_MAX} must be >= 1")
        self._staging = self.root / ".staging"
        self._staging.mkdir(exist_ok=True)
        self._seal_locks: dict[str, asyncio.Lock] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope.get("type") != "http" or not path.startswith(PREFIX):
            await self.app(scope, receive, send)
            return
        try:
            status, body = await self._route(scope, path[len(PREFIX):].split("/"), receive)
        except _Answer as exc:
            status, body = exc.status, {"error": {"message": str(exc), "code": exc.status}}
        if status == 0:
            return   # the client left: nobody to answer
        await engine_key.send_json(send, status, body)

    def _allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope.get("headers") or ()
                      if k.lower() == engine_key.HEADER.lower().encode()), None)
        return self._key is not None and given is not None and \
            hmac.compare_digest(given, self._key)

    async def _route(self, scope: Scope, parts: list[str],
                     receive: Receive) -> tuple[int, Any]:
        if not self._allowed(scope):
            raise _Answer(403, "the adapter store needs the engine's route key"
                          + ("" if self._key else " (this engine has none: uploads are off)"))
        method = str(scope.get("method", ""))
        name = parts[0] if parts else ""
        if not _NAME.fullmatch(name):
            raise _Answer(400, f"not an adapter name: {name[:140]!r}")
        if method == "PUT" and len(parts) == 2:
            if parts[1] not in FILES:
                raise _Answer(400, f"an adapter's files are {list(FILES)}, not {parts[1][:80]!r}")
            return await self._put(scope, name, parts[1], receive)
        if method == "POST" and parts[1:] == ["seal"]:
            return await self._seal(name, await self._small_body(receive))
        if method == "DELETE" and len(parts) == 1:
            d = self.root / name
            gone = d.is_dir()
            for where in (d, self._stage(name)):
                await asyncio.to_thread(shutil.rmtree, where, True)
            return 200, {"deleted": gone}
        raise _Answer(405 if len(parts) <= 2 else 404,
                      f"{method} {PREFIX}{'/'.join(parts)[:200]}: no such route")

    def _stage(self, name: str) -> Path:
        return self._staging / name

    async def _put(self, scope: Scope, name: str, file: str,
                   receive: Receive) -> tuple[int, Any]:
        declared = next((v for k, v in scope.get("headers") or ()
                         if k.lower() == b"content-length"), None)
        if declared is not None and (not declared.isdigit() or
                                     int(declared) > self.max_bytes):
            raise _Answer(413, f"{file}: {declared.decode(errors='replace')[:20]} bytes, over "
                          f"the store's {self.max_bytes}")
        stage = self._stage(name)
        tmp = stage / f".{file}.{uuid.uuid4().hex}"
        n = 0
        done = False
        try:
            stage.mkdir(exist_ok=True)
            f = await asyncio.to_thread(open, tmp, "wb")
        except OSError as exc:
            raise _Answer(507, f"{file}: the store cannot stage it ({exc})") from exc
        try:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    return 0, None
                chunk = msg.get("body", b"")
                n += len(chunk)
                if n > self.max_bytes:
                    raise _Answer(413, f"{file}: over the store's {self.max_bytes} bytes")
                if chunk:
                    await asyncio.to_thread(f.write, chunk)
                if not msg.get("more_body", False):
                    break
            await asyncio.to_thread(f.close)
            try:
                await asyncio.to_thread(os.replace, tmp, stage / file)
            except FileNotFoundError:
                # A seal took the staging directory (and the files in it) while this
                # file arrived: it is not part of what was sealed.
                raise _Answer(409, f"{name}: sealed while {file} was uploading; it was "
                              "not sealed in: upload the adapter under a new name") from None
            done = True
        except OSError as exc:
            if exc.errno in _FULL:
                raise _Answer(507, f"{file}: the store's disk is full ({exc})") from exc
            raise _Answer(507, f"{file}: the store cannot write it ({exc})") from exc
        finally:
            if not done:
                f.close()
                tmp.unlink(missing_ok=True)
        return 200, {"name": name, "file": file, "bytes": n}

    async def _small_body(self, receive: Receive) -> bytes:
        buf = b""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise _Answer(400, "the client left")
            buf += bytes(msg.get("body", b""))
            if len(buf) > 4096:
                raise _Answer(413, "the seal's body is at most 4096 bytes")
            if not msg.get("more_body", False):
                return buf

    async def _seal(self, name: str, raw: bytes) -> tuple[int, Any]:
        try:
            want = json.loads(raw).get("content_digest")
        except (ValueError, AttributeError):
            want = None
        if not isinstance(want, str) or not HEX64.fullmatch(want):
            raise _Answer(400, 'the seal\'s body is {"content_digest": <sha256 hex>}')
        # One seal of a name at a time in this process; across processes the rename
        # below decides (only one takes the staging directory).
        # (A lock per name ever sealed: one per adapter version, a few bytes each.)
        async with self._seal_locks.setdefault(name, asyncio.Lock()):
            return await self._seal_locked(name, want)

    async def _seal_locked(self, name: str, want: str) -> tuple[int, Any]:
        stage, final = self._stage(name), self.root / name
        if final.is_dir():
            await asyncio.to_thread(shutil.rmtree, stage, True)   # a retry's files
            return self._sealed(name, final, want, await asyncio.to_thread(_digest, final))
        if not all((stage / f).is_file() for f in FILES):
            raise _Answer(409, f"{name}: upload {list(FILES)} before the seal")
        # The files are taken out of the staging directory first: what is digested is
        # what is sealed, and an upload that lands meanwhile goes to a new staging
        # directory (or is refused, 409), never into the sealed one.
        sealing = self._staging / f".sealing-{name}-{uuid.uuid4().hex}"
        try:
            await asyncio.to_thread(os.rename, stage, sealing)
        except FileNotFoundError:
            raise _Answer(409, f"{name}: another seal took its files; seal again to see "
                          "what it sealed") from None
        except OSError as exc:
            raise _Answer(507, f"{name}: the store cannot seal it ({exc})") from exc
        try:
            try:
                got = await asyncio.to_thread(_digest, sealing)
            except (BadInput, OSError, ValueError) as exc:
                raise _Answer(422, f"{name}: not a LoRA adapter: {exc}") from exc
            if got != want:
                raise _Answer(422, f"{name}: the files received digest to {got[:16]}, not "
                              f"{want[:16]}: removed, nothing sealed")
            for leftover in sealing.glob(".*"):
                leftover.unlink(missing_ok=True)
            try:
                await asyncio.to_thread(os.rename, sealing, final)
            except OSError as exc:
                if final.is_dir():  # another process sealed it meanwhile
                    return self._sealed(name, final, want,
                                        await asyncio.to_thread(_digest, final))
                raise _Answer(507, f"{name}: the store cannot seal it ({exc})") from exc
            return 200, {"path": str(final.resolve()), "content_digest": got}
        finally:
            await asyncio.to_thread(shutil.rmtree, sealing, True)  # gone once renamed

    @staticmethod
    def _sealed(name: str, final: Path, want: str, got: str) -> tuple[int, Any]:
        """The answer for a name sealed already: the same content is a success."""
        if got == want:
            return 200, {"path": str(final.resolve()), "content_digest": got}
        raise _Answer(409, f"{name} is sealed with other content ({got[:16]})")


def _digest(d: Path) -> str:
    from rolloutcore.verification.adapters import AdapterSource

    return AdapterSource.of(d).content_digest


# ------------------------------------------------------------------ trainer half

def _call(method: str, url: str, step: str, timeout_s: float, *,
          content: IO[bytes] | None = None, json: Mapping[str, str] | None = None) -> Any:
    from rolloutcore.engine.errors import request

    return request(method, url, step=step, timeout_s=timeout_s, json_body=json,
                   content=content, what=f"{method} {PREFIX}...").json()


def upload_adapter(base_url: str, name: str, directory: str | os.PathLike[str],
                   content_digest: str, *, timeout_s: float = 120.0) -> str:
    """Upload the adapter in ``directory`` to the engine's store as ``name``; return the
    path the engine holds it under (sealed only if it digests to ``content_digest``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadInput(f"not an adapter name: {name!r}")
    if not isinstance(content_digest, str) or not HEX64.fullmatch(content_digest):
        raise BadInput("content_digest must be a sha256 hex digest")
    d = Path(directory)
    missing = [f for f in FILES if not (d / f).is_file()]
    if missing:
        raise BadInput(f"{d} lacks {missing}")
    base = base_url.rstrip("/") + PREFIX + name
    for f in FILES:
        with open(d / f, "rb") as fh:
            _call("PUT", f"{base}/{f}", "upload_adapter", timeout_s, content=fh)
    got = _call("POST", f"{base}/seal", "upload_adapter", timeout_s,
                json={"content_digest": content_digest})
    path = got.get("path") if isinstance(got, dict) else None
    if not isinstance(path, str) or got.get("content_digest") != content_digest:
        raise EffectError("upload_adapter", f"unexpected seal answer: {str(got)[:300]}")
    return path


def delete_adapter(base_url: str, name: str, *, timeout_s: float = 30.0) -> bool:
    """Remove ``name`` from the engine's store; whether it was there."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise BadInput(f"not an adapter name: {name!r}")
    got = _call("DELETE", base_url.rstrip("/") + PREFIX + name, "delete_adapter", timeout_s)
    return bool(isinstance(got, dict) and got.get("deleted"))
