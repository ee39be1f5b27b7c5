"""Engine checksums against references, with the effects: reading engines, launching
a cold one, keeping references on disk.

``verification.checksums`` holds what is decided (the comparison, the
reference document, the layout digest) and does no I/O; this module does
the I/O around it:

* ``engine_layout`` and ``take_reference`` read an engine through
  ``VllmHTTP`` (``/server_info``, ``/weight_checker``);
* ``reference_checksums`` starts a cold engine on a checkpoint (vLLM's own
  loader), takes its checksums and stops it, so that a reference is taken
  **the same way** as the engine to verify holds its weights;
* ``ChecksumCache`` keeps references on disk, keyed by the checkpoint's
  content digest and the layout, so that a reference costs one cold start
  per checkpoint and layout, ever;
* ``verify_engine`` compares a live engine with a reference, layouts included.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput, EffectError, JournalError
from rolloutcore.verification.checksums import (
    HEX64,
    LAYOUT_FIELDS,
    ChecksumReport,
    ReferenceChecksums,
    check_layout,
    layout_diff,
    layout_digest,
    raw_checksums,
    verify,
)

__all__ = [
    "ChecksumCache",
    "engine_layout",
    "reference_checksums",
    "take_reference",
    "verify_engine",
]


def engine_layout(http: VllmHTTP, *, timeout_s: float | None = None) -> dict[str, Any]:
    """The layout of the engine behind ``http``: ``LAYOUT_FIELDS`` + ``vllm_version``.

    A field the engine does not report is recorded as ``None``: two engines
    that both lack it still compare equal on it, which is the best that can
    be said.
    """
    if not isinstance(http, VllmHTTP):
        raise BadInput("http must be a VllmHTTP")
    info = http.server_info(timeout_s=timeout_s)
    cfg = info.get("vllm_config")
    if not isinstance(cfg, Mapping):
        raise EffectError("server_info", "no vllm_config in /server_info: engine layout "
                          "unknown", mutation_started=False)
    out: dict[str, Any] = {"vllm_version": http.version(timeout_s=timeout_s)}
    for key, (section, name) in LAYOUT_FIELDS.items():
        sec = cfg.get(section)
        v = sec.get(name) if isinstance(sec, Mapping) else None
        out[key] = v if v is None or isinstance(v, (str, int, float, bool)) else str(v)
    return out


def take_reference(http: VllmHTTP, content_digest: str, *, origin: str = "cold-load",
                   source: str = "", timeout_s: float | None = None) -> ReferenceChecksums:
    """Read the checksums and layout of the engine behind ``http`` now, as a reference.

    The caller vouches that the engine holds the checkpoint whose content
    digest is ``content_digest`` (``origin`` says why: ``cold-load``, or
    ``verified-load`` for an update verified otherwise, e.g. by the probe).
    """
    if not isinstance(http, VllmHTTP):
        raise BadInput("http must be a VllmHTTP")
    cs = http.weight_checksums(timeout_s=timeout_s)
    return ReferenceChecksums(content_digest, engine_layout(http, timeout_s=timeout_s),
                              raw_checksums(cs), origin, source or http.base_url)


class ChecksumCache:
    """References on disk: ``<root>/<content digest>/<layout digest>.json``.

    Files are written atomically (temp file, fsync, rename); a file that
    does not parse, or whose content does not match its name, raises
    ``JournalError`` instead of being treated as a miss, because a silently
    replaced reference would make any engine "verified".
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        if not isinstance(root, (str, os.PathLike)) or not os.fspath(root):
            raise BadInput(f"cache root must be a path, got {root!r}")
        self.root = Path(root)
        if self.root.exists() and not self.root.is_dir():
            raise BadInput(f"checksum cache {str(self.root)!r} is not a directory")

    def path_for(self, content_digest: str, layout: Mapping[str, Any]) -> Path:
        if not isinstance(content_digest, str) or not HEX64.fullmatch(content_digest):
            raise BadInput("content_digest must be a sha256 hex digest")
        return self.root / content_digest / f"{layout_digest(layout)}.json"

    def get(self, content_digest: str, layout: Mapping[str, Any]) -> ReferenceChecksums | None:
        p = self.path_for(content_digest, layout)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise JournalError(f"cannot read checksum reference {str(p)!r}: {exc}") from exc
        try:
            ref = ReferenceChecksums.from_dict(json.loads(raw))
        except (ValueError, UnicodeDecodeError) as exc:  # BadInput is a ValueError
            raise JournalError(f"checksum reference {str(p)!r} is unreadable: {exc}") from exc
        if ref.content_digest != content_digest or ref.layout_digest != layout_digest(layout):
            raise JournalError(f"checksum reference {str(p)!r} does not hold the reference "
                               "its name says (content or layout digest differs)")
        return ref

    def put(self, ref: ReferenceChecksums) -> Path:
        if not isinstance(ref, ReferenceChecksums):
            raise BadInput("put takes a ReferenceChecksums")
        p = self.path_for(ref.content_digest, ref.layout)
        data = json.dumps(ref.to_dict(), sort_keys=True, indent=1).encode() + b"\n"
        tmp: str | None = None
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
            try:
                os.write(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, p)
            tmp = None
        except OSError as exc:
            raise JournalError(f"cannot write checksum reference {str(p)!r}: {exc}") from exc
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        return p


class _Engine(Protocol):
    """What ``reference_checksums`` needs of a started engine (``ManagedEngine`` has it)."""

    @property
    def base_url(self) -> str: ...

    def stop(self) -> None: ...


def _default_launch(model_dir: Path, layout: Mapping[str, Any] | None) -> _Engine:
    from rolloutcore.engine.process import ManagedEngine

    kw: dict[str, Any] = {"backend": None}
    dtype = None if layout is None else layout.get("dtype")
    if isinstance(dtype, str):
        kw["dtype"] = dtype.removeprefix("torch.")
    return ManagedEngine(model_dir, **kw).start()


def reference_checksums(model_dir: str | os.PathLike[str], *,
                        cache: ChecksumCache | str | os.PathLike[str] | None = None,
                        layout: Mapping[str, Any] | None = None,
                        launch: Callable[[Path], _Engine] | None = None,
                        timeout_s: float = 60.0) -> ReferenceChecksums:
    """The reference checksums of the checkpoint in ``model_dir``, cold-loaded by vLLM.

    ``layout`` is the layout of the engine the reference is for (normally
    ``engine_layout(http)`` of the engine to verify). With a ``cache`` and a
    ``layout``, a cached reference for (content digest, layout) is returned
    without starting anything. Otherwise ``launch(model_dir)`` (default: a
    ``ManagedEngine`` with no transfer backend, in the layout's dtype) starts
    a cold engine, its checksums are read, it is stopped, and the reference
    is cached. ``BadInput`` when the cold engine's layout is not ``layout``
    (the reference is cached under its own layout all the same), or when the
    checkpoint changed while the engine loaded it (nothing cached).
    """
    from rolloutcore.transports.source import WeightSource

    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise BadInput(f"{d} is not a model directory (no config.json)")
    if layout is not None:
        layout = check_layout(layout)
    store = cache if isinstance(cache, ChecksumCache) or cache is None else ChecksumCache(cache)
    digest = WeightSource.from_checkpoint(d).content_digest()
    if store is not None and layout is not None:
        hit = store.get(digest, layout)
        if hit is not None:
            return hit
    eng = launch(d) if launch is not None else _default_launch(d, layout)
    try:
        with VllmHTTP(eng.base_url, timeout_s=timeout_s) as http:
            ref = take_reference(http, digest, origin="cold-load", source=str(d))
    finally:
        eng.stop()
    if WeightSource.from_checkpoint(d).content_digest() != digest:
        raise BadInput(f"checkpoint {d} changed while the reference engine loaded it; "
                       "nothing cached")
    if store is not None:
        store.put(ref)
    if layout is not None and ref.layout_digest != layout_digest(layout):
        raise BadInput("the cold-loaded engine's layout differs from the requested one ("
                       + "; ".join(layout_diff(ref.layout, layout))
                       + "): start it like the engine to verify (pass launch=...)")
    return ref


def verify_engine(http: VllmHTTP, reference: ReferenceChecksums, *,
                  timeout_s: float | None = None) -> ChecksumReport:
    """``verify`` of the engine behind ``http`` now, with the layouts compared as well."""
    if not isinstance(reference, ReferenceChecksums):
        raise BadInput("reference must be a ReferenceChecksums")
    report = verify(http.weight_checksums(timeout_s=timeout_s),
                    reference)
    diff = layout_diff(reference.layout, engine_layout(http, timeout_s=timeout_s))
    return dataclasses.replace(report, layout_mismatch=tuple(diff)) if diff else report
