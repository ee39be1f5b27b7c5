"""Behavioural validation through the image path of a vision-language policy.

The text-only policy probe (``probe.PolicyProbe``) never runs the vision
tower, so an update that mis-sends or skips a vision parameter, or an engine
that keeps serving image embeddings computed by the previous weights,
passes it. ``ImageProbe`` extends the same method to images: the trainer
computes, from the very checkpoint it sends, what the target policy does on
a few fixed (prompt, image) pairs: a greedy continuation and the
log-probability of each of its tokens, with a plain float32 PyTorch forward
of its model and the checkpoint's own processor. The engine scores prompt +
continuation teacher-forced, with the image, and the check compares the
continuation's log-probabilities position by position under ``tolerance``.

Because the probe images are sent again at every update's live validation,
the previous version's embeddings of them are in the engine's encoder cache
when the next update is validated. vLLM's ``/reset_encoder_cache`` answers
an empty 200 whatever happened; the image probe is the evidence that the
reset took: a stale embedding of a probe image fails it.

The prompt is text with the processor's single image placeholder (e.g.
``<image>``) where the image goes; the engine receives it as token ids with
that one placeholder token and expands it itself (vLLM's multimodal
processor), so the check also compares the engine's expanded prompt with the
processor's, token for token.

``vlm_probe`` builds both halves for a vision-language checkpoint: text
cases (from ids below the tokenizer's added tokens, so no prompt contains
an image placeholder) and image cases, in one ``ProbeSuite``.
"""

from __future__ import annotations

import base64
import copy
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from rolloutcore.core.evidence import Check, UpdateTarget
from rolloutcore.core.versions import VerificationLevel
from rolloutcore.errors import BadInput, EffectError
from rolloutcore.verification.probe import (
    DEFAULT_TOLERANCE,
    Calibrated,
    Calibration,
    PolicyProbe,
    ProbeResult,
    default_prompts,
    deviations_at,
    takes_calibration,
)

__all__ = [
    "DEFAULT_IMAGE_PROMPTS",
    "IMAGE_TOLERANCE",
    "ImageProbe",
    "ImageProbeCase",
    "ImageScorer",
    "ProbeSuite",
    "is_vision_language",
    "probe_images",
    "vlm_probe",
]

#: Nats. Measured on the CPU engine with the tiny Idefics3 policies
#: (results/mm-cache.json, "probe"): correct updates 0.0028-0.0039 (the bf16
#: vision tower adds a little to the text path's noise), a wrong vision tower
#: or a stale encoder-cache embedding 0.15. Twice the worst correct value.
IMAGE_TOLERANCE = 0.008

DEFAULT_IMAGE_PROMPTS = ("user: {image}what is in the picture?\nassistant:",
                         "user: {image}describe it.\nassistant:")


class ImageScorer(Protocol):
    """What the image probe needs from an engine client (``VllmHTTP`` provides it)."""

    def score(self, token_ids: Sequence[int], *, images: Sequence[str] = (),
              timeout_s: float | None = None) -> list[float | None]: ...


@dataclass(frozen=True)
class ImageProbeCase:
    prompt: tuple[int, ...]       # as sent: one placeholder token for the image
    image_url: str                # data: URL
    expanded: tuple[int, ...]     # the prompt as the processor expands it
    continuation: tuple[int, ...]
    logprobs: tuple[float, ...]   # reference log-probability of each continuation token

    def __post_init__(self) -> None:
        if not self.prompt or not self.continuation or not self.expanded:
            raise BadInput("an image probe needs a prompt and a continuation")
        if len(self.logprobs) != len(self.continuation):
            raise BadInput("one reference logprob per continuation token")
        if not all(math.isfinite(x) for x in self.logprobs):
            raise BadInput("reference logprobs must be finite")
        if not self.image_url.startswith("data:image/"):
            raise BadInput("the probe image must be a data:image/ URL")


def probe_images(n: int = 2, size: tuple[int, int] = (64, 48), seed: int = 4321) -> list[bytes]:
    """Fixed PNG probe images of random pixels (a pure function of the arguments)."""
    from PIL import Image

    out = []
    state = seed
    w, h = size
    for _ in range(n):
        px = bytearray()
        for _ in range(w * h * 3):
            state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
            px.append(state >> 56)
        buf = io.BytesIO()
        Image.frombytes("RGB", (w, h), bytes(px)).save(buf, format="PNG")
        out.append(buf.getvalue())
    return out


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


class ImageProbe(Calibrated[ImageProbeCase]):
    """Image probe cases with a tolerance; ``run`` is the adapter's ProbeSet hook."""

    kind: ClassVar[str] = "image"

    def __init__(self, cases: Sequence[ImageProbeCase], *, tolerance: float = IMAGE_TOLERANCE,
                 name: str = "image-probe", timeout_s: float = 60.0,
                 calibrate: bool = True) -> None:
        super().__init__(cases, tolerance=tolerance, name=name, timeout_s=timeout_s,
                         calibrate=calibrate)
        self.mismatched_expansions = 0

    @classmethod
    def from_model(cls, model: Any, processor: Any, images: Sequence[bytes], *,
                   prompts: Sequence[str] = DEFAULT_IMAGE_PROMPTS, new_tokens: int = 8,
                   tolerance: float = IMAGE_TOLERANCE) -> ImageProbe:
        """Reference cases from a HF image-text-to-text model and its processor.

        Prompt ``i`` (with ``{image}`` where the image goes) is paired with
        image ``i`` (PNG bytes), cycling through the shorter list.
        """
        import torch
        from PIL import Image

        placeholder = getattr(processor, "image_token", None)
        if not isinstance(placeholder, str) or not placeholder:
            raise BadInput("the processor names no image placeholder token")
        if not images or not prompts or any("{image}" not in p for p in prompts):
            raise BadInput("image probes need images and prompts with an {image} slot")
        tok = processor.tokenizer
        cases = []
        was_training = bool(getattr(model, "training", False))
        model.eval()
        try:
            with torch.no_grad():
                ref = copy.deepcopy(model).float()
                for i in range(max(len(prompts), len(images))):
                    text = prompts[i % len(prompts)].format(image=placeholder)
                    png = images[i % len(images)]
                    pil = Image.open(io.BytesIO(png)).convert("RGB")
                    enc = processor(text=text, images=[pil], return_tensors="pt")
                    sent = tuple(int(t) for t in tok(text, add_special_tokens=False)["input_ids"])
                    expanded = tuple(int(t) for t in enc["input_ids"][0])
                    extra = {k: v for k, v in enc.items()
                             if k not in ("input_ids", "attention_mask")}
                    for k, v in extra.items():
                        if hasattr(v, "dtype") and v.dtype.is_floating_point:
                            extra[k] = v.float()
                    ids = enc["input_ids"]
                    cont: list[int] = []
                    lps: list[float] = []
                    for _ in range(new_tokens):
                        logits = ref(input_ids=ids, **extra).logits[0, -1].float()
                        logp = torch.log_softmax(logits, dim=-1)
                        t = int(torch.argmax(logp))
                        cont.append(t)
                        lps.append(float(logp[t]))
                        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
                    cases.append(ImageProbeCase(sent, _data_url(png), expanded, tuple(cont),
                                                tuple(lps)))
        finally:
            if was_training:
                model.train()
        return cls(cases, tolerance=tolerance)

    # ------------------------------------------------------------------ engine side
    def measure(self, engine: ImageScorer) -> ProbeResult:
        diffs: list[tuple[float, int, int]] = []
        self.mismatched_expansions = 0
        for ci, case in enumerate(self.cases):
            seq = list(case.prompt) + list(case.continuation)
            got = engine.score(seq, images=[case.image_url], timeout_s=self.timeout_s)
            n_exp = len(case.expanded)
            if len(got) != n_exp + len(case.continuation):
                # The engine expanded the image differently from the processor:
                # its logprobs cannot be aligned, which fails the probe.
                self.mismatched_expansions += 1
                diffs.extend((math.inf, ci, j) for j in range(len(case.continuation)))
                continue
            diffs += deviations_at(got[n_exp:], case.logprobs, ci)
        self.last = ProbeResult.of(diffs)
        return self.last

    def run(self, http: ImageScorer, target: UpdateTarget, *,
            calibrations: Mapping[str, Calibration] | None = None, calibrating: bool = False,
            deviations: dict[str, tuple[float, float]] | None = None) -> Check:
        res = self.measure(http)
        extra = (f"; {self.mismatched_expansions} image prompts expanded differently by the "
                 "engine" if self.mismatched_expansions else "")
        return self.checked(res, "image probes", calibrations, calibrating, deviations, extra)


class ProbeSuite:
    """Several probe sets as one: passes when every one passes."""

    takes_calibration: ClassVar[bool] = True  # passed on to the members that take it

    def __init__(self, probes: Sequence[Any], *, name: str = "policy-probe") -> None:
        if not probes or not all(callable(getattr(p, "run", None)) for p in probes):
            raise BadInput("a probe suite needs probe sets with a run method")
        self.probes = tuple(probes)
        self.name = name
        self.last: list[Check] = []

    def run(self, http: Any, target: UpdateTarget, *,
            calibrations: Mapping[str, Calibration] | None = None, calibrating: bool = False,
            deviations: dict[str, tuple[float, float]] | None = None) -> Check:
        """Every member's check; calibrated members get the calibration arguments."""
        checks = [p.run(http, target, calibrations=calibrations, calibrating=calibrating,
                        deviations=deviations) if takes_calibration(p)
                  else p.run(http, target) for p in self.probes]
        self.last = checks
        worst = max((c.max_abs_diff for c in checks if c.max_abs_diff is not None),
                    default=None)
        failed = [c for c in checks if not c.passed]
        tol = next((c.tolerance for c in failed or checks if c.tolerance is not None), None)
        return Check(self.name, not failed, "; ".join(f"{c.name}: {c.detail}" for c in checks),
                     max_abs_diff=worst, tolerance=tol, level=VerificationLevel.PROBE)


def is_vision_language(model_dir: str | Path) -> bool:
    """True when the checkpoint's config has a vision tower (``vision_config``)."""
    cfg = Path(model_dir) / "config.json"
    try:
        return "vision_config" in json.loads(cfg.read_text())
    except (OSError, ValueError, TypeError):
        return False


def vlm_probe(model_dir: str | Path, *, tolerance: float = DEFAULT_TOLERANCE,
              image_tolerance: float = IMAGE_TOLERANCE, new_tokens: int = 16,
              image_new_tokens: int = 8) -> ProbeSuite:
    """Text and image probes from a vision-language checkpoint directory.

    ``tolerance`` is the text probe's (``probe.DEFAULT_TOLERANCE``),
    ``image_tolerance`` the image probe's (``IMAGE_TOLERANCE``).
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    d = Path(model_dir)
    if not is_vision_language(d):
        raise BadInput(f"{d} is not a vision-language checkpoint (no vision_config)")
    from rolloutcore.verification.hf_load import HF_LOCK

    try:
        with HF_LOCK:
            model = AutoModelForImageTextToText.from_pretrained(str(d))
            processor = AutoProcessor.from_pretrained(str(d))  # type: ignore[no-untyped-call]
    except (OSError, ValueError) as exc:
        raise BadInput(f"cannot load {d} as an image-text-to-text model: {exc}") from exc
    base = int(getattr(processor.tokenizer, "vocab_size", 0) or 0)
    if base < 4:
        raise EffectError("probe", f"tokenizer of {d} reports vocab_size {base}",
                          mutation_started=False)
    # Ids below the added tokens: no prompt can contain an image placeholder.
    text = PolicyProbe.from_model(model, default_prompts(base), new_tokens=new_tokens,
                                  tolerance=tolerance)
    image = ImageProbe.from_model(model, processor, probe_images(),
                                  new_tokens=image_new_tokens, tolerance=image_tolerance)
    return ProbeSuite([text, image])
