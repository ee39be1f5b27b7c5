"""The one exception map (``rolloutcore.engine.errors``) as its users apply it.

The CUDA-IPC trainer's calls, the TRL gateway engine, the launcher's probes
and the gateway's read-only passthrough each had a private map; they now
wrap their calls in ``map_errors``. Checked here: the tree's classes come
out (never an httpx exception), the caller's ``mutation_started`` is kept,
and a call cut off by its own watchdog is a timeout.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import httpx
import pytest

from helpers.vllm_fake import answer, vllm
from rolloutcore.engine.errors import map_errors, raise_for_status
from rolloutcore.engine.routes import Routes
from rolloutcore.engine.weight_sync import HttpWeightSync, WeightSyncClient
from rolloutcore.errors import (
    EffectError,
    EffectTimeout,
    EngineRefused,
    EngineUnavailable,
    EngineUnreachable,
)


def _client(handler: Any) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler))


def _raise(exc: Exception) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc
    return handler


# ----------------------------------------------------------------- the map itself

@pytest.mark.parametrize(("exc", "cls"), [
    (httpx.ConnectError("refused"), EngineUnreachable),
    (httpx.ReadTimeout("slow"), EffectTimeout),
    (httpx.RemoteProtocolError("closed"), EngineUnavailable),
    (ConnectionResetError("reset"), EngineUnavailable),
])
@pytest.mark.parametrize("mutation", [True, False])
def test_most_specific_class_and_the_callers_mutation_flag(
        exc: Exception, cls: type[EffectError], mutation: bool) -> None:
    c = _client(_raise(exc))
    with pytest.raises(cls) as got, map_errors("s", "GET /x", timeout_s=1.0,
                                               mutation_started=mutation):
        c.get("http://e.test/x")
    assert type(got.value) is cls and got.value.mutation_started is mutation
    assert got.value.__cause__ is exc


def test_a_closed_client_is_a_timeout_only_when_the_watchdog_closed_it() -> None:
    c = _client(lambda r: httpx.Response(200))
    c.close()
    with pytest.raises(EffectTimeout, match="cancelled by its watchdog"), map_errors(
            "s", "GET /x", timeout_s=1.0, cancelled=lambda: True):
        c.get("http://e.test/x")
    with pytest.raises(RuntimeError), map_errors("s", "GET /x", timeout_s=1.0,
                                                 cancelled=lambda: False):
        c.get("http://e.test/x")


def test_status_keeps_the_mutation_flag() -> None:
    r = httpx.Response(409, text="no", request=httpx.Request("POST", "http://e.test/p"))
    with pytest.raises(EngineRefused) as got:
        raise_for_status(r, "s", "POST /p", mutation_started=False)
    assert got.value.mutation_started is False and got.value.status == 409


def test_the_same_map_wraps_an_async_call_and_an_async_stream() -> None:
    asyncio.run(_async_call_and_stream())


async def _async_call_and_stream() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("gone")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        with pytest.raises(EngineUnavailable), map_errors("s", "GET /x", timeout_s=1.0):
            await c.get("http://e.test/x")
        with pytest.raises(EngineUnavailable), map_errors("s", "POST /g", timeout_s=1.0):
            async with c.stream("POST", "http://e.test/g") as resp:
                async for _ in resp.aiter_lines():
                    pass


# ----------------------------------------------------------------- its users

def _sync(handler: Any) -> HttpWeightSync:
    sync = HttpWeightSync("http://e.test", pooled=True)
    sync._client = _client(handler)
    return sync


def test_weight_sync_speaks_vllms_four_methods_on_the_routes_of_the_table() -> None:
    # The one fake of vLLM, its four routes answering as the test says (the fake's engine
    # would refuse a finish without a start, and it serves no draft update).
    requests: list[httpx.Request] = []
    ok = answer(200, {"ok": True})
    fake = vllm(seen=requests, overrides={
        Routes.OPENAPI: answer(200, {"paths": {Routes.START_UPDATE: {}}}),
        **{p: ok for p in (Routes.INIT_TRANSFER, Routes.START_UPDATE, Routes.START_DRAFT_UPDATE,
                           Routes.UPDATE_WEIGHTS, Routes.FINISH_UPDATE)}})
    sync = _sync(fake.handle)
    assert isinstance(sync, WeightSyncClient)
    assert sync.routes() == frozenset({Routes.START_UPDATE})
    sync.init_weight_transfer_engine({"a": 1})
    sync.start_weight_update()
    sync.start_weight_update(draft=True)
    sync.update_weights({"names": []})
    sync.finish_weight_update("rc-1")
    assert sync.finish_weight_update() == {"ok": True}
    seen = [(r.method, r.url.path, r.content) for r in requests]
    assert [(m, p) for m, p, _ in seen] == [
        ("GET", Routes.OPENAPI), ("POST", Routes.INIT_TRANSFER), ("POST", Routes.START_UPDATE),
        ("POST", Routes.START_DRAFT_UPDATE), ("POST", Routes.UPDATE_WEIGHTS),
        ("POST", Routes.FINISH_UPDATE), ("POST", Routes.FINISH_UPDATE)]
    bodies = [b for _, _, b in seen]
    assert bodies[1] == b'{"init_info":{"a":1}}' and bodies[2] == b""
    assert bodies[4] == b'{"update_info":{"names":[]}}'
    assert bodies[5] == b'{"weight_version":"rc-1"}' and bodies[6] == b""  # as vLLM's client


@pytest.mark.parametrize(("exc", "cls"), [
    (httpx.ConnectError("refused"), EngineUnreachable),
    (httpx.ReadTimeout("slow"), EffectTimeout),
])
def test_weight_sync_failures_go_through_the_map(exc: Exception,
                                                 cls: type[EffectError]) -> None:
    with pytest.raises(cls) as got:
        _sync(_raise(exc)).start_weight_update(step="transfer")
    assert got.value.mutation_started is False and got.value.step == "transfer"
    with pytest.raises(EngineUnavailable, match="HTTP 500") as got2:
        _sync(lambda r: httpx.Response(500, text="boom")).update_weights({})
    assert got2.value.mutation_started is True and got2.value.status == 500


def test_weight_sync_abort_makes_a_stuck_call_a_timeout() -> None:
    entered, release = threading.Event(), threading.Event()

    def handler(request: httpx.Request) -> httpx.Response:
        entered.set()
        release.wait(5)
        raise httpx.ReadError("connection closed by abort")

    sync = _sync(handler)
    out: list[BaseException] = []

    def call() -> None:
        try:
            sync.finish_weight_update("v", timeout_s=5.0)
        except BaseException as exc:
            out.append(exc)

    th = threading.Thread(target=call)
    th.start()
    assert entered.wait(5)
    sync.abort()
    release.set()
    th.join(5)
    assert len(out) == 1 and isinstance(out[0], EffectTimeout), out
    assert "cancelled by its watchdog" in str(out[0]) and out[0].mutation_started is True


def test_cuda_ipc_trainer_takes_the_weight_sync_client() -> None:
    from rolloutcore.transports.cuda_ipc.trainer import CudaIpcTransport

    t = CudaIpcTransport(device="cpu")
    t._syncs["http://e.test"] = _sync(lambda r: httpx.Response(200, json={"results": [1]}))
    assert t.rpc("http://e.test", "rc_hello") == [1]
    t._syncs["http://e.test"] = _sync(_raise(httpx.ConnectError("refused")))
    with pytest.raises(EngineUnreachable) as got:
        t.rpc("http://e.test", "rc_hello")
    assert got.value.step == "rpc" and got.value.mutation_started is False
    t.abort()


def _gateway_engine(handler: Any) -> Any:
    from rolloutcore.integrations.trl.engines import _GatewayEngine

    return _GatewayEngine("http://gw.test", "t" * 32, transport=None, data_token=None,
                          timeout_s=5, min_verification=None,
                          http_transport=httpx.MockTransport(handler))


def test_trl_gateway_engine_leaks_no_httpx_exception() -> None:
    eng = _gateway_engine(lambda r: httpx.Response(500, text="down"))
    try:
        with pytest.raises(EngineUnavailable, match="HTTP 500") as got:
            eng._served_model()
        assert not isinstance(got.value, httpx.HTTPError)
        assert got.value.mutation_started is False
    finally:
        eng.close()
    eng = _gateway_engine(_raise(httpx.ConnectError("refused")))
    try:
        with pytest.raises(EngineUnreachable) as got2:
            eng.engine_identity()
        assert got2.value.mutation_started is False
    finally:
        eng.close()


def test_launcher_probe_reports_the_httpx_failure_as_before(tmp_path: Any) -> None:
    from rolloutcore.engine.process import ManagedEngine

    (tmp_path / "config.json").write_text("{}")
    eng = ManagedEngine(tmp_path, port=1)
    with pytest.raises(EngineUnavailable, match=r"ConnectError: refused") as got:
        eng._check_support(_client(_raise(httpx.ConnectError("refused"))), 0.0)
    assert got.value.mutation_started is False
