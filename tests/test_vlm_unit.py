"""The vision-language test kit, without an engine (issue 22).

* ``testing.vlm``: the tiny Idefics3 pair made offline; the next policy
  shares every text weight and differs in every vision/connector weight;
  the processor is the PIL one (no torchvision) and expands one ``<image>``;
* ``verification.image_probe``: reference cases from the HF model; the
  comparison against a scorer that is the same policy passes, against the
  other policy's vision tower fails, a scorer that expands the image
  differently fails; ``vlm_probe`` keeps image placeholders out of the text
  probes; ``ProbeSuite`` passes only when every probe does;
* ``testing.mmcache.EncoderLog``: encoder runs counted from vLLM's log lines;
* ``FaultProxy``'s ``swallow``: an empty 200, the upstream never asked;
* ``VllmHTTP.generate/score(images=...)``: bad images refused before any request.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from rolloutcore.core.evidence import Check
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput
from rolloutcore.testing.faultproxy import Fault, FaultProxy
from rolloutcore.testing.mmcache import EncoderLog, make_image_png, png_data_url
from rolloutcore.testing.vlm import (
    ARCHITECTURE,
    IMAGE_TOKEN,
    IMAGE_TOKENS_PER_IMAGE,
    is_vision_param,
    make_vlm_checkpoint,
    make_vlm_pair,
)
from rolloutcore.verification.image_probe import (
    DEFAULT_IMAGE_PROMPTS,
    ImageProbe,
    ProbeSuite,
    is_vision_language,
    probe_images,
)

torch = pytest.importorskip("torch")
pytest.importorskip("PIL")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_vlm_pair(tmp_path_factory.mktemp("vlm"))


def test_the_next_policy_differs_only_in_the_image_path(pair: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    a, b = pair
    ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ta.keys() == tb.keys()
    vision = {k for k in ta if is_vision_param(k)}
    assert vision and len(vision) < len(ta)
    assert all(not torch.equal(ta[k], tb[k]) for k in vision)
    assert all(torch.equal(ta[k], tb[k]) for k in ta.keys() - vision)
    assert json.loads((a / "config.json").read_text())["architectures"] == [ARCHITECTURE]
    assert is_vision_language(a) and not is_vision_language(a / "nope")
    assert json.loads((b / "rolloutcore.json").read_text())["new_vision_seed"] == 2


def test_the_processor_needs_no_torchvision_and_expands_one_placeholder(
        pair: tuple[Path, Path]) -> None:
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(pair[0]))  # type: ignore[no-untyped-call]
    assert type(proc.image_processor).__name__.endswith("Pil")
    img = Image.open(io.BytesIO(make_image_png(1)))
    enc = proc(text=f"user: {IMAGE_TOKEN}hi", images=[img], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    assert ids.count(proc.image_token_id) == IMAGE_TOKENS_PER_IMAGE
    assert proc.tokenizer(f"x{IMAGE_TOKEN}y", add_special_tokens=False)["input_ids"] == [
        ord("x"), proc.image_token_id, ord("y")]


def test_bad_maker_input_changes_nothing(pair: tuple[Path, Path], tmp_path: Path) -> None:
    a, _ = pair
    out = tmp_path / "C"
    for kw in ({"like": a}, {"new_vision_seed": 3}, {"like": a, "new_vision_seed": -1},
               {"like": tmp_path, "new_vision_seed": 3}):
        with pytest.raises(BadInput):
            make_vlm_checkpoint(out, 1, **kw)
    with pytest.raises(BadInput):
        make_vlm_checkpoint(out, True)  # type: ignore[arg-type]
    with pytest.raises(BadInput, match="not an empty directory"):
        make_vlm_checkpoint(a, 1)
    assert not out.exists()


# --------------------------------------------------------------------------- image probe

class HFScorer:
    """A stand-in engine: one HF policy, expanding the image like the processor does."""

    def __init__(self, model_dir: Path, probe: ImageProbe, *, wrong_expansion: bool = False):
        from transformers import AutoModelForImageTextToText, AutoProcessor

        self.model = AutoModelForImageTextToText.from_pretrained(str(model_dir)).float().eval()
        self.proc = AutoProcessor.from_pretrained(str(model_dir))  # type: ignore[no-untyped-call]
        self.expanded = {c.prompt: c.expanded for c in probe.cases}
        self.wrong = wrong_expansion
        self.calls = 0

    def score(self, token_ids: Sequence[int], *, images: Sequence[str] = (),
              timeout_s: float | None = None, mutation_started: bool = True
              ) -> list[float | None]:
        import base64

        from PIL import Image

        self.calls += 1
        (url,) = images
        png = base64.b64decode(url.split(",", 1)[1])
        n = next(len(p) for p in self.expanded if tuple(token_ids[:len(p)]) == p)
        seq = list(self.expanded[tuple(token_ids[:n])]) + list(token_ids[n:])
        enc = self.proc(text="x" + IMAGE_TOKEN, images=[Image.open(io.BytesIO(png))],
                        return_tensors="pt")
        with torch.no_grad():
            logits = self.model(input_ids=torch.tensor([seq]),
                                pixel_values=enc["pixel_values"].float(),
                                pixel_attention_mask=enc["pixel_attention_mask"]).logits[0]
        logp = torch.log_softmax(logits.float(), dim=-1)
        out: list[float | None] = [None] + [float(logp[i - 1, t]) for i, t in
                                            enumerate(seq) if i > 0]
        return out[:-1] if self.wrong else out


def test_the_image_probe_tells_the_vision_towers_apart(pair: tuple[Path, Path]) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    a, b = pair
    model = AutoModelForImageTextToText.from_pretrained(str(a))
    proc = AutoProcessor.from_pretrained(str(a))  # type: ignore[no-untyped-call]
    probe = ImageProbe.from_model(model, proc, probe_images(1), prompts=DEFAULT_IMAGE_PROMPTS[:1],
                                  new_tokens=3)
    (case,) = probe.cases
    assert case.prompt.count(proc.image_token_id) == 1
    assert len(case.expanded) == len(case.prompt) + IMAGE_TOKENS_PER_IMAGE + 2
    same = probe.run(HFScorer(a, probe), None)  # type: ignore[arg-type]
    assert same.passed and same.max_abs_diff is not None and same.max_abs_diff < 1e-4
    other = probe.run(HFScorer(b, probe), None)  # type: ignore[arg-type]
    assert not other.passed and other.max_abs_diff is not None
    assert other.max_abs_diff > 5 * probe.tolerance
    bad = probe.run(HFScorer(a, probe, wrong_expansion=True), None)  # type: ignore[arg-type]
    assert not bad.passed and "expanded differently" in bad.detail
    suite = ProbeSuite([probe, probe])
    assert suite.run(HFScorer(a, probe), None).passed  # type: ignore[arg-type]

    class Failing:
        def run(self, http: Any, target: Any) -> Check:
            return Check("failing", False, "no", max_abs_diff=1.0, tolerance=0.1)

    merged = ProbeSuite([probe, Failing()]).run(HFScorer(a, probe), None)  # type: ignore[arg-type]
    assert not merged.passed and merged.max_abs_diff == 1.0 and merged.tolerance == 0.1
    assert "failing: no" in merged.detail
    with pytest.raises(BadInput):
        ProbeSuite([])
    with pytest.raises(BadInput):
        ImageProbe.from_model(model, proc, [], new_tokens=1)


# --------------------------------------------------------------------------- tools


def test_encoder_log_counts_encoder_runs(tmp_path: Path) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("startup line\n")
    el = EncoderLog(log)
    m = el.mark()
    with open(log, "a") as f:
        f.write("INFO Engine 000: Iteration(3): 1 context requests, 50 context tokens, ... "
                "CPU KV cache usage: 0.0%, encoder inputs: 1, encoder output embeddings: 16\n"
                "INFO Engine 000: Iteration(4): 0 context requests, ... usage: 0.0%\n"
                "INFO unrelated\n")
    assert el.since(m, 2) == (1, 16, 2)
    m2 = el.mark()
    with open(log, "a") as f:
        f.write("INFO Engine 000: Iteration(5): 1 context requests, ... usage: 0.0%\n")
    assert el.since(m2, 1) == (0, 0, 1)
    with pytest.raises(Exception, match="iteration lines"):
        el.since(el.mark(), 1, timeout_s=0.05)


def test_swallow_answers_an_empty_200_and_never_forwards() -> None:
    seen: list[str] = []

    async def upstream(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover
        seen.append(scope["path"])

    with pytest.raises(BadInput):
        Fault(Fault.swallow().kind, upstream=True)
    with FaultProxy("http://127.0.0.1:9") as proxy:  # nothing listens there
        proxy.inject("/reset_encoder_cache", Fault.swallow(), times=1)
        r = httpx.post(proxy.base_url + "/reset_encoder_cache", timeout=10)
        assert (r.status_code, r.content) == (200, b"")
        assert [h.kind.value for h in proxy.hits] == ["swallow"]
        r2 = httpx.post(proxy.base_url + "/reset_encoder_cache", timeout=10)
        assert r2.status_code >= 500  # forwarded now: the upstream is not there
    assert Fault.swallow().describe() == "empty 200 without forwarding"


def test_bad_images_are_refused_before_any_request() -> None:
    h = VllmHTTP("http://127.0.0.1:9", timeout_s=1)
    try:
        for images in (["https://x/y.png"], ["data:image/png;base64,@@"], "data:x",
                       [png_data_url(b"not a png")]):
            with pytest.raises(BadInput):
                h.score([1, 2], images=images)  # type: ignore[arg-type]
            with pytest.raises(BadInput):
                h.generate([1, 2], max_tokens=1, images=images)  # type: ignore[arg-type]
    finally:
        h.close()
