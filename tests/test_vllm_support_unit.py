"""Which vLLM is supported: ``engine.support.assess`` on real and altered answers.

``data/vllm-0.32.0-cpu.json`` holds what a real vLLM 0.32.0 (the CPU build
these tests run) answered on ``/version`` and ``/openapi.json``, trimmed to
the route list and the two schemas that matter. Older or broken engines are
that answer with routes or the version changed, as VLLM-FACTS describes them
(0.26: the RL endpoints, no ``/weight_info``, ``/weight_checker`` or spans).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutcore.engine.support import (
    OPTIONAL_CAPABILITIES,
    REQUIRED_ROUTES,
    SupportVerdict,
    assess,
    parse_version,
)
from rolloutcore.errors import EngineUnavailable

REAL = json.loads((Path(__file__).parent / "data" / "vllm-0.32.0-cpu.json").read_text())


def _openapi(drop: tuple[str, ...] = (), schemas: bool = True) -> dict[str, Any]:
    doc = copy.deepcopy(REAL["openapi"])
    for r in drop:
        del doc["paths"][r]
    if not schemas:
        doc["components"]["schemas"] = {}
    return dict(doc)


def test_the_real_engine_is_supported_with_every_capability_of_its_release() -> None:
    v = assess(REAL["version"], REAL["openapi"])
    assert v.supported and v.reasons == () and v.missing_routes == ()
    assert v.version == "0.32.0"
    # /checkpoint/status came with 0.34: the real 0.32 document has everything else.
    assert v.capabilities == {k: k != "checkpoint" for k in OPTIONAL_CAPABILITIES}
    assert v.require("launch") is v
    assert "is supported" in v.describe() and "lacks checkpoint)" in v.describe()
    assert not v.preview


def test_a_route_list_alone_cannot_tell_spans() -> None:
    """What VllmHTTP.capabilities() returns: the paths only; spans show in the schemas."""
    v = assess("0.32.0", frozenset(REAL["openapi"]["paths"]))
    assert v.supported and v.capabilities["weight_versions"] is None
    assert v.capabilities["weight_checker"] is True
    assert v.describe().endswith("; cannot tell weight_versions)")


def test_a_026_engine_is_supported_without_the_optional_parts() -> None:
    v = assess({"version": "0.26.0"},
               _openapi(drop=("/weight_info", "/weight_checker"), schemas=False))
    assert v.supported
    assert v.capabilities == {"weight_info": False, "weight_checker": False,
                              "weight_versions": False, "generate": True, "sleep": True,
                              "checkpoint": False}
    assert "lacks checkpoint, weight_checker, weight_info, weight_versions" in v.describe()


@pytest.mark.parametrize("version,ok", [
    ("0.26.0", True), ("0.26.0rc1", True), ("0.29.3", True), ("0.32.0+cpu", True),
    ("0.32.9", True), ("v0.30.1", True), ("0.34.0", True), ("0.34.2+cu130", True),
    ("0.25.2", False), ("0.35.0", False), ("1.0.0", False), ("0.9.2", False),
])
def test_version_range(version: str, ok: bool) -> None:
    v = assess({"version": version}, REAL["openapi"], preview=False)
    assert v.supported is ok, v.reasons
    assert not v.preview
    if not ok:
        assert v.reasons == (f"vLLM {version} is outside the supported range 0.26..0.34 "
                             "(pip install 'rolloutcore[gpu]' or 'rolloutcore[cpu]' installs "
                             "a supported one)",)


@pytest.mark.parametrize("version", ["0.33.0", "0.33.0.dev12+gabcdef", "0.33.4"])
def test_033_never_ran_and_starts_only_as_a_preview(
        version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.33 is handled but has not run through the verified transition (0.34 has): only
    the operator's opt-in admits it, and the verdict says so; the environment variable
    is the default of ``preview``."""
    monkeypatch.setenv("ROLLOUTCORE_VLLM_PREVIEW", "0")
    v = assess({"version": version}, REAL["openapi"])
    assert not v.supported and not v.preview
    assert "has not run through RolloutCore's verified transition" in v.reasons[0]
    assert "ROLLOUTCORE_VLLM_PREVIEW=1" in v.reasons[0]
    monkeypatch.setenv("ROLLOUTCORE_VLLM_PREVIEW", "1")
    v = assess({"version": version}, REAL["openapi"])
    assert v.supported and v.preview, v.reasons
    assert "as a preview (ROLLOUTCORE_VLLM_PREVIEW=1" in v.describe()


@pytest.mark.parametrize("version", ["0.25.0", "0.35.0"])
def test_preview_admits_nothing_outside_the_range(
        version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLLOUTCORE_VLLM_PREVIEW", "1")
    v = assess({"version": version}, REAL["openapi"])
    assert not v.supported and not v.preview


def test_parse_version() -> None:
    assert parse_version("0.32.0") == (0, 32, 0)
    assert parse_version("0.33.0.dev12+gabc") == (0, 33, 0)
    assert parse_version("0.27") == (0, 27, 0)
    assert parse_version("nightly") is None and parse_version("") is None


def test_missing_required_routes_are_named_with_the_fix() -> None:
    """Without VLLM_SERVER_DEV_MODE the RL routes are absent: each is named."""
    rl = ("/pause", "/resume", "/start_weight_update", "/update_weights",
          "/finish_weight_update", "/reset_prefix_cache")
    assert set(rl) == set(REQUIRED_ROUTES)
    v = assess(REAL["version"], _openapi(drop=rl))
    assert not v.supported and v.missing_routes == rl
    (reason,) = v.reasons
    assert all(r in reason for r in rl) and "VLLM_SERVER_DEV_MODE=1" in reason
    v = assess(REAL["version"], _openapi(drop=("/update_weights",)))
    assert v.missing_routes == ("/update_weights",)
    assert "VLLM_SERVER_DEV_MODE" not in v.reasons[0]


def test_every_reason_is_given_at_once() -> None:
    v = assess({"version": "0.20.0"}, _openapi(drop=("/resume",)))
    assert len(v.reasons) == 2 and not v.supported
    with pytest.raises(EngineUnavailable, match=r"0\.20\.0 is outside.*/resume") as ei:
        v.require("launch")
    assert ei.value.mutation_started is False and ei.value.step == "launch"


@pytest.mark.parametrize("version,openapi,match", [
    ({"detail": "Not Found"}, REAL["openapi"], "did not answer"),
    ({"version": 32}, REAL["openapi"], "did not answer"),
    (None, REAL["openapi"], "did not answer"),
    ("nightly", REAL["openapi"], "cannot read vLLM version 'nightly'"),
    (REAL["version"], {"error": "HTTP 404"}, "no route list"),
    (REAL["version"], {"paths": ["/pause"]}, "no route list"),
    (REAL["version"], "/pause", "no route list"),
    (REAL["version"], 42, "no route list"),
    (REAL["version"], [1, 2], "no route list"),
])
def test_malformed_answers_are_reasons_not_exceptions(version: Any, openapi: Any,
                                                       match: str) -> None:
    v = assess(version, openapi)
    assert isinstance(v, SupportVerdict) and not v.supported
    assert any(match in r for r in v.reasons), v.reasons


def test_generate_without_spans_in_its_schema() -> None:
    doc = _openapi()
    del doc["components"]["schemas"]["WeightVersionSpan"]
    del doc["components"]["schemas"]["GenerateTokensChoice"]["properties"]["weight_versions"]
    assert assess(REAL["version"], doc).capabilities["weight_versions"] is False
    no_gen = _openapi(drop=("/inference/v1/generate",))
    caps = assess(REAL["version"], no_gen).capabilities
    assert caps["generate"] is False and caps["weight_versions"] is False
