"""The GPU native-routes harness without CUDA (fast lane): its arguments, plan, result and
checks, its sender's call recorder, and ``benchmarks/native_routes.py``'s shared pieces
(``after_native_round`` against a real gateway over the fake engine, on loopback).

``diagnostics/gpu/h200_native_routes.py`` runs vLLM's own ``ipc`` sender against the
gateway's ``/rc/<token>`` and the engine directly on a GPU; what needs no GPU is run
here before the lead runs it there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from helpers.gateway_rig import FAST, TOKEN, serve_fake, uvicorn_thread
from helpers.scripts import load_script
from rolloutcore.control.controller import LifecycleController
from rolloutcore.control.journal import Journal
from rolloutcore.control.runner import LifecycleRunner
from rolloutcore.service import ServiceConfig
from rolloutcore.service.app import create_app
from rolloutcore.testing.fake import FakeAdapter, FakeEngine, FakeWeights
from rolloutcore.testing.fake_vllm import FakeVllm
from rolloutcore.transports import engine_key

HARNESS = Path(__file__).resolve().parents[1] / "diagnostics" / "gpu" / "h200_native_routes.py"
LEVEL = "native-unreferenced"


H: Any = load_script("rc_h200_native_routes_harness", HARNESS)
NR = H.nr


def test_arguments_and_their_refusals() -> None:
    a = H.parse_args(["--out", "/tmp/x", "--gpu-util", "0.35", "--reps", "5"])
    assert (a.reps, a.warmup, a.gpu_util, a.engine, a.eager, a.plan) == (
        5, 1, 0.35, "guarded", True, False)
    for bad in (["--reps", "0"], ["--warmup", "-1"], ["--gpu-util", "1.5"],
                ["--engine", "half"], ["--gateway-child"]):
        with pytest.raises(SystemExit):
            H.parse_args(bad)


def test_the_plan_names_every_call_and_fits_the_devices_call(
        capsys: pytest.CaptureFixture[str]) -> None:
    p = H.plan(H.parse_args(["--reps", "5"]))
    assert p["fits"] and p["estimate_s"] <= p["budget_s"] == 400.0
    assert set(p["calls"]) == {"direct round (timed)", "native round (timed)",
                               "after a native round (untimed)", "bitexact (untimed)"}
    assert p["rounds"]["order"][:4] == ["0:direct", "0:native", "1:native", "1:direct"]
    assert len(p["rounds"]["order"]) == 12
    assert not H.plan(H.parse_args(["--reps", "400"]))["fits"]
    assert H.main(["--plan"]) == 0
    assert json.loads(capsys.readouterr().out)["rounds"]["measured_pairs"] == 5


def _rows(direct: list[float], native: list[float], warm: int = 1) -> list[dict[str, Any]]:
    rows = []
    for i, (d, n) in enumerate(zip(direct, native, strict=True)):
        for path, s in (("direct", d), ("native", n)):
            rows.append({"path": path, "round": i, "wall_s": s, "warmup": i < warm,
                         "calls": {"update_weights": {"answered_at": s, "seconds": s / 2}},
                         **({"phases": {"open": 0.01}} if path == "native" else {})})
    return rows


def _seen(n: int, warm: int = 1, **over: Any) -> list[dict[str, Any]]:
    return [{"label": f"rc-{i + 1}", "state": "READY", "assigned": True, "levels": [LEVEL],
             "mislabeled": False, "attributed_by": "gateway header", "answer_status": 200,
             "round": i, "warmup": i < warm, **over} for i in range(n)]


def _bitexact(**over: Any) -> dict[str, Any]:
    names = ["a", "b", "c"]
    kw: dict[str, Any] = dict(snapshot={"taken": 3}, compare={"compared": 3, "n_mismatched": 0,
                                                              "mismatched": []},
                              before=[1, 2, 3], other=[4, 5, 6], after=[1, 2, 3], names=names,
                              greedy={"direct_engine": [7, 8], "native_engine": [7, 8],
                                      "native_gateway": [7, 8]})
    kw.update(over)
    return dict(H.bitexact_verdict(**kw))


def test_a_clean_run_has_the_cpu_benchmarks_keys_and_no_problem() -> None:
    res = H.build_result(_rows([9.0, 0.2, 0.3], [9.0, 0.3, 0.45]), _seen(3), _bitexact(),
                         {"machine": "m"})
    for key in ("native_over_direct", "verification", "labels_assigned",
                "mislabeled_answers", "direct_median_s", "native_median_s", "round_ratios",
                "round_ratio_median", "phase_medians", "machine"):
        assert key in res
    assert res["native_over_direct"] == pytest.approx(0.375 / 0.25)    # warm-up left out
    assert res["round_ratios"] == [1.5, 1.5] and res["round_ratio_median"] == 1.5
    assert (res["labels_assigned"], res["native_rounds"], res["mislabeled_answers"]) == (2, 2, 0)
    assert res["verification"] == [LEVEL] and res["greedy_equal"] is True
    assert res["bitexact"]["passed"] and res["problems"] == []
    assert res["phase_medians"]["native"]["phases"] == {"open": 0.01}
    t = H.table(res)
    assert "| native_over_direct | 1.500 |" in t and "| mislabeled_answers | 0 | 0 |" in t


@pytest.mark.parametrize(("seen", "be", "expect"), [
    ({"mislabeled": True}, {}, "mislabeled_answers 2"),
    ({"assigned": False}, {}, "labels_assigned 0 of 2"),
    ({"levels": ["probe"]}, {}, "verification ['probe']"),
    ({}, {"compare": {"compared": 3, "n_mismatched": 1, "mismatched": ["b"]}},
     "1 parameters differ"),
    ({}, {"other": [4, 2, 6]}, "changed 2 of 3"),
    ({}, {"after": [1, 2, 9]}, "checksums differ"),
    ({}, {"snapshot": {"taken": 2}}, "snapshot 2"),
    ({}, {"greedy": {"direct_engine": [7, 8], "native_engine": [7, 8],
                     "native_gateway": [7, 9]}}, "greedy ids equal: False"),
    ({}, {"greedy": {"direct_engine": None, "native_engine": None}},
     "greedy ids equal: False"),
])
def test_each_check_that_does_not_hold_is_named(seen: dict[str, Any], be: dict[str, Any],
                                                expect: str) -> None:
    res = H.build_result(_rows([9.0, 0.2, 0.3], [9.0, 0.3, 0.45]), _seen(3, **seen),
                         _bitexact(**be), {})
    assert any(expect in p for p in res["problems"]), res["problems"]


def test_a_run_cut_short_still_gives_a_result_naming_what_is_missing() -> None:
    rows = _rows([9.0, 0.2], [9.0, 0.3])[:-1]      # the last pair's native round never ran
    res = H.build_result(rows, _seen(1), None, {})
    assert "native_over_direct" not in res
    assert "no measured native round" in res["problems"]
    assert any("bitexact did not pass" in p for p in res["problems"])
    assert H.table(res).count("n/a") >= 3


def test_the_sender_recorder_times_every_post_and_keys_only_the_guarded_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    requests = pytest.importorskip("requests")
    sent: list[tuple[str, dict[str, str]]] = []

    def fake_post(url: str, *a: Any, **kw: Any) -> str:
        sent.append((url, dict(kw.get("headers") or {})))
        return "answer"

    monkeypatch.setattr(requests, "post", fake_post)
    engine, gw = "http://127.0.0.1:18123", "http://127.0.0.1:18124/rc/tok"
    key = engine_key.new_key()
    engine_key.register(engine, key)
    try:
        posts = H.Posts()
        posts.install()
        body = {"update_info": {"names": ["x"], "ipc_handles_pickled": "QUJD"}}
        assert requests.post(f"{engine}/update_weights", json=body, timeout=1) == "answer"
        assert requests.post(f"{gw}/update_weights", json=body, timeout=1) == "answer"
    finally:
        engine_key.forget(engine, key)
    assert sent[0] == (f"{engine}/update_weights", {engine_key.HEADER: key})
    assert sent[1] == (f"{gw}/update_weights", {})
    assert [c["route"] for c in posts.calls] == ["/update_weights", "/update_weights"]
    assert all(c["t1"] >= c["t0"] for c in posts.calls) and posts.handles_chars == 4
    calls = NR.calls_of(posts.calls, posts.calls[0]["t0"])
    assert set(calls) == {"update_weights"}


def test_after_native_round_sees_what_a_client_of_the_gateway_sees(tmp_path: Path) -> None:
    """A round by vLLM's route sequence through a real gateway (uvicorn, loopback) over the
    fake engine: the label is the gateway's, the level native-unreferenced, the answer
    after it attributed to it (by vLLM's spans and by the gateway's header alike)."""
    w0, w1 = FakeWeights.from_seed(0), FakeWeights.from_seed(1, step=1)
    eng = FakeEngine(w0, token_delay_s=0.0005)
    ad = FakeAdapter(eng)
    ad.stage(w0)
    path = tmp_path / "journal.jsonl"
    j = Journal(path)
    c = LifecycleController(listener=j.listener)
    r = LifecycleRunner(c, ad, FAST, record=j.write)
    r.bootstrap(w0.identity())
    up = serve_fake(FakeVllm(eng, model="policy"))
    native = "gpu-harness-native-0123456789"
    app = create_app(r, ServiceConfig(upstream_url=up, control_token=TOKEN,
                                      min_verification="declared"), native_token=native)
    auth = {"authorization": f"Bearer {TOKEN}"}
    ns = sorted(w1.tensors)
    body = {"update_info": {"names": ns, "dtype_names": ["bfloat16"] * len(ns),
                            "shapes": [[len(w1.tensors[n])] for n in ns], "packed": False,
                            "ipc_handles_pickled": "QUJD",
                            "fake_data": [w1.tensors[n].hex() for n in ns]}}
    try:
        with uvicorn_thread(app) as gw:
            prev = httpx.get(f"{gw}/control/status", headers=auth).json()["committed"]["label"]
            base = f"{gw}/rc/{native}"
            for route, b in (("start_weight_update", None), ("update_weights", body),
                             ("finish_weight_update", None)):
                assert httpx.post(f"{base}/{route}", json=b, timeout=30).status_code == 200
            for spans in (True, False):
                seen = NR.after_native_round(gw, auth, path, None, spans=spans, previous=prev)
                assert seen["assigned"] and not seen["mislabeled"], seen
                assert seen["levels"] == [LEVEL] and seen["label"] not in (prev, "default")
                assert seen["answer_status"] == 200 and seen["state"] == "READY"
            # a label the sender chose, or the one before the round, is not assigned
            assert not NR.after_native_round(gw, auth, path, seen["label"])["assigned"]
            assert not NR.after_native_round(gw, auth, path, None,
                                             previous=seen["label"])["assigned"]
            # an answer that did not come is never counted as attributed
            bad = NR.after_native_round(gw, auth, path, None, spans=False,
                                        sampling={"max_tokens": -1})
            assert bad["answer_status"] != 200 and bad["mislabeled"]
    finally:
        j.close()
