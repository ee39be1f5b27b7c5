"""``rolloutcore serve``: the options of ``rolloutcore.service.serve.run_serve``.

This module imports nothing from the service until the command runs, so
``rolloutcore serve --help`` works without the service extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rolloutcore.cli import argtypes
from rolloutcore.cli.vocab import HelpFormatter, deprecated

__all__ = ["DESCRIPTION", "FLEET_REFUSED", "add_arguments", "fleet_options", "options"]

DESCRIPTION = """\
The gateway in front of a vLLM server, under uvicorn. Three ways to get the engine:

* --upstream URL with --checkpoint DIR: a vLLM already running (started
  from DIR, whose identity becomes the first committed version);
* --model DIR: launch vLLM on DIR (loopback, dev endpoints, weight-transfer
  backend) and stop it on exit;
* neither: generate a tiny offline checkpoint and launch vLLM on it (the
  embedded default; nothing is downloaded).

The engine is taken over only verified: awake, not paused, and serving the
checkpoint's policy (its policy probe), to the verification floor
(--min-verification); otherwise serve exits with status 3.

A fleet: --engines N (N > 1) launches N vLLM servers locally, --ray places
them as Ray actors (one per placement-group bundle; a local Ray cluster when
--ray-address is not given), all behind one gateway that routes each request
by its version policy (X-RolloutCore-Policy: latest, any, min-version:N,
max-staleness:k, pinned:<label>) and updates them through
POST /control/fleet/updates (synchronous with one fan-out broadcast, or
rolling waves).

Everything that can be refused is refused before anything starts: a
non-loopback bind without a given token, bad limits, a missing checkpoint,
a vLLM option RolloutCore owns (--vllm-arg), a taken --port (exit status
4), a vLLM outside the supported range or without the routes an update
needs. Exit statuses and messages: docs/troubleshooting.md.
"""


def _fields_of(cls: Any, args: argparse.Namespace, **given: object) -> Any:
    """``cls`` built from the options of the same names; ``given`` for those named otherwise."""
    from dataclasses import fields

    return cls(**{f.name: given[f.name] if f.name in given else getattr(args, f.name)
                  for f in fields(cls)})


def options(args: argparse.Namespace) -> Any:
    """The parsed command line as ``ServeOptions`` (imports the service)."""
    from rolloutcore.service.serve import ServeOptions

    return _fields_of(ServeOptions, args)


#: ``serve`` options a fleet does not take, with why: given with ``--engines N``
#: (N > 1) or ``--ray``, each is refused at start (exit 2), nothing started.
#: Every other option means for the fleet what it means for one engine.
FLEET_REFUSED: dict[str, tuple[object, str]] = {
    "upstream": (None, "--engines/--ray start the engines; --upstream names one running "
                       "engine (a fleet of running engines: rolloutcore.fleet.placement."
                       "build_fleet(urls=...))"),
    "checkpoint": (None, "--checkpoint names what one --upstream engine was started from; "
                         "a fleet starts its engines on --model"),
    "takeover_checksums": (None, "a fleet starts its own engines: there is no running engine "
                                 "to take over"),
    "engine_url": (None, "a fleet gateway serves no trainer protocol (/control/updates) for "
                         "which trainers would need the engine's URL: its updates come "
                         "through POST /control/fleet/updates"),
    "update_mode": ("strict", "a fleet's rolling and synchronous updates are strict; the "
                              "asynchronous modes run on one engine's gateway (#31 takes "
                              "them across a fleet)"),
    "max_staleness": (None, "the staleness bound belongs to the asynchronous modes, which a "
                            "fleet gateway does not run yet"),
    "worker_extension_cls": (None, "a fleet launches its engines with RolloutCore's own "
                                   "worker extension"),
    "transport_backend": ("rolloutcore_gloo",
                          "a fleet sends weights with its own gloo fan-out and per-engine "
                          "gloo groups (rolloutcore_gloo); another backend is not supported "
                          "by the fleet yet"),
}


def fleet_options(args: argparse.Namespace) -> Any:
    """The parsed command line as ``FleetServeOptions`` (imports the fleet)."""
    from rolloutcore.errors import BadInput
    from rolloutcore.fleet.serve import FleetServeOptions

    for name, (default, why) in FLEET_REFUSED.items():
        if getattr(args, name) != default:
            raise BadInput(f"--{name.replace('_', '-')} with a fleet: {why}")
    return _fields_of(FleetServeOptions, args, journal_dir=args.journal,
                      vllm_args=tuple(args.vllm_args))


def _run(args: argparse.Namespace) -> int:
    fleet = args.engines > 1 or args.ray
    opts = fleet_options(args) if fleet else options(args)   # refused before a workdir
    made = args.workdir is None
    if made:   # made here, so that a failure can say where the logs are
        import tempfile

        args.workdir = tempfile.mkdtemp(prefix="rolloutcore-fleet-" if fleet
                                        else "rolloutcore-serve-")
        opts = fleet_options(args) if fleet else options(args)
    rc = 1
    try:
        if fleet:
            from rolloutcore.fleet.serve import run_fleet_serve

            rc = run_fleet_serve(opts)
        else:
            from rolloutcore.service.serve import run_serve

            rc = run_serve(opts)
        return rc
    finally:
        work = Path(args.workdir)
        if rc not in (0, 4) and (work / "logs").is_dir():
            print(f"rolloutcore serve: the engine logs are in {work / 'logs'}",
                  file=sys.stderr)
        if made and not any(work.iterdir()):   # refused before anything: nothing left
            work.rmdir()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``rolloutcore serve``; sets ``func`` to run the gateway."""
    p.description = DESCRIPTION
    p.formatter_class = HelpFormatter
    eng = p.add_argument_group("engine")
    src = eng.add_mutually_exclusive_group()
    src.add_argument("--upstream", metavar="URL", help="a running vLLM server")
    src.add_argument("--model", metavar="DIR", help="launch vLLM on this checkpoint")
    eng.add_argument("--checkpoint", metavar="DIR",
                     help="with --upstream: the checkpoint the engine was started from")
    eng.add_argument("--step", type=argtypes.nonneg_int, default=0,
                     help="training step of the initial weights (provenance)")
    eng.add_argument("--tensor-parallel-size", type=argtypes.positive_int, default=1,
                     metavar="N", help="with --model: launch vLLM with N tensor-parallel "
                     "ranks (with --engines: each engine; the CPU build binds each rank of "
                     "each engine to cores of its own and refuses a host with too few); "
                     "every update checks what each rank wrote")
    eng.add_argument("--pipeline-parallel-size", type=argtypes.positive_int, default=1,
                     metavar="N", help="with --model: launch vLLM with N pipeline stages "
                     "(bound like tensor-parallel ranks); every update checks that each "
                     "tensor was written by exactly one stage")
    eng.add_argument("--worker-extension-cls", default=None, metavar="CLASS",
                     help="with --model: vLLM's --worker-extension-cls for the launched "
                     "engine (importable in its workers; a tensor-parallel gloo engine's "
                     "must subclass rolloutcore.transports.gloo_report.RankReportExtension "
                     "for the gateway to check every rank)")
    eng.add_argument("--lora", action="store_true",
                     help="launch vLLM with LoRA enabled (--enable-lora, runtime adapter "
                     "loading) and serve LoRA-adapter versions: POST /control/adapters "
                     "publishes one, verified; requests for model 'policy' are served by the "
                     "current one (docs/lora.md)")
    eng.add_argument("--max-loras", type=argtypes.positive_int, default=None, metavar="N",
                     help="with --lora: vLLM's --max-loras, adapters in one batch (default 2)")
    eng.add_argument("--max-lora-rank", type=argtypes.positive_int, default=None,
                     metavar="R", help="with --lora: vLLM's --max-lora-rank (one of 1, 8, "
                     "16, 32, 64, 128, 256, 320, 512; default 16); a higher-rank adapter is "
                     "refused before it is loaded")
    eng.add_argument("--vllm-arg", dest="vllm_args", action="append", default=[],
                     metavar="OPTION",
                     help="one of vLLM's own engine options for the launched engine, "
                     "repeated: --vllm-arg=--max-model-len=4096 --vllm-arg=--enforce-eager "
                     "(note the '='); everything after ' -- ' on the command line is passed "
                     "the same way. Options RolloutCore owns (host, port, model, weight "
                     "transfer, worker extension, middleware, parallelism, LoRA) are refused "
                     "with the option to use instead. The tiny checkpoint's --dtype bfloat16 "
                     "--max-model-len 512 apply to it only, unless given here")
    eng.add_argument("--native-routes", action="store_true",
                     help="also answer vLLM's own RL routes (/pause, /start_weight_update, "
                          "/update_weights, /finish_weight_update, ...) under "
                          "/rc/<ROLLOUTCORE_NATIVE_TOKEN>: an unmodified trainer changes its "
                          "base URL only (docs/native-routes.md)")
    eng.add_argument("--transport-backend", default="rolloutcore_gloo",
                     help="vLLM weight-transfer backend trainers must use "
                          "(default rolloutcore_gloo)")
    eng.add_argument("--engine-url", default=None,
                     help="URL of vLLM as trainers reach it (default: the upstream URL)")
    eng.add_argument("--workdir", default=None,
                     help="where a generated checkpoint goes, and every log (the engines' in "
                     "WORKDIR/logs, its path printed when serve fails; default: a temp dir)")
    net = p.add_argument_group("network and security")
    net.add_argument("--host", default="127.0.0.1",
                     help="bind address (default loopback; others need --token and --data-token)")
    net.add_argument("--port", type=argtypes.port, default=8100,
                     help="the gateway's port; a taken one is refused before anything "
                          "starts (exit status 4)")
    net.add_argument("--token", default=None,
                     help="control token (else ROLLOUTCORE_TOKEN, else generated and printed)")
    net.add_argument("--token-file", default=None, help="read the control token from a file")
    net.add_argument("--token-out", default=None,
                     help="write the (generated) control token to this file, mode 0600")
    net.add_argument("--data-token", default=None,
                     help="require this bearer token on the data endpoints too (else "
                          "ROLLOUTCORE_DATA_TOKEN; required when --host is not loopback)")
    net.add_argument("--max-body-bytes", type=argtypes.nonneg_int, default=1 << 20,
                     help="larger request bodies get 413")
    net.add_argument("--client-body-s", type=argtypes.positive_float, default=30.0,
                     help="a request body must arrive within this (else 408)")
    net.add_argument("--client-send-s", type=argtypes.positive_float, default=30.0,
                     help="a client that leaves its answer unread this long is cut off")
    lim = p.add_argument_group("admission and updates")
    lim.add_argument("--queue", type=argtypes.nonneg_int, default=0,
                     help="hold up to N requests during an update (default 0: 503 at once)")
    lim.add_argument("--queue-wait-s", type=argtypes.positive_float, default=30.0,
                     help="how long a held request waits for the update to end (then 503)")
    lim.add_argument("--lease-s", type=argtypes.positive_float, default=120.0,
                     help="default trainer lease per update")
    lim.add_argument("--drain-timeout-s", type=argtypes.positive_float, default=120.0,
                     help="how long an update waits for bound rollouts to finish")
    lim.add_argument("--drain-policy", choices=("abort", "refuse"), default="abort",
                     help="at the drain deadline: abort the stragglers (unattributable) and "
                          "update (default), or refuse the update")
    lim.add_argument("--update-mode",
                     choices=("strict", "keep", "recompute", "engine_recompute"),
                     default="strict",
                     help="what an update does with requests in flight: strict drains them "
                          "first; keep freezes them in the engine and continues them under "
                          "the new version (their later tokens attend to the old KV); "
                          "recompute aborts them and resubmits prompt + output so far under "
                          "it (the token route); engine_recompute freezes them and has vLLM "
                          "recompute their KV under it on resume (every route). Every answer "
                          "says per token which version produced it (docs/async-modes.md)")
    lim.add_argument("--max-staleness", type=argtypes.nonneg_int, default=None, metavar="K",
                     help="with keep or recompute: end (unattributable) a request whose "
                          "oldest tokens would be more than K published versions old")
    lim.add_argument("--health-interval-s", type=float, default=2.0,
                     help="watch the engine between updates this often (0: no watch); a "
                          "dead, restarted or silent engine is tainted and refused")
    lim.add_argument("--journal", default=None,
                     help="append the lifecycle journal here; an existing one (a previous "
                          "gateway's) is restored first (a fleet: a directory, the pool's "
                          "journal and one per engine)")
    ver = p.add_argument_group("verification")
    ver.add_argument("--min-verification", default=None,
                     choices=["declared", "manifest", "engine-checksum", "probe"],
                     help="the floor every update (and the takeover) must reach; a begin "
                          "asking for less is refused with 422 (default: the highest level "
                          "this engine can reach, probe on any engine that scores prompts)")
    ver.add_argument("--takeover-probe", default=None, metavar="FILE",
                     help="the checkpoint's policy probe (PolicyProbe.to_wire() as JSON), "
                          "instead of computing it here with a forward pass of the checkpoint")
    ver.add_argument("--takeover-checksums", default=None, metavar="FILE",
                     help="the checkpoint's reference checksums (ReferenceChecksums.to_dict() "
                          "as JSON, taken from an engine that cold-loaded it): content "
                          "evidence with which a takeover without its journal may adopt an "
                          "engine updated since it started, when what it holds matches")
    lim.add_argument("--trajectories", dest="record", default=None, metavar="PATH",
                     help="record finished /inference/v1/generate requests that carry "
                          "X-RolloutCore-Run/-Step/-Prompt-Index as trajectory groups in "
                          "this trajectory file")
    lim.add_argument("--record", dest="record", default=None, metavar="PATH",
                     action=deprecated("--trajectories"),
                     help="deprecated spelling of --trajectories")
    fl = p.add_argument_group("fleet (several engines behind one gateway)")
    fl.add_argument("--engines", type=argtypes.positive_int, default=1, metavar="N",
                    help="launch N vLLM engines on --model (or the generated checkpoint)")
    fl.add_argument("--ray", action="store_true",
                    help="place the engines as Ray actors, one per placement-group bundle")
    fl.add_argument("--ray-address", default=None,
                    help="a running Ray cluster (default: start a local one)")
    fl.add_argument("--default-policy", default="latest",
                    help="routing policy of requests that name none (latest, any, "
                         "min-version:N, max-staleness:k, pinned:<label>)")
    fl.add_argument("--quorum", type=argtypes.positive_int, default=None,
                    help="synchronous updates publish once this many engines passed "
                         "(default: all)")
    fl.add_argument("--min-serving", type=argtypes.nonneg_int, default=None,
                    help="rolling updates keep this many engines serving (default N-1)")
    p.set_defaults(func=_run)
