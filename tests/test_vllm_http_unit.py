"""VllmHTTP / VllmAdapter behaviour that a real engine cannot be made to show on demand.

The real vLLM 0.32 server is exercised in ``tests/engine/test_vllm_adapter.py``
(including a real ``{"success": false}`` reset). Here ``httpx.MockTransport``
stands in only for what that server never does: malformed or unexpected
bodies, server errors and timeouts, and the route set of an older vLLM (0.26:
no ``/weight_info``, no ``/weight_checker``, no per-token versions) or of a
tensor-parallel one. Cancellation is tested against a real socket.
"""

from __future__ import annotations

import http.server
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import httpx
import pytest

from helpers.vllm_fake import answer, sent
from rolloutcore.core.evidence import CacheKind, Check, PauseMode, TransferEvidence, UpdateTarget
from rolloutcore.core.lifecycle import Step
from rolloutcore.core.versions import (
    ParameterManifest,
    Provenance,
    VerificationLevel,
    WeightIdentity,
    WeightVersion,
)
from rolloutcore.engine.http import CACHE_ROUTES, KEEPALIVE_S, Routes, VllmHTTP
from rolloutcore.engine.port import VllmAdapter
from rolloutcore.engine.wire import MetricsSnapshot, prefix_cache_delta
from rolloutcore.errors import (
    BadInput,
    EffectError,
    EffectTimeout,
    EngineRefused,
    EngineUnavailable,
    EngineUnreachable,
    RequestRejected,
    TransferError,
)
from rolloutcore.testing import FakeVllm
from rolloutcore.testing.fake_engine import FakeEngine, FakeWeights
from rolloutcore.verification.checksums import EMPTY_SHA256, WeightChecksums, compare_checksums

BASE = "http://engine.test"

Handler = Callable[[httpx.Request], httpx.Response]
# vLLM 0.26: pause/resume, resets, weight transfer; no label, no checker.
V026 = (Routes.WEIGHT_INFO, Routes.WEIGHT_CHECKER)
#: every request each fake was sent, in order (its ``before`` hook records them)
_SEEN: weakref.WeakKeyDictionary[FakeVllm, list[httpx.Request]] = weakref.WeakKeyDictionary()


def vllm(without: Iterable[str] = (), overrides: Mapping[str, Handler] | None = None
           ) -> FakeVllm:
    """The one fake of vLLM (``FakeVllm``: the model ``policy``, label ``rc-1``, a vLLM
    that says it is 0.26), ``without`` the routes an older vLLM lacks, each path of
    ``overrides`` answered by its handler (``FakeVllm.override``); records requests."""
    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0),
                    model="policy", without=without)
    fake.engine.label, fake.version = "rc-1", "0.26.0"
    for path, handler in (overrides or {}).items():
        fake.override(path, handler)
    _SEEN[fake] = []
    fake.before = _SEEN[fake].append
    return fake


def requests(fake: FakeVllm, path: str | None = None) -> list[httpx.Request]:
    """What ``fake`` was sent (to ``path``), in order."""
    return [r for r in _SEEN[fake] if path is None or r.url.path == path]


def client(engine: FakeVllm, **kw: Any) -> VllmHTTP:
    return VllmHTTP(BASE, transport=engine.transport(), **kw)


def raising(exc: Exception) -> Handler:
    def h(_: httpx.Request) -> httpx.Response:
        raise exc
    return h


def target(label: str = "rc-1", identity: WeightIdentity | None = None) -> UpdateTarget:
    m = ParameterManifest.from_items([("w", (2,), "float32")])
    return UpdateTarget(WeightVersion(1, label, "e0"),
                        identity or WeightIdentity.declare(m, Provenance("ckpt")), "test")


# --------------------------------------------------------------------------- construction


@pytest.mark.parametrize("url", ["", "engine:8000", "ftp://x", None])
def test_bad_base_url(url: Any) -> None:
    with pytest.raises(BadInput):
        VllmHTTP(url)


@pytest.mark.parametrize("t", [0, -1, float("nan"), float("inf"), True, "5"])
def test_bad_timeout(t: Any) -> None:
    with pytest.raises(BadInput):
        VllmHTTP(BASE, timeout_s=t)


@pytest.mark.parametrize("k", [-1, float("nan"), float("inf"), True, "2"])
def test_bad_keepalive(k: Any) -> None:
    with pytest.raises(BadInput, match="keepalive_s"):
        VllmHTTP(BASE, keepalive_s=k)


def test_idle_connections_are_dropped_before_the_server_would_drop_them() -> None:
    """A pooled connection idle past ``keepalive_s`` is not sent on again.

    The server (uvicorn, as vLLM's) keeps idle connections for 5 s; the
    client reuses one for ``keepalive_s``. Inside that, calls share a
    connection (the same client port); past it, a new one is opened.
    """
    from helpers.gateway_rig import uvicorn_thread

    fake = FakeVllm(FakeEngine(FakeWeights.from_seed(0), token_delay_s=0.0))
    assert KEEPALIVE_S < 5.0  # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE default
    with uvicorn_thread(fake, lifespan="off") as url, VllmHTTP(url, keepalive_s=0.2) as h:
        h.version()
        h.version()
        time.sleep(0.5)
        h.version()
    assert fake.received == [("GET", Routes.VERSION)] * 3
    first, again, later = fake.peers
    assert first == again != later


def test_capabilities_are_read_once_from_openapi() -> None:
    e = vllm()
    h = client(e)
    assert h.capabilities() == e.paths and Routes.PAUSE in e.paths
    assert h.has(Routes.GENERATE) and not h.has("/nope")
    assert sent(e, "/openapi.json") == 1
    h.capabilities(refresh=True)
    assert sent(e, "/openapi.json") == 2


def test_openapi_without_paths_is_an_effect_error() -> None:
    h = client(vllm(overrides={"/openapi.json": answer(200, {"info": {}})}))
    with pytest.raises(EffectError, match="paths"):
        h.capabilities()


# --------------------------------------------------------------------------- errors


def test_server_error_is_engine_unavailable_and_the_step_says_whether_weights_moved() -> None:
    # The HTTP client cannot know whether weights moved: it says "maybe" ...
    h = client(vllm(overrides={Routes.PAUSE: answer(500, {"error": "boom"})}))
    with pytest.raises(EngineUnavailable, match=r"HTTP 500.*boom") as ei:
        h.pause(PauseMode.WAIT)
    assert ei.value.mutation_started is True and ei.value.step == "pause"
    assert ei.value.status == 500
    # ... the adapter's step knows: a drain moves no weights, a resume may follow a transfer.
    with pytest.raises(EngineUnavailable, match=r"HTTP 500.*boom") as ei:
        VllmAdapter(h).drain(PauseMode.WAIT)
    assert ei.value.mutation_started is False and ei.value.step == "pause"
    h2 = client(vllm(overrides={Routes.RESUME: answer(500, {"error": "boom"})}))
    with pytest.raises(EngineUnavailable) as ei:
        VllmAdapter(h2).resume()
    assert ei.value.mutation_started is True


def test_connect_error_is_engine_unreachable_from_the_httpx_error() -> None:
    h = client(vllm(overrides={Routes.RESUME: raising(httpx.ConnectError("refused"))}))
    with pytest.raises(EngineUnreachable) as ei:
        h.resume()
    assert isinstance(ei.value, EngineUnavailable)
    assert isinstance(ei.value.__cause__, httpx.ConnectError)
    assert "POST /resume" in str(ei.value) and ei.value.mutation_started is True


def test_a_reset_connection_is_engine_unavailable_not_unreachable() -> None:
    h = client(vllm(overrides={Routes.PAUSE: raising(
        httpx.RemoteProtocolError("Server disconnected without sending a response."))}))
    with pytest.raises(EngineUnavailable, match="RemoteProtocolError") as ei:
        h.pause(PauseMode.WAIT)
    assert not isinstance(ei.value, EngineUnreachable)  # the request may have arrived


def test_timeout_is_effect_timeout_with_the_deadline_used() -> None:
    h = client(vllm(overrides={Routes.IS_PAUSED: raising(httpx.ReadTimeout("slow"))}),
               timeout_s=7)
    with pytest.raises(EffectTimeout) as ei:
        h.is_paused()
    assert ei.value.deadline_s == 7 and ei.value.mutation_started is True
    assert isinstance(ei.value.__cause__, httpx.ReadTimeout)
    with pytest.raises(EffectTimeout) as ei:
        h.is_paused(timeout_s=0.25)
    assert ei.value.deadline_s == 0.25 and "GET /is_paused" in str(ei.value)


def test_client_error_on_our_request_is_bad_input() -> None:
    h = client(vllm(overrides={Routes.GENERATE: answer(
        400, {"error": {"message": "Token id 999 is out of vocabulary"}})}))
    with pytest.raises(BadInput, match="out of vocabulary") as ei:
        h.generate([1, 999], max_tokens=2)
    assert isinstance(ei.value, RequestRejected) and ei.value.status == 400


def test_a_route_the_engine_does_not_offer_is_not_bad_input() -> None:
    e = vllm(without=(Routes.PAUSE,))
    h = client(e)
    h.capabilities()
    with pytest.raises(EngineRefused, match="not offered") as ei:
        h.pause(PauseMode.WAIT)
    assert not isinstance(ei.value, BadInput) and ei.value.status == 404
    with pytest.raises(EngineRefused, match="not offered") as ei:
        VllmAdapter(h).drain(PauseMode.WAIT)
    assert ei.value.mutation_started is False
    # vLLM answers 403 on /inference/v1/generate without --enable-scale-out.
    h2 = client(vllm(overrides={Routes.GENERATE: answer(403, {"detail": "Forbidden"})}))
    with pytest.raises(EngineRefused, match="not offered") as ei:
        h2.generate([1], max_tokens=1)
    assert not isinstance(ei.value, BadInput)


@pytest.mark.parametrize("body", [{"is_paused": "yes"}, {"paused": True}, [], None])
def test_unexpected_is_paused_answers_are_effect_errors(body: Any) -> None:
    ans = answer(200, text="not json") if body is None else answer(200, body)
    h = client(vllm(overrides={Routes.IS_PAUSED: ans}))
    with pytest.raises(EffectError):
        h.is_paused()


def test_health_false_on_503_raises_when_unreachable() -> None:
    assert client(vllm(overrides={Routes.HEALTH: answer(503)})).health() is False
    h = client(vllm(overrides={Routes.HEALTH: raising(httpx.ConnectError("x"))}))
    with pytest.raises(EngineUnavailable):
        h.health()


def test_bad_arguments_send_nothing() -> None:
    e = vllm()
    h = client(e)
    h.capabilities()
    before = len(requests(e))
    for call in (
        lambda: h.pause("wait"),  # type: ignore[arg-type]
        lambda: h.pause(PauseMode.WAIT, clear_cache="no"),  # type: ignore[arg-type]
        lambda: h.generate([], max_tokens=1),
        lambda: h.generate([1, -2], max_tokens=1),
        lambda: h.generate([1, True], max_tokens=1),
        lambda: h.generate("abc", max_tokens=1),  # type: ignore[arg-type]
        lambda: h.generate([1], max_tokens=0),
        lambda: h.generate([1], max_tokens=1, temperature=-1),
        lambda: h.generate([1], max_tokens=1, seed=1.5),  # type: ignore[arg-type]
        lambda: h.complete("", max_tokens=1),
        lambda: h.reset_prefix_cache(reset_running_requests=1),  # type: ignore[arg-type]
        lambda: h.reset_cache("prefix"),  # type: ignore[arg-type]
        lambda: h.is_paused(timeout_s=0),
    ):
        with pytest.raises(BadInput):
            call()
    # generate() asks for the model name first, nothing else reached the engine
    assert {r.url.path for r in requests(e)[before:]} <= {Routes.MODELS}


def test_closed_client_refuses() -> None:
    h = client(vllm())
    h.close()
    with pytest.raises(EngineUnavailable, match="closed"):
        h.resume()


# --------------------------------------------------------------------------- cache resets


@pytest.mark.parametrize(("ans", "success", "detail"), [
    (answer(200, text="<html>ok</html>"), False, "unrecognised"),
    (answer(200, {"status": "ok"}), False, "unrecognised"),
    (answer(200, {"success": "true"}), False, "unrecognised"),
    (answer(200, {"success": 1}), False, "unrecognised"),
])
def test_prefix_reset_bodies_that_are_not_a_flag_fail_closed(
        ans: Handler, success: bool, detail: str) -> None:
    ev = client(vllm(overrides={Routes.RESET_PREFIX: ans})).reset_prefix_cache()
    assert ev.http_status == 200 and ev.engine_success is success
    assert detail in ev.detail and ev.problems(None)


def test_reset_with_empty_body_is_unflagged_and_says_so() -> None:
    ev = client(vllm(overrides={Routes.RESET_PREFIX: answer(200)})).reset_prefix_cache()
    assert ev.http_status == 200 and ev.engine_success is None
    assert ev.unverified == ("prefix cache reset: the engine reports no success flag",)
    assert not ev.problems(None)


def test_encoder_reset_that_starts_reporting_a_flag_is_read() -> None:
    ev = client(vllm(overrides={Routes.RESET_ENCODER: answer(200, {"success": False})})
                ).reset_encoder_cache()
    assert ev.engine_success is False and ev.problems(None)


def test_reset_server_error_raises() -> None:
    h = client(vllm(overrides={Routes.RESET_MM: answer(503, text="overloaded")}))
    with pytest.raises(EngineUnavailable, match="503"):
        h.reset_mm_cache()


def test_reset_running_requests_is_passed_as_a_query() -> None:
    e = vllm()
    client(e).reset_prefix_cache(reset_running_requests=True)
    req = requests(e, Routes.RESET_PREFIX)[-1]
    assert req.url.params["reset_running_requests"] == "true"


@pytest.mark.parametrize("kind", list(CacheKind))
def test_absent_reset_route_is_unverified_not_pretended(kind: CacheKind) -> None:
    e = vllm(without=(CACHE_ROUTES[kind],))
    ev = client(e).reset_cache(kind)
    assert ev.http_status is None and ev.engine_success is None
    assert ev.unverified == (f"{kind.value} cache reset route absent: cache not reset",)
    assert ev.problems(None)  # a reset that did not happen is never a success
    assert sent(e, CACHE_ROUTES[kind]) == 0


def test_pause_sends_mode_and_never_clears_by_default() -> None:
    e = vllm()
    client(e).pause(PauseMode.KEEP)
    req = requests(e, Routes.PAUSE)[-1]
    assert req.method == "POST"
    assert dict(req.url.params) == {"mode": "keep", "clear_cache": "false"}


# --------------------------------------------------------------------------- weights


def test_weight_info_on_an_engine_without_labels() -> None:
    e = vllm(without=V026)
    wi = client(e).weight_info()
    assert wi.label is None and wi.label_supported is False
    assert sent(e, Routes.WEIGHT_INFO) == 0


def test_weight_info_answers() -> None:
    assert client(vllm()).label() == "rc-1"
    h = client(vllm(overrides={Routes.WEIGHT_INFO: answer(200, {"weight_version": None})}))
    assert h.weight_info().label is None and h.weight_info().label_supported
    h = client(vllm(overrides={Routes.WEIGHT_INFO: answer(200, {"weight_version": 3})}))
    with pytest.raises(EffectError):
        h.weight_info()


def test_checksums_of_a_tensor_parallel_engine_keep_rank_keys_for_repeated_names() -> None:
    sums = {"dp0:pp0:pcp0:tp0:model.norm.weight": "a" * 64,
            "dp0:pp0:pcp0:tp1:model.norm.weight": "b" * 64,
            "dp0:pp0:pcp0:tp0:lm_head.weight": "C" * 64,
            "dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight": EMPTY_SHA256}
    h = client(vllm(overrides={Routes.WEIGHT_CHECKER: answer(200, {"checksums": sums})}))
    cs = h.weight_checksums()
    assert set(cs.digests) == {"dp0:pp0:pcp0:tp0:model.norm.weight",
                               "dp0:pp0:pcp0:tp1:model.norm.weight",
                               "lm_head.weight", "model.layers.0.mlp.down_proj.weight"}
    assert cs.digests["lm_head.weight"] == "c" * 64  # normalised to lower case
    assert cs.raw_keys["lm_head.weight"] == "dp0:pp0:pcp0:tp0:lm_head.weight"
    assert cs.unverifiable == {"model.layers.0.mlp.down_proj.weight"}
    assert cs.coverage == 0.75


def test_checksums_without_the_checker_route() -> None:
    h = client(vllm(without=V026))
    with pytest.raises(EffectError, match="no /weight_checker") as ei:
        h.weight_checksums()
    assert ei.value.mutation_started is True  # the HTTP client cannot tell


def _sums(**d: str) -> WeightChecksums:
    return WeightChecksums(d, {k: f"dp0:pp0:pcp0:tp0:{k}" for k in d})


def test_compare_checksums_never_counts_zero_bytes_as_a_match() -> None:
    eng = _sums(a="1" * 64, b="2" * 64, fused=EMPTY_SHA256, c="3" * 64)
    cmp = compare_checksums(eng, {"a": "1" * 64, "b": "2" * 64, "fused": EMPTY_SHA256})
    assert cmp.matched == ("a", "b") and cmp.unverifiable == ("fused",)
    assert cmp.no_reference == ("c",) and cmp.passed
    assert cmp.coverage == 0.5
    chk = cmp.to_check()
    assert chk.passed and chk.coverage == 0.5 and chk.level is VerificationLevel.ENGINE_CHECKSUM
    assert "1 unverifiable" in chk.detail and "1 without reference" in chk.detail


def test_compare_checksums_failures() -> None:
    eng = _sums(a="1" * 64, fused=EMPTY_SHA256)
    assert compare_checksums(eng, {"a": "9" * 64}).mismatched == ("a",)
    missing = compare_checksums(eng, {"a": "1" * 64, "gone": "1" * 64})
    assert not missing.passed and missing.missing_in_engine == ("gone",)
    nothing = compare_checksums(eng, {"fused": EMPTY_SHA256})
    assert nothing.compared == 0 and not nothing.passed
    assert "nothing compared" in nothing.detail()
    # Full engine keys are accepted as reference keys too.
    assert compare_checksums(eng, {"dp0:pp0:pcp0:tp0:a": "1" * 64}).matched == ("a",)
    with pytest.raises(BadInput):
        compare_checksums(eng, {"a": 1})  # type: ignore[dict-item]


# --------------------------------------------------------------------------- metrics

METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="policy"} 600.0
vllm:prefix_cache_queries_total{engine="1",model_name="policy"} 300.0
vllm:prefix_cache_queries_created{engine="0",model_name="policy"} 1.7e+09
# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="policy"} 256.0
vllm:prefix_cache_hits_total{engine="1",model_name="policy"} 0.0
# HELP vllm:e2e_request_latency_seconds Latency.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{le="0.5",model_name="policy"} 3.0
vllm:e2e_request_latency_seconds_bucket{le="+Inf",model_name="policy"} 4.0
vllm:e2e_request_latency_seconds_count{model_name="policy"} 4.0
vllm:e2e_request_latency_seconds_sum{model_name="policy"} 1.5
"""


def test_metrics_are_parsed_and_summed_over_engines() -> None:
    m = client(vllm(overrides={Routes.METRICS: answer(200, text=METRICS)})).metrics()
    assert m.get("vllm:prefix_cache_queries_total") == 900.0
    assert m.get("vllm:prefix_cache_hits_total") == 256.0
    assert m.get("vllm:e2e_request_latency_seconds_count") == 4.0
    assert m.get("vllm:e2e_request_latency_seconds_bucket") is None


def test_unparseable_metrics() -> None:
    h = client(vllm(overrides={Routes.METRICS: answer(200, text="vllm:x{ 1 2 3\n")}))
    with pytest.raises(EffectError, match="unparseable"):
        h.metrics()


def _snap(q: float | None, h: float | None) -> MetricsSnapshot:
    v = {}
    if q is not None:
        v["vllm:prefix_cache_queries_total"] = q
    if h is not None:
        v["vllm:prefix_cache_hits_total"] = h
    return MetricsSnapshot(v, 0.0)


def test_prefix_cache_delta_is_after_minus_before() -> None:
    d = prefix_cache_delta(_snap(300, 0), _snap(600, 256))
    assert (d.queries, d.hits) == (300, 256)
    assert prefix_cache_delta(_snap(5, 1), _snap(5, 1)).queries == 0
    with pytest.raises(BadInput, match="different engine incarnations"):
        prefix_cache_delta(_snap(600, 256), _snap(300, 0))
    with pytest.raises(BadInput, match="missing"):
        prefix_cache_delta(_snap(1, None), _snap(2, 1))


# --------------------------------------------------------------------------- generation


def _gen_answer(**choice: Any) -> Handler:
    base = {"index": 0, "finish_reason": "length", "token_ids": [5, 6],
            "logprobs": {"content": [{"token_id": 5, "logprob": -0.5},
                                     {"token_id": 6, "logprob": -1.5}]}}
    base.update(choice)
    return answer(200, {"request_id": "r1", "choices": [base]})


def test_generate_request_and_parse() -> None:
    e = vllm(overrides={Routes.GENERATE: _gen_answer(
        weight_versions=[{"version": "rc-1", "start": 0, "end": 1},
                         {"version": "rc-2", "start": 1, "end": 2}])})
    g = client(e).generate([1, 2, 3], max_tokens=2, seed=7, request_id="mine")
    body = json.loads(requests(e, Routes.GENERATE)[0].content)
    assert body == {"model": "policy", "token_ids": [1, 2, 3], "request_id": "mine",
                    "sampling_params": {"max_tokens": 2, "temperature": 0.0,
                                        "ignore_eos": False, "logprobs": 0, "seed": 7}}
    assert g.token_ids == (5, 6) and g.logprobs == (-0.5, -1.5)
    assert g.versions() == {"rc-1", "rc-2"} and g.finish_reason == "length"


def test_generate_on_an_engine_without_version_spans() -> None:
    g = client(vllm(overrides={Routes.GENERATE: _gen_answer()})).generate(
        [1], max_tokens=2)
    assert g.weight_versions is None and g.versions() == frozenset()


@pytest.mark.parametrize("choice", [
    {"logprobs": {"content": [{"token_id": 5, "logprob": -0.5}]}},   # one missing
    {"weight_versions": [{"version": "x", "start": 2, "end": 1}]},     # reversed span
    {"token_ids": ["a"]},
])
def test_generate_malformed_answers(choice: dict[str, Any]) -> None:
    h = client(vllm(overrides={Routes.GENERATE: _gen_answer(**choice)}))
    with pytest.raises(EffectError, match="unexpected generate answer"):
        h.generate([1], max_tokens=2)


def test_completions_request_and_parse() -> None:
    e = vllm(overrides={Routes.COMPLETIONS: answer(200, {"choices": [{
        "text": "hi", "token_ids": [104, 105], "finish_reason": "length",
        "logprobs": {"token_logprobs": [-1.0, None]}}]})})
    c = client(e).complete("he", max_tokens=2)
    body = json.loads(requests(e, Routes.COMPLETIONS)[0].content)
    assert body["prompt"] == "he" and body["return_token_ids"] is True and body["logprobs"] == 0
    assert c.text == "hi" and c.token_ids == (104, 105) and c.logprobs == (-1.0, None)


# --------------------------------------------------------------------------- cancel (real socket)


@pytest.fixture()
def stuck_server() -> Iterator[str]:
    """A real HTTP server whose /is_paused never answers (until shutdown)."""
    release = threading.Event()

    class H(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path.startswith("/is_paused"):
                release.wait(30)
            body = b'{"is_paused": false}'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: Any) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    # polled every 10 ms, not 0.5 s: ``shutdown`` waits for the loop to see it
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.01},
                     daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        release.set()
        srv.shutdown()
        srv.server_close()


def test_cancel_inflight_unblocks_a_stuck_call_from_another_thread(stuck_server: str) -> None:
    h = VllmHTTP(stuck_server, timeout_s=30)
    errs: list[BaseException] = []

    def call() -> None:
        try:
            h.is_paused()
        except BaseException as exc:
            errs.append(exc)

    th = threading.Thread(target=call)
    th.start()
    th.join(0.3)
    assert th.is_alive()
    t0 = time.monotonic()
    assert h.cancel_inflight() == 1
    th.join(5)
    assert not th.is_alive() and time.monotonic() - t0 < 2
    assert isinstance(errs[0], EffectTimeout) and "cancelled" in str(errs[0])
    h.close()


def test_adapter_cancel_shuts_http_for_non_transfer_steps(stuck_server: str) -> None:
    a = VllmAdapter(VllmHTTP(stuck_server, timeout_s=30))
    errs: list[BaseException] = []

    def call() -> None:
        try:
            a.http.is_paused()
        except BaseException as exc:
            errs.append(exc)

    th = threading.Thread(target=call)
    th.start()
    th.join(0.3)
    a.cancel(Step.VALIDATE)
    th.join(5)
    assert not th.is_alive() and isinstance(errs[0], EffectTimeout)
    a.close()


# --------------------------------------------------------------------------- adapter


def _source() -> Any:
    import torch

    from rolloutcore.transports.source import WeightSource

    return WeightSource.from_state_dict({"w": torch.ones(2)})


def test_adapter_on_an_old_engine_states_what_it_cannot_verify() -> None:
    e = vllm(without=(*V026, Routes.RESET_ENCODER))
    a = VllmAdapter(client(e), engine_epoch="ep-1")
    boot = a.bootstrap()
    assert boot.healthy and boot.engine_epoch == "ep-1"
    assert boot.observed_label is None and boot.label_supported is False
    assert "no weight_version endpoint: label not verified" in boot.unverified
    assert any("/weight_checker" in u for u in boot.unverified)
    assert any("encoder" in u for u in boot.unverified)
    assert a.caches == (CacheKind.PREFIX, CacheKind.MULTIMODAL)
    a.drain(PauseMode.WAIT)
    v = a.validate(target(), live=False)
    assert v is not None and v.observed_label is None and not v.label_supported
    assert v.checks == ()
    assert "no weight_version endpoint: label not verified" in v.unverified
    assert "no /weight_checker: engine checksums not verified" in v.unverified
    assert v.problems(target()) == [
        "no evidence at all: the engine has no version label and no check ran"]


def test_bootstrap_epoch_without_launcher_or_instance_id_is_local_and_stated() -> None:
    bare = vllm(overrides={Routes.SERVER_INFO: answer(200, {"vllm_config": {}})})
    boot = VllmAdapter(client(bare)).bootstrap()
    assert boot.engine_epoch.startswith("vllm-unidentified-")
    assert any("not identifiable" in u for u in boot.unverified)
    e = vllm(overrides={Routes.SERVER_INFO: answer(200, {"vllm_config": {
        "instance_id": "abc123"}})})
    assert VllmAdapter(client(e)).bootstrap().engine_epoch == "vllm-abc123"


def test_bootstrap_refuses_a_transport_the_engine_was_not_started_with() -> None:
    from rolloutcore.transports.gloo import GlooTransport

    for wt in (None, {"backend": "nccl"}):
        e = vllm(overrides={Routes.SERVER_INFO: answer(200, {"vllm_config": {
            "instance_id": "i", "weight_transfer_config": wt}})})
        a = VllmAdapter(client(e), GlooTransport())
        with pytest.raises(EngineUnavailable, match="rolloutcore_gloo") as ei:
            a.bootstrap()
        assert ei.value.mutation_started is False


def test_bootstrap_of_a_dead_engine_is_unhealthy_evidence() -> None:
    e = vllm(overrides={Routes.HEALTH: answer(503)})
    boot = VllmAdapter(client(e), engine_epoch="x").bootstrap()
    assert not boot.healthy and boot.problems(None) == ["engine is not healthy"]


def test_stage_rejects_bad_input_and_keeps_the_previous_stage() -> None:
    a = VllmAdapter(client(vllm()))
    src = _source()
    a.stage(src)
    bads: list[Callable[[], None]] = [
        lambda: a.stage(object()),
        lambda: a.stage(src, provenance="ckpt"),  # type: ignore[arg-type]
        lambda: a.stage(src, reference_checksums={}),
        lambda: a.stage(src, reference_checksums={"a": 1}),  # type: ignore[dict-item]
        lambda: a.stage(src, probes=object()),  # type: ignore[arg-type]
    ]
    for bad in bads:
        with pytest.raises(BadInput):
            bad()
    assert a.staged is src


def test_preflight_compares_manifest_provenance_and_content() -> None:
    e = vllm()
    a = VllmAdapter(client(e))
    src = _source()
    ident = WeightIdentity.declare(src.manifest(), Provenance("A"), src.content_digest())
    t = target(identity=ident)
    assert "no weight source staged" in " ".join(a.preflight(t).problems(t))
    a.stage(src, provenance=Provenance("A"))
    a.drain(PauseMode.WAIT)
    assert a.preflight(t).problems(t) == []
    a.stage(src, provenance=Provenance("B"))
    assert any("provenance" in p for p in a.preflight(t).problems(t))
    other = WeightIdentity.declare(src.manifest(), Provenance("A"), "0" * 64)
    t2 = target(identity=other)
    a.stage(src, provenance=Provenance("A"))
    assert any("content digest" in p for p in a.preflight(t2).problems(t2))
    m3 = ParameterManifest.from_items([("w", (3,), "float32")])
    wrong_manifest = target(identity=WeightIdentity.declare(m3, Provenance("A")))
    assert any("manifest" in p for p in a.preflight(wrong_manifest).problems(wrong_manifest))
    # preflight mutated nothing: no pause/resume/reset/transfer calls beyond the drain
    assert sent(e, Routes.PAUSE) == 1 and sent(e, Routes.RESET_PREFIX) == 0


def test_preflight_refuses_an_engine_asleep_before_the_drain() -> None:
    e = vllm(overrides={Routes.IS_SLEEPING: answer(200, {"is_sleeping": True})})
    a = VllmAdapter(client(e))
    a.stage(_source())
    a.drain(PauseMode.WAIT)
    pf = a.preflight(target())
    assert "asleep" in pf.detail


def test_sleep_state_is_not_asked_of_an_engine_without_sleep_mode() -> None:
    def info(sleep: object) -> Handler:
        return answer(200, {"vllm_config": {"model_config": {"enable_sleep_mode": sleep}}})

    for sleep, asked in ((False, 0), (True, 1), ("?", 1)):
        e = vllm(overrides={Routes.SERVER_INFO: info(sleep)})
        a = VllmAdapter(client(e))
        boot = a.bootstrap()
        assert boot.engine_info["enable_sleep_mode"] == (sleep if isinstance(sleep, bool) else None)
        a.stage(_source())
        a.drain(PauseMode.WAIT)
        assert sent(e, Routes.IS_SLEEPING) == asked, sleep
        assert a.preflight(target()).problems(target()) == []


def test_validate_reads_paused_state_alongside_the_transport_check() -> None:
    e = vllm()
    tr = _CheckingTransport(True)
    a = VllmAdapter(client(e), tr)  # type: ignore[arg-type]
    a.drain(PauseMode.WAIT)
    v = a.validate(target(), live=False)
    assert v is not None and v.paused is True and len(tr.urls) == 1
    assert [c.name for c in v.checks] == ["transport-checksum"]
    assert sent(e, Routes.IS_PAUSED) == 1
    a.resume()
    v2 = a.validate(target(), live=False)
    assert v2 is not None and v2.paused is False
    failing = VllmAdapter(client(vllm(overrides={Routes.IS_PAUSED: answer(500, {})})),
                          _CheckingTransport(True))  # type: ignore[arg-type]
    with pytest.raises(EngineUnavailable):
        failing.validate(target(), live=False)
    a.close()
    failing.close()


def test_transfer_without_a_stage_or_transport_mutates_nothing() -> None:
    a = VllmAdapter(client(vllm()))
    with pytest.raises(TransferError) as ei:
        a.transfer(target())
    assert ei.value.mutation_started is False


def test_validate_with_reference_checksums() -> None:
    sums = {"dp0:pp0:pcp0:tp0:a": "1" * 64, "dp0:pp0:pcp0:tp0:qkv": EMPTY_SHA256}
    a = VllmAdapter(client(vllm(overrides={
        Routes.WEIGHT_CHECKER: answer(200, {"checksums": sums})})))
    a.stage(_source(), reference_checksums={"a": "1" * 64, "qkv": EMPTY_SHA256})
    v = a.validate(target(), live=False)
    assert v is not None and v.observed_label == "rc-1"
    (chk,) = v.checks
    assert chk.passed and chk.coverage == 0.5
    assert any("1 of 2 engine parameters hash as zero bytes" in u for u in v.unverified)
    a.stage(_source())  # no reference: said, not pretended
    v2 = a.validate(target(), live=False)
    assert v2 is not None and v2.checks == ()
    assert any("no reference checksums" in u for u in v2.unverified)


class _CheckingTransport:
    """A transport that can check what it installed (like rc_cuda_ipc)."""

    backend = "checking"

    def __init__(self, passed: bool) -> None:
        self.passed = passed
        self.urls: list[str] = []

    def connect(self, base_url: str, *, timeout_s: float) -> None:
        pass

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float) -> Any:
        raise AssertionError("not used")

    def validation_check(self, base_url: str) -> Check:
        self.urls.append(base_url)
        return Check("transport-checksum", self.passed, "slices vs sent",
                     coverage=1.0, level=VerificationLevel.ENGINE_CHECKSUM)

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_paused_validation_includes_the_transports_own_check() -> None:
    for passed in (True, False):
        tr = _CheckingTransport(passed)
        a = VllmAdapter(client(vllm()), tr)  # type: ignore[arg-type]
        a.stage(_source())
        v = a.validate(target(), live=False)
        assert v is not None and tr.urls == [BASE]
        assert [c.name for c in v.checks] == ["transport-checksum"]
        assert (v.problems(target()) == []) is passed


class _SendingCheckingTransport(_CheckingTransport):
    """Sends (nothing real) and can check; records the order of its calls."""

    def __init__(self, passed: bool | Exception) -> None:
        super().__init__(passed is True)
        self.outcome = passed
        self.events: list[str] = []
        self.release = threading.Event()

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float) -> Any:
        self.events.append(f"send {target_label}")
        return TransferEvidence(completed=True, mutation_started=True, backend=self.backend,
                                tensors=1, bytes=8, finish_label=target_label, elapsed_s=0.0)

    def validation_check(self, base_url: str) -> Check:
        self.events.append("check start")
        self.release.wait(10)
        self.events.append("check end")
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return super().validation_check(base_url)


def test_transport_check_starts_when_the_transfer_returns_and_the_validation_collects_it(
) -> None:
    e = vllm()
    tr = _SendingCheckingTransport(True)
    a = VllmAdapter(client(e), tr)  # type: ignore[arg-type]
    t = target()
    a.stage(_source())
    a.drain(PauseMode.WAIT)
    a.transfer(t)
    # The check runs beside the cache reset: the reset does not wait for it.
    a.reset_cache(CacheKind.PREFIX)
    deadline = time.monotonic() + 10
    while len(tr.events) < 2 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert tr.events == ["send rc-1", "check start"]
    # The paused state was read as the transfer returned, for this validation.
    while sent(e, Routes.IS_PAUSED) < 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sent(e, Routes.IS_PAUSED) == 1
    tr.release.set()
    v = a.validate(t, live=False)
    assert v is not None and v.paused is True
    assert sent(e, Routes.IS_PAUSED) == 1  # the validation took that read, not another
    (chk,) = v.checks
    assert chk.name == "transport-checksum" and chk.passed
    assert "alongside the cache reset" in chk.detail
    assert tr.events == ["send rc-1", "check start", "check end"] and len(tr.urls) == 1
    # Collected once: a second validation of the same target reads again.
    a.validate(t, live=False)
    assert len(tr.urls) == 2
    # An early check belongs to its target: another target's validation reads anew.
    a.transfer(t)
    other = target("rc-2")
    a.validate(other, live=False)
    assert len(tr.urls) == 4 and tr.events.count("check start") == 4
    # A failing or raising early check fails the validation as a late one would.
    for outcome, want in ((False, "check transport-checksum failed"),
                          (EngineUnavailable("rpc", "gone", mutation_started=False), None)):
        tr2 = _SendingCheckingTransport(outcome)
        tr2.release.set()
        b = VllmAdapter(client(vllm()), tr2)  # type: ignore[arg-type]
        b.stage(_source())
        b.transfer(t)
        if want is None:
            with pytest.raises(EngineUnavailable, match="gone"):
                b.validate(t, live=False)
        else:
            v3 = b.validate(t, live=False)
            assert v3 is not None and any(want in p for p in v3.problems(t))
        b.close()
    # Off: the check runs inside the validation, as before.
    tr3 = _SendingCheckingTransport(True)
    tr3.release.set()
    c = VllmAdapter(client(vllm()), tr3, early_transport_check=False)  # type: ignore[arg-type]
    c.stage(_source())
    c.transfer(t)
    assert tr3.events == ["send rc-1"]
    c.validate(t, live=False)
    assert tr3.events == ["send rc-1", "check start", "check end"]
    with pytest.raises(BadInput):
        VllmAdapter(client(vllm()), tr3, early_transport_check=1)  # type: ignore[arg-type]
    a.close()
    c.close()


class _Probes:
    def __init__(self, result: Any) -> None:
        self.result = result
        self.calls: list[tuple[VllmHTTP, UpdateTarget]] = []

    def run(self, http: VllmHTTP, target: UpdateTarget) -> Check:
        self.calls.append((http, target))
        return self.result  # type: ignore[no-any-return]


def test_live_validation_runs_the_probe_hook() -> None:
    a = VllmAdapter(client(vllm()))
    assert a.validate(target(), live=True) is None
    chk = Check("policy_probe", False, "max diff 3.1", max_abs_diff=3.1, tolerance=0.05,
                level=VerificationLevel.PROBE)
    probes = _Probes(chk)
    a2 = VllmAdapter(client(vllm()), probes=probes)
    t = target()
    v = a2.validate(t, live=True)
    assert v is not None and v.checks == (chk,) and v.paused is False
    assert probes.calls == [(a2.http, t)]
    assert "check policy_probe failed: max diff 3.1" in v.problems(t)
    # Probes staged with the update override the adapter's default.
    staged = _Probes(Check("policy_probe", True))
    a2.stage(_source(), probes=staged)
    v2 = a2.validate(t, live=True)
    assert v2 is not None and v2.checks[0].passed and len(probes.calls) == 1
    a2.stage(_source(), probes=_Probes("not a check"))
    with pytest.raises(EffectError, match="not a Check"):
        a2.validate(t, live=True)


def test_resume_confirms_and_fence_reports_its_failures() -> None:
    e = vllm()
    a = VllmAdapter(client(e))
    d = a.drain(PauseMode.WAIT)
    r = a.resume()
    assert d.paused and r.resumed and r.is_paused_after is False
    # vLLM's own answers ({"status": "paused"/"resumed"}, sent after its engine
    # core acted) are the evidence: no second round trip to /is_paused.
    assert sent(e, Routes.IS_PAUSED) == 0
    # An answer that does not say so is confirmed by asking, and believed.
    stuck = vllm(overrides={Routes.IS_PAUSED: answer(200, {"is_paused": True}),
                              Routes.RESUME: answer(200, {})})
    assert VllmAdapter(client(stuck)).resume().problems(None) == [
        "engine still reports paused after resume"]
    assert sent(stuck, Routes.IS_PAUSED) == 1
    unpaused = vllm(overrides={Routes.IS_PAUSED: answer(200, {"is_paused": False}),
                                 Routes.PAUSE: answer(200, {"status": "ok"})})
    assert VllmAdapter(client(unpaused)).drain(PauseMode.WAIT).problems(None) == [
        "engine does not report paused"]
    dead = VllmAdapter(client(vllm(overrides={Routes.PAUSE: raising(
        httpx.ConnectError("gone"))})))
    with pytest.raises(EngineUnreachable):  # #16: a fence that failed says so
        dead.fence()
    fenced = vllm()
    VllmAdapter(client(fenced)).fence()
    req = requests(fenced, Routes.PAUSE)[-1]
    assert req.url.params["mode"] == "abort"


# --------------------------------------------------------------------------- failure policy


def test_each_step_declares_once_whether_its_failures_may_have_moved_weights() -> None:
    """Every route failing with a 5xx: what each step raises carries its declaration."""
    from rolloutcore.engine.port import STEP_MAY_MUTATE

    def down(req: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="down")

    def broken(*, health: bool = True) -> FakeVllm:
        # /openapi.json answers (the routes are known), (/health,) everything else is down.
        served = vllm().paths - {Routes.OPENAPI}
        return vllm(overrides={r: down for r in served if r != Routes.HEALTH or not health})

    assert STEP_MAY_MUTATE[Step.DRAIN] is False and STEP_MAY_MUTATE[Step.TRANSFER] is True
    t = target()
    calls: list[tuple[Step, Callable[[VllmAdapter], object]]] = [
        (Step.BOOTSTRAP, lambda a: a.bootstrap()),
        (Step.DRAIN, lambda a: a.drain(PauseMode.WAIT)),
        (Step.INVALIDATE, lambda a: a.reset_cache(CacheKind.PREFIX)),
        (Step.VALIDATE, lambda a: a.validate(t, live=False)),
        (Step.RESUME, lambda a: a.resume()),
    ]
    for step, call in calls:
        a = VllmAdapter(client(broken()), engine_epoch="e")
        with pytest.raises(EngineUnavailable, match="HTTP 503") as ei:
            call(a)
        assert ei.value.mutation_started is STEP_MAY_MUTATE[step], step
    # Between updates a dead engine is evidence, not an exception.
    ev = VllmAdapter(client(broken(health=False))).observe_health(timeout_s=1)
    assert not ev.healthy and ev.problems(None)


class _AbortableTransport(_SendingCheckingTransport):
    def __init__(self, send_error: BaseException | None = None) -> None:
        super().__init__(True)
        self.aborted = 0
        self.send_error = send_error

    def send(self, base_url: str, target_label: str, source: Any, *,
             timeout_s: float) -> Any:
        if self.send_error is not None:
            raise self.send_error
        return super().send(base_url, target_label, source, timeout_s=timeout_s)

    def abort(self) -> None:
        self.aborted += 1


def test_a_transfer_failure_keeps_the_transports_own_classification() -> None:
    for err, started in ((TransferError("transfer", "refused at start", mutation_started=False),
                          False),
                         (TransferError("transfer", "cut mid-way", mutation_started=True), True),
                         (RuntimeError("collective broke"), True)):
        a = VllmAdapter(client(vllm()), _AbortableTransport(err))  # type: ignore[arg-type]
        a.stage(_source())
        with pytest.raises(TransferError) as ei:
            a.transfer(target())
        assert ei.value.mutation_started is started, err


def test_cancel_of_the_transfer_step_aborts_the_transport() -> None:
    tr = _AbortableTransport()
    a = VllmAdapter(client(vllm()), tr)  # type: ignore[arg-type]
    a.cancel(Step.VALIDATE)
    assert tr.aborted == 0
    a.cancel(Step.TRANSFER)
    assert tr.aborted == 1
    a.close()


def test_the_adapter_is_the_port_and_observes_health() -> None:
    from rolloutcore.control.port import HealthObserver, LifecycleAdapter

    a = VllmAdapter(client(vllm()))
    assert isinstance(a, LifecycleAdapter) and isinstance(a, HealthObserver)


def test_engine_recompute_pause_is_refused_where_keep_ignores_clear_cache() -> None:
    """vLLM 0.26's keep ignores clear_cache: an engine_recompute drain there is refused
    before the pause (nothing sent, no mutation); on 0.32 it asks for clear_cache=true and
    its evidence says the caches were cleared."""
    old = vllm(without=V026)
    with pytest.raises(EffectError, match="ignores clear_cache") as ei:
        VllmAdapter(client(old)).drain(PauseMode.KEEP, clear_cache=True)
    assert ei.value.mutation_started is False and sent(old, Routes.PAUSE) == 0
    new = vllm()
    ev = VllmAdapter(client(new)).drain(PauseMode.KEEP, clear_cache=True)
    assert ev.cleared and ev.mode is PauseMode.KEEP
    (req,) = requests(new, Routes.PAUSE)
    assert req.url.params["clear_cache"] == "true" and req.url.params["mode"] == "keep"
    plain = vllm()
    assert not VllmAdapter(client(plain)).drain(PauseMode.KEEP).cleared
    (req,) = requests(plain, Routes.PAUSE)
    assert req.url.params["clear_cache"] == "false"


@pytest.mark.parametrize("form", ["0.32", "0.26"])
def test_top_logprobs_reads_both_vllm_forms_of_a_logprob_entry(form: str) -> None:
    """vLLM 0.32 names each entry's ``token_id``; 0.26 with ``--skip-tokenizer-init`` has
    none and writes the token as ``"token_id:N"`` (seen on the H200, 2026-12-05)."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        return ({"token_id": tid, "logprob": lp} if form == "0.32" else
                {"token": f"token_id:{tid}", "logprob": lp, "bytes": None})

    content = [{**entry(7, -0.1), "top_logprobs": [entry(7, -0.1), entry(9, -2.5)]},
               {**entry(3, -0.7), "top_logprobs": [entry(3, -0.7)]}]

    e = vllm(overrides={Routes.GENERATE: answer(200, {"choices": [
        {"logprobs": {"content": content}}]})})
    with client(e) as h:
        got = h.top_logprobs([1, 2], max_tokens=2, top=2, model="m")
    assert got == [(7, {7: -0.1, 9: -2.5}), (3, {3: -0.7})]


@pytest.mark.parametrize("bad", [{"token": "hello", "logprob": -1.0}, {"logprob": -1.0},
                                 {"token_id": "7", "logprob": -1.0},
                                 {"token_id": True, "logprob": -1.0}])
def test_top_logprobs_refuses_an_entry_without_a_token_id(bad: dict[str, Any]) -> None:
    e = vllm(overrides={Routes.GENERATE: answer(200, {"choices": [
        {"logprobs": {"content": [bad]}}]})})
    with client(e) as h, pytest.raises(EffectError, match="unexpected generate answer"):
        h.top_logprobs([1, 2], max_tokens=1, top=1, model="m")
