"""The one HTTP translation point (``rolloutcore.engine.errors``) and its users.

Every client of vLLM (``VllmHTTP``, the transports' weight-transfer calls,
the recoverer's label write, the gateway's upstream client) must turn the
same failure into the same class of the tree. The httpx failures are raised
by ``httpx.MockTransport`` handlers (as httpx itself raises them); the
status codes and a refused connection come from real loopback sockets.
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import pytest

from rolloutcore.engine.errors import (
    is_refusal,
    map_errors,
    request,
    status_error,
    transport_error,
)
from rolloutcore.engine.process import free_port
from rolloutcore.engine.recovery import set_weight_version
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    EngineRefused,
    EngineUnavailable,
    EngineUnreachable,
    RequestRejected,
    RolloutCoreError,
)
from rolloutcore.transports.base import TransportBase


@pytest.mark.parametrize(("exc", "cls"), [
    (httpx.ConnectError("refused"), EngineUnreachable),
    (httpx.ConnectTimeout("slow"), EffectTimeout),
    (httpx.ReadTimeout("slow"), EffectTimeout),
    (httpx.PoolTimeout("full"), EffectTimeout),
    (httpx.RemoteProtocolError("Server disconnected without sending a response."),
     EngineUnavailable),
    (httpx.ReadError("reset"), EngineUnavailable),
    (httpx.DecodingError("bad gzip"), EngineUnavailable),
])
def test_each_httpx_failure_becomes_its_class(exc: Exception, cls: type[EffectError]) -> None:
    def handler(_: httpx.Request) -> httpx.Response:
        raise exc

    with httpx.Client(transport=httpx.MockTransport(handler)) as client, \
            pytest.raises(cls) as ei:
        request("POST", "http://engine.test/pause", step="pause", timeout_s=3, client=client)
    err = ei.value
    assert type(err) is cls and err.__cause__ is exc and err.step == "pause"
    assert err.mutation_started is True  # the boundary never claims the weights are untouched
    assert "POST /pause" in str(err)
    if cls is EffectTimeout:
        assert isinstance(err, EffectTimeout) and err.deadline_s == 3


def test_socket_errors_map_like_httpx_ones() -> None:
    """The gateway's client meets the socket's errors: the same mapping, the same classes."""
    refused = transport_error(ConnectionRefusedError(111, "refused"), "upstream", "connect",
                              timeout_s=1, connecting=True)
    assert type(refused) is EngineUnreachable and is_refusal(refused)
    reset = transport_error(ConnectionResetError(104, "reset"), "upstream", "read", timeout_s=1)
    assert type(reset) is EngineUnavailable and not is_refusal(reset)
    late = transport_error(TimeoutError(), "upstream", "connect", timeout_s=2, connecting=True)
    assert isinstance(late, EffectTimeout) and late.deadline_s == 2 and not is_refusal(late)


def test_a_cancelled_request_is_its_steps_timeout() -> None:
    exc = httpx.ReadError("shut down")
    with pytest.raises(EffectTimeout, match="cancelled by its watchdog") as ei, \
            map_errors("is_paused", "GET /is_paused", timeout_s=30, cancelled=lambda: True):
        raise exc
    assert ei.value.__cause__ is exc and ei.value.deadline_s < 30
    # Not cancelled: the engine broke the connection.
    with pytest.raises(EngineUnavailable), \
            map_errors("is_paused", "GET /is_paused", timeout_s=30, cancelled=lambda: False):
        raise exc
    # Anything that is not a transport failure is not the boundary's to translate.
    with pytest.raises(KeyError), map_errors("x", "GET /x", timeout_s=1):
        raise KeyError("mine")


@pytest.mark.parametrize(("status", "offered", "cls"), [
    (500, True, EngineUnavailable), (503, True, EngineUnavailable),
    (400, True, RequestRejected), (409, True, RequestRejected), (422, True, RequestRejected),
    (404, True, RequestRejected), (404, False, EngineRefused), (405, False, EngineRefused),
    (403, True, EngineRefused), (307, True, EngineUnavailable),
])
def test_status_codes(status: int, offered: bool, cls: type[EffectError]) -> None:
    err = status_error("s", "POST /x", status, " body " * 100, offered=offered)
    assert type(err) is cls and getattr(err, "status", None) == status
    assert len(str(err)) < 400  # the body is quoted, not dumped
    assert isinstance(err, BadInput) is (cls is RequestRejected)  # only our request's fault
    assert is_refusal(err) is (400 <= status < 500)
    assert status_error("s", "GET /x", 200, "") is None
    assert status_error("s", "GET /x", 204, "") is None


class _Engine(http.server.BaseHTTPRequestHandler):
    """A loopback stand-in for vLLM's weight-transfer and label routes."""

    protocol_version = "HTTP/1.1"
    answers: ClassVar[dict[str, tuple[int, Any]]] = {}
    seen: ClassVar[list[tuple[str, Any]]] = []

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(n)) if n else None
        self.seen.append((self.path, body))
        status, out = self.answers.get(self.path, (404, {"detail": "Not Found"}))
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture()
def engine() -> Iterator[str]:
    _Engine.answers = {"/start_weight_update": (409, {"detail": "an update is running"}),
                       "/finish_weight_update": (500, {"detail": "boom"}),
                       "/get_world_size": (200, {"world_size": 1}),
                       "/update_weight_version": (200, {})}
    _Engine.seen = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    srv.daemon_threads = True
    # polled every 10 ms, not 0.5 s: ``shutdown`` waits for the loop to see it
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01},
                     daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()


def test_the_transports_calls_go_through_the_same_mapping(engine: str) -> None:
    assert TransportBase.get(engine, "/get_world_size", 5) == {"world_size": 1}
    with pytest.raises(RequestRejected, match="an update is running") as ei:
        TransportBase.post(engine, "/start_weight_update", None, 5)
    assert is_refusal(ei.value) and ei.value.step == "start_weight_update"
    with pytest.raises(EngineUnavailable, match="boom") as ei2:
        TransportBase.post(engine, "/finish_weight_update", {"weight_version": "rc-1"}, 5)
    assert not is_refusal(ei2.value) and ei2.value.status == 500
    with pytest.raises(EngineUnreachable) as ei3:
        TransportBase.post(f"http://127.0.0.1:{free_port()}", "/start_weight_update", None, 5)
    assert is_refusal(ei3.value)


def test_the_recoverers_label_write_goes_through_the_same_mapping(engine: str) -> None:
    set_weight_version(engine, "rc-7", timeout_s=5)
    assert _Engine.seen[-1] == ("/update_weight_version", {"new_version": "rc-7"})
    n = len(_Engine.seen)
    with pytest.raises(BadInput):
        set_weight_version(engine, "has space", timeout_s=5)
    assert len(_Engine.seen) == n  # refused before anything was sent
    _Engine.answers["/update_weight_version"] = (500, {"detail": "no"})
    with pytest.raises(EngineUnavailable, match="update_weight_version"):
        set_weight_version(engine, "rc-8", timeout_s=5)
    with pytest.raises(EngineUnreachable):
        set_weight_version(f"http://127.0.0.1:{free_port()}", "rc-8", timeout_s=5)


def test_every_class_the_mapping_makes_is_in_the_tree() -> None:
    made = [status_error("s", "GET /x", s, "") for s in (307, 403, 404, 500)]
    made += [transport_error(e, "s", "GET /x", timeout_s=1)
             for e in (httpx.ConnectError("x"), httpx.ReadTimeout("x"), OSError("x"))]
    assert all(isinstance(e, RolloutCoreError) for e in made)
