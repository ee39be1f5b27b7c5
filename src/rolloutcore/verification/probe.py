"""Behavioural validation: does the engine now compute the *target* policy?

A label, a 200 from every endpoint and even checksums of the parameters the
engine can hash do not prove that: a transport can skip or mis-route a
tensor, a load path can leave a derived buffer stale, and on the CPU backend
the fused linear layers cannot be hashed at all. So the trainer computes, from
the very tensors it sends, what the target policy does on a few fixed probe
inputs, and the engine must reproduce it before anything is admitted under
the new version.

The comparison is teacher-forced, so that a near-tie between two tokens
cannot make a correct engine look wrong: the trainer generates a greedy
continuation of each probe prompt with a plain PyTorch forward of its model
(float32, from the bf16 weights it sends) and records the log-probability of
each continuation token. The engine scores prompt + continuation with
``prompt_logprobs`` and the check compares, position by position, the
log-probability the engine gives the same tokens. The greedy tokens the
engine would itself generate are compared too and reported, but only the
teacher-forced difference decides, under ``tolerance`` (nats). The tolerance
is measured, not guessed: ``benchmarks/probe_tolerance.py`` records the
distribution on correct and on wrong updates (docs/probe-tolerance.md).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Protocol, TypeAlias, TypeVar

from rolloutcore.core.evidence import Check, UpdateTarget
from rolloutcore.core.records import fields_dict
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EffectError

if TYPE_CHECKING:
    import torch

__all__ = [
    "CALIBRATION_MARGIN",
    "MEAN_FLOOR_FRACTION",
    "MEAN_MARGIN",
    "DEFAULT_TOLERANCE",
    "TAKEOVER_TOLERANCE",
    "Calibrated",
    "Calibration",
    "Judgement",
    "MAX_TOLERANCE",
    "ModelOrDir",
    "ModelScorer",
    "WIRE_LIMITS",
    "PolicyProbe",
    "ProbeCase",
    "ProbeResult",
    "Scorer",
    "default_prompts",
    "deviations_at",
    "takes_calibration",
]

#: A model as a trainer hands it over: a checkpoint (or adapter) directory, or a
#: module (a HF causal LM, a PEFT model).
ModelOrDir: TypeAlias = "str | Path | torch.nn.Module"

#: Nats. Calibrated on the CPU engine with the tiny test models: correct updates
#: measured 0.0026-0.0032, the smallest single mis-sent tensor 0.0072 (a q_proj:
#: random-init attention is nearly uniform, so q/k errors move little). Other
#: models and kernels have other noise: calibrate with benchmarks/probe_tolerance.py.
#: See docs/probe-tolerance.md.
DEFAULT_TOLERANCE = 0.005

#: The largest tolerance a probe may carry over the wire by default: a probe
#: with a tolerance of whole nats passes anything, so a gateway that promises
#: ``probe`` refuses one (``ServiceConfig.max_probe_tolerance`` sets its own).
MAX_TOLERANCE = 0.05

#: Bounds of a probe sent over the wire (``PolicyProbe.from_wire``): what a
#: gateway accepts from a trainer before anything drains. Each case costs the
#: engine one scoring call while admission is closed, so they are bounded.
WIRE_LIMITS: dict[str, int] = {"cases": 32, "prompt": 4096, "continuation": 512,
                               "positions": 32768, "name": 128}


#: How far a correct update's probe may deviate beyond what the engine showed on
#: the checkpoint it was started on (the takeover's probe of it), measured by
#: ``benchmarks/probe_tolerance.py`` (docs/probe-tolerance.md). The worst
#: position (max |dlogp|) of a correct update reached 2.05x the takeover's on a
#: tied Qwen3 (a maximum over 48 positions is a noisy statistic), so the max may
#: reach ``CALIBRATION_MARGIN`` times the takeover's; the mean over the
#: positions stayed within 1.31x, while the weakest mis-sent tensor (a tiny
#: Llama's q_proj) moved it 2.45x: the mean may reach ``MEAN_MARGIN`` times.
CALIBRATION_MARGIN = 3.0
MEAN_MARGIN = 2.0
#: The mean's tolerance is never below this fraction of the probe's own (max)
#: tolerance: an engine that happened to be exact at takeover does not refuse
#: every later update for a rounding.
MEAN_FLOOR_FRACTION = 0.2

#: The tolerance of a calibrating probe (a takeover, a recovery: the engine
#: cold-started on the checkpoint the probe was computed from): the largest
#: deviation that still leaves the margin under ``MAX_TOLERANCE``. A wrong
#: checkpoint deviates by tenths of a nat and more (docs/probe-tolerance.md).
TAKEOVER_TOLERANCE = MAX_TOLERANCE / CALIBRATION_MARGIN


def _check_number(what: str, v: object, *, positive: bool) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0 or (positive and v == 0):
        raise BadInput(f"calibration {what} must be a finite number "
                       f"{'> 0' if positive else '>= 0'}, got {v!r}")


@dataclass(frozen=True)
class Calibration:
    """A probe tolerance calibrated on the engine itself, at takeover.

    The fixed default was measured on one model; another model's kernels
    (its dtype, vocabulary, logit scale) are noisier, and a correct update
    is then refused (a tied Qwen3 deviates by up to 0.009-0.010 where the
    default allows 0.005). The takeover verifies the engine on the checkpoint
    it was started on with that checkpoint's own probe: the deviation it
    measures (``baseline``, the worst position, and ``baseline_mean``) is
    this engine's noise on this model with weights known to be right. An
    update's probe passes as it always did within its own tolerance; above
    it, when its worst position is within ``margin`` times ``baseline``
    (never more than ``cap``) **and** its mean within ``mean_margin`` times
    ``baseline_mean`` (never less than ``MEAN_FLOOR_FRACTION`` of the probe's
    tolerance): a loosened max alone would let the weakest mis-sent tensors
    through. A calibration never refuses what the probe's own tolerance
    accepts.
    """

    baseline: float
    baseline_mean: float
    margin: float = CALIBRATION_MARGIN
    mean_margin: float = MEAN_MARGIN
    cap: float = MAX_TOLERANCE

    def __post_init__(self) -> None:
        _check_number("baseline", self.baseline, positive=False)
        _check_number("baseline_mean", self.baseline_mean, positive=False)
        for name in ("margin", "mean_margin", "cap"):
            _check_number(name, getattr(self, name), positive=True)
        if self.baseline_mean > self.baseline:
            raise BadInput(f"calibration baseline_mean {self.baseline_mean!r} is above its "
                           f"baseline (the max) {self.baseline!r}")

    def tolerance(self, floor: float) -> float:
        """The max's tolerance of an update's probe whose own tolerance is ``floor``."""
        return min(self.cap, max(floor, self.margin * self.baseline))

    def mean_tolerance(self, floor: float) -> float:
        """The mean's tolerance of an update's probe whose own tolerance is ``floor``."""
        return min(self.cap, max(MEAN_FLOOR_FRACTION * floor,
                                 self.mean_margin * self.baseline_mean))

    def describe(self, floor: float) -> str:
        return (f"calibrated at takeover on the engine's start checkpoint: max |dlogp| "
                f"{self.baseline:.4g} x {self.margin:g} (floor {floor:g}, cap {self.cap:g}), "
                f"mean {self.baseline_mean:.3g} x {self.mean_margin:g}: mean tolerance "
                f"{self.mean_tolerance(floor):.3g}")

    def to_dict(self) -> dict[str, float]:
        return fields_dict(self)


@dataclass(frozen=True)
class Judgement:
    """A probe's result held against its tolerance (``Calibrated.judge``)."""

    passed: bool
    tolerance: float
    note: str


#: A probe set's case type (``ProbeCase``, ``ImageProbeCase``).
C = TypeVar("C")


class Calibrated(Generic[C]):
    """What a probe set needs to be calibrated (``PolicyProbe``, ``ImageProbe``).

    ``run(http, target)`` uses the probe's own tolerance; the adapter passes
    what it knows of the engine instead (``calibrations``, keyed by ``kind``)
    or, for a takeover's or a recovery's probe of the checkpoint the engine
    was started on, ``calibrating=True`` (the tolerance is then at least
    ``TAKEOVER_TOLERANCE``, and the deviation measured is written to
    ``deviations[kind]``: it becomes the engine's ``Calibration``). Nothing
    of it is kept on the probe (one probe may validate several engines at
    once). ``calibrate=False`` keeps the probe's own tolerance whatever the
    engine showed (a trainer that wants the fixed value).
    """

    #: Its ``run`` takes the calibration arguments (a wrapper or a suite that passes
    #: them on says so too; ``takes_calibration``).
    takes_calibration: ClassVar[bool] = True
    #: Which calibration applies (the text probe's or the image probe's).
    kind: ClassVar[str] = "text"
    name: str
    tolerance: float
    calibrate: bool = True

    def __init__(self, cases: Iterable[C], *, tolerance: float, name: str, timeout_s: float,
                 calibrate: bool) -> None:
        """The checks and settings both probe sets share (``cases``: at least one)."""
        self.cases = tuple(cases)
        if not self.cases:
            raise BadInput(f"a {type(self).__name__} needs at least one case")
        if not math.isfinite(tolerance) or tolerance <= 0:
            raise BadInput("tolerance must be a positive number")
        if not isinstance(calibrate, bool):
            raise BadInput(f"calibrate must be a bool, got {calibrate!r}")
        self.tolerance = tolerance
        self.name = name
        self.timeout_s = timeout_s
        self.calibrate = calibrate
        self.last: ProbeResult | None = None

    def _calibration(self, calibrations: Mapping[str, Calibration] | None
                     ) -> Calibration | None:
        if not self.calibrate or calibrations is None:
            return None
        return calibrations.get(self.kind)

    def effective_tolerance(self, calibrations: Mapping[str, Calibration] | None = None,
                            calibrating: bool = False) -> float:
        """The max |dlogp| this probe passes with."""
        if not self.calibrate:
            return self.tolerance
        if calibrating:
            return max(self.tolerance, TAKEOVER_TOLERANCE)
        cal = self._calibration(calibrations)
        return self.tolerance if cal is None else cal.tolerance(self.tolerance)

    def judge(self, res: ProbeResult, calibrations: Mapping[str, Calibration] | None = None,
              calibrating: bool = False, deviations: dict[str, tuple[float, float]] | None = None
              ) -> Judgement:
        """``res`` against the tolerance, with the words that say how it was set."""
        tol = self.effective_tolerance(calibrations, calibrating)
        passed = res.max_abs_diff <= tol
        cal = None if calibrating else self._calibration(calibrations)
        if calibrating and self.calibrate:
            note = (f"tolerance {tol:.4g} (calibrating: the engine on the checkpoint it was "
                    f"started on; its deviation calibrates later updates)")
            if deviations is not None:
                worst = deviations.get(self.kind, (0.0, 0.0))
                deviations[self.kind] = (max(worst[0], res.max_abs_diff),
                                         max(worst[1], res.mean_abs_diff))
        elif cal is not None:
            # Within the probe's own tolerance it passes as it always did; the room
            # the calibration adds above it is for noise, so the mean must be noise too.
            mean_tol = cal.mean_tolerance(self.tolerance)
            mean_ok = res.max_abs_diff <= self.tolerance or res.mean_abs_diff <= mean_tol
            passed = passed and mean_ok
            note = (f"tolerance {tol:.4g} ({cal.describe(self.tolerance)})"
                    + ("" if mean_ok else f"; above {self.tolerance:g} the mean must be noise "
                       f"too: {res.mean_abs_diff:.3g} > {mean_tol:.3g}"))
        else:
            note = f"tolerance {tol:g}" + ("" if self.calibrate else " (fixed: calibrate=False)")
        return Judgement(passed, tol, note)

    def run(self, http: Any, target: UpdateTarget, *,
            calibrations: Mapping[str, Calibration] | None = None, calibrating: bool = False,
            deviations: dict[str, tuple[float, float]] | None = None) -> Check:
        raise NotImplementedError  # each probe kind measures its own way

    def checked(self, res: ProbeResult, what: str,
                calibrations: Mapping[str, Calibration] | None, calibrating: bool,
                deviations: dict[str, tuple[float, float]] | None, extra: str = "") -> Check:
        """``run``'s check: ``res`` as ``judge`` holds it (``what``: the cases' name)."""
        j = self.judge(res, calibrations, calibrating, deviations)
        return Check(self.name, j.passed,
                     f"{len(self.cases)} {what}, {res.positions} teacher-forced positions; "
                     f"max |dlogp| {res.max_abs_diff:.4g} (case {res.worst_case}, pos "
                     f"{res.worst_position}), mean {res.mean_abs_diff:.3g}, {j.note}{extra}",
                     max_abs_diff=res.max_abs_diff, tolerance=j.tolerance,
                     level=VerificationLevel.PROBE)


def deviations_at(got: Sequence[float | None], want: Sequence[float], case: int
                  ) -> list[tuple[float, int, int]]:
    """(|dlogp|, case, position) of each reference logprob against the engine's (``got``,
    aligned with ``want``): infinite where the engine gave none, or none finite."""
    return [(math.inf if have is None or not math.isfinite(have) else abs(have - w), case, j)
            for j, (have, w) in enumerate(zip(got, want, strict=True))]


def takes_calibration(probes: object) -> bool:
    """Whether ``probes.run`` takes ``calibrations``, ``calibrating`` and ``deviations``."""
    return getattr(type(probes), "takes_calibration", False) is True


class Scorer(Protocol):
    """What the probe needs from an engine client (``VllmHTTP`` provides both)."""

    def score(self, token_ids: Sequence[int], *,
              timeout_s: float | None = None) -> list[float | None]: ...


@dataclass(frozen=True)
class ProbeCase:
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]
    logprobs: tuple[float, ...]   # reference log-probability of each continuation token

    def __post_init__(self) -> None:
        if not self.prompt or not self.continuation:
            raise BadInput("a probe needs a prompt and a continuation")
        if len(self.logprobs) != len(self.continuation):
            raise BadInput("one reference logprob per continuation token")
        if not all(math.isfinite(x) for x in self.logprobs):
            raise BadInput("reference logprobs must be finite")


@dataclass(frozen=True)
class ProbeResult:
    max_abs_diff: float
    mean_abs_diff: float
    worst_case: int
    worst_position: int
    positions: int

    @classmethod
    def of(cls, diffs: Sequence[tuple[float, int, int]]) -> ProbeResult:
        """The worst and the mean of (|dlogp|, case, position), one per compared position."""
        worst = max(diffs)
        return cls(worst[0], sum(d for d, _, _ in diffs) / len(diffs), worst[1], worst[2],
                   len(diffs))

    def to_dict(self) -> dict[str, Any]:
        return fields_dict(self)


def default_prompts(vocab_size: int, *, n: int = 3, length: int = 160,
                    seed: int = 1234) -> list[list[int]]:
    """Fixed probe prompts; ``length`` > one CPU KV block (128) so a cached block is exercised."""
    if vocab_size < 4:
        raise BadInput("vocab_size too small")
    state = seed
    out = []
    for _ in range(n):
        p = []
        for _ in range(length):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            p.append(1 + (state >> 33) % (vocab_size - 2))
        out.append(p)
    return out


class PolicyProbe(Calibrated[ProbeCase]):
    """A set of probe cases with a tolerance; ``run`` is the adapter's ProbeSet hook."""

    def __init__(self, cases: Iterable[ProbeCase], *,
                 tolerance: float = DEFAULT_TOLERANCE, name: str = "policy-probe",
                 timeout_s: float = 60.0, calibrate: bool = True) -> None:
        super().__init__(cases, tolerance=tolerance, name=name, timeout_s=timeout_s,
                         calibrate=calibrate)

    # ------------------------------------------------------------------ reference
    @classmethod
    def from_model(cls, model: torch.nn.Module, prompts: Sequence[Sequence[int]] | None = None,
                   *, new_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE
                   ) -> PolicyProbe:
        """Reference cases from a trainer-side causal LM (a HF ``*ForCausalLM`` module);
        ``prompts`` default to ``default_prompts`` of its config's vocabulary.

        The model may be on any device (a trainer's CUDA model: the reference is
        computed there, in float32); the inputs go to the device of its parameters.
        """
        import torch

        if prompts is None:
            config = getattr(model, "config", None)
            if config is None:
                raise BadInput(f"a {type(model).__name__} has no HF config to draw probe "
                               "prompts from: pass prompts")
            prompts = default_prompts(int(config.vocab_size))
        cases = []
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            with torch.no_grad():
                # A float32 copy: never change the trainer's own module.
                ref = (copy.deepcopy(model).float() if _dtype_of(model) != torch.float32
                       else model)
                dev = _device_of(ref)
                for p in prompts:
                    cont, lps = _greedy(ref, list(p), new_tokens, dev)
                    cases.append(ProbeCase(tuple(p), tuple(cont), tuple(lps)))
        finally:
            if was_training:
                model.train()
        return cls(cases, tolerance=tolerance)

    @classmethod
    def from_checkpoint(cls, model_dir: str, prompts: Sequence[Sequence[int]] | None = None, *,
                        new_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE
                        ) -> PolicyProbe:
        """Reference cases computed from a checkpoint directory (a trainer with no live model)."""
        from transformers import AutoModelForCausalLM

        from rolloutcore.verification.hf_load import HF_LOCK

        with HF_LOCK:
            model = AutoModelForCausalLM.from_pretrained(model_dir)
        return cls.from_model(model, prompts, new_tokens=new_tokens, tolerance=tolerance)

    @classmethod
    def of(cls, model: ModelOrDir, *, tolerance: float = DEFAULT_TOLERANCE) -> PolicyProbe:
        """``from_checkpoint`` of a directory, else ``from_model``."""
        if isinstance(model, (str, Path)):
            return cls.from_checkpoint(str(model), tolerance=tolerance)
        return cls.from_model(model, tolerance=tolerance)

    # ------------------------------------------------------------------ the wire
    def to_wire(self) -> dict[str, Any]:
        """The expectations as JSON: what a trainer sends with a gateway's begin.

        Only what the trainer computed (prompts, its greedy continuations,
        their log-probabilities) and the tolerance travel; the gateway runs
        the comparison itself (``from_wire`` then ``run``).
        """
        out: dict[str, Any] = {
            "name": self.name, "tolerance": self.tolerance,
            "cases": [{"prompt": list(c.prompt), "continuation": list(c.continuation),
                       "logprobs": list(c.logprobs)} for c in self.cases]}
        if not self.calibrate:
            out["calibrate"] = False  # the engine's calibration may not loosen it
        return out

    @classmethod
    def from_wire(cls, d: object, *, vocab_size: int | None = None,
                  max_tolerance: float = MAX_TOLERANCE, max_model_len: int | None = None,
                  timeout_s: float = 60.0) -> PolicyProbe:
        """Expectations received from a trainer, checked before anything is run.

        Refused with ``BadInput`` (naming the field): anything but the exact
        keys, more cases or tokens than ``WIRE_LIMITS``, a token id outside
        ``[0, vocab_size)``, one log-probability per continuation token that
        is not finite or is above 0 (a log-probability cannot be), a
        tolerance that is not in ``(0, max_tolerance]``, a sequence longer
        than the engine's context.
        """
        lim = WIRE_LIMITS
        if not isinstance(d, dict):
            raise BadInput("probe: expected an object")
        extra = set(d) - {"name", "tolerance", "cases", "calibrate"}
        if extra or "cases" not in d or "tolerance" not in d:
            raise BadInput(f"probe: needs exactly 'cases' and 'tolerance' (and an optional "
                           f"'name' and 'calibrate'), got {sorted(d)}")
        calibrate = d.get("calibrate", True)
        if not isinstance(calibrate, bool):
            raise BadInput(f"probe.calibrate must be true or false, got {calibrate!r}")
        name = d.get("name", "policy-probe")
        if not isinstance(name, str) or not 0 < len(name) <= lim["name"]:
            raise BadInput(f"probe.name: a string of 1..{lim['name']} characters")
        tol = d["tolerance"]
        if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) \
                or not 0 < tol <= max_tolerance:
            raise BadInput(f"probe.tolerance must be a number in (0, {max_tolerance:g}] nats, "
                           f"got {tol!r}")
        raw = d["cases"]
        if not isinstance(raw, list) or not 0 < len(raw) <= lim["cases"]:
            raise BadInput(f"probe.cases: a list of 1..{lim['cases']} cases")
        if vocab_size is not None and (isinstance(vocab_size, bool)
                                       or not isinstance(vocab_size, int) or vocab_size < 2):
            raise BadInput("vocab_size must be an int >= 2")
        cases: list[ProbeCase] = []
        positions = 0
        for i, c in enumerate(raw):
            where = f"probe.cases[{i}]"
            if not isinstance(c, dict) or set(c) != {"prompt", "continuation", "logprobs"}:
                raise BadInput(f"{where}: needs exactly 'prompt', 'continuation', 'logprobs'")
            prompt = _token_list(c["prompt"], f"{where}.prompt", lim["prompt"], vocab_size)
            cont = _token_list(c["continuation"], f"{where}.continuation",
                               lim["continuation"], vocab_size)
            lps = c["logprobs"]
            if not isinstance(lps, list) or len(lps) != len(cont):
                raise BadInput(f"{where}.logprobs: one per continuation token "
                               f"({len(cont)})")
            for j, x in enumerate(lps):
                if isinstance(x, bool) or not isinstance(x, (int, float)) \
                        or not math.isfinite(x) or x > _LOGPROB_ROUNDING:
                    raise BadInput(f"{where}.logprobs[{j}]: a finite log-probability <= 0, "
                                   f"got {x!r}")
            if max_model_len is not None and len(prompt) + len(cont) > max_model_len:
                raise BadInput(f"{where}: {len(prompt) + len(cont)} tokens exceed the "
                               f"engine's context of {max_model_len}")
            positions += len(prompt) + len(cont)
            if positions > lim["positions"]:
                raise BadInput(f"probe: more than {lim['positions']} tokens in all")
            cases.append(ProbeCase(tuple(prompt), tuple(cont), tuple(float(x) for x in lps)))
        return cls(cases, tolerance=float(tol), name=name, timeout_s=timeout_s,
                   calibrate=calibrate)

    # ------------------------------------------------------------------ engine side
    def measure(self, engine: Scorer) -> ProbeResult:
        diffs: list[tuple[float, int, int]] = []
        for ci, case in enumerate(self.cases):
            seq = list(case.prompt) + list(case.continuation)
            got = engine.score(seq, timeout_s=self.timeout_s)
            if len(got) != len(seq):
                raise EffectError("validate_live",
                                  f"engine scored {len(got)} positions for {len(seq)} tokens")
            diffs += deviations_at(got[len(case.prompt):], case.logprobs, ci)
        self.last = ProbeResult.of(diffs)
        return self.last

    def run(self, http: Scorer, target: UpdateTarget, *,
            calibrations: Mapping[str, Calibration] | None = None, calibrating: bool = False,
            deviations: dict[str, tuple[float, float]] | None = None) -> Check:
        return self.checked(self.measure(http), "probes", calibrations, calibrating,
                            deviations)


class ModelScorer:
    """A ``Scorer`` that is a trainer-side causal LM: the prompt log-probabilities a
    probe's ``measure`` asks an engine for, computed by the model (in float32 on its
    own device; a non-float32 model is scored through a float32 copy, as
    ``PolicyProbe.from_model`` does). ``probe.measure(ModelScorer(base))`` is how far
    the probe's reference is from ``base``'s: the effect a probe can see."""

    def __init__(self, model: torch.nn.Module) -> None:
        import torch

        self._torch = torch
        self._model = model
        self._ref = model if _dtype_of(model) == torch.float32 else None

    def score(self, token_ids: Sequence[int], *,
              timeout_s: float | None = None) -> list[float | None]:
        torch = self._torch
        was_training = bool(getattr(self._model, "training", False))
        self._model.eval()
        try:
            with torch.no_grad():
                if self._ref is None:
                    self._ref = copy.deepcopy(self._model).float()
                ids = torch.tensor([list(token_ids)], dtype=torch.long,
                                   device=_device_of(self._ref))
                logp = torch.log_softmax(self._ref(input_ids=ids).logits[0].float(), dim=-1)
                got = logp[:-1].gather(-1, ids[0, 1:, None])[:, 0].tolist()
        finally:
            if was_training:
                self._model.train()
        return [None, *(float(x) for x in got)]


#: float32 rounding of a log-softmax can land a hair above 0 for a certain token.
_LOGPROB_ROUNDING = 1e-4


def _token_list(v: object, where: str, limit: int, vocab: int | None) -> list[int]:
    if not isinstance(v, list) or not 0 < len(v) <= limit:
        raise BadInput(f"{where}: a list of 1..{limit} token ids")
    hi = vocab if vocab is not None else 2**31
    for j, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < hi:
            raise BadInput(f"{where}[{j}]: a token id in [0, {hi}), got {t!r}")
    return list(v)


def _greedy(model: torch.nn.Module, prompt: list[int], new_tokens: int,
            dev: torch.device | None) -> tuple[list[int], list[float]]:
    """``new_tokens`` greedy tokens after ``prompt`` and their log-probabilities, decoding
    with the model's KV cache where it keeps one (a HF causal LM: one forward of the prompt,
    then one token per step); a module that returns no cache is run on the whole sequence
    at every step. The two agree to float32 rounding."""
    import torch

    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    out = model(input_ids=ids, use_cache=True) if _takes_cache(model) else model(input_ids=ids)
    cont: list[int] = []
    lps: list[float] = []
    for step in range(new_tokens):
        logp = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
        tok = int(torch.argmax(logp))
        cont.append(tok)
        lps.append(float(logp[tok]))
        if step + 1 == new_tokens:
            break
        nxt = torch.tensor([[tok]], dtype=torch.long, device=dev)
        past = getattr(out, "past_key_values", None)
        if past is not None:
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
        else:
            ids = torch.cat([ids, nxt], dim=1)
            out = model(input_ids=ids)
    return cont, lps


def _takes_cache(model: object) -> bool:
    """Whether the model is a HF ``PreTrainedModel`` (or wraps one: PEFT), whose forward
    takes ``use_cache`` and ``past_key_values``."""
    try:
        from transformers import PreTrainedModel
    except ImportError:   # pragma: no cover - transformers is a dependency of the probe
        return False
    seen: set[int] = set()
    m: Any = model
    while m is not None and id(m) not in seen:
        if isinstance(m, PreTrainedModel):
            return True
        seen.add(id(m))
        m = getattr(m, "base_model", None) if not hasattr(m, "peft") else m.peft
    return False


def _dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    for p in model.parameters():
        return p.dtype
    return None


def _device_of(model: torch.nn.Module) -> torch.device | None:
    """Where the model's inputs go: its first parameter's device (None: the default)."""
    for p in model.parameters():
        return p.device
    return None
