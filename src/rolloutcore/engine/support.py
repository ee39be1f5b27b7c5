"""Which vLLM RolloutCore supports, decided from the engine's own answers.

A verified hot update needs routes that only some vLLM builds serve (the RL
endpoints exist from 0.26 on, and only with ``VLLM_SERVER_DEV_MODE=1``).
Without them an update would fail half-way, on the first ``/pause``; with a
vLLM outside the tested range the routes may exist but mean something
else. So both are checked once, at start-up, before anything is admitted,
and the answer says exactly what is wrong and how to fix it.

``assess`` is pure: the caller fetches ``/version`` and ``/openapi.json``
(``ManagedEngine.start``, ``rolloutcore serve``) and hands the parsed
bodies over, so the decision is unit-tested without an engine and the
module imports no HTTP client. The route names come from the route table
(``engine.routes``), which imports no HTTP client either.

Optional capabilities are reported, never required: what the engine lacks
is later stated as unverified evidence (``VllmAdapter``), not assumed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutcore.engine.routes import Routes, required_routes
from rolloutcore.errors import EngineUnavailable

__all__ = [
    "MAX_MINOR",
    "MIN_MINOR",
    "OPTIONAL_CAPABILITIES",
    "PREVIEW_ENV",
    "PREVIEW_ONLY",
    "REQUIRED_ROUTES",
    "SupportVerdict",
    "assess",
    "parse_version",
]

#: The supported range, by minor version: 0.26.x up to 0.34.x except 0.33.x (pyproject's
#: ``gpu`` extra says the same: ``vllm>=0.26,!=0.33.*,<0.35``). 0.26 is the first
#: release with the RL endpoints; 0.32 (CPU, CI) and 0.34 (the 8B transition on a GPU,
#: ``results/gpu/vllm034.json``) are the newest ones run.
MIN_MINOR = (0, 26)
MAX_MINOR = (0, 34)
#: Releases inside the range whose differences RolloutCore handles (``engine.state``,
#: ``transports.compat.reload``, the 0.33 ``WeightSource`` contract) but that have not
#: run through its verified transition: admitted only where the operator sets
#: ``ROLLOUTCORE_VLLM_PREVIEW=1``, and the verdict says so. A release leaves this set
#: (and pyproject's ``gpu`` extra admits it) once it has run.
PREVIEW_ONLY: frozenset[tuple[int, int]] = frozenset({(0, 33)})
PREVIEW_ENV = "ROLLOUTCORE_VLLM_PREVIEW"
_INSTALL_HINT = "pip install 'rolloutcore[gpu]' or 'rolloutcore[cpu]' installs a supported one"

#: Routes a hot update cannot do without, with what each is for.
REQUIRED_ROUTES: Mapping[str, str] = required_routes()

#: Optional capabilities, each with how it shows in ``/openapi.json``.
OPTIONAL_CAPABILITIES: Mapping[str, str] = {
    "weight_info": "/weight_info: the engine's weight-version label",
    "weight_checker": "/weight_checker: per-parameter checksums while paused",
    "weight_versions": "per-token weight_versions spans in /inference/v1/generate answers",
    "generate": "/inference/v1/generate: token in, token out (--enable-scale-out)",
    "sleep": "/sleep and /wake_up",
    "checkpoint": "/checkpoint/status: the process-checkpoint state (vLLM 0.34)",
}

_ROUTE_OF = {"weight_info": Routes.WEIGHT_INFO, "weight_checker": Routes.WEIGHT_CHECKER,
             "generate": Routes.GENERATE, "sleep": Routes.SLEEP,
             "checkpoint": Routes.CHECKPOINT_STATUS}
_VERSION_RE = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?")


def parse_version(text: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a vLLM version string, local and pre-release parts ignored.

    ``0.32.0+cpu``, ``0.26.0rc1`` and ``0.33.0.dev12+gabc`` all parse; the
    range is decided on (major, minor) only, so a pre-release of 0.33 is
    outside it and a patch release of 0.32 inside.
    """
    m = _VERSION_RE.match(text.strip())
    if m is None:
        return None
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


@dataclass(frozen=True)
class SupportVerdict:
    """Whether RolloutCore can drive this engine, and if not, every reason why.

    ``capabilities`` maps each name of ``OPTIONAL_CAPABILITIES`` to whether
    the engine offers it, or ``None`` when the answers given cannot tell
    (per-token spans show only in the full ``/openapi.json`` schemas, not
    in a route list).
    """

    version: str | None
    reasons: tuple[str, ...]
    missing_routes: tuple[str, ...]
    capabilities: Mapping[str, bool | None] = field(default_factory=dict)
    #: A release not yet run, admitted by ``ROLLOUTCORE_VLLM_PREVIEW=1``.
    preview: bool = False

    @property
    def supported(self) -> bool:
        return not self.reasons

    def describe(self) -> str:
        """One line: the verdict and the optional capabilities."""
        have = sorted(k for k, v in self.capabilities.items() if v)
        lacks = sorted(k for k, v in self.capabilities.items() if v is False)
        unknown = sorted(k for k, v in self.capabilities.items() if v is None)
        caps = f"optional: has {', '.join(have) or 'none'}"
        if lacks:
            caps += f"; lacks {', '.join(lacks)}"
        if unknown:
            caps += f"; cannot tell {', '.join(unknown)}"
        head = (f"vLLM {self.version or '(unknown version)'} is supported" if self.supported
                else "unsupported vLLM: " + "; ".join(self.reasons))
        if self.preview and self.supported:
            head += f" as a preview ({PREVIEW_ENV}=1: not yet run through the verified transition)"
        return f"{head} ({caps})"

    def require(self, where: str) -> SupportVerdict:
        """Raise ``EngineUnavailable`` (nothing changed) unless supported; else self."""
        if not self.supported:
            raise EngineUnavailable(where, self.describe(), mutation_started=False)
        return self


def _version_text(answer: object) -> str | None:
    if isinstance(answer, str):
        return answer
    if isinstance(answer, Mapping) and isinstance(answer.get("version"), str):
        return str(answer["version"])
    return None


def _routes_and_schemas(openapi: object) -> tuple[frozenset[str] | None,
                                                  Mapping[str, Any] | None]:
    if isinstance(openapi, Mapping):
        paths = openapi.get("paths")
        if not isinstance(paths, Mapping):
            return None, None
        comps = openapi.get("components")
        schemas = comps.get("schemas") if isinstance(comps, Mapping) else None
        return (frozenset(str(p) for p in paths),
                schemas if isinstance(schemas, Mapping) else {})
    if isinstance(openapi, (str, bytes)) or not isinstance(openapi, Iterable):
        return None, None
    routes = list(openapi)
    if not all(isinstance(r, str) for r in routes):
        return None, None
    return frozenset(routes), None


def _has_spans(schemas: Mapping[str, Any]) -> bool:
    if "WeightVersionSpan" in schemas:
        return True
    return any(isinstance(s, Mapping) and isinstance(s.get("properties"), Mapping)
               and "weight_versions" in s["properties"] for s in schemas.values())


def assess(version: object, openapi: object, *,
           preview: bool | None = None) -> SupportVerdict:
    """Decide support from the engine's ``/version`` and ``/openapi.json`` answers.

    ``version`` is the parsed ``/version`` body (``{"version": "0.32.0"}``) or
    the version string; ``openapi`` is the parsed ``/openapi.json`` body or
    just its route paths (what ``VllmHTTP.capabilities()`` returns). A
    malformed answer is a reason, not an exception: it comes from the
    engine, and the verdict says what it was. ``preview`` (default: the
    ``ROLLOUTCORE_VLLM_PREVIEW`` environment variable is ``1``) admits the
    releases in ``PREVIEW_ONLY``, handled but not yet run.
    """
    if preview is None:
        preview = os.environ.get(PREVIEW_ENV, "") == "1"
    reasons: list[str] = []
    in_preview = False
    text = _version_text(version)
    if text is None:
        reasons.append(f"/version did not answer {{'version': str}}: {str(version)[:80]}")
    else:
        parsed = parse_version(text)
        if parsed is None:
            reasons.append(f"cannot read vLLM version {text!r}")
        elif parsed[:2] in PREVIEW_ONLY and preview:
            in_preview = True
        elif parsed[:2] in PREVIEW_ONLY:
            reasons.append(
                f"vLLM {text} has not run through RolloutCore's verified transition "
                f"(it runs as a preview with {PREVIEW_ENV}=1; {_INSTALL_HINT})")
        elif not MIN_MINOR <= parsed[:2] <= MAX_MINOR:
            reasons.append(
                f"vLLM {text} is outside the supported range "
                f"{MIN_MINOR[0]}.{MIN_MINOR[1]}..{MAX_MINOR[0]}.{MAX_MINOR[1]} ({_INSTALL_HINT})")
    routes, schemas = _routes_and_schemas(openapi)
    if routes is None:
        reasons.append(f"/openapi.json has no route list ('paths'): {str(openapi)[:80]}")
        return SupportVerdict(text, tuple(reasons), (), {})
    missing = tuple(r for r in REQUIRED_ROUTES if r not in routes)
    if missing:
        hint = (" (start vLLM with VLLM_SERVER_DEV_MODE=1: the RL endpoints are dev-mode "
                "routes)" if Routes.PAUSE in missing else "")
        reasons.append("missing required routes " + ", ".join(
            f"{r} ({REQUIRED_ROUTES[r]})" for r in missing) + hint)
    caps: dict[str, bool | None] = {k: r in routes for k, r in _ROUTE_OF.items()}
    caps["sleep"] = Routes.SLEEP in routes and Routes.WAKE_UP in routes
    caps["weight_versions"] = (None if schemas is None else bool(
        caps["generate"] and _has_spans(schemas)))
    return SupportVerdict(text, tuple(reasons), missing,
                          {k: caps[k] for k in OPTIONAL_CAPABILITIES}, preview=in_preview)
