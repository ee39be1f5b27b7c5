"""Prometheus metrics of one gateway, fed by the controller's own records.

The controller hands every record to its listeners, in order (outside its
lock); ``ServiceMetrics.listener`` turns those typed records into counters and
histograms, so the metrics cannot disagree with the journal. Values that are
a *state* rather than a count (the lifecycle state, the active rollouts, the
committed generation) are read from the controller at scrape time instead of
being tracked incrementally, so they cannot drift.

Each service has its own ``CollectorRegistry``: several gateways (or tests)
in one process do not share metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rolloutcore.control.controller import LifecycleController
from rolloutcore.core.lifecycle import State
from rolloutcore.core.records import Admit, Commit, Record, Refuse, Transition
from rolloutcore.core.versions import VerificationLevel

__all__ = ["CONTENT_TYPE", "ServiceMetrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                  10.0, 30.0, 60.0, 120.0, 300.0, float("inf"))
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0, 30.0, 60.0, float("inf"))


class ServiceMetrics:
    """The gateway's metrics; ``listener`` is added to the controller."""

    def __init__(self, controller: LifecycleController | None) -> None:
        self._controller = controller
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.state = Gauge("rolloutcore_state", "1 for the lifecycle state the engine is in",
                           ["state"], registry=r)
        self.committed_generation = Gauge(
            "rolloutcore_committed_generation", "generation of the committed weight version "
            "(-1 before bootstrap)", registry=r)
        self.active_rollouts = Gauge("rolloutcore_active_rollouts",
                                     "rollouts admitted and not yet released", registry=r)
        self.transitions = Counter("rolloutcore_transitions_total",
                                   "lifecycle state transitions",
                                   ["from_state", "to_state", "event"], registry=r)
        self.state_seconds = Histogram(
            "rolloutcore_state_duration_seconds", "time spent in a state before leaving it",
            ["state"], buckets=_PHASE_BUCKETS, registry=r)
        self.phase_seconds = Histogram(
            "rolloutcore_update_phase_seconds", "duration of each phase of an update",
            ["phase"], buckets=_PHASE_BUCKETS, registry=r)
        self.admissions = Counter("rolloutcore_admissions_total",
                                  "admission decisions of the data plane",
                                  ["result"], registry=r)
        self.queued = Counter("rolloutcore_queued_requests_total",
                              "requests that waited in the admission queue, by how it ended",
                              ["result"], registry=r)
        self.updates = Counter("rolloutcore_updates_total",
                               "updates by outcome (published, or the failure class)",
                               ["outcome"], registry=r)
        self.requests = Counter("rolloutcore_requests_total",
                                "data-plane requests by route and status",
                                ["route", "status"], registry=r)
        self.request_seconds = Histogram(
            "rolloutcore_request_duration_seconds",
            "data-plane request time, admission to release", ["route"],
            buckets=_LATENCY_BUCKETS, registry=r)
        self.stream_endings = Counter(
            "rolloutcore_stream_endings_total",
            "how data-plane responses ended (complete, client_disconnect, upstream_error)",
            ["ending"], registry=r)
        self.leases_expired = Counter("rolloutcore_leases_expired_total",
                                      "updates whose trainer lease expired", registry=r)
        # Liveness and bounds of the data plane (#16).
        self.aborted_rollouts = Counter(
            "rolloutcore_aborted_rollouts_total",
            "rollouts aborted by the drain policy (released unattributable)", registry=r)
        self.slow_clients = Counter(
            "rolloutcore_slow_clients_total",
            "requests cut because the client left its answer unread past client_send_s",
            registry=r)
        self.body_timeouts = Counter(
            "rolloutcore_body_timeouts_total",
            "requests whose body did not arrive within client_body_s (answered 408)",
            registry=r)
        self.route_refused = Counter(
            "rolloutcore_route_refused_total",
            "requests no engine was chosen for (a fleet's router), by status", ["status"],
            registry=r)
        self.overloaded = Counter(
            "rolloutcore_overloaded_total",
            "data-plane requests refused at max_concurrent_requests (503)", registry=r)
        self.verification_floor = Gauge(
            "rolloutcore_verification_floor_level",
            "the verification every update must reach (0 declared, 1 manifest, "
            "2 engine-checksum, 3 probe)", registry=r)
        self.committed_verification = Gauge(
            "rolloutcore_committed_verification_level",
            "verification the committed version reached (same scale; -1 before bootstrap)",
            registry=r)
        self.published = Counter(
            "rolloutcore_published_total", "versions published, by the verification reached",
            ["verification"], registry=r)
        self.engine_lost = Counter(
            "rolloutcore_engine_lost_total",
            "engines tainted between updates (died, restarted, stopped answering)",
            registry=r)
        # Pre-create the label sets people alert on, so they read 0 rather than absent.
        if controller is None:
            # Behind a fleet's router there is no one engine: its engines' states are
            # the fleet's own series (``rolloutcore_fleet_*``), never a misleading 0 here.
            for g in (self.state, self.committed_generation, self.active_rollouts,
                      self.committed_verification):
                r.unregister(g)
        for s in State:
            self.state.labels(s.value).set(0)
        # Children of the per-request series, looked up once (``labels()``
        # builds a key and takes a lock on every call).
        self._accepted = self.admissions.labels("accepted")
        self._refused = self.admissions.labels("refused")
        for out in ("published", "no_mutation", "ambiguous", "lease_expired"):
            self.updates.labels(out)
        for lvl in VerificationLevel:
            self.published.labels(lvl.wire)

    def set_floor(self, level: VerificationLevel) -> None:
        self.verification_floor.set(int(level))

    # ---------------------------------------------------------------- feeding
    def listener(self, rec: Record) -> None:
        """Controller listener: runs on the data plane's path too, so it stays O(1)."""
        t = type(rec)
        if t is Admit:
            self._accepted.inc()
        elif t is Transition:
            assert isinstance(rec, Transition)
            self.transitions.labels(rec.before.value, rec.after.value, rec.event.value).inc()
            self.state_seconds.labels(rec.before.value).observe(rec.duration_s)
            if rec.before is State.READY and rec.after is State.TAINTED:
                # READY leaves for TAINTED only on a serving failure (the table's one
                # FAIL row there): counted when decided, before the engine is fenced.
                self.engine_lost.inc()
        elif t is Refuse:
            self._refused.inc()
        elif t is Commit:
            assert isinstance(rec, Commit)
            self.published.labels(rec.identity.verification.wire).inc()

    def watch_recorder(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        """Export the trajectory recorder's counts (read at scrape time from ``stats``)."""
        self.registry.register(_RecorderCollector(stats))

    def observe_update(self, outcome: str, phases: dict[str, float]) -> None:
        self.updates.labels(outcome).inc()
        for phase, seconds in phases.items():
            self.phase_seconds.labels(phase).observe(max(0.0, seconds))

    # ---------------------------------------------------------------- scraping
    def render(self) -> bytes:
        c = self._controller
        if c is None:  # behind a fleet's router: the fleet renders its engines' states
            return bytes(generate_latest(self.registry))
        current = c.state
        for s in State:
            self.state.labels(s.value).set(1 if s is current else 0)
        committed = c.committed
        self.committed_generation.set(-1 if committed is None else committed.generation)
        ident = c.identity
        self.committed_verification.set(-1 if ident is None else int(ident.verification))
        self.active_rollouts.set(len(c.active))
        return bytes(generate_latest(self.registry))


class _RecorderCollector(Collector):
    """The recorder's own counters, as they are when scraped (no copy to drift)."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        c = CounterMetricFamily("rolloutcore_recorder_records",
                                "finished requests the trajectory recorder saw, by result "
                                "(committed, unattributable, failed, dropped, skipped, ...)",
                                labels=["result"])
        for result, n in sorted(dict(s.get("counts", {})).items()):
            c.add_metric([str(result)], float(n))
        yield c
        yield GaugeMetricFamily("rolloutcore_recorder_pending",
                                "records queued for the recorder's writer",
                                value=float(s.get("pending", 0)))
        yield GaugeMetricFamily("rolloutcore_recorder_alive",
                                "1 while the recorder's writer thread runs",
                                value=1.0 if s.get("alive") else 0.0)
