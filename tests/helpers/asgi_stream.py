"""An httpx transport into an ASGI app that really streams (httpx's own buffers).

``httpx.ASGITransport`` runs the app to completion and hands back the whole
body, so a client can neither read a stream as it is produced nor go away in
the middle of it. This transport runs the app in a task and hands each body
chunk over as it is sent; closing the response early is a client disconnect
(the app's ``receive`` answers ``http.disconnect``, as uvicorn's does), and an
app that fails after its response started is a dropped connection
(``httpx.ReadError``), as it would be over a socket.

Also: ``lifespan(app)`` runs an app's lifespan around a block (httpx's
transports do not).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, MutableMapping
from typing import Any

import httpx


class _Body(httpx.AsyncByteStream):
    def __init__(self, queue: asyncio.Queue[tuple[Any, ...]], gone: asyncio.Event,
                 task: asyncio.Task[None]) -> None:
        self._q = queue
        self._gone = gone
        self._task = task

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while True:
            item = await self._q.get()
            if item[0] == "body":
                if item[1]:
                    yield item[1]
                if not item[2]:
                    return
            elif item[0] == "error":
                raise httpx.ReadError(f"connection dropped: {item[1]!r}")
            else:
                raise httpx.RemoteProtocolError("peer closed the response before its end")

    async def aclose(self) -> None:
        self._gone.set()


class StreamingASGITransport(httpx.AsyncBaseTransport):
    def __init__(self, app: Any, client: tuple[str, int] = ("127.0.0.1", 50000)) -> None:
        self.app = app
        self.client = client
        self.tasks: set[asyncio.Task[None]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([c async for c in request.stream])  # type: ignore[union-attr]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": request.url.scheme, "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "server": (request.url.host, request.url.port),
            "client": self.client, "root_path": "",
        }
        q: asyncio.Queue[tuple[Any, ...]] = asyncio.Queue()
        gone = asyncio.Event()
        state = {"sent_request": False, "complete": False}

        async def receive() -> dict[str, Any]:
            if not state["sent_request"]:
                state["sent_request"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: MutableMapping[str, Any]) -> None:
            if gone.is_set() or state["complete"]:
                return  # like uvicorn: writes to a closed connection are dropped
            if msg["type"] == "http.response.start":
                await q.put(("start", msg["status"], msg.get("headers", [])))
            elif msg["type"] == "http.response.body":
                more = msg.get("more_body", False)
                await q.put(("body", msg.get("body", b""), more))
                if not more:
                    state["complete"] = True
                    gone.set()

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as exc:
                await q.put(("error", exc))
            finally:
                await q.put(("end",))

        task = asyncio.get_running_loop().create_task(run())
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        first = await q.get()
        if first[0] != "start":
            gone.set()
            if first[0] == "error":
                raise httpx.ReadError(f"app failed before answering: {first[1]!r}")
            raise httpx.RemoteProtocolError("app ended without answering")
        return httpx.Response(first[1], headers=first[2], stream=_Body(q, gone, task),
                              request=request)

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Wait for the app tasks this transport started to end."""
        if self.tasks:
            await asyncio.wait_for(asyncio.gather(*self.tasks, return_exceptions=True),
                                   timeout_s)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    async with app.router.lifespan_context(app):
        yield
