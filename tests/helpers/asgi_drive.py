"""Drive an ASGI app as a hostile client would: a body that never ends, a reader that stops.

httpx's transports always take a whole body and read every byte, so they
cannot be the client that holds the gateway hostage. ``Drive`` calls the app
itself, as uvicorn would, with a ``receive`` that can hold the body back
(``body_parts``: the last part is followed by silence when ``stall_body``)
and a ``send`` that blocks for ever once ``block_after`` body messages went
out (a socket whose peer stopped reading: uvicorn's ``send`` then waits on
the transport's flow control). Every message the app sent is kept.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from typing import Any


class Drive:
    def __init__(self, app: Any, path: str, body: Any, *, headers: dict[str, str] | None = None,
                 block_after: int | None = None, stall_body: bool = False,
                 body_parts: int = 1) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.app, self.path = app, path
        hdrs = {"content-type": "application/json", "content-length": str(len(raw)),
                **(headers or {})}
        if stall_body:
            hdrs.pop("content-length")
        self.headers = [(k.lower().encode(), v.encode("latin-1")) for k, v in hdrs.items()]
        step = max(1, len(raw) // body_parts)
        self.parts = [raw[i:i + step] for i in range(0, len(raw), step)] or [b""]
        self.stall_body = stall_body
        self.block_after = block_after
        self.sent: list[MutableMapping[str, Any]] = []
        self.blocked = asyncio.Event()   # a send is stuck (the client "stopped reading")
        self.gone = asyncio.Event()      # set to make receive() answer http.disconnect
        self.task: asyncio.Task[None] | None = None
        self._bodies = 0

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                "method": "POST", "scheme": "http", "path": self.path,
                "raw_path": self.path.encode(), "query_string": b"", "root_path": "",
                "headers": self.headers, "client": ("127.0.0.1", 40000),
                "server": ("gateway.test", 80)}

    async def receive(self) -> dict[str, Any]:
        if self.parts:
            part = self.parts.pop(0)
            more = bool(self.parts) or self.stall_body
            return {"type": "http.request", "body": part, "more_body": more}
        await self.gone.wait()  # a stalled body, or the rest of the exchange
        return {"type": "http.disconnect"}

    async def send(self, msg: MutableMapping[str, Any]) -> None:
        if msg["type"] == "http.response.body":
            if self.block_after is not None and self._bodies >= self.block_after:
                self.blocked.set()
                await asyncio.Event().wait()  # never: the peer does not read
            self._bodies += 1
        self.sent.append(msg)

    def start(self) -> asyncio.Task[None]:
        self.task = asyncio.get_running_loop().create_task(
            self.app(self.scope(), self.receive, self.send))
        return self.task

    @property
    def status(self) -> int | None:
        for m in self.sent:
            if m["type"] == "http.response.start":
                return int(m["status"])
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent
                        if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body", False)
                   for m in self.sent)
