"""The replay validator: does an engine at the recorded version reproduce the record?

A trajectory record claims that a policy version produced a completion with
given sampled-token logprobs. Replay checks the claim against an engine
serving that version, in two lanes:

* **token lane (exact)**: a sample that was greedy, or sampled with a seed
  (vLLM builds a per-request generator from it), is generated again with the
  recorded sampling parameters and its token ids must be identical. An
  unseeded sample at a temperature cannot be regenerated: its token lane is
  *not applicable*, never passed.
* **logprob lane (tolerance)**: the recorded prompt + completion is scored
  teacher-forced (vLLM ``prompt_logprobs``, ``VllmHTTP.score``) and each
  position's log-probability is compared with the recorded sampled-token
  logprob. Both are raw log-softmax values under vLLM's default
  ``logprobs_mode=raw_logprobs`` (before temperature, top-k/top-p), so they
  are comparable at any temperature; the report gives max and mean absolute
  difference and the first positions above the tolerance, per sample.

Why both: the token lane is exact but only applies to reproducible samples
and says nothing about *how wrong* a divergence is; the logprob lane applies
to every sample with recorded logprobs and separates numeric noise (prefill
vs decode kernels) from another policy (differences of nats).

**Version first.** Replaying against another policy makes every difference
meaningless, so before any generation the engine's ``/weight_info`` label
is compared with each record's binding label (and with the record's own
engine spans), and re-read after every sample: a label that changed during
the replay invalidates the sample. vLLM's initial label ``default`` names no
particular weights (every fresh engine says it), so with a ``ChecksumCache``
the validator also compares the engine's ``/weight_checker`` checksums with
the cached reference of each bound checkpoint (``binding.identity``'s
content digest). What happens to a sample at another version is the
``MismatchPolicy``: ``refuse`` (default: ``ReplayRefused``, nothing
replayed), ``report`` (listed as ``version-mismatch``, which fails the
report) or ``skip`` (listed as ``skipped``; the rest is replayed, and the report
is not OK: a skipped sample is not verified).

**Through an adapter.** A sample generated through a LoRA adapter (trajectory
schema 5, ``adapter``) is replayed through that adapter: both lanes send its
name as the model, and the engine must list that name with the base as its
parent (else it is a version mismatch, as above). The name is
content-addressed (``rcl-<generation>-<digest[:16]>``), so the check is that
an adapter with that content was loaded under it; load the version's files
(kept by the trainer: RolloutCore retires them from its own store) under the
recorded name first.

Exactness assumes what vLLM itself does not promise across batch shapes:
the replay sends one request at a time, so a recorded sample that was
batched with others may differ by kernel noise; the logprob lane tells that
noise (small) from a wrong policy (large).
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rolloutcore.core.records import fields_dict
from rolloutcore.engine.http import Routes, VllmHTTP
from rolloutcore.engine.verify import ChecksumCache, engine_layout, verify_engine
from rolloutcore.errors import BadInput, EffectError, EngineUnavailable, ReplayRefused
from rolloutcore.provenance.audit import report_table
from rolloutcore.provenance.inputs import check_trajectory_file, require_samples
from rolloutcore.provenance.recorder import read_trajectories
from rolloutcore.provenance.replay_options import DEFAULT_TOLERANCE, MismatchPolicy
from rolloutcore.provenance.trajectory import TrajectorySample

__all__ = [
    "DEFAULT_LABEL",
    "DEFAULT_TOLERANCE",
    "LaneStatus",
    "LogprobLane",
    "MismatchPolicy",
    "ReplayRefused",
    "ReplayReport",
    "ReplayValidator",
    "SampleReplay",
    "SampleStatus",
    "TokenLane",
    "WeightsCheck",
    "compare_logprobs",
    "compare_tokens",
    "adapter_issue",
    "record_version_issue",
    "replay_file",
    "replay_lanes",
    "token_lane_reason",
]


#: What vLLM's ``/weight_info`` says before any ``weight_version`` was set.
DEFAULT_LABEL = "default"

_SHOW_POSITIONS = 5
_RAW = "raw_logprobs"


class LaneStatus(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    NOT_APPLICABLE = "n/a"
    ERROR = "error"


class SampleStatus(enum.StrEnum):
    PASS = "pass"                      # every applicable lane passed
    FAIL = "fail"                      # a lane failed
    VERSION_MISMATCH = "version-mismatch"
    SKIPPED = "skipped"                # other version, MismatchPolicy.SKIP
    NOT_REPLAYABLE = "not-replayable"  # no lane applies (no logprobs, unseeded sampling)
    ERROR = "error"                    # the engine refused or timed out


# --------------------------------------------------------------------------- lanes (pure)


@dataclass(frozen=True)
class TokenLane:
    """Token ids regenerated vs recorded: exact."""

    status: LaneStatus
    detail: str = ""
    recorded: int = 0
    replayed: int | None = None
    first_mismatch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


@dataclass(frozen=True)
class LogprobLane:
    """Teacher-forced logprobs vs recorded sampled-token logprobs, under ``tolerance``."""

    status: LaneStatus
    detail: str = ""
    tolerance: float = DEFAULT_TOLERANCE
    positions: int = 0
    max_abs_diff: float | None = None
    mean_abs_diff: float | None = None
    worst_position: int | None = None
    over_tolerance: int = 0
    first_mismatches: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _check_tolerance(tolerance: float) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or \
            not math.isfinite(tolerance) or tolerance < 0:
        raise BadInput(f"tolerance must be a finite number >= 0 (nats), got {tolerance!r}")
    return float(tolerance)


def token_lane_reason(sample: TrajectorySample) -> str | None:
    """Why the token lane cannot apply to ``sample``; ``None`` when it can."""
    if not sample.completion.token_ids:
        return "no output tokens recorded"
    sp = sample.sampling
    if not sp.greedy and sp.seed is None:
        return (f"sampled at temperature {sp.temperature:g} without a seed: "
                "not reproducible")
    return None


def compare_tokens(recorded: Sequence[int], replayed: Sequence[int], *,
                   prefix: bool = False) -> TokenLane:
    """Exact comparison; with ``prefix`` the record only has to start the replay.

    ``prefix`` is for records cut short (``finish_reason`` ``abort``).
    """
    rec, rep = list(recorded), list(replayed)
    n = min(len(rec), len(rep))
    first = next((i for i in range(n) if rec[i] != rep[i]), None)
    if first is not None:
        return TokenLane(LaneStatus.FAIL, f"first mismatch at output position {first}: "
                         f"recorded {rec[first]}, replayed {rep[first]}", len(rec), len(rep),
                         first)
    if len(rec) == len(rep) or (prefix and len(rep) >= len(rec)):
        return TokenLane(LaneStatus.PASS, "", len(rec), len(rep))
    return TokenLane(LaneStatus.FAIL, f"identical for {n} tokens, then the record has "
                     f"{len(rec)} and the replay {len(rep)}", len(rec), len(rep), n)


def compare_logprobs(recorded: Sequence[float], scored: Sequence[float | None],
                     tolerance: float = DEFAULT_TOLERANCE) -> LogprobLane:
    """Position by position; a position the engine did not score is left out and said so."""
    tol = _check_tolerance(tolerance)
    if len(recorded) != len(scored):
        raise BadInput(f"{len(recorded)} recorded logprobs for {len(scored)} scored positions")
    diffs: list[tuple[int, float]] = []
    for i, (r, s) in enumerate(zip(recorded, scored, strict=True)):
        if s is None:
            continue
        if not (math.isfinite(r) and math.isfinite(s)):
            raise BadInput(f"non-finite logprob at position {i}: recorded {r}, scored {s}")
        diffs.append((i, abs(r - s)))
    unscored = len(recorded) - len(diffs)
    note = f"{unscored} position(s) not scored" if unscored else ""
    if not diffs:
        return LogprobLane(LaneStatus.ERROR, note or "nothing to compare", tol)
    worst_pos, worst = max(diffs, key=lambda t: t[1])
    over = [i for i, d in diffs if d > tol]
    status = LaneStatus.FAIL if over else LaneStatus.PASS
    detail = "; ".join(x for x in (
        f"{len(over)} of {len(diffs)} positions differ by more than {tol:g} nats" if over
        else "", note) if x)
    return LogprobLane(status, detail, tol, len(diffs), worst,
                       sum(d for _, d in diffs) / len(diffs), worst_pos, len(over),
                       tuple(over[:_SHOW_POSITIONS]))


def record_version_issue(sample: TrajectorySample, engine_label: str) -> str | None:
    """Why ``sample`` is not at ``engine_label``'s version; ``None`` when it is.

    The record's own engine spans are a second witness: spans naming a label
    other than the binding's mean the record is not the binding's version.
    """
    bound = sample.binding.version.label
    spans = sample.completion.span_versions
    if spans is not None and any(v != bound for v in spans):
        return (f"record's engine spans name {', '.join(spans)} but its binding is "
                f"{bound!r}")
    if bound != engine_label:
        return f"record bound to {bound!r}, engine serves {engine_label!r}"
    return None


def adapter_issue(sample: TrajectorySample, listed: Mapping[str, str | None]) -> str | None:
    """Why ``sample``'s adapter cannot be replayed on an engine listing ``listed``
    (``/v1/models``: name -> parent); ``None`` when it can (or it has none)."""
    a = sample.adapter
    if a is None:
        return None
    if not a.name.endswith("-" + a.content_digest[:16]):
        return (f"adapter name {a.name!r} does not carry its content digest "
                f"{a.content_digest[:16]}: the engine's adapter of that name cannot be "
                "shown to be it")
    if a.name not in listed:
        return (f"generated through adapter {a.name!r}, which the engine does not list: "
                f"load that version's files under that name")
    if listed[a.name] is None:
        return f"{a.name!r} is the engine's base model here, not an adapter"
    return None


# --------------------------------------------------------------------------- lanes (engine)


def _logprob_reason(sample: TrajectorySample, engine_mode: str | None) -> str | None:
    c = sample.completion
    if c.logprobs is None:
        return "no logprobs recorded"
    if not c.token_ids:
        return "no output tokens recorded"
    mode = sample.engine.config.get("logprobs_mode", _RAW)
    if mode != _RAW:
        return (f"recorded logprobs_mode {mode!r} is not comparable with prompt logprobs "
                f"(needs {_RAW!r})")
    if engine_mode is not None and engine_mode != _RAW:
        return f"replay engine runs logprobs_mode {engine_mode!r}, needs {_RAW!r}"
    return None


def _regenerate(http: VllmHTTP, sample: TrajectorySample,
                timeout_s: float | None) -> tuple[TokenLane, frozenset[str]]:
    sp = sample.sampling
    rec = sample.completion.token_ids
    aborted = sample.completion.finish_reason == "abort"
    max_tokens = len(rec) if aborted or sp.max_tokens is None else sp.max_tokens
    extra = {k: v for k, v in sp.to_vllm().items()
             if k not in ("max_tokens", "temperature", "seed")}
    if "n" in extra:
        extra["n"] = 1
    gen = http.generate(sample.prompt.token_ids, max_tokens=max_tokens,
                        temperature=sp.temperature, seed=sp.seed, logprobs=False,
                        ignore_eos=bool(extra.get("ignore_eos", False)),
                        sampling_extra=extra, timeout_s=timeout_s,
                        model=None if sample.adapter is None else sample.adapter.name)
    lane = compare_tokens(rec, gen.token_ids, prefix=aborted)
    if lane.status is LaneStatus.PASS and not aborted and \
            gen.finish_reason != sample.completion.finish_reason:
        lane = TokenLane(lane.status, f"finish reason {gen.finish_reason!r}, recorded "
                         f"{sample.completion.finish_reason!r}", lane.recorded, lane.replayed)
    return lane, gen.versions()


def _rescore(http: VllmHTTP, sample: TrajectorySample, tolerance: float,
             timeout_s: float | None) -> LogprobLane:
    prompt = list(sample.prompt.token_ids)
    comp = list(sample.completion.token_ids)
    rec = sample.completion.logprobs
    assert rec is not None
    model = None if sample.adapter is None else sample.adapter.name
    try:
        scored = http.score(prompt + comp, timeout_s=timeout_s, model=model)
    except BadInput:
        # Scoring generates one token: a record that fills max_model_len does
        # not fit. Score all but its last token rather than nothing.
        if len(comp) < 2:
            raise
        scored = [*http.score(prompt + comp[:-1], timeout_s=timeout_s, model=model), None]
    return compare_logprobs(rec, scored[len(prompt):], tolerance)


def replay_lanes(http: VllmHTTP, sample: TrajectorySample, *,
                 tolerance: float = DEFAULT_TOLERANCE, timeout_s: float | None = None,
                 engine_logprobs_mode: str | None = None,
                 ) -> tuple[TokenLane, LogprobLane, frozenset[str]]:
    """Both lanes of one sample, **without any version check** (``ReplayValidator`` does it).

    Returns the lanes and the labels the engine put on the regenerated
    tokens (empty when the token lane did not run). An engine that refuses
    a request (``BadInput``) or times out makes that lane ``ERROR``;
    ``EngineUnavailable`` propagates.
    """
    tol = _check_tolerance(tolerance)
    labels: frozenset[str] = frozenset()
    if sample.prompt.media:
        # Images are recorded as digests only: without them the prompt is not the prompt.
        media = (f"the prompt had {len(sample.prompt.media)} image(s), recorded as digests "
                 "only: the replay would need the images")
        return (TokenLane(LaneStatus.NOT_APPLICABLE, media, len(sample.completion.token_ids)),
                LogprobLane(LaneStatus.NOT_APPLICABLE, media, tol), labels)
    why = token_lane_reason(sample)
    if why is not None:
        tok = TokenLane(LaneStatus.NOT_APPLICABLE, why, len(sample.completion.token_ids))
    else:
        try:
            tok, labels = _regenerate(http, sample, timeout_s)
        except EngineUnavailable:
            raise
        except (BadInput, EffectError) as exc:
            tok = TokenLane(LaneStatus.ERROR, str(exc), len(sample.completion.token_ids))
    why = _logprob_reason(sample, engine_logprobs_mode)
    if why is not None:
        lp = LogprobLane(LaneStatus.NOT_APPLICABLE, why, tol)
    else:
        try:
            lp = _rescore(http, sample, tol, timeout_s)
        except EngineUnavailable:
            raise
        except (BadInput, EffectError) as exc:
            lp = LogprobLane(LaneStatus.ERROR, str(exc), tol)
    return tok, lp, labels


# --------------------------------------------------------------------------- report


@dataclass(frozen=True)
class SampleReplay:
    group_id: str
    sample_index: int
    recorded_label: str
    status: SampleStatus
    token: TokenLane
    logprob: LogprobLane
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "sample_index": self.sample_index,
                "recorded_label": self.recorded_label, "status": self.status.value,
                "detail": self.detail, "token_lane": self.token.to_dict(),
                "logprob_lane": self.logprob.to_dict()}


@dataclass(frozen=True)
class WeightsCheck:
    """Engine checksums vs the cached reference of one bound checkpoint."""

    content_digest: str | None
    status: str          # verified | mismatch | no-reference | no-content-digest
    detail: str = ""
    coverage: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def _status(tok: TokenLane, lp: LogprobLane) -> SampleStatus:
    lanes = (tok.status, lp.status)
    if LaneStatus.FAIL in lanes:
        return SampleStatus.FAIL
    if LaneStatus.ERROR in lanes:
        return SampleStatus.ERROR
    if LaneStatus.PASS in lanes:
        return SampleStatus.PASS
    return SampleStatus.NOT_REPLAYABLE


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


@dataclass(frozen=True)
class ReplayReport:
    trajectories: str
    engine: str
    engine_label: str
    tolerance: float
    policy: MismatchPolicy
    samples: tuple[SampleReplay, ...]
    weights: tuple[WeightsCheck, ...] = ()
    notes: tuple[str, ...] = ()
    elapsed_s: float = 0.0

    def counts(self) -> dict[str, int]:
        c = Counter(s.status.value for s in self.samples)
        return {st.value: c.get(st.value, 0) for st in SampleStatus}

    @property
    def ok(self) -> bool:
        """Something passed, and nothing failed, errored, was at another version or was
        skipped: a skipped sample is not verified, so a replay that skipped any is not OK."""
        c = self.counts()
        return c[SampleStatus.PASS.value] > 0 and not any(
            c[s.value] for s in (SampleStatus.FAIL, SampleStatus.ERROR,
                                 SampleStatus.VERSION_MISMATCH, SampleStatus.SKIPPED))

    def _lane_summary(self) -> dict[str, Any]:
        lps = [s.logprob for s in self.samples if s.logprob.max_abs_diff is not None]
        positions = sum(lp.positions for lp in lps)
        return {
            "token": dict(Counter(s.token.status.value for s in self.samples
                                  if s.status not in (SampleStatus.SKIPPED,
                                                      SampleStatus.VERSION_MISMATCH))),
            "logprob": dict(Counter(s.logprob.status.value for s in self.samples
                                    if s.status not in (SampleStatus.SKIPPED,
                                                        SampleStatus.VERSION_MISMATCH))),
            "logprob_positions": positions,
            "logprob_max_abs_diff": max((lp.max_abs_diff or 0.0 for lp in lps), default=None),
            "logprob_mean_abs_diff": (None if not positions else sum(
                (lp.mean_abs_diff or 0.0) * lp.positions for lp in lps) / positions),
        }

    def to_dict(self) -> dict[str, Any]:
        return {"trajectories": self.trajectories, "engine": self.engine,
                "engine_label": self.engine_label, "tolerance": self.tolerance,
                "policy": self.policy.value, "ok": self.ok, "counts": self.counts(),
                "lanes": self._lane_summary(), "elapsed_s": self.elapsed_s,
                "weights": [w.to_dict() for w in self.weights], "notes": list(self.notes),
                "samples": [s.to_dict() for s in self.samples]}

    def _verdict(self, c: dict[str, int]) -> str:
        if self.ok:
            return "OK"
        skipped = c[SampleStatus.SKIPPED.value]
        if skipped and not any(c[s.value] for s in (SampleStatus.FAIL, SampleStatus.ERROR,
                                                     SampleStatus.VERSION_MISMATCH)):
            return (f"NOT VERIFIED ({skipped} of {len(self.samples)} samples skipped: at "
                    "another version, not replayed)")
        return "FAILED"

    def format_table(self, max_rows: int = 50) -> str:
        c = self.counts()
        lanes = self._lane_summary()
        head = ", ".join(f"{v} {k}" for k, v in c.items() if v)
        lines = [f"replay of {self.trajectories} against {self.engine} "
                 f"(engine label {self.engine_label!r}): {self._verdict(c)}",
                 f"  {len(self.samples)} samples: {head or 'none'}; "
                 f"{self.elapsed_s:.1f}s",
                 "  token lane (exact): " + (", ".join(
                     f"{v} {k}" for k, v in sorted(lanes['token'].items())) or "-"),
                 "  logprob lane (tolerance " f"{self.tolerance:g} nats): " + (", ".join(
                     f"{v} {k}" for k, v in sorted(lanes['logprob'].items())) or "-")
                 + f"; {lanes['logprob_positions']} positions, max |diff| "
                 f"{_fmt(lanes['logprob_max_abs_diff'])}, mean "
                 f"{_fmt(lanes['logprob_mean_abs_diff'])}"]
        for w in self.weights:
            dig = (w.content_digest or "-")[:12]
            lines.append(f"  weights {dig}: {w.status}: {w.detail}")
        lines += [f"  note: {n}" for n in self.notes]
        rows = [("group", "sample", "label", "status", "tokens", "logprob max/mean",
                 "first >tol", "detail")]
        for s in self.samples[:max_rows]:
            t, lp = s.token, s.logprob
            tok = t.status.value if t.first_mismatch is None else \
                f"{t.status.value}@{t.first_mismatch}"
            lpv = lp.status.value if lp.max_abs_diff is None else \
                f"{lp.status.value} {_fmt(lp.max_abs_diff)}/{_fmt(lp.mean_abs_diff)}"
            detail = s.detail or "; ".join(x for x in (
                t.detail if t.status is not LaneStatus.PASS else "",
                lp.detail if lp.status is not LaneStatus.PASS else "") if x)
            rows.append((s.group_id, str(s.sample_index), s.recorded_label, s.status.value,
                         tok, lpv, ",".join(map(str, lp.first_mismatches)) or "-",
                         detail[:120]))
        lines += report_table(rows, len(self.samples), max_rows, "samples")
        return "\n".join(lines)


# --------------------------------------------------------------------------- validator


class ReplayValidator:
    """Replays samples against the engine behind ``http``, one request at a time."""

    def __init__(self, http: VllmHTTP, *, tolerance: float = DEFAULT_TOLERANCE,
                 policy: MismatchPolicy | str = MismatchPolicy.REFUSE,
                 checksum_cache: ChecksumCache | str | os.PathLike[str] | None = None,
                 timeout_s: float | None = None) -> None:
        if not isinstance(http, VllmHTTP):
            raise BadInput("http must be a VllmHTTP")
        try:
            self.policy = MismatchPolicy(policy)
        except ValueError:
            raise BadInput(f"policy must be one of {[p.value for p in MismatchPolicy]}, "
                           f"got {policy!r}") from None
        self.http = http
        self.tolerance = _check_tolerance(tolerance)
        self.cache = checksum_cache if checksum_cache is None or isinstance(
            checksum_cache, ChecksumCache) else ChecksumCache(checksum_cache)
        if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(
                timeout_s, (int, float)) or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise BadInput(f"timeout_s must be a positive number, got {timeout_s!r}")
        self.timeout_s = timeout_s

    def _label(self) -> str:
        wi = self.http.weight_info(timeout_s=self.timeout_s)
        if not wi.label_supported or wi.label is None:
            raise ReplayRefused("the engine reports no weight version (no /weight_info, vLLM "
                                "< 0.32): it cannot be shown to serve the recorded version")
        return wi.label

    def _weights(self, samples: Sequence[TrajectorySample]) -> dict[str | None, WeightsCheck]:
        """Engine checksums vs the cached reference of each bound checkpoint."""
        assert self.cache is not None
        out: dict[str | None, WeightsCheck] = {}
        layout: Mapping[str, Any] | None = None
        for s in samples:
            dig = s.binding.identity.content_digest
            if dig in out:
                continue
            if dig is None:
                out[dig] = WeightsCheck(None, "no-content-digest",
                                        "binding identity has no content digest")
                continue
            if layout is None:
                layout = engine_layout(self.http, timeout_s=self.timeout_s)
            ref = self.cache.get(dig, layout)
            if ref is None:
                out[dig] = WeightsCheck(dig, "no-reference",
                                        "no cached reference for this checkpoint and layout")
                continue
            rep = verify_engine(self.http, ref, timeout_s=self.timeout_s)
            out[dig] = WeightsCheck(dig, "verified" if rep.passed else "mismatch",
                                    rep.detail(), rep.coverage)
        return out

    def _notes(self, samples: Sequence[TrajectorySample]) -> tuple[list[str], str | None]:
        notes: list[str] = []
        engine_mode: str | None = None
        h = self.http
        if Routes.SERVER_INFO in h.capabilities(timeout_s=self.timeout_s):
            cfg = h.server_info(timeout_s=self.timeout_s).get("vllm_config")
            mc = cfg.get("model_config") if isinstance(cfg, dict) else None
            if isinstance(mc, dict):
                m = mc.get("logprobs_mode")
                engine_mode = m if isinstance(m, str) else None
                dtype = str(mc.get("dtype", "")).removeprefix("torch.")
                rec = {str(s.engine.config.get("dtype")) for s in samples
                       if "dtype" in s.engine.config}
                if dtype and rec and rec != {dtype}:
                    notes.append(f"records were served in {', '.join(sorted(rec))}, the "
                                 f"replay engine runs {dtype}: expect numeric differences")
        version = h.version(timeout_s=self.timeout_s) if Routes.VERSION in h.capabilities(
            timeout_s=self.timeout_s) else None
        rec_versions = {s.engine.vllm_version for s in samples}
        if version is not None and rec_versions != {version}:
            notes.append(f"records come from vLLM {', '.join(sorted(rec_versions))}, the "
                         f"replay engine is {version}")
        if not any("logprobs_mode" in s.engine.config for s in samples):
            notes.append(f"records do not state logprobs_mode: vLLM's default {_RAW!r} "
                         "assumed")
        return notes, engine_mode

    def replay(self, samples: Iterable[TrajectorySample], *,
               trajectories: str = "<samples>") -> ReplayReport:
        t0 = time.monotonic()
        items = list(samples)
        if not all(isinstance(s, TrajectorySample) for s in items):
            raise BadInput("replay takes TrajectorySample records")
        if not items:
            raise BadInput(f"{trajectories}: no committed samples to replay")
        label = self._label()
        issues: dict[int, str] = {}
        listed = (self.http.models(timeout_s=self.timeout_s)
                  if any(s.adapter is not None for s in items) else {})
        for i, s in enumerate(items):
            why = record_version_issue(s, label) or adapter_issue(s, listed)
            if why is not None:
                issues[i] = why
        weights: dict[str | None, WeightsCheck] = {}
        if self.cache is not None:
            weights = self._weights([s for i, s in enumerate(items) if i not in issues])
            for i, s in enumerate(items):
                w = weights.get(s.binding.identity.content_digest)
                if i not in issues and w is not None and w.status == "mismatch":
                    issues[i] = ("engine checksums differ from the bound checkpoint's "
                                 "reference: " + w.detail)
        if issues and self.policy is MismatchPolicy.REFUSE:
            first = next(iter(issues.values()))
            raise ReplayRefused(f"{len(issues)} of {len(items)} samples are not at the "
                                f"engine's version {label!r} (first: {first}); nothing "
                                "replayed (policy 'skip' replays the others)")
        if len(issues) == len(items) and self.policy is MismatchPolicy.SKIP:
            raise ReplayRefused(f"no sample is at the engine's version {label!r}; nothing "
                                "replayed")
        notes, engine_mode = self._notes(items)
        if label == DEFAULT_LABEL and not any(w.status == "verified"
                                              for w in weights.values()):
            notes.append(f"the engine's label {DEFAULT_LABEL!r} is vLLM's initial label and "
                         "names no particular weights; give a checksum cache to verify them")
        out: list[SampleReplay] = []
        drifted: str | None = None
        for i, s in enumerate(items):
            bound = s.binding.version.label
            if i in issues or drifted is not None:
                st = SampleStatus.SKIPPED if (self.policy is MismatchPolicy.SKIP
                                              and drifted is None) \
                    else SampleStatus.VERSION_MISMATCH
                na = "not replayed: other version"
                out.append(SampleReplay(s.group_id, s.sample_index, bound, st,
                                        TokenLane(LaneStatus.NOT_APPLICABLE, na),
                                        LogprobLane(LaneStatus.NOT_APPLICABLE, na,
                                                    self.tolerance),
                                        issues.get(i) or f"not replayed: the engine's label "
                                        f"changed to {drifted!r} during the replay"))
                continue
            tok, lp, seen = replay_lanes(self.http, s, tolerance=self.tolerance,
                                         timeout_s=self.timeout_s,
                                         engine_logprobs_mode=engine_mode)
            after = self._label()
            drift = sorted((seen | {after}) - {label})
            if drift:
                # The engine moved under us: this sample and every later one are void.
                drifted = after
                notes.append(f"engine label changed during the replay: {label!r} -> "
                             f"{', '.join(drift)}; later samples not replayed")
                out.append(SampleReplay(s.group_id, s.sample_index, bound,
                                        SampleStatus.VERSION_MISMATCH, tok, lp,
                                        f"engine label changed during this sample: "
                                        f"{label!r} -> {', '.join(drift)}"))
                continue
            out.append(SampleReplay(s.group_id, s.sample_index, bound, _status(tok, lp),
                                    tok, lp))
        return ReplayReport(trajectories, self.http.base_url, label, self.tolerance,
                            self.policy, tuple(out), tuple(weights.values()), tuple(notes),
                            time.monotonic() - t0)


def replay_file(trajectories: str | os.PathLike[str], engine: str | VllmHTTP, *,
                tolerance: float = DEFAULT_TOLERANCE,
                policy: MismatchPolicy | str = MismatchPolicy.REFUSE,
                checksum_cache: ChecksumCache | str | os.PathLike[str] | None = None,
                timeout_s: float = 120.0) -> ReplayReport:
    """Replay the committed samples of a trajectory file against an engine URL (or client)."""
    path = os.fspath(trajectories)
    check_trajectory_file(path)   # empty, unreadable or a journal: refused, reason first
    samples = list(read_trajectories(path))
    require_samples(path, len(samples))
    if isinstance(engine, VllmHTTP):
        return ReplayValidator(engine, tolerance=tolerance, policy=policy,
                               checksum_cache=checksum_cache,
                               timeout_s=timeout_s).replay(samples, trajectories=path)
    with VllmHTTP(engine, timeout_s=timeout_s) as http:
        return ReplayValidator(http, tolerance=tolerance, policy=policy,
                               checksum_cache=checksum_cache,
                               timeout_s=timeout_s).replay(samples, trajectories=path)
