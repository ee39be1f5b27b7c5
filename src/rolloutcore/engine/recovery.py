"""Recovery from TAINTED: a replacement engine on a checkpoint of known identity, verified.

A tainted engine holds weights nobody can name: an update may have landed
partly, fully or not at all. Rolling it back in place would need a proof that
the old tensors were restored, which nothing on the engine can give. So the
way back is a *replacement*: a new engine process (a new epoch) cold-loads a
checkpoint whose identity is known, and is verified like an update before
the controller publishes it (``LifecycleController.recovered``) as a new
generation on the new epoch. Nothing admitted before the taint can then be
attributed to it: its version differs in generation, label and epoch.

Two ``port.Recoverer`` implementations:

* ``ManagedRecoverer``, for an engine we launched (``ManagedEngine``): stop
  the old process group whatever state it is in (alive, hung, half dead after
  a SIGKILL), restart it on the checkpoint, label it, verify it.
* ``OperatorRecoverer``, for an engine we did not launch: a person (or
  another system) replaces it. We wait, under a deadline, for their signal
  (a file appearing, or a callable turning true), then check that the engine
  behind the URL is a *new* incarnation that has not been updated since it
  started, label it and verify it.

The label: vLLM gives every cold-loaded engine the weight version
``"default"`` and has no flag to choose another, so the recovery target's
label is set with ``POST /update_weight_version``. The transports never do
this after a transfer (a label written after the fact can be seen before it
is true); here no transfer happened: the process loaded the checkpoint
itself before the label was written, and nothing is admitted (the
controller is RECOVERING) until the verification below has run. The
evidence says so in ``unverified``.

Verification, the same evidence an update gives:

* the label, read back from ``/weight_info``;
* the policy probe computed from the checkpoint's own tensors
  (``probe.PolicyProbe``): the engine must reproduce the reference
  teacher-forced log-probabilities;
* engine checksums against a cold-load reference of the same checkpoint and
  layout, where one exists (``checksums.ReferenceChecksums``); parameters the
  CPU backend hashes as zero bytes count as unverifiable, never as matches;
* the checkpoint's content digest, read again right before the start, must
  still be the identity's: a checkpoint rewritten on disk is not "known".

Recovery can fail too (the start dies, the probe disagrees, the operator
never signals): the recoverer raises, or returns evidence whose problems
the controller sees, and the runner classifies it like any failure: the
engine stays TAINTED.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import Check, RecoveryEvidence, UpdateTarget, ValidationEvidence
from rolloutcore.core.versions import Provenance, WeightIdentity, WeightVersion
from rolloutcore.engine.http import Routes, VllmHTTP, check_timeout
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    RolloutCoreError,
)
from rolloutcore.transports.source import WeightSource
from rolloutcore.verification.checksums import (
    ChecksumComparison,
    ChecksumReport,
    ReferenceChecksums,
    WeightChecksums,
    checksum_map,
    compare_checksums,
)

if TYPE_CHECKING:
    import httpx

    from rolloutcore.engine.process import ManagedEngine
    from rolloutcore.verification.probe import PolicyProbe

__all__ = [
    "LABEL_NOTE",
    "ManagedRecoverer",
    "OperatorRecoverer",
    "RecoveryTimings",
    "set_weight_version",
]

STEP = "recover"

#: What every recovery evidence states about its label.
LABEL_NOTE = ("label set with POST /update_weight_version after a cold load of the "
              "checkpoint (no weight transfer happened; the label is not proof of the weights)")

_FRESH_LABEL = "default"  # what vLLM reports before anyone sets a weight version


def set_weight_version(base_url: str, label: str, *, timeout_s: float) -> None:
    """``POST /update_weight_version``: only for a cold-loaded engine (see the module doc)."""
    with VllmHTTP(base_url, timeout_s=timeout_s) as http:
        http.set_weight_version(label)


#: Reads a replacement engine's parameter checksums (base URL -> name -> checksum).
ChecksumReader = Callable[[str], Mapping[str, str]]


@dataclass
class RecoveryTimings:
    """Where a recovery's time went (seconds), and which incarnations it replaced."""

    old_epoch: str | None = None
    new_epoch: str | None = None
    base_url: str | None = None
    wait_s: float = 0.0      # operator signal (OperatorRecoverer)
    stop_s: float = 0.0      # old process group gone (ManagedRecoverer)
    start_s: float = 0.0     # new process healthy
    label_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    checks: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class _Checkpoint:
    """The known checkpoint: its identity, its probe and its reference checksums."""

    def __init__(self, checkpoint: str | os.PathLike[str], provenance: Provenance | None,
                 identity: WeightIdentity | None, reference: ReferenceChecksums
                 | Mapping[str, str] | None, probe: PolicyProbe | bool | None,
                 read_checksums: ChecksumReader | None = None) -> None:
        from rolloutcore.verification.probe import PolicyProbe

        if not isinstance(checkpoint, (str, os.PathLike)) or not str(checkpoint):
            raise BadInput(f"checkpoint must be a path, got {checkpoint!r}")
        path = Path(checkpoint)
        if not (path / "config.json").is_file():
            raise BadInput(f"{path} is not a model directory (no config.json)")
        self.path = path.resolve()
        if provenance is not None and not isinstance(provenance, Provenance):
            raise BadInput("provenance must be a Provenance or None")
        src = WeightSource.from_checkpoint(self.path)
        manifest, content = src.manifest().digest, src.content_digest()
        if identity is not None:
            if not isinstance(identity, WeightIdentity):
                raise BadInput("identity must be a WeightIdentity or None")
            if identity.manifest_digest != manifest:
                raise BadInput(f"{self.path}: its parameter manifest is not the identity's")
            if identity.content_digest not in (None, content):
                raise BadInput(f"{self.path}: its content digest {content[:12]} is not the "
                               f"identity's {identity.content_digest[:12]}")
            prov = provenance or identity.provenance
        else:
            prov = provenance or Provenance(str(self.path), "recovery", 0)
        # A fresh declaration: the controller sets the level the evidence reaches.
        self.identity = WeightIdentity(manifest, prov, content)
        if reference is not None:
            if isinstance(reference, ReferenceChecksums):
                if reference.content_digest != content:
                    raise BadInput("the reference checksums were taken from another "
                                   f"checkpoint ({reference.content_digest[:12]}, this one "
                                   f"is {content[:12]})")
            else:
                reference = checksum_map("reference (or ReferenceChecksums)", reference)
        self.reference = reference
        if read_checksums is not None and (not callable(read_checksums) or reference is None
                                           or isinstance(reference, ReferenceChecksums)):
            raise BadInput("read_checksums must be callable, and needs a reference mapping "
                           "of parameter name to checksum taken the same way (e.g. from a "
                           "cold engine on this checkpoint)")
        self.read_checksums = read_checksums
        if probe is not None and not isinstance(probe, (bool, PolicyProbe)):
            raise BadInput("probe must be a PolicyProbe, True (compute it from the "
                           "checkpoint) or False/None")
        self._probe: PolicyProbe | None = probe if isinstance(probe, PolicyProbe) else None
        self._want_probe = probe is True
        self._lock = threading.Lock()

    def probe(self) -> PolicyProbe | None:
        from rolloutcore.verification.probe import PolicyProbe

        with self._lock:
            if self._probe is None and self._want_probe:
                self._probe = PolicyProbe.from_checkpoint(str(self.path))
            return self._probe

    def check_unchanged(self) -> None:
        got = WeightSource.from_checkpoint(self.path).content_digest()
        if got != self.identity.content_digest:
            raise EffectError(STEP, f"checkpoint {self.path} changed on disk since its identity "
                              f"was taken ({got[:12]} != {str(self.identity.content_digest)[:12]})"
                              "; it is no longer a checkpoint of known identity")

    def _read_and_compare(self, base_url: str, ref: Mapping[str, str],
                          unverified: list[str]) -> Check:
        """The engine's checksums read the caller's way (a worker extension's hash of
        every parameter, where vLLM has no ``/weight_checker``), against ``ref``."""
        reader = self.read_checksums
        assert reader is not None
        try:
            got = checksum_map("what read_checksums returned", reader(base_url))
        except Exception as exc:  # fail closed: no reading is a failed check, not a pass
            return Check("engine_checksum", False,
                         f"could not read the engine's checksums: {exc!r}"[:500])
        cmp = compare_checksums(WeightChecksums(dict(got), {k: k for k in got}), ref)
        return _compared(cmp, cmp.total, unverified)

    def verify(self, http: VllmHTTP, target: WeightVersion, epoch: str,
               notes: list[str], timings: RecoveryTimings) -> RecoveryEvidence:
        """Label it, then observe it like an update's validation."""
        from rolloutcore.engine.verify import verify_engine

        t0 = time.monotonic()
        healthy = http.health()
        if not healthy:
            val = ValidationEvidence(None, False, checks=(Check(
                "health", False, "replacement engine answers /health with an error"),))
            return RecoveryEvidence(engine_epoch=epoch, identity=self.identity, validation=val,
                                    healthy=False, unverified=tuple(notes))
        tl = time.monotonic()
        unverified = list(notes)
        if http.has(Routes.UPDATE_WEIGHT_VERSION):
            http.set_weight_version(target.label)
            unverified.append(LABEL_NOTE)
        # else a vLLM without version labels (0.26): the label is not claimed, so
        # only the checks below can make this evidence (none: "no evidence at all").
        timings.label_s = time.monotonic() - tl
        wi = http.weight_info()
        if not wi.label_supported:
            unverified.append("no weight_version endpoint: label not verified")
        checks: list[Check] = []
        probe = self.probe()
        if probe is not None:
            # The engine cold-started on the checkpoint the probe was computed from:
            # the takeover's tolerance (the adapter keeps its calibration).
            checks.append(probe.run(http, UpdateTarget(target, self.identity, "recovery"),
                                    calibrating=True))
        else:
            unverified.append("no policy probe: the engine's policy was not compared with "
                              "the checkpoint's")
        ref = self.reference
        if ref is None:
            unverified.append("no reference checksums for the checkpoint: engine checksums "
                              "not compared")
        elif self.read_checksums is not None and not isinstance(ref, ReferenceChecksums):
            checks.append(self._read_and_compare(http.base_url, ref, unverified))
        elif not http.has(Routes.WEIGHT_CHECKER):
            unverified.append("no /weight_checker: engine checksums not compared")
        elif isinstance(ref, ReferenceChecksums):
            rep = verify_engine(http, ref)
            checks.append(_compared(rep, rep.engine_params, unverified))
        else:
            cmp = compare_checksums(http.weight_checksums(), ref)
            checks.append(_compared(cmp, cmp.total, unverified))
        paused = http.is_paused() if http.has(Routes.IS_PAUSED) else None
        timings.checks = [f"{c.name}={'pass' if c.passed else 'FAIL'}" for c in checks]
        val = ValidationEvidence(wi.label, wi.label_supported, paused=paused,
                                 checks=tuple(checks), elapsed_s=time.monotonic() - t0,
                                 unverified=tuple(unverified))
        timings.verify_s = time.monotonic() - t0
        return RecoveryEvidence(engine_epoch=epoch, identity=self.identity, validation=val,
                                healthy=healthy, unverified=tuple(unverified))


def _compared(cmp: ChecksumComparison | ChecksumReport, total: int,
              unverified: list[str]) -> Check:
    """A checksum comparison's check; parameters hashed as zero bytes noted as unverified."""
    if cmp.unverifiable:
        unverified.append(f"{len(cmp.unverifiable)} of {total} engine parameters hash as "
                          "zero bytes (repacked): not verifiable")
    return cmp.to_check()


class _Recovery:
    """What both recoverers keep: the known checkpoint, the last timings, and the engine
    client a recovery reads through (``_reading``), which the watchdog unblocks."""

    known: _Checkpoint
    last: RecoveryTimings | None

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._http: VllmHTTP | None = None
        self.last = None

    @property
    def identity(self) -> WeightIdentity:
        return self.known.identity

    @contextlib.contextmanager
    def _reading(self, http: VllmHTTP) -> Iterator[VllmHTTP]:
        with self._lock:
            self._http = http
        try:
            yield http
        finally:
            with self._lock:
                self._http = None
            http.close()

    def _unblock(self) -> None:
        with self._lock:
            http = self._http
        if http is not None:
            http.cancel_inflight()


class ManagedRecoverer(_Recovery):
    """Replaces a ``ManagedEngine``'s process with a new one on a known checkpoint.

    ``reference``: cold-load checksums of the checkpoint (strongly advised);
    ``probe``: a ``PolicyProbe`` of the checkpoint, ``True`` to compute it
    from the checkpoint on first use, ``False`` for none. ``on_replaced`` is
    called with the engine once the new process is healthy, before it is
    verified (e.g. to point a proxy at a changed port). ``read_checksums``:
    where vLLM has no ``/weight_checker`` (0.26), how the replacement's
    parameter checksums are read instead (``base_url -> {name: checksum}``,
    e.g. ``rolloutcore.transports.cuda_ipc.recovery_checksums``), compared
    with ``reference`` (a mapping taken the same way from a cold engine on
    the checkpoint); a reading that fails is a failed check.
    """

    def __init__(self, engine: ManagedEngine | Any, checkpoint: str | os.PathLike[str], *,
                 provenance: Provenance | None = None, identity: WeightIdentity | None = None,
                 reference: ReferenceChecksums | Mapping[str, str] | None = None,
                 probe: PolicyProbe | bool | None = True, start_timeout_s: float | None = None,
                 stop_grace_s: float = 5.0, http_timeout_s: float = 60.0,
                 on_replaced: Callable[[ManagedEngine], None] | None = None,
                 read_checksums: ChecksumReader | None = None) -> None:
        from rolloutcore.engine.process import ManagedEngine

        # A ManagedEngine, or a handle with its interface (a fleet's Ray-placed engine,
        # whose process lives in an actor: rolloutcore.fleet.placement.RayEngine).
        if not isinstance(engine, ManagedEngine) and not all(
                callable(getattr(engine, a, None))
                for a in ("stop", "restart", "alive", "signal_group")):
            raise BadInput("engine must be a ManagedEngine (for an engine we did not launch, "
                           "use OperatorRecoverer)")
        self.engine = engine
        self.known = _Checkpoint(checkpoint, provenance, identity, reference, probe,
                                 read_checksums)
        self.start_timeout_s = (None if start_timeout_s is None
                                else check_timeout(start_timeout_s, "start_timeout_s"))
        self.stop_grace_s = check_timeout(stop_grace_s, "stop_grace_s")
        self.http_timeout_s = check_timeout(http_timeout_s, "http_timeout_s")
        if on_replaced is not None and not callable(on_replaced):
            raise BadInput("on_replaced must be callable")
        self.on_replaced = on_replaced
        super().__init__()
        self._cancelled = False

    def _check_cancelled(self) -> None:
        with self._lock:
            if self._cancelled:
                raise EffectError(STEP, "recovery cancelled by its watchdog")

    def replace_engine(self, target: WeightVersion) -> RecoveryEvidence:
        if not isinstance(target, WeightVersion):
            raise BadInput("target must be a WeightVersion")
        with self._lock:
            self._cancelled = False
        t0 = time.monotonic()
        timings = RecoveryTimings()
        self.last = timings
        eng = self.engine
        with contextlib.suppress(BadInput):
            timings.old_epoch = eng.epoch
        # The old incarnation goes, whatever it is doing: a tainted engine serves no one.
        eng.stop(grace_s=self.stop_grace_s)
        timings.stop_s = time.monotonic() - t0
        self.known.check_unchanged()
        self._check_cancelled()
        ts = time.monotonic()
        eng.restart(self.known.path, timeout_s=self.start_timeout_s)
        timings.start_s = time.monotonic() - ts
        try:
            self._check_cancelled()  # cancelled while starting, after the start began
        except EffectError:
            eng.stop(grace_s=0.5)
            raise
        timings.new_epoch, timings.base_url = eng.epoch, eng.base_url
        if timings.new_epoch == timings.old_epoch:
            raise EffectError(STEP, "the restarted engine reports the old epoch")
        if self.on_replaced is not None:
            self.on_replaced(eng)
        with self._reading(VllmHTTP(eng.base_url, timeout_s=self.http_timeout_s)) as http:
            notes = [f"engine process replaced: epoch {timings.old_epoch} -> "
                     f"{timings.new_epoch}, cold start {timings.start_s:.1f}s"]
            ev = self.known.verify(http, target, eng.epoch, notes, timings)
        timings.total_s = time.monotonic() - t0
        return ev

    def cancel(self) -> None:
        """Watchdog: a start in progress is killed (it then fails), a verification unblocked."""
        with self._lock:
            self._cancelled = True
        self._unblock()
        if self.engine.alive():
            with contextlib.suppress(OSError, BadInput):
                self.engine.signal_group(signal.SIGKILL)


Signal = str | os.PathLike[str] | Callable[[], bool]


class OperatorRecoverer(_Recovery):
    """Waits for an operator to replace an engine we do not own, then verifies it.

    ``signal`` is a path (the operator creates the file once the new engine
    is up; it is removed when consumed, so one signal serves one recovery)
    or a callable that returns true once the engine is replaced. ``wait_s``
    bounds the wait; on expiry the recovery fails (EffectTimeout) and the
    engine stays TAINTED. ``previous_epoch`` is the tainted incarnation's
    epoch, as ``VllmAdapter`` derives it (``vllm-<instance_id>``).
    """

    def __init__(self, base_url: str, checkpoint: str | os.PathLike[str], *, signal: Signal,
                 wait_s: float, poll_s: float = 0.5, previous_epoch: str | None = None,
                 provenance: Provenance | None = None, identity: WeightIdentity | None = None,
                 reference: ReferenceChecksums | Mapping[str, str] | None = None,
                 probe: PolicyProbe | bool | None = True, health_s: float = 60.0,
                 http_timeout_s: float = 60.0,
                 read_checksums: ChecksumReader | None = None,
                 transport: httpx.BaseTransport | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise BadInput(f"base_url must be an http(s) URL, got {base_url!r}")
        if not (callable(signal) or isinstance(signal, (str, os.PathLike))) or (
                isinstance(signal, str) and not signal):
            raise BadInput("signal must be a file path or a callable returning bool")
        self.base_url = base_url.rstrip("/")
        self.signal = signal
        self.wait_s = check_timeout(wait_s, "wait_s")
        self.poll_s = check_timeout(poll_s, "poll_s")
        self.health_s = check_timeout(health_s, "health_s")
        self.http_timeout_s = check_timeout(http_timeout_s, "http_timeout_s")
        if previous_epoch is not None and (not isinstance(previous_epoch, str)
                                           or not previous_epoch):
            raise BadInput("previous_epoch must be a non-empty string or None")
        self.previous_epoch = previous_epoch
        self.known = _Checkpoint(checkpoint, provenance, identity, reference, probe,
                                 read_checksums)
        super().__init__()
        self._stop = threading.Event()
        self._transport = transport  # the engine client's (a test's FakeVllm)

    def _signalled(self) -> bool:
        sig = self.signal
        if callable(sig):
            return bool(sig())
        p = Path(sig)
        if not p.exists():
            return False
        with contextlib.suppress(FileNotFoundError):
            p.unlink()  # consumed: a stale signal must not start the next recovery
        return True

    def _wait(self, seconds: float, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + seconds
        while not ready():
            if self._stop.is_set():
                raise EffectError(STEP, f"recovery cancelled by its watchdog while waiting "
                                  f"for {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise EffectTimeout(STEP, seconds)
            self._stop.wait(min(self.poll_s, left))

    def replace_engine(self, target: WeightVersion) -> RecoveryEvidence:
        if not isinstance(target, WeightVersion):
            raise BadInput("target must be a WeightVersion")
        self._stop.clear()
        t0 = time.monotonic()
        timings = RecoveryTimings(old_epoch=self.previous_epoch, base_url=self.base_url)
        self.last = timings
        self._wait(self.wait_s, "the operator's signal", self._signalled)
        timings.wait_s = time.monotonic() - t0
        with self._reading(VllmHTTP(self.base_url, timeout_s=self.http_timeout_s,
                                    transport=self._transport)) as http:
            ts = time.monotonic()

            def healthy() -> bool:
                try:
                    return http.health(timeout_s=min(5.0, self.http_timeout_s))
                except RolloutCoreError:
                    return False

            self._wait(self.health_s, "the replacement engine's /health", healthy)
            timings.start_s = time.monotonic() - ts
            epoch = self._epoch(http)
            timings.new_epoch = epoch
            label = http.label()
            if label not in (None, _FRESH_LABEL):
                raise EffectError(STEP, f"the engine at {self.base_url} reports weight version "
                                  f"{label!r}: it was updated since it started, so it is not a "
                                  "fresh load of the checkpoint")
            self.known.check_unchanged()
            notes = [f"engine replaced by an operator: epoch {self.previous_epoch} -> {epoch}"]
            ev = self.known.verify(http, target, epoch, notes, timings)
        timings.total_s = time.monotonic() - t0
        return ev

    def _epoch(self, http: VllmHTTP) -> str:
        """The incarnation's epoch as ``VllmAdapter.bootstrap`` derives it."""
        instance_id = None
        if http.has(Routes.SERVER_INFO):
            cfg = http.server_info().get("vllm_config")
            if isinstance(cfg, dict):
                instance_id = cfg.get("instance_id")
        if not isinstance(instance_id, str) or not instance_id:
            raise EffectError(STEP, "the engine does not identify its incarnation (no "
                              "instance_id): cannot tell that it was replaced")
        epoch = f"vllm-{instance_id}"
        if epoch == self.previous_epoch:
            raise EffectError(STEP, f"the engine at {self.base_url} is still the tainted "
                              f"incarnation ({epoch}): it was not replaced")
        return epoch

    def cancel(self) -> None:
        self._stop.set()
        self._unblock()
