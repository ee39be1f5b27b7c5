"""How an adapter version's probes are scored and judged (``AdapterManager``'s probes).

The probe tolerance an update may declare, the engine's device (which scoring
``probe_scoring="auto"`` takes), scoring through one model of the engine, and every
case of every probe scored at once so that the engine batches them.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from rolloutcore.control.port import LoraCapability
from rolloutcore.core.evidence import Check
from rolloutcore.errors import BadInput, EvidenceRejected, RolloutCoreError
from rolloutcore.verification.adapters import measure_generated
from rolloutcore.verification.probe import MAX_TOLERANCE, Calibration, PolicyProbe, ProbeResult

__all__ = ["ScoredThrough", "check_probe_tolerance", "engine_device", "prefetch", "run_probes"]

log = logging.getLogger("rolloutcore.adapters")


def check_probe_tolerance(value: object, default: float, cap: float = MAX_TOLERANCE
                          ) -> float:
    """An adapter update's probe tolerance: ``value`` (a number in (0, ``cap``]) or
    ``default`` when None; ``BadInput`` otherwise."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value <= cap:
        raise BadInput(f"probe_tolerance must be a number in (0, {cap:g}] nats, "
                       f"got {value!r}")
    return float(value)


def engine_device(http: object, timeout_s: float | None = None) -> str | None:
    """The engine's device type (``cuda``, ``cpu``, ...) from ``/server_info``'s
    ``device_config``; None when the engine does not say (no ``/server_info``: vLLM
    without ``VLLM_SERVER_DEV_MODE``, or a test's fake)."""
    info = getattr(http, "server_info", None)
    if not callable(info):
        return None
    try:
        body = info(timeout_s=timeout_s)
    except RolloutCoreError as exc:
        log.info("no device type from /server_info (%s): adapter probes through generation",
                 exc)
        return None
    cfg = body.get("vllm_config") if isinstance(body, dict) else None
    dev = cfg.get("device_config") if isinstance(cfg, dict) else None
    if not isinstance(dev, dict):
        return None
    for key in ("device_type", "device"):
        v = dev.get(key)
        if isinstance(v, str) and v and v != "auto":
            return v.split(":")[0].lower()
    return None


class ScoredThrough:
    """A ``Scorer`` through one model of the engine (the base: None, or an adapter's name).

    ``prefetch`` may have scored its sequences already (all at once): ``score``
    then answers those, in order, and checks that it is asked for the same tokens."""

    def __init__(self, http: LoraCapability, model: str | None, timeout_s: float) -> None:
        self.http, self.model, self.timeout_s = http, model, timeout_s
        self.ready: list[tuple[list[int], list[float | None]]] | None = None

    def score(self, token_ids: Sequence[int], *, timeout_s: float | None = None
              ) -> list[float | None]:
        if self.ready is not None:
            if not self.ready or self.ready[0][0] != list(token_ids):
                raise EvidenceRejected("validate", "a prefetched probe was asked for other "
                                       "tokens than it scored")  # a bug here
            return self.ready.pop(0)[1]
        out: list[float | None] = self.http.score(
            token_ids, timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            model=self.model)
        return out


def prefetch(scorers: Sequence[ScoredThrough], probes: Sequence[PolicyProbe]) -> None:
    """Score every case of every probe through its scorer at once (one thread per
    request: the engine batches them); each scorer then answers its probe's ``measure``
    from those. The first failure in (probe, case) order is raised once all have
    answered or timed out."""
    jobs = [(sc, [*c.prompt, *c.continuation], p.timeout_s)
            for sc, p in zip(scorers, probes, strict=True) for c in p.cases]
    with ThreadPoolExecutor(len(jobs), thread_name_prefix="rc-probe") as pool:
        futures = [pool.submit(sc.score, seq, timeout_s=t) for sc, seq, t in jobs]
        got = [f.result() for f in futures]
    ready: dict[int, list[tuple[list[int], list[float | None]]]] = {
        id(sc): [] for sc in scorers}
    for (sc, seq, _), out in zip(jobs, got, strict=True):
        ready[id(sc)].append((seq, out))
    for sc in scorers:
        sc.ready = ready[id(sc)]


def run_probes(http: LoraCapability, probes: Sequence[tuple[PolicyProbe, str | None, str]],
               *, scoring: str, together: bool, timeout_s: float,
               calibrations: Mapping[str, Calibration]) -> list[Check]:
    """Each (probe, model, what) measured through ``model`` and judged, in order
    (``AdapterManager._probes`` says how ``scoring`` and ``together`` send them)."""
    if scoring == "prompt_logprobs":
        scorers = [ScoredThrough(http, m, timeout_s) for _, m, _ in probes]
        if together:
            prefetch(scorers, [p for p, _, _ in probes])

        def measure(i: int) -> ProbeResult:
            return probes[i][0].measure(scorers[i])
    else:
        def measure(i: int) -> ProbeResult:
            p, m, _ = probes[i]
            return measure_generated(p, http, m, timeout_s=timeout_s)
    if together and len(probes) > 1 and scoring == "generation":
        with ThreadPoolExecutor(len(probes), thread_name_prefix="rc-probes") as pool:
            futures = [pool.submit(measure, i) for i in range(len(probes))]
            results = [f.result() for f in futures]
    else:
        results = [measure(i) for i in range(len(probes))]
    checks = []
    for (probe, _, what), res in zip(probes, results, strict=True):
        j = probe.judge(res, calibrations)
        how = f" ({scoring})" if scoring != "generation" else ""
        checks.append(Check(
            probe.name, j.passed,
            f"{what}{how}: {len(probe.cases)} probes, {res.positions} teacher-forced "
            f"positions; max |dlogp| {res.max_abs_diff:.4g}, mean "
            f"{res.mean_abs_diff:.3g}, {j.note}",
            max_abs_diff=res.max_abs_diff, tolerance=j.tolerance))
    return checks
