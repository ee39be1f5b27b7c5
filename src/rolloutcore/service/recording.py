"""Optional: each finished token-in/token-out request recorded as a trajectory group.

A rollout client that wants its samples recorded by the gateway names their
place in the run with three request headers::

    X-RolloutCore-Run: run-7
    X-RolloutCore-Step: 42
    X-RolloutCore-Prompt-Index: 3

A finished ``/inference/v1/generate`` request (status 200, complete, streamed
or not) with those headers becomes one ``TrajectoryGroup``: one sample per
choice (``sampling_params.n``), each with the prompt, the sampling
parameters, the tokens, logprobs and vLLM's ``weight_versions`` spans, a
digest of each image sent with the prompt (never the image), the
controller's binding (version, identity, rollout id) and the admission and
release times. Requests without the headers, and the other routes (whose
answers are text, not token ids), are not recorded.

A request the controller released *unattributable* is recorded as such
(``attribution``: trajectory schema 3): one cut by the drain policy (its
tokens so far, ``finish_reason: abort``), or one that completed after the
engine was tainted. Nothing of it is credited to a version, and nothing is
silently missing either.

Appending fsyncs, so it never runs on the event loop: the data plane hands
finished requests to a bounded queue and one thread writes them (the
recorder is the single writer of its file). A full queue drops the record
and counts it; a record that cannot be built or written, whatever the
request held (nesting, sizes, types), is counted with its reason and never
affects the response, which was already sent, nor the writer, which goes on
with the next one. ``stats()`` is what ``/control/status`` and ``/metrics``
report. ``close`` is bounded: a writer stuck on its disk is left behind, and
shutdown goes on.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutcore.engine.routes import Routes
from rolloutcore.errors import BadInput
from rolloutcore.provenance.recorder import AppendOutcome, TrajectoryRecorder
from rolloutcore.provenance.trajectory import (
    MAX_EXTRA_DEPTH,
    SEED_EXTERNAL,
    SEED_NONE,
    Attribution,
    EngineIdentity,
    FleetPlacement,
    Prompt,
    SampledCompletion,
    SamplingSpec,
    Timestamps,
    TrajectoryGroup,
    TrajectorySample,
    VersionSpan,
    group_id_for,
)
from rolloutcore.service.proxy import FinishedRequest, json_depth

__all__ = ["PROMPT_INDEX_HEADER", "RUN_HEADER", "STEP_HEADER", "GatewayRecorder",
           "build_group"]

RUN_HEADER = "x-rolloutcore-run"
STEP_HEADER = "x-rolloutcore-step"
PROMPT_INDEX_HEADER = "x-rolloutcore-prompt-index"
GENERATE = Routes.GENERATE
_TYPED = ("temperature", "top_p", "top_k", "max_tokens", "seed")
#: Endings of a request that are recorded (the rest produced no sample).
_RECORDED = frozenset({"complete", "aborted"})


def _int_header(headers: Mapping[str, str], name: str) -> int:
    raw = headers.get(name, "")
    if not raw.isdigit() or len(raw) > 18:
        raise BadInput(f"{name} must be a non-negative integer, got {raw!r}")
    return int(raw)


def _choices(fin: FinishedRequest) -> list[dict[str, Any]]:
    """The answer's choices; a stream's chunks are merged per choice index."""
    if fin.response is not None:
        ch = fin.response.get("choices")
        if not isinstance(ch, list):
            raise BadInput("the answer has no choices")
        return [c for c in ch if isinstance(c, dict)]
    merged: dict[int, dict[str, Any]] = {}
    for ev in fin.events:
        for c in ev.get("choices") or ():
            if not isinstance(c, dict) or not isinstance(c.get("index"), int):
                continue
            m = merged.setdefault(c["index"], {"index": c["index"], "token_ids": [],
                                               "logprobs": {"content": []},
                                               "finish_reason": None, "stop_reason": None,
                                               "weight_versions": None, "_lp": False})
            m["token_ids"].extend(c.get("token_ids") or ())
            lp = c.get("logprobs")
            if isinstance(lp, dict) and isinstance(lp.get("content"), list):
                m["_lp"] = True
                m["logprobs"]["content"].extend(lp["content"])
            for k in ("finish_reason", "stop_reason", "weight_versions"):
                if c.get(k) is not None:
                    m[k] = c[k]
    out = []
    for i in sorted(merged):
        m = merged[i]
        if not m.pop("_lp"):
            m["logprobs"] = None
        out.append(m)
    return out


def _completion(c: dict[str, Any], cut: bool = False, versions: Any = None
                ) -> SampledCompletion:
    ids = tuple(c.get("token_ids") or ())
    lp = c.get("logprobs")
    logprobs = None
    if isinstance(lp, dict) and isinstance(lp.get("content"), list):
        logprobs = tuple(float(x["logprob"]) for x in lp["content"])
    spans = c.get("weight_versions")
    wv = None if spans is None else tuple(
        VersionSpan(str(s["version"]), int(s["start"]), int(s["end"])) for s in spans)
    finish = c.get("finish_reason") or ("abort" if cut else "unknown")
    return SampledCompletion(ids, str(finish), logprobs, c.get("stop_reason"), wv, versions)


def build_group(fin: FinishedRequest, engine: EngineIdentity) -> TrajectoryGroup:
    """The trajectory group of one finished generate request (``BadInput`` if it has none)."""
    h = fin.headers
    run = h.get(RUN_HEADER, "")
    step = _int_header(h, STEP_HEADER)
    index = _int_header(h, PROMPT_INDEX_HEADER)
    req = fin.request
    sp = req.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadInput("sampling_params must be an object")
    seed = sp.get("seed")
    sampling = SamplingSpec(
        float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0)),
        int(sp.get("top_k", -1)), sp.get("max_tokens"),
        seed, SEED_NONE if seed is None else SEED_EXTERNAL,
        {k: v for k, v in sp.items() if k not in _TYPED})
    prompt = Prompt(tuple(req.get("token_ids") or ()), media=tuple(fin.media))
    cut = fin.ending == "aborted"
    choices = _choices(fin) if fin.response is not None or fin.events else []
    if cut:
        # Cut mid-way: every sample the request asked for, with what it got.
        n = sp.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 1024 else 1
        have = {c.get("index"): c for c in choices}
        choices = [have.get(i) or {"index": i, "token_ids": []} for i in range(n)]
    if not choices:
        raise BadInput("the answer has no choices")
    attribution = Attribution() if fin.attributable else Attribution(
        False, (fin.unattributable or "the controller credits it to no version")[:512])
    stamps = Timestamps(fin.admitted_wall, fin.admitted_mono, fin.completed_wall,
                        fin.completed_mono)
    gid = group_id_for(run, step, index)
    binding = fin.binding  # the controller's binding is the trajectory's
    fleet = _placement(fin)
    samples = [TrajectorySample(run, step, gid, index, len(choices), int(c.get("index", i)),
                                prompt, sampling,
                                _completion(c, cut, fin.token_versions if len(choices) == 1
                                            else None), binding, engine, stamps,
                                attribution, fleet)
               for i, c in enumerate(choices)]
    return TrajectoryGroup(tuple(samples))


def _placement(fin: FinishedRequest) -> FleetPlacement | None:
    """The replica and fleet version a fleet gateway's router chose (``Target.info``)."""
    info = fin.target.info if fin.target is not None else {}
    if "fleet_version" not in info:
        return None
    return FleetPlacement(str(info["replica"]), int(info["fleet_version"]),
                          str(info["fleet_label"]))


class GatewayRecorder:
    """The data plane's ``on_finished`` hook: queue, then one writer thread.

    Counts by result (``stats``): ``committed`` (written, attributable),
    ``unattributable`` (written, marked so), ``duplicate`` (the same group
    was on disk already), ``failed`` (not recordable: bad coordinates,
    hostile or malformed content, a failed write; the reason is kept),
    ``too_large`` (a stream longer than the gateway collects), ``dropped``
    (queue full, or after close), ``skipped`` (nothing to record: another
    route, no coordinates, an error answer).
    """

    def __init__(self, path: str | Path, engine: EngineIdentity, *,
                 engines: Mapping[str, EngineIdentity] | None = None,
                 max_pending: int = 4096) -> None:
        if not isinstance(engine, EngineIdentity):
            raise BadInput("engine must be an EngineIdentity")
        if engines is not None and not all(isinstance(e, EngineIdentity)
                                           for e in engines.values()):
            raise BadInput("engines must map target names to EngineIdentity")
        self.engine = engine
        #: A fleet's engines, by replica (the data plane's target name); else the one.
        self.engines = dict(engines or {})
        self.path = Path(path)
        self._rec = TrajectoryRecorder(path)
        self._q: queue.Queue[FinishedRequest | None] = queue.Queue(max_pending)
        self.counts: collections.Counter[str] = collections.Counter()
        self.errors: collections.deque[str] = collections.deque(maxlen=32)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="rolloutcore-recorder",
                                        daemon=True)
        self._thread.start()

    def _count(self, what: str, error: str | None = None) -> None:
        with self._lock:
            self.counts[what] += 1
            if error:
                self.errors.append(error[:500])

    def stats(self) -> dict[str, Any]:
        """What ``/control/status`` shows and ``/metrics`` exports."""
        with self._lock:
            counts, errors = dict(self.counts), list(self.errors)
        return {"path": str(self.path), "alive": self._thread.is_alive(),
                "pending": self._q.qsize(), "counts": counts, "recent_errors": errors}

    def __call__(self, fin: FinishedRequest) -> None:
        """Called on the event loop when a request ends: never blocks."""
        if self._closing.is_set():
            self._count("dropped", f"recorder closed: {fin.binding.rollout_id}")
            return
        if fin.route != GENERATE or fin.ending not in _RECORDED or RUN_HEADER not in \
                fin.headers or (fin.ending == "complete" and fin.status != 200):
            self._count("skipped")
            return
        if fin.record_overflow:
            self._count("too_large", f"{fin.binding.rollout_id}: stream longer than the "
                        "gateway collects for the recorder")
            return
        try:
            self._q.put_nowait(fin)
        except queue.Full:
            self._count("dropped", f"queue full: {fin.binding.rollout_id}")

    def _one(self, fin: FinishedRequest) -> str:
        # Whatever walks the request recursively (the record's own checks and
        # encoder) must not meet nesting deeper than a record keeps.
        if json_depth(fin.request, MAX_EXTRA_DEPTH + 2) > MAX_EXTRA_DEPTH + 2:
            raise BadInput(f"the request nests deeper than {MAX_EXTRA_DEPTH + 2}")
        engine = self.engine if fin.target is None else self.engines.get(fin.target.name,
                                                                           self.engine)
        group = build_group(fin, engine)
        if self._rec.append_group(group) is AppendOutcome.ALREADY_COMMITTED:
            return "duplicate"
        return "committed" if fin.attributable else "unattributable"

    def _work(self) -> None:
        """The single writer. Survives anything one record can do to it."""
        while True:
            try:
                fin = self._q.get(timeout=0.2)
            except queue.Empty:
                if self._closing.is_set():
                    return
                continue
            try:
                if fin is None:
                    return
                try:
                    what = self._one(fin)
                except Exception as exc:  # any request: counted, never fatal
                    self._count("failed", f"{fin.binding.rollout_id}: "
                                f"{type(exc).__name__}: {exc}")
                else:
                    self._count(what)
            finally:
                self._q.task_done()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything queued so far is written (bounded); True when it was."""
        done = threading.Event()

        def waiter() -> None:
            self._q.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking records, write what is queued within ``timeout_s``, close the file.

        Never blocks longer: a writer still busy then (a disk that hangs) is
        left to its daemon thread, its file not closed under it, and counted.
        """
        self._closing.set()
        with contextlib.suppress(queue.Full):
            self._q.put_nowait(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._count("abandoned", f"the writer was still busy {timeout_s:g}s after close")
            return
        self._rec.close()
