"""The in-process rollout path of the update modes: salted, carried, stitched (issue 20).

The controller decides what an update does with rollouts in flight (its
mode, a row of ``core.rules.UPDATE_MODES``); the runner pauses the engine
as the row says. What is left is the rollout's own side, and that is this
module's ``RolloutClient``: it admits a rollout, streams it from the engine
with the **version salt** of the version it is admitted under
(``core.cache_salt``), and follows it across updates:

* ``keep``: the stream simply continues after the resume; tokens read
  after the update's resume instant are the new version's;
* ``recompute``: the pause aborted the request; the client keeps the
  tokens and logprobs it has, waits for the update to publish (or be
  abandoned), and resubmits prompt + output so far, salted by the version
  the rollout now continues under, so its KV is recomputed by those
  weights;
* over the staleness bound: the controller ends the binding at the pause
  (``carry`` record); the client stops reading (closing the stream makes
  vLLM abort the request) and reports the rollout, never drops it;
* an engine that breaks or an update that taints: the rollout ends with
  the error, unattributable.

Per-token versions come from the engine's ``weight_versions`` spans where
it reports them (vLLM 0.32). Otherwise they are derived from the stream:
``VersionClock`` (a controller listener) notes when each update enters
RESUMING, which every listener sees before the runner sends ``/resume``.
The engine produced nothing between its pause answer and the resume, and
vLLM answers a pause only once the outputs of earlier steps are on their
way to the streams; the transition in between (transfer, cache resets,
validation) is far longer than writing them takes. So a token read before
that instant was sampled by the old weights, one read after it by the new
ones. On 0.32 the derivation is checked against the engine's spans
(``Rollout.derived_agrees``).

``stitch`` (``provenance.stitch``) builds the sample: tokens, behaviour
logprobs, per-token versions with the KV each span attended to, and one
segment per engine request with its salt; ``Rollout.sample`` makes it a
trajectory record (schema version 3).
"""

from __future__ import annotations

import enum
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.port import StreamChunk
from rolloutcore.core.cache_salt import salt_for
from rolloutcore.core.lifecycle import Binding, State
from rolloutcore.core.records import (
    Abandon,
    Commit,
    Record,
    RequestUpdate,
    Taint,
    Transition,
    UpdateMode,
)
from rolloutcore.core.rules import UPDATE_MODES
from rolloutcore.core.strict import check_int
from rolloutcore.core.versions import EngineIdentity, WeightVersion
from rolloutcore.errors import AdmissionRefused, BadInput, RolloutCoreError
from rolloutcore.provenance.stitch import SegmentRun, Stitched, stitch
from rolloutcore.provenance.trajectory import (
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectorySample,
    VersionSpan,
)

__all__ = [
    "Rollout",
    "attribute",
    "segment_run",
    "RolloutClient",
    "RolloutStatus",
    "StreamSource",
    "TokenStream",
    "VersionClock",
]


@runtime_checkable
class TokenStream(Protocol):
    """A streamed generation (``VllmHTTP.generate_stream``'s ``GenerationStream``)."""

    def __iter__(self) -> Iterator[StreamChunk]: ...

    def close(self) -> None: ...


@runtime_checkable
class StreamSource(Protocol):
    """Where rollouts are generated: ``VllmHTTP``, or the fake engine's streams."""

    def generate_stream(self, token_ids: Sequence[int], *, max_tokens: int,
                        temperature: float = 0.0, logprobs: bool = True,
                        seed: int | None = None, ignore_eos: bool = False,
                        request_id: str | None = None, cache_salt: str | None = None,
                        sampling_extra: Mapping[str, Any] | None = None,
                        read_timeout_s: float = 300.0) -> TokenStream: ...


class VersionClock:
    """A controller listener: when each published update resumed the engine.

    ``version_at(t, since)`` is the version that sampled a token read at
    ``t`` by a request submitted under ``since``.
    """

    def __init__(self, controller: LifecycleController) -> None:
        self._cond = threading.Condition()
        self._target: WeightVersion | None = None
        self._resume_at: float | None = None
        self._bounds: list[tuple[float, WeightVersion]] = []
        self.updates = 0
        self.records = 0
        controller.add_listener(self)

    def __call__(self, rec: Record) -> None:
        now = time.monotonic()
        with self._cond:
            self.records += 1
            if isinstance(rec, RequestUpdate):
                self.updates += 1
                self._target, self._resume_at = rec.target, None
            elif isinstance(rec, Transition):
                if rec.before is State.VALIDATING and rec.after is State.RESUMING:
                    self._resume_at = now
            elif isinstance(rec, Commit):
                if self._target is not None and rec.version == self._target and \
                        self._resume_at is not None:
                    self._bounds.append((self._resume_at, rec.version))
                self._target = self._resume_at = None
            elif isinstance(rec, (Taint, Abandon)):
                self._target = self._resume_at = None
            self._cond.notify_all()

    def version_at(self, t: float, since: WeightVersion) -> WeightVersion:
        """The newest version published with a resume instant at or before ``t``.

        A taint publishes nothing, so it moves no token: whether a rollout
        that crossed one is attributable is the controller's ``complete``.
        """
        with self._cond:
            v = since
            for tb, ver in self._bounds:
                if tb <= t and ver.generation > v.generation and \
                        ver.engine_epoch == since.engine_epoch:
                    v = ver
            return v

    def wait(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (woken by every record) until ``pred()``, at most ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not pred():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
            return True


def segment_run(clock: VersionClock, ver: WeightVersion, salt: str | None, prefill: int,
                chunks: Iterable[StreamChunk]) -> SegmentRun:
    """One engine request as read (``chunks``, each with its read instant) as a segment.

    Each token's version is derived from when it was read (``clock``); the
    engine's own spans, where it gave them over exactly this output, ride
    along for ``stitch`` to check the derivation against. The in-process
    ``RolloutClient`` and the gateway's carried requests (``service.carried``)
    both build their segments here.
    """
    toks: list[int] = []
    lps: list[float] | None = []
    per_token: list[tuple[int, str]] = []
    finish: str | None = None
    spans = None
    for ch in chunks:
        toks += ch.token_ids
        if ch.logprobs is None:
            lps = None
        elif lps is not None:
            lps += ch.logprobs
        v = clock.version_at(ch.read_at, ver)
        per_token += [(v.generation, v.label)] * len(ch.token_ids)
        if ch.finish_reason is not None:
            finish = ch.finish_reason
        if ch.weight_versions is not None:
            spans = tuple((s.version, s.start, s.end) for s in ch.weight_versions)
    if spans is not None and (sum(b - a for _, a, b in spans) != len(toks)):
        spans = None  # spans over a different output: not evidence for this one
    if lps is not None and len(lps) != len(toks):
        lps = None
    return SegmentRun(ver.label, salt, prefill, tuple(toks),
                      None if lps is None else tuple(lps), tuple(per_token), spans, finish)


def attribute(controller: LifecycleController, mode: UpdateMode, runs: Sequence[SegmentRun],
              committed: WeightVersion) -> tuple[Stitched, int] | str:
    """A completed rollout's segments stitched, and its staleness; or why it cannot be.

    ``committed`` is the version the controller credited at the release
    (``Completion.committed``). The staleness is the number of versions
    published after the rollout's oldest token, up to ``committed``.
    """
    gens = {v.label: v.generation for v in controller.published}
    try:
        st = stitch(mode, runs, gens, max_staleness=controller.max_staleness,
                    completed_generation=committed.generation)
    except BadInput as exc:
        return f"cannot attribute its tokens: {exc}"
    oldest = min((s.generation for s in st.versions.spans if len(s)),
                 default=committed.generation)
    staleness = sum(1 for v in controller.published if oldest < v.generation
                    <= committed.generation and v.engine_epoch == committed.engine_epoch)
    return st, staleness


class RolloutStatus(enum.StrEnum):
    COMPLETED = "completed"    # finished; attributable says whether it can be trained on
    OVER_BOUND = "over_bound"  # ended by an update: it would have exceeded max_staleness
    FAILED = "failed"          # the engine broke, or an update tainted it


@dataclass
class Rollout:
    """One rollout's outcome: the stitched sample, or why there is none."""

    rollout_id: str
    prompt: tuple[int, ...]
    status: RolloutStatus
    mode: UpdateMode
    binding: Binding | None = None
    attributable: bool = False
    error: str | None = None
    runs: list[SegmentRun] = field(default_factory=list)
    stitched: Stitched | None = None
    staleness: int | None = None
    admitted_wall: float = 0.0
    admitted_mono: float = 0.0
    completed_wall: float = 0.0
    completed_mono: float = 0.0
    first_token_mono: float | None = None
    #: The engine requests as read: (version, salt, prefill, chunks); ``runs`` is
    #: built from them once the rollout's last update is decided.
    raw: list[tuple[WeightVersion, str | None, int, list[StreamChunk]]] = field(
        default_factory=list, repr=False)

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(t for r in self.runs for t in r.token_ids)

    @property
    def recomputed_tokens(self) -> int:
        """Tokens prefilled again by resubmissions."""
        return sum(r.prefill_tokens for r in self.runs[1:])

    @property
    def derived_agrees(self) -> bool | None:
        """Whether the stream's derivation equals the engine's spans (None: no spans)."""
        st = self.stitched
        if st is None or st.versions.source != "engine":
            return None
        return [(s.generation, s.start, s.end) for s in st.derived] == [
            (s.generation, s.start, s.end) for s in st.versions.spans]

    def sample(self, *, run: str, step: int, group_id: str, prompt_index: int,
               group_size: int, sample_index: int, sampling: SamplingSpec,
               engine: EngineIdentity) -> TrajectorySample:
        """The trajectory record (schema version 3) of a completed, attributable rollout."""
        st = self.stitched
        if self.status is not RolloutStatus.COMPLETED or not self.attributable or st is None \
                or self.binding is None:
            raise BadInput(f"rollout {self.rollout_id} is {self.status.value}"
                           f"{'' if self.attributable else ', unattributable'}: no sample")
        wv = None if st.engine_spans is None else tuple(
            VersionSpan(lab, a, b) for lab, a, b in st.engine_spans)
        comp = SampledCompletion(st.token_ids, st.finish_reason or "unknown", st.logprobs,
                                 None, wv, st.versions)
        return TrajectorySample(run, step, group_id, prompt_index, group_size, sample_index,
                                Prompt(self.prompt), sampling, comp, self.binding, engine,
                                Timestamps(self.admitted_wall, self.admitted_mono,
                                           self.completed_wall, self.completed_mono))


_UPDATING = frozenset({State.DRAINING, State.QUIESCED, State.UPDATING, State.INVALIDATING,
                       State.VALIDATING, State.RESUMING})


class RolloutClient:
    """Rollouts on one engine under one controller, in the controller's update mode.

    Thread-safe: ``run`` is called from as many threads as there are
    rollouts in flight. ``salt=False`` only for a negative control: an
    asynchronous mode whose row needs the salt refuses it unless
    ``unsafe_unsalted=True``.
    """

    def __init__(self, controller: LifecycleController, source: StreamSource, *,
                 salt: bool = True, unsafe_unsalted: bool = False,
                 clock: VersionClock | None = None, admit_wait_s: float = 600.0,
                 update_wait_s: float = 600.0, read_timeout_s: float = 600.0,
                 sampling_extra: Mapping[str, Any] | None = None) -> None:
        if not isinstance(controller, LifecycleController):
            raise BadInput("controller must be a LifecycleController")
        if not isinstance(source, StreamSource):
            raise BadInput("source must have generate_stream (VllmHTTP or a fake engine)")
        rule = UPDATE_MODES[controller.update_mode]
        if rule.needs_salt and not salt and not unsafe_unsalted:
            raise BadInput(f"update mode {controller.update_mode.value!r} needs the version "
                           "salt (a request under N+1 could reuse KV of N); salt=False only "
                           "with unsafe_unsalted=True, for a negative control")
        for name, v in (("admit_wait_s", admit_wait_s), ("update_wait_s", update_wait_s),
                        ("read_timeout_s", read_timeout_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise BadInput(f"{name} must be a positive number of seconds")
        self.controller = controller
        self.source = source
        self.salt = salt
        self.clock = clock or VersionClock(controller)
        self.admit_wait_s = float(admit_wait_s)
        self.update_wait_s = float(update_wait_s)
        self.read_timeout_s = float(read_timeout_s)
        if sampling_extra is not None and not isinstance(sampling_extra, Mapping):
            raise BadInput("sampling_extra must be a mapping (extra sampling_params)")
        #: Sent with every request's sampling_params (``{"detokenize": False}`` for
        #: an engine started without a tokenizer).
        self.sampling_extra = dict(sampling_extra or {})
        self._lock = threading.Lock()
        self._progress: dict[str, int] = {}

    def in_flight(self) -> dict[str, int]:
        """Rollout id -> output tokens received so far, for every rollout being generated."""
        with self._lock:
            return dict(self._progress)

    @property
    def mode(self) -> UpdateMode:
        return self.controller.update_mode

    # ------------------------------------------------------------------ admission
    def _admit(self, rid: str) -> Binding:
        c, clock = self.controller, self.clock
        deadline = time.monotonic() + self.admit_wait_s
        while True:
            seen = clock.records
            try:
                return c.admit(rid)
            except AdmissionRefused as exc:
                if exc.retry_after_s is None or time.monotonic() >= deadline:
                    raise
                wait = max(0.0, min(exc.retry_after_s, deadline - time.monotonic()))
            # Ask again once something changed (the update ended, a rollout completed
            # and freed capacity), never in a loop that only refuses.
            clock.wait(lambda seen=seen: clock.records > seen + 1  # type: ignore[misc]
                       and c.state in (State.READY, State.TAINTED), wait)

    # ------------------------------------------------------------------ one rollout
    def run(self, prompt: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
            seed: int | None = None, ignore_eos: bool = False, logprobs: bool = True,
            rollout_id: str | None = None) -> Rollout:
        """Generate one rollout to its end, across any updates; never raises for the engine.

        Bad input raises ``BadInput`` before anything is admitted. An admission
        refused for good (a tainted engine) ends it ``FAILED``.
        """
        ids = tuple(prompt)
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                              for t in ids):
            raise BadInput("prompt must be a non-empty sequence of token ids >= 0")
        check_int("max_tokens", max_tokens, 1)
        rid = rollout_id or f"r-{uuid.uuid4().hex}"
        out = Rollout(rid, ids, RolloutStatus.FAILED, self.mode)
        try:
            b = self._admit(rid)
        except AdmissionRefused as exc:
            out.error = f"not admitted: {exc}"
            return out
        out.binding = b
        out.admitted_wall, out.admitted_mono = time.time(), time.monotonic()
        with self._lock:
            self._progress[rid] = 0
        try:
            self._generate(out, max_tokens, temperature, seed, ignore_eos, logprobs)
        finally:
            with self._lock:
                self._progress.pop(rid, None)
            self._release(out)
        return out

    def _generate(self, out: Rollout, max_tokens: int, temperature: float,
                  seed: int | None, ignore_eos: bool, logprobs: bool) -> None:
        c, clock = self.controller, self.clock
        rid = out.rollout_id
        produced: list[int] = []
        while True:
            ver = c.serving_version(rid)
            if ver is None:
                out.status = RolloutStatus.OVER_BOUND if c.over_bound(rid) else \
                    RolloutStatus.FAILED
                out.error = ("ended by an update: its oldest tokens would have been more "
                             f"than max_staleness={c.max_staleness} published versions old"
                             if c.over_bound(rid) else "its binding was released")
                return
            salt = salt_for(ver) if self.salt else None
            prefill = (*out.prompt, *produced)
            updates_before = clock.updates
            chunks: list[StreamChunk] = []
            error: str | None = None
            over = False
            try:
                stream = self.source.generate_stream(
                    prefill, max_tokens=max_tokens - len(produced), temperature=temperature,
                    logprobs=logprobs, seed=seed, ignore_eos=ignore_eos,
                    request_id=f"{rid}-{len(out.raw)}", cache_salt=salt,
                    sampling_extra=self.sampling_extra or None,
                    read_timeout_s=self.read_timeout_s)
                try:
                    for ch in stream:
                        if c.over_bound(rid):
                            over = True  # closing the stream makes the engine abort it
                            break
                        if ch.token_ids:
                            if out.first_token_mono is None:
                                out.first_token_mono = ch.read_at
                            with self._lock:
                                self._progress[rid] = self._progress.get(rid, 0) + len(
                                    ch.token_ids)
                        chunks.append(ch)
                finally:
                    stream.close()
            except RolloutCoreError as exc:
                error = f"{type(exc).__name__}: {exc}"
            out.raw.append((ver, salt, len(prefill), chunks))
            produced += [t for ch in chunks for t in ch.token_ids]
            if over:
                out.status, out.error = RolloutStatus.OVER_BOUND, (
                    f"ended by an update: max_staleness={c.max_staleness} would be exceeded")
                return
            finish = next((ch.finish_reason for ch in reversed(chunks)
                           if ch.finish_reason is not None), None)
            paused_meanwhile = clock.updates != updates_before or c.state in _UPDATING
            if error is None and finish not in (None, "abort"):
                out.status = RolloutStatus.COMPLETED
                return
            if error is None and paused_meanwhile and self.mode is UpdateMode.RECOMPUTE and \
                    len(produced) < max_tokens:
                # Aborted at an update's pause: wait for it to end, then resubmit.
                if not clock.wait(lambda: c.state in (State.READY, State.TAINTED),
                                  self.update_wait_s):
                    out.error = f"the update did not end within {self.update_wait_s:g}s"
                    return
                if c.state is State.TAINTED:
                    out.error = "the update that aborted it tainted the engine"
                    return
                continue
            if error is None and len(produced) >= max_tokens:
                out.status = RolloutStatus.COMPLETED  # aborted after its last token
                return
            why = error or (f"the engine ended it ({finish or 'stream ended without a finish'})"
                            + (" during an update" if paused_meanwhile else ""))
            if paused_meanwhile or c.state in _UPDATING or c.state is State.TAINTED:
                # Kept (or queued) across an update that failed: say which.
                clock.wait(lambda: c.state not in _UPDATING, self.update_wait_s)
                why += f"; engine now {c.state.value}"
            out.error = why
            return

    def _segment(self, ver: WeightVersion, salt: str | None, prefill: int,
                 chunks: Iterable[StreamChunk]) -> SegmentRun:
        return segment_run(self.clock, ver, salt, prefill, chunks)

    def _release(self, out: Rollout) -> None:
        c = self.controller
        if c.state is State.RESUMING:
            # Carried and finished while the target serves unpublished: its
            # attribution (and its last tokens' version) is the update's outcome.
            self.clock.wait(lambda: c.state is not State.RESUMING, self.update_wait_s)
        out.runs = [self._segment(*r) for r in out.raw]
        out.completed_wall, out.completed_mono = time.time(), time.monotonic()
        try:
            comp = c.complete(out.rollout_id)
        except (BadInput, RolloutCoreError):
            out.attributable = False  # released by the controller (over the bound)
            return
        out.attributable = comp.attributable and out.status is RolloutStatus.COMPLETED
        if out.status is RolloutStatus.COMPLETED and not comp.attributable:
            out.status = RolloutStatus.FAILED
            out.error = f"completed unattributable (engine {comp.state.value})"
        if not out.runs or out.status is not RolloutStatus.COMPLETED:
            return
        committed = comp.committed
        assert committed is not None
        got = attribute(c, self.mode, out.runs, committed)
        if isinstance(got, str):
            out.status, out.attributable, out.error = RolloutStatus.FAILED, False, got
            return
        out.stitched, out.staleness = got
