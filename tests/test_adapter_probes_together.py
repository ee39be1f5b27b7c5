"""The adapter probes sent together still check what they check (issue #49).

On an engine that says it is CUDA (``/server_info``), ``AdapterManager``'s default
(``probe_scoring="auto"``) scores by ``prompt_logprobs`` and sends both probes, every
case of each, at once. The engine is ``testing.peft_scorer.peft_vllm`` (the tiny model
and its adapters through PEFT, float32) behind a client that reports CUDA and can
misbehave the way the probes exist to catch; the controller is a fake fleet replica's.
Each negative control must refuse the update, naming the probe that caught it; were the
probes to stop reading each case's every position through their own model, one of
these would publish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleettools import fake_fleet
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.versions import Provenance
from rolloutcore.errors import BadInput, UpdateFailed
from rolloutcore.verification.probe import ModelScorer

pytest.importorskip("peft")

Fault = Callable[[str | None, list[float | None], int], tuple[str | None, list[float | None]]]


class Cuda:
    """A ``LoraCapability`` around the PEFT fake that says CUDA and scores prompts
    (``prompt_logprobs``: the model, base or base + the loaded adapter, float32), counts the
    scores in flight at once, and applies ``fault`` (model, answer) to each score."""

    def __init__(self, fake: Any, http: Any, device: str = "cuda") -> None:
        self.fake, self.http, self.device = fake, http, device
        self.base_url = http.base_url
        self.fault: Fault | None = None
        self.scored: list[str | None] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def server_info(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        return {"vllm_config": {"device_config": {"device": self.device}}}

    def models(self, **kw: Any) -> dict[str, str | None]:
        out: dict[str, str | None] = self.http.models(**kw)
        return out

    def load_lora_adapter(self, name: str, path: str, **kw: Any) -> None:
        self.http.load_lora_adapter(name, path, **kw)

    def unload_lora_adapter(self, name: str, **kw: Any) -> None:
        self.http.unload_lora_adapter(name, **kw)

    def top_logprobs(self, *a: Any, **kw: Any) -> Any:
        return self.http.top_logprobs(*a, **kw)

    def score(self, token_ids: Sequence[int], *, timeout_s: float | None = None,
              model: str | None = None, **kw: Any) -> list[float | None]:
        with self._lock:
            self.scored.append(model)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            n = len(self.scored)
        try:
            time.sleep(0.05)   # long enough for the others to be sent meanwhile
            sent = model
            if self.fault is not None:
                sent, _ = self.fault(model, [], n)
            path = None if sent is None else self.fake.loras[sent]
            out = ModelScorer(self.fake.scorer._model(path)[1]).score(list(token_ids))
            if self.fault is not None:
                _, out = self.fault(model, out, n)
            return out
        finally:
            with self._lock:
                self.in_flight -= 1


@pytest.fixture
def rig(tmp_path: Path, one_torch_thread: None) -> Any:
    from rolloutcore.testing.models import make_adapter, make_checkpoint
    from rolloutcore.testing.peft_scorer import peft_vllm

    base = make_checkpoint(tmp_path / "base", 0)
    for seed in range(1, 6):
        make_adapter(base, seed, rank=4).save_pretrained(tmp_path / f"a{seed}")
    f = fake_fleet(1)
    eng = Cuda(*peft_vllm(base))
    m = AdapterManager(eng, f.coord.replicas["r0"].controller, base_model=base,
                       store=tmp_path / "store", max_rank=8)
    try:
        yield m, eng, tmp_path
    finally:
        m.close()
        f.coord.close()


def test_on_cuda_the_default_scores_by_prompt_logprobs_with_both_probes_at_once(
        rig: Any) -> None:
    m, eng, tmp = rig
    assert (m.engine_device, m.probe_scoring, m.probes_together) == \
        ("cuda", "prompt_logprobs", True)
    res = m.update(tmp / "a1", Provenance("a1", "tests", 1))
    checks = {c.name: c for c in res.checks}
    assert checks["adapter-probe"].passed and checks["base-probe"].passed
    assert "(prompt_logprobs)" in checks["adapter-probe"].detail
    assert "sent with the adapter probe" in checks["base-probe"].detail
    assert "probes" in res.phases and "probe_adapter" not in res.phases
    # every case of both probes, through its own model, all in flight at once
    n = len(res.version.name) and 3
    assert sorted(eng.scored, key=str) == sorted([res.version.name] * n + [None] * n, key=str)
    assert eng.most_in_flight == 2 * n


@pytest.mark.parametrize("control,caught_by", [
    # the load did nothing: the adapter's requests are served by the base
    (lambda model, out, n: (None, out), "adapter-probe"),
    # a base request batched with adapter requests gets the adapter (vLLM 0.32 CPU's slot -1)
    (lambda model, out, n: ("ADAPTER" if model is None else model, out), "base-probe"),
    # one position of the adapter probe's last case is off: every position is read
    (lambda model, out, n: (model, [*out[:-1], (out[-1] or 0.0) - 0.5]
                            if model is not None and n >= 3 and out else out),
     "adapter-probe"),
    # the base probe's last position is off
    (lambda model, out, n: (model, [*out[:-1], (out[-1] or 0.0) - 0.5]
                            if model is None and out else out), "base-probe"),
])
def test_the_probes_sent_together_still_catch_what_they_exist_for(
        rig: Any, control: Fault, caught_by: str) -> None:
    m, eng, tmp = rig
    good = m.update(tmp / "a1", Provenance("a1", "tests", 1)).version
    name = {"v": ""}

    def fault(model: str | None, out: list[float | None], n: int
              ) -> tuple[str | None, list[float | None]]:
        sent, got = control(model, out, n - first)
        return (name["v"] if sent == "ADAPTER" else sent), got

    first = len(eng.scored)
    eng.fault = fault
    prepared = m.prepare(tmp / "a2", Provenance("a2", "tests", 2))
    name["v"] = prepared.version.name
    with pytest.raises(UpdateFailed) as ei:
        m.apply(prepared)
    eng.fault = None
    assert f"{caught_by}: " in str(ei.value) and "(prompt_logprobs)" in str(ei.value)
    assert m.current == good                              # the previous one serves
    assert prepared.version.name not in eng.models()      # the refused one was unloaded


def test_elsewhere_the_default_is_generation_one_probe_after_the_other(
        rig: Any, tmp_path: Path) -> None:
    m, eng, tmp = rig
    for device, scoring in (("cpu", "generation"), ("tpu", "generation")):
        eng.device = device
        m2 = AdapterManager(eng, m.controller, base_model=m.base_model,
                            store=tmp_path / f"s-{device}")
        assert (m2.probe_scoring, m2.probes_together) == (scoring, False)
        m2.close()
    eng.device = "cpu"
    m3 = AdapterManager(eng, m.controller, base_model=m.base_model, store=tmp_path / "s3",
                        probe_scoring="prompt_logprobs")
    assert (m3.probe_scoring, m3.probes_together) == ("prompt_logprobs", False)
    res = m3.update(tmp / "a3", Provenance("a3", "tests", 3))
    assert {"probe_adapter", "probe_base"} <= set(res.phases) and eng.most_in_flight == 1
    m3.close()
    for bad in ("yes", 1):
        with pytest.raises(BadInput, match="probes_together"):
            AdapterManager(eng, m.controller, base_model=m.base_model,
                           store=tmp_path / "bad", probes_together=bad)  # type: ignore[arg-type]
