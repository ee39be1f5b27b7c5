"""``serve --upstream`` on an engine started behind RolloutCore's guard: given the same
route key in its environment, the gateway holds it as a launcher does (its calls carry
it, it pauses through the guard's fast pause), and a key the engine does not take, or
an engine with no guard, is refused at start with nothing held.

The guard is vLLM's own middleware around a stand-in app that answers 404 to routes it
does not have, as vLLM does, served on a real socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from helpers.gateway_rig import uvicorn_thread
from rolloutcore.errors import BadInput
from rolloutcore.service.serve import upstream_route_key
from rolloutcore.transports import engine_key
from rolloutcore.transports.engine_key import RouteGuard

OWN = engine_key.new_key()


async def _vllm_like(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 404,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b'{"detail": "Not Found"}'})


@pytest.fixture
def guarded(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setenv(engine_key.ENV, OWN)
    with uvicorn_thread(RouteGuard(_vllm_like), lifespan="off") as url:
        try:
            yield url
        finally:
            engine_key.forget(url)


def test_the_engines_own_key_is_held_as_a_launchers(guarded: str) -> None:
    assert upstream_route_key(guarded) is True
    assert engine_key.headers_for(guarded) == {engine_key.HEADER: OWN}
    assert engine_key.owns(guarded)  # lends a key for a lease, pauses through FAST_PAUSE


def test_a_key_the_engine_does_not_take_is_refused_and_nothing_is_held(
        guarded: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_key.ENV, engine_key.new_key())
    with pytest.raises(BadInput, match="does not take it as its route key"):
        upstream_route_key(guarded)
    assert engine_key.headers_for(guarded) == {}
    assert not engine_key.owns(guarded)


def test_an_engine_with_no_guard_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_key.ENV, OWN)
    with uvicorn_thread(_vllm_like, lifespan="off") as url:
        with pytest.raises(BadInput, match="answered 404 without the key"):
            upstream_route_key(url)
        assert engine_key.headers_for(url) == {}


def test_a_malformed_key_is_refused_before_any_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_key.ENV, "short")
    with pytest.raises(BadInput, match=engine_key.ENV):
        upstream_route_key("http://127.0.0.1:1")
    assert engine_key.headers_for("http://127.0.0.1:1") == {}


def test_no_key_in_the_environment_holds_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(engine_key.ENV, raising=False)
    assert upstream_route_key("http://127.0.0.1:1") is False
    assert engine_key.headers_for("http://127.0.0.1:1") == {}


def test_an_engine_that_cannot_be_reached_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(engine_key.ENV, OWN)
    with pytest.raises(BadInput, match="does not take it as its route key"):
        upstream_route_key("http://127.0.0.1:1")
    assert engine_key.headers_for("http://127.0.0.1:1") == {}
