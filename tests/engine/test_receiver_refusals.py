"""A real vLLM (CPU, ``rolloutcore_gloo``) refuses forged receiver input and keeps serving.

Anyone who reaches the engine's HTTP port can post an ``init_info`` or an
``update_info``. Before this check the engine joined any rendezvous address
for up to a day and allocated any shape it was sent. Here each forged body is
refused with an error that says why, before the engine connects anywhere
(a listener stands where the forged address points and must see no
connection) or opens the reload; afterwards the engine still serves the same
greedy outputs under the same label, and a real update still goes through.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from enginetools import EngineFactory, TinyModels
from rolloutcore.engine.process import ManagedEngine, vllm_available
from rolloutcore.transports import GlooTransport
from rolloutcore.transports.gloo import GlooUpdateInfo
from rolloutcore.transports.net import local_address_towards
from rolloutcore.transports.source import WeightSource

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not vllm_available(), reason="vLLM is not installed"),
]

PROMPTS = [list(range(10, 40)), [5, 6, 7]]


def generate(eng: ManagedEngine) -> list[tuple[list[int], list[float]]]:
    out = []
    for ids in PROMPTS:
        r = httpx.post(f"{eng.base_url}/inference/v1/generate", timeout=120, json={
            "model": eng.model_name, "token_ids": ids,
            "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0,
                                "ignore_eos": True}})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append((c["token_ids"], [x["logprob"] for x in c["logprobs"]["content"]]))
    return out


def post(eng: ManagedEngine, path: str, body: Any = None) -> httpx.Response:
    return httpx.post(f"{eng.base_url}{path}", json=body, timeout=60)


def label(eng: ManagedEngine) -> str:
    return str(httpx.get(f"{eng.base_url}/weight_info", timeout=30).json()["weight_version"])


@pytest.fixture(scope="module")
def eng(engine_factory: EngineFactory, tiny_models: TinyModels) -> Iterator[ManagedEngine]:
    e = engine_factory(tiny_models.A)
    try:
        yield e
    finally:
        engine_factory.stop(e)


class Listener:
    """A TCP listener where a forged rendezvous points: counts connections made to it."""

    def __init__(self, host: str) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(8)
        self.sock.settimeout(0.5)
        self.host, self.port = host, int(self.sock.getsockname()[1])

    def connections(self) -> int:
        n = 0
        while True:
            try:
                c, _ = self.sock.accept()
            except (TimeoutError, OSError):
                return n
            c.close()
            n += 1

    def close(self) -> None:
        self.sock.close()


def _init(addr: str, port: int, **kw: Any) -> dict[str, Any]:
    return {"init_info": {"master_address": addr, "master_port": port, "rank_offset": 1,
                          "world_size": 2, "timeout_s": 30, **kw}}


def test_forged_init_info_is_refused_before_connecting(eng: ManagedEngine) -> None:
    before, lab = generate(eng), label(eng)
    cases: list[tuple[str, dict[str, Any], str]] = []
    lan = local_address_towards("192.0.2.1")  # this host's routed address, if it has one
    lan_listener = Listener(lan) if not lan.startswith("127.") else None
    loop = Listener("127.0.0.1")
    try:
        if lan_listener is not None:
            cases.append(("a non-loopback address", _init(lan, lan_listener.port),
                          "refused: this engine joins a rendezvous only on loopback"))
        cases += [
            ("a hostname", _init("localhost.localdomain", loop.port), "give an IP address"),
            ("a day-long timeout", _init("127.0.0.1", loop.port, timeout_s=86400),
             "exceeds this engine's cap of 300"),
            ("a huge world", _init("127.0.0.1", loop.port, world_size=1 << 20),
             "world_size 1048576 exceeds 1024"),
        ]
        for what, body, msg in cases:
            r = post(eng, "/init_weight_transfer_engine", body)
            assert r.status_code >= 400, what
            assert msg in r.text, (what, r.text[:500])
        assert loop.connections() == 0  # the engine connected nowhere
        if lan_listener is not None:
            assert lan_listener.connections() == 0
    finally:
        loop.close()
        if lan_listener is not None:
            lan_listener.close()
    assert generate(eng) == before and label(eng) == lab


def test_forged_update_info_is_refused_before_the_reload_opens(
        eng: ManagedEngine, tiny_models: TinyModels) -> None:
    src = WeightSource.from_checkpoint(tiny_models.B)
    tr = GlooTransport(op_timeout_s=60)
    try:
        tr.connect(eng.base_url, timeout_s=120)  # a real group: rounds could be received
        before, lab = generate(eng), label(eng)
        info = GlooUpdateInfo.of(src)

        def body(**over: Any) -> dict[str, Any]:
            d = {"names": list(info.names), "dtype_names": list(info.dtype_names),
                 "shapes": [list(s) for s in info.shapes]}
            for i, name in enumerate(d["names"]):
                if name in over:
                    dt, shape = over[name]
                    d["dtype_names"][i], d["shapes"][i] = dt, shape
            extra = over.get("__extra__")
            if extra is not None:
                d["names"].append(extra[0])
                d["dtype_names"].append(extra[1])
                d["shapes"].append(extra[2])
            return {"update_info": d}

        emb = "model.embed_tokens.weight"
        norm = "model.layers.0.input_layernorm.weight"
        forged = [
            ("an unknown name", body(__extra__=("model.layers.0.self_attn.o_proj.bias",
                                                "bfloat16", [128])),
             "not a parameter of this model"),
            ("a shape far beyond the parameter", body(**{emb: ("bfloat16", [10**7, 128])}),
             "does not fit model.embed_tokens.weight"),
            ("a dtype that does not convert", body(**{norm: ("int64", [128])}),
             "does not convert exactly"),
            ("the fused parameter and its shard", body(__extra__=(
                "model.layers.0.self_attn.qkv_proj.weight", "bfloat16", [256, 128])),
             "both land on model.layers.0.self_attn.qkv_proj.weight"),
        ]
        assert post(eng, "/pause?mode=wait&clear_cache=false").status_code == 200
        try:
            for what, b, msg in forged:
                assert post(eng, "/start_weight_update").status_code == 200, what
                r = post(eng, "/update_weights", b)
                assert r.status_code >= 400, what
                assert msg in r.text, (what, r.text[:500])
        finally:
            assert post(eng, "/resume").status_code == 200
        # Nothing was opened or written: the same outputs, the same label, serving.
        assert generate(eng) == before and label(eng) == lab

        # The group was never used by those rounds: a real update still goes through.
        assert post(eng, "/pause?mode=wait&clear_cache=false").status_code == 200
        try:
            ev = tr.send(eng.base_url, "rc-after-forgeries", src, timeout_s=120)
            assert post(eng, "/reset_prefix_cache").status_code == 200
        finally:
            post(eng, "/resume")
        assert ev.completed and label(eng) == "rc-after-forgeries"
        assert generate(eng) != before
    finally:
        tr.close()
