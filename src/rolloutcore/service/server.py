"""The gateway's HTTP server settings under uvicorn: what the ASGI app cannot bound itself.

A client that opens a connection and sends its request line and headers
slowly, or never, never reaches the app: uvicorn (0.54) bounds the idle time
*between* requests (``timeout_keep_alive``) but not the time a request takes
to arrive, so a few thousand such connections hold the gateway's sockets and
memory for ever. ``http_protocol(header_s)`` is uvicorn's own httptools
protocol with one more deadline: from the connection's first byte (or the
end of the previous answer's keep-alive wait) to the end of the headers,
``header_s`` at most; past it the client gets a 408 and the connection is
closed. The body has its own deadline in the app (``client_body_s``), so
does the reading of the answer (``client_send_s``).

Used by ``rolloutcore serve``: ``uvicorn.run(app, http=http_protocol(s))``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from rolloutcore.errors import BadInput

__all__ = ["HeaderDeadlineProtocol", "http_protocol"]

_408 = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: 27\r\nconnection: close\r\n\r\nrequest headers too slow.\r\n")


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """httptools' protocol, with the request's headers due within ``header_s``."""

    header_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

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
        super().connection_lost(exc)


def http_protocol(header_s: float) -> type[HeaderDeadlineProtocol]:
    """uvicorn's ``http=`` argument: the protocol class with this header deadline."""
    if isinstance(header_s, bool) or not isinstance(header_s, (int, float)) or \
            not 0 < header_s < float("inf"):
        raise BadInput(f"header_s must be a positive number of seconds, got {header_s!r}")
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,),
                {"header_s": float(header_s)})
