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
``HealthObserver`` and a ``Sleeper``; ``FakeRecoverer`` is a ``Recoverer``.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

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
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable, TransferError

__all__ = [
    "FakeAdapter",
    "FakeRecoverer",
    "FakeEngine",
    "FakeWeights",
    "Fault",
    "FaultKind",
    "Generation",
    "reference_tokens",
]

VOCAB = 256


def _h(*parts: object) -> bytes:
    m = hashlib.sha256()
    for p in parts:
        m.update(repr(p).encode())
        m.update(b"\x00")
    return m.digest()


@dataclass(frozen=True)
class FakeWeights:
    """Named byte tensors; ``from_seed`` makes a policy, same shapes for every seed."""

    tensors: Mapping[str, bytes]
    provenance: Provenance

    @classmethod
    def from_seed(cls, seed: int, *, step: int = 0, n_params: int = 4,
                  size: int = 64) -> FakeWeights:
        t = {f"layers.{i}.weight": (_h(seed, i) * (size // 32 + 1))[:size]
             for i in range(n_params)}
        return cls(t, Provenance(f"fake-seed-{seed}", "fake-run", step))

    @property
    def manifest(self) -> ParameterManifest:
        return ParameterManifest.from_items((n, (len(b),), "uint8")
                                            for n, b in self.tensors.items())

    @property
    def digest(self) -> str:
        return hashlib.sha256(b"".join(_h(n, self.tensors[n]) for n in sorted(self.tensors))
                              ).hexdigest()

    def identity(self) -> WeightIdentity:
        return WeightIdentity.declare(self.manifest, self.provenance, self.digest)


def _kv_step(kv: bytes, token: int, wdigest: str) -> bytes:
    return _h(kv, token, wdigest)


def _next_token(kv: bytes, wdigest: str) -> int:
    return _h(kv, "next", wdigest)[0] % VOCAB


def reference_tokens(weights_digest: str, prompt: list[int], n: int) -> list[int]:
    """What a fresh engine (empty cache) serving these weights generates, greedily."""
    kv = b""
    for t in prompt:
        kv = _kv_step(kv, t, weights_digest)
    out = []
    for _ in range(n):
        tok = _next_token(kv, weights_digest)
        out.append(tok)
        kv = _kv_step(kv, tok, weights_digest)
    return out


@dataclass
class Generation:
    request_id: str
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    token_labels: list[str] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None

    @property
    def version_spans(self) -> list[dict[str, object]]:
        """Contiguous spans {version, start, end} over the output, as vLLM reports them."""
        spans: list[dict[str, object]] = []
        for i, lab in enumerate(self.token_labels):
            if spans and spans[-1]["version"] == lab:
                spans[-1]["end"] = i + 1
            else:
                spans.append({"version": lab, "start": i, "end": i + 1})
        return spans


class FaultKind(enum.StrEnum):
    RAISE = "raise"        # the effect fails with a server error
    HANG = "hang"          # the effect blocks until cancelled
    LIE = "lie"            # the effect answers "ok" at transport level, the body says otherwise
    DIE = "die"            # the engine dies in the middle of the effect


@dataclass
class Fault:
    kind: FaultKind
    times: int = 1


class FakeEngine:
    """The simulated engine. Thread-safe; ``generate`` blocks like an HTTP call would."""

    #: (device total, weights, KV cache, the rest) bytes of the memory model:
    #: Qwen3-8B-like proportions, as seen on the H200 at gpu-memory-utilization 0.45.
    MEMORY = (140 << 30, 16 << 30, 46 << 30, 1 << 30)

    def __init__(self, weights: FakeWeights, *, token_delay_s: float = 0.002,
                 block_size: int = 16, sleep_mode: bool = True,
                 wake_resumes: str = "when_awake") -> None:
        if token_delay_s < 0 or block_size <= 0:
            raise BadInput("token_delay_s must be >= 0 and block_size > 0")
        if wake_resumes not in ("when_awake", "always"):
            raise BadInput("wake_resumes must be 'when_awake' or 'always'")
        self.sleep_mode = bool(sleep_mode)
        self.wake_resumes = wake_resumes
        self._asleep: set[str] = set()   # "weights", "kv_cache"
        self.sleep_level: int | None = None
        self._host: dict[str, bytes] | None = None
        self._garbage = 0
        self.token_delay_s = token_delay_s
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex[:12]
        self.label = "default"
        self._weights = dict(weights.tensors)
        self._wdigest = weights.digest
        self._cond = threading.Condition()
        self._paused: PauseMode | None = None
        self._in_flight: dict[str, Generation] = {}
        self._abort_ids: set[str] = set()
        self._cache: dict[tuple[int, ...], bytes] = {}
        self._updating = False
        self.dead = False
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._ids = 0

    # -------------------------------------------------------------- inspection
    @property
    def weights_digest(self) -> str:
        with self._cond:
            return self._wdigest

    @property
    def in_flight(self) -> int:
        with self._cond:
            return len(self._in_flight)

    @property
    def paused(self) -> bool:
        with self._cond:
            return self._paused is not None

    def weight_bytes(self) -> dict[str, bytes]:
        with self._cond:
            return dict(self._weights)

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnavailable("engine", "engine process is dead")

    @property
    def asleep(self) -> frozenset[str]:
        """The memory pools asleep now ("weights", "kv_cache")."""
        with self._cond:
            return frozenset(self._asleep)

    @property
    def is_sleeping(self) -> bool:
        """vLLM's ``/is_sleeping``: true while anything sleeps *or* the scheduler is paused."""
        with self._cond:
            return bool(self._asleep) or self._paused is not None

    def memory(self) -> dict[str, int]:
        """Device memory as the engine's worker sees it: what its pools hold now."""
        total, w, kv, rest = self.MEMORY
        with self._cond:
            used = rest + (0 if "weights" in self._asleep else w) + (
                0 if "kv_cache" in self._asleep else kv)
        return {"used_bytes": used, "free_bytes": total - used, "total_bytes": total}

    def _crash(self, why: str) -> EngineUnavailable:
        """What the real engine does when its kernels meet released memory."""
        self.dead = True
        self._cond.notify_all()
        return EngineUnavailable("engine", f"engine core died: {why}")

    # -------------------------------------------------------------- serving
    def generate(self, prompt: list[int], max_tokens: int,
                 request_id: str | None = None) -> Generation:
        if not prompt or any(not isinstance(t, int) or not 0 <= t < VOCAB for t in prompt):
            raise BadInput(f"prompt must be non-empty token ids in [0, {VOCAB})")
        if max_tokens <= 0:
            raise BadInput("max_tokens must be positive")
        with self._cond:
            self._alive()
            # New requests are held while paused (vLLM queues them until resume).
            while self._paused is not None and not self.dead:
                self._cond.wait(0.05)
            self._alive()
            if self._asleep:  # a scheduler resumed against asleep memory
                raise self._crash(f"illegal memory access ({sorted(self._asleep)} asleep)")
            self._ids += 1
            rid = request_id or f"req-{self._ids}"
            g = Generation(rid, list(prompt))
            self._in_flight[rid] = g
            kv, cached = self._prefill(prompt)
            g.cached_tokens = cached
        try:
            for _ in range(max_tokens):
                if self.token_delay_s:
                    time.sleep(self.token_delay_s)
                with self._cond:
                    while self._paused is PauseMode.KEEP and not self.dead:
                        self._cond.wait(0.05)
                    self._alive()
                    if rid in self._abort_ids:
                        g.finish_reason = "abort"
                        break
                    tok = _next_token(kv, self._wdigest)
                    kv = _kv_step(kv, tok, self._wdigest)
                    g.tokens.append(tok)
                    g.token_labels.append(self.label)
            else:
                g.finish_reason = "length"
            return g
        finally:
            with self._cond:
                self._in_flight.pop(rid, None)
                self._abort_ids.discard(rid)
                self._cond.notify_all()

    def _prefill(self, prompt: list[int]) -> tuple[bytes, int]:
        """Reuse the longest cached block-aligned prefix (stale or not), compute the rest."""
        bs = self.block_size
        self.prefix_queries += len(prompt)
        kv, start = b"", 0
        for end in range((len(prompt) // bs) * bs, 0, -bs):
            hit = self._cache.get(tuple(prompt[:end]))
            if hit is not None:
                kv, start = hit, end
                break
        self.prefix_hits += start
        for i in range(start, len(prompt)):
            kv = _kv_step(kv, prompt[i], self._wdigest)
            if (i + 1) % bs == 0:
                self._cache[tuple(prompt[:i + 1])] = kv
        return kv, start

    # -------------------------------------------------------------- lifecycle
    def pause(self, mode: PauseMode, timeout_s: float = 30.0) -> None:
        with self._cond:
            self._alive()
            self._paused = mode
            if mode is PauseMode.ABORT:
                self._abort_ids.update(self._in_flight)
            if mode in (PauseMode.ABORT, PauseMode.WAIT):
                deadline = time.monotonic() + timeout_s
                while self._in_flight and not self.dead:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise EffectError("drain", "in-flight requests did not finish",
                                          mutation_started=False)
                    self._cond.wait(min(left, 0.05))
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self._alive()
            self._paused = None
            self._cond.notify_all()

    def reset_prefix_cache(self) -> bool:
        """False while requests run, like vLLM's reset without reset_running_requests."""
        with self._cond:
            self._alive()
            if self._in_flight:
                return False
            self._cache.clear()
            return True

    def kill(self) -> None:
        with self._cond:
            self.dead = True
            self._cond.notify_all()

    def restart(self, weights: FakeWeights) -> None:
        """A new process on ``weights`` (its start checkpoint): new epoch, empty caches.

        What a supervisor restarting a crashed engine does behind the
        controller's back: it serves again, but not the committed version.
        """
        with self._cond:
            self.dead = False
            self.epoch = uuid.uuid4().hex[:12]
            self.label = "default"
            self._weights = dict(weights.tensors)
            self._wdigest = weights.digest
            self._paused = None
            self._in_flight.clear()
            self._cache.clear()
            self._updating = False
            self._asleep, self._host, self.sleep_level = set(), None, None
            self._cond.notify_all()

    # -------------------------------------------------------------- sleep mode
    def sleep(self, level: int) -> None:
        """vLLM's ``/sleep?level=N&mode=wait``: pause, wait for in-flight work, release."""
        if level not in (1, 2):
            raise BadInput("sleep level must be 1 or 2")
        self.pause(PauseMode.WAIT)
        with self._cond:
            self._alive()
            if not self.sleep_mode:
                # vLLM without sleep mode (and its CPU build): the worker ignores the
                # call and keeps every byte, while the engine reports sleeping.
                self._asleep = {"weights", "kv_cache"}
                self._host = dict(self._weights)
                self.sleep_level = level
                return
            self._host = dict(self._weights) if level == 1 else None
            self._asleep = {"weights", "kv_cache"}
            self.sleep_level = level
            self._cache.clear()

    def wake(self, tags: str) -> bool:
        """``/wake_up`` (``tags`` "weights", "kv_cache" or "all"); returns fully awake."""
        if tags not in ("weights", "kv_cache", "all"):
            raise BadInput(f"unknown wake tags {tags!r}")
        with self._cond:
            self._alive()
            want = {"weights", "kv_cache"} if tags == "all" else {tags}
            if "weights" in want and "weights" in self._asleep:
                if self._host is not None:
                    self._weights = dict(self._host)
                else:
                    # Level 2: the memory comes back, its contents do not.
                    self._garbage += 1
                    self._weights = {n: _h("garbage", self._garbage, n)[:1] * len(b)
                                     for n, b in self._weights.items()}
                self._wdigest = FakeWeights(self._weights, Provenance("x")).digest
                self._host = None
            self._asleep -= want
            awake = not self._asleep
            if awake or self.wake_resumes == "always":
                self._paused = None
                self._cond.notify_all()
            return awake

    def start_update(self) -> None:
        with self._cond:
            self._alive()
            if "weights" in self._asleep:
                raise self._crash("weight update into asleep weights (vLLM #57853)")
            if self._updating:
                raise TransferError("transfer", "update already started", mutation_started=False)
            self._updating = True

    def load(self, name: str, data: bytes) -> None:
        with self._cond:
            self._alive()
            if "weights" in self._asleep:
                raise self._crash("weight write into asleep weights (vLLM #57853)")
            if not self._updating:
                raise TransferError("transfer", "load outside an update")
            if name not in self._weights or len(self._weights[name]) != len(data):
                raise TransferError("transfer", f"unknown or mis-shaped parameter {name}")
            self._weights[name] = data
            self._wdigest = FakeWeights(self._weights, Provenance("x")).digest

    def finish_update(self, label: str) -> None:
        with self._cond:
            self._alive()
            self._updating = False
            self.label = label


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
        # The sleep this adapter put the engine in, until it serves again: its level,
        # the pools woken since, whether a transfer wrote the weights since, and the
        # per-parameter digests taken before it (for a wake on the same weights).
        self._slept: int | None = None
        self._woken: set[str] = set()
        self._wrote = False
        self._reference: dict[str, str] | None = None
        #: what an adapter call refused before touching the engine, in order (tests)
        self.refusals: list[str] = []

    # -------------------------------------------------------------- set-up
    def stage(self, weights: FakeWeights) -> None:
        if not isinstance(weights, FakeWeights):
            raise BadInput("stage needs FakeWeights")
        self._staged = weights

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
        return BootstrapEvidence(engine_epoch=e.epoch, healthy=not e.dead,
                                 observed_label=e.label, label_supported=True,
                                 capabilities=frozenset({"fake"}),
                                 engine_info={"engine": "fake"})

    def observe_health(self, *, timeout_s: float = 5.0) -> HealthEvidence:
        """Between updates: dead, or a different process than the one bootstrapped."""
        e = self.engine
        if e.dead:
            return HealthEvidence(False, False, reason="engine process is dead")
        restarted = self._epoch_at_bootstrap is not None and e.epoch != self._epoch_at_bootstrap
        return HealthEvidence(True, True, restarted,
                              f"epoch {self._epoch_at_bootstrap} is now {e.epoch}"
                              if restarted else "")

    def _refuse_asleep(self, step: str, what: str, pool: str = "weights") -> None:
        """Refuse before any engine call while ``pool`` sleeps (``mutation_started=False``)."""
        if self._slept is not None and pool not in self._woken:
            self.refusals.append(step)
            raise EffectError(step, f"the engine is asleep ({pool} released): {what} refused "
                              f"before reaching it", mutation_started=False)

    def drain(self, mode: PauseMode) -> DrainEvidence:
        self._refuse_asleep("drain", "a drain for an update")
        t0 = time.monotonic()
        fk = self._fault("drain")
        self.engine.pause(mode)
        return DrainEvidence(paused=fk is not FaultKind.LIE and self.engine.paused, mode=mode,
                             engine_in_flight=self.engine.in_flight,
                             elapsed_s=time.monotonic() - t0)

    def preflight(self, target: UpdateTarget) -> PreflightEvidence:
        fk = self._fault("preflight")
        if self._staged is None:
            raise EffectError("preflight", "nothing staged", mutation_started=False)
        src = self._staged
        digest = src.manifest.digest if fk is not FaultKind.LIE else "0" * 64
        return PreflightEvidence(source_manifest_digest=digest,
                                 source_provenance=src.provenance)

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
            got = e.generate(list(p), self._probe_tokens).tokens
            want = reference_tokens(self._staged.digest, list(p), self._probe_tokens)
            worst = max(worst, sum(a != b for a, b in zip(got, want, strict=True)))
        passed = worst == 0 and fk is None
        return ValidationEvidence(
            observed_label=e.label, label_supported=True, paused=False,
            checks=(Check("policy-probe", passed,
                          f"{len(self._probe_prompts)} probes, worst mismatching tokens {worst}",
                          max_abs_diff=float(worst), tolerance=0.0,
                          level=VerificationLevel.PROBE),))

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
            want, against = self._reference, "the digests taken before the sleep"
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
        self._slept, self._woken, self._wrote, self._reference = None, set(), False, None

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
        self._slept, self._woken, self._wrote, self._reference = level, set(), False, ref
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
