"""The adapter probes sent together still check what they check (issue #49).

On an engine that says it is CUDA (``/server_info``), ``AdapterManager``'s default
(``probe_scoring="auto"``) scores by ``prompt_logprobs`` and sends both probes, every
case of each, at once. The engine is ``testing.peft_scorer.peft_vllm`` (the one fake,
``FakeVllm``, saying ``cuda`` in ``/server_info``, its ``prompt_logprobs`` computed by the
tiny model and its adapters through PEFT, float32) with a scorer that counts the prompts
in flight and can misbehave the way the probes exist to catch; the controller is a fake
fleet replica's.
Each negative control must refuse the update, naming the probe that caught it; were the
probes to stop reading each case's every position through their own model, one of
these would publish.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from fleettools import fake_fleet
from helpers.needs import installed
from rolloutcore.control.adapters import AdapterManager
from rolloutcore.core.versions import Provenance
from rolloutcore.engine.http import VllmHTTP
from rolloutcore.errors import BadInput, UpdateFailed
from rolloutcore.testing.fake_vllm import FakeVllm
from rolloutcore.testing.peft_scorer import PeftScorer

installed("peft")

Fault = Callable[[str | None, list[float | None], int], tuple[str | None, list[float | None]]]


class Rig(NamedTuple):
    fake: FakeVllm
    http: VllmHTTP
    scorer: Counting


class Counting(PeftScorer):
    """The PEFT fake's scorer (the tiny model, base or base + an adapter, float32) that
    records the adapter path of every prompt it scores (None: the base), counts those in
    flight at once, and applies ``fault`` (path, answer) to each."""

    def __init__(self, checkpoint: Path) -> None:
        super().__init__(checkpoint)
        self.fault: Fault | None = None
        self.scored: list[str | None] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()

    def prompt_logprobs(self, path: str | None, token_ids: list[int]) -> list[float | None]:
        with self._lock:
            self.scored.append(path)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            n = len(self.scored)
        try:
            time.sleep(0.05)   # long enough for the others to be sent meanwhile
            sent = path
            if self.fault is not None:
                sent, _ = self.fault(path, [], n)
            out = super().prompt_logprobs(sent, token_ids)
            if self.fault is not None:
                _, out = self.fault(path, out, n)
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
    scorer = Counting(base)
    fake, http = peft_vllm(base, scorer=scorer, device="cuda")
    m = AdapterManager(http, f.coord.replicas["r0"].controller, base_model=base,
                       store=tmp_path / "store", max_rank=8)
    try:
        yield m, Rig(fake, http, scorer), tmp_path
    finally:
        m.close()
        f.coord.close()


def test_on_cuda_the_default_scores_by_prompt_logprobs_with_both_probes_at_once(
        rig: Any) -> None:
    m, r, tmp = rig
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
    path = r.fake.loras[res.version.name]
    assert sorted(r.scorer.scored, key=str) == sorted([path] * n + [None] * n, key=str)
    assert r.scorer.most_in_flight == 2 * n
    # token ids only: the engine does not detokenize every prompt position's logprob
    # (most of a probe's cost on a CPU engine: benchmarks/score_cost.py)
    scoring = [b["sampling_params"] for b in r.fake.bodies
               if "prompt_logprobs" in b.get("sampling_params", {})]
    assert len(scoring) == 2 * n and all(sp["detokenize"] is False for sp in scoring)


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
    m, r, tmp = rig
    good = m.update(tmp / "a1", Provenance("a1", "tests", 1)).version
    name = {"v": ""}

    def fault(model: str | None, out: list[float | None], n: int
              ) -> tuple[str | None, list[float | None]]:
        sent, got = control(model, out, n - first)
        return (r.fake.loras[name["v"]] if sent == "ADAPTER" else sent), got

    first = len(r.scorer.scored)
    r.scorer.fault = fault
    prepared = m.prepare(tmp / "a2", Provenance("a2", "tests", 2))
    name["v"] = prepared.version.name
    with pytest.raises(UpdateFailed) as ei:
        m.apply(prepared)
    r.scorer.fault = None
    assert f"{caught_by}: " in str(ei.value) and "(prompt_logprobs)" in str(ei.value)
    assert m.current == good                              # the previous one serves
    assert prepared.version.name not in r.http.models()      # the refused one was unloaded


def test_elsewhere_the_default_is_generation_one_probe_after_the_other(
        rig: Any, tmp_path: Path) -> None:
    m, r, tmp = rig
    for device, scoring in (("cpu", "generation"), ("tpu", "generation")):
        r.fake.device = device
        m2 = AdapterManager(r.http, m.controller, base_model=m.base_model,
                            store=tmp_path / f"s-{device}")
        assert (m2.probe_scoring, m2.probes_together) == (scoring, False)
        m2.close()
    r.fake.device = "cpu"
    m3 = AdapterManager(r.http, m.controller, base_model=m.base_model, store=tmp_path / "s3",
                        probe_scoring="prompt_logprobs")
    assert (m3.probe_scoring, m3.probes_together) == ("prompt_logprobs", False)
    res = m3.update(tmp / "a3", Provenance("a3", "tests", 3))
    assert {"probe_adapter", "probe_base"} <= set(res.phases) and r.scorer.most_in_flight == 1
    m3.close()
    for bad in ("yes", 1):
        with pytest.raises(BadInput, match="probes_together"):
            AdapterManager(r.http, m.controller, base_model=m.base_model,
                           store=tmp_path / "bad", probes_together=bad)  # type: ignore[arg-type]
