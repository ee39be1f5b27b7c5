"""A control route's request body: bounded in size and in time, JSON as the standard has it.

One reader for every control route of every gateway (one engine's trainer
protocol, a fleet's update route): ``Content-Type: application/json`` (else
415), at most ``max_body_bytes`` (413), all of it within ``client_body_s``
(408), and, for ``control_json``, a JSON object nested at most
``max_json_depth`` deep without ``NaN``/``Infinity`` (400). A body refused
here reaches nothing.
"""

from __future__ import annotations

from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rolloutcore.errors import RequestTooLarge
from rolloutcore.service.config import ServiceConfig
from rolloutcore.service.wire import validate_request

__all__ = ["control_body", "control_json"]


async def _read(request: Request, limit: int) -> bytes:
    cl = request.headers.get("content-length")
    if cl is not None:
        try:
            declared = int(cl)
        except ValueError:
            raise RequestTooLarge(f"Content-Length {cl!r} is not an integer") from None
        if declared > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise RequestTooLarge(f"request body exceeds {limit} bytes")
    return bytes(buf)


async def control_body(request: Request, config: ServiceConfig) -> bytes | Response:
    """The body's bytes, or the answer that refuses it (415, 413, 408)."""
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        return JSONResponse({"error": "Content-Type must be application/json"},
                            status_code=415)
    try:
        with anyio.fail_after(config.client_body_s):
            return await _read(request, config.max_body_bytes)
    except RequestTooLarge:
        return JSONResponse({"error": f"request body exceeds {config.max_body_bytes} bytes"},
                            status_code=413)
    except TimeoutError:
        return JSONResponse({"error": f"the request body did not arrive within "
                                      f"{config.client_body_s:g}s"}, status_code=408)


async def control_json(request: Request, config: ServiceConfig) -> dict[str, Any] | Response:
    """The body as a JSON object, or the answer that refuses it (415, 413, 408, 400)."""
    raw = await control_body(request, config)
    if isinstance(raw, Response):
        return raw
    problem, payload = validate_request(raw, config.max_json_depth)
    if problem:
        return JSONResponse({"error": problem}, status_code=400)
    return payload
