"""The trainer protocol's adapter routes: publish a LoRA-adapter version through the gateway.

``POST /control/adapters`` (control token) with ``{"adapter_dir": str,
"provenance": {"checkpoint": str, "trainer_run": str, "step": int}}``: the
gateway reads the adapter directory (the trainer saved it where the gateway
can read it: the same machine or a shared filesystem), checks and digests it,
computes its reference from the base checkpoint it serves and runs the
verified adapter update (``control.adapters.AdapterManager.update``).
``base_dir`` (optional): the base checkpoint the engine serves now, after a
full update of the base (the references' base; without it an adapter update
after a full update is refused, 409). The answer: 200 with the published
version, its checks and phases; 400 for a bad body or a bad adapter
(nothing changed); 409 when the update was refused (nothing changed) or
failed (the previous adapter serves: ``classification`` says whether the
failed version was unloaded). ``GET /control/adapters``: the
current adapter and every version's state and bound requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, UpdateFailed, UpdateRefused

__all__ = ["adapter_base_dir", "adapter_probe_tolerance", "adapter_routes",
           "parse_adapter_body"]


def parse_adapter_body(body: object) -> tuple[Path, Provenance]:
    """The body of ``POST /control/adapters``; ``BadInput`` naming the field otherwise."""
    if not isinstance(body, dict) or set(body) - {"base_dir", "probe_tolerance"} != {
            "adapter_dir", "provenance"}:
        raise BadInput("body: needs exactly 'adapter_dir' and 'provenance' (and optional "
                       "'base_dir', 'probe_tolerance')")
    adapter_base_dir(body)
    adapter_probe_tolerance(body)
    d = body["adapter_dir"]
    if not isinstance(d, str) or not d or len(d) > 4096:
        raise BadInput("adapter_dir: a path of 1..4096 characters")
    p = body["provenance"]
    if not isinstance(p, dict) or not set(p) <= {"checkpoint", "trainer_run", "step"} \
            or "checkpoint" not in p:
        raise BadInput("provenance: an object with 'checkpoint' (and optional "
                       "'trainer_run', 'step')")
    step = p.get("step", 0)
    if isinstance(step, bool) or not isinstance(step, int):
        raise BadInput("provenance.step: an int >= 0")
    return Path(d), Provenance(p["checkpoint"], p.get("trainer_run", ""), step)


def adapter_probe_tolerance(body: dict[str, Any]) -> float | None:
    """The body's optional ``probe_tolerance`` (nats): the trainer's tolerance of the probe
    through the adapter, as it declares a full update's, at most ``MAX_TOLERANCE``."""
    from rolloutcore.control.adapters import check_probe_tolerance

    v = body.get("probe_tolerance")
    return None if v is None else check_probe_tolerance(v, 0.0)


def adapter_base_dir(body: dict[str, Any]) -> Path | None:
    """The body's optional ``base_dir``: the base checkpoint the engine serves now (after a
    full update of the base), for the references; ``BadInput`` when it is not one."""
    b = body.get("base_dir")
    if b is None:
        return None
    if not isinstance(b, str) or not b or len(b) > 4096 or \
            not (Path(b) / "config.json").is_file():
        raise BadInput("base_dir: a checkpoint directory (with config.json) of 1..4096 "
                       "characters")
    return Path(b)


def adapter_routes(adapters: Any, denied: Callable[[Request], Response | None],
                   json_body: Callable[[Request], Awaitable[Any]], *,
                   status: Callable[[], dict[str, Any]] | None = None) -> list[Route]:
    """The two routes, over ``adapters``: an ``AdapterManager`` (one engine) or a fleet's
    ``FleetAdapters`` (both have ``set_base`` and ``update``). ``status``: the GET
    route's answer (default: ``adapters.view``'s current version, states and bound
    requests). A failed update answers 409 with the exception's ``to_dict()`` where it
    has one (a fleet's: each replica's outcome), else its phase and classification."""
    import json

    def view_of() -> dict[str, Any]:
        v = adapters.view
        return {"current": None if v.current is None else v.current.to_dict(),
                "states": {k: s.value for k, s in v.states.items()},
                "bound": dict(v.bound)}

    answer = status or view_of

    async def publish(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        raw = await json_body(request)
        if isinstance(raw, Response):
            return raw
        try:
            body = json.loads(raw) if isinstance(raw, (bytes, str)) else raw
            adapter_dir, prov = parse_adapter_body(body)
            base_dir = adapter_base_dir(body)
            tol = adapter_probe_tolerance(body)
        except (ValueError, RecursionError) as exc:   # BadInput and bad JSON alike
            return JSONResponse({"error": str(exc)}, status_code=400)

        def run() -> Any:
            if base_dir is not None:
                adapters.set_base(base_dir)
            return adapters.update(adapter_dir, prov, probe_tolerance=tol)

        try:
            res = await anyio.to_thread.run_sync(run)
        except BadInput as exc:
            return JSONResponse({"error": str(exc)}, status_code=400)
        except UpdateRefused as exc:
            return JSONResponse({"error": str(exc), "refused": True}, status_code=409)
        except UpdateFailed as exc:
            to_dict = getattr(exc, "to_dict", None)
            return JSONResponse(to_dict() if callable(to_dict) else {
                "error": str(exc), "phase": exc.phase, "classification": exc.classification},
                status_code=409)
        return JSONResponse(res.to_dict())

    async def view(request: Request) -> Response:
        if (r := denied(request)) is not None:
            return r
        return JSONResponse(answer())

    return [Route("/control/adapters", publish, methods=["POST"]),
            Route("/control/adapters", view, methods=["GET"])]
