"""vLLM 0.33 and 0.34, against their contract as read in the released wheels (fast lane).

The CPU build here is 0.32, so these run the code that handles each difference
against stand-ins shaped like 0.33/0.34 (their class contracts and route answers,
read from the 0.34.0 wheel's sources): the reload API (``start_reload`` /
``finish_reload``, direct mode refused), the 0.33 ``WeightSource`` contract
(``metadata`` a ``functools.cached_property``, ``iter_full``), and 0.34's own word
on its weights read as validation evidence (``has_incomplete_weight_update``,
``/checkpoint/status``). The GPU run of the same code on a real 0.34 is
``diagnostics/gpu/h200_8b_ipc.py`` (``results/gpu/vllm034.json``).
"""

from __future__ import annotations

import abc
import functools
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch

from rolloutcore.core.evidence import PauseMode
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.testing import FakeVllm
from rolloutcore.transports.compat.reload import DirectReloadRefused, ReloadApi
from rolloutcore.transports.driver import SourceSlot
from rolloutcore.transports.source import WeightSource
from test_vllm_http_unit import answer, client, sent, target, vllm

# ----------------------------------------------------------------- the reload API


def _module(name: str, **attrs: Any) -> types.ModuleType:
    m = types.ModuleType(name)
    for k, v in attrs.items():
        setattr(m, k, v)
    return m


def test_a_032_worker_opens_and_closes_the_layerwise_reload() -> None:
    calls: list[tuple[str, tuple[Any, ...]]] = []
    m = _module("fake_reload_032",
                initialize_layerwise_reload=lambda *a: calls.append(("init", a)),
                finalize_layerwise_reload=lambda *a: calls.append(("final", a)))
    api = ReloadApi(m)
    assert api.generation == "layerwise" and not api.direct_mode()
    api.open("model")
    api.close("model", "cfg", "cuda:0")
    assert calls == [("init", ("model",)), ("final", ("model", "cfg"))]


def _reload_034(monkeypatch: pytest.MonkeyPatch, direct: bool) -> list[tuple[str, Any]]:
    calls: list[tuple[str, Any]] = []
    m = _module("fake_reload_034", start_reload=lambda *a: calls.append(("start", a)),
                finish_reload=lambda *a: calls.append(("finish", a)),
                initialize_layerwise_reload=lambda *a: calls.append(("init", a)))
    monkeypatch.setitem(sys.modules, "fake_reload_034", m)
    monkeypatch.setitem(sys.modules, "fake_reload_034.direct",
                        _module("fake_reload_034.direct", direct_reload_enabled=lambda: direct))
    return calls


def test_a_034_worker_uses_start_reload_so_weight_update_active_is_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _reload_034(monkeypatch, direct=False)
    api = ReloadApi(sys.modules["fake_reload_034"])
    assert api.generation == "start_reload"
    api.open("model")
    with api.mtp_ok():  # start_reload set vLLM's flag: no 0.32 context manager needed
        pass
    api.close("model", "cfg", "cuda:0")
    # finish_reload takes the device too (0.34's signature).
    assert calls == [("start", ("model",)), ("finish", ("model", "cfg", "cuda:0"))]


def test_direct_reload_mode_is_refused_before_anything_moves(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _reload_034(monkeypatch, direct=True)
    api = ReloadApi(sys.modules["fake_reload_034"])
    assert api.direct_mode()
    with pytest.raises(DirectReloadRefused, match="VLLM_RELOAD_MODE=direct"):
        api.open("model")
    assert calls == []


@pytest.mark.slow  # imports vLLM (about 5 s of CPU on these CPUs)
def test_the_installed_vllm_has_a_reload_api_the_workers_can_use() -> None:
    pytest.importorskip("vllm")
    from rolloutcore.transports.compat.reload import reload_api

    api = reload_api()
    assert api.generation in ("layerwise", "start_reload")
    assert not api.direct_mode()
    with api.mtp_ok():
        pass


# ------------------------------------------------------- the 0.33 WeightSource contract


@dataclass(frozen=True)
class _ParamMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


class _WeightSource033(abc.ABC):
    """vLLM 0.33+'s base class contract: a cached ``metadata`` property, ``iter_full``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        md = cls.__dict__.get("metadata")
        if md is not None and not isinstance(md, functools.cached_property):
            raise TypeError(f"{cls.__name__}.metadata must be a functools.cached_property")

    @property
    @abc.abstractmethod
    def metadata(self) -> list[_ParamMeta]:
        raise NotImplementedError

    def iter_full(self) -> Iterator[tuple[str, torch.Tensor]]:
        raise NotImplementedError


def test_the_source_slot_meets_the_033_contract_and_declares_each_round(
        monkeypatch: pytest.MonkeyPatch) -> None:
    base = _module("vllm.distributed.weight_transfer.base",
                   WeightSource=_WeightSource033, ParamMeta=_ParamMeta)
    pkg = _module("vllm.distributed.weight_transfer", base=base)
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer", pkg)
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.base", base)
    slot = SourceSlot()
    view = slot.as_vllm()  # defining the class is where 0.33 raised TypeError
    assert isinstance(view, _WeightSource033)
    slot.fill(WeightSource.from_state_dict({"a": torch.ones(2), "b": torch.zeros(3)}), None)
    assert [(m.name, tuple(m.shape)) for m in view.metadata] == [("a", (2,)), ("b", (3,))]
    assert [n for n, _ in view.iter_full()] == ["a", "b"]
    # The next round sends another source: its metadata, not the cached one.
    slot.fill(WeightSource.from_state_dict({"c": torch.ones(4, 1)}), None)
    assert [(m.name, tuple(m.shape)) for m in view.metadata] == [("c", (4, 1))]
    assert [(n, tuple(t.shape)) for n, t in view.iter_full()] == [("c", (4, 1))]


@pytest.mark.slow  # imports vLLM (about 5 s of CPU on these CPUs)
def test_the_source_slot_still_meets_the_installed_vllms_contract() -> None:
    pytest.importorskip("vllm")
    slot = SourceSlot()
    view = slot.as_vllm()
    slot.fill(WeightSource.from_state_dict({"a": torch.ones(2)}), None)
    md = view.metadata if not callable(view.metadata) else view.metadata()
    assert [m.name for m in md] == ["a"]


# ---------------------------------------------- 0.34's own word on its weights


def _engine_034(incomplete: list[Any] | None = None, checkpoint: Any = "running") -> FakeVllm:
    rpcs: list[Any] = []

    def rpc(req: httpx.Request) -> httpx.Response:
        import json

        body = json.loads(req.content)
        rpcs.append(body)
        if body.get("method") != "has_incomplete_weight_update":
            return httpx.Response(400, json={"error": "unknown method"})
        # vLLM 0.34's /collective_rpc answers each worker's bool as its str()
        # (entrypoints/serve/dev/rpc/api_router.py): "False", not false.
        return httpx.Response(200, json={"results": incomplete if incomplete is not None
                                         else ["False", "False"]})

    e = vllm(overrides={  # served so, and listed by /openapi.json
        "/version": answer(200, {"version": "0.34.0"}),
        "/metrics": answer(200, text=""),
        "/collective_rpc": rpc,
        "/checkpoint/status": answer(200, {"state": checkpoint} if isinstance(checkpoint, str)
                                     else checkpoint),
    })
    e.rpcs = rpcs  # type: ignore[attr-defined]
    return e


def _validate(e: FakeVllm) -> Any:
    a = VllmAdapter(client(e), engine_epoch="ep-1")
    a.bootstrap()
    a.drain(PauseMode.WAIT)
    return a.validate(target(), live=False)


def test_a_034_engine_whose_workers_finished_passes_both_checks() -> None:
    e = _engine_034()
    v = _validate(e)
    by = {c.name: c for c in v.checks}
    assert by["weights-complete"].passed and "2 of 2 workers" in by["weights-complete"].detail
    assert by["checkpoint-running"].passed
    assert v.problems(target()) == []


def test_a_bool_answered_as_json_false_also_passes() -> None:
    v = _validate(_engine_034(incomplete=[False]))
    assert next(c for c in v.checks if c.name == "weights-complete").passed


@pytest.mark.parametrize("results", [[False, True], [True], [None, False], [],
                                     ["False", "True"], ["true"], ["0"], [{"x": 1}]])
def test_a_034_engine_that_says_its_weights_are_half_written_is_never_published(
        results: list[Any]) -> None:
    v = _validate(_engine_034(incomplete=results))
    chk = next(c for c in v.checks if c.name == "weights-complete")
    assert not chk.passed
    assert v.problems(target()), "a failed check must fail the validation"


@pytest.mark.parametrize("state", ["prepared", "preparing", "restoring", "failed",
                                   {"error": "no state"}])
def test_a_034_engine_outside_its_running_checkpoint_state_fails_validation(
        state: Any) -> None:
    v = _validate(_engine_034(checkpoint=state))
    chk = next(c for c in v.checks if c.name == "checkpoint-running")
    assert not chk.passed and "only 'running' serves" in chk.detail
    assert v.problems(target())


def test_a_032_engine_is_not_asked_what_it_cannot_answer() -> None:
    e = vllm(overrides={"/version": answer(200, {"version": "0.32.0"}),
                        "/metrics": answer(200, text="")})
    v = _validate(e)
    assert not {c.name for c in v.checks} & {"weights-complete", "checkpoint-running"}
    assert sent(e, "/collective_rpc") == 0 and sent(e, "/checkpoint/status") == 0
