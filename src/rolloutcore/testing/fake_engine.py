"""The fake engine: an in-process stand-in for vLLM that models what matters.

Requests in flight, pause modes (wait, keep, abort), a prefix cache keyed by
tokens (and salts) that serves stale blocks unless reset, weights whose
digest changes every output, sleep levels, a process that can die or be
restarted, and weight-operation counters. ``FakeAdapter`` (``testing.fake``)
drives it through the ``LifecycleAdapter`` port.
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
    PauseMode,
)
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    WeightIdentity,
)
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EngineRefused,
    EngineUnavailable,
    TransferError,
)

if TYPE_CHECKING:  # the demo runs this module with nothing installed (no httpx)
    from rolloutcore.engine.wire import GenerationChunk
    from rolloutcore.verification.probe import PolicyProbe

__all__ = [
    "EnginePaused",
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
        tolerance: float = 0.005) -> PolicyProbe:
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
        from rolloutcore.engine.wire import GenerationChunk, VersionSpan

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


class EnginePaused(EngineRefused):
    """vLLM 0.33+'s answer to a new request while paused in ``wait`` or ``abort`` mode
    (HTTP 503, code ``engine_paused``, retryable); ``keep`` still queues."""

    def __init__(self, reason: str) -> None:
        super().__init__("generate", reason, status=503, mutation_started=False)


class FakeEngine:
    """The simulated engine. Thread-safe; ``generate`` blocks like an HTTP call would."""

    #: (device total, weights, KV cache, the rest) bytes of the memory model:
    #: Qwen3-8B-like proportions, as seen on the H200 at gpu-memory-utilization 0.45.
    MEMORY = (140 << 30, 16 << 30, 46 << 30, 1 << 30)

    def __init__(self, weights: FakeWeights, *, token_delay_s: float = 0.002,
                 block_size: int = 16, sleep_mode: bool = True,
                 wake_resumes: str = "when_awake", draft: str | None = None,
                 rejects_while_paused: bool = False) -> None:
        if token_delay_s < 0 or block_size <= 0:
            raise BadInput("token_delay_s must be >= 0 and block_size > 0")
        if draft is not None and (not isinstance(draft, str) or not draft):
            raise BadInput("draft must be a speculative method's name or None")
        #: The speculative method of a draft with weights this engine decodes with, as
        #: vLLM's ``/server_info`` names it (None: no draft). Its weights are not modelled:
        #: every update the fake takes is target-only, so an adapter refuses them all.
        self.draft = draft
        if wake_resumes not in ("when_awake", "always"):
            raise BadInput("wake_resumes must be 'when_awake' or 'always'")
        #: vLLM 0.33+: a new request while paused (wait, abort) is refused with
        #: ``EnginePaused`` instead of held until resume; counted in ``rejected_while_paused``.
        self.rejects_while_paused = bool(rejects_while_paused)
        self.rejected_while_paused = 0
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
        #: Frozen requests a ``pause(keep, clear_cache)`` preempted: recomputed on resume.
        self._preempted: set[str] = set()
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
            # New requests are held while paused (vLLM queues them until resume; from
            # 0.33 only in keep mode, and refuses them in the other two).
            while self._paused is not None and not self.dead:
                if self.rejects_while_paused and self._paused is not PauseMode.KEEP:
                    self.rejected_while_paused += 1
                    raise EnginePaused("Generation is paused. Please retry after it resumes.")
                self._cond.wait(0.05)
            self._alive()
            if self._asleep:  # a scheduler resumed against asleep memory
                raise self._crash(f"illegal memory access ({sorted(self._asleep)} asleep)")
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
                    if rid in self._preempted:  # its KV was freed: prefill it again, now
                        self._preempted.discard(rid)
                        kv, _ = self._prefill([*g.prompt, *g.tokens], cache_salt)
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
                self._preempted.discard(rid)
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
    def pause(self, mode: PauseMode, timeout_s: float = 30.0, *,
              clear_cache: bool = False) -> None:
        """vLLM's pause; ``clear_cache`` with ``keep`` preempts the frozen requests (their
        KV freed, the prefix cache cleared): each is recomputed on resume, by the weights
        the engine holds then."""
        with self._cond:
            self._alive()
            self._paused = mode
            if clear_cache:
                self._cache.clear()
                self._preempted.update(self._in_flight)
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

    def abort(self, request_ids: Sequence[str] | None = None) -> int:
        """vLLM's ``/abort_requests``: end the named requests (None: every one) with
        ``finish_reason: abort`` at their next token; returns how many it asked."""
        with self._cond:
            self._alive()
            ids = list(self._in_flight) if request_ids is None else list(request_ids)
            self._abort_ids.update(i for i in ids if i in self._in_flight)
            self._cond.notify_all()
            return len(ids)

    def resume(self) -> None:
        with self._cond:
            self._alive()
            self._paused = None
            self._cond.notify_all()

    def reset_prefix_cache(self) -> bool:
        """False while requests run, like vLLM's reset without reset_running_requests."""
        with self._cond:
            self._alive()
            if set(self._in_flight) - self._preempted:  # preempted ones hold no blocks
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
            self.weight_ops += 1

    def load(self, name: str, data: bytes) -> None:
        with self._cond:
            self._alive()
            if "weights" in self._asleep:
                raise self._crash("weight write into asleep weights (vLLM #57853)")
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


