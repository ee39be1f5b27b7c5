"""FaultProxy over real sockets: a real uvicorn upstream, the proxy's uvicorn, httpx clients.

The upstream here is a small Starlette app that records what reached it, so
each test can tell whether the "engine" saw a request the proxy broke. The
proxy in front of a real vLLM is exercised in tests/engine/test_faults_engine.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from helpers.gateway_rig import uvicorn_thread
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import free_port
from rolloutcore.errors import BadInput, EffectTimeout, EngineUnavailable, EngineUnreachable
from rolloutcore.testing.faultproxy import Fault, FaultKind, FaultProxy


class Upstream:
    """Records every request it answers (path, method, query, body)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, bytes]] = []
        self.lock = threading.Lock()
        self.app = Starlette(routes=[
            Route("/echo", self.echo, methods=["GET", "POST"]),
            Route("/reset_prefix_cache", self.reset, methods=["POST"]),
            Route("/reset_mm_cache", self.empty, methods=["POST"]),
            Route("/text", self.text, methods=["GET"]),
            Route("/missing", self.missing, methods=["GET"]),
            Route("/stream", self.stream, methods=["GET"]),
        ])

    async def _note(self, req: Request) -> bytes:
        body = await req.body()
        with self.lock:
            self.seen.append((req.url.path, req.method, req.url.query, body))
        return body

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, *_ in self.seen if p == path)

    async def echo(self, req: Request) -> Response:
        body = await self._note(req)
        return JSONResponse({"method": req.method, "query": req.url.query,
                             "body": body.decode(), "x": req.headers.get("x-test")},
                            headers={"x-up": "1"})

    async def reset(self, req: Request) -> Response:
        await self._note(req)
        return JSONResponse({"success": True})

    async def empty(self, req: Request) -> Response:
        await self._note(req)
        return Response(status_code=200)

    async def text(self, req: Request) -> Response:
        await self._note(req)
        return PlainTextResponse("plain")

    async def missing(self, req: Request) -> Response:
        await self._note(req)
        return JSONResponse({"error": "nope"}, status_code=404)

    async def stream(self, req: Request) -> Response:
        await self._note(req)

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.01)

        return StreamingResponse(chunks(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    up = Upstream()
    with uvicorn_thread(up.app) as url:
        yield up, url


@pytest.fixture(scope="module")
def module_proxy(upstream: tuple[Upstream, str]) -> Iterator[FaultProxy]:
    with FaultProxy(upstream[1]) as p:
        yield p


@pytest.fixture()
def proxy(module_proxy: FaultProxy, upstream: tuple[Upstream, str]) -> Iterator[FaultProxy]:
    module_proxy.reset()
    module_proxy.set_upstream(upstream[1])
    try:
        yield module_proxy
    finally:
        module_proxy.reset()


@pytest.fixture()
def up(upstream: tuple[Upstream, str]) -> Upstream:
    return upstream[0]


def test_pass_through_keeps_method_query_body_headers_and_streams(
        proxy: FaultProxy, up: Upstream) -> None:
    r = httpx.post(f"{proxy.base_url}/echo?a=1&b=two", content=b"payload",
                   headers={"x-test": "yes"}, timeout=10)
    assert r.status_code == 200 and r.headers["x-up"] == "1"
    assert r.json() == {"method": "POST", "query": "a=1&b=two", "body": "payload", "x": "yes"}
    assert httpx.get(f"{proxy.base_url}/missing", timeout=10).status_code == 404
    with httpx.stream("GET", f"{proxy.base_url}/stream", timeout=10) as s:
        events = [line for line in s.iter_lines() if line]
    assert events == ["data: 0", "data: 1", "data: 2"]
    assert proxy.hits == [] and proxy.requests("/echo") >= 1


def test_status_fault_with_and_without_the_engine_seeing_it(
        proxy: FaultProxy, up: Upstream) -> None:
    before = up.count("/echo")
    proxy.inject("/echo", Fault.http_status(500), times=1)
    t0 = time.monotonic()
    r = httpx.post(f"{proxy.base_url}/echo", content=b"x", timeout=10)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert up.count("/echo") == before  # never forwarded
    (hit,) = proxy.hits
    assert hit.kind is FaultKind.STATUS and hit.route == "/echo" and hit.method == "POST"
    assert t0 <= hit.t_mono <= time.monotonic()
    # times=1: the next request passes.
    assert httpx.post(f"{proxy.base_url}/echo", timeout=10).status_code == 200
    proxy.inject("/echo", Fault.http_status(503, upstream=True), times=1)
    r = httpx.post(f"{proxy.base_url}/echo", timeout=10)
    assert r.status_code == 503 and up.count("/echo") == before + 2
    assert proxy.hits[-1].upstream_status == 200


def test_skip_method_and_wildcard(proxy: FaultProxy, up: Upstream) -> None:
    proxy.inject("/echo", Fault.http_status(500), method="get", skip=1, times=1)
    assert httpx.post(f"{proxy.base_url}/echo", timeout=10).status_code == 200  # method
    assert httpx.get(f"{proxy.base_url}/echo", timeout=10).status_code == 200   # skipped
    assert httpx.get(f"{proxy.base_url}/echo", timeout=10).status_code == 500   # applied
    assert httpx.get(f"{proxy.base_url}/echo", timeout=10).status_code == 200   # used up
    proxy.inject("*", Fault.http_status(502))
    assert httpx.get(f"{proxy.base_url}/text", timeout=10).status_code == 502
    proxy.clear("*")
    assert httpx.get(f"{proxy.base_url}/text", timeout=10).text == "plain"


def test_delay_holds_the_answer_after_the_engine_acted(proxy: FaultProxy, up: Upstream) -> None:
    before = up.count("/reset_prefix_cache")
    proxy.inject("/reset_prefix_cache", Fault.delay(30.0))
    with VllmHTTP(proxy.base_url, timeout_s=0.5) as h:
        t0 = time.monotonic()
        with pytest.raises(EffectTimeout):
            h._request("POST", "/reset_prefix_cache", step="reset", timeout_s=0.5)
        assert time.monotonic() - t0 < 5
    assert up.count("/reset_prefix_cache") == before + 1  # the engine did reset
    assert proxy.wait_hit("/reset_prefix_cache", timeout_s=1).kind is FaultKind.DELAY


def test_delay_before_forwarding_drops_a_request_whose_client_left(
        proxy: FaultProxy, up: Upstream) -> None:
    before = up.count("/echo")
    proxy.inject("/echo", Fault.delay(0.6, upstream=False), times=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy.base_url}/echo", timeout=0.2)
    time.sleep(1.2)
    assert up.count("/echo") == before
    # A client that waits gets the real answer, late.
    proxy.inject("/echo", Fault.delay(0.3, upstream=False), times=1)
    t0 = time.monotonic()
    assert httpx.post(f"{proxy.base_url}/echo", timeout=10).status_code == 200
    assert time.monotonic() - t0 >= 0.3 and up.count("/echo") == before + 1


def test_close_cuts_the_connection_mid_response(proxy: FaultProxy, up: Upstream) -> None:
    before = up.count("/echo")
    proxy.inject("/echo", Fault.close(), times=1)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{proxy.base_url}/echo", timeout=10)
    assert up.count("/echo") == before
    proxy.inject("/echo", Fault.close(upstream=True), times=1)
    with VllmHTTP(proxy.base_url, timeout_s=10) as h, pytest.raises(EngineUnavailable) as ei:
        h._request("POST", "/echo", step="finish", timeout_s=10)
    assert "RemoteProtocolError" in str(ei.value) and ei.value.mutation_started
    assert not isinstance(ei.value, EngineUnreachable)  # it was delivered, then cut
    assert up.count("/echo") == before + 1
    assert httpx.post(f"{proxy.base_url}/echo", timeout=10).status_code == 200  # still serving


def test_engine_failure_rewrites_success_and_the_adapter_sees_it(
        proxy: FaultProxy, up: Upstream) -> None:
    proxy.inject("/reset_prefix_cache", Fault.engine_failure())
    proxy.inject("/reset_mm_cache", Fault.engine_failure())
    proxy.inject("/text", Fault.engine_failure())
    proxy.inject("/missing", Fault.engine_failure())
    with VllmHTTP(proxy.base_url, timeout_s=10) as h:
        h._capabilities = frozenset({"/reset_prefix_cache", "/reset_mm_cache"})
        ev = h.reset_prefix_cache()
        assert ev.http_status == 200 and ev.engine_success is False and ev.problems(None)
        mm = h.reset_mm_cache()
        assert mm.engine_success is False  # an empty 200 became {"success": false}
    r = httpx.post(f"{proxy.base_url}/reset_prefix_cache", timeout=10)
    assert r.status_code == 200 and r.json() == {"success": False}
    assert httpx.get(f"{proxy.base_url}/text", timeout=10).text == "plain"  # not JSON: as is
    assert httpx.get(f"{proxy.base_url}/missing", timeout=10).status_code == 404
    assert {h.kind for h in proxy.hits} == {FaultKind.ENGINE_FAILURE}


def test_unreachable_upstream_is_a_502_and_set_upstream_switches(proxy: FaultProxy) -> None:
    proxy.set_upstream(f"http://127.0.0.1:{free_port()}")
    r = httpx.get(f"{proxy.base_url}/echo", timeout=10)
    assert r.status_code == 502 and "upstream failed" in r.json()["error"]["message"]


def test_stop_releases_held_requests(upstream: tuple[Upstream, str]) -> None:
    p = FaultProxy(upstream[1]).start()
    p.inject("/echo", Fault.delay(300.0))
    errors: list[BaseException] = []

    def held() -> None:
        try:
            httpx.post(f"{p.base_url}/echo", timeout=60)
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=held)
    th.start()
    p.wait_hit("/echo", timeout_s=10)
    t0 = time.monotonic()
    p.stop()
    th.join(20)
    assert not th.is_alive() and time.monotonic() - t0 < 10
    p.stop()  # idempotent


def test_bad_input_changes_nothing(proxy: FaultProxy) -> None:
    with pytest.raises(BadInput):
        FaultProxy("ftp://host")
    with pytest.raises(BadInput):
        proxy.inject("echo", Fault.close())
    with pytest.raises(BadInput):
        proxy.inject("/echo", "close")  # type: ignore[arg-type]
    with pytest.raises(BadInput):
        proxy.inject("/echo", Fault.close(), times=-1)
    with pytest.raises(BadInput):
        proxy.inject("/echo", Fault.close(), method="G E T")
    with pytest.raises(BadInput):
        Fault(FaultKind.STATUS, status=700)
    with pytest.raises(BadInput):
        Fault(FaultKind.ENGINE_FAILURE)
    with pytest.raises(BadInput):
        Fault.delay(0)
    with pytest.raises(BadInput):
        FaultProxy("http://127.0.0.1:1").base_url  # noqa: B018 - not started
    assert proxy.rules == []
    with pytest.raises(EffectTimeout):
        proxy.wait_hit("/echo", timeout_s=0.05)
