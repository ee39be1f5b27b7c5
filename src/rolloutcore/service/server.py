"""The gateway's HTTP server settings under uvicorn: what the ASGI app cannot bound itself.

A client that opens a connection and sends its request line and headers
slowly, or never, never reaches the app: uvicorn (0.54) bounds the idle time
*between* requests (``timeout_keep_alive``) but not the time a request takes
to arrive, so a few thousand such connections hold the gateway's sockets and
memory for ever. ``http_protocol(header_s, send_s)`` is uvicorn's own
httptools protocol with two more deadlines:

* from the connection's first byte (or the end of the previous answer's
  keep-alive wait) to the end of the headers, ``header_s`` at most; past it
  the client gets a 408 and the connection is closed;
* a connection whose peer has stopped reading (the transport asked us to
  pause writing) for ``send_s`` is aborted. The app cannot do this: ASGI
  has no way to drop a connection, and a closing transport waits for its
  buffer to drain, which a peer that never reads never lets happen. Without
  it, an answer the app handed over whole (a non-streamed one: uvicorn
  takes it in one write and the handler ends) would sit in the server's
  memory for as long as the client lived.

The body has its own deadline in the app (``client_body_s``), and so does a
send the app waits on (``client_send_s``; the same value is given here).

Used by ``rolloutcore serve``: ``uvicorn.run(app, http=http_protocol(h, s))``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rolloutcore.errors import BadInput

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from rolloutcore.service.config import ServiceConfig

__all__ = ["HeaderDeadlineProtocol", "http_protocol", "run_until_signalled"]

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: 27\r\nconnection: close\r\n\r\nrequest headers too slow.\r\n")


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """httptools' protocol: headers due within ``header_s``; a peer that stops
    reading for ``send_s`` is dropped."""

    header_s: float = 10.0
    send_s: float = 30.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.send_s, self._not_reading)

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _not_reading(self) -> None:
        """The peer took nothing for ``send_s``: drop the connection and its buffer."""
        self._write_timer = None
        self.transport.abort()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_s, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _too_slow(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.write(_408)
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # Between requests the keep-alive deadline applies instead (uvicorn's).
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)


def http_protocol(header_s: float, send_s: float = 30.0) -> type[HeaderDeadlineProtocol]:
    """uvicorn's ``http=`` argument: the protocol class with these deadlines."""
    for name, v in (("header_s", header_s), ("send_s", send_s)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or \
                not 0 < v < float("inf"):
            raise BadInput(f"{name} must be a positive number of seconds, got {v!r}")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                {"header_s": float(header_s), "send_s": float(send_s)})


def run_until_signalled(app: Starlette, host: str, port: int, config: ServiceConfig,
                        on_signal: Callable[[int, FrameType | None], None], *,
                        token: str, token_given: bool, token_out: str | None,
                        banner: str) -> None:
    """Serve ``app`` under uvicorn until SIGTERM/SIGINT, as every gateway does.

    First the control token goes to ``token_out`` (0600, never through a
    link), and the banner (and a generated token) to stderr.

    uvicorn re-raises the signal that stopped it once it has shut down; with
    the default SIGTERM disposition that would kill the process before its
    engines are stopped, so ``on_signal`` (``SystemExit``) is installed first
    and the caller's cleanup runs. The data path's per-request CPU is the
    gateway's added latency (docs/service.md, "What the gateway costs"): no
    access log (uvicorn formats its arguments even when INFO is filtered out)
    and no X-Forwarded-* rewriting (nothing here reads the client address).
    Everything allocated so far (modules, app, identity) is moved out of the
    collector's reach, so a full collection scans only what requests leave
    behind.
    """
    import gc
    import signal
    import sys

    import uvicorn

    from rolloutcore.service.auth import write_token_file

    if token_out:
        write_token_file(token_out, token)
    print(f"[rolloutcore] {banner}", file=sys.stderr)
    if not token_given:
        print(f"[rolloutcore] control token (generated): {token}", file=sys.stderr)
    sys.stderr.flush()
    signal.signal(signal.SIGTERM, on_signal)
    gc.collect()
    gc.freeze()
    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False,
                proxy_headers=False, timeout_graceful_shutdown=10,
                http=http_protocol(config.client_header_s, config.client_send_s))
