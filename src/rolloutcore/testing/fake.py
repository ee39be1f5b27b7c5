"""An in-process simulated engine and its adapter: fast unit tests and the no-install demo.

It models the behaviours that decide correctness, not speed:

* requests take time (one token per ``token_delay_s``) and are in flight
  while they generate; each generated token is tagged with the engine's
  version label at the moment it was produced (like vLLM's ``weight_versions``);
* the pause modes: ``abort`` finishes in-flight requests as aborted, ``wait``
  lets them finish and holds new ones until resume, ``keep`` freezes them
  and lets them continue after resume (so they span versions);
* a prefix cache keyed by block-aligned token prefixes that stores the
  "KV" computed under the weights of the time, survives a weight change
  unless reset, and is really reused: a stale entry changes the output;
* weights whose digest changes the generated tokens;
* a prefix-cache reset that, like vLLM's, answers ``success: false`` while
  requests are running;
* injectable faults at every effect: raise, hang (until cancelled), lie in
  the body, die mid-transfer;
* vLLM's sleep levels (colocated training): level 1 keeps a host copy of the
  weights, level 2 forgets them (a wake brings back memory of garbage, so
  what the engine then generates is not the policy's); the KV cache is
  dropped; the scheduler stays paused until everything is awake (vLLM 0.32;
  ``wake_resumes="always"`` is the older vLLM that resumes on any wake);
  a weight write or a request that meets asleep memory kills the engine, as
  the real one crashes (vLLM #57853); the device memory it holds in each
  condition (``memory()``).

``FakeAdapter`` is a ``LifecycleAdapter`` like any other, a
``HealthObserver``, an ``ExpectationTaker`` (a remote trainer's probe:
``fake_probe`` computes one from ``FakeWeights`` as a trainer would, and the
engine scores it with ``FakeEngine.score``), a ``WriteObserver`` (the
engine counts its weight-update calls, as vLLM does) and a ``Sleeper``;
``FakeRecoverer`` is a ``Recoverer``.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rolloutcore.core.evidence import (
    BootstrapEvidence,
    CacheKind,
    CacheResetEvidence,
    Check,
    DrainEvidence,
    HealthEvidence,
    PauseMode,
    PreflightEvidence,
    RecoveryEvidence,
    ResumeEvidence,
    SleepEvidence,
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
    WakeEvidence,
    WakeTags,
)
from rolloutcore.core.lifecycle import Step
from rolloutcore.core.speculative import engine_draft_refusal
from rolloutcore.core.versions import (
    VerificationLevel,
    WeightVersion,
)
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable, TransferError
from rolloutcore.testing.fake_engine import (
    FakeEngine,
    FakeStream,
    FakeWeights,
    Fault,
    FaultKind,
    Generation,
    fake_logprob,
    fake_probe,
    reference_tokens,
)

if TYPE_CHECKING:  # the demo runs this module with nothing installed
    from rolloutcore.verification.probe import PolicyProbe

__all__ = [
    "FakeAdapter",
    "FakeRecoverer",
    "FakeEngine",
    "FakeStream",
    "FakeWeights",
    "Fault",
    "FaultKind",
    "Generation",
    "fake_logprob",
    "fake_probe",
    "reference_tokens",
]

class FakeAdapter:
    """The port over a ``FakeEngine``. ``stage`` sets what the next transfer sends."""

    caches: tuple[CacheKind, ...] = (CacheKind.PREFIX, CacheKind.ENCODER, CacheKind.MULTIMODAL)

    def __init__(self, engine: FakeEngine, *, probe_prompts: tuple[tuple[int, ...], ...] = (
            tuple(range(40)), tuple(range(100, 133))), probe_tokens: int = 8) -> None:
        self.engine = engine
        self.faults: dict[str, Fault] = {}
        self._staged: FakeWeights | None = None
        self._cancel = threading.Event()
        self._probe_prompts = probe_prompts
        self._probe_tokens = probe_tokens
        #: transfer fault helper: names to skip silently (a transport bug)
        self.skip_params: set[str] = set()
        self._epoch_at_bootstrap: str | None = None
        # A remote trainer's expectations (``expect``): used instead of the staged
        # weights, which a remote trainer never hands over.
        self._remote = False
        self._probes: PolicyProbe | None = None
        self._reference: Mapping[str, str] | None = None
        self._ops_verified: int | None = None
        self._ops_at_drain: int | None = None
        # The sleep this adapter put the engine in, until it serves again: its level,
        # the pools woken since, whether a transfer wrote the weights since, and the
        # per-parameter digests taken before it (for a wake on the same weights).
        self._slept: int | None = None
        self._woken: set[str] = set()
        self._wrote = False
        self._sleep_ref: dict[str, str] | None = None
        #: what an adapter call refused before touching the engine, in order (tests)
        self.refusals: list[str] = []
        #: the engine's draft (``FakeEngine.draft``), read at bootstrap as VllmAdapter does
        self.draft_method: str | None = None

    # -------------------------------------------------------------- set-up
    def stage(self, weights: FakeWeights) -> None:
        if not isinstance(weights, FakeWeights):
            raise BadInput("stage needs FakeWeights")
        self._staged = weights
        self._remote = False

    def expect(self, *, probes: PolicyProbe | None, reference_checksums: Mapping[str, str] | None,
               calibrating: bool = False) -> None:
        """A remote trainer's expectations: ``probes`` (``fake_probe``) and, as its
        reference checksum, ``{"fake-digest": weights.digest}``. The fake engine
        computes exactly: there is no noise to calibrate (``calibrating`` changes
        nothing)."""
        self._remote = True
        self._staged = None
        self._probes = probes
        self._reference = None if reference_checksums is None else dict(reference_checksums)

    def check_sent(self, sent: Mapping[str, Any]) -> None:
        raise BadInput("the fake engine's transport reports no checksum of what it sent")

    def expect_sent(self, sent: Mapping[str, Any] | None) -> None:
        if sent is not None:
            self.check_sent(sent)

    def writes_since_drain(self, *, timeout_s: float = 5.0) -> tuple[str, ...] | None:
        if self._ops_at_drain is None or self.engine.dead:
            return None
        n = self.engine.weight_ops - self._ops_at_drain
        return (f"{n} weight-update call(s)",) if n else ()

    def inject(self, effect: str, kind: FaultKind, times: int = 1) -> None:
        valid = {"bootstrap", "drain", "preflight", "transfer", "reset_prefix",
                 "reset_encoder", "reset_multimodal", "validate", "validate_live", "resume",
                 "sleep", "wake_weights", "wake_kv_cache", "wake_all"}
        if effect not in valid:
            raise BadInput(f"unknown effect {effect!r}; one of {sorted(valid)}")
        self.faults[effect] = Fault(FaultKind(kind), times)

    def _fault(self, effect: str) -> FaultKind | None:
        f = self.faults.get(effect)
        if f is None or f.times <= 0:
            return None
        f.times -= 1
        if f.kind is FaultKind.RAISE:
            # A 500 from /sleep or /wake_up leaves the engine's memory unknown.
            raise EngineUnavailable(effect, "injected server error (HTTP 500)",
                                    mutation_started=effect == "transfer" or
                                    effect.startswith(("sleep", "wake")))
        if f.kind is FaultKind.HANG:
            self._cancel.clear()
            self._cancel.wait()
            raise EngineUnavailable(effect, "cancelled while hanging")
        if f.kind is FaultKind.DIE and effect != "transfer":
            self.engine.kill()
            raise EngineUnavailable(effect, "engine died")
        return f.kind

    # -------------------------------------------------------------- the port
    def bootstrap(self) -> BootstrapEvidence:
        self._fault("bootstrap")
        e = self.engine
        self._epoch_at_bootstrap = e.epoch
        self._ops_verified = e.weight_ops
        self.draft_method = e.draft
        return BootstrapEvidence(engine_epoch=e.epoch, healthy=not e.dead,
                                 observed_label=e.label, label_supported=True,
                                 capabilities=frozenset({"fake"}),
                                 engine_info={"engine": "fake", "paused": e.paused})

    def observe_health(self, *, timeout_s: float = 5.0) -> HealthEvidence:
        """Between updates: dead, or a different process than the one bootstrapped."""
        e = self.engine
        if e.dead:
            return HealthEvidence(False, False, reason="engine process is dead")
        restarted = self._epoch_at_bootstrap is not None and e.epoch != self._epoch_at_bootstrap
        base = self._ops_verified
        n = 0 if base is None or restarted else e.weight_ops - base
        return HealthEvidence(True, True, restarted,
                              f"epoch {self._epoch_at_bootstrap} is now {e.epoch}"
                              if restarted else "", observed_label=e.label,
                              writes=(f"{n} weight-update call(s)",) if n else ())

    def _refuse_asleep(self, step: str, what: str, pool: str = "weights") -> None:
        """Refuse before any engine call while ``pool`` sleeps (``mutation_started=False``)."""
        if self._slept is not None and pool not in self._woken:
            self.refusals.append(step)
            raise EffectError(step, f"the engine is asleep ({pool} released): {what} refused "
                              f"before reaching it", mutation_started=False)

    def drain(self, mode: PauseMode, *, clear_cache: bool = False) -> DrainEvidence:
        self._refuse_asleep("drain", "a drain for an update")
        t0 = time.monotonic()
        fk = self._fault("drain")
        self._ops_at_drain = self.engine.weight_ops
        self.engine.pause(mode, clear_cache=clear_cache)
        paused = fk is not FaultKind.LIE and self.engine.paused
        return DrainEvidence(paused=paused, mode=mode,
                             engine_in_flight=self.engine.in_flight,
                             cleared=paused and clear_cache,
                             elapsed_s=time.monotonic() - t0)

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        fk = self._fault("preflight")
        if self._staged is None:
            raise EffectError("preflight", "nothing staged", mutation_started=False)
        src = self._staged
        digest = src.manifest.digest if fk is not FaultKind.LIE else "0" * 64
        return PreflightEvidence(source_manifest_digest=digest,
                                 source_provenance=src.provenance,
                                 detail="" if self.draft_method is None
                                 else engine_draft_refusal(self.draft_method))

    def transfer(self, target: UpdateTarget) -> TransferEvidence:
        t0 = time.monotonic()
        if self._staged is None:
            raise TransferError("transfer", "nothing staged", mutation_started=False)
        if self._slept is not None and "weights" not in self._woken:
            self.refusals.append("transfer")
            raise TransferError("transfer", "the engine is asleep (weights released): "
                                "nothing sent", mutation_started=False)
        fk = self._fault("transfer")
        self._wrote = self._wrote or self._slept is not None
        e = self.engine
        e.start_update()
        n = nbytes = 0
        items = sorted(self._staged.tensors.items())
        for i, (name, data) in enumerate(items):
            if fk is FaultKind.DIE and i >= len(items) // 2:
                e.kill()
                raise TransferError("transfer", f"engine died after {i} of {len(items)} tensors")
            if name in self.skip_params:
                continue
            e.load(name, data)
            n += 1
            nbytes += len(data)
        label = target.version.label
        e.finish_update(label)
        return TransferEvidence(completed=fk is not FaultKind.LIE, mutation_started=True,
                                backend="fake", tensors=n, bytes=nbytes, finish_label=label,
                                error="transport reported a partial send" if fk else None,
                                elapsed_s=time.monotonic() - t0)

    def reset_cache(self, cache: CacheKind) -> CacheResetEvidence:
        self._refuse_asleep("invalidate", "a cache reset", "kv_cache")
        fk = self._fault(f"reset_{cache.value}")
        ok = self.engine.reset_prefix_cache() if cache is CacheKind.PREFIX else True
        if fk is FaultKind.LIE:
            ok = False
        return CacheResetEvidence(cache=cache, http_status=200, engine_success=ok)

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        fk = self._fault("validate_live" if live else "validate")
        e = self.engine
        if not live and self._slept is not None:
            return self._validate_wake(target, fk)
        if self._remote:
            return self._validate_remote(target, live, fk)
        self._ops_verified = e.weight_ops
        if not live:
            staged = self._staged.digest if self._staged else None
            match = staged is not None and e.weights_digest == staged
            if fk is FaultKind.LIE:
                match = True
            return ValidationEvidence(
                observed_label=e.label, label_supported=True, paused=e.paused,
                checks=(Check("engine-checksum", match,
                              "engine weight digest vs staged source digest", coverage=1.0,
                              level=VerificationLevel.ENGINE_CHECKSUM),))
        if self._staged is None:
            return None
        worst = 0
        for p in self._probe_prompts:
            # Salted by the target, as vLLM's probe (prompt logprobs) never reads the
            # prefix cache: a keep-mode update leaves the old entries in place.
            got = e.generate(list(p), self._probe_tokens,
                             cache_salt=f"probe:{target.version.label}").tokens
            want = reference_tokens(self._staged.digest, list(p), self._probe_tokens)
            worst = max(worst, sum(a != b for a, b in zip(got, want, strict=True)))
        passed = worst == 0 and fk is None
        return ValidationEvidence(
            observed_label=e.label, label_supported=True, paused=False,
            checks=(Check("policy-probe", passed,
                          f"{len(self._probe_prompts)} probes, worst mismatching tokens {worst}",
                          max_abs_diff=float(worst), tolerance=0.0,
                          level=VerificationLevel.PROBE),))

    def _validate_remote(self, target: UpdateTarget, live: bool,
                         fk: FaultKind | None) -> ValidationEvidence | None:
        """Against a remote trainer's expectations only: the staged weights are unknown."""
        e = self.engine
        self._ops_verified = e.weight_ops
        if not live:
            checks: tuple[Check, ...] = ()
            if self._reference is not None:
                match = e.weights_digest == self._reference.get("fake-digest")
                checks = (Check("engine-checksum", match or fk is FaultKind.LIE,
                                "engine weight digest vs the trainer's reference",
                                coverage=1.0, level=VerificationLevel.ENGINE_CHECKSUM),)
            return ValidationEvidence(observed_label=e.label, label_supported=True,
                                      paused=e.paused, checks=checks)
        if self._probes is None:
            return None
        check = self._probes.run(e, target)
        if fk is not None:
            check = Check(check.name, False, f"injected {fk.value}: {check.detail}",
                          level=check.level)
        return ValidationEvidence(observed_label=e.label, label_supported=True, paused=False,
                                  checks=(check,))
    def _validate_wake(self, target: UpdateTarget, fk: FaultKind | None) -> ValidationEvidence:
        """After a wake: every parameter, against the update's source when one was sent
        since the sleep, against the digests from before the sleep when none was."""
        e = self.engine
        now = {n: hashlib.sha256(b).hexdigest() for n, b in e.weight_bytes().items()}
        if self._wrote:
            src = self._staged.tensors if self._staged is not None else {}
            want: dict[str, str] | None = {n: hashlib.sha256(b).hexdigest()
                                           for n, b in src.items()}
            against = "the update's source"
        else:
            want, against = self._sleep_ref, "the digests taken before the sleep"
        matched = 0 if want is None else sum(want.get(n) == d for n, d in now.items())
        passed = want is not None and matched == len(now) and set(want) == set(now)
        if fk is FaultKind.LIE:
            passed, matched = True, len(now)
        detail = (f"{matched} of {len(now)} engine parameters equal {against}" if want
                  is not None else "no digests were taken before the sleep: nothing to "
                  "compare a wake on the same weights with")
        return ValidationEvidence(
            observed_label=e.label, label_supported=True, paused=e.paused,
            checks=(Check("engine-parameters", passed, detail,
                          coverage=matched / len(now) if now else 0.0,
                          level=VerificationLevel.ENGINE_CHECKSUM),))

    # -------------------------------------------------------------- the Sleeper
    def forget_sleep(self) -> None:
        """The engine serves again (resumed, or replaced): no sleep of ours is in progress."""
        self._slept, self._woken, self._wrote, self._sleep_ref = None, set(), False, None

    @property
    def asleep(self) -> int | None:
        """The level of the sleep this adapter put the engine in (None: not asleep)."""
        return self._slept

    def sleep(self, level: int, *, reference: bool) -> SleepEvidence:
        t0 = time.monotonic()
        e = self.engine
        if not e.sleep_mode:
            self.refusals.append("sleep")
            raise EffectError("sleep", "the engine has no sleep mode (started without "
                              "--enable-sleep-mode): nothing was sent", mutation_started=False)
        ref = ({n: hashlib.sha256(b).hexdigest() for n, b in e.weight_bytes().items()}
               if reference else None)
        before = {**e.memory(), "source": "fake worker"}
        fk = self._fault("sleep")
        e.sleep(level)
        self._slept, self._woken, self._wrote, self._sleep_ref = level, set(), False, ref
        return SleepEvidence(level=level, is_sleeping_after=e.is_sleeping and fk is None,
                             paused_after=e.paused,
                             memory_before=before,
                             memory_after={**e.memory(), "source": "fake worker"},
                             reference_params=0 if ref is None else len(ref),
                             elapsed_s=time.monotonic() - t0)

    def wake(self, tags: WakeTags) -> WakeEvidence:
        t0 = time.monotonic()
        if not isinstance(tags, WakeTags):
            raise BadInput("tags must be WakeTags")
        fk = self._fault(f"wake_{tags.value}")
        e = self.engine
        awake = e.wake(tags.value)
        self._woken |= ({"weights", "kv_cache"} if tags is WakeTags.ALL else {tags.value})
        repaused = False
        if not e.paused:
            # The engine resumed its scheduler on its own: hold it before anything runs.
            e.pause(PauseMode.WAIT)
            repaused = True
        return WakeEvidence(tags=tags, fully_awake=awake, paused_after=e.paused,
                            repaused=repaused, memory_after={**e.memory(),
                                                             "source": "fake worker"},
                            detail="lied about the wake" if fk is FaultKind.LIE else "",
                            elapsed_s=time.monotonic() - t0)

    def resume(self) -> ResumeEvidence:
        fk = self._fault("resume")
        self.forget_sleep()
        self.engine.resume()
        return ResumeEvidence(resumed=True,
                              is_paused_after=True if fk is FaultKind.LIE else self.engine.paused)

    def fence(self) -> None:
        if not self.engine.dead:
            self.engine.pause(PauseMode.ABORT, timeout_s=1.0)

    def cancel(self, step: Step) -> None:
        self._cancel.set()

    def close(self) -> None:
        self._cancel.set()


class FakeRecoverer:
    """Replaces the adapter's engine with a new one (new epoch) on known weights."""

    def __init__(self, adapter: FakeAdapter, weights: FakeWeights, *,
                 fail: bool = False) -> None:
        self.adapter = adapter
        self.weights = weights
        self.fail = fail

    def replace_engine(self, target: WeightVersion) -> RecoveryEvidence:
        t0 = time.monotonic()
        old = self.adapter.engine
        old.kill()
        new = FakeEngine(self.weights, token_delay_s=old.token_delay_s,
                         block_size=old.block_size, sleep_mode=old.sleep_mode,
                         wake_resumes=old.wake_resumes)
        if self.fail:
            new.kill()
            raise EngineUnavailable("recover", "replacement engine died at start")
        new.label = target.label  # a cold load: the label is given at load time
        self.adapter.engine = new
        self.adapter._epoch_at_bootstrap = new.epoch  # the process health is checked against
        self.adapter._ops_verified = new.weight_ops
        self.adapter.forget_sleep()
        self.adapter.faults.clear()
        self.adapter.stage(self.weights)
        live = self.adapter.validate(UpdateTarget(target, self.weights.identity(), "recovery"),
                                     live=True)
        assert live is not None
        return RecoveryEvidence(engine_epoch=new.epoch, identity=self.weights.identity(),
                                validation=live, healthy=not new.dead,
                                elapsed_s=time.monotonic() - t0)

    def cancel(self) -> None:
        self.adapter.cancel(Step.RECOVER)
