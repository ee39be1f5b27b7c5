"""``rolloutcore serve --engines N`` / ``--ray``: a fleet of vLLM engines behind one gateway.

The engines are started here (local processes, or Ray actors through a
placement group), each taken over by its own controller, bootstrapped into
fleet version 0 on the checkpoint they were started from, and put behind the
fleet gateway (``fleet.gateway``). Updates come through the control route
``POST /control/fleet/updates`` with a checkpoint directory the gateway can
read (``{"checkpoint": ..., "strategy": "synchronous"|"rolling", ...}``);
the coordinator then moves every engine (one fan-out broadcast for a
synchronous update, per-engine waves for a rolling one).

As for one engine, everything that can be refused is refused before
anything starts: a bad option, a non-loopback bind without a given token,
a missing checkpoint.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutcore.core.pool import Strategy
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput
from rolloutcore.fleet.coordinator import TRANSFERS, FleetConfig, FleetCoordinator
from rolloutcore.fleet.routing import Policy
from rolloutcore.service.auth import generate_token, read_token_file
from rolloutcore.service.config import ServiceConfig, check_bind

__all__ = ["FleetServeOptions", "parse_update_request", "run_fleet_serve"]


@dataclass(frozen=True)
class FleetServeOptions:
    engines: int = 2
    ray: bool = False
    ray_address: str | None = None
    model: str | None = None
    step: int = 0
    workdir: str | None = None
    host: str = "127.0.0.1"
    port: int = 8100
    token: str | None = None
    token_file: str | None = None
    token_out: str | None = None
    data_token: str | None = None
    default_policy: str = "latest"
    quorum: int | None = None
    min_serving: int | None = None
    queue: int = 0
    queue_wait_s: float = 30.0
    health_interval_s: float = 1.0
    journal_dir: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.engines, bool) or not isinstance(self.engines, int) or \
                not 1 <= self.engines <= 512:
            raise BadInput(f"engines must be an int in 1..512, got {self.engines!r}")
        Policy.parse(self.default_policy)   # a RouteRefused (BadInput) when unknown
        if self.quorum is not None and not 1 <= self.quorum <= self.engines:
            raise BadInput(f"quorum must be in 1..{self.engines}, got {self.quorum}")
        if self.min_serving is not None and not 0 <= self.min_serving < self.engines:
            raise BadInput(f"min_serving must be in 0..{self.engines - 1}, "
                           f"got {self.min_serving}")
        if not 0 < self.port < 65536:
            raise BadInput(f"port must be in 1..65535, got {self.port}")


_UPDATE_KEYS = frozenset({"checkpoint", "strategy", "label", "quorum", "min_serving",
                          "wave_size", "transfer", "step", "trainer_run", "owner"})


def parse_update_request(body: Mapping[str, Any]) -> dict[str, Any]:
    """A control-route body checked field by field (``BadInput`` names the first bad one)."""
    unknown = sorted(set(body) - _UPDATE_KEYS)
    if unknown:
        raise BadInput(f"unknown fields {unknown}; known: {sorted(_UPDATE_KEYS)}")
    ckpt = body.get("checkpoint")
    if not isinstance(ckpt, str) or not (Path(ckpt) / "config.json").is_file():
        raise BadInput("'checkpoint' must name a model directory the gateway can read")
    out: dict[str, Any] = {"checkpoint": ckpt}
    try:
        out["strategy"] = Strategy(body.get("strategy", "synchronous"))
    except ValueError:
        raise BadInput(f"'strategy' must be one of {[s.value for s in Strategy]}") from None
    for k in ("quorum", "min_serving", "wave_size", "step"):
        v = body.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise BadInput(f"'{k}' must be an integer >= 0")
        out[k] = v
    for k in ("label", "trainer_run", "owner"):
        v = body.get(k)
        if v is not None and not isinstance(v, str):
            raise BadInput(f"'{k}' must be a string")
        out[k] = v
    tr = body.get("transfer")
    if tr is not None and tr not in TRANSFERS:
        raise BadInput(f"'transfer' must be one of {list(TRANSFERS)}")
    out["transfer"] = tr
    return out


def _token(o: FleetServeOptions) -> tuple[str, bool]:
    if o.token and o.token_file:
        raise BadInput("give --token or --token-file, not both")
    if o.token:
        return o.token, True
    if o.token_file:
        return read_token_file(o.token_file), True
    env = os.environ.get("ROLLOUTCORE_TOKEN")
    if env:
        return env.strip(), True
    return generate_token(), False


def _exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_fleet_serve(o: FleetServeOptions) -> int:
    """Start the engines, the coordinator and the gateway; block until interrupted."""
    if not isinstance(o, FleetServeOptions):
        raise BadInput("run_fleet_serve takes FleetServeOptions")
    token, given = _token(o)
    check_bind(o.host, given)
    cfg = ServiceConfig(upstream_url="http://127.0.0.1:1", control_token=token,
                        data_token=o.data_token, queue_max=o.queue, queue_wait_s=o.queue_wait_s,
                        health_interval_s=0)
    if o.model is not None and not (Path(o.model) / "config.json").is_file():
        raise BadInput(f"{o.model} is not a model directory (no config.json)")
    import uvicorn

    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.fleet.placement import (
        build_fleet,
        launch_local,
        place_ray,
        prepare_checkpoint,
    )

    workdir = Path(o.workdir or tempfile.mkdtemp(prefix="rolloutcore-fleet-"))
    if o.model is not None:
        model_dir = Path(o.model)
    else:
        from rolloutcore.testing.models import make_checkpoint

        model_dir = make_checkpoint(workdir / "policy-0", seed=0)
        print(f"[rolloutcore] generated a tiny checkpoint at {model_dir}", file=sys.stderr)
    where = "Ray actors" if o.ray else "local processes"
    print(f"[rolloutcore] starting {o.engines} vLLM engines as {where} on {model_dir}",
          file=sys.stderr)
    engines: list[Any] = []
    placement: Any = None
    coord: FleetCoordinator | None = None
    try:
        if o.ray:
            placement = place_ray(o.engines, model_dir, address=o.ray_address, progress=True,
                                  log_dir=workdir / "logs")
            engines = list(placement.engines)
        else:
            engines = launch_local(o.engines, model_dir, log_dir=workdir / "logs",
                                   progress=True)
        coord = build_fleet(engines, checkpoint=model_dir,
                            provenance=Provenance(str(model_dir.resolve()), "", o.step),
                            config=FleetConfig(quorum=o.quorum, min_serving=o.min_serving,
                                               health_interval_s=o.health_interval_s),
                            journal_dir=o.journal_dir or workdir / "journals", journal_keep=256)
        fleet = coord

        def updater(body: Mapping[str, Any]) -> Any:
            req = parse_update_request(body)
            ck = req["checkpoint"]
            weights = prepare_checkpoint(ck, Provenance(str(Path(ck).resolve()),
                                                        req["trainer_run"] or "",
                                                        req["step"] or 0))
            return fleet.update(weights, strategy=req["strategy"], label=req["label"],
                                owner=req["owner"] or "trainer", quorum=req["quorum"],
                                min_serving=req["min_serving"], wave_size=req["wave_size"],
                                transfer=req["transfer"])

        app = create_fleet_app(coord, cfg, default_policy=o.default_policy, updater=updater,
                               check_update=parse_update_request)
        if o.token_out:
            fd = os.open(o.token_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
        print(f"[rolloutcore] fleet gateway http://{o.host}:{o.port} -> "
              + ", ".join(e.base_url for e in engines), file=sys.stderr)
        if not given:
            print(f"[rolloutcore] control token (generated): {token}", file=sys.stderr)
        sys.stderr.flush()
        signal.signal(signal.SIGTERM, _exit)
        uvicorn.run(app, host=o.host, port=o.port, log_level="warning", access_log=False,
                    proxy_headers=False, timeout_graceful_shutdown=10)
        return 0
    finally:
        if coord is not None:
            coord.close()
        if placement is not None:
            placement.shutdown()
        else:
            for e in engines:
                e.stop()
