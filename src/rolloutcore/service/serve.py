"""``rolloutcore serve``: the gateway in front of a vLLM server, under uvicorn.

Three ways to get the engine:

* ``--upstream URL`` with ``--checkpoint DIR``: a vLLM already running (started
  from DIR, whose identity becomes the first committed version);
* ``--model DIR``: launch vLLM on DIR (loopback, dev endpoints, weight-transfer
  backend) and stop it on exit;
* neither: generate a tiny offline checkpoint and launch vLLM on it (the
  embedded default; nothing is downloaded).

Everything that can be refused is refused before anything starts: a
non-loopback bind without a given token, bad limits, a missing checkpoint.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

from rolloutcore.errors import BadInput
from rolloutcore.service.auth import generate_token, read_token_file
from rolloutcore.service.config import ServiceConfig, check_bind

__all__ = ["add_serve_parser", "main", "run_serve"]


def _pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {s}")
    return v


def _nonneg_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {s}")
    return v


def _port(s: str) -> int:
    v = _nonneg_int(s)
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535: {s}")
    return v


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``serve`` to a CLI's subparsers; sets ``func`` to ``run_serve``."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="the gateway in front of vLLM: versioned rollouts, trainer protocol",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    eng = p.add_argument_group("engine")
    src = eng.add_mutually_exclusive_group()
    src.add_argument("--upstream", metavar="URL", help="a running vLLM server")
    src.add_argument("--model", metavar="DIR", help="launch vLLM on this checkpoint")
    eng.add_argument("--checkpoint", metavar="DIR",
                     help="with --upstream: the checkpoint the engine was started from")
    eng.add_argument("--step", type=_nonneg_int, default=0,
                     help="training step of the initial weights (provenance)")
    eng.add_argument("--transport-backend", default="rolloutcore_gloo",
                     help="vLLM weight-transfer backend trainers must use "
                          "(default rolloutcore_gloo)")
    eng.add_argument("--engine-url", default=None,
                     help="URL of vLLM as trainers reach it (default: the upstream URL)")
    eng.add_argument("--workdir", default=None,
                     help="where a generated checkpoint and engine logs go")
    net = p.add_argument_group("network and security")
    net.add_argument("--host", default="127.0.0.1",
                     help="bind address (default loopback; others need --token)")
    net.add_argument("--port", type=_port, default=8100)
    net.add_argument("--token", default=None,
                     help="control token (else ROLLOUTCORE_TOKEN, else generated and printed)")
    net.add_argument("--token-file", default=None, help="read the control token from a file")
    net.add_argument("--token-out", default=None,
                     help="write the (generated) control token to this file, mode 0600")
    net.add_argument("--data-token", default=None,
                     help="require this bearer token on the data endpoints too")
    net.add_argument("--max-body-bytes", type=_nonneg_int, default=1 << 20)
    lim = p.add_argument_group("admission and updates")
    lim.add_argument("--queue", type=_nonneg_int, default=0,
                     help="hold up to N requests during an update (default 0: 503 at once)")
    lim.add_argument("--queue-wait-s", type=_pos_float, default=30.0)
    lim.add_argument("--lease-s", type=_pos_float, default=120.0,
                     help="default trainer lease per update")
    lim.add_argument("--drain-timeout-s", type=_pos_float, default=120.0)
    lim.add_argument("--health-interval-s", type=float, default=2.0,
                     help="watch the engine between updates this often (0: no watch); a "
                          "dead, restarted or silent engine is tainted and refused")
    lim.add_argument("--journal", default=None, help="append the lifecycle journal here")
    lim.add_argument("--record", default=None, metavar="PATH",
                     help="record finished /inference/v1/generate requests that carry "
                          "X-RolloutCore-Run/-Step/-Prompt-Index as trajectory groups")
    p.set_defaults(func=run_serve)
    return p


def _token(args: argparse.Namespace) -> tuple[str, bool]:
    """(token, given): given by flag, file or environment; else generated."""
    if args.token and args.token_file:
        raise BadInput("give --token or --token-file, not both")
    if args.token:
        return str(args.token), True
    if args.token_file:
        return read_token_file(args.token_file), True
    env = os.environ.get("ROLLOUTCORE_TOKEN")
    if env:
        return env.strip(), True
    return generate_token(), False


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_serve(args: argparse.Namespace) -> int:
    """The ``serve`` command; blocks until interrupted. Returns an exit status."""
    token, given = _token(args)
    check_bind(args.host, given)
    if args.upstream and not args.checkpoint:
        raise BadInput("--upstream needs --checkpoint: the weights the engine was started "
                       "from become the first committed version")
    if args.max_body_bytes <= 0:
        raise BadInput("--max-body-bytes must be positive")
    # Settings are checked before anything is launched.
    probe = ServiceConfig(upstream_url=args.upstream or "http://127.0.0.1:1",
                          engine_url=args.engine_url, control_token=token,
                          data_token=args.data_token, max_body_bytes=args.max_body_bytes,
                          queue_max=args.queue, queue_wait_s=args.queue_wait_s,
                          lease_s=min(args.lease_s, 1800.0),
                          health_interval_s=args.health_interval_s)
    import uvicorn

    from rolloutcore.adapters.vllm import VllmAdapter, VllmHTTP
    from rolloutcore.control.journal import Journal
    from rolloutcore.control.runner import Deadlines, LifecycleRunner
    from rolloutcore.core.lifecycle import LifecycleController
    from rolloutcore.core.versions import Provenance, WeightIdentity
    from rolloutcore.service.app import create_app
    from rolloutcore.transports.source import WeightSource

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="rolloutcore-serve-"))
    engine: Any = None
    # Without --journal nothing would read the records: no journal then. With one,
    # the file has every record and memory only the last few (two records per
    # data-plane request would otherwise grow without bound).
    journal = Journal(args.journal, keep=256) if args.journal else None
    adapter: Any = None
    recorder: Any = None
    try:
        if args.upstream:
            url, model_dir, epoch, served = args.upstream.rstrip("/"), Path(args.checkpoint), \
                None, None
        else:
            from rolloutcore.adapters.vllm.process import ManagedEngine

            if args.model:
                model_dir = Path(args.model)
            else:
                from rolloutcore.testing.models import make_checkpoint

                model_dir = make_checkpoint(workdir / "policy-0", seed=0)
                print(f"[rolloutcore] generated a tiny checkpoint at {model_dir}",
                      file=sys.stderr)
            engine = ManagedEngine(model_dir, backend=args.transport_backend,
                                   log_dir=workdir / "logs", progress=True)
            engine.start()
            url, epoch, served = engine.base_url, engine.epoch, engine.model_name
        source = WeightSource.from_checkpoint(model_dir)
        identity = WeightIdentity.declare(source.manifest(), Provenance(
            str(model_dir.resolve()), "", args.step), source.content_digest())
        adapter = VllmAdapter(VllmHTTP(url), None, engine_epoch=epoch,
                              drain_timeout_s=args.drain_timeout_s)
        controller = LifecycleController(
            listener=None if journal is None else journal.listener)
        runner = LifecycleRunner(controller, adapter, Deadlines(drain_s=args.drain_timeout_s),
                                 record=None if journal is None else journal.write)
        runner.bootstrap(identity)
        cfg = ServiceConfig(**{**probe.__dict__, "upstream_url": url, "model": served,
                               "transport": {"backend": args.transport_backend}})
        if args.record:
            from rolloutcore.core.versions import EngineIdentity
            from rolloutcore.service.recording import GatewayRecorder

            http = adapter.http
            caps = http.capabilities()
            econf: dict[str, Any] = {}
            if engine is not None:
                econf = {"dtype": engine.dtype, "max_model_len": engine.max_model_len,
                         "enable_prefix_caching": engine.prefix_caching}
            recorder = GatewayRecorder(args.record, EngineIdentity(
                http.version() if "/version" in caps else "unknown",
                served or http.model(), econf, url))
        app = create_app(runner, cfg, on_finished=recorder)
        if args.token_out:
            fd = os.open(args.token_out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token + "\n")
        print(f"[rolloutcore] gateway http://{args.host}:{args.port} -> vLLM {url} "
              f"(committed {controller.committed})", file=sys.stderr)
        if not given:
            print(f"[rolloutcore] control token (generated): {token}", file=sys.stderr)
        sys.stderr.flush()
        # uvicorn re-raises the signal that stopped it once it has shut down;
        # with the default SIGTERM disposition that kills the process before
        # the engine below is stopped. Turned into SystemExit, cleanup runs.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        # The data path's per-request CPU is the gateway's added latency
        # (docs/service.md, "What the gateway costs"): no access log (uvicorn
        # formats its arguments even when INFO is filtered out) and no
        # X-Forwarded-* rewriting (nothing here reads the client address).
        # Everything allocated so far (modules, app, identity) is moved out of
        # the collector's reach, so a full collection scans only what requests
        # leave behind.
        gc.collect()
        gc.freeze()
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                    access_log=False, proxy_headers=False, timeout_graceful_shutdown=10)
        return 0
    finally:
        if recorder is not None:
            recorder.close()
        if adapter is not None:
            adapter.close()
        if engine is not None:
            engine.stop()
        if journal is not None:
            journal.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m rolloutcore.service.serve ...``: the same command without the CLI."""
    from rolloutcore.errors import RolloutCoreError

    parser = argparse.ArgumentParser(prog="rolloutcore")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    try:
        return int(ns.func(ns))
    except RolloutCoreError as exc:
        print(f"rolloutcore serve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
