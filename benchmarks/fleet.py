"""A fleet of real CPU vLLM engines behind the fleet gateway: updates, capacity, deaths.

Measures, with ``--engines`` engines (default 3) on the tiny model:

* ``single_engine_s``: one engine's verified transition alone (a one-replica
  fleet, per-engine send), median of ``--reps``;
* ``sync_fanout_s``: a synchronous fleet update with one fan-out broadcast to
  every engine; ``sync_sequential_s``: the same with N sequential per-engine
  sends; ``fanout_over_single`` (goal: within 1.3x);
* ``independent_parallel_s``: N one-engine transitions at once, each engine
  its own one-replica fleet and its own group: what this host allows N
  engines doing their own work at the same time (``fanout_over_independent_parallel``).

* serving capacity during a rolling update (``wave_size`` engines per wave,
  ``min_serving`` = N - wave_size) under client load (``any`` requests):
  requests/s per wave over the steady-state rate before the roll; a wave
  lasts about one engine's update, so ``--rolls`` updates are run and each
  wave's fraction is its median over them; the lowest of those
  (``rolling_retained_min``; goal >= (N-w)/N), failed ``any`` requests
  (goal 0) and the lowest serving count sampled from status;
* a replica SIGKILLed while serving under load: time to its fencing
  (out of the pool) and to its rejoining (recovered, verified on the fleet
  version, back in the pool).

Every series runs ``--reps`` + 1 rounds back to back; round 0 forms that
series' transfer group(s) (``first_round_s``; the fan-out connect alone:
``fanout_connect_s``) and the medians are of the rounds after it, the group
kept, as a trainer's loop runs them.

Engines are launched with ``fleet.placement.launch_local``: on a host with
fewer than two cores per engine, each gets its own core(s) and
vLLM's own one-second idle spin (``--spin S``: ``ROLLOUTCORE_VLLM_IDLE_SPIN_S=S``
instead, to measure what a shorter one buys; ``benchmarks/idle_spin.py``
measures what it costs under load).

Writes results/fleet.json and prints a table. Not a test.

    .venv/bin/python benchmarks/fleet.py [--engines 3] [--reps 5] [--rolls 3] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "fleet-benchmark-token-0123456789"


def mislabeled(headers: Any, body: Any) -> bool:
    """An answer whose fleet version, engine version and vLLM's own spans disagree."""
    try:
        label = headers["x-rolloutcore-version"]
        spans = {s["version"] for s in body["choices"][0]["weight_versions"]}
        fleet_label = headers["x-rolloutcore-fleet-label"]
        info = body["rolloutcore"]
    except (KeyError, TypeError, IndexError):
        return True
    return not (spans == {label} and info["version"] == label
                and str(info["fleet_version"]) == headers["x-rolloutcore-fleet-version"]
                and info["replica"] == headers["x-rolloutcore-replica"]
                and (label.split(".")[0] == fleet_label
                     or (fleet_label == "fleet-0" and label == "default")))


class Clients:
    """Client threads posting ``any`` requests; every answer is kept with its times.

    Each request asks the gateway to record it (``--record``: run ``bench``, one
    group per request), and each answer is checked: its fleet version, replica
    and engine version must agree with vLLM's own spans (``mislabeled``).
    """

    counter = 0   # group numbers, unique across every Clients of one run

    def __init__(self, url: str, n: int, policy: str = "any", max_tokens: int = 8) -> None:
        self.url, self.policy, self.max_tokens = url, policy, max_tokens
        self.answers: list[tuple[float, float, int, str]] = []  # sent, done, status, replica
        self.errors: list[str] = []
        self.mislabeled = 0
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                         for k in range(n)]

    def _run(self, k: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120) as c:
            i = 0
            while not self._stop.is_set():
                i += 1
                t0 = time.monotonic()
                with self.lock:
                    Clients.counter += 1
                    gid = Clients.counter
                try:
                    r = c.post("/inference/v1/generate", headers={
                        "x-rolloutcore-policy": self.policy, "x-rolloutcore-run": "bench",
                        "x-rolloutcore-step": "0", "x-rolloutcore-prompt-index": str(gid)},
                        json={
                        "model": "policy", "token_ids": [7, k, i % 250, 3],
                        "sampling_params": {"max_tokens": self.max_tokens, "temperature": 0}})
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.answers.append((t0, time.monotonic(), r.status_code,
                                     r.headers.get("x-rolloutcore-replica", "")))
                if r.status_code == 200 and mislabeled(r.headers, r.json()):
                    self.mislabeled += 1
                if r.status_code != 200:
                    time.sleep(0.05)

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def rate(self, t0: float, t1: float) -> float:
        """Successful answers completed in [t0, t1), per second."""
        n = sum(1 for _, d, s, _ in self.answers if s == 200 and t0 <= d < t1)
        return n / max(1e-9, t1 - t0)


class Sampler:
    def __init__(self, url: str) -> None:
        self.url = url
        self.serving: list[int] = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30,
                          headers={"authorization": f"Bearer {TOKEN}"}) as c:
            while not self._stop.is_set():
                r = c.get("/control/status")
                if r.status_code == 200:
                    self.serving.append(int(r.json()["serving"]))
                time.sleep(0.02)

    def start(self) -> Sampler:
        self._th.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._th.join(30)


class Series:
    """Wall seconds (and transfer seconds, where the round says) of a run of rounds."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.transfer_s: list[float] = []


def _series(what: str, round_: Any, n: int) -> Series:
    out = Series()
    for i in range(n):
        t0 = time.monotonic()
        r = round_(i)
        out.seconds.append(time.monotonic() - t0)
        print(f"[fleet-bench] {what}: round {i + 1}/{n} {out.seconds[-1]:.3f} s"
              + (" (forms its group)" if i == 0 else ""), flush=True)
        out.transfer_s.append(float(getattr(r, "transfer_s", 0.0) or 0.0))
    return out


def _all_at_once(calls: list[Any]) -> None:
    """Run ``calls`` in threads at once; re-raise the first failure."""
    errors: list[BaseException] = []

    def run(c: Any) -> None:
        try:
            c()
        except BaseException as exc:  # handed back below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--wave-size", type=int, default=1)
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--rolls", type=int, default=3,
                    help="rolling updates under load (each wave's fraction: the median)")
    ap.add_argument("--steady-s", type=float, default=15.0)
    ap.add_argument("--rejoin-wait-s", type=float, default=1200.0,
                    help="how long to wait for the killed replica to rejoin under load")
    ap.add_argument("--out", default=str(ROOT / "results" / "fleet.json"))
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--spin", type=float, default=None, metavar="S",
                    help="the engines' idle spin (ROLLOUTCORE_VLLM_IDLE_SPIN_S); default: "
                         "vLLM's own 1 s")
    args = ap.parse_args()
    if args.engines < 2 or args.reps < 1 or args.rolls < 1 or \
            not 1 <= args.wave_size < args.engines:
        ap.error("need --engines >= 2, --reps >= 1, --rolls >= 1, "
                 "1 <= --wave-size < --engines")

    import torch
    import vllm

    from rolloutcore.core.pool import ReplicaStateChange, WaveBegin, WaveEnd
    from rolloutcore.fleet import FleetConfig, FleetCoordinator
    from rolloutcore.fleet.gateway import create_fleet_app
    from rolloutcore.fleet.placement import (
        build_fleet,
        launch_local,
        prepare_checkpoint,
        vllm_replica,
    )
    from rolloutcore.service import ServiceConfig
    from rolloutcore.testing.models import make_checkpoint

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.gateway_rig import uvicorn_thread

    work = Path(args.workdir or tempfile.mkdtemp(prefix="rc-fleet-bench-"))
    a = make_checkpoint(work / "A", 1)
    b = make_checkpoint(work / "B", 2)
    wa, wb = prepare_checkpoint(a), prepare_checkpoint(b)
    n = args.engines
    t0 = time.monotonic()
    from rolloutcore.transports.vllm_plugin import IDLE_SPIN_ENV

    spin_env = {IDLE_SPIN_ENV: f"{args.spin:g}"} if args.spin is not None else {}
    engines = launch_local(n, a, log_dir=work / "logs", progress=True, env=spin_env)
    start_s = time.monotonic() - t0
    out: dict[str, Any] = {"engines": n, "wave_size": args.wave_size,
                           "engine_env": [{k: v for k, v in e.env_overrides.items()
                                           if k in ("VLLM_CPU_OMP_THREADS_BIND", IDLE_SPIN_ENV)}
                                          for e in engines]}
    try:
        # -- one engine alone: the reference transition --------------------------------
        # Round 0 of every series forms its group (connect, timed apart); the medians
        # are of the rounds after it, the group kept, as a trainer's loop runs them.
        rep = vllm_replica("solo", engines[0].base_url, engine=engines[0])
        solo = FleetCoordinator([rep], config=FleetConfig(health_interval_s=0))
        solo.bootstrap(wa.identity, weights=wa)
        single = _series("single engine", lambda i: solo.update(
            wb if i % 2 == 0 else wa, transfer="per-engine", label=f"solo-{i}"), args.reps + 1)
        if (args.reps + 1) % 2:
            solo.update(wa, transfer="per-engine", label="solo-back")
        solo.close()
        # -- N independent one-engine transitions at once: what this host allows --------
        solos = [FleetCoordinator([vllm_replica(f"p{j}", e.base_url, engine=e)],
                                  config=FleetConfig(health_interval_s=0))
                 for j, e in enumerate(engines)]
        for c in solos:
            c.bootstrap(wa.identity, weights=wa)
        parallel = _series(f"{n} one-engine transitions at once", lambda i: _all_at_once(
            [lambda c=c: c.update(wb if i % 2 == 0 else wa, transfer="per-engine",
                                  label=f"par-{i}") for c in solos]), args.reps + 1)
        for c in solos:
            if (args.reps + 1) % 2:
                c.update(wa, transfer="per-engine", label="par-back")
            c.close()
        # -- the fleet ------------------------------------------------------------------
        coord = build_fleet(engines, checkpoint=a, journal_dir=work / "journals",
                            config=FleetConfig(health_interval_s=0.5), journal_keep=2000)
        toggle = [wb, wa]
        k = 0

        def fleet_round(transfer: str) -> Any:
            nonlocal k
            r = coord.update(toggle[k % 2], transfer=transfer)
            k += 1
            assert r.transfer == transfer, (r.transfer, transfer)
            return r

        fan = _series("fleet, fan-out", lambda i: fleet_round("fanout"), args.reps + 1)
        fan_connect_s = coord.fanout.last_connect_s if coord.fanout is not None else None
        seq = _series("fleet, per-engine sends", lambda i: fleet_round("per-engine"), args.reps + 1)
        from rolloutcore.core.versions import EngineIdentity
        from rolloutcore.provenance.recorder import read_groups
        from rolloutcore.service.recording import GatewayRecorder

        traj = work / "trajectories.jsonl"
        ids = {nm: EngineIdentity(vllm.__version__, "policy", {}, str(rp.url))
               for nm, rp in coord.replicas.items()}
        recorder = GatewayRecorder(traj, ids["e0"], engines=ids)
        app = create_fleet_app(coord, ServiceConfig(upstream_url="http://127.0.0.1:1",
                                                    control_token=TOKEN), on_finished=recorder)
        answered = mislabels = 0
        with uvicorn_thread(app) as url:
            # -- capacity during a rolling update -----------------------------------------
            cl = Clients(url, args.clients).start()
            time.sleep(3.0)   # warm up
            ts = time.monotonic()
            time.sleep(args.steady_s)
            steady = cl.rate(ts, time.monotonic())
            sampler = Sampler(url).start()
            t_roll = time.monotonic()
            rolls: list[list[dict[str, Any]]] = []
            roll_s: list[float] = []
            for ri in range(args.rolls):
                t_r = time.monotonic()
                res = coord.update(toggle[k % 2], strategy="rolling", wave_size=args.wave_size,
                                   min_serving=n - args.wave_size)
                k += 1
                roll_s.append(res.seconds)
                rec = coord.journal.records
                begins = {r.record.wave: r.t_mono for r in rec
                          if isinstance(r.record, WaveBegin) and r.t_mono >= t_r}
                ends = {r.record.wave: r.t_mono for r in rec
                        if isinstance(r.record, WaveEnd) and r.t_mono >= t_r}
                time.sleep(1.0)   # the last wave's answers complete
                waves = []
                for w in sorted(begins):
                    rate = cl.rate(begins[w], ends[w])
                    waves.append({"wave": w, "seconds": ends[w] - begins[w],
                                  "requests_per_s": rate,
                                  "fraction_of_steady": rate / steady if steady else None})
                rolls.append(waves)
                print(f"[fleet-bench] rolling update {ri + 1}/{args.rolls}: {res.seconds:.2f} s, "
                      "waves at " + ", ".join(f"{w['fraction_of_steady']:.2f}" for w in waves)
                      + " of steady", flush=True)
            t_end = time.monotonic()
            sampler.stop()
            cl.stop()
            answered += sum(1 for a in cl.answers if a[2] == 200)
            mislabels += cl.mislabeled
            any_failed = sum(1 for s, d, st, _ in cl.answers if st != 200
                             and t_roll <= s <= t_end) + len(cl.errors)
            # A wave lasts about one engine's update (a second here): a handful of answers
            # per replica. Each wave's fraction is the median over the rolls.
            per_wave = [statistics.median(r[i]["fraction_of_steady"] for r in rolls)
                        for i in range(min(len(r) for r in rolls))]
            out.update({
                "steady_requests_per_s": steady, "rolling_waves": rolls,
                "rolling_wave_medians": per_wave,
                "rolling_retained_min": min(per_wave),
                "rolling_retained_min_any_roll": min(w["fraction_of_steady"]
                                                     for r in rolls for w in r),
                "rolling_failed_any": any_failed,
                "rolling_min_serving_seen": min(sampler.serving) if sampler.serving else None,
                "rolling_min_serving": n - args.wave_size,
                "rolling_total_s": statistics.median(roll_s), "rolls": args.rolls,
                "rolling_goal": (n - args.wave_size) / n,
            })
            # -- a replica killed while serving -------------------------------------------
            cl = Clients(url, args.clients).start()
            time.sleep(3.0)
            victim = engines[-1]
            name = f"e{n - 1}"
            tk = time.monotonic()
            victim.signal_group(signal.SIGKILL)
            ok = coord.wait_for(lambda: coord.state_of(name).value != "SERVING", 120, 0.005)
            t_fenced = time.monotonic()
            ok2 = coord.wait_for(lambda: coord.state_of(name).value == "SERVING",
                                 args.rejoin_wait_s, 0.1)
            t_back = time.monotonic()
            time.sleep(1.0)
            cl.stop()
            answered += sum(1 for a in cl.answers if a[2] == 200)
            mislabels += cl.mislabeled
            recs = [r for r in coord.journal.records if isinstance(r.record, ReplicaStateChange)
                    and r.record.replica == name and r.t_mono >= tk]
            fenced_rec = next((r.t_mono for r in recs if r.record.after == "FENCED"), t_fenced)
            back_rec = next((r.t_mono for r in recs if r.record.event == "rejoined"), t_back)
            served_dead = sum(1 for s, d, st, rp in cl.answers
                              if st == 200 and rp == name and tk < s < back_rec)
            out.update({
                "fence_after_death_s": fenced_rec - tk if ok else None,
                "rejoin_after_death_s": back_rec - tk if ok2 else None,
                "served_by_dead_replica": served_dead,
                "failed_during_death": sum(1 for s, d, st, _ in cl.answers if st != 200
                                           and tk <= s <= back_rec),
                "answers_during_death": sum(1 for s, d, st, _ in cl.answers
                                            if tk <= s <= back_rec),
                "death_trail": [(r.record.after, r.record.event, round(r.t_mono - tk, 3))
                                for r in recs],
            })
        recorder.flush(120)
        recorder.close()
        recorded = sum(len(g.samples) for g in read_groups(traj))
        from rolloutcore.provenance.audit import audit_file

        coord.close()
        audit = audit_file(traj, work / "journals")
        out.update({"mislabeled_answers": mislabels, "samples_answered": answered,
                    "samples_recorded": recorded,
                    "audit_ok": audit.purity.ok, "audit_findings": len(audit.purity.findings),
                    "audit_unattributable": audit.purity.unattributable,
                    "recorder_counts": recorder.stats()["counts"]})
    finally:
        for e in engines:
            e.stop()
    med = statistics.median
    out.update({
        "sync_fanout_s": med(fan.seconds[1:]), "sync_sequential_s": med(seq.seconds[1:]),
        "single_engine_s": med(single.seconds[1:]),
        "fanout_over_single": med(fan.seconds[1:]) / med(single.seconds[1:]),
        "independent_parallel_s": med(parallel.seconds[1:]),
        "fanout_over_independent_parallel": med(fan.seconds[1:]) / med(parallel.seconds[1:]),
        "sync_fanout_transfer_s": med(fan.transfer_s[1:]),
        "sync_sequential_transfer_s": med(seq.transfer_s[1:]),
        "single_engine_transfer_s": med(single.transfer_s[1:]),
        "fanout_connect_s": fan_connect_s,
        "first_round_s": {"single_engine": single.seconds[0], "sync_fanout": fan.seconds[0],
                          "sync_sequential": seq.seconds[0],
                          "independent_parallel": parallel.seconds[0]},
        "runs": {"single_engine_s": single.seconds, "sync_fanout_s": fan.seconds,
                 "sync_sequential_s": seq.seconds, "independent_parallel_s": parallel.seconds},
        "engine_start_s": start_s,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "torch": torch.__version__,
                    "vllm": vllm.__version__, "load_avg_at_end": os.getloadavg()},
        "versions": {"rolloutcore": __import__("rolloutcore").__version__,
                     "vllm": vllm.__version__, "torch": torch.__version__},
        "command": "python benchmarks/fleet.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "notes": ("CPU vLLM, tiny model, all engines on one host of os.cpu_count() cores: "
                  "the engines compete for the same cores, so taking one out of the pool "
                  "frees CPU for the others and capacity falls less than (N-w)/N; and N "
                  "engines updating at once share those cores (independent_parallel_s)."),
    })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    rows = [("engines / wave size", f"{n} / {args.wave_size}"),
            ("single engine transition", f"{out['single_engine_s']:.3f} s"),
            ("synchronous, one fan-out broadcast", f"{out['sync_fanout_s']:.3f} s"),
            ("synchronous, N sequential sends", f"{out['sync_sequential_s']:.3f} s"),
            ("N one-engine transitions at once", f"{out['independent_parallel_s']:.3f} s"),
            ("fan-out group connect (once)", f"{out['fanout_connect_s']:.3f} s"
             if out["fanout_connect_s"] is not None else "n/a"),
            ("fan-out / single (goal <= 1.3)", f"{out['fanout_over_single']:.2f}"),
            ("fan-out / N at once", f"{out['fanout_over_independent_parallel']:.2f}"),
            ("rolling: lowest wave capacity / steady", f"{out['rolling_retained_min']:.2f} "
             f"(goal >= {out['rolling_goal']:.2f})"),
            ("rolling: failed `any` requests", str(out["rolling_failed_any"])),
            ("rolling: fewest serving seen", f"{out['rolling_min_serving_seen']} "
             f"(min_serving {out['rolling_min_serving']})"),
            ("death -> fenced", f"{out['fence_after_death_s']:.3f} s"
             if out["fence_after_death_s"] is not None else "n/a"),
            ("death -> rejoined", f"{out['rejoin_after_death_s']:.1f} s"
             if out["rejoin_after_death_s"] is not None else "n/a"),
            ("answers mislabeled (fleet/engine/spans)", str(out["mislabeled_answers"])),
            ("samples recorded / answered", f"{out['samples_recorded']} / "
             f"{out['samples_answered']}"),
            ("audit of the record (fleet journals)", "clean" if out["audit_ok"] else
             f"{out['audit_findings']} findings")]
    w = max(len(r[0]) for r in rows)
    for k_, v in rows:
        print(f"{k_:<{w}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
