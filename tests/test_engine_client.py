"""``engine.client``: the sync and async twins, one method set, one exception map."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from rolloutcore.engine.client import AsyncEngineClient, EngineClient
from rolloutcore.errors import EffectTimeout, EngineUnavailable, EngineUnreachable, RequestRejected


def _handler(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/ok":
        return httpx.Response(200, json={"path": request.url.path})
    if request.url.path == "/bad":
        return httpx.Response(400, text="no")
    if request.url.path == "/down":
        return httpx.Response(503, text="paused")
    if request.url.path == "/slow":
        raise httpx.ReadTimeout("slow", request=request)
    if request.url.path == "/stream":
        return httpx.Response(200, content=b"a\nb\n")
    raise httpx.ConnectError("refused", request=request)


def test_both_twins_have_the_same_method_set() -> None:
    def public(cls: type) -> set[str]:
        return {n for n in vars(cls) if not n.startswith("_")} - {"aclose"}
    assert public(EngineClient) == public(AsyncEngineClient)


@pytest.mark.parametrize(("path", "exc"), [("/bad", RequestRejected), ("/down", EngineUnavailable),
                                           ("/slow", EffectTimeout),
                                           ("/gone", EngineUnreachable)])
def test_sync_and_async_map_failures_alike(path: str, exc: type[Exception]) -> None:
    with EngineClient("http://e", transport=httpx.MockTransport(_handler)) as c, \
            pytest.raises(exc) as got:
        c.request("GET", path, step="probe")
    assert got.value.__cause__ is None or isinstance(got.value.__cause__, httpx.HTTPError)

    async def go() -> None:
        async with AsyncEngineClient("http://e", transport=httpx.MockTransport(_handler)) as a:
            with pytest.raises(exc):
                await a.request("GET", path, step="probe")
    asyncio.run(go())


def test_a_success_and_an_unchecked_answer_come_back_as_they_are() -> None:
    with EngineClient("http://e", transport=httpx.MockTransport(_handler)) as c:
        assert c.request("GET", "/ok", step="probe").json() == {"path": "/ok"}
        assert c.request("GET", "/down", step="probe", check_status=False).status_code == 503
        with c.stream("GET", "/stream", step="gen") as r:
            assert list(r.iter_lines()) == ["a", "b"]

    async def go() -> list[str]:
        async with AsyncEngineClient("http://e", transport=httpx.MockTransport(_handler)) as a, \
                a.stream("GET", "/stream", step="gen") as r:
            return [line async for line in r.aiter_lines()]
    assert asyncio.run(go()) == ["a", "b"]


def test_a_stream_that_cannot_open_fails_in_the_tree() -> None:
    with EngineClient("http://e", transport=httpx.MockTransport(_handler)) as c, \
            pytest.raises(EngineUnreachable), c.stream("GET", "/gone", step="gen"):
        pass


def test_vllm_http_has_the_lora_capability() -> None:
    """The adapter manager takes a ``LoraCapability``: list, load, unload, score, top logprobs."""
    from rolloutcore.control.port import LoraCapability
    from rolloutcore.engine.http import VllmHTTP

    http = VllmHTTP("http://127.0.0.1:9", transport=httpx.MockTransport(_handler))
    try:
        assert isinstance(http, LoraCapability)
    finally:
        http.close()
    methods = {"models", "load_lora_adapter", "unload_lora_adapter", "score", "top_logprobs"}
    assert methods <= {n for n in vars(LoraCapability) if not n.startswith("_")}
    assert not isinstance(object(), LoraCapability)


def test_every_client_of_the_process_shares_one_tls_context(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """httpx loads the CA bundle into a new TLS context per client (~30 ms); a lent key's
    lend and take-back and every transport call built one on an update's critical path.
    Clients, async clients and one-off requests now share one context."""
    import ssl

    from rolloutcore.engine import errors

    real = ssl.create_default_context
    made: list[int] = []

    def counting(*a: object, **k: object) -> ssl.SSLContext:
        made.append(1)
        return real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl, "create_default_context", counting)
    errors.tls_context.cache_clear()
    try:
        for _ in range(3):
            EngineClient("http://127.0.0.1:1").close()
            asyncio.run(AsyncEngineClient("http://127.0.0.1:1").aclose())
            with pytest.raises(EngineUnreachable):
                errors.request("GET", "http://127.0.0.1:1/health", step="probe", timeout_s=2.0)
        assert len(made) == 1
    finally:
        errors.tls_context.cache_clear()
