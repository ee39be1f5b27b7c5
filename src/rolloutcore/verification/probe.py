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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rolloutcore.core.evidence import Check, UpdateTarget
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EffectError

__all__ = [
    "DEFAULT_TOLERANCE",
    "MAX_TOLERANCE",
    "WIRE_LIMITS",
    "PolicyProbe",
    "ProbeCase",
    "ProbeResult",
    "Scorer",
    "default_prompts",
]

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

    def to_dict(self) -> dict[str, Any]:
        return {"max_abs_diff": self.max_abs_diff, "mean_abs_diff": self.mean_abs_diff,
                "worst_case": self.worst_case, "worst_position": self.worst_position,
                "positions": self.positions}


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


class PolicyProbe:
    """A set of probe cases with a tolerance; ``run`` is the adapter's ProbeSet hook."""

    def __init__(self, cases: Iterable[ProbeCase], *,
                 tolerance: float = DEFAULT_TOLERANCE, name: str = "policy-probe",
                 timeout_s: float = 60.0) -> None:
        self.cases = tuple(cases)
        if not self.cases:
            raise BadInput("a probe set needs at least one case")
        if not math.isfinite(tolerance) or tolerance <= 0:
            raise BadInput("tolerance must be a positive number")
        self.tolerance = tolerance
        self.name = name
        self.timeout_s = timeout_s
        self.last: ProbeResult | None = None

    # ------------------------------------------------------------------ reference
    @classmethod
    def from_model(cls, model: Any, prompts: Sequence[Sequence[int]], *,
                   new_tokens: int = 16, tolerance: float = DEFAULT_TOLERANCE) -> PolicyProbe:
        """Reference cases from a trainer-side causal LM (a HF ``*ForCausalLM`` module)."""
        import torch

        cases = []
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            with torch.no_grad():
                # A float32 copy: never change the trainer's own module.
                ref = (copy.deepcopy(model).float() if _dtype_of(model) != torch.float32
                       else model)
                for p in prompts:
                    ids = torch.tensor([list(p)], dtype=torch.long)
                    cont: list[int] = []
                    lps: list[float] = []
                    for _ in range(new_tokens):
                        logits = ref(input_ids=ids).logits[0, -1].float()
                        logp = torch.log_softmax(logits, dim=-1)
                        tok = int(torch.argmax(logp))
                        cont.append(tok)
                        lps.append(float(logp[tok]))
                        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
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

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        vocab = int(model.config.vocab_size)
        return cls.from_model(model, prompts or default_prompts(vocab), new_tokens=new_tokens,
                              tolerance=tolerance)

    # ------------------------------------------------------------------ the wire
    def to_wire(self) -> dict[str, Any]:
        """The expectations as JSON: what a trainer sends with a gateway's begin.

        Only what the trainer computed (prompts, its greedy continuations,
        their log-probabilities) and the tolerance travel; the gateway runs
        the comparison itself (``from_wire`` then ``run``).
        """
        return {"name": self.name, "tolerance": self.tolerance,
                "cases": [{"prompt": list(c.prompt), "continuation": list(c.continuation),
                           "logprobs": list(c.logprobs)} for c in self.cases]}

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
        extra = set(d) - {"name", "tolerance", "cases"}
        if extra or "cases" not in d or "tolerance" not in d:
            raise BadInput(f"probe: needs exactly 'cases' and 'tolerance' (and an optional "
                           f"'name'), got {sorted(d)}")
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
        return cls(cases, tolerance=float(tol), name=name, timeout_s=timeout_s)

    # ------------------------------------------------------------------ engine side
    def measure(self, engine: Scorer) -> ProbeResult:
        diffs: list[tuple[float, int, int]] = []
        for ci, case in enumerate(self.cases):
            seq = list(case.prompt) + list(case.continuation)
            got = engine.score(seq, timeout_s=self.timeout_s)
            if len(got) != len(seq):
                raise EffectError("validate_live",
                                  f"engine scored {len(got)} positions for {len(seq)} tokens")
            for j, want in enumerate(case.logprobs):
                have = got[len(case.prompt) + j]
                if have is None or not math.isfinite(have):
                    diffs.append((math.inf, ci, j))
                else:
                    diffs.append((abs(have - want), ci, j))
        worst = max(diffs)
        finite = [d for d, _, _ in diffs]
        res = ProbeResult(worst[0], sum(finite) / len(finite), worst[1], worst[2], len(diffs))
        self.last = res
        return res

    def run(self, http: Scorer, target: UpdateTarget) -> Check:
        res = self.measure(http)
        passed = res.max_abs_diff <= self.tolerance
        return Check(self.name, passed,
                     f"{len(self.cases)} probes, {res.positions} teacher-forced positions; "
                     f"max |dlogp| {res.max_abs_diff:.4g} (case {res.worst_case}, pos "
                     f"{res.worst_position}), mean {res.mean_abs_diff:.3g}, "
                     f"tolerance {self.tolerance:g}",
                     max_abs_diff=res.max_abs_diff, tolerance=self.tolerance,
                     level=VerificationLevel.PROBE)


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


def _dtype_of(model: Any) -> Any:
    for p in model.parameters():
        return p.dtype
    return None
