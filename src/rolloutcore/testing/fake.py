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
  the body, die mid-transfer.

``FakeAdapter`` is a ``LifecycleAdapter`` like any other, a
``HealthObserver``, an ``ExpectationTaker`` (a remote trainer's probe:
``fake_probe`` computes one from ``FakeWeights`` as a trainer would, and the
engine scores it with ``FakeEngine.score``) and a ``WriteObserver`` (the
engine counts its weight-update calls, as vLLM does); ``FakeRecoverer`` is a
``Recoverer``.
"""

from __future__ import annotations

import enum
import hashlib
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
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
    TransferEvidence,
    UpdateTarget,
    ValidationEvidence,
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

if TYPE_CHECKING:  # the demo runs this module with nothing installed (no httpx)
    from rolloutcore.adapters.vllm.wire import GenerationChunk

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

    def policy_probe(self) -> Any:
        """The probe a trainer computes from these weights (``fake_probe``)."""
        return fake_probe(self)


def _kv_step(kv: bytes, token: int, wdigest: str) -> bytes:
    return _h(kv, token, wdigest)


def _next_token(kv: bytes, wdigest: str) -> int:
    return _h(kv, "next", wdigest)[0] % VOCAB


def fake_logprob(kv: bytes, token: int, wdigest: str) -> float:
    """The fake policy's log-probability of ``token`` after ``kv`` (in [-4, -1/64])."""
    return -(1 + _h(kv, "logprob", token, wdigest)[0]) / 64.0


def fake_probe(weights: FakeWeights, prompts: Sequence[Sequence[int]] = (
        tuple(range(40)), tuple(range(100, 133))), *, new_tokens: int = 8,
        tolerance: float = 0.005) -> Any:
    """What a trainer computes from ``weights``: a ``PolicyProbe`` of the fake policy
    (its greedy continuation of each prompt and their log-probabilities)."""
    from rolloutcore.verification.probe import PolicyProbe, ProbeCase

    cases = []
    for p in prompts:
        kv = b""
        for t in p:
            kv = _kv_step(kv, t, weights.digest)
        cont, lps = [], []
        for _ in range(new_tokens):
            tok = _next_token(kv, weights.digest)
            lps.append(fake_logprob(kv, tok, weights.digest))
            cont.append(tok)
            kv = _kv_step(kv, tok, weights.digest)
        cases.append(ProbeCase(tuple(p), tuple(cont), tuple(lps)))
    return PolicyProbe(cases, tolerance=tolerance)


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


class FakeStream:
    """A fake engine's streamed request: one ``GenerationChunk`` per token, spans at the end."""

    def __init__(self, steps: Iterator[Generation]) -> None:
        self._steps = steps

    def __iter__(self) -> Iterator[GenerationChunk]:
        # Imported here: the package imports httpx, which the demo does without.
        from rolloutcore.adapters.vllm.wire import GenerationChunk, VersionSpan

        seen = 0
        for g in self._steps:
            new = g.tokens[seen:]
            seen = len(g.tokens)
            if not new and g.finish_reason is None:
                continue
            spans = None if g.finish_reason is None else tuple(
                VersionSpan(str(s["version"]), int(str(s["start"])), int(str(s["end"])))
                for s in g.version_spans)
            yield GenerationChunk(tuple(new), tuple(-1.0 for _ in new), g.finish_reason,
                                  spans, time.monotonic())

    def close(self) -> None:
        close = getattr(self._steps, "close", None)
        if close is not None:
            close()  # GeneratorExit in the engine loop: the request leaves the engine


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

    def __init__(self, weights: FakeWeights, *, token_delay_s: float = 0.002,
                 block_size: int = 16) -> None:
        if token_delay_s < 0 or block_size <= 0:
            raise BadInput("token_delay_s must be >= 0 and block_size > 0")
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
        self._cache: dict[tuple[str | int | None, ...], bytes] = {}
        self._updating = False
        self.dead = False
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._ids = 0
        #: weight-update calls (start, load, finish), counted like vLLM's metrics
        self.weight_ops = 0

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

    def tokens_in_flight(self) -> dict[str, int]:
        """Request id -> tokens generated so far, for every request in flight."""
        with self._cond:
            return {rid: len(g.tokens) for rid, g in self._in_flight.items()}

    def weight_bytes(self) -> dict[str, bytes]:
        with self._cond:
            return dict(self._weights)

    def _alive(self) -> None:
        if self.dead:
            raise EngineUnavailable("engine", "engine process is dead")

    # -------------------------------------------------------------- serving
    def generate(self, prompt: list[int], max_tokens: int,
                 request_id: str | None = None, cache_salt: str | None = None) -> Generation:
        """One request to its end. ``cache_salt`` separates prefix-cache entries like vLLM's."""
        last: Generation | None = None
        for step in self._steps(prompt, max_tokens, request_id, cache_salt):
            last = step
        assert last is not None
        return last

    def generate_stream(self, token_ids: list[int] | tuple[int, ...], *, max_tokens: int,
                        temperature: float = 0.0, logprobs: bool = True,
                        seed: int | None = None, ignore_eos: bool = False,
                        request_id: str | None = None, cache_salt: str | None = None,
                        sampling_extra: object = None,
                        read_timeout_s: float = 300.0) -> FakeStream:
        """The request as a stream of one-token events (``VllmHTTP.generate_stream``'s shape).

        The last event carries the per-token labels as spans, like vLLM 0.32.
        """
        return FakeStream(self._steps(list(token_ids), max_tokens, request_id, cache_salt))

    def _steps(self, prompt: list[int], max_tokens: int, request_id: str | None,
               cache_salt: str | None) -> Iterator[Generation]:
        """Yields the generation after each token (and once at its end)."""
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
            self._ids += 1
            rid = request_id or f"req-{self._ids}"
            g = Generation(rid, list(prompt))
            self._in_flight[rid] = g
            kv, cached = self._prefill(prompt, cache_salt)
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
                yield g
            else:
                g.finish_reason = "length"
            yield g
        finally:
            with self._cond:
                self._in_flight.pop(rid, None)
                self._abort_ids.discard(rid)
                self._cond.notify_all()

    def score(self, token_ids: Sequence[int], *,
              timeout_s: float | None = None) -> list[float | None]:
        """Teacher-forced log-probabilities of ``token_ids`` under the current weights
        (a fresh prefill: no cache), the first ``None``, like ``VllmHTTP.score``."""
        with self._cond:
            self._alive()
            wd = self._wdigest
        out: list[float | None] = [None]
        kv = b""
        for i, t in enumerate(token_ids):
            if i:
                out.append(fake_logprob(kv, int(t), wd))
            kv = _kv_step(kv, int(t), wd)
        return out

    def _prefill(self, prompt: list[int], salt: str | None = None) -> tuple[bytes, int]:
        """Reuse the longest cached block-aligned prefix (stale or not), compute the rest.

        Entries are keyed by the salt too: a salted request never meets another
        salt's entries (vLLM hashes the salt into the first block).
        """
        bs = self.block_size
        self.prefix_queries += len(prompt)
        kv, start = b"", 0
        for end in range((len(prompt) // bs) * bs, 0, -bs):
            hit = self._cache.get((salt, *prompt[:end]))
            if hit is not None:
                kv, start = hit, end
                break
        self.prefix_hits += start
        for i in range(start, len(prompt)):
            kv = _kv_step(kv, prompt[i], self._wdigest)
            if (i + 1) % bs == 0:
                self._cache[(salt, *prompt[:i + 1])] = kv
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
            self._cond.notify_all()

    def start_update(self) -> None:
        with self._cond:
            self._alive()
            if self._updating:
                raise TransferError("transfer", "update already started", mutation_started=False)
            self._updating = True
            self.weight_ops += 1

    def load(self, name: str, data: bytes) -> None:
        with self._cond:
            self._alive()
            if not self._updating:
                raise TransferError("transfer", "load outside an update")
            if name not in self._weights or len(self._weights[name]) != len(data):
                raise TransferError("transfer", f"unknown or mis-shaped parameter {name}")
            self.weight_ops += 1
            self._weights[name] = data
            self._wdigest = FakeWeights(self._weights, Provenance("x")).digest

    def finish_update(self, label: str) -> None:
        with self._cond:
            self._alive()
            self._updating = False
            self.weight_ops += 1
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
        # A remote trainer's expectations (``expect``): used instead of the staged
        # weights, which a remote trainer never hands over.
        self._remote = False
        self._probes: Any = None
        self._reference: Mapping[str, str] | None = None
        self._ops_verified: int | None = None
        self._ops_at_drain: int | None = None

    # -------------------------------------------------------------- set-up
    def stage(self, weights: FakeWeights) -> None:
        if not isinstance(weights, FakeWeights):
            raise BadInput("stage needs FakeWeights")
        self._staged = weights
        self._remote = False

    def expect(self, *, probes: Any | None, reference_checksums: Mapping[str, str] | None
               ) -> None:
        """A remote trainer's expectations: ``probes`` (``fake_probe``) and, as its
        reference checksum, ``{"fake-digest": weights.digest}``."""
        self._remote = True
        self._staged = None
        self._probes = probes
        self._reference = None if reference_checksums is None else dict(reference_checksums)

    def expect_sent(self, sent: Mapping[str, Any] | None) -> None:
        if sent is not None:
            raise BadInput("the fake engine's transport reports no checksum of what it sent")

    def writes_since_drain(self, *, timeout_s: float = 5.0) -> tuple[str, ...] | None:
        if self._ops_at_drain is None or self.engine.dead:
            return None
        n = self.engine.weight_ops - self._ops_at_drain
        return (f"{n} weight-update call(s)",) if n else ()

    def inject(self, effect: str, kind: FaultKind, times: int = 1) -> None:
        valid = {"bootstrap", "drain", "preflight", "transfer", "reset_prefix",
                 "reset_encoder", "reset_multimodal", "validate", "validate_live", "resume"}
        if effect not in valid:
            raise BadInput(f"unknown effect {effect!r}; one of {sorted(valid)}")
        self.faults[effect] = Fault(FaultKind(kind), times)

    def _fault(self, effect: str) -> FaultKind | None:
        f = self.faults.get(effect)
        if f is None or f.times <= 0:
            return None
        f.times -= 1
        if f.kind is FaultKind.RAISE:
            raise EngineUnavailable(effect, "injected server error (HTTP 500)",
                                    mutation_started=effect == "transfer")
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

    def drain(self, mode: PauseMode) -> DrainEvidence:
        t0 = time.monotonic()
        fk = self._fault("drain")
        self._ops_at_drain = self.engine.weight_ops
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
        fk = self._fault("transfer")
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
        fk = self._fault(f"reset_{cache.value}")
        ok = self.engine.reset_prefix_cache() if cache is CacheKind.PREFIX else True
        if fk is FaultKind.LIE:
            ok = False
        return CacheResetEvidence(cache=cache, http_status=200, engine_success=ok)

    def validate(self, target: UpdateTarget, *, live: bool) -> ValidationEvidence | None:
        fk = self._fault("validate_live" if live else "validate")
        e = self.engine
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

    def resume(self) -> ResumeEvidence:
        fk = self._fault("resume")
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
                         block_size=old.block_size)
        if self.fail:
            new.kill()
            raise EngineUnavailable("recover", "replacement engine died at start")
        new.label = target.label  # a cold load: the label is given at load time
        self.adapter.engine = new
        self.adapter._epoch_at_bootstrap = new.epoch  # the process health is checked against
        self.adapter._ops_verified = new.weight_ops
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
