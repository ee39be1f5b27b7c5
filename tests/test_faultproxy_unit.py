"""FaultProxy over real sockets: the one fake of vLLM served by uvicorn, the proxy's uvicorn,
httpx clients.

Upstream is ``FakeVllm`` (an ASGI app, as vLLM serves one), on loopback: its ``received``
and ``before`` tell each test whether the "engine" saw a request the proxy broke, and its
stream faults show what the proxy does with an engine that cuts its own answer. The proxy
in front of a real vLLM is exercised in tests/engine/test_faults_engine.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.gateway_rig import uvicorn_thread
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.engine.process import free_port
from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput, EffectTimeout, EngineUnavailable, EngineUnreachable
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights
from rolloutcore.testing.faultproxy import Fault, FaultKind, FaultProxy

COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 3}


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[FakeVllm, str]]:
    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0))
    with uvicorn_thread(fake, lifespan="off") as url:
        yield fake, url


@pytest.fixture(scope="module")
def module_proxy(upstream: tuple[FakeVllm, str]) -> Iterator[FaultProxy]:
    with FaultProxy(upstream[1]) as p:
        yield p


@pytest.fixture()
def proxy(module_proxy: FaultProxy, upstream: tuple[FakeVllm, str]) -> Iterator[FaultProxy]:
    module_proxy.reset()
    module_proxy.set_upstream(upstream[1])
    try:
        yield module_proxy
    finally:
        module_proxy.reset()


@pytest.fixture()
def up(upstream: tuple[FakeVllm, str]) -> Iterator[FakeVllm]:
    """The module's fake, its stream faults and hook put back after each test."""
    fake = upstream[0]
    yield fake
    fake.before, fake.event_delay_s, fake.break_after_events = None, 0.0, None
    fake.loras.clear()
    if fake.engine.paused:
        fake.engine.resume()


def count(fake: FakeVllm, path: str) -> int:
    """How many requests for ``path`` reached the engine."""
    return sum(1 for _, p in list(fake.received) if p == path)


def test_pass_through_keeps_method_query_body_headers_and_streams(
        proxy: FaultProxy, up: FakeVllm) -> None:
    seen: list[httpx.Request] = []
    up.before = seen.append
    body = json.dumps(COMPLETION).encode()
    r = httpx.post(f"{proxy.base_url}{Routes.COMPLETIONS}", content=body,
                   headers={"x-test": "yes", "content-type": "application/json"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["object"] == "text_completion" and len(r.json()["choices"][0]["text"]) == 3
    r = httpx.post(f"{proxy.base_url}{Routes.PAUSE}?mode=keep&clear_cache=false", timeout=10)
    assert r.json() == {"status": "paused"} and up.engine.paused
    (completion, pause) = seen
    assert (completion.method, completion.content, completion.headers["x-test"]) == (
        "POST", body, "yes")
    assert (pause.method, pause.url.path, pause.url.query) == (
        "POST", Routes.PAUSE, b"mode=keep&clear_cache=false")
    assert httpx.post(f"{proxy.base_url}{Routes.RESUME}", timeout=10).status_code == 200
    assert httpx.get(f"{proxy.base_url}/missing", timeout=10).status_code == 404
    assert httpx.post(f"{proxy.base_url}{Routes.MODELS}", timeout=10).status_code == 405
    # Event by event: the engine's pauses between events reach the client, nothing held.
    up.event_delay_s = 0.25
    got: list[tuple[float, str]] = []
    with httpx.stream("POST", f"{proxy.base_url}{Routes.COMPLETIONS}",
                      json={**COMPLETION, "stream": True}, timeout=10) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        got = [(time.monotonic(), line) for line in s.iter_lines() if line]
    events = [line for _, line in got]
    assert len(events) == 4 and events[-1] == "data: [DONE]"
    assert all(json.loads(e[len("data: "):])["object"] == "text_completion"
               for e in events[:-1])
    assert got[-1][0] - got[0][0] >= 0.5  # three pauses of 0.25 s, seen as they happened
    assert proxy.hits == [] and proxy.requests(Routes.COMPLETIONS) >= 2


def test_an_engine_that_cuts_its_stream_is_cut_through_the_proxy(
        proxy: FaultProxy, up: FakeVllm) -> None:
    up.break_after_events = 1
    events: list[str] = []
    with pytest.raises(httpx.RemoteProtocolError), httpx.stream(
            "POST", f"{proxy.base_url}{Routes.COMPLETIONS}",
            json={**COMPLETION, "stream": True}, timeout=10) as s:
        events.extend(line for line in s.iter_lines() if line)
    assert len(events) == 1 and events[0] != "data: [DONE]"
    assert proxy.hits == []  # no fault of the proxy's: the engine's cut, passed on
    up.break_after_events = None
    with httpx.stream("POST", f"{proxy.base_url}{Routes.COMPLETIONS}",
                      json={**COMPLETION, "stream": True}, timeout=10) as s:
        assert [line for line in s.iter_lines() if line][-1] == "data: [DONE]"


def test_status_fault_with_and_without_the_engine_seeing_it(
        proxy: FaultProxy, up: FakeVllm) -> None:
    route = Routes.RESET_PREFIX
    before = count(up, route)
    proxy.inject(route, Fault.http_status(500), times=1)
    t0 = time.monotonic()
    r = httpx.post(f"{proxy.base_url}{route}", timeout=10)
    assert r.status_code == 500 and r.json()["error"]["code"] == 500
    assert count(up, route) == before  # never forwarded
    (hit,) = proxy.hits
    assert hit.kind is FaultKind.STATUS and hit.route == route and hit.method == "POST"
    assert t0 <= hit.t_mono <= time.monotonic()
    # times=1: the next request passes.
    assert httpx.post(f"{proxy.base_url}{route}", timeout=10).json() == {"success": True}
    proxy.inject(route, Fault.http_status(503, upstream=True), times=1)
    r = httpx.post(f"{proxy.base_url}{route}", timeout=10)
    assert r.status_code == 503 and count(up, route) == before + 2
    assert proxy.hits[-1].upstream_status == 200


def test_skip_method_and_wildcard(proxy: FaultProxy, up: FakeVllm) -> None:
    url = f"{proxy.base_url}{Routes.MODELS}"
    proxy.inject(Routes.MODELS, Fault.http_status(500), method="get", skip=1, times=1)
    assert httpx.post(url, timeout=10).status_code == 405  # the method: the engine answers
    assert httpx.get(url, timeout=10).status_code == 200   # skipped
    assert httpx.get(url, timeout=10).status_code == 500   # applied
    assert httpx.get(url, timeout=10).status_code == 200   # used up
    proxy.inject("*", Fault.http_status(502))
    assert httpx.get(f"{proxy.base_url}{Routes.VERSION}", timeout=10).status_code == 502
    proxy.clear("*")
    assert httpx.get(f"{proxy.base_url}{Routes.VERSION}", timeout=10).json() == {
        "version": "fake"}


def test_delay_holds_the_answer_after_the_engine_acted(proxy: FaultProxy, up: FakeVllm) -> None:
    route = Routes.RESET_PREFIX
    before = count(up, route)
    proxy.inject(route, Fault.delay(30.0))
    with VllmHTTP(proxy.base_url, timeout_s=0.25) as h:
        t0 = time.monotonic()
        with pytest.raises(EffectTimeout):
            h._request("POST", route, step="reset", timeout_s=0.25)
        assert time.monotonic() - t0 < 5
    assert count(up, route) == before + 1  # the engine did reset
    assert proxy.wait_hit(route, timeout_s=1).kind is FaultKind.DELAY


def test_delay_before_forwarding_drops_a_request_whose_client_left(
        proxy: FaultProxy, up: FakeVllm) -> None:
    route = Routes.MODELS
    before = count(up, route)
    proxy.inject(route, Fault.delay(0.45, upstream=False), times=1)
    with pytest.raises(httpx.ReadTimeout):
        httpx.get(f"{proxy.base_url}{route}", timeout=0.2)
    time.sleep(0.9)     # the hold ended 0.65 s ago: a forward would have reached it
    assert count(up, route) == before
    # A client that waits gets the real answer, late.
    proxy.inject(route, Fault.delay(0.3, upstream=False), times=1)
    t0 = time.monotonic()
    assert httpx.get(f"{proxy.base_url}{route}", timeout=10).status_code == 200
    assert time.monotonic() - t0 >= 0.3 and count(up, route) == before + 1


def test_close_cuts_the_connection_mid_response(proxy: FaultProxy, up: FakeVllm) -> None:
    route = Routes.RESET_PREFIX
    before = count(up, route)
    proxy.inject(route, Fault.close(), times=1)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{proxy.base_url}{route}", timeout=10)
    assert count(up, route) == before
    proxy.inject(route, Fault.close(upstream=True), times=1)
    with VllmHTTP(proxy.base_url, timeout_s=10) as h, pytest.raises(EngineUnavailable) as ei:
        h._request("POST", route, step="finish", timeout_s=10)
    assert "RemoteProtocolError" in str(ei.value) and ei.value.mutation_started
    assert not isinstance(ei.value, EngineUnreachable)  # it was delivered, then cut
    assert count(up, route) == before + 1
    assert httpx.post(f"{proxy.base_url}{route}", timeout=10).status_code == 200  # serving


def test_engine_failure_rewrites_success_and_the_adapter_sees_it(
        proxy: FaultProxy, up: FakeVllm, tmp_path: Path) -> None:
    (tmp_path / "adapter_config.json").write_text("{}")
    for route in (Routes.RESET_PREFIX, Routes.RESET_MM, Routes.LOAD_LORA, "/missing"):
        proxy.inject(route, Fault.engine_failure())
    with VllmHTTP(proxy.base_url, timeout_s=10) as h:
        h._capabilities = frozenset({Routes.RESET_PREFIX, Routes.RESET_MM})
        ev = h.reset_prefix_cache()
        assert ev.http_status == 200 and ev.engine_success is False and ev.problems(None)
        mm = h.reset_mm_cache()
        assert mm.engine_success is False  # an empty 200 became {"success": false}
    r = httpx.post(f"{proxy.base_url}{Routes.RESET_PREFIX}", timeout=10)
    assert r.status_code == 200 and r.json() == {"success": False}
    r = httpx.post(f"{proxy.base_url}{Routes.LOAD_LORA}", timeout=10,
                   json={"lora_name": "a", "lora_path": str(tmp_path)})
    assert r.status_code == 200 and r.text.startswith("Success:")  # not JSON: as is
    assert up.loras == {"a": str(tmp_path)}
    assert httpx.get(f"{proxy.base_url}/missing", timeout=10).status_code == 404
    assert {h.kind for h in proxy.hits} == {FaultKind.ENGINE_FAILURE}


def test_unreachable_upstream_is_a_502_and_set_upstream_switches(proxy: FaultProxy) -> None:
    proxy.set_upstream(f"http://127.0.0.1:{free_port()}")
    r = httpx.get(f"{proxy.base_url}{Routes.MODELS}", timeout=10)
    assert r.status_code == 502 and "upstream failed" in r.json()["error"]["message"]


def test_stop_releases_held_requests(upstream: tuple[FakeVllm, str]) -> None:
    p = FaultProxy(upstream[1]).start()
    p.inject(Routes.RESET_PREFIX, Fault.delay(300.0))
    errors: list[BaseException] = []

    def held() -> None:
        try:
            httpx.post(f"{p.base_url}{Routes.RESET_PREFIX}", timeout=60)
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=held)
    th.start()
    p.wait_hit(Routes.RESET_PREFIX, timeout_s=10)
    t0 = time.monotonic()
    p.stop()
    th.join(20)
    assert not th.is_alive() and time.monotonic() - t0 < 10
    p.stop()  # idempotent


def test_bad_input_changes_nothing(proxy: FaultProxy) -> None:
    with pytest.raises(BadInput, match="upstream must be http"):
        FaultProxy("ftp://host")
    with pytest.raises(BadInput, match="upstream must be a string"):
        FaultProxy(8000)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="upstream must be http"):
        proxy.set_upstream("localhost:8000")
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
